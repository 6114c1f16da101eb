"""The result-file format (DESIGN.md section 7), its validation, and the
floor / ratio arithmetic shared by the harness and the regression check.

Sizes are decimal: 1 GB = 1e9 bytes, bandwidth in GB/s = 1e9 bytes per second.
"""
from __future__ import annotations

import math
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from perf.quantized import QUANT_VARIANTS, quant_yardstick

GB = 1e9

# Figures the regression check compares: ratios, which survive a change of
# clock, driver or machine load better than times.
RATIO_FIGURES = ("ratio_to_floor", "ratio_to_resident", "ratio_to_best_peer", "ratio_to_resident_graph",
                 "ratio_to_resident_tfill", "ratio_to_resident_compile", "ratio_to_pinned", "ratio_to_copy",
                 "ratio_to_resident_lora")
# Ratios where higher is better (a kernel's bandwidth against a plain copy);
# every other ratio is a time against a yardstick, lower is better.
HIGHER_IS_BETTER = ("ratio_to_copy",)

# Yardsticks: the whole model on the device, plain / as one CUDA graph / with
# diffusers' regional compile (compile_repeated_blocks).
RESIDENT_MODES = ("resident", "resident-graph", "resident-compile", "resident-tfill",
                  "resident-qfp8", "resident-qgguf8", "resident-qint8", "resident-qnf4",  # perf/quantized.py
                  "resident-lora64", "resident-lora64fused")  # the LoRA modes' (any rank: is_resident)
_LORA_PART = re.compile(r"^lora[1-9]\d*(fused)?$")  # a LoRA variant of a mode (perf/modes.py -lora<R>[fused])

# Peers are other libraries' offloading, named by library prefix.
PEER_PREFIXES = ("diffusers-", "accelerate-")

_MODE_RE = re.compile(
    r"^(resident|resident-graph|resident-compile|resident-tfill|resident-q(fp8|gguf8|int8|nf4)|resident-lora[1-9][0-9]*(fused)?"
    r"|module(-coded[2p]?)?|naive-block|dlo-allgather(-coded(2|p|auto)?)?|dlo-rank-local"
    r"|layerwise(-[a-z0-9]+)*|graphs(-[a-z0-9]+)*|default(-[0-9]+gb)?(-q(fp8|gguf8|int8|nf4))?|copy(-[a-z0-9]+)*|triton(-[a-z0-9]+)*|encode(-[a-z0-9]+)*"
    r"|(diffusers|accelerate)-[a-z0-9]+(-[a-z0-9]+)*)$"
)
_MODE_FORMS = ("resident, resident-graph, resident-compile, resident-tfill, resident-qfp8|qgguf8|qint8|qnf4, resident-lora<R>[fused], module[-coded|-coded2|-codedp], naive-block, dlo-allgather[-coded|-coded2|-codedp|-codedauto], "
               "dlo-rank-local, "
               "layerwise[-variant...], graphs[-variant...], default[-<N>gb][-q<x>] (the planned default), "
               "copy[-variant...], triton[-variant...], encode[-variant...] (kernel benchmarks), "
               "diffusers-<x>, accelerate-<x>")

_REQUIRED_TOP = {
    "scenario": str, "gpu": str, "gpus": int, "commit": str, "torch": str,
    "date": str, "modes": dict,
}
_OPTIONAL_TOP_NUM = ("h2d_gbps", "model_gb")
# per-mode figures that, when present, must be finite non-negative numbers
_MODE_NUMBERS = (
    "step_ms", "floor_ms", "ratio_to_floor", "ratio_to_resident", "ratio_to_best_peer", "ratio_to_resident_graph",
    "ratio_to_resident_tfill", "ratio_to_resident_compile", "peak_device_gb", "nvml_peak_used_gb", "pinned_host_gb", "host_rss_gb", "host_rss_peak_gb",
    "setup_s", "build_s", "h2d_gbps", "streamed_gb", "wall_ms_per_step", "first_step_ms",
    "predicted_ms", "ratio_to_predicted", "ratio_to_best_fixed", "budget_gb", "device_weight_gb",
    "uncoded_floor_ms", "ratio_to_uncoded_floor", "setup_ratio_to_uncoded", "ready_s", "ready_ratio_to_uncoded",
    "ratio_to_resident_lora", "adapter_bytes",
)
_FIXED_COUNT = re.compile(r"^layerwise(-r\d+)?$")  # the fixed placements an auto mode is compared with


