"""Distributed layerwise offload (DLO) on CPU over gloo.

Multi-rank checks run in real processes (2, 3, 4 and 8 ranks), one launch per
rank count: every check of a launch runs in the same processes and reports back
through a pickle per rank, and the test functions below assert on those
reports. Processes come from a forkserver that has imported torch and
diffusers once (a plain spawn re-imports diffusers in every process, about
12 s each on a 2-core machine). The compatibility rules need no process group
and run in the test process.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import importlib
import multiprocessing as mp
import os
import pickle
import re
import sys
import traceback

import pytest
import torch

from weightstream import OffloadConfig, OffloadedTransformer, UnsupportedCombinationError
from weightstream.checkout import safe_path
from weightstream.models import ToyDiT, flux_inputs, tiny_flux, toy_inputs
from weightstream.offload import distributed as dlo
from weightstream.offload.host.shares import Shares
from weightstream.offload.dlo.topology import ParallelConfig, resolve_transfer, shard_size
from weightstream.offload.dlo.control import validate_wave
from weightstream.offload.host.arena import PAGE
from weightstream.offload.layout import TENSOR_ALIGN

PRELOAD = [
    "torch", "torch.distributed", "weightstream.models", "weightstream.offload.distributed",
    "diffusers.models.transformers.transformer_flux",
]


# --------------------------------------------------------------------------- launcher
def run_ranks(world: int, tmpdir, target: str, *, backend: str = "gloo", timeout: float = 240.0,
              cuda: bool = False) -> list[dict]:
    """Run ``target`` ("module:function", called as fn(rank, world)) on ``world``
    ranks of a fresh process group; return each rank's report dict. ``cuda``: the
    ranks use CUDA (gloo over CUDA tensors), so they are spawned as for NCCL."""
    if backend == "nccl" or cuda:
        # CUDA cannot be initialised in a process forked from one that touched it
        # (the forkserver imports torch and the test modules): spawn fresh ranks.
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
    tmpdir = str(tmpdir)
    procs = [ctx.Process(target=_worker, args=(r, world, tmpdir, target, backend)) for r in range(world)]
    with safe_path():  # the forkserver starts on the first start(): the checkout's root not first on its path
        for p in procs:
            p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    for p in procs:
        p.join(max(1.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    reports = []
    for r in range(world):
        path = os.path.join(tmpdir, f"rank{r}.pkl")
        if not os.path.exists(path):
            pytest.fail(f"rank {r} wrote no report (exit code {procs[r].exitcode}; hung ranks: {hung})")
        with open(path, "rb") as f:
            reports.append(pickle.load(f))
    for r, rep in enumerate(reports):
        if "__error__" in rep:
            pytest.fail(f"rank {r} failed outside a check:\n{rep['__error__']}")
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {timeout} s")
    return reports


def _worker(rank, world, tmpdir, target, backend):
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)
    import torch.distributed as dist

    report: dict = {}
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(tmpdir, "store"), world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        mod, fn = target.split(":")
        report = getattr(importlib.import_module(mod), fn)(rank, world)
    except BaseException:
        report["__error__"] = traceback.format_exc()
    with open(os.path.join(tmpdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(report, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (seconds with diffusers loaded) and gloo's


class Checks:
    """Runs named checks inside a rank; an exception becomes that check's report."""

    def __init__(self):
        self.report: dict = {}

    def run(self, name, fn, *args, **kw):
        try:
            self.report[name] = fn(*args, **kw)
        except BaseException:
            self.report[name] = {"__error__": traceback.format_exc()}


def get(reports, name) -> list:
    """One check's report from every rank (failing with the rank's traceback)."""
    out = []
    for r, rep in enumerate(reports):
        if name not in rep:
            pytest.fail(f"rank {r} has no report for {name!r}")
        v = rep[name]
        if isinstance(v, dict) and "__error__" in v:
            pytest.fail(f"rank {r}, check {name!r} raised:\n{v['__error__']}")
        out.append(v)
    return out


# --------------------------------------------------------------------------- checks (inside ranks)
def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _model(kind, rank, dtype=torch.float32):
    """(model, inputs): the same weights on every rank, this rank's own request."""
    if kind == "toy":
        return ToyDiT(), toy_inputs(seed=1 + rank)
    if kind == "toy-narrow":  # blocks of 3-6 KiB: at 4 and 8 ranks some shares hold only padding
        return ToyDiT(width=8), toy_inputs(seed=1 + rank)
    m = tiny_flux(dtype=dtype)
    return m, flux_inputs(m, seed=1 + rank)


