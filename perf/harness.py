"""`python -m perf run`: every mode of a scenario in its own fresh process.

Order: (host-memory touch) -> resident (added when not asked for: the floor
and ratio_to_resident need it) -> the other modes as given. After each mode
the result file is rewritten, so a run killed part-way keeps what finished.
The file is ``<scenario>-<gpu kind>.json``: this run's modes replace the
ones of the same name, the others stay (each mode names its own commit and
date). DLO modes (perf/dlo.py) and the module-swap scenario
(perf/module_swap.py) run through ``run_cli``.
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
from perf.results import load_prior, lora_yardstick, markdown_table, result_filename, summarise, validate_result
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
    "setup_s_per_gb", "checkpoint_fs", "staging_after_steps", "staging_pack_gbps", "adapter_bytes",
    "plan", "block_gb",  # the planned default: its plan, and every block's raw bytes (the uncoded floor)
)
RATIOS_OF_THE_RUN = ("floor_ms", "ratio_to_floor", "ratio_to_resident", "ratio_to_best_peer")


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
    if spec.lora:  # the same LoRA on the resident model (a resident-lora mode is its own); none for other weights
        return f"resident-{spec.lora}" if spec.weight_fill == "normal" and spec.quantize is None else None
    if spec.quantize is not None:  # the same quantized model resident (perf/quantized.py)
        return None if spec.kind == "resident" else f"resident-{spec.quantize}"
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


def _prior_modes(prior: dict | None, workers: dict) -> tuple[dict, dict]:
    """The modes of the file this run merges into that it did not measure (not run, or failed this
    time): (those whose ratios are worked out again against this run's resident step and H2D
    rate, those kept as measured). DLO modes are kept: their floor is per rank, their resident
    the slowest rank's."""
    again, kept = {}, {}
    for m, f in (prior or {}).get("modes", {}).items():
        if workers.get(m, {}).get("ok"):
            continue
        f = {"commit": prior["commit"], "date": prior["date"], **f}
        if m.startswith("dlo-"):
            kept[m] = dict(f)
        else:
            again[m] = {k: v for k, v in f.items() if k not in RATIOS_OF_THE_RUN}
    return again, kept


