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

    def __post_init__(self):
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
        return position % self.slots

    def load(self, position: int) -> Load:
        prev = position - self.slots
        return Load(position, self.block_at(position), self.slot_at(position), prev if prev >= 0 else None)

    def priming(self) -> list[Load]:
        """Loads issued before the first forward (every slot's first user)."""
        return [self.load(p) for p in range(self.slots)]

    def after_compute(self, position: int) -> Load:
        """The load that may start once ``position`` finished computing."""
        return self.load(position + self.slots)

    def step_of(self, position: int) -> int:
        return position // self.n