STAT_KEYS = ("transfer", "shard_group", "shard_group_size", "shard_rank", "host_bytes", "model_bytes",
             "pinned_host_gb_per_rank", "streamed_bytes_per_step", "h2d_bytes_per_step", "blocks_streamed",
             "gather", "shard_bytes", "usable")


def check_equal(kind, parallel, *, transfer=None, forwards=3, rank=0, device="cpu", dtype=torch.float32,
                same_inputs=False, **cfg_kw):
    """Offloaded outputs vs the resident model over several forwards, then disable()."""
    model, inputs = _model(kind, 0 if same_inputs else rank, dtype)
    ref_model = copy.deepcopy(model).to(device)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        ref = _first(ref_model(**inputs))
    cfg = OffloadConfig.layerwise(weight_transfer=transfer, progress=False, **cfg_kw)
    om = OffloadedTransformer(model, cfg, device=device, parallel=parallel)
    primed_before = om.executor._primed
    with torch.no_grad():
        equal = [torch.equal(_first(om(**inputs)), ref) for _ in range(forwards)]
    stats = om.stats()
    layouts = [lay.nbytes for lay in om._streamed.layouts]
    plain = om.disable()
    with torch.no_grad():
        restored = torch.equal(_first(plain(**inputs)), ref)
    ref_sd = ref_model.state_dict()
    weights_back = all(torch.equal(v, ref_sd[k]) for k, v in plain.state_dict().items())
    return dict(equal=equal, restored=restored, weights_back=weights_back, primed_before=primed_before,
                layouts=layouts, stats={k: stats.get(k) for k in STAT_KEYS})


def check_weights(parallel, rank):
    """update_weights / gather_state_dict / state_dict() on an AllGather backend."""
    model, inputs = _model("toy", rank)
    ref_model = copy.deepcopy(model)
    om = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device="cpu", parallel=parallel)
    with torch.no_grad():
        om(**inputs)  # primes and prefetches the next step's first blocks
    g = torch.Generator().manual_seed(7)  # the same new weights on every rank
    new = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in ref_model.state_dict().items()}
    written = om.update_weights(new)
    ref_model.load_state_dict(new)
    with torch.no_grad():
        ref = ref_model(**inputs)
        equal = [torch.equal(om(**inputs), ref) for _ in range(2)]
    full = om._streamed.gather_state_dict()
    gathered_ok = sorted(full) == sorted(new) and all(torch.equal(full[k], new[k]) for k in new)
    try:
        om.state_dict()
        state_dict_error = None
    except RuntimeError as e:
        state_dict_error = str(e)
    om.disable()
    return dict(written=len(written), expected=len(new), equal=equal, gathered_ok=gathered_ok,
                state_dict_error=state_dict_error)


def _message(fn):
    try:
        return ("ok", fn())
    except ValueError as e:
        return ("ValueError", str(e))


def check_waves(parallel, rank, world):
    base = {"prompt": f"request of rank {rank}", "num_inference_steps": 4, "height": 64, "width": 64,
            "guidance_scale": 3.5}
    last = world - 1
    without_steps = {k: v for k, v in base.items() if k != "num_inference_steps"}
    return {
        "agree": _message(lambda: validate_wave(dict(base), parallel)),
        "steps_differ": _message(lambda: validate_wave({**base, "num_inference_steps": 4 + (rank == last)},
                                                       parallel)),
        "steps_missing": _message(lambda: validate_wave(without_steps if rank == last else base, parallel)),
        "steps_none": _message(lambda: validate_wave({**base, "num_inference_steps": None} if rank == 0 else base,
                                                     parallel)),
        "path_differ": _message(lambda: validate_wave({**base, "height": 64 if rank == 0 else 128}, parallel)),
        "cfg_differs": _message(lambda: validate_wave({**base, "negative_prompt": "blurry"} if rank == last
                                                      else base, parallel)),
        "not_a_dict": _message(lambda: validate_wave(None if rank == last else base, parallel)),
        "custom_keys": _message(lambda: validate_wave({**base, "mode": rank}, parallel, path_keys=("mode",))),
        "rank_local": _message(lambda: validate_wave(without_steps, parallel, transfer="rank-local")),
        "after": _message(lambda: validate_wave(dict(base), parallel)),  # still in step after rejections
    }



@contextlib.contextmanager
def failing_gather(at: int):
    """In this rank process only: the all-gather raises on its ``at``-th call (a third-party
    function replaced, restored after); yields the call counter ``{"n": calls}``."""
    import torch.distributed as dist

    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original = getattr(dist, name)
    calls = {"n": 0}

    def failing(*args, **kw):
        calls["n"] += 1
        if calls["n"] == at:
            raise RuntimeError("injected collective failure")
        return original(*args, **kw)

    setattr(dist, name, failing)
    try:
        yield calls
    finally:
        setattr(dist, name, original)

