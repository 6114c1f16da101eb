"""Measurement: a step's figures from the executor's event log. Pure, no tensors.

Per-block compute (:func:`compute_from_events`, with the cold first blocks of a
signature's first step taken out), the link rate (:func:`h2d_from_events`), the
device weight budget of ``resident_layers="auto"`` without a given one
(:func:`auto_budget_bytes`), and the input signature a plan is kept per
(:func:`signature`). The planners (:mod:`.placement`, :mod:`.codec`) take these.
"""
from __future__ import annotations

import math
import statistics

from weightstream.offload.config import AUTO_DEVICE_MARGIN_GB, ConfigTypeError
from weightstream.offload.plan.ring import _int_seq, _number

__all__ = ["compute_from_events", "h2d_from_events", "auto_budget_bytes", "COLD_FACTOR"]


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
