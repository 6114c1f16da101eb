"""DLO never loses weights and never hangs (gloo on CPU, 2, 4 and 8 ranks).

One launch per rank count runs every check in the same processes (the launcher
of tests/test_distributed.py); the tests run against each launch. The rank
that fails, differs or stays away is the last one (rank N - 1), so at 4 and 8
ranks the healthy ranks are several and the odd one is not rank 1. Checks whose collectives time out on purpose use a
group of their own and run last: a timed-out gloo operation stays pending in
its group until the group's own timeout. Every DLO wait here is bounded by a
dlo_timeout_s of a few seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import time

import pytest
import torch

from test_distributed import Checks, get, run_ranks
from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import ToyDiT, toy_inputs
from weightstream.offload import distributed as dlo
from weightstream.offload.dlo.control import tensor_digests
from weightstream.offload.dlo.topology import ParallelConfig
from weightstream.offload.build import streamed_blocks

TIMEOUT_S = 2.0  # dlo_timeout_s of the checks that time out on purpose
SLACK_S = 4.0  # two shared CPU cores: scheduling delay on top of it


def _cfg(**kw):
    kw.setdefault("dlo_timeout_s", 5.0)
    return OffloadConfig.layerwise(progress=False, **kw)


def _toy(rank):
    model = ToyDiT()
    return model, toy_inputs(seed=1 + rank), copy.deepcopy(model)


def _run(fn):
    try:
        fn()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _forward(om, inputs):
    with torch.no_grad():
        return om(**inputs)


class _Stop(BaseException):
    """A BaseException of the caller's own (not an Exception): torch runs no always_call hook for it."""


STOPS = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit,
         "CancelledError": asyncio.CancelledError, "_Stop": _Stop}


def _raise_in(block, when, exc=ValueError):
    """A pre-hook on ``block`` that raises ``exc`` while ``when()`` is true (a user error inside the
    model, or a KeyboardInterrupt and the like arriving while it computes)."""
    def hook(module, args):
        if when():
            raise exc(f"injected failure inside a block (forward {when.state['n']})")
    return block.register_forward_pre_hook(hook)


class _Counter:
    def __init__(self, fail_at, rank, ranks):
        self.state = {"n": 0}
        self.fail_at, self.rank, self.ranks = fail_at, rank, ranks

    def __call__(self):
        return self.state["n"] == self.fail_at and self.rank in self.ranks