def check_failure_everywhere(parallel, rank):
    """A collective that raises on every rank (injected) marks the backend unusable."""
    model, inputs = _model("toy", rank)
    om = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device="cpu", parallel=parallel)
    with torch.no_grad():
        om(**inputs)
    with failing_gather(3) as calls:
        try:
            with torch.no_grad():
                om(**inputs)
            first = None
        except RuntimeError as e:
            first = str(e)
        with torch.no_grad():
            try:
                om(**inputs)
                later = None
            except RuntimeError as e:
                later = str(e)
        try:
            om.disable()
            disable = None
        except RuntimeError as e:
            disable = str(e)
    return dict(first=first, later=later, disable=disable, usable=om._streamed.usable,
                stats_failure=om.stats()["failure"], calls_after=calls["n"],
                local=om._streamed.local_state_dict())


def check_failure_one_rank(rank, world):
    """One rank raises inside a block (a user hook): it completes the step's gathers,
    its peers learn of it at the step's end and raise too; the next forward runs."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=15))
    parallel = ParallelConfig(dp=world, dp_group=group)
    model, inputs = _model("toy", rank)
    cfg = OffloadConfig.layerwise(progress=False, dlo_timeout_s=5.0)
    om = OffloadedTransformer(model, cfg, device="cpu", parallel=parallel)
    state = {"forward": 0}

    def boom(module, args):
        if rank == 1 and state["forward"] == 1:
            raise ValueError("injected failure inside single_blocks.0 on rank 1")

    handle = model.single_blocks[0].register_forward_pre_hook(boom)
    errors, runtime = [], []
    for i in range(3):
        state["forward"] = i
        try:
            with torch.no_grad():
                om(**inputs)
            errors.append(None)
            runtime.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
            runtime.append(isinstance(e, RuntimeError))
    handle.remove()
    return dict(errors=errors, runtime=runtime, usable=om._streamed.usable, failure=om.stats()["failure"])


def check_list_gather(parallel, rank):
    """A backend without all_gather_into_tensor (gloo before it gained one): the
    construction-time probe fails on every rank and DLO gathers into a list of
    views of the block slot instead."""
    import torch.distributed as dist

    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}

    def unsupported(*args, **kw):  # third-party function replaced in this rank process only
        raise RuntimeError("no support for _allgather_base in Gloo process group (simulated)")

    for n in names:
        setattr(dist, n, unsupported)
    try:
        return check_equal("toy", parallel, rank=rank, forwards=2)
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def check_setup_failure_loses_nothing(parallel, rank):
    """A failure while packing the shares (injected on every rank at the 4th block)
    leaves the model whole: the originals are released only after every share is packed."""

    model, inputs = _model("toy", rank)
    ref_model = copy.deepcopy(model)
    real_pin, calls = Shares.pin, {"n": 0}

    def failing_pin(self, k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise MemoryError("injected while pinning")
        return real_pin(self, k)

    Shares.pin = failing_pin
    try:
        OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device="cpu", parallel=parallel)
        raised = None
    except MemoryError as e:
        raised = str(e)
    finally:
        Shares.pin = real_pin
    with torch.no_grad():
        intact = torch.equal(model(**inputs), ref_model(**inputs))
    return dict(raised=raised, intact=intact)


def check_reset_is_fatal(parallel, rank):
    """Under AllGather a one-rank ring reset (what a failed graph capture does)
    would issue gathers the peers do not: it marks the backend unusable instead."""
    model, inputs = _model("toy", rank)
    om = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device="cpu", parallel=parallel)
    with torch.no_grad():
        om(**inputs)
    errors = []
    for call in (om.executor.reset, lambda: om(**inputs)):
        try:
            with torch.no_grad():
                call()
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return dict(errors=errors)


def scenario_two(rank, world):
    """Every 2-rank check, in one launch."""
    import torch.distributed as dist

    dp = ParallelConfig(dp=world)
    c = Checks()
    c.run("toy_allgather", check_equal, "toy", dp, transfer="allgather", rank=rank)
    c.run("toy_default", check_equal, "toy", dp, rank=rank, forwards=2)
    c.run("toy_allgather_3slots", check_equal, "toy", dp, rank=rank, num_slots=3, forwards=3)
    c.run("toy_list_gather", check_list_gather, dp, rank)
    c.run("toy_rank_local_resident", check_equal, "toy", dp, transfer="rank-local", rank=rank,
          resident_layers=2)
    c.run("flux_allgather", check_equal, "flux", dp, transfer="allgather", rank=rank, forwards=2)
    c.run("flux_rank_local", check_equal, "flux", dp, transfer="rank-local", rank=rank, forwards=2)
    c.run("weights", check_weights, dp, rank)
    c.run("waves", check_waves, dp, rank, world)
    c.run("failure_everywhere", check_failure_everywhere, dp, rank)
    c.run("setup_failure", check_setup_failure_loses_nothing, dp, rank)
    c.run("reset_is_fatal", check_reset_is_fatal, dp, rank)
    dist.barrier()
    c.run("failure_one_rank", check_failure_one_rank, rank, world)
    return c.report


def scenario_three(rank, world):
    """Every 3-rank check, in one launch."""
    c = Checks()
    dp = ParallelConfig(dp=world)
    sp = ParallelConfig(sp=world)
    c.run("toy_allgather", check_equal, "toy", dp, rank=rank)
    c.run("flux_allgather_sp", check_equal, "flux", sp, rank=rank, forwards=2, same_inputs=True)
    c.run("flux_allgather_bf16", check_equal, "flux", dp, rank=rank, forwards=2, dtype=torch.bfloat16)
    c.run("toy_rank_local", check_equal, "toy", dp, transfer="rank-local", rank=rank, forwards=2)
    c.run("waves", check_waves, dp, rank, world)
    return c.report


def scenario_many(rank, world):
    """The 4- and 8-rank checks (issue 17), in one launch: every share smaller, some
    all padding (toy-narrow), the same weights gathered from every rank's piece."""
    dp = ParallelConfig(dp=world)
    sp = ParallelConfig(sp=world)
    c = Checks()
    c.run("toy_allgather", check_equal, "toy", dp, transfer="allgather", rank=rank)
    c.run("toy_narrow_allgather", check_equal, "toy-narrow", dp, rank=rank, forwards=2)
    c.run("flux_allgather_bf16", check_equal, "flux", dp, rank=rank, forwards=2, dtype=torch.bfloat16)
    c.run("flux_allgather_sp", check_equal, "flux", sp, rank=rank, forwards=2, same_inputs=True)
    c.run("toy_list_gather", check_list_gather, dp, rank)
    c.run("toy_rank_local", check_equal, "toy", dp, transfer="rank-local", rank=rank, forwards=2)
    c.run("flux_rank_local", check_equal, "flux", dp, transfer="rank-local", rank=rank, forwards=2)
    c.run("weights", check_weights, dp, rank)
    c.run("waves", check_waves, dp, rank, world)
    return c.report


