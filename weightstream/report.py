"""Render a recorded trace (weightstream.telemetry) into a self-contained HTML
report: a memory timeline per GPU (NVML used, torch allocated / reserved,
utilisation), PCIe throughput, host RSS, and an overlap timeline per event log
(copy vs compute lane per block: whether transfers hide behind compute).

matplotlib is optional: without it the HTML still holds every number (and a
note says why there is no picture). The plotted data sit in the HTML as
`<script type="application/json" id="weightstream-trace">` and
`id="weightstream-overlap"` blocks; the PNG is embedded as base64 and also
written beside the HTML.
"""
from __future__ import annotations

import base64
import html
import io
import json
import os
from typing import Any


def _import_matplotlib():
    """(Figure class) or None when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


# ------------------------------------------------------------------ overlap arithmetic

def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> float:
    """Total length of the overlap of two unions of disjoint sorted intervals."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            total += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_stats(events: list[dict]) -> dict:
    """Per step and in total: copy busy ms, compute busy ms, copy ms hidden
    behind compute, exposed copy ms, compute idle ms inside the step's span,
    and the copy lane's busy fraction of the span (near 1 when a step is
    transfer-bound and the link never idles)."""
    steps: dict[int, dict[str, list]] = {}
    for e in events:
        lanes = steps.setdefault(int(e["step"]), {"copy": [], "compute": []})
        lanes[e["lane"]].append((float(e["start_ms"]), float(e["end_ms"])))
    rows = []
    for step in sorted(steps):
        copy, comp = _union(steps[step]["copy"]), _union(steps[step]["compute"])
        every = copy + comp
        span = (max(b for _, b in every) - min(a for a, _ in every)) if every else 0.0
        copy_ms, comp_ms = _length(copy), _length(comp)
        hidden = _intersection(copy, comp)
        rows.append({
            "step": step, "span_ms": span, "copy_ms": copy_ms, "compute_ms": comp_ms,
            "hidden_copy_ms": hidden, "exposed_copy_ms": copy_ms - hidden,
            "compute_idle_ms": max(span - comp_ms, 0.0),
            "hidden_fraction": (hidden / copy_ms) if copy_ms > 0 else None,
            "copy_busy_fraction": (copy_ms / span) if span > 0 else None,
        })
    tot = {k: sum(r[k] for r in rows) for k in ("span_ms", "copy_ms", "compute_ms", "hidden_copy_ms",
                                                "exposed_copy_ms", "compute_idle_ms")}
    tot["hidden_fraction"] = (tot["hidden_copy_ms"] / tot["copy_ms"]) if tot["copy_ms"] > 0 else None
    tot["copy_busy_fraction"] = (tot["copy_ms"] / tot["span_ms"]) if tot["span_ms"] > 0 else None
    tot["steps"] = len(rows)
    return {"steps": rows, "total": tot}


# ------------------------------------------------------------------ figure

def _has_gpu_data(trace) -> bool:
    return bool(trace["devices"]) or bool(trace["torch"]["devices"])


