"""Copy and compute lanes of a profiler trace: where the copy engine idles.

A transfer-bound streamed step is as fast as its H2D copies are back to back;
every gap on the copy lane (no host-to-device copy running) adds to the step.
:func:`lane_summary` reads the events of a ``torch.profiler`` Chrome trace
(pure: a list of dicts, CPU-tested) and reports each lane's busy time and the
copy lane's gaps, each with what the compute lane did meanwhile.
:func:`kernel_totals` adds kernel time per class (NCCL, decode, other) and
per CUDA stream. :func:`profile_steps` is the thin mechanism the perf worker calls
(``python -m perf _worker ... --profile-dir DIR``).
"""
from __future__ import annotations

import gzip
import json
import os


def _intervals(events, pred) -> list[tuple[float, float, dict]]:
    out = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e) for e in events
           if e.get("ph") == "X" and pred(e)]
    return sorted(out, key=lambda x: x[0])


def is_h2d(e: dict) -> bool:
    name = e.get("name", "")
    return e.get("cat") == "gpu_memcpy" and ("HtoD" in name or "Host to Device" in name)


def is_kernel(e: dict) -> bool:
    return e.get("cat") == "kernel"


def _union(iv: list[tuple[float, float, dict]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e, _ in iv:
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in spans)


def lane_summary(events: list[dict], *, min_gap_us: float = 200.0, top: int = 20) -> dict:
    """Busy time of the H2D copy lane and the kernel lane, and the copy lane's
    gaps of at least ``min_gap_us`` (times in ms from the first copy)."""
    copies = _intervals(events, is_h2d)
    kernels = _intervals(events, is_kernel)
    if not copies:
        return {"copies": 0, "kernels": len(kernels)}
    t0, t1 = copies[0][0], max(e for _, e, _ in copies)
    copy_busy = _union(copies)
    compute_busy = _union(kernels)
    gaps = []
    for (s0, e0), (s1, _) in zip(copy_busy, copy_busy[1:]):
        if s1 - e0 < min_gap_us:
            continue
        before = max((c for c in copies if c[1] <= e0 + 1e-3), key=lambda c: c[1])
        after = min((c for c in copies if c[0] >= s1 - 1e-3), key=lambda c: c[0])
        running = [k for k in kernels if k[0] < s1 and k[1] > e0]
        gaps.append({
            "at_ms": round((e0 - t0) / 1e3, 3),
            "gap_ms": round((s1 - e0) / 1e3, 3),
            "compute_busy_ms": round(_overlap(compute_busy, e0, s1) / 1e3, 3),
            "kernels": len(running),
            "first_kernels": [k[2].get("name", "")[:60] for k in running[:3]],
            "copy_before_mb": round(_bytes(before[2]) / 1e6, 1),
            "copy_after_mb": round(_bytes(after[2]) / 1e6, 1),
        })
    sizes = [_bytes(c[2]) for c in copies]
    rates = sorted(_bytes(c[2]) / (c[1] - c[0]) / 1e3 for c in copies if _bytes(c[2]) >= 1e8 and c[1] > c[0])
    window = t1 - t0
    busy = sum(e - s for s, e in copy_busy)
    return {
        "copies": len(copies),
        "kernels": len(kernels),
        "copy_bytes": int(sum(sizes)),
        "window_ms": round(window / 1e3, 3),
        "copy_busy_ms": round(busy / 1e3, 3),
        "copy_idle_ms": round((window - busy) / 1e3, 3),
        "compute_busy_ms": round(_overlap(compute_busy, t0, t1) / 1e3, 3),
        "big_copy_gbps_median": round(rates[len(rates) // 2], 2) if rates else None,
        "gaps_over_min": len(gaps),
        "gaps_total_ms": round(sum(g["gap_ms"] for g in gaps), 3),
        "gaps": sorted(gaps, key=lambda g: -g["gap_ms"])[:top],
        "gaps_in_time_order": [(g["at_ms"], g["gap_ms"]) for g in gaps],
    }


KERNEL_CLASSES = (("nccl", ("nccl",)), ("decode", ("_decode_kernel",)))  # class, name substrings


def kernel_class(name: str, classes=KERNEL_CLASSES) -> str:
    """The first class one of whose substrings is in ``name`` (case-insensitive), else "other"."""
    low = name.lower()
    return next((c for c, subs in classes if any(x.lower() in low for x in subs)), "other")


def kernel_totals(events: list[dict], classes=KERNEL_CLASSES) -> dict:
    """Kernel time per class (count, summed ms) and per CUDA stream (busy ms: the union of its
    kernels; summed ms per class), over the span of all kernels."""
    kernels = _intervals(events, is_kernel)
    if not kernels:
        return {"kernels": 0}
    out: dict = {"kernels": len(kernels), "span_ms": round((max(e for _, e, _ in kernels) - kernels[0][0]) / 1e3, 3),
                 "classes": {}, "streams": {}}
    by_stream: dict = {}
    for s, e, ev in kernels:
        c = kernel_class(ev.get("name", ""), classes)
        tot = out["classes"].setdefault(c, {"count": 0, "ms": 0.0})
        tot["count"] += 1
        tot["ms"] += (e - s) / 1e3
        stream = str((ev.get("args") or {}).get("stream", "?"))
        by_stream.setdefault(stream, []).append((s, e, ev))
        per = out["streams"].setdefault(stream, {"busy_ms": 0.0, "ms": {}})
        per["ms"][c] = per["ms"].get(c, 0.0) + (e - s) / 1e3
    for stream, iv in by_stream.items():
        per = out["streams"][stream]
        per["busy_ms"] = round(sum(e - s for s, e in _union(iv)) / 1e3, 3)
        per["ms"] = {c: round(v, 3) for c, v in per["ms"].items()}
    for tot in out["classes"].values():
        tot["ms"] = round(tot["ms"], 3)
    return out


def _bytes(e: dict) -> float:
    args = e.get("args") or {}
    return float(args.get("bytes", args.get("Bytes", 0)) or 0)


def profile_steps(run, steps: int, out_dir: str, label: str, *, keep_trace: bool = True) -> dict:
    """Run ``steps`` calls of ``run`` under torch.profiler (CUDA activity);
    write ``<label>-lanes.json`` (and the gzipped trace) to ``out_dir``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    raw = os.path.join(out_dir, f"{label}-trace.json")
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        events = json.load(f).get("traceEvents", [])
    summary = {"label": label, "steps": steps, **lane_summary(events), "kernel_totals": kernel_totals(events)}
    with open(os.path.join(out_dir, f"{label}-lanes.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if keep_trace:
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            dst.write(src.read())
    os.remove(raw)
    return summary
