"""Pageable blocks through pinned bounce buffers (PinnedSource's staged path), on the CPU.

``PinnedSource(req, stage=True)`` stages every unpinned block on any device
(on the CPU nothing is pinned: every block stages through the real Stager,
its packer thread and its two buffers). Outputs are compared bit for bit
with the resident model; the stream/event order of the staged path (the
CUDA code path, run under RecordingStreams) is checked with stream_trace,
the bounce buffers included.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings

import pytest
import torch

from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.offload.schedule import Schedule
from weightstream.offload.sources.pinned import PinnedSource
from weightstream.offload.streams import Op, RecordingStreams
from weightstream.offload.build import streamed_blocks
from weightstream.offload.streamed import StreamedBlocks

from layerwise_cases import build, first
from stream_trace import check, counts

DEV = torch.device("cpu")
MODES = {"ring": {}, "step_local": {"step_local": True}, "defer_last": {"defer_last": True}}


def staged(**kw):
    return lambda req: PinnedSource(req, stage=True, **kw)


def streamed_cls(slots: int, mode: str, streams=None):
    def _schedule(self, num_blocks, resident):
        return Schedule(num_blocks, resident, slots, **MODES[mode])

    return type("BounceStreamed", (StreamedBlocks,), {"_schedule": _schedule, "streams": streams})


class Bounce:
    """A model wrapped with every streamed block staged, its resident reference and inputs."""

    def __init__(self, name="toy", *, slots=2, resident=0, mode="ring", streams=None, source=None):
        model, self.ref, self.x = build(name, DEV)
        cfg = OffloadConfig.layerwise(resident_layers=resident, num_slots=max(2, slots), progress=False)
        cls = streamed_cls(slots, mode, streams)
        st = streamed_blocks(model, cfg, DEV, None, source=source or staged(), cls=cls)
        self.wrapped = OffloadedTransformer(model, cfg, device=DEV, streamed=st)
        self.source = st.source

    def check(self, steps=1):
        with torch.no_grad():
            want = first(self.ref(**self.x))
            for i in range(steps):
                got = first(self.wrapped(**self.x))
                assert torch.equal(got, want), f"step {i}: max diff {(got - want).abs().max()}"

    def interrupt(self, k: int):
        """A forward that raises inside streamed block ``k`` (its weights bound)."""
        blk = self.wrapped.executor.blocks[self.wrapped.executor.schedule.streamed[k]].module

        def boom(module, args):
            raise RuntimeError("boom")

        handle = next(iter(blk.children())).register_forward_pre_hook(boom)
        try:
            with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.wrapped(**self.x)
        finally:
            handle.remove()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name, resident, slots", [("toy", 0, 2), ("toy", 3, 3), ("flux", 0, 2), ("wan", 1, 2)])
def test_staged_blocks_are_bit_exact(name, resident, slots, mode):
    case = Bounce(name, slots=slots, resident=resident, mode=mode)
    n = case.wrapped.stats()["blocks_streamed"]
    case.check(steps=3)
    s = case.wrapped.stats()
    assert s["staged_blocks"] == n and s["staging_buffers"] == 2 and s["staging_kind"] == "pageable"
    assert s["staging_packs"] >= 3 * n and s["staging_packed_bytes"] >= 3 * s["h2d_bytes_per_step"]
    assert s["staging_restarts"] == 0  # every load came in the order the packer walked
    case.wrapped.disable()


@pytest.mark.filterwarnings("ignore:weightstream. a forward started before")
@pytest.mark.parametrize("mode", list(MODES))
def test_interrupted_step_restarts_the_stager(mode):
    case = Bounce("toy", slots=2, mode=mode)
    case.check()
    case.interrupt(3)
    case.check(steps=2)
    assert case.wrapped.stats()["staging_restarts"] >= 1


def _new_weights(ref) -> dict:
    g = torch.Generator().manual_seed(7)
    sd = {k: v + torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else v
          for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd)
    return sd


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("resident", [0, 2])
def test_update_weights_reaches_the_next_forward(mode, resident):
    """The packer has already packed the next blocks with the old weights: the
    update must drop them (PinnedSource.reload), under every schedule."""
    case = Bounce("toy", slots=2, resident=resident, mode=mode)
    case.check()
    assert case.source.stager.wait_idle(10)  # both buffers hold blocks packed before the update
    case.wrapped.update_weights(_new_weights(case.ref))
    case.check(steps=2)


@pytest.mark.parametrize("mode", list(MODES))
def test_state_dict_edit_reaches_the_next_forward(mode):
    """An in-place edit of a state_dict() tensor moves the arena's version; the
    next step reloads, and blocks packed ahead before the edit are dropped."""
    case = Bounce("toy", slots=2, mode=mode)
    case.check()
    assert case.source.stager.wait_idle(10)
    streamed = [k for k in case.wrapped.state_dict() if k.startswith(("double_blocks.", "single_blocks."))]
    assert len(streamed) > 4
    with torch.no_grad():
        for key in streamed:
            case.wrapped.state_dict()[key].mul_(-0.5)
            case.ref.state_dict()[key].mul_(-0.5)
    case.check(steps=2)


def test_copy_pool_packs_large_blocks():
    class PoolSource(PinnedSource):
        pool_min_bytes = 0  # every image "large": split over the CopyPool's threads

    case = Bounce("flux", slots=2, source=lambda req: PoolSource(req, stage=True, staging_threads=3))
    case.check(steps=2)
    st = case.source.stager
    assert st.pool is not None and st.pool.bytes == case.wrapped.stats()["staging_packed_bytes"] > 0
    case.wrapped.disable()


def test_disable_stops_the_packer_and_restores_weights():
    case = Bounce("toy", slots=2)
    case.check()
    thread = case.source.stager._thread
    model = case.wrapped.disable()
    assert not thread.is_alive()
    with torch.no_grad():
        assert torch.equal(first(model(**case.x)), first(case.ref(**case.x)))


def test_stage_choices():
    model, _, _ = build("toy", DEV)
    cfg = OffloadConfig.layerwise(progress=False)
    with pytest.raises(ValueError, match="stage='yes' is not allowed; choose from: None"):
        streamed_blocks(model, cfg, DEV, None, source=lambda req: PinnedSource(req, stage="yes"))
    for stage in (None, False):  # the CPU default and the pageable path: no stager
        model, ref, x = build("toy", DEV)
        st = streamed_blocks(model, cfg, DEV, None, source=lambda req, s=stage: PinnedSource(req, stage=s))
        wrapped = OffloadedTransformer(model, cfg, device=DEV, streamed=st)
        assert st.source.stager is None and wrapped.stats()["staged_blocks"] == 0
        assert st.source.uncapturable() is None
        with torch.no_grad():
            assert torch.equal(first(wrapped(**x)), first(ref(**x)))


def test_uncapturable_names_the_staged_blocks():
    case = Bounce("toy", slots=2)
    why = case.wrapped.executor.uncapturable()
    assert "cannot capture the 7 block(s) that stage through pinned bounce buffers" in why
    assert "pinned_memory_budget_gb" in why


# ----------------------------------------------------------------- stream order, bounce buffers included
class ThreadedRecording(RecordingStreams):
    """RecordingStreams whose trace also notes the host thread of every op (the
    packer thread synchronises h2d_done events from its own thread)."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self.threads: list[int] = []

    def _add(self, kind, stream, **kw):
        with self._lock:
            self.threads.append(threading.get_ident())
            self.trace.append(Op(len(self.trace), kind, stream, **kw))

    def packed(self, b: int, k: int) -> None:
        """The packer wrote buffer ``b`` (host work: a write on its own lane the host then waits for)."""
        with self._lock:
            for kind, kw in (("access", {"access": "write", "slot": ("stage", b), "what": k}), ("sync_stream", {})):
                self.threads.append(threading.get_ident())
                self.trace.append(Op(len(self.trace), kind, "packer", **kw))


