"""DLO over NCCL on every GPU of the machine (one process per GPU; 2, 4 or 8):
tiny Flux in bf16 and fp32, AllGather and rank-local, bit-exact against the
resident model on each GPU; AllGather in CUDA graphs; the failure of one rank
(the last) surfaces as an error on every other rank within dlo_timeout_s.

Run on a multi-GPU machine: ``python3 -m pytest -q -m multigpu tests/test_distributed_gpu.py``.
The world size is ``torch.cuda.device_count()``; ``WEIGHTSTREAM_TEST_GPUS=N``
uses the first N GPUs only (e.g. 2 or 4 on an 8-GPU machine). The ranks come
from the launcher of tests/test_distributed.py.
"""
from __future__ import annotations

import os

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

from test_distributed import Checks, check_equal, check_waves, get, run_ranks  # noqa: E402
from test_trust_dlo import SLACK_S, TIMEOUT_S, check_block_failure  # noqa: E402
from weightstream.offload.dlo.topology import ParallelConfig  # noqa: E402

pytestmark = pytest.mark.multigpu

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CASES = [(model, transfer, dt) for model in ("flux",) for transfer in ("allgather", "rank-local") for dt in DTYPES]
CASES += [("toy", "allgather", "fp32"), ("toy-narrow", "allgather", "fp32")]  # narrow: at 4 / 8 GPUs the last
# ranks' shares of some blocks are padding only


def _name(model, transfer, dt):
    return f"{model}_{transfer}_{dt}"


def gpu_world() -> int:
    """Ranks of a launch: every visible GPU, or the first WEIGHTSTREAM_TEST_GPUS of them."""
    count = torch.cuda.device_count()
    raw = os.environ.get("WEIGHTSTREAM_TEST_GPUS")
    if raw is None:
        return count
    if not raw.isdigit() or not 2 <= int(raw) <= count:
        raise ValueError(f"WEIGHTSTREAM_TEST_GPUS={raw!r}: allowed an integer from 2 to the {count} GPUs torch sees")
    return int(raw)


def scenario_gpu(rank, world):
    """Every multi-GPU check, in one launch (runs inside each rank)."""
    device = f"cuda:{rank}"
    dp = ParallelConfig(dp=world)
    every, last = tuple(range(world)), world - 1
    c = Checks()
    for model, transfer, dt in CASES:
        c.run(_name(model, transfer, dt), check_equal, model, dp, transfer=transfer, rank=rank, device=device,
              dtype=DTYPES[dt], forwards=3)
    c.run("flux_allgather_bf16_events", _events, dp, rank, device)
    c.run("waves", check_waves, dp, rank, world)
    c.run("weights", _weights_gpu, dp, rank, device)
    c.run("graphs", _graphs_gpu, dp, rank, device)
    # DLO trust (tests/test_trust_dlo.py on NCCL)
    c.run("same_exception", check_block_failure, dp, rank, transfer="allgather", failing=every, device=device)
    c.run("one_rank_fails", check_block_failure, dp, rank, transfer="allgather", failing=(last,), device=device)
    c.run("capture_fails_on_one_rank", _capture_fails_on_one_rank, dp, rank, device, last)
    return c.report


def scenario_peer_stays_alive(rank, world):
    """A launch of its own: it leaves an NCCL collective stuck, and NCCL's watchdog
    later takes the process down; the report is written before that."""
    c = Checks()
    c.run("peer_stays_alive", _peer_stays_alive, rank, world, f"cuda:{rank}")
    return c.report


def _capture_fails_on_one_rank(parallel, rank, device, bad):
    """A capture that fails on rank ``bad`` only: every rank falls back to eager (one agreement),
    outputs stay bit-exact, DLO stays usable."""
    import copy

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import flux_inputs, tiny_flux

    model = tiny_flux(dtype=torch.bfloat16)
    inputs = flux_inputs(model, device=device, seed=1 + rank)
    ref_model = copy.deepcopy(model).to(device)
    with torch.no_grad():
        ref = ref_model(**inputs)[0]
    cfg = OffloadConfig.layerwise(weight_transfer="allgather", cuda_graphs="on", weight_codec="none", progress=False,
                                  dlo_timeout_s=30.0)
    om = OffloadedTransformer(model, cfg, device=device, parallel=parallel)

    def fail_in_capture(module, args):
        if rank == bad and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"injected capture failure on rank {bad}")

    target = model.single_transformer_blocks[1]
    handle = target.register_forward_pre_hook(fail_in_capture)
    with torch.no_grad():
        equal = [torch.equal(om(**inputs)[0], ref) for _ in range(6)]
    handle.remove()
    counts, usable = dict(om.graphs.counts), om._streamed.usable
    om.disable()
    return dict(equal=equal, counts=counts, usable=usable)


