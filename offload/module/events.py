"""The module offload controller's transition log (``handle.events``)."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

MAX_EVENTS = 10_000


@dataclass(frozen=True)
class Transition:
    """One record of the controller's event log.

    action: "enter" (a component hook ran; nothing may have moved),
    "arrive", "depart". cause: the unit whose hook or context asked for it,
    or "setup" / "offload_all" / "disable". on_device: units resident after
    the record. host_ms: host time spent on it (for an arrival: issuing the
    copy and rebinding, not the copy itself).
    """

    seq: int
    action: str
    unit: str
    cause: str
    nbytes: int
    t_ms: float
    host_ms: float
    on_device: tuple[str, ...]


class TransitionLog:
    """The newest ``MAX_EVENTS`` :class:`Transition` records (``events``, newest last),
    numbered from 1 and timed from the controller's start ``t0`` (``time.perf_counter()``)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.seq = 0
        self.events: collections.deque[Transition] = collections.deque(maxlen=MAX_EVENTS)

    def record(self, action: str, unit: str, cause: str, nbytes: int, started: float,
               on_device: tuple[str, ...]) -> None:
        """A transition that began at ``started`` and ends now."""
        now = time.perf_counter()
        self._append(action, unit, cause, nbytes, started, now - started, on_device)

    def enter(self, unit: str, cause: str, on_device: tuple[str, ...]) -> None:
        """A component hook or context ran (whatever it moved is logged before this)."""
        self._append("enter", unit, cause, 0, time.perf_counter(), 0.0, on_device)

    def _append(self, action, unit, cause, nbytes, started, took_s, on_device) -> None:
        self.seq += 1
        self.events.append(Transition(self.seq, action, unit, cause, nbytes, (started - self.t0) * 1e3,
                                      took_s * 1e3, on_device))
