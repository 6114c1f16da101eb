"""`python -m perf run`: every mode of a scenario in its own fresh process.

Order: (host-memory touch) -> resident (added when not asked for: the floor
and ratio_to_resident need it) -> the other modes as given. After each mode
the result file is rewritten, so a run killed part-way keeps what finished.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from perf.common import git_commit
from perf.modes import CODED_FILL, parse_mode
from perf.results import markdown_table, result_filename, summarise, validate_result
from perf.scenarios import checkpoint_dir, existing_checkpoint, get_scenario, scenario_label, warm_page_cache

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "perf" / "results"
TOUCH_STAMP = Path(tempfile.gettempdir()) / "weightstream-perf-touched-gb"

# worker figures copied into the result's per-mode entry
MODE_KEYS = (
    "step_ms", "step_ms_all", "wall_ms_per_step", "first_step_ms", "peak_device_gb", "peak_reserved_gb",
    "nvml_peak_used_gb", "pinned_host_gb", "host_rss_gb", "host_rss_peak_gb", "setup_s", "build_s",
    "h2d_gbps", "streamed_gb", "output_finite", "output_sha1", "record_events", "stats", "notes", "trace",
    "model_gb", "setup_peak_rss_gb", "setup_peak_rss_ratio", "target_setup_peak_rss_ratio",
    "device_weight_gb", "budget_gb", "predicted_ms", "resident_blocks", "planned_slots",
    "coded_bytes", "coded_blocks", "codec_plan", "coding_step_ms_all", "coding_s", "bits_per_weight", "encode_s", "coded_sidecar", "sidecar_loaded", "sidecar_load_s",
    "sidecar_write_s", "sidecar_bytes", "sidecar_s_per_gb",
)


class Clock:
    def __init__(self):
        self.t0 = time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - self.t0:6.1f}s] {msg}",
              file=sys.stderr, flush=True)


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def touch_host_memory(gb: float, clock: Clock) -> None:
    if gb <= 0:
        return
    try:
        done = float(TOUCH_STAMP.read_text())
    except (OSError, ValueError):
        done = 0.0
    if done >= gb:
        clock.log(f"host memory already touched ({done:.0f} GB >= {gb:.0f} GB), skipping")
        return
    clock.log(f"touching {gb:.0f} GB of host memory in a throwaway process")
    rc = subprocess.run([sys.executable, "-m", "perf", "_touch", "--gb", str(gb)], cwd=REPO, env=_child_env()).returncode
    if rc == 0:
        TOUCH_STAMP.write_text(str(gb))
    else:
        clock.log(f"host-memory touch failed (exit {rc}); continuing")


def write_checkpoint_once(label: str, ckpt_dir: str | None, clock: Clock) -> str | None:
    """Write the scenario's checkpoint for -mmap modes in a throwaway process
    (untimed; when one is already there, only read it to warm the page cache).
    Returns an error message or None."""
    sc, tiny = get_scenario(label)
    where = ckpt_dir or checkpoint_dir(label)
    if existing_checkpoint(sc, where, tiny=tiny) is not None:
        t = time.perf_counter()
        n = warm_page_cache(where)
        clock.log(f"{label}: reusing the checkpoint {where} ({n / 1e9:.2f} GB read in {time.perf_counter() - t:.1f} s)")
        return None
    cmd = [sys.executable, "-m", "perf", "_ckpt", "--scenario", label]
    if ckpt_dir:
        cmd += ["--ckpt-dir", ckpt_dir]
    clock.log(f"{label}: preparing the safetensors checkpoint for -mmap modes")
    rc = subprocess.run(cmd, cwd=REPO, env=_child_env()).returncode
    return None if rc == 0 else f"writing the checkpoint failed (exit {rc})"


def _yardstick(mode: str) -> str | None:
    """The resident mode whose output ``mode`` must equal bit for bit (None: no such mode)."""
    try:
        spec = parse_mode(mode)
    except ValueError:
        return None
    if spec.compile:
        return "resident-compile"
    if spec.weight_fill != "normal":
        return "resident-tfill" if spec.weight_fill == CODED_FILL else None
    return "resident"


def run_worker(label: str, mode: str, *, steps: int, warmup: int, device: str | None,
               trace_dir: str | None, timeout: float | None, clock: Clock, extra: list[str] = ()) -> dict:
    """Run one mode in a fresh process; its stderr passes through, stdout lines
    other than the result are echoed to stderr."""
    cmd = [sys.executable, "-m", "perf", "_worker", "--scenario", label, "--mode", mode,
           "--steps", str(steps), "--warmup", str(warmup), *extra]
    if device:
        cmd += ["--device", device]
    if trace_dir:
        cmd += ["--trace-dir", trace_dir]
    clock.log(f"{label} {mode}: starting worker")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(), stdout=subprocess.PIPE, text=True)
    result = None
    fired = threading.Event()

    def _kill():
        fired.set()
        proc.kill()

    watchdog = threading.Timer(timeout, _kill) if timeout else None
    if watchdog:
        watchdog.start()
    try:
        for line in proc.stdout:
            s = line.strip()
            if s.startswith("{") and '"_perf_worker"' in s:
                try:
                    result = json.loads(s)
                    continue
                except ValueError:
                    pass
            sys.stderr.write(line)
            sys.stderr.flush()
        rc = proc.wait()
    finally:
        if watchdog:
            watchdog.cancel()
    if fired.is_set() and result is None:
        result = {"mode": mode, "ok": False, "error": f"killed after the --mode-timeout of {timeout:.0f} s"}
    elapsed = time.perf_counter() - t
    if result is None:
        result = {"mode": mode, "ok": False,
                  "error": f"worker exited with status {rc} after {elapsed:.0f} s without a result line"}
    clock.log(f"{label} {mode}: {'done' if result.get('ok') else 'FAILED'} in {elapsed:.1f} s")
    return result


def assemble(label: str, workers: dict[str, dict], failed: dict[str, str], *, commit: str, dirty: bool,
             prior: dict | None = None) -> dict:
    """The result dict (DESIGN.md section 7) from worker outputs."""
    ok = {m: w for m, w in workers.items() if w.get("ok")}
    first = next(iter(ok.values()), {})
    rates = [w["h2d_gbps"] for w in ok.values() if w.get("h2d_gbps")]
    # one floor for every mode: the best H2D measured in this run (a mode that
    # slowed the link must not get a kinder floor of its own)
    h2d = round(max(rates), 2) if rates else None
    raw = {}
    if prior:
        for m, f in prior.get("modes", {}).items():
            if m not in workers:
                raw[m] = {k: v for k, v in f.items()
                          if k not in ("floor_ms", "ratio_to_floor", "ratio_to_resident", "ratio_to_best_peer")}
    for m, w in ok.items():
        raw[m] = {k: w[k] for k in MODE_KEYS if w.get(k) is not None}
        if w.get("streamed_bytes") is not None:
            raw[m]["streamed_bytes"] = w["streamed_bytes"]
    modes = summarise(raw, h2d)
    for m, f in modes.items():
        f.pop("streamed_bytes", None)
        # compiled modes run other kernels: they compare with the compiled resident model; modes
        # with other weights (the coded modes' Student-t fill) with the resident model of that fill
        yardstick = _yardstick(m)
        ref = modes.get(yardstick, {}).get("output_sha1")
        if m != yardstick and ref and f.get("output_sha1"):
            # same seed, same weights: a different output means different kernels or a bug
            f["output_equals_resident"] = f["output_sha1"] == ref
    model_gb = first.get("model_gb") or (prior or {}).get("model_gb")
    result = {
        "scenario": label, "gpu": first.get("gpu") or (prior or {}).get("gpu", "unknown"),
        "gpus": first.get("gpus", (prior or {}).get("gpus", 0)), "commit": commit, "dirty": dirty,
        "torch": first.get("torch") or (prior or {}).get("torch", "unknown"),
        "date": datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "h2d_gbps": h2d, "driver": first.get("driver"), "model_gb": model_gb,
        "diffusers": first.get("diffusers"), "accelerate": first.get("accelerate"),
        "modes": modes,
    }
    if failed:
        result["failed"] = dict(failed)
    if prior and any(m not in workers for m in prior.get("modes", {})):
        result["merged_from"] = prior.get("date")
    return result


def host_memory_cap_gb() -> float | None:
    """What this machine lets a process touch: the larger of MemAvailable and a
    cgroup limit (the device machines' RAM grows on first use, so MemAvailable
    alone under-reports there); None when neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024 / 1e9)
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            found.append(int(raw) / 1e9)
    return max(found) if found else None