def assemble(label: str, workers: dict[str, dict], failed: dict[str, str], *, commit: str, dirty: bool,
             prior: dict | None = None) -> dict:
    """The result dict (DESIGN.md section 7) from worker outputs, merged over ``prior`` (the file
    already there): its other modes stay, each with its own commit and date."""
    ok = {m: w for m, w in workers.items() if w.get("ok")}
    first = next(iter(ok.values()), {})
    rates = [w["h2d_gbps"] for w in ok.values() if w.get("h2d_gbps")]
    # one floor for every mode: the best H2D measured in this run (a mode that
    # slowed the link must not get a kinder floor of its own)
    h2d = round(max(rates), 2) if rates else None
    date = datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    raw, kept = _prior_modes(prior, workers)
    for m, w in ok.items():
        raw[m] = {k: w[k] for k in MODE_KEYS if w.get(k) is not None}
        raw[m].update(commit=commit, date=date)
        if w.get("streamed_bytes") is not None:
            raw[m]["streamed_bytes"] = w["streamed_bytes"]
    modes = {**summarise(raw, h2d), **kept}
    for m, f in modes.items():
        f.pop("streamed_bytes", None)
        # compiled modes run other kernels: they compare with the compiled resident model; modes
        # with other weights (the coded modes' Student-t fill) with the resident model of that fill
        yardstick = _yardstick(m)
        ref = modes.get(yardstick, {}).get("output_sha1")
        if m != yardstick and ref and f.get("output_sha1") and (m in ok or "output_equals_resident" not in f):
            # same seed, same weights: a different output means different kernels or a bug (an
            # earlier run's mode keeps the comparison made in its own run)
            f["output_equals_resident"] = f["output_sha1"] == ref
    model_gb = first.get("model_gb") or (prior or {}).get("model_gb")
    result = {
        **{k: v for k, v in (prior or {}).items() if k not in ("modes", "failed", "merged_from")},
        "scenario": label, "gpu": first.get("gpu") or (prior or {}).get("gpu", "unknown"),
        "gpus": first.get("gpus", (prior or {}).get("gpus", 0)), "commit": commit, "dirty": dirty,
        "torch": first.get("torch") or (prior or {}).get("torch", "unknown"),
        "date": date, "h2d_gbps": h2d, "driver": first.get("driver"), "model_gb": model_gb,
        "diffusers": first.get("diffusers"), "accelerate": first.get("accelerate"),
        "modes": modes,
    }
    if failed:
        result["failed"] = dict(failed)
    if prior and any(not workers.get(m, {}).get("ok") for m in prior.get("modes", {})):
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
        mode_timeout: float | None = None, ckpt_dir: str | None = None, profile_dir: str | None = None,
        clock: Clock | None = None) -> tuple[dict | None, Path | None, bool]:
    """Run the modes, merging into ``<out_dir>/<scenario>-<gpu kind>.json``; returns (result, path, all_ok)."""
    clock = clock or Clock()
    sc, tiny_name = get_scenario(scenario)
    tiny = tiny or tiny_name
    label = scenario_label(sc, tiny)
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got steps={steps} warmup={warmup}")
    if not tiny and (device == "cpu" or (device is None and not _cuda_available())):
        raise ValueError(f"scenario {scenario!r} is sized like the real model ({sc.approx_model_gb:.0f} GB) and "
                         "needs a CUDA GPU; on this machine add --tiny (a toy-sized model of the same structure)")
    if profile_dir and (device == "cpu" or (device is None and not _cuda_available())):
        raise ValueError("--profile-dir profiles the CUDA copy and compute lanes (perf/lanes.py): it needs a CUDA "
                         "device; leave it out on a CPU")
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
    for want in dict.fromkeys(lora_yardstick(m) for m in modes if lora_yardstick(m)):
        if want not in modes:  # a LoRA mode's floor and ratio_to_resident_lora come from it
            clock.log(f"adding mode {want!r}: the LoRA modes' floor and ratio_to_resident_lora come from it")
            modes.insert(1, want)
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
    prior = None
    for mode in modes:
        if specs[mode].source == "mmap" and ckpt_error:
            failed[mode] = ckpt_error
            all_ok = False
            continue
        extra = ["--ckpt-dir", ckpt_dir] if ckpt_dir and specs[mode].source == "mmap" else []
        if profile_dir:
            extra += ["--profile-dir", profile_dir]
        w = run_worker(label, mode, steps=steps, warmup=warmup, device=device, trace_dir=trace_dir,
                       timeout=mode_timeout, clock=clock, extra=extra)
        workers[mode] = w
        if not w.get("ok"):
            failed[mode] = w.get("error", "failed")
            all_ok = False
            continue
        if path is None:  # the GPU kind is known from the first mode that finished
            path = out_dir / result_filename(label, w.get("gpu", "unknown"), w.get("gpus", 0))
            prior = load_prior(path, label, w.get("gpu", "unknown"), w.get("gpus", 0))
        result = _write(path, assemble(label, workers, failed, commit=commit, dirty=dirty, prior=prior), clock)
    if result is not None and failed:
        result = _write(path, assemble(label, workers, failed, commit=commit, dirty=dirty, prior=prior), clock)
    if result is not None:
        try:
            validate_result(result)
        except ValueError as e:
            clock.log(f"INVALID result {path}: {e}")
            all_ok = False
        print(markdown_table(result), flush=True)
        for line in verdicts(result):
            clock.log(line)
    for mode, err in failed.items():
        clock.log(f"mode {mode} failed: {err}")
    return result, path, all_ok


