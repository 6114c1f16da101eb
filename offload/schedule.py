"""The streaming schedule: a pure plan, CPU-tested, no tensors.

Blocks ``0 .. resident-1`` stay on the device. The other ``n`` blocks stream
through ``num_slots`` slots. Number every streamed block execution across
steps with a *position* ``p = step * n + k`` (``k`` = index among streamed
blocks). Then:

- position ``p`` uses slot ``p % S``;
- positions ``0 .. S-1`` are loaded before the first forward ("priming");
- after position ``p`` computes, the load of position ``p + S`` into the same
  slot may start (its "slot free" dependency); the last blocks of a step thus
  prefetch the first blocks of the next;
- compute of ``p`` waits for its own load.

With an odd ``n`` and two slots, a block's slot alternates from step to step;
that is why slots are a function of the position, not of the block.

``step_local=True`` keeps every load inside its own step, for CUDA graphs (a
graph must finish all its work, so a copy for the next step cannot overlap
across the graph boundary): the step's first ``S`` positions load at the
*start* of the step, behind the resident blocks' compute, and the last blocks
prefetch nothing. Slots then count from the step start (``k % S``), so every
step uses the same pattern.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """Copy the image of ``block`` into ``slot`` for position ``position``."""

    position: int
    block: int
    slot: int
    after_position: int | None  # compute that must finish first (None: slot never used)


@dataclass(frozen=True)
class Schedule:
    num_blocks: int
    resident: int = 0
    num_slots: int = 2
    step_local: bool = False

    def __post_init__(self):
        if not isinstance(self.step_local, bool):
            raise TypeError(f"Schedule.step_local={self.step_local!r} must be a bool")
        for key in ("num_blocks", "resident", "num_slots"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"Schedule.{key}={v!r} must be an int")
        if self.num_blocks < 1:
            raise ValueError(f"Schedule.num_blocks={self.num_blocks} must be >= 1")
        if not 0 <= self.resident < self.num_blocks:
            raise ValueError(
                f"resident_layers={self.resident} must be in [0, {self.num_blocks - 1}] for "
                f"{self.num_blocks} blocks: at least one block must stream"
            )
        if self.num_slots < 1:
            raise ValueError(f"Schedule.num_slots={self.num_slots} must be >= 1")

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(range(self.resident, self.num_blocks))

    @property
    def n(self) -> int:
        return self.num_blocks - self.resident

    @property
    def slots(self) -> int:
        """Slots actually used: never more than streamed blocks."""
        return min(self.num_slots, self.n)

    def is_streamed(self, block: int) -> bool:
        return block >= self.resident

    def block_at(self, position: int) -> int:
        return self.resident + position % self.n

    def slot_at(self, position: int) -> int:
        if self.step_local:
            return position % self.n % self.slots
        return position % self.slots

    def load(self, position: int) -> Load:
        prev = position - self.slots
        if self.step_local and position % self.n < self.slots:
            prev = -1  # a step-start load: ordered after the previous step as a whole
        return Load(position, self.block_at(position), self.slot_at(position), prev if prev >= 0 else None)

    def priming(self) -> list[Load]:
        """Loads issued before the first forward (every slot's first user).
        Step-local schedules issue these at the start of every step instead."""
        return self.step_start(0)

    def step_start(self, step: int) -> list[Load]:
        """The loads of a step's first positions."""
        return [self.load(step * self.n + i) for i in range(self.slots)]

    def after_compute(self, position: int) -> Load | None:
        """The load that may start once ``position`` finished computing (None:
        a step-local schedule's last blocks prefetch nothing)."""
        if self.step_local and position % self.n + self.slots >= self.n:
            return None
        return self.load(position + self.slots)

    @property
    def phase_period(self) -> int:
        """Steps after which the slot pattern repeats (one graph per phase)."""
        from math import gcd

        return 1 if self.step_local else self.slots // gcd(self.n, self.slots)

    def step_of(self, position: int) -> int:
        return position // self.n