def _peer_stays_alive(rank, world, device):
    """The last rank skips a forward but stays alive: every other rank's forward raises
    within dlo_timeout_s."""
    import datetime
    import time

    import torch.distributed as dist

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import ToyDiT, toy_inputs

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=120))
    parallel = ParallelConfig(dp=world, dp_group=group)
    model, inputs = ToyDiT(), toy_inputs(seed=1 + rank, device=device)
    cfg = OffloadConfig.layerwise(weight_codec="none", progress=False, dlo_timeout_s=TIMEOUT_S)
    om = OffloadedTransformer(model, cfg, device=device, parallel=parallel)
    with torch.no_grad():
        om(**inputs)
    out = {}
    if rank != world - 1:
        t0 = time.monotonic()
        try:
            with torch.no_grad():
                om(**inputs)
            out["error"] = None
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["elapsed"] = time.monotonic() - t0
    else:
        time.sleep(TIMEOUT_S + 5.0)
    # no local_state_dict() here: with a gather stuck on the device a D2H read may wait
    # for it until the watchdog ends the process (covered on gloo: test_trust_dlo.py)
    return out


def _graphs_gpu(parallel, rank, device):
    """AllGather captured in CUDA graphs (H2D, NCCL gather, compute) equals eager and resident."""
    import copy

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import flux_inputs, tiny_flux

    model = tiny_flux(dtype=torch.bfloat16)
    inputs = flux_inputs(model, device=device, seed=1 + rank)
    ref_model = copy.deepcopy(model).to(device)
    with torch.no_grad():
        ref = ref_model(**inputs)[0]
    cfg = OffloadConfig.layerwise(weight_transfer="allgather", cuda_graphs="on", weight_codec="none", progress=False)
    om = OffloadedTransformer(model, cfg, device=device, parallel=parallel)
    with torch.no_grad():
        equal = [torch.equal(om(**inputs)[0], ref) for _ in range(6)]
    counts = dict(om.graphs.counts)
    om.disable()
    return dict(equal=equal, counts=counts)


def _events(parallel, rank, device):
    """The AllGather event log has a copy and a gather interval per streamed block and step."""
    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import flux_inputs, tiny_flux

    model = tiny_flux(dtype=torch.bfloat16)
    inputs = flux_inputs(model, device=device, seed=1 + rank)
    om = OffloadedTransformer(model, OffloadConfig.layerwise(record_events=True, weight_codec="none", progress=False), device=device,
                              parallel=parallel)
    with torch.no_grad():
        for _ in range(2):
            om(**inputs)
    ev = om.events()
    lanes = {lane: sum(1 for e in ev if e["lane"] == lane) for lane in ("copy", "gather", "compute")}
    ordered = all(e["end_ms"] >= e["start_ms"] for e in ev)
    stats = om.stats()
    om.disable()
    return dict(lanes=lanes, ordered=ordered, pinned=stats["pinned"], pinned_gb=stats["pinned_host_gb_per_rank"],
                host_bytes=stats["host_bytes"], blocks=stats["blocks_streamed"])


def _weights_gpu(parallel, rank, device):
    """update_weights re-gathers the primed slots; gather_state_dict returns the new weights."""
    import copy

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import ToyDiT, toy_inputs

    model, inputs = ToyDiT(), toy_inputs(seed=1 + rank, device=device)
    ref_model = copy.deepcopy(model).to(device)
    om = OffloadedTransformer(model, OffloadConfig.layerwise(weight_codec="none", progress=False), device=device,
                              parallel=parallel)
    with torch.no_grad():
        om(**inputs)
    g = torch.Generator().manual_seed(7)
    new = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in ref_model.state_dict().items()}
    om.update_weights(new)
    ref_model.load_state_dict(new)
    with torch.no_grad():
        equal = [torch.equal(om(**inputs), ref_model(**inputs)) for _ in range(2)]
    full = om._streamed.gather_state_dict()
    om.disable()
    return dict(equal=equal, gathered_ok=all(torch.equal(full[k], new[k]) for k in new))


@pytest.fixture(scope="module")
def gpus(tmp_path_factory):
    """One launch over every GPU (gpu_world())."""
    return run_ranks(gpu_world(), tmp_path_factory.mktemp("dlo_gpu"), "test_distributed_gpu:scenario_gpu",
                     backend="nccl", timeout=420 + 30 * gpu_world())