def _same_weights(sd, ref_sd):
    return sorted(sd) == sorted(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


# --------------------------------------------------------------------------- checks (inside ranks)
def check_block_failure(parallel, rank, *, transfer, failing, block="single", forwards=4, fail_at=1,
                        device="cpu", exc="ValueError", codec="none"):
    """Forward ``fail_at`` raises ``exc`` (a name: ValueError, or one of STOPS) inside a block on
    the ranks in ``failing``; every forward's error (or equality with the resident model) and the
    weights after."""
    model, inputs, ref_model = _toy(rank)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    ref_model = ref_model.to(device)
    with torch.no_grad():
        ref = ref_model(**inputs)
    om = OffloadedTransformer(model, _cfg(weight_transfer=transfer, weight_codec=codec), device=device,
                              parallel=parallel)
    when = _Counter(fail_at, rank, failing)
    target = model.single_blocks[2] if block == "single" else model
    handle = _raise_in(target, when, STOPS.get(exc, ValueError))
    errors, equal, elapsed = [], [], []
    for i in range(forwards):
        when.state["n"] = i
        t0 = time.monotonic()
        try:
            equal.append(torch.equal(_forward(om, inputs), ref))
            errors.append(None)
        except BaseException as e:  # noqa: B036  (a KeyboardInterrupt injected into the model: recorded)
            equal.append(None)
            errors.append(f"{type(e).__name__}: {e}")
        elapsed.append(time.monotonic() - t0)
    handle.remove()
    ref_sd = {k: v.cpu() for k, v in ref_model.state_dict().items()}
    out = dict(errors=errors, equal=equal, elapsed=elapsed, usable=om._streamed.usable,
               failure=om.stats()["failure"])
    if transfer == "allgather":
        out["gathered"] = _same_weights(om.gather_state_dict(), ref_sd)
        out["local"] = om._streamed.local_state_dict()
        out["state_dict_error"] = _run(om.state_dict)
    else:
        out["state_dict"] = _same_weights(om.state_dict(), ref_sd)
    plain = om.disable()
    out["restored"] = _same_weights({k: v.cpu() for k, v in plain.state_dict().items()}, ref_sd)
    with torch.no_grad():
        out["restored_equal"] = torch.equal(plain(**inputs), ref)
    return out


def check_mismatch(parallel, rank, case, odd=1):
    """Rank ``odd`` disagrees at setup: the same ValueError on every rank, the model untouched."""
    model, inputs, ref_model = _toy(rank)
    kw = {}
    if case == "num_slots":
        kw = dict(num_slots=3 if rank == odd else 2)
    elif case == "weight_transfer":
        kw = dict(weight_transfer="rank-local" if rank == odd else "allgather")
    elif case == "resident_layers":
        kw = dict(weight_transfer="rank-local", resident_layers=1 if rank == odd else 2)
    elif case == "cuda_graphs":
        kw = dict(cuda_graphs="on" if rank == odd else "off")
    elif case == "dtype":
        if rank == odd:
            model.double_blocks[0].to(torch.float64)
            ref_model = copy.deepcopy(model)
    elif case == "layout":
        if rank == odd:
            model = ToyDiT(width=48)
            ref_model = copy.deepcopy(model)
    elif case in ("weights", "weights_unchecked"):
        if rank == odd:
            with torch.no_grad():
                model.single_blocks[3].up.weight[0, 0] += 1.0
            ref_model = copy.deepcopy(model)
        if case == "weights_unchecked":
            kw = dict(dlo_verify_weights=False)
    elif case in ("weights_unsampled", "resident", "zero_sign"):
        if rank == odd:
            with torch.no_grad():
                if case == "weights_unsampled":  # one element in the middle: no sample of a few KB per block sees it
                    model.single_blocks[3].up.weight[96, 1] += 1.0
                elif case == "resident":  # outside every streamed block
                    model.head.bias[3] += 1.0
                else:  # 0.0 -> -0.0: equal values, other bits
                    model.single_blocks[1].down.weight.view(-1)[1001] = 0.0
                    model.single_blocks[1].down.weight.view(-1)[1001] *= -1.0
            ref_model = copy.deepcopy(model)
        elif case == "zero_sign":
            with torch.no_grad():
                model.single_blocks[1].down.weight.view(-1)[1001] = 0.0
            ref_model = copy.deepcopy(model)
    else:
        raise ValueError(case)
    error = _run(lambda: OffloadedTransformer(model, _cfg(**kw), device="cpu", parallel=parallel))
    if case == "weights_unchecked":
        return dict(error=error)
    intact = _same_weights(model.state_dict(), ref_model.state_dict())
    return dict(error=error, intact=intact, hooks=len(model._forward_pre_hooks) + len(model._forward_hooks))


def check_agree_capture(parallel, rank, world):
    """The capture decision is collective: one rank's failure (the last rank's) makes
    every rank reset to the captured step's start (the same gathers on each) and run it eagerly."""
    model, inputs, ref_model = _toy(rank)
    with torch.no_grad():
        ref = ref_model(**inputs)
    om = OffloadedTransformer(model, _cfg(), device="cpu", parallel=parallel)
    ex = om.executor
    _forward(om, inputs)
    results = []
    for ok in (rank != world - 1, True):
        ex.capture_tag = 1  # what GraphRunner sets while it captures
        agreed = ex.agree_capture(ok)
        ex.capture_tag = None
        if not agreed:
            ex.reset()
        results.append(agreed)
    equal = [torch.equal(_forward(om, inputs), ref) for _ in range(3)]
    usable = om._streamed.usable
    om.disable()
    return dict(results=results, equal=equal, usable=usable)


def check_dlo_schedule(parallel, rank):
    """graph_boundary_loads='auto' under DLO AllGather keeps the in-graph schedule."""
    cfg = OffloadConfig.layerwise(cuda_graphs="on", progress=False, dlo_timeout_s=5.0)
    sb = dlo.build_streamed(ToyDiT(), cfg, torch.device("cpu"), None, parallel)
    defer_last = sb.schedule.defer_last
    sb.restore()
    return dict(defer_last=defer_last, cls=type(sb.source).__name__)


def check_peer_stays_alive(rank, world):
    """The last rank skips a forward but stays alive: every other rank's forward fails
    within dlo_timeout_s, later calls on it fail at once, and every rank still gives
    back its share of the weights without a collective."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    parallel = ParallelConfig(dp=world, dp_group=group)
    model, inputs, _ = _toy(rank)
    om = OffloadedTransformer(model, _cfg(dlo_timeout_s=TIMEOUT_S), device="cpu", parallel=parallel)
    _forward(om, inputs)
    out = {}
    if rank != world - 1:
        t0 = time.monotonic()
        out["error"] = _run(lambda: _forward(om, inputs))
        out["elapsed"] = time.monotonic() - t0
        t0 = time.monotonic()
        out["later"] = [_run(lambda: _forward(om, inputs)), _run(om.gather_state_dict), _run(om.disable)]
        out["later_elapsed"] = time.monotonic() - t0
    else:
        time.sleep(TIMEOUT_S + 2.0)  # alive, but not in the forward
    out["local"] = om._streamed.local_state_dict()
    return out


def check_setup_one_rank_fails(rank, world):
    """The last rank rejects its config before the setup collective: every other rank's
    setup fails within dlo_timeout_s."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    parallel = ParallelConfig(dp=world, dp_group=group)
    model, _, _ = _toy(rank)
    kw = dict(device_memory_budget_gb=1e-9) if rank == world - 1 else {}
    t0 = time.monotonic()
    error = _run(lambda: OffloadedTransformer(model, _cfg(dlo_timeout_s=TIMEOUT_S, **kw), device="cpu",
                                              parallel=parallel))
    return dict(error=error, elapsed=time.monotonic() - t0)


def check_wave_timeout(rank, world):
    """validate_wave on every rank but the last: bounded by its timeout_s."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    parallel = ParallelConfig(dp=world, dp_group=group)
    if rank == world - 1:
        time.sleep(TIMEOUT_S + 2.0)
        return {}
    t0 = time.monotonic()
    error = _run(lambda: dlo.validate_wave({"num_inference_steps": 4}, parallel, timeout_s=TIMEOUT_S))
    return dict(error=error, elapsed=time.monotonic() - t0)


MISMATCHES = ["num_slots", "weight_transfer", "resident_layers", "cuda_graphs", "dtype", "layout", "weights",
              "weights_unchecked", "weights_unsampled", "resident", "zero_sign"]


class ManyBlocks(torch.nn.Module):
    """Enough blocks that the setup digest folds its per-block lists (over _CONTROL_CAP // 2 of JSON)."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, n: int = 700):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def check_folded_weights(parallel, rank, odd):
    """700 blocks, rank ``odd`` differs in block 650 only: the setup digest's per-block lists are
    folded to fit, and one more small collective still names the block and tensor."""
    model = ManyBlocks()
    if rank == odd:
        with torch.no_grad():
            model.blocks[650].weight[2, 3] += 1.0
    return dict(error=_run(lambda: OffloadedTransformer(model, _cfg(), device="cpu", parallel=parallel)))


@contextlib.contextmanager
def _interrupted_gather(at: int):
    """In this rank process only: the all-gather's ``at``-th call runs, then a KeyboardInterrupt
    arrives (a third-party function replaced, restored after): a load cut short after its
    collective was issued, before the rank saw it complete (or, coded, before its decode)."""
    import torch.distributed as dist

    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original, calls = getattr(dist, name), {"n": 0}

    def interrupted(*args, **kw):
        calls["n"] += 1
        work = original(*args, **kw)
        if calls["n"] == at:
            work.wait()
            raise KeyboardInterrupt(f"injected while waiting for gather {at}")
        return work

    setattr(dist, name, interrupted)
    try:
        yield calls
    finally:
        setattr(dist, name, original)


def check_cut_short(rank, world, codec):
    """The last rank's load is cut short by a KeyboardInterrupt inside its gather (forward 1): it
    re-raises it, and its next forward is refused, named, before any transfer (the slot is never
    decoded into or read); every other rank's forward fails within dlo_timeout_s; every rank gives
    its share back without a collective."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    parallel = ParallelConfig(dp=world, dp_group=group)
    model, inputs, ref_model = _toy(rank)
    with torch.no_grad():
        ref = ref_model(**inputs)
    om = OffloadedTransformer(model, _cfg(dlo_timeout_s=TIMEOUT_S, weight_codec=codec), device="cpu",
                              parallel=parallel)
    out = {"equal": torch.equal(_forward(om, inputs), ref), "errors": [], "elapsed": []}
    with _interrupted_gather(4 if rank == world - 1 else 0):
        for _ in range(2):
            t0 = time.monotonic()
            try:
                _forward(om, inputs)
                out["errors"].append(None)
            except BaseException as e:  # noqa: B036  (the injected KeyboardInterrupt: recorded)
                out["errors"].append(f"{type(e).__name__}: {e}")
            out["elapsed"].append(time.monotonic() - t0)
    out["gather"] = _run(om.gather_state_dict)
    out["local"] = om._streamed.local_state_dict()
    return out


def check_update_on_some_ranks(parallel, rank, world, *, alone: bool, how: str = "update_weights"):
    """update_weights under AllGather (a collective) on every rank with the same weights: the next
    forwards follow it; on the last rank alone (``alone``): the next forward stops on every rank,
    named, instead of computing with mixed shares."""
    model, inputs, ref_model = _toy(rank)
    om = OffloadedTransformer(model, _cfg(weight_transfer="allgather"), device="cpu", parallel=parallel)
    new = {k: v * 2 for k, v in ref_model.state_dict().items() if k.startswith("double_blocks.0.")}
    if not alone or rank == world - 1:
        if how == "update_weights":
            om.update_weights(new)
        else:  # peft's merge writes this way: .data of a streamed parameter assigned
            params = dict(model.named_parameters())
            for k, v in new.items():
                params[k].data = v.clone()
    ref_model.load_state_dict(new, strict=False)
    with torch.no_grad():
        want = ref_model(**inputs)
    out = {"errors": [], "equal": []}
    for _ in range(2):
        try:
            out["equal"].append(torch.equal(_forward(om, inputs), want))
            out["errors"].append(None)
        except Exception as e:
            out["equal"].append(None)
            out["errors"].append(f"{type(e).__name__}: {e}")
    return out


def scenario(rank, world):
    dp = ParallelConfig(dp=world)
    every, last = tuple(range(world)), world - 1
    c = Checks()
    c.run("same_exception_allgather", check_block_failure, dp, rank, transfer="allgather", failing=every)
    c.run("same_exception_rank_local", check_block_failure, dp, rank, transfer="rank-local", failing=every)
    c.run("one_rank_allgather", check_block_failure, dp, rank, transfer="allgather", failing=(last,))
    c.run("one_rank_first_forward", check_block_failure, dp, rank, transfer="allgather", failing=(0,),
          fail_at=0)
    c.run("one_rank_before_blocks", check_block_failure, dp, rank, transfer="allgather", failing=(last,),
          block="root")
    c.run("one_rank_rank_local", check_block_failure, dp, rank, transfer="rank-local", failing=(last,))
    for case in MISMATCHES:
        c.run(f"mismatch_{case}", check_mismatch, dp, rank, case, odd=last)
    c.run("agree_capture", check_agree_capture, dp, rank, world)
    c.run("dlo_schedule", check_dlo_schedule, dp, rank)
    if world == 2:  # any exception type inside a block (2 ranks: the mechanism does not depend on N)
        for exc in STOPS:
            c.run(f"stop_{exc}", check_block_failure, dp, rank, transfer="allgather", failing=(last,), exc=exc)
        c.run("stop_every_rank", check_block_failure, dp, rank, transfer="allgather", failing=every,
              exc="KeyboardInterrupt")
        c.run("stop_exp_k", check_block_failure, dp, rank, transfer="allgather", failing=(last,),
              exc="KeyboardInterrupt", codec="exp-k", forwards=3)
        c.run("folded_weights", check_folded_weights, dp, rank, last)
    c.run("update_every_rank", check_update_on_some_ranks, dp, rank, world, alone=False)
    c.run("update_one_rank", check_update_on_some_ranks, dp, rank, world, alone=True)
    c.run("data_write_one_rank", check_update_on_some_ranks, dp, rank, world, alone=True, how="data")
    # these time out on purpose, each in a group of its own: last
    c.run("setup_one_rank_fails", check_setup_one_rank_fails, rank, world)
    c.run("peer_stays_alive", check_peer_stays_alive, rank, world)
    c.run("wave_timeout", check_wave_timeout, rank, world)
    if world == 2:
        for codec in ("none", "exp-k"):
            c.run(f"cut_short_{codec}", check_cut_short, rank, world, codec)
    return c.report


# 2 ranks as before; 4 and 8 (issue 17): every rank but the odd one must see the failure
@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda n: f"{n}ranks")
def ranks(request, tmp_path_factory):
    n = request.param
    return run_ranks(n, tmp_path_factory.mktemp(f"dlo_trust{n}"), "test_trust_dlo:scenario", timeout=420)


def _healthy(reps, bad):
    return [(r, rep) for r, rep in enumerate(reps) if r != bad]


# --------------------------------------------------------------------------- item 1: nothing lost, usable after
@pytest.mark.parametrize("name", ["same_exception_allgather", "same_exception_rank_local"])
def test_same_exception_on_every_rank_leaves_dlo_usable(ranks, name):
    for r, rep in enumerate(get(ranks, name)):
        assert rep["errors"][0] is None and rep["equal"][0] is True
        assert rep["errors"][1].startswith("ValueError: injected failure inside a block"), (r, rep["errors"])
        # the next forwards on every rank run, bit-exact against the resident model
        assert rep["errors"][2:] == [None, None] and rep["equal"][2:] == [True, True], (r, rep)
        assert rep["usable"] is True and rep["failure"] is None
        assert rep["restored"] and rep["restored_equal"]
        if "allgather" in name:
            assert rep["gathered"] is True
            assert "local_state_dict()" in rep["state_dict_error"]
        else:
            assert rep["state_dict"] is True


@pytest.mark.parametrize("name", ["one_rank_allgather", "one_rank_first_forward", "one_rank_before_blocks"])
def test_one_rank_fails_every_rank_errors_then_usable(ranks, name):
    reps = get(ranks, name)
    fail_at = 0 if name == "one_rank_first_forward" else 1
    bad = 0 if name == "one_rank_first_forward" else len(reps) - 1
    assert reps[bad]["errors"][fail_at].startswith("ValueError: injected failure inside a block")
    for r, rep in _healthy(reps, bad):
        err = rep["errors"][fail_at]
        assert err and err.startswith("RuntimeError") and f"rank {bad}: ValueError: injected failure" in err, (r, err)
        assert rep["elapsed"][fail_at] < 5.0, f"healthy rank {r} waited for a timeout"
    for r, rep in enumerate(reps):
        others = [i for i in range(len(rep["errors"])) if i != fail_at]
        assert all(rep["errors"][i] is None and rep["equal"][i] is True for i in others), (r, rep)
        assert rep["usable"] is True and rep["gathered"] is True and rep["restored"] and rep["restored_equal"]


def test_one_rank_fails_rank_local_is_rank_local(ranks):
    """Rank-local has no collective: only the failing rank sees its error; all stay exact."""
    reps = get(ranks, "one_rank_rank_local")
    bad = reps[-1]
    assert bad["errors"][1].startswith("ValueError: injected failure inside a block")
    assert bad["equal"][2:] == [True, True] and bad["state_dict"] and bad["restored"]
    for r, rep in _healthy(reps, len(reps) - 1):
        assert rep["errors"] == [None] * 4 and all(rep["equal"]), (r, rep)


def test_local_state_dicts_merge_into_the_weights(ranks):
    full = dlo.merge_shards([rep["local"] for rep in get(ranks, "same_exception_allgather")])
    assert _same_weights(full, ToyDiT().state_dict())
    locals_ = [rep["local"] for rep in get(ranks, "one_rank_allgather")]
    pieces = [v for local in locals_ for v in local.values() if isinstance(v, dlo.ShardPiece)]
    assert pieces, "no tensor spans two ranks' shares: the merge of pieces is untested"
    with pytest.raises(ValueError, match="misses bytes"):
        dlo.merge_shards(locals_[:-1])  # every rank's share is needed, the last one's too


# --------------------------------------------------------------------------- any exception type (issue 34)
TWO = pytest.mark.parametrize("ranks", [2], indirect=True, ids=["2ranks"])  # the 2-rank launch only


@TWO
@pytest.mark.parametrize("exc", list(STOPS))
def test_any_base_exception_in_a_block_takes_the_documented_path(ranks, exc):
    """A KeyboardInterrupt, SystemExit, CancelledError or a BaseException of the caller's own inside
    a block on one rank (torch runs no always_call hook for them): that rank completes the step's
    gathers and re-raises its own exception, its peer raises the named RuntimeError (never a
    SIGABRT), and every forward after is bit-exact on every rank."""
    reps = get(ranks, f"stop_{exc}")
    bad = len(reps) - 1
    assert reps[bad]["errors"][1].startswith(f"{exc}: injected failure inside a block"), reps[bad]["errors"]
    for r, rep in _healthy(reps, bad):
        err = rep["errors"][1]
        assert err and err.startswith("RuntimeError") and f"rank {bad}: {exc}: injected failure" in err, (r, err)
        assert rep["elapsed"][1] < 5.0, f"healthy rank {r} waited for a timeout"
    for r, rep in enumerate(reps):
        assert [rep["errors"][i] for i in (0, 2, 3)] == [None] * 3, (r, rep["errors"])
        assert [rep["equal"][i] for i in (0, 2, 3)] == [True] * 3, (r, rep["equal"])
        assert rep["usable"] is True and rep["failure"] is None and rep["gathered"] is True
        assert rep["restored"] and rep["restored_equal"]


@TWO
@pytest.mark.parametrize("name", ["stop_every_rank", "stop_exp_k"])
def test_keyboard_interrupt_on_every_rank_and_under_exp_k(ranks, name):
    """A KeyboardInterrupt on every rank at once: each re-raises its own; under exp-k on one rank
    (whose re-primed gathers used to decode a peer's bytes: a raw decoder ValueError) the
    documented path too. The next forward is bit-exact everywhere."""
    reps = get(ranks, name)
    bad = len(reps) - 1
    for r, rep in enumerate(reps):
        err = rep["errors"][1]
        if name == "stop_every_rank" or r == bad:
            assert err.startswith("KeyboardInterrupt: injected failure inside a block"), (r, err)
        else:
            assert err.startswith("RuntimeError") and f"rank {bad}: KeyboardInterrupt" in err, (r, err)
        others = [i for i in range(len(rep["errors"])) if i != 1]
        assert all(rep["errors"][i] is None and rep["equal"][i] is True for i in others), (r, rep)
        assert rep["usable"] is True and rep["gathered"] is True and rep["restored"] and rep["restored_equal"]


@TWO
@pytest.mark.parametrize("codec", ["none", "exp-k"])
def test_a_load_cut_short_ends_the_backend_named_and_loses_nothing(ranks, codec):
    """A KeyboardInterrupt inside a gather (after it was issued; under exp-k before its decode)
    on one rank: it re-raises it; its next forward and gather_state_dict() are refused at once,
    named, with no transfer (its slot is never decoded into or read); its peer's forward fails
    within dlo_timeout_s; merge_shards of every rank's local_state_dict() is the model's weights."""
    reps = get(ranks, f"cut_short_{codec}")
    bad = len(reps) - 1
    assert all(rep["equal"] for rep in reps)
    b = reps[bad]
    assert b["errors"][0].startswith("KeyboardInterrupt: injected while waiting for gather 4"), b["errors"]
    assert "unusable" in b["errors"][1] and "cut short" in b["errors"][1] and "block '" in b["errors"][1], b
    assert b["elapsed"][1] < 1.0 and "local_state_dict()" in b["gather"]
    for r, rep in _healthy(reps, bad):
        assert "DLOCollectiveError" in rep["errors"][0] and "dlo_timeout_s=2" in rep["errors"][0], (r, rep)
        assert rep["elapsed"][0] < TIMEOUT_S + SLACK_S and "unusable" in rep["errors"][1], (r, rep)
    assert _same_weights(dlo.merge_shards([rep["local"] for rep in reps]), ToyDiT().state_dict())


@TWO
def test_setup_names_the_block_when_the_digest_lists_are_folded(ranks):
    errs = [rep["error"] for rep in get(ranks, "folded_weights")]
    assert len(set(errs)) == 1 and errs[0] and "disagree at setup" in errs[0], errs
    assert "block 'blocks.650' weights differ at tensor 'blocks.650.weight': rank 1" in errs[0], errs[0]


# --------------------------------------------------------------------------- item 2: no hangs
def test_peer_that_stays_alive_fails_within_the_timeout(ranks):
    reps = get(ranks, "peer_stays_alive")
    for r, rep in _healthy(reps, len(reps) - 1):
        err = rep["error"]
        assert err and "DLOCollectiveError" in err and "dlo_timeout_s=2" in err, (r, err)
        assert TIMEOUT_S * 0.9 <= rep["elapsed"] < TIMEOUT_S + SLACK_S, (r, rep["elapsed"])
        later = rep["later"]
        assert "unusable" in later[0], (r, later)
        assert "local_state_dict()" in later[1] and "local_state_dict()" in later[2], (r, later)
        assert rep["later_elapsed"] < 1.0, f"rank {r}: a call after the failure waited on a collective"
    assert "error" not in reps[-1], "the absent rank ran the forward"
    assert _same_weights(dlo.merge_shards([rep["local"] for rep in reps]), ToyDiT().state_dict())


def test_setup_failure_on_one_rank_is_an_error_within_the_timeout(ranks):
    reps = get(ranks, "setup_one_rank_fails")
    assert reps[-1]["error"] and "device_memory_budget_gb" in reps[-1]["error"]
    for r, rep in _healthy(reps, len(reps) - 1):
        err = rep["error"]
        assert err and "DLOCollectiveError" in err and "setup check" in err, (r, err)
        assert rep["elapsed"] < TIMEOUT_S + SLACK_S, (r, rep["elapsed"])


MISMATCH_TEXT = {  # {r}: the rank that differs (the last)
    "num_slots": "rank {r} num_slots=3, rank 0 num_slots=2",
    "weight_transfer": "rank {r} weight_transfer='rank-local', rank 0 weight_transfer='allgather'",
    "resident_layers": "rank {r} resident_layers=1, rank 0 resident_layers=2",
    "cuda_graphs": "rank {r} cuda_graphs='on', rank 0 cuda_graphs='off'",
    "dtype": "rank {r} dtypes=['torch.bfloat16', 'torch.float32', 'torch.float64'], rank 0 dtypes=['torch.bfloat16', "
             "'torch.float32']",
    "layout": "layout differ: rank {r}",
    "weights": "block 'single_blocks.3' weights differ at tensor 'single_blocks.3.up.weight': rank {r}",
    "weights_unsampled": "block 'single_blocks.3' weights differ at tensor 'single_blocks.3.up.weight': rank {r}",
    "resident": "resident tensor 'head.bias' differs: rank {r}",
    "zero_sign": "block 'single_blocks.1' weights differ at tensor 'single_blocks.1.down.weight': rank {r}",
}


@pytest.mark.parametrize("case", list(MISMATCH_TEXT))
def test_setup_mismatch_names_both_values_on_every_rank(ranks, case):
    reps = get(ranks, f"mismatch_{case}")
    assert len({rep["error"] for rep in reps}) == 1, f"the ranks report different errors: {reps}"
    err = reps[0]["error"]
    assert err and err.startswith("ValueError") and "disagree at setup" in err, err
    assert f"over {len(reps)} ranks" in err, err
    assert MISMATCH_TEXT[case].format(r=len(reps) - 1) in err, err
    for rep in reps:
        assert rep["intact"] and rep["hooks"] == 0, "a rejected setup changed the model"


def test_weight_check_is_opt_out(ranks):
    assert [rep["error"] for rep in get(ranks, "mismatch_weights_unchecked")] == [None] * len(ranks)


# --------------------------------------------------------------------------- capture decision, schedule
def test_capture_decision_is_collective(ranks):
    for r, rep in enumerate(get(ranks, "agree_capture")):
        assert rep["results"] == [False, True], (r, rep)
        assert all(rep["equal"]) and rep["usable"], (r, rep)


def test_dlo_allgather_schedule_is_not_next_step(ranks):
    assert [rep["defer_last"] for rep in get(ranks, "dlo_schedule")] == [False] * len(ranks)
    assert {rep["cls"] for rep in get(ranks, "dlo_schedule")} == {"ShardSource"}


def test_dlo_rank_local_schedule_is_not_next_step():
    """graph_boundary_loads='auto' picks the next-step boundary (Schedule.defer_last) for
    plain layerwise graphs, never for DLO (supports_next_step=False)."""
    cfg = OffloadConfig.layerwise(cuda_graphs="on", progress=False)
    plain = streamed_blocks(ToyDiT(), cfg, torch.device("cpu"), None)
    assert plain.schedule.defer_last is True  # the same config outside DLO: the check can fail
    plain.restore()
    rl = OffloadConfig.layerwise(cuda_graphs="on", weight_transfer="rank-local", progress=False)
    sb = dlo.build_streamed(ToyDiT(), rl, torch.device("cpu"), None, ParallelConfig(dp=2))
    assert type(sb.source).__name__ == "PinnedSource" and sb.schedule.defer_last is False
    sb.restore()


def test_request_wave_check_is_bounded(ranks):
    reps = get(ranks, "wave_timeout")
    for r, rep in _healthy(reps, len(reps) - 1):
        assert rep["error"] and "DLOCollectiveError" in rep["error"] and "request-wave" in rep["error"], (r, rep)
        assert rep["elapsed"] < TIMEOUT_S + SLACK_S, (r, rep["elapsed"])


# --------------------------------------------------------------------------- pure parts
def test_digest_mismatches_name_the_values_and_the_block():
    base = {"num_slots": 2, "block_names": ["a", "b"], "block_layouts": ["x", "y"], "dtypes": ["torch.float32"],
            "weights": "w0"}
    other = {**base, "num_slots": 3, "block_layouts": ["x", "z"], "weights": "w1"}
    errs = dlo.digest_mismatches([base, other, base])
    assert "rank 1 num_slots=3, rank 0 num_slots=2" in errs
    assert "block 'b' layout differ: rank 1 z, rank 0 y" in errs
    assert len(errs) == 2, errs  # the weights are compared by weight_mismatches (with the ranks)
    assert dlo.digest_mismatches([base, dict(base)]) == []


def test_fit_digest_folds_long_block_lists():
    d = {"num_slots": 2, "block_names": [f"blocks.{i}" for i in range(4000)],
         "block_layouts": ["0123456789abcdef"] * 4000}
    small = dlo.fit_digest(d)
    assert small["num_slots"] == 2 and isinstance(small["block_layouts"], str)
    assert len(__import__("json").dumps(small)) < 1000
    changed = dlo.fit_digest({**d, "block_layouts": ["0123456789abcdef"] * 3999 + ["x"]})
    assert changed["block_layouts"] != small["block_layouts"]


def test_weight_digest_sees_every_byte():
    """Exact, not sampled: an element in the middle of a tensor, the sign of a zero, a NaN's
    payload each change the digest (bit patterns, not values); equal bytes give equal digests."""
    g = torch.Generator().manual_seed(0)
    t = [torch.randn(300, 200, generator=g), torch.randn(7, generator=g).to(torch.bfloat16), torch.zeros(5)]
    d = tensor_digests(t)
    assert tensor_digests([x.clone() for x in t]) == d and len(set(d)) == 3
    for i, edit in [(0, lambda x: x[150, 101].add_(1e-3)), (2, lambda x: x[2].mul_(-1.0)),
                    (2, lambda x: x.view(torch.int32)[4].fill_(0x7FC00001)),
                    (2, lambda x: x.view(torch.int32)[4].fill_(0x7FC00002))]:
        t2 = [x.clone() for x in t]
        edit(t2[i])
        got = tensor_digests(t2)
        assert got[i] != d[i] and got[1] == d[1]
    assert tensor_digests([t[0].t()]) != tensor_digests([t[0]])  # the same bytes, another shape


def test_weight_digest_reads_every_chunk_of_large_tensors():
    """A tensor larger than one hashing chunk (a Flux single block's proj_out): the last element too."""
    big = torch.zeros(3072 * 15360, dtype=torch.bfloat16)
    other = big.clone()
    other[-1] = 2
    middle = big.clone()
    middle[big.numel() // 2 + 3] = 1
    a, b, c = tensor_digests([big, other, middle])
    assert len({a, b, c}) == 3


@pytest.mark.parametrize("kw,match", [(dict(dlo_timeout_s=0), "dlo_timeout_s=0"),
                                      (dict(dlo_timeout_s=float("nan")), "dlo_timeout_s=nan"),
                                      (dict(dlo_timeout_s="5"), "dlo_timeout_s='5'"),
                                      (dict(dlo_verify_weights=1), "dlo_verify_weights=1")])
def test_dlo_config_keys_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        OffloadConfig.layerwise(**kw)
    cfg = OffloadConfig.layerwise(dlo_timeout_s=3, dlo_verify_weights=False)
    assert cfg.dlo_timeout_s == 3.0 and OffloadConfig.from_dict(cfg.to_dict()) == cfg
    assert OffloadConfig.layerwise().dlo_timeout_s == 60.0 and OffloadConfig.layerwise().dlo_verify_weights


def test_update_weights_is_agreed_never_mixed(ranks):
    """update_weights on every rank: bit-exact after; on one rank only: every rank's next forward
    raises (the weights versions differ in the end-of-step agreement), none returns mixed shares."""
    for r, rep in enumerate(get(ranks, "update_every_rank")):
        assert rep["errors"] == [None, None] and rep["equal"] == [True, True], (r, rep)
    for r, rep in enumerate(get(ranks, "update_one_rank") + get(ranks, "data_write_one_rank")):
        assert rep["equal"] == [None, None], (r, rep)
        assert all("the ranks hold other weights" in e and "collective" in e for e in rep["errors"]), (r, rep)