class TracedSource(PinnedSource):
    """The real staged source; its packer notes each pack in the trace."""

    def packer(self):
        inner, ready = super().packer(), threading.Event()
        self.attached = ready

        def pack(k, buf, pool):
            inner(k, buf, pool)
            ready.wait(10)  # self.stager is set once attach() returns
            b = next(i for i, x in enumerate(self.stager.buffers) if x.tensor.data_ptr() == buf.data_ptr())
            self.streams.packed(b, k)

        pack.bytes = 0
        return pack

    def attach(self, slots, streams, device):
        super().attach(slots, streams, device)
        self.attached.set()


def _split(rec: ThreadedRecording) -> tuple[list[Op], list[Op]]:
    """(the forward thread's ops, every op): the slot rules read the first (a
    packer thread's host waits do not order the forward thread's work on CUDA)."""
    main = threading.get_ident()
    own = [op for op, t in zip(rec.trace, rec.threads) if t == main and not _stage(op)]
    return [dataclasses.replace(op, index=i) for i, op in enumerate(own)], list(rec.trace)


def _stage(op: Op) -> bool:
    return isinstance(op.slot, tuple) and op.slot[0] == "stage"


def _violations(rec: ThreadedRecording) -> tuple[dict, dict]:
    """(slot rules broken on the forward thread's trace, bounce-buffer rules
    broken on the whole trace). ``overlap`` does not apply to a bounce buffer:
    its reads run on the copy stream, after that stream's earlier slot writes."""
    main, full = _split(rec)
    slots = {r: v[:3] for r, v in check(main).items() if v}
    stage = {r: [x for x in v if "('stage'" in x.split(":")[0].split(" is ")[0]][:3]
             for r, v in check(full).items() if r != "overlap"}
    return slots, {r: v for r, v in stage.items() if v}


