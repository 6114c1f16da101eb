"""Eager executor: per-block hooks drive the schedule over fixed device slots.

Forward lifecycle of a streamed block (DESIGN.md section 3):
1. the compute stream waits on the event of the copy that filled its slot;
2. parameters and buffers are rebound to views into the slot (identity kept);
3. the block computes;
4. "slot free" is recorded on the compute stream; the copy stream waits on it
   and copies the image of the block that next uses this slot;
5. the block's tensors go back to placeholders.

Correctness comes from these stream/event dependencies only: there is no
global synchronize on this path. On ``device="cpu"`` the same mechanism runs
with synchronous copies and no streams. Every stream/event operation goes
through ``self.streams`` (:mod:`streams`): torch's own on CUDA; in tests,
``RecordingStreams`` runs this CUDA code path with CPU tensors and records it.

Misuse guards (errors in :mod:`.misuse`), a few integer reads per block:
a thread id compare (:class:`ConcurrentUseError` for a second thread); the
version counters of a block's tensors at bind and unbind
(:class:`StreamedWriteError` for an in-place write during the block's forward,
or to a placeholder between forwards, and for ``.data`` replaced between
forwards); ``torch.is_grad_enabled()`` (:class:`InferenceOnlyError` at the first
backward). Not detected: writes that do not move a version counter (through
``.data``, numpy, ctypes, or kernels that update buffers internally, such as
batch_norm's running statistics; a BatchNorm in train mode is still caught by
its ``num_batches_tracked`` counter) and ``.data`` replaced inside a block's
forward.
"""
from __future__ import annotations

import threading
import warnings

import torch
from torch import nn

from .discovery import Block
from .event_log import EventLog, _Record
from .hooks import BlockHook, StepHook
from .layout import block_tensors
from .misuse import StreamedWriteError
from .ownership import Ownership
from .placeholders import Placeholders, empty_like_dtype
from .schedule import Load, Schedule
from .streams import resolve_streams


