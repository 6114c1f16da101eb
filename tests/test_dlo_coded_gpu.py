"""DLO AllGather with coded shards over NCCL, one process per GPU (2 or more GPUs).

Run on a multi-GPU machine: ``python3 -m pytest -q -m multigpu tests/test_dlo_coded_gpu.py``
(``WEIGHTSTREAM_TEST_GPUS=N``: the first N GPUs). Tiny Flux in bf16 (tensors large
enough to code), bit-exact against the resident model on each GPU: eager, CUDA
graphs, rank-local coded, update_weights with a re-shard, the event log's gather lane,
weight_codec="auto" (the ranks plan together; eager and graphs).
"""
from __future__ import annotations

import os

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

from test_distributed import Checks, get, run_ranks  # noqa: E402
from test_distributed_gpu import gpu_world  # noqa: E402
from test_dlo_coded import _coded_cfg, _model, _rank_equal, _rank_weights  # noqa: E402
from weightstream.offload.dlo.topology import ParallelConfig  # noqa: E402
from weightstream.offload.dlo.control import merge_shards  # noqa: E402

pytestmark = pytest.mark.multigpu


def _events(parallel, rank, device):
    from weightstream import OffloadedTransformer

    model, x = _model("flux", seed_inputs=1 + rank, device=device)
    om = OffloadedTransformer(model, _coded_cfg(record_events=True), device=device, parallel=parallel)
    with torch.no_grad():
        for _ in range(2):
            om(**x)
    ev = om.events()
    lanes = {lane: sum(1 for e in ev if e["lane"] == lane) for lane in ("copy", "gather", "compute")}
    stats = om.stats()
    om.disable()
    return dict(lanes=lanes, pinned=stats["pinned"], blocks=stats["blocks_streamed"])


def _graph_counts(parallel, rank, device):
    from weightstream import OffloadedTransformer

    model, x = _model("flux", seed_inputs=1 + rank, device=device)
    om = OffloadedTransformer(model, _coded_cfg(cuda_graphs="on"), device=device, parallel=parallel)
    with torch.no_grad():
        for _ in range(4):
            om(**x)
    counts = dict(om.graphs.counts)
    om.disable()
    return counts


def scenario_gpu(rank, world):
    device = f"cuda:{rank}"
    dp = ParallelConfig(dp=world)
    c = Checks()
    c.run("eager", _rank_equal, "flux", dp, rank, device=device, forwards=3)
    c.run("toy", _rank_equal, "toy", dp, rank, device=device, forwards=3)
    c.run("graphs", _rank_equal, "flux", dp, rank, device=device, forwards=6, cuda_graphs="on")
    c.run("graphs_k2", _rank_equal, "flux", dp, rank, device=device, forwards=6, cuda_graphs="on", codec="exp-k2")
    c.run("graphs_kp", _rank_equal, "flux", dp, rank, device=device, forwards=6, cuda_graphs="on", codec="exp-kp")
    c.run("graph_counts", _graph_counts, dp, rank, device)
    c.run("rank_local", _rank_equal, "flux", dp, rank, device=device, forwards=3, transfer="rank-local")
    c.run("weights", _rank_weights, dp, rank, device=device)
    c.run("events", _events, dp, rank, device)
    c.run("auto", _rank_equal, "flux", dp, rank, device=device, forwards=4, codec="auto")
    c.run("auto_graphs", _rank_equal, "flux", dp, rank, device=device, forwards=6, codec="auto", cuda_graphs="on")
    return c.report


@pytest.fixture(scope="module")
def gpus(tmp_path_factory):
    return run_ranks(gpu_world(), tmp_path_factory.mktemp("dlo_coded_gpu"), "test_dlo_coded_gpu:scenario_gpu",
                     backend="nccl", timeout=420 + 30 * gpu_world())


@pytest.mark.parametrize("name", ["eager", "toy", "graphs", "graphs_k2", "graphs_kp"])
def test_nccl_coded_allgather_bit_exact(gpus, name):
    reps = get(gpus, name)
    if name != "toy":  # "graphs_k2" / "graphs_kp": exp-k2 / exp-kp tensors gathered and decoded
        assert all((2 in rep["stats"]["versions"]) == (name == "graphs_k2") for rep in reps)
        assert all((3 in rep["stats"]["versions"]) == (name == "graphs_kp") for rep in reps)
    for r, rep in enumerate(reps):
        assert all(rep["equal"]) and rep["restored"] and rep["back"], (r, rep["equal"])
        s = rep["stats"]
        assert s["source"] == "dlo-allgather-coded" and s["pinned"], s
        assert s["shard_bytes"] * len(reps) >= s["coded_bytes"] and s["h2d_bytes_per_step"] == s["shard_bytes"]
    if name != "toy":
        assert reps[0]["stats"]["bits_per_weight"] < 14 and reps[0]["stats"]["coded_bytes"] < reps[0]["stats"]["raw_bytes"]
    merged = merge_shards([rep["local"] for rep in reps])
    assert all(torch.equal(merged[k], v) for k, v in reps[0]["ref"].items())


def test_nccl_coded_allgather_replays_graphs(gpus):
    for counts in get(gpus, "graph_counts"):
        assert counts.get("replay", 0) >= 1 and counts.get("eager-fallback", 0) == 0, counts


def test_nccl_coded_rank_local(gpus):
    for rep in get(gpus, "rank_local"):
        assert all(rep["equal"]) and rep["restored"] and rep["back"]
        assert rep["stats"]["source"] == "coded-exp-k"


def test_nccl_coded_update_weights_reshards(gpus):
    for rep in get(gpus, "weights"):
        assert rep["equal"] == [True, True] and rep["gathered"] and rep["resharded"], rep
        assert "gather_state_dict" in rep["sd_error"]


def test_nccl_coded_event_log_has_gathers(gpus):
    for rep in get(gpus, "events"):
        assert rep["lanes"]["gather"] == rep["lanes"]["copy"] > 0 and rep["lanes"]["compute"] > 0, rep
        assert rep["pinned"]


@pytest.mark.parametrize("name", ["auto", "auto_graphs"])
def test_nccl_auto_codec_plans_alike_on_every_rank(gpus, name):
    """weight_codec='auto' over NCCL: the ranks join their measurements and code the same blocks
    (the same coded shares on every rank); eager and with CUDA graphs captured after the plan."""
    reps = get(gpus, name)
    for r, rep in enumerate(reps):
        assert all(rep["equal"]) and rep["restored"] and rep["back"], (r, rep["equal"])
        assert rep["plan"] is not None and rep["plan"]["h2d_gbps"] > 0, rep["plan"]
    assert len({tuple(rep["plan"]["coded_blocks"]) for rep in reps}) == 1
    assert len({rep["stats"]["shard_bytes"] for rep in reps}) == 1
    assert all(rep["stats"]["coded_blocks"] == len(rep["plan"]["coded_blocks"]) for rep in reps)
    merged = merge_shards([rep["local"] for rep in reps])
    assert all(torch.equal(merged[k], v) for k, v in reps[0]["ref"].items())