def is_peer(mode: str) -> bool:
    return mode.startswith(PEER_PREFIXES)


def is_weightstream(mode: str) -> bool:
    """Modes that run our own controller (compared against the best peer)."""
    return mode in ("module", "module-coded") or mode.startswith(("layerwise", "graphs", "dlo-", "default"))


def is_offloaded(mode: str) -> bool:
    """A mode that streams weights (and so carries a streaming floor)."""
    return not is_resident(mode) and not mode.startswith(("copy", "triton", "encode"))


def is_resident(mode: str) -> bool:
    """A yardstick: the whole model on the device (resident-lora<R>[fused] of any rank too)."""
    return mode in RESIDENT_MODES or (mode.startswith("resident-") and bool(_LORA_PART.match(mode[9:])))


def lora_yardstick(mode: str) -> str | None:
    """The resident mode carrying the same LoRA as ``mode`` (``layerwise-lora64`` ->
    ``resident-lora64``), None when ``mode`` has no LoRA variant or is that yardstick."""
    if is_resident(mode):
        return None
    parts = [p for p in mode.split("-") if _LORA_PART.match(p)]
    return f"resident-{parts[0]}" if parts else None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_mode_name(mode: str) -> None:
    if not isinstance(mode, str) or not _MODE_RE.match(mode):
        raise ValueError(f"mode name {mode!r} is not one of the allowed forms: {_MODE_FORMS}")


def validate_result(result: dict) -> None:
    """Raise ValueError naming the first thing wrong with a result dict."""
    if not isinstance(result, dict):
        raise ValueError(f"result must be a JSON object, got {type(result).__name__}")
    for key, typ in _REQUIRED_TOP.items():
        if key not in result:
            raise ValueError(f"result is missing the key {key!r}")
        val = result[key]
        if not isinstance(val, typ) or isinstance(val, bool):
            raise ValueError(f"result key {key!r} must be {typ.__name__}, got {val!r}")
    for key in ("scenario", "gpu", "commit", "torch"):
        if not result[key]:
            raise ValueError(f"result key {key!r} must not be empty")
    if result["gpus"] < 0:
        raise ValueError(f"result key 'gpus' must be >= 0, got {result['gpus']}")
    try:
        datetime.fromisoformat(result["date"].replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"result key 'date' must be an ISO-8601 time, got {result['date']!r}") from None
    for key in _OPTIONAL_TOP_NUM:
        val = result.get(key)
        if val is not None and not (_is_number(val) and val > 0):
            raise ValueError(f"result key {key!r} must be a positive number or null, got {val!r}")
    if "driver" in result and result["driver"] is not None and not isinstance(result["driver"], str):
        raise ValueError(f"result key 'driver' must be a string or null, got {result['driver']!r}")
    modes = result["modes"]
    if not modes:
        raise ValueError("result 'modes' is empty: no mode finished")
    for mode, figs in modes.items():
        validate_mode_name(mode)
        where = f"mode {mode!r}"
        if not isinstance(figs, dict):
            raise ValueError(f"{where} must map to an object of figures, got {figs!r}")
        if "step_ms" not in figs:
            raise ValueError(f"{where} is missing 'step_ms'")
        for key in _MODE_NUMBERS:
            if key in figs and figs[key] is not None and not (_is_number(figs[key]) and figs[key] >= 0):
                raise ValueError(f"{where} figure {key!r} must be a finite number >= 0, got {figs[key]!r}")
        if not figs["step_ms"] or figs["step_ms"] <= 0:
            raise ValueError(f"{where} 'step_ms' must be > 0, got {figs['step_ms']!r}")
        if is_offloaded(mode):
            for key in ("floor_ms", "ratio_to_floor"):
                if figs.get(key) is None:
                    raise ValueError(f"{where} is offloaded and must carry {key!r}")
            if figs["floor_ms"] <= 0:
                raise ValueError(f"{where} 'floor_ms' must be > 0, got {figs['floor_ms']!r}")
            want = figs["step_ms"] / figs["floor_ms"]
            if not math.isclose(figs["ratio_to_floor"], want, rel_tol=0.01):
                raise ValueError(
                    f"{where} 'ratio_to_floor' {figs['ratio_to_floor']} disagrees with "
                    f"step_ms / floor_ms = {want:.4f}")