def _write(path: Path, result: dict, clock: Clock) -> dict:
    try:
        validate_result(result)
    except ValueError as e:
        clock.log(f"result does not validate yet: {e}")
    path.write_text(json.dumps(result, indent=1) + "\n")
    clock.log(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return result


# the mmap source's targets: step against the pinned store of the same run, setup per GB
MMAP_TARGETS = {"layerwise-mmap": 1.05, "layerwise-mmap-staging": 1.10}
MMAP_SETUP_TARGET_S_PER_GB = 0.2


def verdicts(result: dict) -> list[str]:
    """One line per target this run's figures can judge (the mmap source's, against layerwise)."""
    lines = []
    for m, f in result["modes"].items():
        if f.get("commit", result["commit"]) != result["commit"]:
            continue  # an earlier run's mode, judged in its own run
        base = "layerwise-mmap-staging" if m.startswith("layerwise-mmap-staging") else m
        target, r = MMAP_TARGETS.get(base), f.get("ratio_to_pinned")
        if target is not None and r is not None:
            lines.append(f"{m}: step {r:.3f}x pinned (target <= {target}) {'PASS' if r <= target else 'MISS'}")
    s = result["modes"].get("layerwise-mmap", {}).get("setup_s_per_gb")
    if s is not None:
        lines.append(f"layerwise-mmap: setup {s:.3f} s/GB (target < {MMAP_SETUP_TARGET_S_PER_GB}) "
                     f"{'PASS' if s < MMAP_SETUP_TARGET_S_PER_GB else 'MISS'}")
    return lines


# ------------------------------------------------------------------ `python -m perf run`: the three families

WORKER_DEFAULT_MODES = ("resident", "layerwise", "diffusers-block", "diffusers-leaf")
# options that only one family of modes takes (argparse dest -> the family)
FAMILY_OPTIONS = {
    "touch_gb": "worker", "trace_dir": "worker", "mode_timeout": "worker", "ckpt_dir": "worker",
    "nproc": "dlo", "num_slots": "dlo", "plan_h2d_gbps": "dlo",
    "encoder_gb": "module", "dit_gb": "module", "width": "module", "rounds": "module", "peer_rounds": "module",
    "fill": "module", "run_mb": "module", "steps": "worker/dlo", "warmup": "worker/dlo", "tiny": "worker/dlo",
    "profile_dir": "worker/dlo",
}
FAMILY_NAMES = {"worker": "single-GPU modes (one fresh process each)", "dlo": "dlo-* modes (--nproc ranks)",
                "module": "--scenario module-swap"}


def family_of(scenario: str, modes: list[str] | None, nproc: str | None) -> str:
    """Which runner a `perf run` goes to: "module" (the module-swap scenario), "dlo" (a dlo-* mode
    or --nproc: ranks), else "worker"; ValueError on a mix."""
    from perf.dlo import MODES as DLO_MODES, is_dlo_mode
    from perf.module_swap import SCENARIO as MODULE_SCENARIO

    if scenario == MODULE_SCENARIO:
        return "module"
    if nproc is not None or any(is_dlo_mode(m) for m in modes or ()):
        other = [m for m in modes or () if m not in DLO_MODES]
        if any(is_dlo_mode(m) for m in other):
            raise ValueError(f"--modes {','.join(m for m in other if is_dlo_mode(m))} is not allowed with DLO modes; "
                             f"choose from: {', '.join(DLO_MODES)}")
        if other:
            raise ValueError(f"--modes mixes dlo-* modes with {','.join(other)}, which do not run on DLO ranks; "
                             f"run them separately (with DLO: {', '.join(DLO_MODES)})")
        return "dlo"
    return "worker"


def _check_options(family: str, given: dict) -> None:
    for key, value in given.items():
        owner = FAMILY_OPTIONS.get(key)
        if value is not None and value is not False and owner and family not in owner.split("/"):
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"{flag} applies to {' / '.join(FAMILY_NAMES[o] for o in owner.split('/'))}, "
                             f"not to {FAMILY_NAMES[family]}; leave it out")


