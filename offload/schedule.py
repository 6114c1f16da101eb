"""The streaming schedule: a pure plan, CPU-tested, no tensors.

``resident`` blocks stay on the device: an int ``N`` keeps the first ``N``
(``0 .. N-1``), a tuple / frozenset / list of block indices keeps any subset
(``resident_blocks``; a subset that is a prefix ``0 .. N-1`` is stored as the
int ``N``, the same schedule). The other ``n`` blocks (``streamed``, ascending)
stream through ``num_slots`` slots. Number every streamed block execution
across steps with a *position* ``p = step * n + k`` (``k = index(block)``, the
block's index in ``streamed``). Then:

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
step uses the same pattern. What overlaps then depends on where the resident
blocks sit: resident blocks *before* the first streamed block hide the
step-start loads (with the first ``N`` resident, all of them); resident blocks
*between* streamed ones hide the in-step loads issued before them (the ring
runs up to ``S`` loads ahead of compute); resident blocks *after* the last
streamed block overlap no copy at all (nothing is loaded across the graph's
end), and with block ``first == 0`` the first streamed block waits for its
whole step-start load. The eager ring (``step_local=False``) has none of these
limits: a step's last blocks, resident or not, prefetch the next step's first.

``defer_last=True`` is the CUDA-graph schedule without resident blocks: loads
cross the step boundary as usual, except the one that waits for a step's last
block (position ``S - 1`` of the next step). Inside a graph that copy could
only start at the very end and the graph would wait for it; issued at the
start of the next step instead (ordered after the previous step as a whole),
it overlaps that step's first block, as the eager ring does. The first
``S - 1`` loads are primed before the first forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Load:
    """Copy the image of ``block`` into ``slot`` for position ``position``."""

    position: int
    block: int
    slot: int
    after_position: int | None  # compute that must finish first (None: slot never used)


@dataclass(frozen=True)
class Schedule:
    """See the module docstring. ``resident``: an int N (the first N blocks) or
    a collection of block indices (stored as a sorted tuple, or as the int N
    when it is ``0 .. N-1``). Read the resident set from ``resident_blocks``;
    ``resident`` keeps the int form where there is one."""

    num_blocks: int
    resident: int | tuple[int, ...] = 0
    num_slots: int = 2
    step_local: bool = False
    defer_last: bool = False
    _streamed: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for key in ("step_local", "defer_last"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"Schedule.{key}={getattr(self, key)!r} must be a bool")
        if self.step_local and self.defer_last:
            raise ValueError("Schedule: step_local=True and defer_last=True exclude each other; choose one")
        for key in ("num_blocks", "num_slots"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"Schedule.{key}={v!r} must be an int")
        if self.num_blocks < 1:
            raise ValueError(f"Schedule.num_blocks={self.num_blocks} must be >= 1")
        if self.num_slots < 1:
            raise ValueError(f"Schedule.num_slots={self.num_slots} must be >= 1")
        resident = _resident_blocks(self.resident, self.num_blocks)
        if resident == tuple(range(len(resident))):
            object.__setattr__(self, "resident", len(resident))
        else:
            object.__setattr__(self, "resident", resident)
        kept = set(resident)
        streamed = tuple(b for b in range(self.num_blocks) if b not in kept)
        object.__setattr__(self, "_streamed", streamed)
        object.__setattr__(self, "_index", {b: k for k, b in enumerate(streamed)})

    @property
    def streamed(self) -> tuple[int, ...]:
        """Streamed block indices, ascending (execution order)."""
        return self._streamed

    @property
    def resident_blocks(self) -> tuple[int, ...]:
        """Resident block indices, ascending."""
        if isinstance(self.resident, int):
            return tuple(range(self.resident))
        return self.resident

    @property
    def num_resident(self) -> int:
        return self.num_blocks - len(self._streamed)

    @property
    def first(self) -> int:
        """The first streamed block (where a step's streaming starts)."""
        return self._streamed[0]

    def index(self, block: int) -> int:
        """``k``: the position of streamed ``block`` in ``streamed`` (its host
        image, slot views, ...); ValueError for a resident or unknown block."""
        k = self._index.get(block)
        if k is None:
            what = "resident" if block in self.resident_blocks else f"not a block index 0..{self.num_blocks - 1}"
            raise ValueError(f"block={block!r} is not streamed ({what}); streamed blocks: {list(self._streamed)}")
        return k

    @property
    def n(self) -> int:
        return len(self._streamed)

    @property
    def ring_slots(self) -> int:
        """Slots actually used (a count: never more than streamed blocks). The
        executor's ``slots`` are the device tensors themselves."""
        return min(self.num_slots, self.n)

    def is_streamed(self, block: int) -> bool:
        return block in self._index

    def block_at(self, position: int) -> int:
        return self._streamed[position % self.n]

    def slot_at(self, position: int) -> int:
        if self.step_local:
            return position % self.n % self.ring_slots
        return position % self.ring_slots

    @property
    def has_step_start(self) -> bool:
        """Whether loads are issued when a step starts (a hook on the DiT's forward)."""
        return self.step_local or self.defer_last

    def _at_step_start(self, position: int) -> bool:
        i = position % self.n
        if self.step_local:
            return i < self.ring_slots
        return self.defer_last and i == self.ring_slots - 1

    def load(self, position: int) -> Load:
        prev = position - self.ring_slots
        if self._at_step_start(position):
            prev = -1  # a step-start load: ordered after the previous step as a whole
        return Load(position, self.block_at(position), self.slot_at(position), prev if prev >= 0 else None)

    def priming(self) -> list[Load]:
        """Loads issued before the first forward (every slot's first user, less
        those a step issues at its start)."""
        return self.carried(0)

    def _first_loads(self, step: int, at_start: bool | None = None) -> list[Load]:
        """Loads of ``step``'s first ``S`` positions: all of them, or only those
        issued at the step's start (``at_start=True``) or before it (False)."""
        first = (step * self.n + i for i in range(self.ring_slots))
        return [self.load(p) for p in first if at_start is None or self._at_step_start(p) == at_start]

    def carried(self, step: int) -> list[Load]:
        """The loads of ``step``'s first positions that the previous step issues
        (priming for step 0); the rest come from :meth:`step_start`."""
        return self._first_loads(step, at_start=False)

    def step_start(self, step: int) -> list[Load]:
        """The loads issued when ``step`` starts (none for the plain ring)."""
        return self._first_loads(step, at_start=True)

    def refill(self, step: int) -> list[Load]:
        """Every load of ``step``'s first positions, for a step that starts with
        nothing in flight (after an interrupted step)."""
        return self._first_loads(step)

    def after_compute(self, position: int) -> Load | None:
        """The load that may start once ``position`` finished computing (None when
        that load is issued at the next step's start, or not at all)."""
        if self.step_local and position % self.n + self.ring_slots >= self.n:
            return None
        nxt = position + self.ring_slots
        if self.defer_last and self._at_step_start(nxt):  # only a step's last position reaches it
            return None
        return self.load(nxt)

    @property
    def phase_period(self) -> int:
        """Steps after which the slot pattern repeats (one graph per phase)."""
        from math import gcd

        return 1 if self.step_local else self.ring_slots // gcd(self.n, self.ring_slots)

    def step_of(self, position: int) -> int:
        return position // self.n


def _resident_blocks(resident, num_blocks: int) -> tuple[int, ...]:
    """The resident set as a sorted tuple; ValueError / TypeError naming the value."""
    if isinstance(resident, bool):
        raise TypeError(f"Schedule.resident={resident!r} must be an int or a collection of block indices")
    if isinstance(resident, int):
        if not 0 <= resident < num_blocks:
            raise ValueError(
                f"resident_layers={resident} must be in [0, {num_blocks - 1}] for "
                f"{num_blocks} blocks: at least one block must stream"
            )
        return tuple(range(resident))
    if not isinstance(resident, (tuple, list, frozenset, set)):
        raise TypeError(
            f"Schedule.resident={resident!r} must be an int or a tuple / frozenset / list of block indices"
        )
    for b in resident:
        if not isinstance(b, int) or isinstance(b, bool):
            raise TypeError(f"Schedule.resident={resident!r}: block {b!r} must be an int")
        if not 0 <= b < num_blocks:
            raise ValueError(
                f"Schedule.resident={resident!r}: block {b} is not allowed; allowed: block indices "
                f"0..{num_blocks - 1}"
            )
    out = tuple(sorted(set(resident)))
    if len(out) != len(resident):
        raise ValueError(f"Schedule.resident={resident!r} names a block twice; allowed: each block once")
    if len(out) >= num_blocks:
        raise ValueError(
            f"resident_layers={resident!r} keeps all {num_blocks} blocks resident; allowed: at most "
            f"{num_blocks - 1} of them (at least one block must stream)"
        )
    return out
