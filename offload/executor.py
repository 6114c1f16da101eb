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
from .hooks import BlockHook, StepHook, casting_keeps
from .ownership import Ownership
from .placeholders import Placeholders
from .ring_bindings import BlockBindings
from .ring_copies import RingCopies
from .ring_log import RingLog
from .schedule import Load, Schedule
from .streams import resolve_streams


class LayerwiseExecutor:
    """Streams the blocks of ``schedule.streamed`` through fixed device slots.

    The bytes come from ``source`` (a :class:`~.sources.base.WeightSource`): the
    executor owns the ring's position (the schedule's walk, step starts, skipped
    and cut-short steps) and composes one owner per concern: the slots' copy
    stream, events and capture tags (:class:`~.ring_copies.RingCopies`, which calls
    ``source.load`` for every load), the tensors' bindings and write guards
    (:class:`~.ring_bindings.BlockBindings`) and the event log
    (:class:`~.ring_log.RingLog`). ``guard`` (DLO, see :mod:`.dlo.guard`): sticky
    failures and the decisions every rank takes together.
    """

    copies_cls = RingCopies  # tests substitute mutants (tests/test_happens_before.py)

    @property
    def capture_tag(self):
        """The graph capture that loads issued now belong to (None: eager)."""
        return self.copies.tag

    @capture_tag.setter
    def capture_tag(self, tag) -> None:
        self.copies.tag = tag

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
        self.ring_log = RingLog(self.device, source, schedule.step_of, record=record_events)
        # the copy stream, the slots' loaded/freed events, capture tags; attaches the source (ring_copies.py)
        self.copies = self.copies_cls(source, self.streams, self.device, self.slots, self.k_of, self.ring_log,
                                      schedule.step_of, guard, [b.name for b in blocks])
        # what the tensors of the blocks the source holds are bound to (ring_bindings.py): views
        # into a slot while their block computes, placeholders otherwise; a block resident
        # under auto placement gets no slot views
        lays = source.layouts
        self.bindings = BlockBindings(lays, [blocks[lay.index].module for lay in lays], self.slots, self.device,
                                      lambda k: schedule.is_streamed(lays[k].index), placeholders)
        self.position = 0  # next position to compute
        self.hooks = [BlockHook(self, blocks[i]) for i in schedule.streamed]
        self._compute_stream = None
        # Misuse guards (see acquire, ring_bindings.py, _check_host_edits): host_version():
        # the source's host views (state_dict()) share one version counter.
        self._host_version = source.host_version()
        self._started: int | None = None  # position whose step-start work was done
        # the thread running a step, an update or disable() (shared with StreamedBlocks: one per model)
        self.ownership = ownership if ownership is not None else Ownership()
        self.ownership.add_entries(self, *(blocks[i].module for i in schedule.streamed))
        self.ph = placeholders  # unbound tensors refuse reads/writes between forwards (placeholders.py)
        for i in schedule.streamed:
            self.bindings.unbind(self.k_of[i])
        if prime not in ("now", "first_forward"):
            raise ValueError(f"prime={prime!r} is not allowed; choose from: now, first_forward")
        self._primed = False
        self._refill = False  # a load failed: the next step starts from a refill (_issue)
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
        # layerwise casting: leaves outside the streamed blocks keep their own storage
        self.hooks += casting_keeps(root, {id(h.block.module) for h in self.hooks if isinstance(h, BlockHook)})

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
        if self._refill:
            self._resync("a load failed in the previous step (its slot may hold another block)")
            return
        if self.position % self.schedule.n:
            if self.bindings.bound is not None:
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
        self.copies.after_compute()  # order the reloads after every reader and loader of the slots so far
        self.reload_pending()

    def _step_start_loads(self, loads: list[Load] | None = None) -> None:
        if loads is None:
            loads = self.schedule.step_start(self.schedule.step_of(self.position))
        if loads:  # the defer_last schedule issues them at the step's first block (ring_copies.py)
            self.copies.step_start(loads, defer=self.schedule.defer_last and self.position % self.schedule.n == 0)

    def _issue(self, load: Load, *, wait_free: bool = True) -> None:
        try:
            self.copies.issue(load, wait_free=wait_free)
        except BaseException:
            # its slot holds whatever was there before: the next step starts from a refill, even when the
            # failed load was one the step's end carries into the next step (the position at a boundary)
            self._refill = True
            raise

    # -- hooks -----------------------------------------------------------------
    def before_block(self, block: int) -> None:
        if self.guard is not None:
            self.guard.check()  # a failed DLO backend stops here, before any transfer or collective
        _guarded(self.guard, self._before_block, block)

    def after_block(self, block: int) -> None:
        _guarded(self.guard, self._after_block, block)

    def _before_block(self, block: int) -> None:
        own = self.ownership
        if own.owner != threading.get_ident():
            own.claim("a streamed block's forward")
        if not self._primed:
            self._prime()
        interrupted = self.bindings.bound is not None  # a forward raised inside a block (its post-hook never ran)
        if interrupted:
            self.bindings.unbind_current()
        expected = self.schedule.block_at(self.position)
        if self._refill and block == self.schedule.first:  # a step entered without the DiT's hook
            self._resync("a load failed in the previous step (its slot may hold another block)")
            expected = self.schedule.block_at(self.position)
        if block != expected:
            if not interrupted and own.depth:  # inside the DiT's forward: the blocks in between were skipped
                self._skip_to(block)
            elif block == self.schedule.first:
                self._resync()
            else:
                raise _out_of_order(self.blocks, block, expected, self.schedule.first)
        p = self.position
        if self._started != p and block == self.schedule.first:
            self._start_step()  # a step entered without the DiT's hook (root.forward(...)), or the plain ring
        elif interrupted and block == expected:
            # the block that raised runs again (its step already started): what the step start
            # checks may have changed since (a state_dict() edit, a checkpoint file)
            self.source.check()
            self._check_host_edits()
        self.copies.issue_late()  # after a resync too, which may defer its loads here
        slot = self.schedule.slot_at(p)
        if self.streams is not None:
            cs = self.streams.current_stream(self.device)
            self.copies.wait_loaded(cs, slot)
            self.source.before_use(self.k_of[block], slot, cs, tag=self.copies.tag)
            self._compute_stream = cs
            self.streams.access("read_begin", slot, block)
        self.bindings.bind(self.k_of[block], slot)
        self.ring_log.compute_begin(p, block, self._compute_stream)

    def _after_block(self, block: int) -> None:
        p = self.position
        slot = self.schedule.slot_at(p)
        self.ring_log.compute_end(self._compute_stream)
        if self.streams is not None:
            self.streams.access("read_end", slot, block)
            self.copies.freed[slot].record(self._compute_stream)
        written = self.bindings.unbind(self.k_of[block])
        self.position = p + 1
        nxt = self.schedule.after_compute(p)
        if nxt is not None:
            self._issue(nxt)
        if not self.ownership.depth and self.position % self.schedule.n == 0:
            self.ownership.release_to(0)  # the step is over (a step held by acquire() ends at release())
        if written:
            raise self.bindings.written_in_forward(self.k_of[block], written)

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
        self.copies.issue_late()
        slot = self.schedule.slot_at(p)
        if self.streams is not None:
            self.copies.freed[slot].record(self.streams.current_stream(self.device))
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
        self.bindings.unbind_current()
        self.copies.late = None
        self.copies.after_compute()  # after whatever compute the step did launch
        for q in range(p, end):
            nxt = self.schedule.after_compute(q)
            if nxt is not None:
                self._issue(nxt, wait_free=False)
        self.position = end

    def _resync(self, why: str = "a forward started before the previous one finished its blocks "
                                 "(an exception inside the model?)") -> None:
        """A step started while the previous one was cut short (an exception
        inside the model, a failed load): wait for outstanding work, unbind,
        re-prime. Not on the normal path."""
        warnings.warn(f"weightstream: {why}; re-priming the slots", stacklevel=4)
        self._refill = False
        self._to_step_boundary()
        self._started = self.position
        self._host_version = self.source.host_version()  # the refill reads the store as it is now
        self._step_start_loads(self.schedule.refill(self.schedule.step_of(self.position)))

    def _to_step_boundary(self) -> None:
        """Unbind whatever a cut-short step left bound; move to the next step start."""
        self.bindings.unbind_current()
        self.copies.late = None
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
        return self.copies.side_streams()

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
            if self.copies.load_tag[slot] is None:
                stream.wait_event(self.copies.loaded[slot])

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
        """True when a step stopped part-way (an exception, or its last blocks skipped), or a
        load failed (:attr:`load_failed`)."""
        return self.position % self.schedule.n != 0 or self._refill

    @property
    def load_failed(self) -> bool:
        """A load raised since the ring was last primed: a slot may hold another block (a
        replay must :meth:`reset` first; an eager step re-primes by itself)."""
        return self._refill

    @property
    def block_bound(self) -> bool:
        """True when a forward raised inside a block (its post-hook never ran)."""
        return self.bindings.bound is not None

    def begin_capture(self, tag: int) -> int:
        """Loads issued from now on belong to capture ``tag``; returns the position."""
        if self.guard is not None and self.copies.tag is None:
            self.guard.capture_start = self.position  # where every rank resets to if it fails anywhere
        self.copies.tag = tag
        return self.position

    def end_capture(self) -> int:
        """Back to eager loads; returns the positions the capture advanced."""
        self.copies.tag = None
        return self.position

    def check_replay(self) -> None:
        """Before a graph replay: the source's refusal of captures gone stale (a named error)."""
        self.source.check_replay()

    def captures_dropped(self) -> None:
        """The graph runner dropped every graph captured over this ring (an adapter change): the
        source forgets the state it kept for them (a coded block grown past the captured copies
        is no longer stale)."""
        self.source.captures_dropped()

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
        self.copies.tag = None
        self._refill = False  # first: a reload that fails marks it again
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
        return self.ring_log.events()

    def log_next_step(self) -> None:
        """Record the event log for the coming step even without record_events
        (auto placement measures a signature's first step); :meth:`take_events` ends it."""
        self.ring_log.log_next_step()

    def take_events(self) -> list[dict]:
        """The event log so far (synchronises); a log opened by log_next_step() closes."""
        return self.ring_log.take_events()

    def remove(self) -> None:
        self.synchronize()
        for h in self.hooks:
            h.remove()
        self.source.remove()
        self.bindings.release()  # every tensor back to its own class (placeholders stay until restored)
        self.slots = []

    def __repr__(self) -> str:
        return (
            f"LayerwiseExecutor({len(self.hooks)} streamed blocks, {len(self.slots)} slots x "
            f"{self.slot_bytes / 2**20:.1f} MiB on {self.device}, hooks={self.hooks!r})"
        )


def _guarded(guard, step, block: int) -> None:
    """``step(block)``; under a guard whose block failures are sticky (DLO AllGather:
    peers may be out of step after one) an exception also ends the backend, named."""
    if guard is None or not guard.sticky_blocks:
        step(block)
        return
    try:
        step(block)
    except BaseException as e:  # a KeyboardInterrupt in the bookkeeping may leave a load unissued
        guard.mark_failed(f"{type(e).__name__}: {e}")
        raise


def _out_of_order(blocks: list[Block], block: int, expected: int, first: int) -> RuntimeError:
    return RuntimeError(
        f"streamed block {blocks[block].name!r} ran out of order: the schedule expected "
        f"{blocks[expected].name!r}. Blocks must run at most once per step in discovery order "
        f"({blocks[first].name!r} first), inside the DiT's forward (blocks "
        "skipped there, e.g. by SD3's skip_layers, are fine)."
    )