@pytest.mark.parametrize("model,transfer,dt", CASES)
def test_nccl_bit_exact(gpus, model, transfer, dt):
    name = _name(model, transfer, dt)
    reps = get(gpus, name)
    world = len(reps)
    assert world == gpu_world()
    for r, rep in enumerate(reps):
        assert all(rep["equal"]), f"rank {r} {name}: outputs differ from the resident model: {rep['equal']}"
        assert rep["restored"] and rep["weights_back"], f"rank {r} {name}: disable() did not restore"
        st = rep["stats"]
        assert st["transfer"] == transfer
        if transfer == "allgather":
            assert st["shard_group_size"] == world and st["shard_rank"] == r
            assert st["shard_bytes"] <= st["streamed_bytes_per_step"] / world + len(rep["layouts"]) * 512


def test_nccl_event_log_and_pinned_shards(gpus):
    for rep in get(gpus, "flux_allgather_bf16_events"):
        n = rep["blocks"]
        assert rep["lanes"]["compute"] == 2 * n
        # every step's blocks were copied and gathered (plus the prefetch of the next step's first two)
        assert rep["lanes"]["copy"] == rep["lanes"]["gather"] >= 2 * n
        assert rep["ordered"]
        assert rep["pinned"] and rep["pinned_gb"] * 1e9 <= rep["host_bytes"]


def test_nccl_request_waves(gpus):
    reps = get(gpus, "waves")
    assert all(rep == reps[0] for rep in reps)
    assert reps[0]["agree"] == ("ok", 4)
    assert reps[0]["steps_differ"][0] == "ValueError"


def test_nccl_allgather_in_cuda_graphs(gpus):
    for rep in get(gpus, "graphs"):
        assert all(rep["equal"]), rep
        assert rep["counts"]["capture"] >= 1 and rep["counts"]["replay"] >= 2, rep["counts"]


def test_nccl_update_weights(gpus):
    for rep in get(gpus, "weights"):
        assert all(rep["equal"]) and rep["gathered_ok"]



# --------------------------------------------------------------------------- DLO trust on NCCL
def test_nccl_same_exception_on_every_rank_leaves_dlo_usable(gpus):
    for r, rep in enumerate(get(gpus, "same_exception")):
        assert rep["errors"][1].startswith("ValueError: injected failure inside a block"), rep["errors"]
        assert rep["errors"][2:] == [None, None] and rep["equal"][2:] == [True, True], (r, rep)
        assert rep["usable"] and rep["gathered"] and rep["restored"] and rep["restored_equal"]


def test_nccl_one_rank_failure_errors_everywhere_then_bit_exact(gpus):
    reps = get(gpus, "one_rank_fails")
    last = len(reps) - 1
    assert reps[last]["errors"][1].startswith("ValueError: injected failure inside a block")
    for r, rep in enumerate(reps[:last]):
        err = rep["errors"][1]
        assert err and f"rank {last}: ValueError: injected failure" in err, (r, rep["errors"])
        assert rep["elapsed"][1] < 5.0, (r, rep["elapsed"])
    for rep in reps:
        assert rep["errors"][2:] == [None, None] and rep["equal"][2:] == [True, True], rep
        assert rep["usable"] and rep["gathered"] and rep["restored"] and rep["restored_equal"]


def test_nccl_capture_failure_on_one_rank_is_eager_on_all(gpus):
    for r, rep in enumerate(get(gpus, "capture_fails_on_one_rank")):
        assert all(rep["equal"]), (r, rep)
        assert rep["usable"] is True, (r, rep)
        assert rep["counts"]["capture"] == 0 and rep["counts"]["eager-fallback"] >= 1, (r, rep["counts"])


def test_nccl_peer_that_stays_alive_fails_within_the_timeout(tmp_path):
    world = gpu_world()
    reports = run_ranks(world, tmp_path, "test_distributed_gpu:scenario_peer_stays_alive", backend="nccl",
                        timeout=180 + 15 * world)
    reps = get(reports, "peer_stays_alive")
    assert len(reps) == world and "error" not in reps[-1], "the absent rank ran the forward"
    for r, rep in enumerate(reps[:-1]):
        assert rep["error"] and "DLOCollectiveError" in rep["error"], (r, rep["error"])
        assert rep["elapsed"] < TIMEOUT_S + SLACK_S, (r, rep["elapsed"])