# --------------------------------------------------------------------------- launches
@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(2, tmp_path_factory.mktemp("dlo2"), "test_distributed:scenario_two")


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return run_ranks(3, tmp_path_factory.mktemp("dlo3"), "test_distributed:scenario_three")


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks(4, tmp_path_factory.mktemp("dlo4"), "test_distributed:scenario_many")


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return run_ranks(8, tmp_path_factory.mktemp("dlo8"), "test_distributed:scenario_many", timeout=420)


EQUALITY_2 = ["toy_allgather", "toy_default", "toy_allgather_3slots", "toy_list_gather",
              "toy_rank_local_resident", "flux_allgather", "flux_rank_local"]
EQUALITY_3 = ["toy_allgather", "flux_allgather_sp", "flux_allgather_bf16", "toy_rank_local"]
EQUALITY_MANY = ["toy_allgather", "toy_narrow_allgather", "flux_allgather_bf16", "flux_allgather_sp",
                 "toy_list_gather", "toy_rank_local", "flux_rank_local"]
# the 8-rank launch costs about 8 s on 2 cores (4 ranks: 6 s): not marked slow
MANY = [("four", 4), ("eight", 8)]


def _assert_equal_report(reps, name, world):
    for r, rep in enumerate(reps):
        assert rep["equal"] and all(rep["equal"]), f"rank {r} {name}: outputs differ from resident {rep['equal']}"
        assert rep["restored"], f"rank {r} {name}: disable() output differs from resident"
        assert rep["weights_back"], f"rank {r} {name}: disable() weights differ from the originals"
        assert rep["primed_before"] is False, f"rank {r} {name}: loads were issued before the first forward"
        st = rep["stats"]
        want = "rank-local" if "rank_local" in name else "allgather"
        assert st["transfer"] == want
        if want == "allgather":
            assert st["shard_group_size"] == world and st["shard_rank"] == r
    if "rank_local" not in name:
        assert {rep["stats"]["shard_rank"] for rep in reps} == set(range(world))


@pytest.mark.parametrize("name", EQUALITY_2)
def test_two_ranks_bit_exact(two, name):
    _assert_equal_report(get(two, name), name, 2)


