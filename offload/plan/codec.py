"""``weight_codec="auto"``: which streamed blocks to code, and with which codec. Pure, no tensors.

Coding a block moves fewer bytes over the host link but costs a decode on the
GPU's SMs. A transfer-bound step (Flux at 1024 px on the H200: the uncoded
stream takes 426 ms, the compute 172 ms) gains about 0.3 of its step; a
compute-bound one (Wan 14B at 480p: the raw stream already hides under the
compute) gains nothing and pays the decode: measured, 1.011-1.013x the resident
step with every block coded. So the codec is planned from a measured step,
like the resident set (:mod:`.placement`):

- inputs: per-block compute (ms, execution order) and the link rate from the
  first eager step's event log (every block streamed raw); per codec the coded
  bytes of each streamed block (sampled: one block of each layout encoded) and
  its decode rate (that block decoded on the device, timed);
- model: the planner's ring (:func:`.ring.ring_ms`). A coded block's load
  moves its coded bytes; its decode runs on the decode stream after its copy
  (eager) or, with CUDA graphs, on the compute stream just before the block
  (the block's compute grows by the decode time). Eager decodes share the SMs
  with the compute: the step is at least the summed compute plus ``steal``
  times the summed decode time (1.15: Wan with every block coded ran 34-41 ms
  over its resident step for 36 ms of decode; a GEMM loop with
  nothing idle loses more, 2.27x, but
  a streamed step's compute has gaps);
- search: per codec, blocks ordered by saved link time per unit of decode
  cost (ties spread over the step), every prefix of that order evaluated; the
  fastest prediction wins, the fewest coded blocks among equals. Coding
  anything must be predicted ``min_gain`` (1%) faster than coding nothing, so
  noise in a measurement never buys a decode. A later plan (a new input
  signature) keeps the blocks coded so far (``fixed``, their codec the one
  option) and may add more.

:class:`CodecPlan` states the choice and its prediction (printed once, kept in
``stats()["codec_plan"]``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from weightstream.offload.config import ConfigTypeError
from weightstream.offload.plan.placement import _radical_inverse
from weightstream.offload.plan.ring import ring_ms

__all__ = ["CodecOption", "CodecPlanInputs", "CodecPlan", "plan_codec", "predict_ms", "DECODE_STEAL", "MIN_GAIN",
           "DECODE_ON"]

DECODE_STEAL = 1.15  # compute time an eager decode costs a step, in units of its own time (module doc)
MIN_GAIN = 0.01  # coding must be predicted this much faster than not coding
DECODE_ON = ("side", "compute")  # eager: a decode stream; CUDA graphs: the compute stream, at use


def _positive(name: str, v, *, zero: bool = False) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ConfigTypeError(f"{name}={v!r} must be a number")
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise ValueError(f"{name}={v!r} is not allowed; allowed: a finite number {'>=' if zero else '>'} 0")
    return float(v)


@dataclass(frozen=True)
class CodecOption:
    """One codec: ``coded_bytes[i]`` the link bytes block ``i`` would move coded (None for a
    resident block), ``decode_gbps`` its decode rate in decoded (raw) GB/s on this device."""

    name: str
    coded_bytes: tuple
    decode_gbps: float

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigTypeError(f"CodecOption.name={self.name!r} must be a codec name")
        object.__setattr__(self, "coded_bytes", tuple(self.coded_bytes))
        object.__setattr__(self, "decode_gbps", _positive("CodecOption.decode_gbps", self.decode_gbps))


@dataclass(frozen=True)
class CodecPlanInputs:
    """What the codec planner knows (times in ms, rates in GB/s = 1e9 B/s).

    compute_ms[i]: measured compute of block ``i`` (execution order, every block).
    raw_bytes[i]: raw link bytes of streamed block ``i``; None for a resident block.
    h2d_gbps: the measured link rate. num_slots: the ring's slots.
    options: the codecs to choose from. decode_on: "side" (eager) or "compute" (graphs).
    step_local: the CUDA-graph schedule with resident blocks (:mod:`.ring`).
    fixed: blocks coded already (an earlier plan), with the one option given; the plan adds to them.
    decoded_bytes[i]: bytes block ``i``'s decode writes (None: its ``raw_bytes``, one process streaming
    whole blocks). DLO AllGather: a rank's link moves its 1/N share of a block, its decode the whole block.
    """

    compute_ms: tuple
    raw_bytes: tuple
    h2d_gbps: float
    num_slots: int
    options: tuple
    decode_on: str = "side"
    step_local: bool = False
    steal: float = DECODE_STEAL
    min_gain: float = MIN_GAIN
    fixed: tuple = ()
    decoded_bytes: tuple | None = None

    def __post_init__(self):
        comp = tuple(_positive(f"compute_ms[{i}]", v, zero=True) for i, v in enumerate(self.compute_ms))
        raw = tuple(self.raw_bytes)
        if len(raw) != len(comp) or not comp:
            raise ValueError(f"raw_bytes has {len(raw)} entries for {len(comp)} compute_ms; allowed: one per "
                             "block, at least one block")
        for i, b in enumerate(raw):
            if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
                raise ValueError(f"raw_bytes[{i}]={b!r} is not allowed; allowed: an int >= 1 or None (resident)")
        if all(b is None for b in raw):
            raise ValueError("raw_bytes names no streamed block; allowed: at least one int")
        if self.decoded_bytes is not None:
            dec = tuple(self.decoded_bytes)
            if len(dec) != len(raw) or any((d is None) != (r is None) or (d is not None and (
                    not isinstance(d, int) or isinstance(d, bool) or d < 1)) for d, r in zip(dec, raw)):
                raise ValueError(f"decoded_bytes={self.decoded_bytes!r} is not allowed; allowed: None, or an int "
                                 ">= 1 exactly where raw_bytes has one (None for resident blocks)")
            object.__setattr__(self, "decoded_bytes", dec)
        for opt in self.options:
            if not isinstance(opt, CodecOption):
                raise ConfigTypeError(f"options holds {opt!r}; expected CodecOption")
            if len(opt.coded_bytes) != len(raw) or any((c is None) != (r is None) or (c is not None and c < 1)
                                                       for c, r in zip(opt.coded_bytes, raw)):
                raise ValueError(f"CodecOption {opt.name!r}: coded_bytes must have an int >= 1 exactly where "
                                 "raw_bytes has one (None for resident blocks)")
        if self.decode_on not in DECODE_ON:
            raise ValueError(f"decode_on={self.decode_on!r} is not allowed; choose from: {', '.join(DECODE_ON)}")
        if not isinstance(self.num_slots, int) or isinstance(self.num_slots, bool) or self.num_slots < 1:
            raise ValueError(f"num_slots={self.num_slots!r} is not allowed; allowed: an int >= 1")
        fixed = tuple(sorted(set(self.fixed)))
        if fixed and (len(self.options) != 1 or any(not isinstance(i, int) or isinstance(i, bool) or
                                                    not 0 <= i < len(raw) or raw[i] is None for i in fixed)):
            raise ValueError(f"fixed={self.fixed!r} is not allowed; allowed: streamed block indices, with exactly "
                             "one option (the codec they are coded with)")
        object.__setattr__(self, "fixed", fixed)
        object.__setattr__(self, "compute_ms", comp)
        object.__setattr__(self, "raw_bytes", raw)
        object.__setattr__(self, "options", tuple(self.options))
        object.__setattr__(self, "h2d_gbps", _positive("h2d_gbps", self.h2d_gbps))
        object.__setattr__(self, "steal", _positive("steal", self.steal, zero=True))
        object.__setattr__(self, "min_gain", _positive("min_gain", self.min_gain, zero=True))

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i, b in enumerate(self.raw_bytes) if b is not None)

    def decoded(self, i: int) -> int:
        """Bytes block ``i``'s decode writes."""
        return self.raw_bytes[i] if self.decoded_bytes is None else self.decoded_bytes[i]


