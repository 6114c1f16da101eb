"""The one summary of a planning (:mod:`.auto`): ``stats()["plan"]`` and the planned default's line.

What the measured step gave (the step's compute, the link rate, the blocks), the budget planned
in and where it came from, and what was chosen (the resident blocks and slots, the codec and the
coded blocks, whether they are coded in the background), with the prediction. Plain JSON; the
``describe`` entry is the one line ``weightstream plan: ...`` printed once by the planned default.
"""
from __future__ import annotations

from weightstream.offload.progress import format_bytes

__all__ = ["plan_summary"]


def plan_summary(auto, rplan, cplan, events) -> dict:
    """The summary of one planning by ``auto`` (an :class:`.auto.AutoStep`): ``rplan`` the
    placement (None: the residency was not planned), ``cplan`` the codec plan (None: not planned)."""
    sb = auto.streamed
    n = len(sb.blocks)
    if rplan is not None:
        compute, h2d = sum(rplan.inputs.compute_ms), rplan.inputs.h2d_gbps
    else:
        compute, h2d = cplan.compute_ms, cplan.h2d_gbps
    sched = sb.schedule
    resident = sorted(rplan.placement.resident) if rplan is not None else list(sched.resident_blocks)
    slots = rplan.placement.slots_used if rplan is not None else sched.ring_slots
    codec = cplan.codec if cplan is not None else None
    coded = list(cplan.coded) if cplan is not None else []
    background = bool(cplan is not None and cplan.added and sb.source.coding_active)  # a job still running
    predicted = cplan.predicted_ms if cplan is not None else rplan.placement.predicted_ms
    out = {
        "planned_keys": list(auto.default) or [k for k, p in (("resident_layers", auto.residency),
                                                               ("weight_codec", auto.codec)) if p is not None],
        "default": bool(auto.default),
        "measured": {"compute_ms": compute, "h2d_gbps": h2d, "blocks": n,
                     "steps": len({ev["step"] for ev in events}) or 1},
        "budget_bytes": rplan.placement.budget_bytes if rplan is not None else None,
        "budget_from": auto.residency.budget_from if rplan is not None else None,
        "resident_blocks": resident, "num_slots": slots,
        "codec": codec, "coded_blocks": coded, "coding_in_background": background,
        "predicted_ms": predicted,
        "uncoded_ms": cplan.uncoded_ms if cplan is not None else None,
    }
    out["describe"] = _line(out, n)
    return out


def _line(s: dict, n: int) -> str:
    m = s["measured"]
    head = f"measured compute {m['compute_ms']:.1f} ms and H2D {m['h2d_gbps']:.1f} GB/s over {n} blocks"
    budget = "" if s["budget_bytes"] is None else \
        f"; budget {format_bytes(s['budget_bytes'])} ({s['budget_from']})"
    res = s["resident_blocks"]
    chose = f"{len(res)} of {n} blocks resident, {n - len(res)} streamed through {s['num_slots']} slot" \
            f"{'s' if s['num_slots'] != 1 else ''}"
    if s["codec"]:
        chose += f", {len(s['coded_blocks'])} coded with {s['codec']}" + \
                 (" (in the background; raw until coded)" if s["coding_in_background"] else "")
    elif s["uncoded_ms"] is not None:
        chose += ", no coding"
    pred = f"predicted step {s['predicted_ms']:.1f} ms"
    if s["uncoded_ms"] is not None and s["codec"]:
        pred += f" (uncoded {s['uncoded_ms']:.1f} ms)"
    elif s["uncoded_ms"] is not None and m["compute_ms"] >= s["predicted_ms"] * (1 - 1e-9):
        pred += " (compute-bound: coding cannot help)"
    return f"{head}{budget}; chose {chose}; {pred}."