@pytest.mark.parametrize("name", EQUALITY_3)
def test_three_ranks_bit_exact(three, name):
    _assert_equal_report(get(three, name), name, 3)


@pytest.mark.parametrize("launch,world", MANY)
@pytest.mark.parametrize("name", EQUALITY_MANY)
def test_many_ranks_bit_exact(request, launch, world, name):
    _assert_equal_report(get(request.getfixturevalue(launch), name), name, world)


def test_models_have_odd_blocks_and_sizes_not_divisible(two, three):
    for reps, world in ((get(two, "toy_allgather"), 2), (get(three, "toy_allgather"), 3),
                        (get(three, "flux_allgather_sp"), 3)):
        layouts = reps[0]["layouts"]
        assert len(layouts) % 2 == 1
        assert any(n % (world * TENSOR_ALIGN) for n in layouts), "every block divides evenly: padding untested"


@pytest.mark.parametrize("launch,world", MANY)
def test_many_ranks_odd_blocks_uneven_and_padding_only_shares(request, launch, world):
    """At 4 and 8 ranks the models still have odd block counts and blocks that do
    not divide evenly; toy-narrow has blocks where the last rank's share is all padding."""
    reps = request.getfixturevalue(launch)
    for name in ("toy_allgather", "flux_allgather_bf16", "toy_narrow_allgather"):
        layouts = get(reps, name)[0]["layouts"]
        assert len(layouts) % 2 == 1, name
        assert any(n % (world * TENSOR_ALIGN) for n in layouts), f"{name}: every block divides evenly"
    narrow = get(reps, "toy_narrow_allgather")[0]["layouts"]
    assert any(n <= (world - 1) * shard_size(n, world) for n in narrow), "no share is padding only"


@pytest.mark.parametrize("launch,name,world", [("two", "toy_allgather", 2), ("two", "flux_allgather", 2),
                                               ("three", "toy_allgather", 3), ("three", "flux_allgather_bf16", 3),
                                               ("four", "toy_allgather", 4), ("four", "flux_allgather_bf16", 4),
                                               ("four", "toy_narrow_allgather", 4),
                                               ("eight", "toy_allgather", 8), ("eight", "flux_allgather_bf16", 8),
                                               ("eight", "toy_narrow_allgather", 8)])
def test_allgather_host_bytes_per_rank(request, launch, name, world):
    reps = get(request.getfixturevalue(launch), name)
    for rep in reps:
        st, n = rep["stats"], len(rep["layouts"])
        total = st["streamed_bytes_per_step"]
        assert st["shard_bytes"] <= total / world + n * TENSOR_ALIGN
        assert st["shard_bytes"] * world >= total
        assert st["host_bytes"] <= total / world + n * (TENSOR_ALIGN + PAGE)
        assert st["h2d_bytes_per_step"] == st["shard_bytes"]
        assert st["model_bytes"] > total


def test_rank_local_keeps_full_blocks(two):
    for rep in get(two, "flux_rank_local"):
        st = rep["stats"]
        assert st["shard_group_size"] == 1
        assert st["host_bytes"] >= st["streamed_bytes_per_step"]
    for rep in get(two, "toy_rank_local_resident"):
        assert rep["stats"]["blocks_streamed"] == 5


@pytest.mark.parametrize("launch,world", [("two", 2), *MANY])
def test_list_gather_fallback_and_probe(request, launch, world):
    reps = request.getfixturevalue(launch)
    assert [r["stats"]["gather"] for r in get(reps, "toy_list_gather")] == ["list"] * world
    # gloo in this torch has all_gather_into_tensor; the probe picks it
    assert [r["stats"]["gather"] for r in get(reps, "toy_allgather")] == ["tensor"] * world


@pytest.mark.parametrize("launch,world", [("two", 2), *MANY])
def test_update_weights_and_gather_state_dict(request, launch, world):
    reps = get(request.getfixturevalue(launch), "weights")
    assert len(reps) == world
    for rep in reps:
        assert rep["written"] == rep["expected"]
        assert all(rep["equal"]), "after update_weights outputs differ from the resident model with new weights"
        assert rep["gathered_ok"]
        assert rep["state_dict_error"] and "gather_state_dict" in rep["state_dict_error"]