def run_cli(args) -> int:
    """`python -m perf run` (argparse namespace in, exit code out): dispatch to the family."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes is not None else None
    family = family_of(args.scenario, modes, args.nproc)
    _check_options(family, {k: getattr(args, k) for k in FAMILY_OPTIONS})
    steps, warmup = args.steps if args.steps is not None else 5, args.warmup if args.warmup is not None else 2
    if family == "module":
        from perf.module_swap import MODES as MODULE_MODES, SwapSizes, run_module_swap

        sizes = SwapSizes(**{k: getattr(args, k) for k in ("encoder_gb", "dit_gb", "width", "rounds", "peer_rounds",
                                                           "fill", "run_mb") if getattr(args, k) is not None})
        _, path = run_module_swap(modes or MODULE_MODES, sizes, out_dir=args.out, device=args.device)
        print(f"result: {path}")
        return 0
    if family == "dlo":
        from perf.dlo import DEFAULT_MODES, SCENARIO as DLO_SCENARIO, dlo_run, parse_nproc, run_dlo

        sc, tiny = get_scenario(args.scenario)
        if sc.name != DLO_SCENARIO:
            raise ValueError(f"DLO modes run the {DLO_SCENARIO} scenario (its Flux, one request per rank), "
                             f"not {args.scenario!r}; give --scenario {DLO_SCENARIO}")
        args.tiny = args.tiny or tiny
        if args.device not in (None, "cpu" if args.tiny else "cuda"):
            raise ValueError(f"--device {args.device} does not apply to DLO modes: they run on CUDA ranks (NCCL), "
                             "or with --tiny on CPU ranks over gloo")
        dlo = dlo_run(modes or DEFAULT_MODES, steps=steps, warmup=warmup, tiny=args.tiny,
                      num_slots=args.num_slots or 2, plan_h2d_gbps=args.plan_h2d_gbps, profile_dir=args.profile_dir)
        code, _, paths = run_dlo(dlo, parse_nproc(args.nproc or "2"), args.out)
        for path in paths:
            print(f"result: {path}")
        return code
    _, path, ok = run(args.scenario, modes or list(WORKER_DEFAULT_MODES), steps=steps, warmup=warmup,
                      out_dir=args.out, tiny=args.tiny, device=args.device, touch_gb=args.touch_gb,
                      trace_dir=args.trace_dir, mode_timeout=args.mode_timeout, ckpt_dir=args.ckpt_dir,
                      profile_dir=args.profile_dir)
    if path is None:
        print("perf run: no mode finished; no result written", file=sys.stderr)
        return 1
    print(f"result: {path}")
    return 0 if ok else 1


def list_text() -> str:
    """`python -m perf list`: every scenario and mode family, and what runs them."""
    from perf.dlo import MODES as DLO_MODES
    from perf.modes import PEER_MODES
    from perf.module_swap import MODES as MODULE_MODES, SCENARIO as MODULE_SCENARIO
    from perf.quantized import QUANT_VARIANTS
    from perf.scenarios import SCENARIOS

    lines = ["scenarios:"]
    lines += [f"  {s.name:16s} {s.description}" for s in SCENARIOS.values()]
    lines += [f"  {MODULE_SCENARIO:16s} T5-XXL-sized encoder and Flux-sized DiT (Linear stacks): arrivals and departures",
              "  (each DiT scenario also as <name>-tiny: a toy-sized model of the same structure, runs on a CPU)", "",
              "single-GPU modes (each in a fresh process):",
              "  resident, resident-graph, resident-compile, resident-tfill (yardsticks)",
              "  layerwise[-<variant>...], graphs[-<variant>...]; variants: r<N>, auto, <N>gb, s<N>, mmap, staging, t<N>,",
              "    graphs, nextstep, ingraph, compile, coded, coded2, codedp, codedauto, sidecar, encgpu, enccpu, encplace",
              "    last, one of -lora<R>, -lora<R>fused (peft LoRA of rank R) or a quantized model: "
              + ", ".join(f"-{q}" for q in QUANT_VARIANTS) + " (also resident-<q>, default-*, diffusers-block-<q>)",
              "  layerwise-pinned-half, layerwise-pageable-half",
              "  default, default-<N>gb (OffloadConfig.layerwise() with no arguments: the planned default)",
              "  peers: " + ", ".join(PEER_MODES) + " (accelerate-cpu: flux-12b-512 only)",
              "dlo-* modes (flux-12b-1024, --nproc N[,N...] ranks, one per GPU; --tiny: CPU ranks over gloo):",
              "  " + ", ".join(DLO_MODES),
              f"--scenario {MODULE_SCENARIO} (GPU only):", "  " + ", ".join(MODULE_MODES)]
    return "\n".join(lines)
