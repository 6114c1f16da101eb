"""Regression check against stored ratios, and baseline writing.

A baseline file `perf/baselines/<gpu-slug>.json`:

    {"gpu": "NVIDIA H200",
     "scenarios": {"flux-12b-1024": {"layerwise": {"ratio_to_floor": 1.023, "ratio_to_resident": 2.56,
                                                   "ratio_to_best_peer": 0.77}, ...}, ...},
     "sources": {"flux-12b-1024": {"commit": "<sha>", "date": "...", "file": "<result file>"}},
     "mode_sources": {"flux-12b-1024": {"layerwise": {"file": "...", "commit": "<sha>", "date": "..."}, ...}}}

``mode_sources`` names the run of each mode (a result file merges the modes of
several runs, each with its own commit and date; git history holds that run).

Only ratios are compared, never absolute times: a ratio worsens when
new > baseline * (1 + tolerance), or, for the ratios where higher is better
(``ratio_to_copy``: a kernel's bandwidth against a device copy), when
new < baseline * (1 - tolerance).
"""
from __future__ import annotations

import json
from pathlib import Path

from perf.results import HIGHER_IS_BETTER, RATIO_FIGURES, gpu_slug, validate_result

BASELINES = Path(__file__).resolve().parent / "baselines"


def load_result(path: str | Path) -> dict:
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read result {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"result {path} is not JSON: {e}") from None
    try:
        validate_result(result)
    except ValueError as e:
        raise ValueError(f"invalid result {path}: {e}") from None
    return result


def baseline_path(gpu: str, explicit: str | Path | None = None, gpus: int = 1) -> Path:
    """perf/baselines/<gpu-slug>.json, or <gpu-slug>-x<N>.json for N-GPU results."""
    if explicit:
        return Path(explicit)
    return BASELINES / (f"{gpu_slug(gpu)}.json" if gpus <= 1 else f"{gpu_slug(gpu)}-x{gpus}.json")


def compare(result: dict, baseline: dict, tolerance: float) -> tuple[list[dict], list[str]]:
    """(regressions, notes). A regression: {scenario, mode, figure, baseline, new, change}."""
    sc = result["scenario"]
    base_modes = baseline["scenarios"][sc]
    regressions, notes = [], []
    for mode, figs in result["modes"].items():
        b = base_modes.get(mode)
        if b is None and not any(k in figs for k in RATIO_FIGURES):
            continue  # resident: nothing to compare
        if b is None:
            notes.append(f"{sc} {mode}: no baseline for this mode (not checked)")
            continue
        for fig in RATIO_FIGURES:
            if fig not in b:
                continue
            if fig not in figs:
                notes.append(f"{sc} {mode} {fig}: in the baseline but not in the result (not checked)")
                continue
            old, new = float(b[fig]), float(figs[fig])
            change = new / old - 1 if old else float("inf")
            worse = new < old * (1 - tolerance) if fig in HIGHER_IS_BETTER else new > old * (1 + tolerance)
            if worse:
                regressions.append(dict(scenario=sc, mode=mode, figure=fig, baseline=old, new=new, change=change))
            else:
                notes.append(f"{sc} {mode} {fig}: baseline {old:.4f} new {new:.4f} ({change:+.1%}) ok")
    for mode in base_modes:
        if mode not in result["modes"]:
            notes.append(f"{sc} {mode}: in the baseline but not measured in this result")
    return regressions, notes


def check_main(results: list[str], baseline: str | None, tolerance: float) -> int:
    """0: no ratio worse than tolerance; 1: regressions; 2: bad input / no baseline."""
    if tolerance < 0:
        print(f"check: --tolerance must be >= 0, got {tolerance}")
        return 2
    failures = 0
    for path in results:
        try:
            result = load_result(path)
        except ValueError as e:
            print(f"check: {e}")
            return 2
        bpath = baseline_path(result["gpu"], baseline, result.get("gpus", 1))
        if not bpath.exists():
            print(f"check: no baseline for GPU {result['gpu']!r} at {bpath}; create one with "
                  f"`python -m perf baseline {path}` (after checking the result is a good reference)")
            return 2
        with open(bpath) as f:
            base = json.load(f)
        if gpu_slug(base.get("gpu", "")) != gpu_slug(result["gpu"]):
            print(f"check: baseline {bpath} is for GPU {base.get('gpu')!r}, the result for {result['gpu']!r}")
            return 2
        if result["scenario"] not in base.get("scenarios", {}):
            print(f"check: baseline {bpath} has no scenario {result['scenario']!r} "
                  f"(it has: {sorted(base.get('scenarios', {}))}); add it with `python -m perf baseline {path}`")
            return 2
        regressions, notes = compare(result, base, tolerance)
        for n in notes:
            print(f"  {n}")
        for r in regressions:
            print(f"REGRESSION {r['scenario']} {r['mode']} {r['figure']}: baseline {r['baseline']:.4f} "
                  f"new {r['new']:.4f} ({r['change']:+.1%} > {tolerance:.1%} tolerance)")
        failures += len(regressions)
        print(f"{path}: {len(regressions)} regression(s) against {bpath} (tolerance {tolerance:.1%})")
    return 1 if failures else 0


def baseline_main(results: list[str], out: str | None) -> int:
    """Write or update baselines from results (one file per GPU)."""
    loaded = []
    for path in results:
        try:
            loaded.append((path, load_result(path)))
        except ValueError as e:
            print(f"baseline: {e}")
            return 2
    slugs = {gpu_slug(r["gpu"]) for _, r in loaded}
    if out and len(slugs) > 1:
        print(f"baseline: --out names one file but the results are from several GPUs: {sorted(slugs)}")
        return 2
    for path, r in loaded:
        bpath = baseline_path(r["gpu"], out, r.get("gpus", 1))
        base = json.loads(bpath.read_text()) if bpath.exists() else {"gpu": r["gpu"], "scenarios": {}, "sources": {}}
        if gpu_slug(base.get("gpu", "")) != gpu_slug(r["gpu"]):
            print(f"baseline: {bpath} is for GPU {base.get('gpu')!r}, {path} for {r['gpu']!r}")
            return 2
        entry = base.setdefault("scenarios", {}).setdefault(r["scenario"], {})
        written = []
        for mode, figs in r["modes"].items():
            ratios = {k: figs[k] for k in RATIO_FIGURES if figs.get(k) is not None}
            if ratios:
                entry[mode] = ratios
                written.append(mode)
        base.setdefault("sources", {})[r["scenario"]] = {
            "commit": r["commit"], "date": r["date"], "file": Path(path).name}
        # a result file merges several runs: name each mode's own
        per_mode = base.setdefault("mode_sources", {}).setdefault(r["scenario"], {})
        for mode in written:
            figs = r["modes"][mode]
            per_mode[mode] = {"file": Path(path).name, "commit": figs.get("commit", r["commit"]),
                              "date": figs.get("date", r["date"])}
        bpath.parent.mkdir(parents=True, exist_ok=True)
        bpath.write_text(json.dumps(base, indent=1, sort_keys=True) + "\n")
        print(f"baseline {bpath}: {r['scenario']} <- {', '.join(written) or 'nothing (no ratios)'} from {path}")
    return 0
