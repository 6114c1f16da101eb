"""The trace file: format, save/load, a summary, and a Perfetto export.

A trace (``weightstream-trace/1``) is what ``MemoryMonitor`` recorded: NVML
samples per GPU, PCIe throughput, torch allocator figures, the host RSS, and
controller event logs (per-block copy/compute intervals). ``to_perfetto``
turns it into Chrome's trace-event JSON, which ui.perfetto.dev and
chrome://tracing open: one track per event log lane (copy, compute), counter
tracks for the samples. Pure functions over plain dicts; no torch, no NVML.
"""
from __future__ import annotations

import json
import os

TRACE_FORMAT = "weightstream-trace/1"


def save_trace(trace: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    return path


def load_trace(path: str) -> dict:
    with open(path) as f:
        trace = json.load(f)
    if trace.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a weightstream trace (format {trace.get('format')!r}, want {TRACE_FORMAT!r})")
    return trace


def _peak(xs) -> float | None:
    vals = [x for x in xs if x is not None]
    return max(vals) if vals else None


def trace_summary(trace: dict) -> dict:
    """Peaks per device from a trace (bytes, %, MB/s)."""
    gpus = []
    for d, g, p in zip(trace["devices"], trace["gpu"], trace["pcie"]):
        gpus.append({"index": d["index"], "name": d["name"], "total_bytes": d["total_bytes"],
                     "peak_used_bytes": _peak(g["used_bytes"]), "peak_util_pct": _peak(g["util_pct"]),
                     "peak_rx_mbs": _peak(p["rx_mbs"]), "peak_tx_mbs": _peak(p["tx_mbs"])})
    tor = trace["torch"]
    return {
        "duration_s": trace["duration_s"], "n_samples": trace["n_samples"], "effective_hz": trace["effective_hz"],
        "nvml": trace["nvml"]["available"], "gpus": gpus,
        "torch": [{"device": dev, "peak_allocated_bytes": _peak(tor["allocated_bytes"][i]),
                   "peak_reserved_bytes": _peak(tor["reserved_bytes"][i])} for i, dev in enumerate(tor["devices"])],
        "host_peak_rss_bytes": _peak(trace["host"]["rss_bytes"]),
        "events": {k: len(v) for k, v in trace["events"].items()},
    }



def _counter(name: str, pid: str, ts_s, values, unit: str, scale: float = 1.0) -> list[dict]:
    return [{"name": name, "ph": "C", "pid": pid, "ts": t * 1e6, "args": {unit: v / scale}}
            for t, v in zip(ts_s, values) if v is not None]


def _process(pid: str, sort: int) -> list[dict]:
    return [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": pid}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": sort}}]


def to_perfetto(trace: dict) -> dict:
    """Chrome trace-event JSON (``{"traceEvents": [...]}``) of a weightstream trace.

    Samples are counters on the monitor's clock (seconds since it started);
    each controller event log is a process with a "copy" and a "compute"
    thread of complete events on the log's own clock (ms since the executor's
    origin). Timestamps are in microseconds, as the format wants.
    """
    out: list[dict] = []
    for i, (d, g) in enumerate(zip(trace["devices"], trace["gpu"])):
        pid = f"GPU{d['index']} {d.get('name', '')}".strip()
        out += _process(pid, i)
        out += _counter("memory used (GB)", pid, trace["t"], g["used_bytes"], "GB", 1e9)
        out += _counter("utilisation (%)", pid, trace["t"], g["util_pct"], "pct")
        if i < len(trace["pcie"]):
            p = trace["pcie"][i]
            out += _counter("PCIe H2D (GB/s)", pid, p["t"], p["rx_mbs"], "GBps", 1e3)
            out += _counter("PCIe D2H (GB/s)", pid, p["t"], p["tx_mbs"], "GBps", 1e3)
    tor = trace["torch"]
    for i, dev in enumerate(tor["devices"]):
        pid = f"torch allocator {dev}"
        out += _process(pid, 100 + i)
        out += _counter("allocated (GB)", pid, tor["t"], tor["allocated_bytes"][i], "GB", 1e9)
        out += _counter("reserved (GB)", pid, tor["t"], tor["reserved_bytes"][i], "GB", 1e9)
    host = trace["host"]
    if host["rss_bytes"]:
        pid = f"host pid {host['pid']}"
        out += _process(pid, 200)
        out += _counter("RSS (GB)", pid, host["t"], host["rss_bytes"], "GB", 1e9)
    for j, (name, events) in enumerate(sorted(trace["events"].items())):
        pid = f"weightstream {name}"
        out += _process(pid, 300 + j)
        for tid, lane in enumerate(("copy", "compute")):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}})
        for e in events:
            out.append({"name": f"{e['lane']} block {e['block']}", "cat": e["lane"], "ph": "X", "pid": pid,
                        "tid": 0 if e["lane"] == "copy" else 1, "ts": e["start_ms"] * 1e3,
                        "dur": max(0.0, e["end_ms"] - e["start_ms"]) * 1e3,
                        "args": {"step": e["step"], "block": e["block"]}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"source": TRACE_FORMAT, "created": trace.get("created"), "meta": trace.get("meta", {})}}