def _run_traced(source_cls, slots, mode, resident=0):
    rec = ThreadedRecording()
    case = Bounce("toy", slots=slots, resident=resident, mode=mode, streams=rec,
                  source=lambda req: source_cls(req, stage=True))
    for _ in range(3):
        case.check()
    case.interrupt(2)
    case.check()
    case.wrapped.update_weights(_new_weights(case.ref))
    case.check()
    case.wrapped.disable()  # joins the packer: its last ops are in the trace
    return rec


@pytest.mark.filterwarnings("ignore:weightstream. a forward started before")
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("slots, resident", [(1, 0), (2, 0), (3, 1)])
def test_staged_path_is_ordered(slots, resident, mode):
    rec = _run_traced(TracedSource, slots, mode, resident)
    main, full = _split(rec)
    c = counts(full)
    assert c["reads"] >= 2 * 5 * (7 - resident) and c["writes"] >= 2 * 5 * (7 - resident), c
    assert any(op.stream == "packer" for op in full) and any(op.kind == "sync_event" for op in full)
    assert _violations(rec) == ({}, {})


@pytest.mark.filterwarnings("ignore:weightstream. a forward started before")
def test_missing_h2d_done_record_is_caught():
    """Mutation: the H2D out of a bounce buffer records no h2d_done. The outputs
    stay bit-exact on the CPU; the trace shows the packer rewriting a buffer
    that a copy may still read."""

    class NoRecord(TracedSource):
        def _load_staged(self, k, slot, position):
            st, streams = self.stager, self.streams
            b = st.acquire(position)
            streams.access("read_begin", ("stage", b), k)
            self.slots[slot][: self.layouts[k].nbytes].copy_(st.buffers[b].tensor[: self.layouts[k].nbytes])
            streams.access("read_end", ("stage", b), k)
            st.release(b, position)  # h2d_done[b] never recorded
            return None

    class Twin(TracedSource):  # the same code with the record: clean
        def _load_staged(self, k, slot, position):
            st, streams = self.stager, self.streams
            b = st.acquire(position)
            streams.access("read_begin", ("stage", b), k)
            self.slots[slot][: self.layouts[k].nbytes].copy_(st.buffers[b].tensor[: self.layouts[k].nbytes])
            streams.access("read_end", ("stage", b), k)
            st.h2d_done[b].record(streams.current_stream(self.device))
            st.release(b, position)
            return None

    slots_bad, stage_bad = _violations(_run_traced(NoRecord, 2, "ring"))
    assert not slots_bad and {"write_after_previous_read", "no_concurrent_write"} <= set(stage_bad), stage_bad
    assert _violations(_run_traced(Twin, 2, "ring")) == ({}, {})