@dataclass(frozen=True)
class CodecPlan:
    """The choice: ``codec`` (None: nothing coded) for blocks ``coded`` (execution order)."""

    codec: str | None
    coded: tuple[int, ...]  # every coded block, those coded before this plan included
    predicted_ms: float
    uncoded_ms: float  # the same model with nothing coded
    compute_ms: float  # the step's compute, summed
    candidates: dict  # codec -> its best (coded count, predicted ms)
    h2d_gbps: float
    decode_gbps: dict  # codec -> measured decode rate
    decode_on: str
    added: tuple[int, ...] = ()  # the blocks this plan codes (the others of ``coded`` were already)
    current_ms: float | None = None  # predicted with the blocks coded before this plan only
    def describe(self) -> str:
        n = sum(1 for _ in self.coded)
        rates = ", ".join(f"{c} decodes {g:.3g} GB/s" for c, g in self.decode_gbps.items())
        tried = "; ".join(f"{c}: {k} coded -> {ms:.1f} ms" for c, (k, ms) in self.candidates.items())
        before = n - len(self.added)
        if before:
            head = (f"{before} blocks coded already with {self.codec}; code {len(self.added)} more"
                    if self.added else f"{before} blocks coded already with {self.codec}; code no more")
        else:
            head = (f"code {n} block{'s' if n != 1 else ''} with {self.codec}" if self.codec else
                    "code no block (the raw stream is predicted as fast: coding would only add decode work)")
        return (f"{head}. Predicted step {self.predicted_ms:.1f} ms, uncoded {self.uncoded_ms:.1f} ms, compute "
                f"{self.compute_ms:.1f} ms; H2D {self.h2d_gbps:.1f} GB/s measured, {rates} (decode on the "
                f"{'compute' if self.decode_on == 'compute' else 'decode'} stream). Best per codec: {tried}.")

    def stats(self) -> dict:
        return {"codec": self.codec, "coded_blocks": list(self.coded), "added_blocks": list(self.added),
                "predicted_ms": self.predicted_ms,
                "uncoded_ms": self.uncoded_ms, "current_ms": self.current_ms, "compute_ms": self.compute_ms, "h2d_gbps": self.h2d_gbps,
                "decode_gbps": dict(self.decode_gbps), "decode_on": self.decode_on,
                "candidates": {c: list(v) for c, v in self.candidates.items()}, "describe": self.describe()}


