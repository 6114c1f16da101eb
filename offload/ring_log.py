"""The ring's event log while one is open (:class:`RingLog`): per-block copy and
compute intervals (:class:`~.event_log.EventLog`), for ``record_events=True``
(the executor's whole life) or for one step (:meth:`RingLog.log_next_step`, the
automatic planners measure a signature's first step). Sources with stages of
their own (a gather, a decode) log them as lanes of the same log."""
from __future__ import annotations

import torch

from .event_log import EventLog, _Record


class RingLog:
    """Owns the executor's :class:`~.event_log.EventLog` (``log``; None while closed)
    and hands it to ``source`` (``source.event_log``, ``source.step_of``)."""

    def __init__(self, device: torch.device, source, step_of, *, record: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self.source = source
        self.step_of = step_of
        self.log: EventLog | None = None
        self._once = False  # opened by log_next_step(): closes at take_events()
        self._compute: _Record | None = None
        if record:
            self._open()
        else:
            self._share()

    def _open(self) -> None:
        self.log = EventLog(cuda=self.cuda)
        self.log.origin = self.log.mark(torch.cuda.current_stream(self.device) if self.cuda else None)
        self._share()

    def _share(self) -> None:
        """Sources with stages of their own (a gather, a decode) log them as lanes of this log."""
        self.source.event_log = self.log
        self.source.step_of = self.step_of

    # -- records (no-ops while closed) ---------------------------------------------------
    def begin(self, position: int, block: int, lane: str) -> _Record | None:
        """A record of ``lane`` for ``block`` at ``position``, appended now (None while closed)."""
        if self.log is None:
            return None
        rec = _Record(self.step_of(position), block, lane)
        self.log.records.append(rec)
        return rec

    def mark(self, stream=None):
        """A timestamp on ``stream`` (an event on CUDA, perf_counter seconds on the CPU)."""
        return self.log.mark(stream)

    def compute_begin(self, position: int, block: int, stream) -> None:
        if self.log is not None:
            self._compute = self.begin(position, block, "compute")
            self._compute.start = self.log.mark(stream)

    def compute_end(self, stream) -> None:
        if self.log is not None:
            self._compute.end = self.log.mark(stream)

    # -- reading -------------------------------------------------------------------------
    def events(self) -> list[dict]:
        return [] if self.log is None else self.log.resolve()

    def log_next_step(self) -> None:
        """Record the coming step even without record_events; :meth:`take_events` ends it."""
        if self.log is None:
            self._open()
            self._once = True

    def take_events(self) -> list[dict]:
        """The log so far (synchronises); a log opened by :meth:`log_next_step` closes."""
        out = self.events()
        if self._once:
            self.log, self._once = None, False
            self._share()
        return out