@pytest.mark.parametrize("launch,world", [("two", 2), ("three", 3), *MANY])
def test_request_waves(request, launch, world):
    reps = get(request.getfixturevalue(launch), "waves")
    for key in reps[0]:
        assert len({repr(rep[key]) for rep in reps}) == 1, f"{key}: ranks disagree: {[rep[key] for rep in reps]}"
    w = reps[0]
    last = world - 1
    assert w["agree"] == ("ok", 4)
    assert w["after"] == ("ok", 4)
    assert w["rank_local"] == ("ok", None)
    kind, msg = w["steps_differ"]
    assert kind == "ValueError" and "num_inference_steps differs" in msg and f"dp rank {last}: 5" in msg
    assert "before any weight collective" in msg
    kind, msg = w["steps_missing"]
    assert kind == "ValueError" and f"missing (or None) on dp rank(s) [{last}]" in msg
    kind, msg = w["steps_none"]
    assert kind == "ValueError" and "missing (or None) on dp rank(s) [0]" in msg
    kind, msg = w["path_differ"]
    assert kind == "ValueError" and "height differs" in msg and "128" in msg and "width" not in msg.split(".")[0]
    kind, msg = w["cfg_differs"]
    assert kind == "ValueError" and "negative_prompt differs" in msg
    kind, msg = w["not_a_dict"]
    assert kind == "ValueError" and f"dp rank {last}: the request is a NoneType" in msg
    kind, msg = w["custom_keys"]
    assert kind == "ValueError" and "mode differs" in msg


def test_collective_failure_marks_unusable(two):
    reps = get(two, "failure_everywhere")
    for rep in reps:
        assert rep["first"] and "injected collective failure" in rep["first"]
        assert rep["later"] and "unusable" in rep["later"] and "injected collective failure" in rep["later"]
        assert rep["disable"] and "local_state_dict()" in rep["disable"] and "merge_shards" in rep["disable"]
        assert rep["usable"] is False and "injected" in rep["stats_failure"]
        assert rep["calls_after"] == 3, "a collective ran after the backend was marked unusable"
    # the host shards are intact: every rank's local reads join into the original weights
    full = dlo.merge_shards([rep["local"] for rep in reps])
    ref = ToyDiT().state_dict()
    assert sorted(full) == sorted(ref) and all(torch.equal(full[k], ref[k]) for k in ref)


def test_allgather_reset_marks_unusable(two):
    for rep in get(two, "reset_is_fatal"):
        assert all(e is not None and "unusable" in e and "reset" in e for e in rep["errors"]), rep


def test_setup_failure_loses_nothing(two):
    for rep in get(two, "setup_failure"):
        assert rep["raised"] == "injected while pinning" and rep["intact"], rep


def test_one_rank_failure_is_an_error_on_every_rank_then_usable(two):
    reps = get(two, "failure_one_rank")
    r0, r1 = reps
    assert r0["errors"][0] is None and r1["errors"][0] is None
    assert r1["errors"][1].startswith("ValueError: injected failure inside single_blocks.0")
    # the peer's own forward raises, naming the failed rank and its error
    assert r0["runtime"][1] and "rank 1: ValueError: injected failure inside single_blocks.0" in r0["errors"][1]
    for rep in reps:
        assert rep["errors"][2] is None and rep["usable"] is True and rep["failure"] is None


# --------------------------------------------------------------------------- rules (no process group)
def _toy_and_ptrs():
    m = ToyDiT()
    return m, {k: (v.data_ptr(), v.numel()) for k, v in m.state_dict().items()}


REJECTIONS = [
    (dict(dp=2, tp=2), "allgather", 0, "weight_transfer='allgather' with tp=2"),
    (dict(dp=2, tp=2), None, 0, "unset (the DLO default 'allgather' for dp=2) with tp=2"),
    (dict(sp=2, tp=4), None, 0, "for sp=2) with tp=4"),
    (dict(sp=2, hsdp=2), "allgather", 0, "hsdp=2 is not allowed: HSDP already shards the parameters, so a DLO "
                                        "AllGather would double-shard"),
    (dict(sp=2, hsdp=2), None, 0, "would double-shard"),
    (dict(hsdp=2), "allgather", 0, "would double-shard"),
    (dict(dp=2), None, 2, "resident_layers=2 with layer_options.dit.weight_transfer unset"),
    (dict(dp=2), None, "auto", "resident_layers='auto' with layer_options.dit.weight_transfer unset"),
    (dict(sp=2), None, [1, 3], "resident_layers=(1, 3) with layer_options.dit.weight_transfer unset"),
    (dict(tp=2), "allgather", 0, "with tp=2"),
]