def predict_ms(inputs: CodecPlanInputs, option: CodecOption | None, coded) -> float:
    """The model's step (ms) with blocks ``coded`` (execution order) coded by ``option``."""
    coded = set(coded)
    blocks, streamed, stolen = [], 0, 0.0
    for i, (c, raw) in enumerate(zip(inputs.compute_ms, inputs.raw_bytes)):
        if raw is None:
            blocks.append((c, None))
            continue
        streamed += 1
        if i not in coded or option is None:
            blocks.append((c, (raw / (inputs.h2d_gbps * 1e6), 0.0)))
            continue
        dec = inputs.decoded(i) / (option.decode_gbps * 1e6)
        load = option.coded_bytes[i] / (inputs.h2d_gbps * 1e6)
        if inputs.decode_on == "compute":
            blocks.append((c + dec, (load, 0.0)))
        else:
            blocks.append((c, (load, dec)))
            stolen += inputs.steal * dec
    ring = ring_ms(blocks, min(inputs.num_slots, streamed), separate_decode=True,
                   step_local=inputs.step_local and streamed < len(blocks))
    return max(ring, sum(inputs.compute_ms) + stolen)


def _order(inputs: CodecPlanInputs, option: CodecOption) -> list[int]:
    """Streamed blocks by saved link ms per ms of decode cost; ties spread over the step."""
    cost = 1.0 if inputs.decode_on == "compute" else max(inputs.steal, 1e-9)
    streamed = inputs.streamed
    rank = {b: _radical_inverse(r) for r, b in enumerate(streamed)}

    def gain(i: int) -> float:
        saved = (inputs.raw_bytes[i] - option.coded_bytes[i]) / (inputs.h2d_gbps * 1e6)
        return saved / (cost * inputs.decoded(i) / (option.decode_gbps * 1e6))

    return sorted((i for i in streamed if option.coded_bytes[i] < inputs.raw_bytes[i]),
                  key=lambda i: (-float(f"{gain(i):.9g}"), rank[i]))


def plan_codec(inputs: CodecPlanInputs) -> CodecPlan:
    """The coded set and codec with the lowest predicted step (module doc); with ``inputs.fixed``
    the blocks to add to those (their codec, the one option)."""
    fixed = inputs.fixed
    uncoded = predict_ms(inputs, None, ())
    current = predict_ms(inputs, inputs.options[0], fixed) if fixed else uncoded
    best = (current, 0, inputs.options[0].name if fixed else None, fixed)
    candidates = {}
    for opt in inputs.options:
        order = [i for i in _order(inputs, opt) if i not in fixed]
        top = (current, 0)
        for n in range(1, len(order) + 1):
            ms = predict_ms(inputs, opt, fixed + tuple(order[:n]))
            if ms < top[0] * (1 - 1e-9):
                top = (ms, n)
        candidates[opt.name] = (len(fixed) + top[1], top[0])
        if top[1] and top[0] < best[0] * (1 - 1e-9):
            best = (top[0], top[1], opt.name, tuple(sorted(fixed + tuple(order[: top[1]]))))
    ms, added, codec, coded = best
    if added and ms > current * (1 - inputs.min_gain):
        ms, codec, coded = current, (inputs.options[0].name if fixed else None), fixed
    return CodecPlan(codec=codec, coded=coded, predicted_ms=ms, uncoded_ms=uncoded,
                     compute_ms=sum(inputs.compute_ms), candidates=candidates, h2d_gbps=inputs.h2d_gbps,
                     decode_gbps={o.name: o.decode_gbps for o in inputs.options}, decode_on=inputs.decode_on,
                     added=tuple(i for i in coded if i not in fixed), current_ms=current)
