"""One mode of one scenario, in this (fresh) process: `python -m perf _worker`.

Builds the model, sets the mode up, runs warm-up steps, then times `steps`
steps with CUDA events around each (no synchronisation inside the timed
region), measures pinned H2D bandwidth last (so its pinned buffer cannot feed
the mode's own pinning from torch's host cache), and prints one JSON line
(`{"_perf_worker": 1, ...}`) on stdout. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import time
import traceback

import torch

from perf.common import measure_h2d_gbps, timed_steps
from perf.modes import coded_figures, parse_mode, prepare, prepare_mmap, staging_figures, weightstream_config
from perf.quantized import QUANT_VARIANTS, quantize, reset_peak_rss
from perf.results import GB, placement_figures
from perf.scenarios import (
    block_bytes, build_inputs, build_meta_model, build_model, checkpoint_dir, checkpoint_info, first_output, fs_type,
    get_scenario, scenario_label, tensor_bytes, warm_page_cache, write_checkpoint,
)


def log(prefix: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {prefix}: {msg}", file=sys.stderr, flush=True)


def host_rss_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def process_rss_peak_bytes() -> int:
    """This process's own peak RSS (VmHWM): ru_maxrss may also carry the RSS of
    the process that spawned it (Linux keeps the pre-exec high-water mark)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return host_rss_peak_bytes()


# issue 15: the process's peak RSS up to the end of setup (imports, build,
# packing) at most this many times the model's bytes
TARGET_SETUP_PEAK_RSS_RATIO = 1.15


def setup_rss_figures(peak_bytes: int, model_bytes: int) -> dict:
    """The setup peak host memory figures of a mode (sizes in decimal GB)."""
    return dict(setup_peak_rss_gb=round(peak_bytes / GB, 3),
                setup_peak_rss_ratio=round(peak_bytes / model_bytes, 4) if model_bytes > 0 else None,
                target_setup_peak_rss_ratio=TARGET_SETUP_PEAK_RSS_RATIO)


