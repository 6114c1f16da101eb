"""The executor's per-block event log: copy / compute (and a source's own lanes, e.g.
"gather") intervals, resolved (synchronised) only when read."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class _Record:
    step: int
    block: int
    lane: str  # "copy" | "compute"
    start: object = None  # torch.cuda.Event or float (perf_counter seconds)
    end: object = None


@dataclass
class EventLog:
    """Per-block copy/compute intervals, resolved (synchronised) only when read."""

    cuda: bool
    origin: object = None
    records: list = field(default_factory=list)

    def mark(self, stream=None):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            return ev
        return time.perf_counter()

    def resolve(self) -> list[dict]:
        if self.cuda:
            torch.cuda.synchronize()
            ms = lambda ev: self.origin.elapsed_time(ev)  # noqa: E731
        else:
            ms = lambda t: (t - self.origin) * 1e3  # noqa: E731
        return [
            {"step": r.step, "block": r.block, "lane": r.lane, "start_ms": ms(r.start), "end_ms": ms(r.end)}
            for r in self.records
            if r.start is not None and r.end is not None
        ]