# ---------------------------------------------------------------- arithmetic

def _sig(x: float, digits: int = 5) -> float:
    """Round to significant digits (ratios can be tiny on a noisy CPU)."""
    return float(f"{x:.{digits}g}")


def floor_ms(resident_ms: float, streamed_bytes: float | None, h2d_gbps: float | None) -> float:
    """The streaming floor: a step can be no faster than its compute (the
    resident step) nor than moving its streamed bytes over the H2D link."""
    if streamed_bytes is None or not h2d_gbps:
        return float(resident_ms)
    return max(float(resident_ms), streamed_bytes / (h2d_gbps * GB) * 1e3)


def summarise(modes: dict[str, dict], h2d_gbps: float | None,
              resident_ms: float | None = None) -> dict[str, dict]:
    """Add floor_ms and the ratios to each mode's figures (a new dict).

    Each offloaded mode's raw figures carry `streamed_bytes` or `streamed_gb`
    (what it moves host-to-device per step). `resident_ms` defaults to the resident mode's
    step time. Peers are compared as a group: ratio_to_best_peer is a
    weightstream mode's step time over the fastest peer's. Without a resident
    step the floor is the transfer term alone and ratio_to_resident is left out."""
    out = {m: dict(f) for m, f in modes.items()}
    if resident_ms is None and "resident" in out:
        resident_ms = out["resident"]["step_ms"]
    elif resident_ms is None and "resident-tfill" in out:  # the same model and kernels, other weights
        resident_ms = out["resident-tfill"]["step_ms"]
    peers = [f["step_ms"] for m, f in out.items() if is_peer(m)]
    best_peer = min(peers) if peers else None
    for mode, f in out.items():
        if not is_offloaded(mode):
            continue
        own_ms = resident_ms
        yard = quant_yardstick(mode)  # a quantized mode: the same quantized model resident
        if yard is not None and yard in out:
            own_ms = out[yard]["step_ms"]
        streamed = f.get("streamed_bytes")
        if streamed is None and f.get("streamed_gb") is not None:
            streamed = f["streamed_gb"] * GB
        # a LoRA mode's compute term is the resident step with the same LoRA (unfused: its matmuls too)
        lora = lora_yardstick(mode)
        compute_ms = out[lora]["step_ms"] if lora in out else own_ms
        if lora in out:
            f["ratio_to_resident_lora"] = _sig(f["step_ms"] / compute_ms)
        if compute_ms is None:
            # no resident step (it failed, e.g. out of memory): the transfer term alone
            if streamed is None or not h2d_gbps:
                continue
            f["floor_ms"] = round(floor_ms(0.0, streamed, h2d_gbps), 3)
        else:
            f["floor_ms"] = round(floor_ms(compute_ms, streamed, h2d_gbps), 3)
        if own_ms is not None:
            f["ratio_to_resident"] = _sig(f["step_ms"] / own_ms)
        f["ratio_to_floor"] = _sig(f["step_ms"] / f["floor_ms"])
        if best_peer is not None and is_weightstream(mode):
            f["ratio_to_best_peer"] = _sig(f["step_ms"] / best_peer)
        if "resident-graph" in out and "graphs" in mode.split("-"):
            f["ratio_to_resident_graph"] = _sig(f["step_ms"] / out["resident-graph"]["step_ms"])
        if "resident-tfill" in out and (mode.startswith("default") or any(p.startswith("coded") for p in mode.split("-"))):
            # the coded modes' Student-t weights, resident: the same weights and output, so the
            # ratio isolates what coding costs (the weights alone moved wan's compute-bound
            # step by up to 0.7% on the H200)
            f["ratio_to_resident_tfill"] = _sig(f["step_ms"] / out["resident-tfill"]["step_ms"])
        if "resident-compile" in out and "compile" in mode.split("-"):
            f["ratio_to_resident_compile"] = _sig(f["step_ms"] / out["resident-compile"]["step_ms"])
        if "layerwise" in out and (mode.endswith("-half") or "mmap" in mode.split("-")):
            # layerwise-pinned-half / -pageable-half, and the mmap source's modes: against the pinned store
            f["ratio_to_pinned"] = _sig(f["step_ms"] / out["layerwise"]["step_ms"])
    compare_placements(out)
    compare_auto_codec(out)
    compare_default(out, h2d_gbps, resident_ms)
    return out