@pytest.mark.parametrize("par,transfer,resident,match", REJECTIONS)
def test_rejections_before_any_tensor_moves(par, transfer, resident, match):
    model, ptrs = _toy_and_ptrs()
    cfg = OffloadConfig.layerwise(weight_transfer=transfer, resident_layers=resident or None, progress=False)
    with pytest.raises(UnsupportedCombinationError) as e:
        OffloadedTransformer(model, cfg, device="cpu", parallel=ParallelConfig(**par))
    assert match in str(e.value)
    assert "rank-local" in str(e.value)  # names the way out
    after = {k: (v.data_ptr(), v.numel()) for k, v in model.state_dict().items()}
    assert after == ptrs, "a rejected config moved or released tensors"
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_dlo_refuses_next_step_graph_boundary_loads():
    model, ptrs = _toy_and_ptrs()
    cfg = OffloadConfig.layerwise(weight_transfer="rank-local", cuda_graphs="on",
                                  graph_boundary_loads="next-step", progress=False)
    with pytest.raises(ValueError, match="graph_boundary_loads='next-step' is not supported with distributed"):
        OffloadedTransformer(model, cfg, device="cpu", parallel=ParallelConfig(dp=2))
    assert {k: (v.data_ptr(), v.numel()) for k, v in model.state_dict().items()} == ptrs


@pytest.mark.parametrize("par,msg", [
    (dict(hsdp=2, dp=2), "HSDP combines with SP only"),  # an UnsupportedCombinationError (a ValueError)
    (dict(hsdp=2, tp=2), "HSDP combines with SP only"),
    (dict(dp=0), "ParallelConfig.dp=0"),
    (dict(sp=-1), "ParallelConfig.sp=-1"),
    (dict(tp=1.5), "ParallelConfig.tp=1.5"),
    (dict(hsdp=True), "ParallelConfig.hsdp=True"),
])
def test_parallel_config_rejections(par, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        ParallelConfig(**par)


def test_resolve_transfer_refuses_any_resident_set_under_allgather():
    """resident_layers="auto" or a list under the default AllGather: the same refusal as an int
    (a ValueError naming the value and the way out), never a TypeError from comparing it to 0."""
    for resident in ("auto", [0], [2, 5]):
        cfg = OffloadConfig.layerwise(resident_layers=resident)
        with pytest.raises(UnsupportedCombinationError, match=r"resident_layers=.* is not allowed: resident layers require "
                                             r"weight_transfer='rank-local'"):
            resolve_transfer(cfg, ParallelConfig(dp=2))
        assert resolve_transfer(cfg, ParallelConfig()) == "rank-local"  # nothing to gather: allowed
        cfg = OffloadConfig.layerwise(weight_transfer="rank-local", resident_layers=resident)
        assert resolve_transfer(cfg, ParallelConfig(dp=2)) == "rank-local"


@pytest.mark.parametrize("par,transfer,resident,want", [
    (dict(dp=2), None, 0, "allgather"),
    (dict(sp=2), None, 0, "allgather"),
    (dict(dp=2, sp=4), None, 0, "allgather"),
    (dict(), None, 0, "rank-local"),
    (dict(), "allgather", 0, "rank-local"),  # a group of one rank has nothing to gather
    (dict(tp=4), None, 0, "rank-local"),
    (dict(dp=2, tp=2), "rank-local", 0, "rank-local"),
    (dict(hsdp=2), None, 0, "rank-local"),
    (dict(hsdp=2, sp=2), "rank-local", 0, "rank-local"),
    (dict(dp=2), "rank-local", 3, "rank-local"),
])
def test_transfer_resolution(par, transfer, resident, want):
    cfg = OffloadConfig.layerwise(weight_transfer=transfer, resident_layers=resident or None)
    assert resolve_transfer(cfg, ParallelConfig(**par)) == want


def test_sharding_group_is_dp_then_sp_never_tp():
    assert ParallelConfig(dp=2, sp=4, tp=2).shard_dim == "dp"
    assert ParallelConfig(sp=4, tp=2).shard_dim == "sp"
    assert ParallelConfig(tp=8).shard_dim is None
    assert ParallelConfig(hsdp=2, sp=2).shard_size == 2


@pytest.mark.parametrize("par", [dict(hsdp=2, sp=2), dict(hsdp=2), dict(dp=2, tp=2), dict(dp=4), dict(tp=2)])
def test_rank_local_accepted_without_collectives(par):
    """HSDP(+SP), TP and DP stream rank-locally; no process group is needed or used."""
    model, inputs = ToyDiT(), toy_inputs()
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        ref = ref_model(**inputs)
    cfg = OffloadConfig.layerwise(weight_transfer="rank-local", progress=False)
    om = OffloadedTransformer(model, cfg, device="cpu", parallel=ParallelConfig(**par))
    with torch.no_grad():
        assert torch.equal(om(**inputs), ref)
        assert torch.equal(om(**inputs), ref)
    assert om.stats()["transfer"] == "rank-local" and om.stats()["shard_group_size"] == 1
    plain = om.disable()
    with torch.no_grad():
        assert torch.equal(plain(**inputs), ref)


def test_allgather_needs_an_initialised_group():
    model, ptrs = _toy_and_ptrs()
    with pytest.raises(ValueError, match="needs an initialised torch.distributed process group"):
        OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device="cpu",
                             parallel=ParallelConfig(dp=2))
    assert {k: (v.data_ptr(), v.numel()) for k, v in model.state_dict().items()} == ptrs