def _touch_size(requested: float, clock: Clock) -> float:
    cap = host_memory_cap_gb()
    if cap is not None and requested > 0.8 * cap:
        clock.log(f"host-memory touch of {requested:.0f} GB capped to {0.8 * cap:.0f} GB "
                  f"(80% of the {cap:.0f} GB this machine offers)")
        return round(0.8 * cap)
    return requested


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run(scenario: str, modes: list[str], *, steps: int = 5, warmup: int = 2, out_dir: str | Path | None = None,
        tiny: bool = False, device: str | None = None, touch_gb: float | None = None, trace_dir: str | None = None,
        mode_timeout: float | None = None, merge: bool = False, ckpt_dir: str | None = None,
        clock: Clock | None = None) -> tuple[dict | None, Path | None, bool]:
    """Run the modes; returns (result, path, all_ok)."""
    clock = clock or Clock()
    sc, tiny_name = get_scenario(scenario)
    tiny = tiny or tiny_name
    label = scenario_label(sc, tiny)
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got steps={steps} warmup={warmup}")
    if not tiny and (device == "cpu" or (device is None and not _cuda_available())):
        raise ValueError(f"scenario {scenario!r} is sized like the real model ({sc.approx_model_gb:.0f} GB) and "
                         "needs a CUDA GPU; on this machine add --tiny (a toy-sized model of the same structure)")
    if out_dir is None:
        # tiny runs are smoke tests: their figures do not belong in perf/results
        out_dir = tempfile.mkdtemp(prefix="weightstream-perf-tiny-") if tiny else DEFAULT_OUT
    for m in modes:
        parse_mode(m, sc)  # refuse unknown or disallowed modes before spending any time
    if len(set(modes)) != len(modes):
        raise ValueError(f"--modes lists a mode twice: {modes}")
    if "resident" not in modes:
        clock.log("adding mode 'resident': the floor and ratio_to_resident come from it")
        modes = ["resident"] + list(modes)
    else:
        modes = ["resident"] + [m for m in modes if m != "resident"]
    commit, dirty = git_commit()
    clock.log(f"scenario {label}: modes {','.join(modes)}; {warmup} warm-up + {steps} timed steps; "
              f"commit {commit[:12]}{' (dirty)' if dirty else ''}")
    if touch_gb is None:
        touch_gb = 0.0 if tiny else _touch_size(round(2 * sc.approx_model_gb), clock)
    touch_host_memory(touch_gb, clock)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workers, failed = {}, {}
    result, path, all_ok = None, None, True
    specs = {m: parse_mode(m, sc) for m in modes}
    ckpt_error = None
    if any(s.source == "mmap" for s in specs.values()):
        ckpt_error = write_checkpoint_once(label, ckpt_dir, clock)
    for mode in modes:
        if specs[mode].source == "mmap" and ckpt_error:
            failed[mode] = ckpt_error
            all_ok = False
            continue
        w = run_worker(label, mode, steps=steps, warmup=warmup, device=device, trace_dir=trace_dir,
                       timeout=mode_timeout, clock=clock,
                       extra=["--ckpt-dir", ckpt_dir] if ckpt_dir and specs[mode].source == "mmap" else [])
        workers[mode] = w
        if not w.get("ok"):
            failed[mode] = w.get("error", "failed")
            all_ok = False
            continue
        prior = None
        ok_first = next(w2 for w2 in workers.values() if w2.get("ok"))
        path = out_dir / result_filename(label, ok_first.get("gpu", "unknown"), commit)
        if merge and path.exists():
            prior = json.loads(path.read_text())
        result = assemble(label, workers, failed, commit=commit, dirty=dirty, prior=prior)
        try:
            validate_result(result)
        except ValueError as e:
            clock.log(f"result does not validate yet: {e}")
        path.write_text(json.dumps(result, indent=1) + "\n")
        clock.log(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    if result is not None and failed and path is not None:
        result = assemble(label, workers, failed, commit=commit, dirty=dirty,
                          prior=json.loads(path.read_text()) if merge else None)
        path.write_text(json.dumps(result, indent=1) + "\n")
    if result is not None:
        try:
            validate_result(result)
        except ValueError as e:
            clock.log(f"INVALID result {path}: {e}")
            all_ok = False
        print(markdown_table(result), flush=True)
    for mode, err in failed.items():
        clock.log(f"mode {mode} failed: {err}")
    return result, path, all_ok
