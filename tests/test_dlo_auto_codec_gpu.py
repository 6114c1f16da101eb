"""weight_codec="auto" under DLO AllGather on one GPU: the real coded shard source and its planner
over a fake group of one (the gather a device copy on the communication stream).

Runs the CUDA paths two ranks cannot add to: the first step measured from CUDA events, the
sampled decodes timed from a CUDA graph, the blocks coded between steps (device synchronised,
coded buffers allocated), raw and coded loads in one ring, and CUDA graphs captured after the
plan. Then two real ranks on the one GPU over gloo (its gathers of CUDA tensors go through the
host: slow, the same bytes), so the ranks' joined plan and the coded gathers run on CUDA without
a second GPU. The NCCL runs are in tests/test_dlo_coded_gpu.py (``auto`` cases, 2 GPUs).
"""
from __future__ import annotations

import copy

import pytest
import torch

from test_distributed import Checks, get, run_ranks
from test_dlo_coded import FAST_DECODE, FakeCodedGather, _first, _model, _rank_auto, _rank_equal
from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.offload.distributed import build_streamed
from weightstream.offload.dlo.topology import DLOPlan, ParallelConfig

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)  # as OffloadedTransformer resolves it: graphs compare input devices with it


def _wrap(model, h2d_gbps=None, **kw):
    cfg = OffloadConfig.layerwise(weight_codec="auto", progress=False, **kw)
    dlo = DLOPlan("allgather", "allgather", None, 1, 0, "dp", "fake")
    sb = build_streamed(model, cfg, DEV, None, ParallelConfig(), dlo=dlo, source_cls=FakeCodedGather)
    om = OffloadedTransformer(sb.module, cfg, device=DEV, streamed=sb)
    if h2d_gbps is not None:  # a slow link: the plan codes every block (decode rates still timed)
        om._streamed.codec_planner.h2d_gbps = h2d_gbps
    return om


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_measured_plan_on_cuda_is_bit_exact(graphs):
    """Nothing given: the step, the link and the decodes are measured on the device; whatever the
    plan codes, every output is bit for bit and the weights come back."""
    model, x = _model("flux", device="cuda")
    ref = copy.deepcopy(model).to(DEV)
    om = _wrap(model, cuda_graphs=graphs)
    with torch.no_grad():
        want = _first(ref(**x))
        outs = [_first(om(**x)) for _ in range(5)]
    assert all(torch.equal(o, want) for o in outs)
    plan = om.stats()["codec_plan"]
    assert plan["h2d_gbps"] > 0 and all(g > 0 for g in plan["decode_gbps"].values()), plan
    assert om.stats()["coded_blocks"] == len(plan["coded_blocks"])
    if graphs == "on":
        assert om.graphs.counts["replay"] >= 1, om.graphs.counts
    plain = om.disable()
    assert all(torch.equal(v.cpu(), ref.state_dict()[k].cpu()) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_slow_link_codes_every_block_then_replays_coded(graphs):
    model, x = _model("flux", device="cuda")
    ref = copy.deepcopy(model).to(DEV)
    om = _wrap(model, h2d_gbps=1e-6, cuda_graphs=graphs)
    src = om._streamed.source
    raw_shards = list(src.store.shard_bytes)
    with torch.no_grad():
        want = _first(ref(**x))
        outs = [_first(om(**x)) for _ in range(5)]
    assert all(torch.equal(o, want) for o in outs)
    assert not any(src.raw) and src.codec in ("exp-k", "exp-k2")
    assert all(c < r for c, r in zip(src.store.shard_bytes, raw_shards))
    assert src.stage.buffer_bytes() > 0 and src.store.pinned
    if graphs == "on":
        assert om.graphs.counts["replay"] >= 1, om.graphs.counts
    plain = om.disable()
    assert all(torch.equal(v.cpu(), ref.state_dict()[k].cpu()) for k, v in plain.state_dict().items())


def test_mixed_raw_and_coded_loads_on_cuda():
    """Some blocks coded, others raw, in one ring on the device (eager, then graphs captured over
    both kinds of load): bit for bit."""
    for graphs in ("off", "on"):
        model, x = _model("flux", device="cuda")
        ref = copy.deepcopy(model).to(DEV)
        om = _wrap(model, cuda_graphs=graphs)
        om._streamed.codec_planner.remove()
        src = om._streamed.source
        with torch.no_grad():
            want = _first(ref(**x))
            assert torch.equal(_first(om(**x)), want)
            src.code_blocks([1, 4], "exp-k")
            assert [not r for r in src.raw] == [False, True, False, False, True]
            assert all(torch.equal(_first(om(**x)), want) for _ in range(4)), graphs
        if graphs == "on":
            assert om.graphs.counts["replay"] >= 1, om.graphs.counts
        plain = om.disable()
        assert all(torch.equal(v.cpu(), ref.state_dict()[k].cpu()) for k, v in plain.state_dict().items())
        del plain, om


def test_decode_rates_given_skip_the_timing():
    model, x = _model("flux", device="cuda")
    om = _wrap(model, h2d_gbps=1e-6)
    om._streamed.codec_planner.decode_gbps = FAST_DECODE
    with torch.no_grad():
        for _ in range(2):
            om(**x)
    plan = om.stats()["codec_plan"]
    assert plan["decode_gbps"] == FAST_DECODE and plan["plan_parts_s"]["decode_s"] < 5.0
    om.disable()


# --------------------------------------------------------------------------- two ranks on one GPU (gloo)
def scenario_one_gpu(rank, world):
    dp = ParallelConfig.data_parallel()
    c = Checks()
    c.run("auto", _rank_equal, "flux", dp, rank, device="cuda:0", forwards=4, codec="auto")
    c.run("coded", _rank_equal, "flux", dp, rank, device="cuda:0", forwards=3)
    c.run("auto_forced", _rank_auto, dp, rank, device="cuda:0")  # a slow link on rank 1: both code every block
    return c.report


@pytest.fixture(scope="module")
def two_on_one(tmp_path_factory):
    return run_ranks(2, tmp_path_factory.mktemp("dlo_auto_one_gpu"), "test_dlo_auto_codec_gpu:scenario_one_gpu",
                     backend="gloo", timeout=300, cuda=True)


@pytest.mark.parametrize("name", ["auto", "coded"])
def test_two_ranks_on_one_gpu_plan_alike_and_stay_exact(two_on_one, name):
    reps = get(two_on_one, name)
    for r, rep in enumerate(reps):
        assert all(rep["equal"]) and rep["restored"] and rep["back"], (r, rep["equal"])
        assert rep["stats"]["source"] == "dlo-allgather-coded" and rep["stats"]["transfer"] == "allgather"
    assert len({rep["stats"]["shard_bytes"] for rep in reps}) == 1
    if name == "auto":
        assert all(rep["plan"] is not None and rep["plan"]["h2d_gbps"] > 0 for rep in reps)
        assert len({tuple(rep["plan"]["coded_blocks"]) for rep in reps}) == 1
        assert all(rep["stats"]["coded_blocks"] == len(rep["plan"]["coded_blocks"]) for rep in reps)


def test_two_ranks_on_one_gpu_join_their_measurements(two_on_one):
    """Rank 0 measures a fast link, rank 1 a slow one (set as the planner's inputs): both code every
    block, from the first step on; the coded shares merge back bit for bit."""
    from weightstream.offload.dlo.control import merge_shards

    reps = get(two_on_one, "auto_forced")
    for r in reps:
        assert r["errors"] == [None] * 3 and r["equal"] == [True] * 3 and r["usable"] and r["back"], r["errors"]
        assert r["plans"][0] == list(range(5)) and not any(r["raw"]) and r["codec"] == "exp-k2"
    assert reps[0]["shards"] == reps[1]["shards"] and reps[0]["ncoll"] == reps[1]["ncoll"]
    merged = merge_shards([r["local"] for r in reps])
    assert all(torch.equal(merged[k], v) for k, v in reps[0]["ref"].items())
