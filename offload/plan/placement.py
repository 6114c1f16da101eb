"""Placement planner: which blocks stay resident, how many slots. Pure, no tensors.

From per-block bytes, measured per-block compute time, measured link bandwidth
(and decode rate) and a device budget, :func:`plan` picks the resident set and
slot count that minimise the predicted step time, and states its prediction.
Resident blocks need not be the first N.

The step-time model is :mod:`.ring`'s (:func:`.ring.step_ms`); the measurement of its
inputs from an executor's event log is :mod:`.measure`'s.

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

from dataclasses import dataclass, replace

from weightstream.offload.config import ConfigTypeError
from weightstream.offload.plan.measure import compute_from_events, h2d_from_events
from weightstream.offload.plan.ring import (
    _EPS, PlanInputs, _check_placement, _device_bytes, _simulate, _slot_bytes, step_ms,
)

__all__ = ["PlanInputs", "Placement", "plan", "evaluate", "step_ms", "AutoPlan", "plan_from_events", "describe"]

_STARTS = 3  # local searches per slot count, from the best distinct candidates
_RUNGS = 4  # budgets the search climbs (see plan)



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

    def cost(self, res: frozenset, slots: int) -> tuple[int, ...]:
        """(predicted ms in units of 1e-6 ms, device bytes): what the search minimises; with
        ``prefer_resident`` (predicted ms, -resident block bytes, device bytes): among equally fast
        placements the one keeping more block bytes resident, then the fewest device bytes."""
        key = (res, slots)
        if key not in self.cache:
            ms, nbytes = _quantise(self.ms(res, slots)), _device_bytes(self.inputs, res, slots)
            if self.inputs.prefer_resident:
                self.cache[key] = (ms, -sum(self.inputs.device_bytes[i] for i in res), nbytes)
            else:
                self.cache[key] = (ms, nbytes)
        return self.cache[key]

    def bound(self, res: frozenset) -> int:
        """A lower bound on the step (quantised): compute, or the copy side's busy time."""
        idx = [i for i in range(self.inputs.num_blocks) if i not in res]
        load, dec = sum(self.load[i] for i in idx), sum(self.decode[i] for i in idx)
        side = load + dec if self.inputs.decode_on_copy_stream else max(load, dec)
        return _quantise(max(self.compute, side) * (1 - _EPS))

    def key(self, res: frozenset, slots: int):
        """Order of preference: faster, then fewer device bytes (with prefer_resident: more resident
        block bytes first), fewer slots, lower indices."""
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
                     prior_compute_ms=None, step_local: bool = False, cold_outliers: bool = False,
                     prefer_resident: bool = False) -> AutoPlan:
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
                        step_local=step_local, prefer_resident=prefer_resident)
    source = "the earlier plan" if prior_compute_ms is not None else "same-size blocks"
    return AutoPlan(inputs, plan(inputs), estimated, measured, estimate_source=source)



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
