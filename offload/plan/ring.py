"""The ring model: the steady-state step time of a placement. Pure, no tensors.

:class:`PlanInputs` (what the planners know: per-block bytes, compute, link
rate, decode rate, budget) and the discrete-event model of the executor's ring
(:mod:`weightstream.offload.schedule`) that :mod:`.placement` searches over and
:mod:`.codec` predicts with.

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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from weightstream.offload.config import ConfigTypeError

__all__ = ["PlanInputs", "step_ms", "ring_ms"]

_MAX_STEPS = 64  # steps simulated before giving up on exact periodicity
_MAX_PERIOD = 4  # longest step period searched for
_EPS = 1e-9  # relative tolerance on times (ms)


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
    prefer_resident: among placements predicted equally fast, prefer more device bytes (resident
    blocks) instead of fewer (the planned default: what the model leaves out of a streamed
    block, its hooks and copy-engine traffic, is not free).
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
    prefer_resident: bool = False

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
        for name in ("decode_on_copy_stream", "step_local", "prefer_resident"):
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