# ----------------------------------------------------------------- perf modes (CPU plumbing)
def test_half_pinned_modes_parse_and_ratio():
    from perf.modes import parse_mode
    from perf.results import summarise

    pinned, pageable = parse_mode("layerwise-pinned-half"), parse_mode("layerwise-pageable-half")
    assert (pinned.half_pinned, pinned.stage) == (True, True) and (pageable.half_pinned, pageable.stage) == (True, False)
    out = summarise({"resident": {"step_ms": 10.0}, "layerwise": {"step_ms": 20.0, "streamed_gb": 1.0},
                     "layerwise-pinned-half": {"step_ms": 24.0, "streamed_gb": 1.0},
                     "layerwise-pageable-half": {"step_ms": 40.0, "streamed_gb": 1.0}}, 50.0)
    assert out["layerwise-pinned-half"]["ratio_to_pinned"] == pytest.approx(1.2)
    assert out["layerwise-pageable-half"]["ratio_to_pinned"] == pytest.approx(2.0)
    assert "ratio_to_pinned" not in out["layerwise"]


def test_half_pinned_modes_run_tiny_on_cpu(tmp_path):
    """The harness end to end (--tiny, CPU): both modes run in workers, compute the
    resident output bit for bit, and report ratio_to_pinned and the staging figures."""
    from perf.harness import run  # the checkout's root is on sys.path (conftest.py)

    modes = ["layerwise", "layerwise-pinned-half", "layerwise-pageable-half"]
    result, _, ok = run("flux-12b-1024", modes, steps=2, warmup=1, out_dir=tmp_path / "res", tiny=True,
                        device="cpu", touch_gb=0, mode_timeout=300)
    assert ok, result.get("failed")
    figs = result["modes"]
    for mode in modes[1:]:
        f = figs[mode]
        assert f["output_equals_resident"] is True, mode
        assert f["ratio_to_pinned"] == pytest.approx(f["step_ms"] / figs["layerwise"]["step_ms"], rel=1e-2)
        assert "pinned_memory_budget_gb" in repr(f["notes"]["config"])
    staged, pageable = figs["layerwise-pinned-half"]["stats"], figs["layerwise-pageable-half"]["stats"]
    n = staged["blocks_streamed"]
    # CPU pins nothing: the pinned-half mode stages every block, the pageable one none
    assert staged["staged_blocks"] == n and staged["staging_packs"] >= 3 * n and staged["staging_pack_gbps"] > 0
    assert pageable["staged_blocks"] == 0 and pageable["staging_buffers"] == 0


@pytest.mark.filterwarnings("ignore:weightstream. a forward started before")
@pytest.mark.parametrize("at", range(1, 7))
def test_edit_after_an_interrupted_step_reaches_the_next_forward(at):
    """An interrupted step, then a state_dict edit: the re-prime reads the store
    as it is now, whatever the packer packed ahead before the edit (a re-prime at
    exactly the packer's next position restarts nothing: at=5 failed before the
    version check in _load_staged). at=0 is left out: interrupted in the step's
    first streamed block, the next forward resumes that step without re-reading
    the store, and the plain pinned path (stage=False) keeps the stale slot too
    (executor behaviour, reported to the lead)."""
    case = Bounce("toy", slots=2)
    case.check()
    case.interrupt(at)
    assert case.source.stager.wait_idle(10)
    key = next(k for k in case.wrapped.state_dict() if k.startswith("double_blocks.0."))
    with torch.no_grad():
        case.wrapped.state_dict()[key].mul_(-0.5)
        case.ref.state_dict()[key].mul_(-0.5)
    case.check(steps=2)