def test_parallel_must_be_a_parallel_config():
    with pytest.raises(TypeError, match="ParallelConfig"):
        OffloadedTransformer(ToyDiT(), OffloadConfig.layerwise(), device="cpu", parallel={"dp": 2})


def test_validate_wave_without_collective():
    assert validate_wave({}, ParallelConfig(dp=2), transfer="rank-local") is None
    assert validate_wave({}, ParallelConfig(sp=2)) is None  # SP ranks share one request
    assert validate_wave({}, ParallelConfig()) is None
    with pytest.raises(ValueError, match="transfer='ring'"):
        validate_wave({}, ParallelConfig(dp=2), transfer="ring")
    with pytest.raises(ValueError, match="needs an initialised"):
        validate_wave({"num_inference_steps": 4}, ParallelConfig(dp=2))


@pytest.mark.parametrize("nbytes,n,want", [(512, 2, 512), (1024, 2, 512), (1536, 2, 1024), (1536, 3, 512),
                                           (2048, 3, 1024), (157696, 3, 52736), (512, 1, 512)])
def test_shard_size(nbytes, n, want):
    got = shard_size(nbytes, n)
    assert got == want and got % TENSOR_ALIGN == 0 and got * n >= nbytes


def test_shares_store_raw_and_coded_shares_gather_back_to_the_image():
    """host/shares.py on its own (no collective): every rank's share of a block, joined
    rank-major, is the block image (raw) or its coded image (coded), the rest zero padding;
    pieces merge back into the tensors; a raw write lands in the one share that holds it."""
    from weightstream.offload.dlo.control import merge_shards
    from weightstream.offload.host.encode import encode_image
    from weightstream.offload.host.shares import joined
    from weightstream.offload.layout import block_tensors, build_layout

    model = tiny_flux(dtype=torch.bfloat16, num_attention_heads=4)
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    tensors = [block_tensors(b) for b in blocks]
    layouts = [build_layout(i, f"b{i}", ts) for i, ts in enumerate(tensors)]
    world = 3
    stores = [Shares(layouts, world, r, pin=False) for r in range(world)]
    try:
        for k, (lay, ts) in enumerate(zip(layouts, tensors)):
            objs = [t for _, _, t in ts]
            image = torch.zeros(lay.nbytes, dtype=torch.uint8)
            for spec, t in zip(lay.tensors, objs):
                spec.view_of(image).copy_(t)
            if k % 2:  # odd blocks coded, even ones raw
                blobs, table = encode_image(lay, objs)
                whole = joined(blobs)
                for s in stores:
                    assert not s.set_coded(k, whole, table)
                want = whole
            else:
                for s in stores:
                    s.set_raw(k, objs)
                want = image
            gathered = torch.cat([s.image(k) for s in stores])
            sb = shard_size(lay.nbytes, world) if k % 2 == 0 else stores[0].coded_shard_bytes(k, want.numel())
            assert [s.shard_bytes[k] for s in stores] == [sb] * world and [s.range(k)[0] for s in stores] == [
                r * sb for r in range(world)]
            assert torch.equal(gathered[: want.numel()], want) and not gathered[want.numel():].any()
            assert [s.raw[k] for s in stores] == [k % 2 == 0] * world
        names = {(k, i): f"b{k}.{spec.name}" for k, lay in enumerate(layouts) for i, spec in enumerate(lay.tensors)}
        local = [{n: s.piece(n, k, i) for (k, i), n in names.items()} for s in stores]
        merged = merge_shards(local)
        for (k, i), n in names.items():
            t = tensors[k][i][2]
            assert merged[n].dtype == t.dtype and torch.equal(merged[n].view(torch.int16), t.view(torch.int16)), n
        spec = layouts[0].tensors[0]
        new = torch.full(spec.shape, 0.5, dtype=spec.dtype)
        for s in stores:
            s.write_raw(0, spec, new)
        gathered = torch.cat([s.image(0) for s in stores])
        assert torch.equal(spec.view_of(gathered), new)
        with pytest.raises(ValueError, match="is coded"):
            stores[0].write_raw(1, layouts[1].tensors[0], tensors[1][0][2])
        assert "Shares(rank 0/3" in repr(stores[0]) and stores[0].nbytes == sum(stores[0].shard_bytes)
    finally:
        for s in stores:
            s.close()