def build_figure(trace: dict):
    """A matplotlib Figure of the trace, or None without matplotlib."""
    Figure = _import_matplotlib()
    if Figure is None:
        return None
    gpu_idx = sorted({d["index"] for d in trace["devices"]} | set(trace["torch"]["devices"]))
    event_logs = [(k, v) for k, v in trace["events"].items() if v]
    has_pcie = any(p["t"] for p in trace["pcie"])
    has_host = bool(trace["host"]["t"])
    panels = [("gpu", i) for i in gpu_idx] + ([("pcie", None)] if has_pcie else []) \
        + ([("host", None)] if has_host else []) + [("events", k) for k, _ in event_logs]
    if not panels:
        panels = [("empty", None)]
    fig = Figure(figsize=(12, 2.6 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    by_index = {d["index"]: (d, g) for d, g in zip(trace["devices"], trace["gpu"])}
    for ax, (kind, key) in zip(axes, panels):
        if kind == "gpu":
            _plot_gpu(ax, trace, key, by_index.get(key))
        elif kind == "pcie":
            for d, p in zip(trace["devices"], trace["pcie"]):
                ax.plot(p["t"], [x / 1e3 for x in p["rx_mbs"]], label=f"GPU{d['index']} rx (H2D)")
                ax.plot(p["t"], [x / 1e3 for x in p["tx_mbs"]], label=f"GPU{d['index']} tx (D2H)", ls="--")
            ax.set_ylabel("PCIe GB/s")
            ax.set_xlabel("s")
            ax.legend(loc="upper right", fontsize=7)
            ax.set_title("PCIe throughput (NVML)")
        elif kind == "host":
            ax.plot(trace["host"]["t"], [x / 1e9 for x in trace["host"]["rss_bytes"]], color="tab:brown")
            ax.ticklabel_format(axis="y", useOffset=False)
            ax.set_ylabel("GB")
            ax.set_xlabel("s")
            ax.set_title(f"host RSS (pid {trace['host']['pid']} and children)")
        elif kind == "events":
            _plot_events(ax, key, trace["events"][key])
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center")
            ax.set_axis_off()
    return fig


def _plot_gpu(ax, trace, index, nvml):
    tor = trace["torch"]
    if nvml is not None:
        d, g = nvml
        t = trace["t"][: len(g["used_bytes"])]
        used = [None if x is None else x / 1e9 for x in g["used_bytes"]]
        ax.plot(t, used, label="NVML used", color="tab:blue")
        peak = max((u for u in used if u is not None), default=0.0)
        if peak > 0.5 * d["total_bytes"] / 1e9:   # else the total line would flatten the curves
            ax.axhline(d["total_bytes"] / 1e9, color="tab:blue", ls=":", lw=0.8, label="total")
        ax2 = ax.twinx()
        ax2.plot(t, g["util_pct"], color="tab:gray", lw=0.6, alpha=0.6)
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("util %", color="tab:gray")
        title = f"GPU{index} {d['name']} ({d['total_bytes'] / 1e9:.0f} GB)"
    else:
        title = f"GPU{index} (no NVML: {trace['nvml'].get('message') or 'unavailable'})"[:110]
    if index in tor["devices"]:
        i = tor["devices"].index(index)
        ax.plot(tor["t"], [x / 1e9 for x in tor["allocated_bytes"][i]], label="torch allocated", color="tab:green")
        ax.plot(tor["t"], [x / 1e9 for x in tor["reserved_bytes"][i]], label="torch reserved",
                color="tab:orange", ls="--")
    ax.set_ylabel("GB")
    ax.set_xlabel("s")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=7)


def _plot_events(ax, name, events):
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    lanes = {"compute": 0, "copy": 1}
    for e in events:
        y = lanes[e["lane"]]
        ax.broken_barh([(e["start_ms"], max(e["end_ms"] - e["start_ms"], 1e-6))], (y - 0.4, 0.8),
                       facecolors=cmap(e["block"] % 20), edgecolors="none")
    ax.set_yticks([0, 1], ["compute", "copy"])
    ax.set_xlabel("ms")
    st = overlap_stats(events)["total"]

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.0f}%"

    ax.set_title(f"overlap '{name}', {st['steps']} step(s): copy lane busy {pct(st['copy_busy_fraction'])}, "
                 f"copy hidden behind compute {pct(st['hidden_fraction'])}, exposed copy "
                 f"{st['exposed_copy_ms']:.1f} ms, compute idle {st['compute_idle_ms']:.1f} ms", fontsize=9)


# ------------------------------------------------------------------ html

def _json_block(obj: Any, elem_id: str) -> str:
    text = json.dumps(obj, separators=(",", ":")).replace("</", "<\\/")
    return f'<script type="application/json" id="{elem_id}">{text}</script>'


def _fmt(x, scale=1.0, nd=2) -> str:
    return "" if x is None else f"{x / scale:.{nd}f}"