def compare_default(out: dict[str, dict], h2d_gbps: float | None, resident_ms: float | None) -> None:
    """The planned default's modes (``default``, ``default-<N>gb``): ``ratio_to_uncoded_floor``, the
    step over the floor of streaming every block raw (its ``block_gb`` at the run's H2D rate, not
    below the resident step: the ``layerwise`` floor), and with ``layerwise`` in the run
    ``setup_ratio_to_uncoded`` (its setup over the uncoded setup, ``uncoded_setup_s`` beside it).
    Every coded or default mode: ``ready_s``, its setup plus what its planning and coding steps
    (``coding_step_ms_all``) took over as many settled steps: the time until it runs at full speed;
    beside ``layerwise``, ``ready_ratio_to_uncoded`` (over the uncoded setup)."""
    for mode, f in out.items():
        if not mode.startswith("default"):
            continue
        if f.get("block_gb") and h2d_gbps:
            f["uncoded_floor_ms"] = round(floor_ms(resident_ms or 0.0, f["block_gb"] * GB, h2d_gbps), 3)
            f["ratio_to_uncoded_floor"] = _sig(f["step_ms"] / f["uncoded_floor_ms"])
    for mode, f in out.items():
        parts = mode.split("-")
        coded = mode.startswith("default") or any(p.startswith("coded") for p in parts)
        if not coded or f.get("setup_s") is None:
            continue
        base = out.get("layerwise" + (f"-{parts[-1]}" if parts[-1] in QUANT_VARIANTS else ""), {})
        steps = f.get("coding_step_ms_all") or []
        f["ready_s"] = round(f["setup_s"] + max(0.0, sum(steps) - len(steps) * f["step_ms"]) / 1e3, 3)
        if base.get("setup_s") and mode.startswith(("layerwise", "graphs", "default")):
            f["uncoded_setup_s"] = base["setup_s"]
            f["setup_ratio_to_uncoded"] = _sig(f["setup_s"] / base["setup_s"])
            f["ready_ratio_to_uncoded"] = _sig(f["ready_s"] / base["setup_s"])


def compare_auto_codec(out: dict[str, dict]) -> None:
    """weight_codec="auto" modes (``<base>-codedauto``) beside their uncoded mode ``<base>`` of the
    same run: what the planning and coding steps cost over that many uncoded steps
    (``auto_excess_s``; the uncoded mode's settled step, so its own first step's warm-up is not
    credited: an upper bound) and the steps of one process after which auto is ahead
    (``auto_payoff_steps``: the coding steps plus the excess over the per-step gain; None when
    the coded step is not faster)."""
    for mode, f in out.items():
        base = mode[: -len("-codedauto")] if mode.endswith("-codedauto") else None
        steps = f.get("coding_step_ms_all")
        if base not in out or not steps or "step_ms" not in out[base]:
            continue
        raw = out[base]["step_ms"]
        excess_ms = sum(steps) - len(steps) * raw
        f["auto_excess_s"] = round(excess_ms / 1e3, 3)
        gain = raw - f["step_ms"]
        f["auto_payoff_steps"] = (len(steps) + max(0, math.ceil(excess_ms / gain))) if gain > 0 else None


def placement_figures(stats: dict) -> dict:
    """A weightstream mode's device weight bytes (fixed modules, resident blocks, slots)
    and, under resident_layers='auto', the planner's budget and predicted step."""
    placed = stats.get("placement")
    if placed is None:
        if "resident_bytes" not in stats or "slot_bytes" not in stats:
            return {}
        return {"device_weight_gb": round((stats["resident_bytes"] + stats["slot_bytes"]) / GB, 4)}
    return {"device_weight_gb": round(placed["device_bytes"] / GB, 4), "budget_gb": round(placed["budget_bytes"] / GB, 4),
            "predicted_ms": round(placed["predicted_ms"], 3), "resident_blocks": placed["resident_blocks"],
            "planned_slots": placed["num_slots"]}


