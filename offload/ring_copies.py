"""The copy side of the ring (:class:`RingCopies`): the copy stream, each slot's
"loaded" and "freed" events, the capture tag every load belongs to, and the one
method that orders and records a load (the ring's step 4, :mod:`.executor`); the
weight source moves the bytes (``source.load``).

Events may only be waited on in the context that recorded them: eagerly (tag
None) or inside the same graph capture (its tag). A load recorded in an earlier
capture ran inside that graph's replay, which the launching stream already
orders after; it needs no wait (:meth:`RingCopies.wait_loaded`).

Step-start loads of the defer_last schedule are issued when the step's first
streamed block starts (:meth:`RingCopies.issue_late`), ordered only after the
step's start by an event recorded there. Inside a CUDA graph a copy created
before any of the step's kernels becomes the graph's first branch and runs on the
launching stream, where H2D copies measured ~5% slower (52.5 vs 55.5 GB/s on the
H200, perf/results/pacing-*); created after the DiT's first kernels it runs beside
them at full rate.
"""
from __future__ import annotations

import torch

from .schedule import Load


class RingCopies:
    """Orders the loads of ``source`` into ``slots`` on a copy stream of ``streams``
    (None on the CPU: synchronous copies, no events). ``k_of``: source index of each
    block index; ``ring_log``: the :class:`~.ring_log.RingLog` that records copies (``step_of``:
    the step of a position);
    ``guard`` (DLO): a load cut short by an exception fails the backend, named."""

    def __init__(self, source, streams, device: torch.device, slots: list[torch.Tensor], k_of: dict,
                 ring_log, step_of, guard=None, block_names=()):
        self.source = source
        self.streams = streams
        self.k_of = k_of
        self.ring_log = ring_log
        self.step_of = step_of
        self.guard = guard
        self.block_names = block_names
        self.tag = None  # the capture loads issued now belong to (None: eager)
        self.load_tag = [None] * len(slots)  # the capture of each slot's last load
        self.late: tuple | None = None  # (event, loads) of deferred step-start loads
        self.device = device
        if streams is None:
            self.copy_stream, self.loaded, self.freed = None, [], []
            source.attach(slots, None, device)
            return
        self.copy_stream = streams.new_stream(device)
        for slot in slots if device.type == "cuda" else ():
            # freed without disable() while a prefetch is in flight, the memory
            # is not handed out again before the copy stream's work is done
            slot.record_stream(self.copy_stream)
        self.loaded = [streams.new_event() for _ in slots]
        self.freed = [streams.new_event() for _ in slots]
        with streams.stream(self.copy_stream):  # attach runs with the copy stream current
            source.attach(slots, streams, device)

    def side_streams(self) -> list:
        """Streams besides the compute stream that a step issues work on (a graph
        capture joins each back into the capturing stream)."""
        return [self.copy_stream, *self.source.side_streams()] if self.streams is not None else []

    def after_compute(self) -> None:
        """Order every side stream after everything the compute stream did so far
        (before loads that rewrite slots its kernels may still read)."""
        if self.streams is not None:
            compute = self.streams.current_stream(self.device)
            for side in self.side_streams():
                side.wait_stream(compute)

    def step_start(self, loads: list[Load], *, defer: bool) -> None:
        """Issue a step's step-start loads after everything the compute stream did
        before (the previous step's readers of the slots); ``defer``: at the step's
        first streamed block instead (:meth:`issue_late`)."""
        if defer:
            ev = None
            if self.streams is not None:
                ev = self.streams.new_event()
                ev.record(self.streams.current_stream(self.device))
            self.late = (ev, loads)
            return
        if self.streams is not None:
            compute = self.streams.current_stream(self.device)
            for side in self.side_streams():
                side.wait_stream(compute)
        for load in loads:
            self.issue(load, wait_free=False)

    def issue_late(self) -> None:
        """Issue the deferred step-start loads (if any), after the step start's event."""
        if self.late is None:
            return
        ev, loads = self.late
        self.late = None
        if ev is not None:
            for side in self.side_streams():
                side.wait_event(ev)
        for load in loads:
            self.issue(load, wait_free=False)

    def wait_loaded(self, stream, slot: int) -> None:
        """Make ``stream`` wait for ``slot``'s last load where it was recorded in the
        current context (eager, or the capture in progress)."""
        if self.load_tag[slot] == self.tag:
            stream.wait_event(self.loaded[slot])

    def issue(self, load: Load, *, wait_free: bool = True) -> None:
        """Order and record one load; the source moves the bytes (``source.load``)."""
        if self.guard is None:
            self._issue_load(load, wait_free)
            return
        self.guard.check()
        try:
            self._issue_load(load, wait_free)
        except BaseException as e:  # a KeyboardInterrupt too: the load it cut short is never issued
            self.guard.mark_failed(f"{type(e).__name__}: {e} (the load of block {self.block_names[load.block]!r} "
                                   f"was cut short, step {self.step_of(load.position)})")
            raise

    def _issue_load(self, load: Load, wait_free: bool) -> None:
        rec = self.ring_log.begin(load.position, load.block, "copy")
        k = self.k_of[load.block]
        after = self.freed[load.slot] if self.streams is not None and wait_free and \
            load.after_position is not None else None
        if self.streams is None:
            if rec is not None:
                rec.start = self.ring_log.mark()
            self.source.load(k, load.slot, position=load.position, after=None, tag=None)
            if rec is not None:
                rec.end = self.ring_log.mark()
            return
        cs = self.copy_stream
        if after is not None and not self.source.waits_for_free_of(k):
            cs.wait_event(after)  # before the copy record starts: it times the copy, not the wait
        with self.streams.stream(cs):
            if rec is not None:
                rec.start = self.ring_log.mark(cs)
            done = self.source.load(k, load.slot, position=load.position, after=after, tag=self.tag)
            if self.source.caps.writes_at_use:
                pass  # the source writes the slot in before_use (a decode issued at use) and notes it there
            elif done is None or done is cs:
                done = cs
                self.streams.access("write", load.slot, load.block)
            else:
                with self.streams.stream(done):  # the slot's last write ran there (a gather)
                    self.streams.access("write", load.slot, load.block)
            self.loaded[load.slot].record(done)
            self.load_tag[load.slot] = self.tag
            if rec is not None:
                rec.end = self.ring_log.mark(cs)  # the copy; a source's later stages log their own lanes
