"""Placement planner: which blocks stay resident, how many slots. Pure, no tensors.

From per-block bytes, measured per-block compute time, measured link bandwidth
(and decode rate) and a device budget, :func:`plan` picks the resident set and
slot count that minimise the predicted step time, and states its prediction.
Resident blocks need not be the first N.

The step-time model follows :mod:`weightstream.offload.schedule` (the ring).
Streamed blocks are numbered by position ``p`` across steps, in execution order:

- the load of ``p`` goes into slot ``p % S`` and may start once the compute of
  ``p - S`` (the slot's previous user) finished and the previous load finished
  (one copy engine, loads in position order); priming loads (``p < S``) have no
  slot dependency;
- a load takes ``link_bytes / h2d`` and, with a decode rate, a decode of
  ``device_bytes / decode`` after its copy. ``decode_on_copy_stream=True``
  (default) runs the decode on the copy stream, so the next copy waits for it;
  ``False`` gives decodes their own stream (serial among themselves);
- a block computes after the previous block's compute and, if streamed, after
  its load (and decode). Resident blocks compute with no load.

The ring wraps across steps (the last blocks prefetch the next step's first
ones). :func:`step_ms` simulates step after step until the schedule is periodic
(the state relative to the step's end repeats, with a period of up to 4
steps) and returns the exact steady-state step time of this model (after 64
steps without a repeat: the mean of the last 8). Device
bytes: fixed + resident blocks + ``min(S, streamed)`` slots sized to the
largest streamed block, as the executor allocates them. At least one block
streams (the schedule needs one; a model that fits whole needs no planner).

``step_local=True`` models the CUDA-graph schedule with resident blocks
(``Schedule(step_local=True)``): each step starts after the previous one as a
whole, issues the loads of its first ``S`` streamed positions at its start and
the others once the slot's previous user in the same step finished; nothing
crosses the step boundary, so every step takes the same time (one step is
simulated). A placement with no resident block runs the plain ring there too
(the executor's ``next-step`` boundary loads), and is modelled as the ring.

Not modelled: decode kernels slowing compute (they share the SMs), the
in-graph boundary load (``graph_boundary_loads="in-graph"``, about 1% on
Flux-1024), DLO all-gathers.

Search (:func:`plan`): candidates are every first-N placement and greedy fills
(saved load time per device byte, one fill per slot-size cap), refined by
local searches (add / remove / swap one block) that minimise (predicted ms,
device bytes), skipping moves whose lower bound max(compute, copy side) is
already slower. It is a heuristic: exact on every small random case checked
against exhaustive search (tests), never worse than first-N by construction,
and monotone in the budget on the seeded checks (a budget ladder seeds each
budget with what a smaller one found), not by proof.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from weightstream.offload.config import AUTO_DEVICE_MARGIN_GB, ConfigTypeError

__all__ = ["PlanInputs", "Placement", "plan", "evaluate", "step_ms", "ring_ms", "AutoPlan", "plan_from_events",
           "compute_from_events", "h2d_from_events", "auto_budget_bytes", "describe"]

_MAX_STEPS = 64  # steps simulated before giving up on exact periodicity
_MAX_PERIOD = 4  # longest step period searched for
_EPS = 1e-9  # relative tolerance on times (ms)
_STARTS = 3  # local searches per slot count, from the best distinct candidates
_RUNGS = 4  # budgets the search climbs (see plan)


def _int_seq(name: str, value, minimum: int) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigTypeError(f"PlanInputs.{name}={value!r} must be a sequence of ints >= {minimum}")
    out = tuple(value)
    for i, v in enumerate(out):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigTypeError(f"PlanInputs.{name}[{i}]={v!r} must be an int >= {minimum}")
        if v < minimum:
            raise ValueError(f"PlanInputs.{name}[{i}]={v} is not allowed; allowed: ints >= {minimum}")
    return out


def _number(name: str, value, *, positive: bool) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigTypeError(f"PlanInputs.{name}={value!r} must be a number")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        allowed = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"PlanInputs.{name}={value!r} is not allowed; allowed: {allowed}")
    return float(value)


@dataclass(frozen=True)
class PlanInputs:
    """What the planner knows. Bytes are ints; times in ms; rates in GB/s (1e9 B/s).

    link_bytes[i]: bytes block ``i`` moves over the link per load (coded or raw).
    device_bytes[i]: bytes block ``i`` occupies on the device (raw, decoded).
    compute_ms[i]: measured compute time of block ``i`` (execution order).
    h2d_gbps: measured host-to-device bandwidth.
    budget_bytes: device bytes allowed for fixed + resident blocks + slots.
    fixed_device_bytes: resident modules outside the blocks (embedders, norms,
    a codec's staging buffers).
    decode_gbps: decode rate in decoded (device) bytes per s; None: no decode.
    slot_counts: slot counts the planner may choose from (>= 2, as ``num_slots``).
    decode_on_copy_stream: whether a decode delays the next copy (see module doc).
    step_local: the CUDA-graph schedule with resident blocks (see module doc).
    """

    link_bytes: tuple[int, ...]
    device_bytes: tuple[int, ...]
    compute_ms: tuple[float, ...]
    h2d_gbps: float
    budget_bytes: int
    fixed_device_bytes: int = 0
    decode_gbps: float | None = None
    slot_counts: tuple[int, ...] = (2, 3, 4)
    decode_on_copy_stream: bool = True
    step_local: bool = False

    def __post_init__(self):
        link = _int_seq("link_bytes", self.link_bytes, 1)
        dev = _int_seq("device_bytes", self.device_bytes, 1)
        if isinstance(self.compute_ms, (str, bytes)) or not hasattr(self.compute_ms, "__iter__"):
            raise ConfigTypeError(f"PlanInputs.compute_ms={self.compute_ms!r} must be a sequence of numbers >= 0")
        comp = tuple(_number(f"compute_ms[{i}]", v, positive=False) for i, v in enumerate(self.compute_ms))
        if not link:
            raise ValueError("PlanInputs.link_bytes=() is not allowed; allowed: one entry per block, >= 1 block")
        for name, seq in (("device_bytes", dev), ("compute_ms", comp)):
            if len(seq) != len(link):
                raise ValueError(
                    f"PlanInputs.{name} has {len(seq)} entries; allowed: one per block ({len(link)}, as link_bytes)"
                )
        slots = _int_seq("slot_counts", self.slot_counts, 2)  # as OffloadConfig.num_slots
        if not slots:
            raise ValueError("PlanInputs.slot_counts=() is not allowed; allowed: one or more ints >= 2")
        for name, seq in (("link_bytes", link), ("device_bytes", dev), ("compute_ms", comp)):
            object.__setattr__(self, name, seq)
        object.__setattr__(self, "slot_counts", tuple(sorted(set(slots))))
        object.__setattr__(self, "h2d_gbps", _number("h2d_gbps", self.h2d_gbps, positive=True))
        if self.decode_gbps is not None:
            object.__setattr__(self, "decode_gbps", _number("decode_gbps", self.decode_gbps, positive=True))
        for name, minimum in (("budget_bytes", 1), ("fixed_device_bytes", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigTypeError(f"PlanInputs.{name}={v!r} must be an int >= {minimum}")
            if v < minimum:
                raise ValueError(f"PlanInputs.{name}={v} is not allowed; allowed: ints >= {minimum}")
        for name in ("decode_on_copy_stream", "step_local"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(f"PlanInputs.{name}={getattr(self, name)!r} must be a bool")

    @property
    def num_blocks(self) -> int:
        return len(self.link_bytes)

    def load_ms(self, block: int) -> float:
        return self.link_bytes[block] / (self.h2d_gbps * 1e6)

    def decode_ms(self, block: int) -> float:
        return 0.0 if self.decode_gbps is None else self.device_bytes[block] / (self.decode_gbps * 1e6)


def _check_placement(inputs: PlanInputs, resident, num_slots) -> tuple[tuple[int, ...], int]:
    n = inputs.num_blocks
    res = tuple(sorted(set(_int_seq("resident", resident, 0))))
    if res and res[-1] >= n:
        raise ValueError(f"resident block {res[-1]} is not allowed; allowed: block indices 0..{n - 1}")
    if len(res) >= n:
        raise ValueError(f"resident={res} leaves no block to stream; allowed: at most {n - 1} of {n} blocks")
    if not isinstance(num_slots, int) or isinstance(num_slots, bool):
        raise ConfigTypeError(f"num_slots={num_slots!r} must be an int >= 1")
    if num_slots < 1:
        raise ValueError(f"num_slots={num_slots} is not allowed; allowed: ints >= 1")
    return res, num_slots


def _slot_bytes(inputs: PlanInputs, res: set) -> int:
    return max(b for i, b in enumerate(inputs.device_bytes) if i not in res)


def _device_bytes(inputs: PlanInputs, res, num_slots: int) -> int:
    res = set(res)
    slots = min(num_slots, inputs.num_blocks - len(res))
    return inputs.fixed_device_bytes + sum(inputs.device_bytes[i] for i in res) + slots * _slot_bytes(inputs, res)


def step_ms(inputs: PlanInputs, resident, num_slots: int) -> float:
    """Steady-state step time (ms) of the ring with ``resident`` blocks kept on
    the device and ``num_slots`` slots (the discrete-event model in the module doc)."""
    res, num_slots = _check_placement(inputs, resident, num_slots)
    return _simulate(inputs, set(res), num_slots)


def _simulate(inputs: PlanInputs, res: set, num_slots: int) -> float:
    blocks = [(c, None if i in res else (inputs.load_ms(i), inputs.decode_ms(i)))
              for i, c in enumerate(inputs.compute_ms)]
    s = min(num_slots, inputs.num_blocks - len(res))
    separate = inputs.decode_gbps is not None and not inputs.decode_on_copy_stream
    return ring_ms(blocks, s, separate_decode=separate, step_local=inputs.step_local and bool(res))


def ring_ms(blocks, num_slots: int, *, separate_decode: bool, step_local: bool = False) -> float:
    """Steady-state step (ms) of the ring over ``blocks``: per block in execution order
    ``(compute_ms, None)`` (resident) or ``(compute_ms, (load_ms, decode_ms))`` (streamed),
    ``num_slots`` slots (at most the streamed count), decodes on the copy stream or, with
    ``separate_decode``, on their own; ``step_local``: the CUDA-graph schedule with resident
    blocks (the module doc's model; also the codec planner's)."""
    s, separate = num_slots, separate_decode
    if step_local:
        return _simulate_step_local(blocks, s, separate)
    t = copy_free = dec_free = 0.0
    done_at: list[float] = []  # compute end per streamed position
    ends, states = [], []
    for step in range(_MAX_STEPS):
        for c, load in blocks:
            if load is None:
                t += c
                continue
            p = len(done_at)
            start = copy_free if p < s else max(copy_free, done_at[p - s])
            ready = copy_free = start + load[0]
            if separate:
                ready = dec_free = max(ready, dec_free) + load[1]
            else:
                ready = copy_free = ready + load[1]
            t = max(t, ready) + c
            done_at.append(t)
        ends.append(t)
        states.append((copy_free - t, *(dec_free - t for _ in range(separate)), *(e - t for e in done_at[-s:])))
        for period in range(1, min(_MAX_PERIOD, step) + 1):
            if _same(states[-1], states[-1 - period], t):
                return (t - ends[-1 - period]) / period
    return (ends[-1] - ends[-9]) / 8  # not periodic within _MAX_STEPS: average of the last steps


def _simulate_step_local(blocks: list, s: int, separate: bool) -> float:
    """One step of the step-local schedule (every step is the same): the first
    ``s`` streamed positions load at the step start, position ``k + s`` once
    ``k`` computed; the copy stream is serial in issue order (the step-start
    loads first, then each after its compute, which issues it)."""
    loads = [load for _, load in blocks if load is not None]
    n = len(loads)
    t = copy_free = dec_free = 0.0
    ready = [0.0] * n

    def issue(k: int, after: float) -> None:
        nonlocal copy_free, dec_free
        copy_free = max(copy_free, after) + loads[k][0]
        if separate:
            ready[k] = dec_free = max(copy_free, dec_free) + loads[k][1]
        else:
            ready[k] = copy_free = copy_free + loads[k][1]

    for k in range(s):
        issue(k, 0.0)
    k = 0
    for c, load in blocks:
        if load is None:
            t += c
            continue
        t = max(t, ready[k]) + c
        if k + s < n:
            issue(k + s, t)
        k += 1
    return t


def _same(a: tuple, b: tuple, scale: float) -> bool:
    tol = _EPS * (1.0 + abs(scale))
    return all(abs(x - y) <= tol for x, y in zip(a, b))


@dataclass(frozen=True)
class Placement:
    """A resident set and slot count with the model's predictions."""

    resident: tuple[int, ...]
    num_slots: int
    predicted_ms: float
    device_bytes: int
    slot_bytes: int
    budget_bytes: int
    num_blocks: int
    compute_ms: float  # floor: every block computes once per step
    transfer_ms: float  # floor: streamed link bytes / h2d
    decode_ms: float  # decode time of the streamed blocks (0 without decode)
    floor_ms: float  # max(compute, the copy side's busy time: transfer + decode on the copy stream)
    streamed_link_bytes: int

    @property
    def streamed(self) -> tuple[int, ...]:
        res = set(self.resident)
        return tuple(i for i in range(self.num_blocks) if i not in res)

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.budget_bytes

    @property
    def slots_used(self) -> int:
        return min(self.num_slots, len(self.streamed))

    def describe(self) -> str:
        n_res = len(self.resident)
        res_bytes = self.device_bytes - self.slots_used * self.slot_bytes
        kept = f"blocks {_ranges(self.resident)}" if self.resident else "no block"
        floors = f"compute {_ms(self.compute_ms)} ms, transfer {_ms(self.transfer_ms)} ms"
        if self.decode_ms:
            floors += f", decode {_ms(self.decode_ms)} ms"
        bound = "compute" if self.compute_ms >= self.floor_ms else "transfer"
        slots = f"{self.slots_used} slot{'s' if self.slots_used != 1 else ''}"
        return (
            f"{n_res} of {self.num_blocks} blocks stay resident ({kept}; {_size(res_bytes)} with the fixed "
            f"modules); {self.num_blocks - n_res} stream ({_size(self.streamed_link_bytes)} per step) through "
            f"{slots} of {_size(self.slot_bytes)}; device {_size(self.device_bytes)} of "
            f"{_size(self.budget_bytes)}. Predicted step {_ms(self.predicted_ms)} ms "
            f"({self.predicted_ms / max(self.floor_ms, 1e-12):.3f}x the floor {_ms(self.floor_ms)} ms); "
            f"floors: {floors} ({bound}-bound)."
        )


def _size(nbytes: int) -> str:
    """Bytes in decimal units, three or four significant figures."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _ms(t: float) -> str:
    return f"{t:.1f}" if t >= 1 else f"{t:.3g}"


def _ranges(idx) -> str:
    out, start = [], None
    for i, b in enumerate(idx):
        if start is None:
            start = b
        if i + 1 == len(idx) or idx[i + 1] != b + 1:
            out.append(str(start) if start == b else f"{start}-{b}")
            start = None
    return ", ".join(out)


def evaluate(inputs: PlanInputs, resident, num_slots: int) -> Placement:
    """The model's prediction for a given placement (budget not enforced: see ``fits``)."""
    res, num_slots = _check_placement(inputs, resident, num_slots)
    return _placement(inputs, res, num_slots, _simulate(inputs, set(res), num_slots))


def _placement(inputs: PlanInputs, res: tuple[int, ...], num_slots: int, ms: float) -> Placement:
    streamed = [i for i in range(inputs.num_blocks) if i not in set(res)]
    load = sum(inputs.load_ms(i) for i in streamed)
    decode = sum(inputs.decode_ms(i) for i in streamed)
    side = load + decode if inputs.decode_on_copy_stream else max(load, decode)
    return Placement(
        resident=res, num_slots=num_slots, predicted_ms=ms,
        device_bytes=_device_bytes(inputs, res, num_slots), slot_bytes=_slot_bytes(inputs, set(res)),
        budget_bytes=inputs.budget_bytes, num_blocks=inputs.num_blocks,
        compute_ms=sum(inputs.compute_ms), transfer_ms=load, decode_ms=decode,
        floor_ms=max(sum(inputs.compute_ms), side),
        streamed_link_bytes=sum(inputs.link_bytes[i] for i in streamed),
    )


# -- search -------------------------------------------------------------------

class _Search:
    """Memoised evaluations of (resident set, slots) under the budget."""

    def __init__(self, inputs: PlanInputs):
        self.inputs = inputs
        self.cache: dict[tuple[frozenset, int], tuple[int, int]] = {}
        self.compute = sum(inputs.compute_ms)
        self.load = [inputs.load_ms(i) for i in range(inputs.num_blocks)]
        self.decode = [inputs.decode_ms(i) for i in range(inputs.num_blocks)]

    def fits(self, res: frozenset, slots: int) -> bool:
        n = self.inputs.num_blocks
        return len(res) < n and _device_bytes(self.inputs, res, slots) <= self.inputs.budget_bytes

    def ms(self, res: frozenset, slots: int) -> float:
        return _simulate(self.inputs, set(res), slots)

    def cost(self, res: frozenset, slots: int) -> tuple[int, int]:
        """(predicted ms in units of 1e-6 ms, device bytes): what the search minimises."""
        key = (res, slots)
        if key not in self.cache:
            self.cache[key] = (_quantise(self.ms(res, slots)), _device_bytes(self.inputs, res, slots))
        return self.cache[key]

    def bound(self, res: frozenset) -> int:
        """A lower bound on the step (quantised): compute, or the copy side's busy time."""
        idx = [i for i in range(self.inputs.num_blocks) if i not in res]
        load, dec = sum(self.load[i] for i in idx), sum(self.decode[i] for i in idx)
        side = load + dec if self.inputs.decode_on_copy_stream else max(load, dec)
        return _quantise(max(self.compute, side) * (1 - _EPS))

    def key(self, res: frozenset, slots: int):
        """Order of preference: faster, then fewer device bytes, fewer slots, lower indices."""
        return (*self.cost(res, slots), slots, sorted(res))


def _quantise(ms: float) -> int:
    return round(ms * 1e6)


def plan(inputs: PlanInputs) -> Placement:
    """The resident set and slot count with the lowest predicted step time
    under ``inputs.budget_bytes``.

    Candidates: every first-N placement, greedy fills by saved load time per
    device byte (one per slot-size cap), then local searches (add / remove /
    swap one block) from the best few of them. The search climbs a ladder of
    budgets from the smallest placement's bytes up to the budget, each rung
    seeded with the best placement of the rung below (which still fits), so a
    larger budget starts from what a smaller one found. The result is never
    predicted slower than the best first-N placement (a candidate)."""
    _check_budget(inputs)
    need = _min_device_bytes(inputs)[0]
    seeds: list[tuple[frozenset, int]] = []
    for k in range(1, _RUNGS + 1):
        budget = need + (inputs.budget_bytes - need) * k // _RUNGS
        rung = replace(inputs, budget_bytes=budget)
        seeds = [_best_at(_Search(rung), seeds)]
    res, slots = seeds[0]
    return _placement(inputs, tuple(sorted(res)), slots, _simulate(inputs, set(res), slots))


def _best_at(search: _Search, seeds) -> tuple[frozenset, int]:
    """The best (resident set, slots) found under ``search``'s budget."""
    inputs = search.inputs
    found = list(seeds)  # fit: the budget only grows
    for slots in inputs.slot_counts:
        starts = {s for s in _first_n(inputs) + _greedy(inputs, slots) if search.fits(s, slots)}
        ranked = sorted(starts | {r for r, s in seeds if s == slots}, key=lambda r: search.key(r, slots))
        found += [(r, slots) for r in ranked]
        found += [(_local_search(search, r, slots), slots) for r in ranked[:_STARTS]]
    best = min(found, key=lambda c: search.key(*c))
    for slots in inputs.slot_counts:  # the best set found, tried with the other slot counts
        if slots != best[1] and search.fits(best[0], slots):
            found.append((_local_search(search, best[0], slots), slots))
    return min(found, key=lambda c: search.key(*c))


def _min_device_bytes(inputs: PlanInputs) -> tuple[int, tuple[int, ...]]:
    """The fewest device bytes any placement needs, and its resident set: with
    the fewest slots, every block larger than some cap resident (the slots
    shrink to the cap)."""
    slots = min(inputs.slot_counts)
    n = inputs.num_blocks
    options = []
    for cap in set(inputs.device_bytes):
        res = tuple(i for i in range(n) if inputs.device_bytes[i] > cap)
        if len(res) < n:
            options.append((_device_bytes(inputs, res, slots), res))
    return min(options)


def _check_budget(inputs: PlanInputs) -> None:
    need, res = _min_device_bytes(inputs)
    if need > inputs.budget_bytes:
        stream_all = _device_bytes(inputs, (), min(inputs.slot_counts))
        raise ValueError(
            f"PlanInputs.budget_bytes={inputs.budget_bytes} is too small: the smallest placement needs {need} "
            f"bytes ({need / 1e9:.3f} GB: fixed {inputs.fixed_device_bytes}, resident blocks {list(res)}, "
            f"{min(inputs.slot_counts)} slots of {_slot_bytes(inputs, set(res))} bytes; streaming every block "
            f"needs {stream_all}); allowed: >= {need}"
        )


def _first_n(inputs: PlanInputs) -> list[frozenset]:
    return [frozenset(range(k)) for k in range(inputs.num_blocks)]


def _spread_order(n: int) -> list[int]:
    """Block indices ordered so that every prefix is spread over the step
    (bit-reversed fractions): ties in the greedy pick spread-out blocks."""
    return sorted(range(n), key=lambda i: _radical_inverse(i))


def _radical_inverse(i: int) -> float:
    out, f = 0.0, 0.5
    while i:
        out += f * (i & 1)
        i >>= 1
        f /= 2
    return out


def _greedy(inputs: PlanInputs, slots: int) -> list[frozenset]:
    """One greedy fill per slot-size cap: blocks larger than the cap are made
    resident first (the slots shrink), then blocks by saved load ms per byte."""
    n = inputs.num_blocks
    rank = {b: r for r, b in enumerate(_spread_order(n))}
    gain = [(inputs.load_ms(i) + inputs.decode_ms(i)) / inputs.device_bytes[i] for i in range(n)]
    order = sorted(range(n), key=lambda i: (-float(f"{gain[i]:.9g}"), rank[i]))
    out = []
    for cap in sorted(set(inputs.device_bytes), reverse=True):
        res = {i for i in range(n) if inputs.device_bytes[i] > cap}
        if len(res) >= n or _device_bytes(inputs, res, slots) > inputs.budget_bytes:
            continue
        for i in order:
            if i not in res and len(res) + 1 < n and _device_bytes(inputs, res | {i}, slots) <= inputs.budget_bytes:
                res.add(i)
        out.append(frozenset(res))
    return out


def _local_search(search: _Search, res: frozenset, slots: int) -> frozenset:
    """First-improvement descent over add / remove / swap moves in a fixed order
    (deterministic); a move must lower (ms, device bytes). Moves whose lower
    bound is already slower are not simulated."""
    improved = True
    while improved:
        improved = False
        current = search.cost(res, slots)
        for cand in _moves(search.inputs.num_blocks, res):
            if search.fits(cand, slots) and search.bound(cand) <= current[0] and search.cost(cand, slots) < current:
                res, improved = cand, True
                break
    return res


def _moves(n: int, res: frozenset):
    out = [i for i in range(n) if i not in res]
    for i in out:
        yield res | {i}
    for r in sorted(res):
        yield res - {r}
    for r in sorted(res):
        for i in out:
            yield (res - {r}) | {i}



# -- from an executor's event log ----------------------------------------------------

_EVENT_KEYS = ("step", "block", "lane", "start_ms", "end_ms")


def _check_events(events, num_blocks: int) -> list[dict]:
    """The records of ``EventLog.resolve()``, checked (ValueError naming the record)."""
    if isinstance(events, (str, bytes, dict)) or not hasattr(events, "__iter__"):
        raise ConfigTypeError(f"events={events!r} must be a list of dicts with keys {', '.join(_EVENT_KEYS)}")
    out = list(events)
    for i, ev in enumerate(out):
        missing = [k for k in _EVENT_KEYS if not isinstance(ev, dict) or k not in ev]
        if missing:
            raise ValueError(f"events[{i}]={ev!r} is not allowed; allowed: a dict with keys "
                             f"{', '.join(_EVENT_KEYS)} (missing {', '.join(missing)})")
        b, lane = ev["block"], ev["lane"]
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_blocks:
            raise ValueError(f"events[{i}].block={b!r} is not allowed; allowed: block indices 0..{num_blocks - 1}")
        if lane not in ("copy", "compute"):
            raise ValueError(f"events[{i}].lane={lane!r} is not allowed; allowed: copy, compute")
        start, end = ev["start_ms"], ev["end_ms"]
        if any(isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) for t in (start, end)) \
                or end < start:
            raise ValueError(f"events[{i}]: start_ms={start!r}, end_ms={end!r} is not allowed; allowed: finite "
                             "times with end_ms >= start_ms")
    return out