class LayerwiseExecutor:
    """Streams the blocks of ``schedule.streamed`` through fixed device slots.

    The bytes come from ``source`` (a :class:`~.sources.base.WeightSource`): the
    executor owns the ring (slots, copy stream, loaded/freed events, bindings,
    capture tags) and calls ``source.load`` for every load. ``guard`` (DLO, see
    :mod:`.dlo_guard`): sticky failures and the decisions every rank takes together.
    """

    def __init__(
        self,
        blocks: list[Block],
        source,
        schedule: Schedule,
        device: torch.device,
        *,
        record_events: bool = False,
        prime: str = "now",
        streams=None,
        guard=None,
        ownership: Ownership | None = None,
        placeholders: Placeholders | None = None,
    ):
        self.blocks = blocks
        self.source = source
        self.guard = guard
        self.schedule = schedule
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"  # tensors on CUDA (non-blocking copies, record_stream)
        # stream/event backend (streams.py): CUDA streams on CUDA, None (no streams) on the CPU
        self.streams = resolve_streams(streams, self.device)
        # source index k of every block the source holds (under resident_layers="auto" the
        # source holds every block and the schedule streams a subset of them)
        self.k_of = {lay.index: k for k, lay in enumerate(source.layouts)}
        missing = [i for i in schedule.streamed if i not in self.k_of]
        if missing:
            raise ValueError(f"the weight source holds no image of streamed block(s) {missing[:5]}")
        self.slot_bytes = source.slot_bytes_of([self.k_of[i] for i in schedule.streamed])  # the blocks it streams
        self.slots = [
            torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(schedule.ring_slots)
        ]
        if self.streams is not None:
            self.copy_stream = self.streams.new_stream(self.device)
            for slot in self.slots if self.cuda else ():
                # freed without disable() while a prefetch is in flight, the memory
                # is not handed out again before the copy stream's work is done
                slot.record_stream(self.copy_stream)
            self.loaded = [self.streams.new_event() for _ in self.slots]
            self.freed = [self.streams.new_event() for _ in self.slots]
            with self.streams.stream(self.copy_stream):  # attach runs with the copy stream current
                source.attach(self.slots, self.streams, self.device)
        else:
            source.attach(self.slots, None, self.device)
        # targets[k]: tensor objects of streamed block k in layout order;
        # views[k][s]: their views in slot s; placeholders[k]: empty stand-ins.
        self.targets = []
        self.views = []
        self.placeholders = []
        empties: dict[torch.dtype, torch.Tensor] = {}
        for lay in source.layouts:
            objs = [t for _, _, t in block_tensors(blocks[lay.index].module)]
            self.targets.append(objs)
            specs = lay.tensors
            streams_here = schedule.is_streamed(lay.index)  # else resident under auto placement: no slot views
            self.views.append([[spec.view_of(slot) for spec in specs] for slot in self.slots] if streams_here else None)
            self.placeholders.append(
                [empty_like_dtype(s.dtype, self.device, empties) for s in specs]
            )
        self.position = 0  # next position to compute
        # Events may only be waited on in the context that recorded them: eagerly
        # (tag None) or inside the same graph capture (its tag). A load recorded
        # in an earlier capture ran inside that graph's replay, which the
        # launching stream already orders after; it needs no wait.
        self.capture_tag = None
        self._load_tag = [None] * schedule.ring_slots
        self._bound: int | None = None  # streamed index currently bound
        self.log = EventLog(cuda=self.cuda) if record_events else None
        self._log_once = False  # the log was opened by log_next_step() and closes at take_events()
        if self.log is not None:
            self.log.origin = self.log.mark(torch.cuda.current_stream(self.device) if self.cuda else None)
        self._share_log()
        self.hooks = [BlockHook(self, blocks[i]) for i in schedule.streamed]
        self._compute_stream = None
        # Step-start loads of the defer_last schedule are issued when the step's
        # first streamed block starts, ordered only after the step's start by an
        # event recorded there. Inside a CUDA graph a copy created before any of
        # the step's kernels becomes the graph's first branch and runs on the
        # launching stream, where H2D copies measured ~5% slower (52.5 vs 55.5
        # GB/s on the H200, perf/results/pacing-*); created after the DiT's first
        # kernels it runs beside them at full rate.
        self._late: tuple | None = None
        # Misuse guards (see acquire, _bind, _unbind, _check_host_edits):
        # _versions[k]: the version counters of block k's tensors while unbound; a
        # change means a write that streaming would lose. host_version(): the
        # source's host views (state_dict()) share one version counter.
        self._versions = [[t._version for t in objs] for objs in self.targets]
        self._host_version = source.host_version()
        self._started: int | None = None  # position whose step-start work was done
        # the thread running a step, an update or disable() (shared with StreamedBlocks: one per model)
        self.ownership = ownership if ownership is not None else Ownership()
        self.ownership.add_entries(self, *(blocks[i].module for i in schedule.streamed))
        # placeholders that refuse reads/writes between forwards (placeholders.py); per streamed
        # block (own class, placeholder class) of each target, swapped at bind / unbind
        self.ph = placeholders
        self._classes = [[(type(t), placeholders.placeholder_class(type(t))) for t in objs]
                         if placeholders is not None else None for objs in self.targets]
        for i in schedule.streamed:
            self._unbind(self.k_of[i])
        if prime not in ("now", "first_forward"):
            raise ValueError(f"prime={prime!r} is not allowed; choose from: now, first_forward")
        self._primed = False
        if prime == "now":
            self._prime()

    def _prime(self) -> None:
        """Issue the loads every slot's first user needs. Collective executors
        prime at the first forward so that every rank issues them in the same order.
        Step-local schedules load at every step start instead (:meth:`begin_step`)."""
        self._primed = True
        for load in self.schedule.priming():
            self._issue(load, wait_free=False)

    def attach_root(self, root: nn.Module) -> None:
        """Hook the DiT's forward: it holds the model for the calling thread and,
        with step-start loads, starts each step. A call that skips the hook
        (``root.forward(...)``) is caught by the step's first streamed block."""
        self.hooks.append(StepHook(self, root))

    # -- one thread at a time (ownership.py) ---------------------------------------
    def acquire(self, what: str = "a forward") -> int:
        """Hold the model for the calling thread until :meth:`release` (re-entrant); returns
        the depth before, for :meth:`release_to`. Another thread entering meanwhile gets
        ConcurrentUseError, never a slot."""
        return self.ownership.acquire(what)

    def release(self) -> None:
        self.ownership.release()

    def release_to(self, depth: int) -> None:
        self.ownership.release_to(depth)

    def begin_step(self) -> None:
        """Issue this step's step-start loads, after everything the compute stream
        did before (the previous step's readers of the slots)."""
        if not self._primed:
            self._prime()
        if self.position % self.schedule.n:
            if self._bound is not None:
                self._resync()  # the previous step stopped inside a block (an exception)
                return
            self.finish_step()  # its last blocks were skipped
        self._start_step()

    def _start_step(self) -> None:
        """Work at a step boundary, once per step: pick up host edits, step-start loads."""
        # once per step, however the step was entered or skipped into; before _started is
        # set, so a step whose check raised checks again (and raises again) when re-entered
        self.source.check()
        self._started = self.position
        self._check_host_edits()
        if self.schedule.has_step_start:
            self._step_start_loads()

    def _check_host_edits(self) -> None:
        """Reload prefetched slots when the host store was written in place through
        torch since they were loaded (a ``state_dict()`` tensor edited in place:
        every host view shares the arena's version counter, so this is one integer
        read per step). Writes that bypass torch (numpy, ctypes, ``.data`` of a
        view) do not move the counter and are not detected."""
        if self.ph is not None and self.ph.handed:
            self.ph.flush()  # edited .data copies of unbound tensors: written like update_weights()
        if self.source.host_version() == self._host_version:
            return
        if self.streams is not None:  # order the reloads after every reader and loader of the slots so far
            compute = self.streams.current_stream(self.device)
            for side in self.side_streams():
                side.wait_stream(compute)
        self.reload_pending()

    def _step_start_loads(self, loads: list[Load] | None = None) -> None:
        if loads is None:
            loads = self.schedule.step_start(self.schedule.step_of(self.position))
        if not loads:
            return
        if self.schedule.defer_last and self.position % self.schedule.n == 0:
            ev = None
            if self.streams is not None:
                ev = self.streams.new_event()
                ev.record(self.streams.current_stream(self.device))
            self._late = (ev, loads)
            return
        if self.streams is not None:
            compute = self.streams.current_stream(self.device)
            for side in self.side_streams():
                side.wait_stream(compute)
        for load in loads:
            self._issue(load, wait_free=False)

    def _issue_late(self) -> None:
        ev, loads = self._late
        self._late = None
        if ev is not None:
            for side in self.side_streams():
                side.wait_event(ev)
        for load in loads:
            self._issue(load, wait_free=False)

    # -- copies ----------------------------------------------------------------
    def _issue(self, load: Load, *, wait_free: bool = True) -> None:
        """Order and record one load; the source moves the bytes (``source.load``)."""
        if self.guard is None:
            self._issue_load(load, wait_free)
            return
        self.guard.check()
        try:
            self._issue_load(load, wait_free)
        except BaseException as e:  # a KeyboardInterrupt too: the load it cut short is never issued
            self.guard.mark_failed(f"{type(e).__name__}: {e} (the load of block {self.blocks[load.block].name!r} "
                                   f"was cut short, step {self.schedule.step_of(load.position)})")
            raise

    def _issue_load(self, load: Load, wait_free: bool) -> None:
        rec = None
        if self.log is not None:
            rec = _Record(self.schedule.step_of(load.position), load.block, "copy")
            self.log.records.append(rec)
        k = self.k_of[load.block]
        after = self.freed[load.slot] if self.streams is not None and wait_free and \
            load.after_position is not None else None
        if self.streams is None:
            if rec is not None:
                rec.start = self.log.mark()
            self.source.load(k, load.slot, position=load.position, after=None, tag=None)
            if rec is not None:
                rec.end = self.log.mark()
            return
        cs = self.copy_stream
        if after is not None and not self.source.waits_for_free_of(k):
            cs.wait_event(after)  # before the copy record starts: it times the copy, not the wait
        with self.streams.stream(cs):
            if rec is not None:
                rec.start = self.log.mark(cs)
            done = self.source.load(k, load.slot, position=load.position, after=after, tag=self.capture_tag)
            if self.source.caps.writes_at_use:
                pass  # the source writes the slot in before_use (a decode issued at use) and notes it there
            elif done is None or done is cs:
                done = cs
                self.streams.access("write", load.slot, load.block)
            else:
                with self.streams.stream(done):  # the slot's last write ran there (a gather)
                    self.streams.access("write", load.slot, load.block)
            self.loaded[load.slot].record(done)
            self._load_tag[load.slot] = self.capture_tag
            if rec is not None:
                rec.end = self.log.mark(cs)  # the copy; a source's later stages log their own lanes

    # -- binding ---------------------------------------------------------------
    def _bind(self, k: int, slot: int) -> None:
        ts = self.targets[k]
        classes = self._classes[k]
        if classes is not None:
            for t, (own, _) in zip(ts, classes):
                t.__class__ = own
        if [t._version for t in ts] != self._versions[k] or any(map(torch.Tensor.numel, ts)):
            self._refuse_placeholder_edit(k)
        for t, v in zip(ts, self.views[k][slot]):
            t.data = v
        self._bound = k

    def _unbind(self, k: int) -> list[int]:
        """Back to placeholders; returns the indices of tensors written while bound."""
        ts = self.targets[k]
        classes = self._classes[k]
        if classes and type(ts[0]) is not classes[0][0]:  # unbound already: own classes first
            for t, (own, _) in zip(ts, classes):
                t.__class__ = own
        for t, ph in zip(ts, self.placeholders[k]):
            t.data = ph
        if self._bound == k:
            self._bound = None
        seen = [t._version for t in ts]
        if classes is not None:
            for t, (_, sub) in zip(ts, classes):
                t.__class__ = sub
        if seen == self._versions[k]:
            return []
        written = [i for i, (a, b) in enumerate(zip(seen, self._versions[k])) if a != b]
        self._versions[k] = seen
        return written

    def _names(self, k: int, idx) -> list[str]:
        name = self.source.layouts[k].name
        specs = self.source.layouts[k].tensors
        return [f"{name}.{specs[i].name}" for i in idx]

    def _refuse_placeholder_edit(self, k: int) -> None:
        """A streamed tensor was edited between forwards (in place, or ``.data``
        replaced) while it held its empty placeholder: undo, raise."""
        ts = self.targets[k]
        idx = [i for i, t in enumerate(ts) if t._version != self._versions[k][i] or t.numel()]
        for t, ph in zip(ts, self.placeholders[k]):
            t.data = ph
        self._versions[k] = [t._version for t in ts]
        if self._classes[k] is not None:
            for t, (_, sub) in zip(ts, self._classes[k]):
                t.__class__ = sub
        raise StreamedWriteError(
            f"streamed tensor(s) {self._names(k, idx)[:5]} were changed between forwards (in place, or "
            "`.data` replaced) while holding their empty placeholder; the change was NOT applied: the "
            "host store keeps the previous weights (the change is now discarded). Change streamed weights "
            "with update_weights() / load_state_dict(), or in place on the tensors state_dict() returns; "
            "or keep the block resident (layer_options.dit.resident_layers or an OffloadPlan)"
        )

    def _written_in_forward(self, k: int, idx: list[int]) -> StreamedWriteError:
        return StreamedWriteError(
            f"block {self.source.layouts[k].name!r} wrote to its streamed tensor(s) "
            f"{self._names(k, idx)[:5]} during its forward (in place: e.g. BatchNorm running statistics in "
            "train mode, a counter or a cache buffer); streamed tensors are reloaded from the host store "
            "every step, so the write is lost. Call eval() on the model, keep this block resident "
            "(layer_options.dit.resident_layers or an OffloadPlan without it), or keep such state outside "
            "the block's parameters and buffers"
        )

    # -- hooks -----------------------------------------------------------------
    def before_block(self, block: int) -> None:
        if self.guard is not None:
            self.guard.check()  # a failed DLO backend stops here, before any transfer or collective
        self._guarded(self._before_block, block)

    def after_block(self, block: int) -> None:
        self._guarded(self._after_block, block)

    def _guarded(self, step, block: int) -> None:
        """``step(block)``; under a guard whose block failures are sticky (DLO AllGather:
        peers may be out of step after one) an exception also ends the backend, named."""
        g = self.guard
        if g is None or not g.sticky_blocks:
            step(block)
            return
        try:
            step(block)
        except BaseException as e:  # a KeyboardInterrupt in the bookkeeping may leave a load unissued
            g.mark_failed(f"{type(e).__name__}: {e}")
            raise

    def _before_block(self, block: int) -> None:
        own = self.ownership
        if own.owner != threading.get_ident():
            own.claim("a streamed block's forward")
        if not self._primed:
            self._prime()
        interrupted = self._bound is not None  # a forward raised inside a block (its post-hook never ran)
        if interrupted:
            self._unbind(self._bound)
        expected = self.schedule.block_at(self.position)
        if block != expected:
            if not interrupted and own.depth:  # inside the DiT's forward: the blocks in between were skipped
                self._skip_to(block)
            elif block == self.schedule.first:
                self._resync()
            else:
                raise RuntimeError(
                    f"streamed block {self.blocks[block].name!r} ran out of order: the schedule expected "
                    f"{self.blocks[expected].name!r}. Blocks must run at most once per step in discovery order "
                    f"({self.blocks[self.schedule.first].name!r} first), inside the DiT's forward (blocks "
                    "skipped there, e.g. by SD3's skip_layers, are fine)."
                )
        p = self.position
        if self._started != p and block == self.schedule.first:
            self._start_step()  # a step entered without the DiT's hook (root.forward(...)), or the plain ring
        elif interrupted and block == expected:
            # the block that raised runs again (its step already started): what the step start
            # checks may have changed since (a state_dict() edit, a checkpoint file)
            self.source.check()
            self._check_host_edits()
        if self._late is not None:  # after a resync too, which may defer its loads here
            self._issue_late()
        slot = self.schedule.slot_at(p)
        if self.streams is not None:
            cs = self.streams.current_stream(self.device)
            if self._load_tag[slot] == self.capture_tag:
                cs.wait_event(self.loaded[slot])
            self.source.before_use(self.k_of[block], slot, cs, tag=self.capture_tag)
            self._compute_stream = cs
            self.streams.access("read_begin", slot, block)
        self._bind(self.k_of[block], slot)
        if self.log is not None:
            self._compute_rec = _Record(self.schedule.step_of(p), block, "compute")
            self._compute_rec.start = self.log.mark(self._compute_stream)
            self.log.records.append(self._compute_rec)

    def _after_block(self, block: int) -> None:
        p = self.position
        slot = self.schedule.slot_at(p)
        if self.log is not None:
            self._compute_rec.end = self.log.mark(self._compute_stream)
        if self.streams is not None:
            self.streams.access("read_end", slot, block)
            self.freed[slot].record(self._compute_stream)
        written = self._unbind(self.k_of[block])
        self.position = p + 1
        nxt = self.schedule.after_compute(p)
        if nxt is not None:
            self._issue(nxt)
        if not self.ownership.depth and self.position % self.schedule.n == 0:
            self.ownership.release_to(0)  # the step is over (a step held by acquire() ends at release())
        if written:
            raise self._written_in_forward(self.k_of[block], written)

    # -- skipped blocks ----------------------------------------------------------
    def _skip_to(self, block: int) -> None:
        """Skip positions until ``block``'s, which is later in this step, or in the
        next one when this step's last blocks were skipped."""
        while self.schedule.block_at(self.position) != block:
            self._skip_position()

    def finish_step(self) -> None:
        """Treat the rest of a step that ended early (its last blocks skipped by
        design, nothing bound) as skipped, up to the next step boundary."""
        while self.position % self.schedule.n:
            self._skip_position()

    def _skip_position(self) -> None:
        """Position ``self.position`` is computed without reading its slot: its
        slot-free event is recorded on the compute stream and the load that waits
        for it is issued, as after_block does. The skipped block's own load is
        wasted (it was issued a step's slots earlier; skipping it would need a
        schedule that knows the skip set in advance)."""
        p = self.position
        if self._started != p and p % self.schedule.n == 0:
            self._start_step()  # the step's first blocks are skipped: its start work comes first
        if self._late is not None:
            self._issue_late()
        slot = self.schedule.slot_at(p)
        if self.streams is not None:
            self.freed[slot].record(self.streams.current_stream(self.device))
        self.position = p + 1
        nxt = self.schedule.after_compute(p)
        if nxt is not None:
            self._issue(nxt)

    def drain_step(self, forward_start: int) -> None:
        """Issue the loads the rest of this step would have issued, with no compute
        (a collective source's rank that stopped part-way: its peers issued them)."""
        n, p = self.schedule.n, self.position
        end = p + n if p == forward_start else -(-p // n) * n
        if not self._primed:
            self._prime()
        if self._bound is not None:
            self._unbind(self._bound)
        self._late = None
        if self.streams is not None:  # after whatever compute the step did launch
            for side in self.side_streams():
                side.wait_stream(self.streams.current_stream(self.device))
        for q in range(p, end):
            nxt = self.schedule.after_compute(q)
            if nxt is not None:
                self._issue(nxt, wait_free=False)
        self.position = end

    def _resync(self) -> None:
        """A step started while the previous one was cut short (an exception
        inside the model): wait for outstanding work, unbind, re-prime. Not on
        the normal path."""
        warnings.warn(
            "weightstream: a forward started before the previous one finished its blocks "
            "(an exception inside the model?); re-priming the slots",
            stacklevel=4,
        )
        self._to_step_boundary()
        self._started = self.position
        self._host_version = self.source.host_version()  # the refill reads the store as it is now
        self._step_start_loads(self.schedule.refill(self.schedule.step_of(self.position)))

    def _to_step_boundary(self) -> None:
        """Unbind whatever a cut-short step left bound; move to the next step start."""
        if self._bound is not None:
            self._unbind(self._bound)
        self._late = None
        n = self.schedule.n
        self.position = -(-self.position // n) * n

    # -- lifecycle -------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for in-flight copies (used outside the hot path: teardown, weight updates)."""
        if self.streams is not None:
            for side in self.side_streams():
                side.synchronize()
            self.streams.current_stream(self.device).synchronize()

    def side_streams(self) -> list:
        """Streams besides the compute stream that a step issues work on (a graph
        capture joins each back into the capturing stream)."""
        return [self.copy_stream, *self.source.side_streams()] if self.streams is not None else []

    def pending_loads(self) -> list[tuple[int, int]]:
        """(position, slot) of the loads already issued for the next step's first
        positions (none between the steps of a step-local schedule)."""
        return [(ld.position, ld.slot) for ld in self.schedule.carried(self.schedule.step_of(self.position))]

    def wait_pending(self, stream) -> None:
        """Make ``stream`` wait for the loads of upcoming positions (before a graph launch)."""
        if not self._primed:
            self._prime()
        self._check_host_edits()  # a replay runs no hooks: pick up host edits here
        for _, slot in self.pending_loads():
            if self._load_tag[slot] is None:
                stream.wait_event(self.loaded[slot])

    def agree_capture(self, ok: bool) -> bool:
        """Whether a CUDA-graph capture succeeded; collective sources decide it with their peers."""
        return ok if self.guard is None else self.guard.agree_capture(self, ok)

    # -- the surface graph capture uses (graphs/runner.py never touches fields) ---------
    @property
    def failure(self) -> str | None:
        """Why this executor stopped for good (a DLO failure); None while usable."""
        return None if self.guard is None else self.guard.failure

    def check_usable(self, what: str = "this forward") -> None:
        """Raise before a step or a replay when it cannot run: a failed DLO backend
        (no collective is issued after a failure), a changed checkpoint file."""
        if self.guard is not None:
            self.guard.check(what)
        self.source.check()

    def capture_deferred(self) -> str | None:
        """Why a capture should wait (the source's loads are about to change: blocks coded in the
        background); None: capture now."""
        return self.source.capture_deferred()

    def uncapturable(self) -> str | None:
        """Why a CUDA graph cannot hold this source's loads (None: it can)."""
        return self.source.uncapturable()

    @property
    def step_index(self) -> int:
        """Steps begun so far (the graph phase is derived from it)."""
        return self.position // self.schedule.n

    @property
    def mid_step(self) -> bool:
        """True when a step stopped part-way (an exception, or its last blocks skipped)."""
        return self.position % self.schedule.n != 0

    @property
    def block_bound(self) -> bool:
        """True when a forward raised inside a block (its post-hook never ran)."""
        return self._bound is not None

    def begin_capture(self, tag: int) -> int:
        """Loads issued from now on belong to capture ``tag``; returns the position."""
        if self.guard is not None and self.capture_tag is None:
            self.guard.capture_start = self.position  # where every rank resets to if it fails anywhere
        self.capture_tag = tag
        return self.position

    def end_capture(self) -> int:
        """Back to eager loads; returns the positions the capture advanced."""
        self.capture_tag = None
        return self.position

    def replayed_step(self) -> None:
        """A replay ran one whole step without running any hook: advance the ring."""
        self.position += self.schedule.n

    def reset(self) -> None:
        """Unbind, wait for all outstanding work, re-prime at the next step boundary.
        Used after a failed capture; not on the normal path. Under a collective
        source only a reset every rank agreed to runs (:meth:`agree_capture`)."""
        target = self.guard.reset_target(self) if self.guard is not None and self.guard.collective else None
        self.synchronize()
        self._to_step_boundary()
        if target is not None:
            self.position = target
        self.capture_tag = None
        self.reload_pending()

    def reload_pending(self) -> None:
        """Re-copy the slots already loaded for upcoming positions (after the host
        store changed). Callers order the copy streams after the slots' readers
        first (synchronize, or wait on the compute stream); not a hot-path call."""
        self.source.check()
        self.source.reload()
        self._host_version = self.source.host_version()
        for position, _ in (self.pending_loads() if self._primed else []):
            self._issue(self.schedule.load(position), wait_free=False)

    def events(self) -> list[dict]:
        return [] if self.log is None else self.log.resolve()

    def log_next_step(self) -> None:
        """Record the event log for the coming step even without record_events
        (auto placement measures a signature's first step); :meth:`take_events` ends it."""
        if self.log is None:
            self.log = EventLog(cuda=self.cuda)
            self.log.origin = self.log.mark(torch.cuda.current_stream(self.device) if self.cuda else None)
            self._log_once = True
            self._share_log()

    def take_events(self) -> list[dict]:
        """The event log so far (synchronises); a log opened by log_next_step() closes."""
        out = self.events()
        if self._log_once:
            self.log, self._log_once = None, False
            self._share_log()
        return out

    def _share_log(self) -> None:
        """Sources with stages of their own (a gather, a decode) log them as lanes of this log."""
        self.source.event_log = self.log
        self.source.step_of = self.schedule.step_of

    def remove(self) -> None:
        self.synchronize()
        for h in self.hooks:
            h.remove()
        self.source.remove()
        if self.ph is not None:  # every tensor back to its own class (placeholders stay until restored)
            self.ph.release_all(t for ts in self.targets for t in ts)
        self.slots = []
        self.views = []

    def __repr__(self) -> str:
        return (
            f"LayerwiseExecutor({len(self.hooks)} streamed blocks, {len(self.slots)} slots x "
            f"{self.slot_bytes / 2**20:.1f} MiB on {self.device}, hooks={self.hooks!r})"
        )