def compare_placements(out: dict[str, dict]) -> None:
    """Auto modes: ratio_to_predicted, and the best fixed placement of this run that fits
    the same budget (``layerwise`` or ``layerwise-r<N>``): ratio_to_best_fixed."""
    for mode, f in out.items():
        if f.get("predicted_ms"):
            f["ratio_to_predicted"] = _sig(f["step_ms"] / f["predicted_ms"])
        budget = f.get("budget_gb")
        if budget is None:
            continue
        fits = [(g["step_ms"], m) for m, g in out.items()
                if _FIXED_COUNT.match(m) and g.get("device_weight_gb") is not None and g["device_weight_gb"] <= budget]
        if fits:
            best_ms, best = min(fits)
            f["best_fixed_mode"], f["ratio_to_best_fixed"] = best, _sig(f["step_ms"] / best_ms)


def gpu_slug(gpu: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (file names and baseline keys)."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return slug or "unknown"


def gpu_kind(gpu: str, gpus: int = 1) -> str:
    """'NVIDIA H200', 2 -> 'nvidia-h200-x2': the GPU kind a result is filed under (the machine's
    GPU count as the result records it; no suffix for one GPU or none)."""
    return gpu_slug(gpu) + (f"-x{gpus}" if gpus > 1 else "")


def result_filename(scenario: str, gpu: str, gpus: int = 1) -> str:
    """One file per scenario and GPU kind: ``<scenario>-<gpu kind>.json`` (the latest run of
    each mode; git history holds the older ones)."""
    return f"{scenario}-{gpu_kind(gpu, gpus)}.json"


class ResultFileError(ValueError):
    """An existing result file that a run would merge into cannot be used (unreadable, invalid,
    or another scenario or GPU kind): fix or move it before running."""


def stamp_modes(result: dict) -> dict:
    """Every mode without its own ``commit`` / ``date`` gets the result's (in place; returns it):
    a merged file's modes come from several runs, and each names its own."""
    for figs in result["modes"].values():
        figs.setdefault("commit", result["commit"])
        figs.setdefault("date", result["date"])
    return result


def load_prior(path: Path, scenario: str, gpu: str, gpus: int) -> dict | None:
    """The result already filed at ``path`` (None when there is none), validated and checked to be
    of ``scenario`` and this GPU kind; ResultFileError otherwise (before any mode runs)."""
    import json

    if not path.exists():
        return None
    try:
        prior = json.loads(path.read_text())
        validate_result(prior)
    except (OSError, ValueError) as e:
        raise ResultFileError(f"the result file {path} this run would merge into is not usable ({e}); "
                              "fix it, or move it away to start a new one") from None
    want, got = (scenario, gpu_kind(gpu, gpus)), (prior["scenario"], gpu_kind(prior["gpu"], prior["gpus"]))
    if got != want:
        raise ResultFileError(f"the result file {path} holds scenario {got[0]!r} on {got[1]!r}, this run is "
                              f"{want[0]!r} on {want[1]!r}; move it away (its name no longer matches its content)")
    return stamp_modes(prior)


def merge_result(prior: dict | None, result: dict) -> dict:
    """``result`` filed over ``prior`` (same scenario and GPU kind): this run's modes replace the
    prior's of the same name, the prior's others stay as they were measured, each with its own
    commit and date. Top-level keys are this run's; a key only the prior has stays."""
    new = stamp_modes(dict(result, modes=dict(result["modes"])))
    if prior is None:
        return new
    kept = {m: f for m, f in prior["modes"].items() if m not in new["modes"]}
    merged = {**{k: v for k, v in prior.items() if k not in ("modes", "failed", "merged_from")}, **new}
    merged["modes"] = {**kept, **new["modes"]}
    if kept:
        merged["merged_from"] = prior["date"]
    return merged


def write_result(out_dir: str | Path, result: dict, *, merge: bool = True) -> Path:
    """Write ``result`` to ``out_dir/<scenario>-<gpu kind>.json``, merged over the file already
    there (``merge_result``); validated before anything is written. Returns the path."""
    import json

    path = Path(out_dir) / result_filename(result["scenario"], result["gpu"], result.get("gpus", 1))
    prior = load_prior(path, result["scenario"], result["gpu"], result.get("gpus", 1)) if merge else None
    merged = merge_result(prior, result)
    validate_result(merged)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1) + "\n")
    return path


# ---------------------------------------------------------------- markdown

