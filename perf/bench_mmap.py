"""Benchmark of the mmap checkpoint source on a Flux.1-sized model (1024x1024).

    python perf/bench_mmap.py [--ckpt-dir /tmp/flux-ckpt] [--steps 5 --warmup 2] [--modes ...]

1. Writes a Flux.1-sized random bf16 checkpoint in diffusers layout
   (FluxTransformer2DModel defaults + guidance_embeds=True, 23.8 GB, sharded
   with an index.json; values generated on the GPU in chunks and written with
   safetensors) to ``--ckpt-dir``, or reuses the one already there.
2. Reads it once to warm the page cache.
3. Runs each mode in a fresh process: ``resident`` (weights on the device, for
   the compute floor), ``layerwise-mmap`` (registered mapping, direct DMA),
   ``layerwise-mmap-staging`` (forced two-buffer staging; ``-t<N>``: with N
   packing threads) and ``layerwise``
   (ordinary loading into private memory, then the pinned HostStore): median
   step ms over ``--steps`` steps after ``--warmup`` (CUDA events around each
   step), setup s (open, map, bind, register; for layerwise: pack and pin)
   and s/GB, and the ratio to the pinned-store step.
4. Writes ``perf/results/flux-12b-1024-mmap-<gpu-slug>-<commit>.json``.

Targets: mmap step <= 1.05x pinned, staging <= 1.1x pinned, mmap setup
< 0.2 s/GB. ``--tiny`` runs the same flow on a toy-sized Flux (CPU works).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):  # `python perf/bench_mmap.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
SCENARIO = "flux-12b-1024"
MODES = ("resident", "layerwise-mmap", "layerwise-mmap-staging", "layerwise")
TARGETS = {"layerwise-mmap": 1.05, "layerwise-mmap-staging": 1.10}
# layerwise-mmap-staging-t<N>: staging with N packing threads (default: staging.default_threads())
_STAGING_T = re.compile(r"^layerwise-mmap-staging-t([1-9][0-9]*)$")


def known_mode(mode: str) -> bool:
    return mode in MODES or bool(_STAGING_T.match(mode))


def staging_threads(mode: str) -> int | None:
    m = _STAGING_T.match(mode)
    return int(m.group(1)) if m else None


def target_of(mode: str) -> float | None:
    return TARGETS["layerwise-mmap-staging"] if _STAGING_T.match(mode) else TARGETS.get(mode)
SETUP_TARGET_S_PER_GB = 0.2
MARK = '"_bench_mmap"'
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _config(tiny: bool) -> dict:
    from perf.scenarios import SCENARIOS

    sc = SCENARIOS[SCENARIO]
    return dict(sc.tiny_config if tiny else sc.config)


# ------------------------------------------------------------------ checkpoint


def _fill(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return "zeros"
    if "norm" in name and leaf == "weight" and ".linear." not in name:
        return "ones"
    return "normal"


def write_checkpoint(ckpt_dir: Path, tiny: bool, shard_gb: float, seed: int = 0) -> None:
    """Random bf16 weights for the scenario's Flux config, diffusers layout, sharded."""
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from weightstream.offload.mmap_source import on_meta

    cfg = _config(tiny)
    stamp = ckpt_dir / ".complete"
    want = hashlib.sha1(json.dumps([cfg, shard_gb, seed], sort_keys=True).encode()).hexdigest()
    if stamp.exists() and stamp.read_text().strip() == want:
        log(f"checkpoint: reusing {ckpt_dir}")
        return
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for old in ckpt_dir.glob("*.safetensors"):
        old.unlink()
    with on_meta():
        model = FluxTransformer2DModel(**cfg)
    model.save_config(str(ckpt_dir))
    specs = [(k, tuple(v.shape)) for k, v in model.state_dict(keep_vars=True).items()]
    total = sum(torch.Size(s).numel() * 2 for _, s in specs)
    gen_dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator(device=gen_dev).manual_seed(seed)
    limit = int(shard_gb * 1e9)
    shards, cur, size = [], [], 0
    for k, s in specs:
        nb = torch.Size(s).numel() * 2
        if cur and size + nb > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append((k, s))
        size += nb
    shards.append(cur)
    log(f"checkpoint: writing {total / 1e9:.2f} GB in {len(shards)} shards to {ckpt_dir} "
        f"(random on {gen_dev.type})")
    weight_map, done, chunk = {}, 0, 1 << 27
    t0 = time.perf_counter()
    for i, shard in enumerate(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for k, s in shard:
            out = torch.empty(s, dtype=torch.bfloat16)
            kind = _fill(k)
            if kind == "zeros":
                out.zero_()
            elif kind == "ones":
                out.fill_(1)
            else:
                flat = out.view(-1)
                for a in range(0, flat.numel(), chunk):
                    b = min(a + chunk, flat.numel())
                    flat[a:b].copy_(torch.empty(b - a, dtype=torch.bfloat16, device=gen_dev)
                                    .normal_(0.0, 0.02, generator=gen))
            tensors[k] = out
            weight_map[k] = name
            done += out.numel() * 2
        save_file(tensors, str(ckpt_dir / name), metadata={"format": "pt"})
        del tensors
        rate = done / 1e9 / (time.perf_counter() - t0)
        log(f"checkpoint: {done / 1e9:.2f}/{total / 1e9:.2f} GB ({rate:.2f} GB/s)")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (ckpt_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    stamp.write_text(want)


def warm_page_cache(ckpt_dir: Path) -> float:
    """Read every shard once (page cache warm for the modes); returns GB read."""
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            while True:
                n = fh.readinto(view)
                if not n:
                    break
                total += n
    dt = time.perf_counter() - t0
    log(f"page cache: read {total / 1e9:.2f} GB in {dt:.1f} s ({total / 1e9 / max(dt, 1e-9):.1f} GB/s)")
    return total / 1e9


def fs_type(path: Path) -> str:
    best, kind = "", "unknown"
    try:
        p = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and p.startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


# ------------------------------------------------------------------ worker


def _timed_steps(module, inputs, steps: int, warmup: int, cuda: bool) -> tuple[list[float], float]:
    """(per-step ms, first warm-up step ms) through the shared loop; the output must be finite."""
    import torch

    from perf.common import timed_steps
    from perf.scenarios import first_output

    with torch.no_grad():
        t = timed_steps(lambda: first_output(module(**inputs)), steps, warmup, cuda)
    if not torch.isfinite(t.out.float()).all():
        raise RuntimeError("non-finite output")
    return t.ms, t.first_ms or 0.0


def run_worker(mode: str, ckpt_dir: Path, steps: int, warmup: int, device: str, tiny: bool) -> dict:
    import torch
    from diffusers import FluxTransformer2DModel

    from perf.scenarios import SCENARIOS, build_inputs
    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.offload.mmap_source import Checkpoint, meta_from_pretrained, offload_from_safetensors

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        if dev.index is None:  # set_device needs an index (torch 2.11)
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    out: dict = {"mode": mode}
    t0 = time.perf_counter()
    meta = meta_from_pretrained(FluxTransformer2DModel, ckpt_dir)
    out["build_s"] = round(time.perf_counter() - t0, 3)
    inputs = build_inputs(SCENARIOS[SCENARIO], dev, tiny=tiny)
    ckpt_gb = sum(f.stat().st_size for f in ckpt_dir.glob("*.safetensors")) / 1e9
    log(f"{mode}: model built on meta in {out['build_s']:.2f} s; checkpoint {ckpt_gb:.2f} GB")
    t0 = time.perf_counter()
    if mode == "resident":
        ck = Checkpoint(ckpt_dir)
        sd = {k: ck.tensor(t).to(dev) for k, t in ck.entries.items()}
        meta.load_state_dict(sd, strict=True, assign=True)
        module, stats = meta, {}
        out["load_s"] = round(time.perf_counter() - t0, 3)
    elif mode == "layerwise":
        from safetensors.torch import load_file

        sd = {}
        for f in sorted(ckpt_dir.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        meta.load_state_dict(sd, strict=True, assign=True)
        del sd
        out["load_s"] = round(time.perf_counter() - t0, 3)
        log(f"{mode}: ordinary loading into private memory took {out['load_s']:.1f} s")
        t0 = time.perf_counter()
        module = OffloadedTransformer(meta, OffloadConfig.layerwise(progress=False), device=dev)
        out["setup_s"] = round(time.perf_counter() - t0, 3)
        stats = module.stats()
    else:
        copy_path = "staging" if "-staging" in mode else "auto"
        module = offload_from_safetensors(meta, ckpt_dir, OffloadConfig.layerwise(progress=False), device=dev,
                                          copy_path=copy_path, staging_threads=staging_threads(mode))
        if cuda:
            torch.cuda.synchronize()
        out["setup_s"] = round(time.perf_counter() - t0, 3)
        out["setup_s_per_gb"] = round(out["setup_s"] / ckpt_gb, 4)
        stats = module.stats()
    if "setup_s" in out:
        log(f"{mode}: setup {out['setup_s']:.2f} s")
    times, first_ms = _timed_steps(module, inputs, steps, warmup, cuda)
    out["step_ms"] = round(statistics.median(times), 3)
    out["step_ms_all"] = [round(t, 3) for t in times]
    out["first_steps_ms"] = round(first_ms, 1)
    if stats:
        out["streamed_bytes"] = int(stats["streamed_bytes_per_step"])
        keep = ("direct_blocks", "staged_blocks", "registered_bytes", "registration_chunks", "register_flags",
                "open_s", "bind_s", "resident_load_s", "store_s", "copies_per_step", "staging_bytes",
                "staging_kind", "staging_threads", "staging_packs", "staging_wait_s", "staging_pack_s", "pinned_bytes", "host_bytes")
        out["stats"] = {k: stats[k] for k in keep if k in stats}
        after = module.stats()  # the packer's counters once the steps ran: where staging spends its time
        if after.get("staging_packs"):
            mean_block = after["streamed_bytes_per_step"] / max(after.get("blocks_streamed", 1), 1)
            out["staging_after_steps"] = {
                k: after[k] for k in ("staging_packs", "staging_pack_s", "staging_wait_s") if k in after}
            if after.get("staging_pack_s"):
                out["staging_pack_gbps"] = round(after["staging_packs"] * mean_block / after["staging_pack_s"] / 1e9, 2)
    log(f"{mode}: median step {out['step_ms']:.1f} ms over {steps} steps ({warmup} warm-up, "
        f"first {first_ms:.0f} ms)")
    if cuda:
        from perf.common import measure_h2d_gbps

        out["peak_device_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 3)
        del module
        torch.cuda.empty_cache()
        out["h2d_gbps"] = round(measure_h2d_gbps(dev)[0], 2)
        out["gpu"] = torch.cuda.get_device_name(dev)
    out["torch"] = torch.__version__
    out["ok"] = True
    return out


# ------------------------------------------------------------------ parent


def spawn(mode: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", mode, "--ckpt-dir", str(args.ckpt_dir),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]
    if args.tiny:
        cmd.append("--tiny")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log(f"{mode}: starting a fresh process")
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, timeout=args.mode_timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "ok": False, "error": f"timed out after {args.mode_timeout} s"}
    result = None
    for line in proc.stdout.splitlines():
        if MARK in line:
            result = json.loads(line)
        elif line.strip():
            print(line, file=sys.stderr, flush=True)
    if result is None:
        result = {"mode": mode, "ok": False, "error": f"exit status {proc.returncode}, no result line"}
    log(f"{mode}: {'done' if result.get('ok') else 'FAILED: ' + result.get('error', '')} "
        f"in {time.perf_counter() - t:.1f} s")
    return result


def assemble(workers: dict, commit: str, dirty: bool, fs: str, ckpt_gb: float) -> dict:
    from perf.results import floor_ms

    ok = {m: w for m, w in workers.items() if w.get("ok")}
    rates = [w["h2d_gbps"] for w in ok.values() if w.get("h2d_gbps")]
    h2d = round(max(rates), 2) if rates else None  # one floor: the best H2D of the run
    resident_ms = ok.get("resident", {}).get("step_ms")
    pinned_ms = ok.get("layerwise", {}).get("step_ms")
    modes = {}
    for m, w in ok.items():
        f = {"step_ms": w["step_ms"], "step_ms_all": w["step_ms_all"]}
        for k in ("setup_s", "setup_s_per_gb", "load_s", "build_s", "peak_device_gb", "first_steps_ms", "stats",
                  "staging_after_steps", "staging_pack_gbps"):
            if k in w:
                f[k] = w[k]
        if m != "resident":
            streamed = w.get("streamed_bytes")
            base = resident_ms if resident_ms is not None else 0.0
            fl = floor_ms(base, streamed, h2d) if (streamed and h2d) or resident_ms else None
            if fl:
                f["floor_ms"] = round(fl, 3)
                f["ratio_to_floor"] = round(w["step_ms"] / fl, 4)
            if streamed:
                f["streamed_gb"] = round(streamed / 1e9, 3)
            if resident_ms:
                f["ratio_to_resident"] = round(w["step_ms"] / resident_ms, 4)
            if pinned_ms and m != "layerwise":
                f["ratio_to_pinned"] = round(w["step_ms"] / pinned_ms, 4)
        modes[m] = f
    first = next(iter(ok.values()), {})
    result = {
        "scenario": SCENARIO, "gpu": first.get("gpu", "cpu"), "gpus": 1 if first.get("gpu") else 0,
        "commit": commit, "dirty": dirty, "torch": first.get("torch", "unknown"),
        "date": datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "h2d_gbps": h2d, "model_gb": round(ckpt_gb, 6), "source": "mmap", "checkpoint_fs": fs,
        "modes": modes,
    }
    failed = {m: w.get("error", "failed") for m, w in workers.items() if not w.get("ok")}
    if failed:
        result["failed"] = failed
    return result


def verdicts(result: dict) -> list[str]:
    lines = []
    modes = result["modes"]
    for m in modes:
        target = target_of(m)
        r = modes[m].get("ratio_to_pinned")
        if r is not None and target is not None:
            lines.append(f"{m}: step {r:.3f}x pinned (target <= {target}) {'PASS' if r <= target else 'MISS'}")
    s = modes.get("layerwise-mmap", {}).get("setup_s_per_gb")
    if s is not None:
        lines.append(f"layerwise-mmap: setup {s:.3f} s/GB (target < {SETUP_TARGET_S_PER_GB}) "
                     f"{'PASS' if s < SETUP_TARGET_S_PER_GB else 'MISS'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python perf/bench_mmap.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/flux-ckpt"), help="default: %(default)s")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES), help="default: %(default)s")
    p.add_argument("--shard-gb", type=float, default=5.0, help="checkpoint shard size (default: %(default)s)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tiny", action="store_true", help="toy-sized Flux (the whole flow on a CPU in seconds)")
    p.add_argument("--out", type=Path, default=REPO / "perf" / "results")
    p.add_argument("--mode-timeout", type=float, default=300.0)
    p.add_argument("--touch-gb", type=float, default=None,
                   help="touch this much host memory first (default: 2 x model size, 0 with --tiny)")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args._worker:
        try:
            res = run_worker(args._worker, args.ckpt_dir, args.steps, args.warmup, args.device, args.tiny)
        except Exception as e:  # reported to the parent; the traceback goes to stderr
            import traceback

            traceback.print_exc()
            res = {"mode": args._worker, "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps({"_bench_mmap": 1, **res}), flush=True)
        return 0 if res.get("ok") else 1
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if not known_mode(m)]
    if unknown:
        p.error(f"unknown modes {unknown}; allowed: {', '.join(MODES)}, layerwise-mmap-staging-t<N>")

    from perf.common import git_commit
    from perf.harness import Clock, touch_host_memory
    from perf.results import gpu_slug, validate_result

    commit, dirty = git_commit()
    log(f"bench_mmap: modes {','.join(modes)}; {args.warmup} warm-up + {args.steps} timed steps; "
        f"commit {commit[:12]}{' (dirty)' if dirty else ''}; device {args.device}")
    touch = args.touch_gb if args.touch_gb is not None else (0.0 if args.tiny else 48.0)
    touch_host_memory(touch, Clock())
    write_checkpoint(args.ckpt_dir, args.tiny, args.shard_gb)
    fs = fs_type(args.ckpt_dir)
    log(f"checkpoint filesystem: {fs}")
    ckpt_gb = warm_page_cache(args.ckpt_dir)
    workers = {m: spawn(m, args) for m in modes}
    result = assemble(workers, commit, dirty, fs, ckpt_gb)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{SCENARIO}-mmap-{gpu_slug(result['gpu'])}-{commit[:12]}.json"
    try:
        validate_result(result)
    except ValueError as e:
        log(f"result does not validate: {e}")
    path.write_text(json.dumps(result, indent=1) + "\n")
    for m, f in result["modes"].items():
        extra = "".join(f", {k} {f[k]}" for k in ("floor_ms", "ratio_to_floor", "ratio_to_pinned", "setup_s",
                                                  "setup_s_per_gb") if k in f)
        log(f"{m}: step {f['step_ms']:.1f} ms{extra}")
    for line in verdicts(result):
        log(line)
    for m, err in (result.get("failed") or {}).items():
        log(f"{m}: FAILED {err}")
    print(f"result: {path}", flush=True)
    return 0 if not result.get("failed") else 1


if __name__ == "__main__":
    raise SystemExit(main())