def render_html(trace: dict, html_path: str, *, png_path: str | None = None, title: str | None = None) -> dict:
    """Write the HTML report (and the PNG beside it when matplotlib is there).
    Returns {"html": path, "png": path or None}."""
    from weightstream.tracefile import trace_summary

    summary = trace_summary(trace)
    overlap = {name: overlap_stats(evs) for name, evs in trace["events"].items() if evs}
    png_path = png_path or os.path.splitext(html_path)[0] + ".png"
    fig = build_figure(trace)
    img_tag, note = "", ""
    if fig is None:
        png_path = None
        note = ("<p class=note><b>matplotlib is not installed</b>: no plots. Every sampled value is in the "
                "JSON block <code>weightstream-trace</code> in this file (install matplotlib and re-render "
                "with <code>python -m weightstream.report TRACE.json</code>).</p>")
    else:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        png = buf.getvalue()
        os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
        with open(png_path, "wb") as f:
            f.write(png)
        img_tag = f'<img alt="memory and overlap timelines" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
    if not trace["nvml"]["available"]:
        note += f"<p class=note>{html.escape(trace['nvml'].get('message') or 'NVML unavailable')}</p>"
    title = title or "weightstream memory report"
    meta = trace.get("meta", {})
    rows = "".join(
        f"<tr><td>GPU{g['index']}</td><td>{html.escape(str(g['name']))}</td><td>{_fmt(g['peak_used_bytes'], 1e9)}</td>"
        f"<td>{_fmt(g['total_bytes'], 1e9, 1)}</td><td>{'' if g['peak_util_pct'] is None else g['peak_util_pct']}</td>"
        f"<td>{_fmt(g['peak_rx_mbs'], 1e3)}</td><td>{_fmt(g['peak_tx_mbs'], 1e3)}</td></tr>"
        for g in summary["gpus"])
    trows = "".join(
        f"<tr><td>cuda:{t['device']}</td><td>{_fmt(t['peak_allocated_bytes'], 1e9)}</td>"
        f"<td>{_fmt(t['peak_reserved_bytes'], 1e9)}</td></tr>" for t in summary["torch"])
    orows = ""
    for name, st in overlap.items():
        for r in st["steps"] + [dict(st["total"], step="all")]:
            frac = "" if r["hidden_fraction"] is None else f"{100 * r['hidden_fraction']:.0f}%"
            busy = "" if r["copy_busy_fraction"] is None else f"{100 * r['copy_busy_fraction']:.0f}%"
            orows += (f"<tr><td>{html.escape(name)}</td><td>{r['step']}</td><td>{r['span_ms']:.2f}</td>"
                      f"<td>{r['copy_ms']:.2f}</td><td>{busy}</td><td>{r['compute_ms']:.2f}</td><td>{frac}</td>"
                      f"<td>{r['exposed_copy_ms']:.2f}</td><td>{r['compute_idle_ms']:.2f}</td></tr>")
    cmd = " ".join(meta.get("command", [])) if isinstance(meta.get("command"), list) else meta.get("command", "")
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:1300px}} table{{border-collapse:collapse;margin:.6em 0}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}} th{{background:#f2f2f2}} .note{{color:#a33}}
img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(cmd)}</p>
<p>{summary['n_samples']} samples over {trace['duration_s']:.2f} s
(asked {trace['hz']:.0f} Hz, got {_fmt(summary['effective_hz'], 1, 1)} Hz);
driver {html.escape(str(trace['nvml'].get('driver')))}; created {html.escape(trace['created'])}
{'' if meta.get('returncode') is None else f"; exit status {meta['returncode']}"}</p>
{note}
<h2>GPUs (NVML)</h2>
<table><tr><th>GPU</th><th>name</th><th>peak used GB</th><th>total GB</th><th>peak util %</th><th>peak H2D GB/s</th><th>peak D2H GB/s</th></tr>{rows}</table>
{'<h2>torch allocator (this process)</h2><table><tr><th>device</th><th>peak allocated GB</th><th>peak reserved GB</th></tr>' + trows + '</table>' if trows else ''}
<p>host RSS peak: {_fmt(summary['host_peak_rss_bytes'], 1e9)} GB</p>
{'<h2>overlap (from event logs)</h2><table><tr><th>log</th><th>step</th><th>span ms</th><th>copy ms</th><th>copy busy</th><th>compute ms</th><th>copy hidden</th><th>exposed copy ms</th><th>compute idle ms</th></tr>' + orows + '</table>' if orows else '<p>no event log attached: no overlap timeline.</p>'}
{img_tag}
{_json_block(overlap, "weightstream-overlap")}
{_json_block(trace, "weightstream-trace")}
</body></html>
"""
    os.makedirs(os.path.dirname(os.path.abspath(html_path)), exist_ok=True)
    with open(html_path, "w") as f:
        f.write(doc)
    return {"html": html_path, "png": png_path}


def extract_json_block(html_text: str, elem_id: str = "weightstream-trace") -> Any:
    """The JSON embedded in a report under `elem_id` (for tests and tools)."""
    start_tag = f'<script type="application/json" id="{elem_id}">'
    i = html_text.index(start_tag) + len(start_tag)
    j = html_text.index("</script>", i)
    return json.loads(html_text[i:j])  # "<\\/" written for "</" is a valid JSON escape


def main(argv: list[str] | None = None) -> int:
    """`python -m weightstream.report TRACE.json [OUT.html]`"""
    import sys

    from weightstream.tracefile import load_trace

    argv = sys.argv[1:] if argv is None else argv
    if not argv or len(argv) > 2:
        print("usage: python -m weightstream.report TRACE.json [OUT.html]", file=sys.stderr)
        return 2
    out = argv[1] if len(argv) == 2 else os.path.splitext(argv[0])[0] + ".html"
    paths = render_html(load_trace(argv[0]), out)
    print(f"wrote {paths['html']}" + (f" and {paths['png']}" if paths["png"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