COLD_FACTOR = 3.0  # a block measured over this many times its same-layout peers' median ran cold


def compute_from_events(events, device_bytes, *, prior_compute_ms=None,
                        cold_outliers: bool = False) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Per-block compute ms from the log's compute records (the median over the
    steps present), and the blocks that had none (resident while measured).
    ``cold_outliers``: a block measured over ``COLD_FACTOR`` times the median of
    the other blocks of its layout (at least two) takes that median: the first
    step of a signature pays one-time costs in its first blocks (library
    initialisation, autotuning: 97 ms instead of 3.7 ms for Flux's first block on
    the H200), which a plan must not mistake for compute.
    Those take ``prior_compute_ms[i]`` when given (an earlier plan's figures),
    else the median of the measured blocks of the same ``device_bytes`` (the
    same layout computes alike), else the median measured ms per byte times
    their bytes. Returns (compute_ms, estimated block indices)."""
    dev = _int_seq("device_bytes", device_bytes, 1)
    per: dict[int, list[float]] = {}
    for ev in _check_events(events, len(dev)):
        if ev["lane"] == "compute":
            per.setdefault(ev["block"], []).append(float(ev["end_ms"]) - float(ev["start_ms"]))
    if not per:
        raise ValueError("events hold no compute record; allowed: the event log of at least one step "
                         "(record_events=True)")
    measured = {b: statistics.median(v) for b, v in per.items()}
    if cold_outliers:
        measured = _without_cold_outliers(measured, dev)
    prior = None
    if prior_compute_ms is not None:
        prior = tuple(_number(f"prior_compute_ms[{i}]", v, positive=False) for i, v in enumerate(prior_compute_ms))
        if len(prior) != len(dev):
            raise ValueError(f"prior_compute_ms has {len(prior)} entries; allowed: one per block ({len(dev)})")
    per_byte = statistics.median(ms / dev[b] for b, ms in measured.items())
    out, estimated = [], []
    for i, nbytes in enumerate(dev):
        if i in measured:
            out.append(measured[i])
            continue
        estimated.append(i)
        same = [ms for b, ms in measured.items() if dev[b] == nbytes]
        out.append(prior[i] if prior is not None else statistics.median(same) if same else per_byte * nbytes)
    return tuple(out), tuple(estimated)


def _without_cold_outliers(measured: dict[int, float], dev) -> dict[int, float]:
    out = dict(measured)
    for b, ms in measured.items():
        peers = [m for p, m in measured.items() if p != b and dev[p] == dev[b]]
        if len(peers) >= 2:
            typical = statistics.median(peers)
            if ms > COLD_FACTOR * typical:
                out[b] = typical
    return out


def h2d_from_events(events, link_bytes, *, device_bytes=None, decode_gbps=None) -> float:
    """Link bandwidth (GB/s) from the log's copy records: the link bytes of the
    copied blocks over the copies' summed duration. With ``decode_gbps`` a copy
    record is taken to span its decode too (a decode on the copy stream), and
    the modelled decode time (``device_bytes / decode_gbps``) is subtracted."""
    link = _int_seq("link_bytes", link_bytes, 1)
    copies = [ev for ev in _check_events(events, len(link)) if ev["lane"] == "copy"]
    if not copies:
        raise ValueError("events hold no copy record; allowed: the event log of a step that streamed, "
                         "or give h2d_gbps")
    total_ms = sum(float(ev["end_ms"]) - float(ev["start_ms"]) for ev in copies)
    if decode_gbps is not None:
        dev = _int_seq("device_bytes", device_bytes, 1)
        total_ms -= sum(dev[ev["block"]] for ev in copies) / (_number("decode_gbps", decode_gbps, positive=True) * 1e6)
    if total_ms <= 0:
        raise ValueError(f"the copy records of events span {total_ms:.6f} ms (after decode) for "
                         f"{len(copies)} copies: no bandwidth can be measured from them; give h2d_gbps")
    return sum(link[ev["block"]] for ev in copies) / (total_ms * 1e6)


@dataclass(frozen=True)
class AutoPlan:
    """A placement planned from measurements, with what was measured."""

    inputs: PlanInputs
    placement: Placement
    estimated_blocks: tuple[int, ...]  # compute not in the event log (see compute_from_events)
    h2d_measured: bool  # h2d_gbps from the log's copy records (else given)
    compute_source: str = "the event log"
    estimate_source: str = "same-size blocks"

    def describe(self) -> str:
        return describe(self)

    def stats(self) -> dict:
        """Plain-JSON figures for ``stats()``."""
        p = self.placement
        return {
            "resident_blocks": list(p.resident), "num_slots": p.num_slots, "predicted_ms": p.predicted_ms,
            "floor_ms": p.floor_ms, "device_bytes": p.device_bytes, "budget_bytes": p.budget_bytes,
            "h2d_gbps": self.inputs.h2d_gbps, "h2d_measured": self.h2d_measured,
            "step_local": self.inputs.step_local,
            "compute_ms": list(self.inputs.compute_ms), "estimated_blocks": list(self.estimated_blocks),
            "link_bytes": list(self.inputs.link_bytes),
            "describe": self.describe(),
        }


def plan_from_events(events, *, link_bytes, device_bytes, budget_bytes: int, h2d_gbps: float | None = None,
                     fixed_device_bytes: int = 0, decode_gbps: float | None = None,
                     slot_counts=(2, 3, 4), decode_on_copy_stream: bool = True,
                     prior_compute_ms=None, step_local: bool = False, cold_outliers: bool = False) -> AutoPlan:
    """Plan from an executor's event log (``EventLog.resolve()``: dicts with
    step, block, lane, start_ms, end_ms; block = index in execution order):
    per-block compute from its compute records (:func:`compute_from_events`),
    the link bandwidth from its copy records unless ``h2d_gbps`` is given
    (:func:`h2d_from_events`), then :func:`plan` under ``budget_bytes``."""
    if hasattr(events, "__iter__") and not isinstance(events, (str, bytes, dict)):
        events = list(events)  # read twice: compute records, then copy records
    compute, estimated = compute_from_events(events, device_bytes, prior_compute_ms=prior_compute_ms,
                                             cold_outliers=cold_outliers)
    measured = h2d_gbps is None
    if measured:
        h2d_gbps = h2d_from_events(events, link_bytes, device_bytes=device_bytes,
                                   decode_gbps=decode_gbps if decode_on_copy_stream else None)
    inputs = PlanInputs(link_bytes=link_bytes, device_bytes=device_bytes, compute_ms=compute, h2d_gbps=h2d_gbps,
                        budget_bytes=budget_bytes, fixed_device_bytes=fixed_device_bytes, decode_gbps=decode_gbps,
                        slot_counts=slot_counts, decode_on_copy_stream=decode_on_copy_stream,
                        step_local=step_local)
    source = "the earlier plan" if prior_compute_ms is not None else "same-size blocks"
    return AutoPlan(inputs, plan(inputs), estimated, measured, estimate_source=source)


def auto_budget_bytes(*, free_bytes: int, reserved_bytes: int, peak_allocated_bytes: int, weight_bytes: int,
                      margin_bytes: int | None = None) -> int:
    """The device weight budget of ``resident_layers="auto"`` without
    ``device_memory_budget_gb``, from figures read after the first eager step:
    what torch may use (``free_bytes`` from ``torch.cuda.mem_get_info`` plus
    ``reserved_bytes``, ``torch.cuda.memory_reserved``: the caching allocator's
    blocks, the weights it holds now among them), less the step's activations
    (``peak_allocated_bytes`` of the step, ``torch.cuda.max_memory_allocated``,
    less the ``weight_bytes`` held then: fixed modules + resident blocks +
    slots), less ``margin_bytes`` (default ``AUTO_DEVICE_MARGIN_GB``)."""
    margin = int(AUTO_DEVICE_MARGIN_GB * 1e9) if margin_bytes is None else margin_bytes
    figures = dict(free_bytes=free_bytes, reserved_bytes=reserved_bytes, peak_allocated_bytes=peak_allocated_bytes,
                   weight_bytes=weight_bytes, margin_bytes=margin)
    for name, v in figures.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigTypeError(f"auto_budget_bytes: {name}={v!r} must be an int >= 0")
        if v < 0:
            raise ValueError(f"auto_budget_bytes: {name}={v} is not allowed; allowed: ints >= 0")
    activations = max(0, peak_allocated_bytes - weight_bytes)
    budget = free_bytes + reserved_bytes - activations - margin
    if budget <= 0:
        raise ValueError(
            f"resident_layers='auto': free {free_bytes} + reserved {reserved_bytes} bytes less the step's "
            f"activations {activations} and the margin {margin} leave {budget} bytes for weights; allowed: "
            "a positive budget (free device memory, or give device_memory_budget_gb)")
    return budget


def describe(plan_or_placement) -> str:
    """One paragraph for printing: the placement (``Placement.describe``), and
    for an :class:`AutoPlan` where its figures came from."""
    if isinstance(plan_or_placement, Placement):
        return plan_or_placement.describe()
    if not isinstance(plan_or_placement, AutoPlan):
        raise ConfigTypeError(f"describe({plan_or_placement!r}): expected a Placement or an AutoPlan")
    a = plan_or_placement
    n = a.inputs.num_blocks
    got = f"per-block compute of {n - len(a.estimated_blocks)} of {n} blocks from {a.compute_source}"
    if a.estimated_blocks:
        got += f" (blocks {_ranges(a.estimated_blocks)}: from {a.estimate_source})"
    link = "measured from the copy records" if a.h2d_measured else "given"
    return f"{a.placement.describe()} Inputs: {got}; H2D {a.inputs.h2d_gbps:.1f} GB/s {link}."