@pytest.mark.parametrize("name, resident", [("toy", (1, 4)), ("toy", (0, 6)), ("flux", (2,))])
def test_auto_placement_rebuilds_the_ring_over_staged_blocks(name, resident):
    """resident_layers='auto': the executor is rebuilt over a subset of the source's
    blocks; the source re-attaches, its stager walks the new ring (positions now
    load other blocks) and the outputs stay bit-exact. The planner's first plan is
    replaced by one with the given resident blocks (its choice depends on CPU timings)."""
    model, ref, x = build(name, DEV)
    cfg = OffloadConfig.layerwise(resident_layers="auto", device_memory_budget_gb=1.0, progress=False)
    st = streamed_blocks(model, cfg, DEV, None, source=staged())
    wrapped = OffloadedTransformer(model, cfg, device=DEV, streamed=st)
    n = len(st.source.layouts)
    first_stager = st.source.stager
    with torch.no_grad():
        want = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), want)  # measured, planned, placed
        auto = st.placement
        plan = dataclasses.replace(auto.current, placement=dataclasses.replace(
            auto.current.placement, resident=resident, num_slots=2))
        auto.plans = {sig: plan for sig in auto.plans}
        auto.apply(plan)
        for i in range(3):
            assert torch.equal(first(wrapped(**x)), want), f"step {i}"
    ring = st.source._ring
    assert ring == [k for k in range(n) if st.source.layouts[k].index not in resident]
    assert st.source.stager is not first_stager and not first_stager._thread.is_alive()
    assert wrapped.stats()["staging_packs"] >= 3 * len(ring)
    back = wrapped.disable()
    with torch.no_grad():
        assert torch.equal(first(back(**x)), want)


# -- which blocks a pinned budget pins (pure) --------------------------------------------------
from weightstream.offload.host.arena import spread_pins  # noqa: E402


@pytest.mark.parametrize("sizes", [[4] * 10, [4] * 9, [8] * 19 + [3] * 38, [1, 9, 2, 8, 3, 7, 4, 6, 5], [5]])
@pytest.mark.parametrize("share", [0.0, 0.1, 0.3, 0.5, 0.7, 0.99, 1.0, 2.0])
def test_spread_pins_stays_in_budget_and_spreads(sizes, share):
    total = sum(sizes)
    budget = int(total * share)
    chosen = spread_pins(sizes, budget)
    assert sum(sizes[i] for i in chosen) <= budget
    if budget >= total:
        assert chosen == frozenset(range(len(sizes)))
    # no room left: every unchosen block is larger than the budget left over
    left = budget - sum(sizes[i] for i in chosen)
    assert all(sizes[i] > left for i in range(len(sizes)) if i not in chosen)
    # spread: the pinned bytes through any block stay within two blocks of the budget's share
    done = pinned = 0
    for i, n in enumerate(sizes):
        done += n
        pinned += n if i in chosen else 0
        want = min(budget, total) / total * done
        assert want - 2 * max(sizes) - 1e-9 <= pinned <= want + 3 * max(sizes) + 1e-9, (i, sorted(chosen))


def test_spread_pins_alternates_at_half_and_pins_all_without_budget():
    assert spread_pins([4] * 8, 16) == frozenset({0, 2, 4, 6})
    assert spread_pins([4] * 8, None) == frozenset(range(8))
    assert spread_pins([4] * 8, 0) == frozenset()