def settle_codec(run, stats, cuda: bool, *, limit_s: float = 150.0) -> list[float]:
    """weight_codec="auto" (given, or the planned default's): steps until its plan is made (after
    the first) and its background coding finished, each timed (ms, host clock after a sync);
    RuntimeError past ``limit_s``."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out, t0 = [], time.perf_counter()
    while True:
        t = time.perf_counter()
        run()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
        s = stats()
        if "codec_plan" in s and s.get("coding_in_background") is None:
            return out
        if time.perf_counter() - t0 > limit_s:
            raise RuntimeError(f"weight_codec='auto' had not finished coding after {len(out)} steps "
                               f"({limit_s:.0f} s): {s.get('coding_in_background')} blocks left")


def torch_pinned_bytes() -> int | None:
    """Bytes held by torch's pinned host allocator (pin_memory=True / .pin_memory())."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return None
    try:
        stats = fn()
    except Exception:
        return None
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    return None


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__.split("+")[0], "torch_full": torch.__version__,
           "python": sys.version.split()[0], "gpu": "cpu", "gpus": 0, "driver": None}
    for mod in ("diffusers", "accelerate"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpus"] = torch.cuda.device_count()
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return env


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(args, prefix: str) -> dict:
    scenario, tiny = get_scenario(args.scenario)
    if args.tiny:
        tiny = True
    label = scenario_label(scenario, tiny)
    spec = parse_mode(args.mode, scenario)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    env = environment(device)
    events_dir = os.environ.get("WEIGHTSTREAM_EVENTS_DIR")
    record_events = bool(args.trace_dir or events_dir) and spec.kind == "weightstream"
    if spec.kind == "weightstream":
        weightstream_config(spec, record_events)  # refuse before spending time on the build

    ckpt, info = None, None
    t = time.perf_counter()
    if spec.source == "mmap":
        ckpt = args.ckpt_dir or str(checkpoint_dir(label, args.seed))
        info = checkpoint_info(ckpt)
        model = build_meta_model(scenario, tiny=tiny)
        model_bytes, blk_bytes = info["model_bytes"], info["block_bytes"]
        log(prefix, f"model on meta; weights from the checkpoint {ckpt} ({info['checkpoint_bytes'] / 1e9:.2f} GB)")
    else:
        model = build_model(scenario, tiny=tiny, device=device if spec.builds_on_device else "cpu",
                            seed=args.seed, progress=lambda m: log(prefix, m), weight_fill=spec.weight_fill)
        if spec.quantize is not None:  # perf/quantized.py: the same weights, quantized on the host
            model = quantize(model, spec.quantize)
            log(prefix, f"quantized ({QUANT_VARIANTS[spec.quantize]}): {tensor_bytes(model) / GB:.2f} GB")
            if not reset_peak_rss():  # the setup peak counts from the quantized model on
                log(prefix, "could not reset the peak RSS: the setup peak includes the bf16 build")
        model_bytes, blk_bytes = tensor_bytes(model), block_bytes(model, scenario)
    build_s = time.perf_counter() - t
    inputs = build_inputs(scenario, device, tiny=tiny)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    t = time.perf_counter()
    if ckpt is not None:
        prepared = prepare_mmap(spec, model, ckpt, device, record_events=record_events)
    else:
        prepared = prepare(spec, model, scenario, device, record_events=record_events)
    _sync(device)
    setup_s = time.perf_counter() - t
    del model
    setup_peak = process_rss_peak_bytes()  # the build and the setup, before any step
    log(prefix, f"set up in {setup_s:.2f} s (peak RSS so far {setup_peak / GB:.2f} GB, "
                f"{setup_peak / max(model_bytes, 1):.3f}x the model); {args.warmup} warm-up + {args.steps} timed steps")
    rss_after_setup = host_rss_bytes()
    pinned = prepared.pinned_bytes if prepared.pinned_bytes is not None else torch_pinned_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    mon = None
    if device.type == "cuda" and not args.no_monitor:
        from weightstream.telemetry import MemoryMonitor

        mon = MemoryMonitor(hz=args.monitor_hz, devices=[device.index], host_hz=0, pcie=bool(args.trace_dir))
        if prepared.events is not None:
            mon.attach_events(prepared.events)
        mon.start()
    coding_ms = None
    try:
        with torch.no_grad():
            planned = "weight_codec" in prepared.notes.get("planned_keys", ())  # the default plans the codec
            if spec.config_kw.get("weight_codec") == "auto" or planned:  # plan + background coding first (untimed)
                coding_ms = settle_codec(lambda: prepared.module(**inputs), prepared.module.stats,
                                         device.type == "cuda")
                log(prefix, f"weight_codec='auto': planned and coded over {len(coding_ms)} steps "
                            f"({sum(coding_ms) / 1e3:.1f} s)")
            timing = timed_steps(lambda: prepared.module(**inputs), args.steps, args.warmup,
                                 device.type == "cuda", after=prepared.after_step)
            ms, wall, first_ms, out = timing.ms, timing.wall_ms, timing.first_ms, timing.out
            if coding_ms:
                first_ms = coding_ms[0]
    finally:
        if mon is not None:
            mon.stop()
    if args.profile_dir and device.type == "cuda":
        from perf.lanes import profile_steps

        with torch.no_grad():
            lanes = profile_steps(lambda: prepared.module(**inputs), args.profile_steps, args.profile_dir,
                                  f"{label}-{args.mode}")
        log(prefix, f"profiled {args.profile_steps} steps: copy lane busy {lanes.get('copy_busy_ms')} ms, "
                    f"idle {lanes.get('copy_idle_ms')} ms in {lanes.get('gaps_over_min')} gaps over "
                    f"{lanes.get('window_ms')} ms")
    if prepared.refresh is not None:
        prepared.refresh()
        if prepared.stats and prepared.stats.get("pinned_bytes") is not None:
            pinned = prepared.stats["pinned_bytes"]  # after the steps: weight_codec="auto" re-pins what it coded
    y = first_output(out)
    finite = bool(torch.isfinite(y).all().item())
    digest = hashlib.sha1(y.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    step_ms = statistics.median(ms)
    log(prefix, f"median step {step_ms:.1f} ms (min {min(ms):.1f}, max {max(ms):.1f}); output finite: {finite}")

    figs = dict(env)
    if coding_ms:
        figs.update(coding_step_ms_all=[round(x, 3) for x in coding_ms], coding_s=round(sum(coding_ms) / 1e3, 3))
    figs.update(
        step_ms=round(step_ms, 3), step_ms_all=[round(x, 3) for x in ms], wall_ms_per_step=round(wall, 3),
        first_step_ms=None if first_ms is None else round(first_ms, 3), steps=args.steps, warmup=args.warmup,
        build_s=round(build_s, 3), setup_s=round(setup_s, 3),
        model_gb=round(model_bytes / GB, 4), block_gb=round(blk_bytes / GB, 4),
        host_rss_gb=None if rss_after_setup is None else round(rss_after_setup / GB, 3),
        host_rss_peak_gb=round(host_rss_peak_bytes() / GB, 3),
        pinned_host_gb=None if pinned is None else round(pinned / GB, 3),
        output_finite=finite, output_sha1=digest, record_events=record_events,
        **setup_rss_figures(setup_peak, model_bytes),
    )
    if prepared.streamed_bytes is not None:
        figs["streamed_bytes"] = int(prepared.streamed_bytes)
        figs["streamed_gb"] = round(prepared.streamed_bytes / GB, 4)
    if prepared.stats:
        figs["stats"] = prepared.stats
        figs.update(placement_figures(prepared.stats))
        figs.update(coded_figures(prepared.stats))  # coded modes: coded_bytes, bits_per_weight
    if info is not None:  # the mmap source: set-up per checkpoint GB, the staging packer's figures
        figs.update(setup_s_per_gb=round(setup_s / (info["checkpoint_bytes"] / GB), 4), checkpoint_fs=fs_type(ckpt),
                    **staging_figures(prepared.stats))
    if prepared.notes:
        figs["notes"] = prepared.notes
    if "lora" in prepared.notes:  # -lora<R> modes and their resident yardsticks: the adapter's device bytes
        figs["adapter_bytes"] = prepared.notes["lora"]["adapter_bytes"]
    if device.type == "cuda":
        figs["peak_device_gb"] = round(torch.cuda.max_memory_allocated(device) / GB, 3)
        figs["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / GB, 3)
    if mon is not None:
        trace = mon.to_trace(meta={"scenario": label, "mode": args.mode})
        used = [u for u in (trace["gpu"][0]["used_bytes"] if trace["gpu"] else []) if u is not None]
        if used:
            figs["nvml_peak_used_gb"] = round(max(used) / GB, 3)
            figs["nvml_total_gb"] = round(trace["devices"][0]["total_bytes"] / GB, 3)
        if args.trace_dir:
            from weightstream.report import render_html
            from weightstream.tracefile import save_trace

            base = os.path.join(args.trace_dir, f"{label}-{args.mode}")
            save_trace(trace, base + "-trace.json")
            paths = render_html(trace, base + "-report.html", title=f"{label} {args.mode}")
            figs["trace"] = base + "-trace.json"
            log(prefix, f"trace {base}-trace.json, report {paths['html']}")
    if events_dir and prepared.events is not None:
        with open(os.path.join(events_dir, f"events-{label}-{args.mode}.json"), "w") as f:
            json.dump(prepared.events(), f)
    del out, y
    if device.type == "cuda" and not args.no_h2d:
        h2d, rates = measure_h2d_gbps(device)
        figs["h2d_gbps"] = round(h2d, 2)
        figs["h2d_gbps_all"] = [round(r, 2) for r in rates]
        log(prefix, f"pinned H2D {h2d:.1f} GB/s")
    return figs


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m perf _worker")
    p.add_argument("--scenario", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--monitor-hz", type=float, default=50.0)
    p.add_argument("--no-monitor", action="store_true")
    p.add_argument("--no-h2d", action="store_true")
    p.add_argument("--profile-dir", default=None,
                   help="after the timed steps, profile --profile-steps more with torch.profiler; write the copy/compute "
                        "lane summary (perf/lanes.py) and the gzipped trace here")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint folder of an -mmap mode (default: per scenario in /tmp)")
    args = p.parse_args(argv)
    prefix = f"{args.scenario}{'-tiny' if args.tiny and not args.scenario.endswith('-tiny') else ''} {args.mode}"
    result = {"_perf_worker": 1, "scenario": args.scenario, "mode": args.mode, "ok": False}
    try:
        result.update(run_mode(args, prefix))
        result["ok"] = True
        rc = 0
    except Exception as e:  # reported to the harness, which records the mode as failed
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        log(prefix, f"FAILED: {result['error']}")
        rc = 1
    print(json.dumps(result), flush=True)
    return rc


def touch_main(argv: list[str]) -> int:
    """Allocate and write `--gb` GB of host memory, then exit (the device
    machine's RAM grows on first use; touching it once keeps that cost out of
    whichever mode runs first)."""
    p = argparse.ArgumentParser(prog="python -m perf _touch")
    p.add_argument("--gb", type=float, required=True)
    args = p.parse_args(argv)
    t = time.perf_counter()
    chunks, left = [], int(args.gb * GB)
    while left > 0:
        n = min(left, 1 << 30)
        chunks.append(torch.empty(n, dtype=torch.uint8).fill_(1))
        left -= n
    log("touch", f"wrote {args.gb:.1f} GB of host memory in {time.perf_counter() - t:.1f} s")
    return 0


def ckpt_main(argv: list[str]) -> int:
    """Write (or reuse) the scenario's safetensors checkpoint for -mmap modes,
    then read it once so the page cache holds it."""
    p = argparse.ArgumentParser(prog="python -m perf _ckpt")
    p.add_argument("--scenario", required=True)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    scenario, tiny = get_scenario(args.scenario)
    label = scenario_label(scenario, tiny)
    ckpt = args.ckpt_dir or str(checkpoint_dir(label, args.seed))
    t = time.perf_counter()
    info = write_checkpoint(scenario, ckpt, tiny=tiny, seed=args.seed, progress=lambda m: log(label, m))
    n = warm_page_cache(ckpt)
    log(label, f"checkpoint ready in {time.perf_counter() - t:.1f} s ({info['checkpoint_bytes'] / 1e9:.2f} GB, "
               f"{n / 1e9:.2f} GB read to warm the page cache)")
    return 0