_COLUMNS = (
    ("step ms", "step_ms", "{:.1f}"), ("floor ms", "floor_ms", "{:.1f}"),
    ("x floor", "ratio_to_floor", "{:.3f}"), ("x resident", "ratio_to_resident", "{:.2f}"),
    ("x best peer", "ratio_to_best_peer", "{:.3f}"), ("peak dev GB", "peak_device_gb", "{:.2f}"),
    ("NVML GB", "nvml_peak_used_gb", "{:.2f}"), ("pinned GB", "pinned_host_gb", "{:.2f}"),
    ("RSS peak GB", "host_rss_peak_gb", "{:.2f}"), ("setup s", "setup_s", "{:.2f}"),
)


def markdown_table(result: dict) -> str:
    head = (f"### {result['scenario']} on {result['gpu']} ({result['commit'][:12]}), "
            f"H2D {result.get('h2d_gbps') or 'n/a'} GB/s, model {result.get('model_gb', 'n/a')} GB")
    lines = [head, "", "| mode | " + " | ".join(c[0] for c in _COLUMNS) + " |",
             "| --- |" + " ---: |" * len(_COLUMNS)]
    for mode, f in result["modes"].items():
        cells = []
        for _, key, fmt in _COLUMNS:
            v = f.get(key)
            cells.append(fmt.format(v) if _is_number(v) else "")
        earlier = f.get("commit", result["commit"]) != result["commit"]  # kept from an earlier run of the file
        name = f"{mode} (earlier: {str(f.get('date', '?'))[:10]})" if earlier else mode
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for mode, err in (result.get("failed") or {}).items():
        lines.append(f"| {mode} | failed: {str(err).splitlines()[0][:100]} |" + " |" * (len(_COLUMNS) - 1))
    return "\n".join(lines)


# ---------------------------------------------------------------- DLO scaling

def _cell(fig: dict | None, key: str, fmt: str) -> str:
    v = (fig or {}).get(key)
    return "" if v is None else format(v, fmt)


def _per_rank(fig: dict | None, gb_key: str, fraction_key: str) -> str:
    """'11.84 GB (0.497x)': GB per rank and its fraction of the model (older results: computed)."""
    if not fig:
        return ""
    gb = fig[gb_key]
    frac = fig.get(fraction_key, gb / fig["model_gb"] if fig.get("model_gb") else None)
    return (f"{gb:.2f} GB" if gb >= 0.01 else f"{gb:.2g} GB") + ("" if frac is None else f" ({frac:.3f}x)")


def scaling_table(results: dict[int, dict | str]) -> str:
    """The DLO scaling table (markdown): one row per N from its result (perf/dlo.py), or why it has none."""
    head = ("| N | resident | DLO AllGather | x resident | x floor | pinned per rank | host per rank | setup | "
            "bit-exact | all-gather (bus) |")
    lines = [head, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for n in sorted(results):
        res = results[n]
        if isinstance(res, str):
            lines.append(f"| {n} | {res} |" + " |" * 8)
            continue
        ag = res["modes"].get("dlo-allgather")
        # the resident step of the AllGather mode's own run (a merged file's resident mode may be a later run's)
        resident = {"step_ms": (ag or {}).get("resident_ms", res["modes"].get("resident", {}).get("step_ms"))}
        pinned, host = (_per_rank(ag, "pinned_host_gb_per_rank", "pinned_fraction"),
                        _per_rank(ag, "host_gb_per_rank", "host_fraction"))
        bus, alg = (ag or {}).get("allgather_busbw_gbps", res.get("allgather_busbw_gbps")), res.get("allgather_gbps")
        if bus is None and alg:  # results before the bus figure: NCCL's (N - 1) / N of the output rate
            bus = alg * (n - 1) / n
        backend = res.get("allgather_backend", "gloo" if res.get("gpu") == "cpu" else "nccl")
        lines.append(
            f"| {n} | {_cell(resident, 'step_ms', '.1f')} ms | {_cell(ag, 'step_ms', '.1f')} ms | "
            f"{_cell(ag, 'ratio_to_resident', '.3f')} | {_cell(ag, 'ratio_to_floor', '.3f')} | {pinned} | {host} | "
            f"{_cell(ag, 'setup_s', '.1f')} s | {_cell(ag, 'bit_exact', '')} | "
            f"{'' if bus is None else f'{bus:.3g} GB/s {backend}'} |")
    return "\n".join(lines)
