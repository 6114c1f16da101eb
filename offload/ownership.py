"""One thread at a time: who holds an offloaded model.

A forward streams its blocks through one set of device slots, and an update,
a ``disable()`` or a ``.data`` write changes the host store those slots are
filled from: each runs on one thread while it holds the model
(:meth:`Ownership.acquire`, re-entrant). Another thread that enters meanwhile
gets :class:`ConcurrentUseError`, never a slot or a torn weight.

A hold whose holder is gone is not a hold: torch runs ``always_call`` forward
hooks for ``Exception`` only, so a ``KeyboardInterrupt`` / ``SystemExit`` /
cancellation inside a forward leaves its hold behind. When a second thread
meets a hold, :meth:`Ownership._stale` looks at the holder (slow path only): a
thread that has ended, or whose stack has no frame of the model's entry
objects (the DiT, its blocks, the wrapper, the machinery), holds nothing, and
the newcomer takes over; the ring then re-synchronises at its next step, as
after any exception.
"""
from __future__ import annotations

import sys
import threading

from .misuse import ConcurrentUseError


class Ownership:
    def __init__(self):
        self.owner: int | None = None  # thread ident
        self.depth = 0  # nested acquire()s of the owner
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._entries: set[int] = set()  # ids of objects whose methods run while the model is held

    def add_entries(self, *objs) -> None:
        """Objects whose frames on the holder's stack mean the hold is live."""
        self._entries.update(id(o) for o in objs)

    def acquire(self, what: str = "a forward") -> int:
        """Hold for the calling thread; returns the depth before (for :meth:`release_to`)."""
        before = self.depth if self.owner == threading.get_ident() else 0
        if self.owner != threading.get_ident():
            self.claim(what)
        self.depth += 1
        return before

    def release(self) -> None:
        if self.owner == threading.get_ident():
            self.depth = max(0, self.depth - 1)
            if not self.depth:
                self.owner = self._thread = None

    def release_to(self, depth: int) -> None:
        """Back to ``depth`` (a ``finally`` of an entry point: whatever hooks a
        BaseException skipped inside it)."""
        if self.owner == threading.get_ident():
            self.depth = min(self.depth, depth)
            if not self.depth:
                self.owner = self._thread = None

    def claim(self, what: str) -> None:
        me = threading.get_ident()
        with self._lock:
            if self.owner is not None and self.owner != me and not self._stale():
                raise ConcurrentUseError(
                    f"this offloaded model is in use by thread {self.owner} (a forward, an update or "
                    f"disable()); thread {me} called {what} concurrently. One offloaded model streams its "
                    "blocks through one set of device slots from one host store, so forwards, "
                    "update_weights(), load_state_dict(), .data writes and disable() cannot overlap: "
                    "serialise the calls (a lock around the model or pipeline call) or build one "
                    "offloaded model per thread")
            if self.owner != me:
                self.depth = 0
            self.owner, self._thread = me, threading.current_thread()

    def _stale(self) -> bool:
        """The holder has ended, or runs none of the model's code (a BaseException skipped
        its release)."""
        t = self._thread
        if t is None or not t.is_alive():
            return True
        f = sys._current_frames().get(self.owner)
        while f is not None:
            if id(f.f_locals.get("self")) in self._entries:
                return False
            f = f.f_back
        return True

    def __repr__(self) -> str:
        return f"Ownership(owner={self.owner}, depth={self.depth})"
