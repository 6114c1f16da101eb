"""DLO modes of `python -m perf run`: distributed layerwise offload on N GPUs, DP=N.

    python -m perf run --scenario flux-12b-1024 --modes dlo-allgather,dlo-rank-local --nproc 2[,4,8]
        [--num-slots 3] [--plan-h2d-gbps R] [--profile-dir DIR] [--tiny]
    torchrun --nproc-per-node N -m perf run --scenario flux-12b-1024 --modes ...   (one N)

A Flux.1-sized DiT at 1024x1024 (random weights generated on each GPU with
the same seed; Student-t, df=4, when a coded mode runs), one request per rank
(NCCL, one process per GPU). Each N runs in fresh processes on the first N
GPUs with its own resident step and files one result,
``flux-12b-1024-<gpu>-x<N>.json`` (merged like every result file); an N with
more ranks than GPUs is skipped and named in the scaling table. Exit code: 0
when every N ran and met its targets (or has none), 1 when one missed them or
failed, 3 when an N was skipped. Per mode: the median step (the slowest rank),
pinned host bytes per rank, bit-exactness against the resident step, and the
floor max(resident, bytes each rank copies H2D / H2D rate): a 1/N shard under
AllGather, whose all-gather runs over NVLink beside the copies. Coded modes
(``dlo-allgather-coded``, ``-coded2``, ``-codedp``, ``-codedauto``) take their
``ratio_to_floor`` against the UNCODED floor (``coded_floor_ms`` beside it).
``allgather_gbps``: output bytes / time of a 700 MB all_gather_into_tensor,
``allgather_busbw_gbps``: NCCL's bus figure. Targets: ``targets_for`` (issue
17) and ``CODED_TARGET`` (issue 14). ``--profile-dir``: rank 0 profiles two
more steps per offloaded mode (``profile_rank0``, perf/lanes.py). ``--tiny``:
a tiny Flux on CPU ranks over gloo (16 MB all-gather), every path in seconds.
"""
from __future__ import annotations

import datetime
import gc
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from weightstream.checkout import safe_path

SCENARIO = "flux-12b-1024"
MODES = ("resident", "dlo-allgather", "dlo-rank-local", "layerwise", "dlo-allgather-coded", "dlo-allgather-coded2",
         "dlo-allgather-codedp", "dlo-allgather-codedauto")
DEFAULT_MODES = ("resident", "dlo-allgather", "dlo-rank-local")
CODED_MODES = {"dlo-allgather-coded": "exp-k", "dlo-allgather-coded2": "exp-k2",
               "dlo-allgather-codedp": "exp-kp", "dlo-allgather-codedauto": "auto"}  # their runs fill Student-t
CODED_TARGET = 1.10  # issue 14: 2x H200, coded AllGather step <= 1.10 x resident
FLUX_12B = dict(guidance_embeds=True)  # FluxTransformer2DModel defaults are Flux.1-dev sized
FLUX_TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                 axes_dims_rope=(4, 6, 6))
GATHER_BYTES, GATHER_BYTES_TINY = 700_000_000, 16_000_000
# NVLink multicast off (NCCL NVLS, torch symmetric memory, NVSHMEM): set for the ranks before NCCL starts
NCCL_ENV = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))


def is_dlo_mode(mode: str) -> bool:
    return mode.startswith("dlo-")


def _nccl_env() -> None:
    for key, value in NCCL_ENV:
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class DloRun:
    """What every rank of a DLO run needs (pickled to the spawned ranks)."""
    modes: tuple[str, ...]
    steps: int = 5
    warmup: int = 2
    tiny: bool = False
    num_slots: int = 2
    plan_h2d_gbps: float | None = None
    profile_dir: str | None = None


def dlo_run(modes, *, steps: int = 5, warmup: int = 2, tiny: bool = False, num_slots: int = 2,
            plan_h2d_gbps: float | None = None, profile_dir: str | None = None) -> DloRun:
    """Validated options of a DLO run (``resident`` first, added when not asked for: every floor
    needs it); ValueError naming the option, its value and what is allowed."""
    modes = [m for m in modes if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--modes {','.join(bad)} is not allowed with DLO modes; choose from: {', '.join(MODES)}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got steps={steps} warmup={warmup}")
    if plan_h2d_gbps is not None and not plan_h2d_gbps > 0:
        raise ValueError(f"--plan-h2d-gbps {plan_h2d_gbps} is not allowed; allowed: a number > 0")
    if "dlo-allgather-codedauto" in modes and warmup < 2:
        raise ValueError(f"--warmup {warmup} is not allowed with dlo-allgather-codedauto; allowed: >= 2 (the first "
                         "step is measured and planned, the blocks coded after it)")
    if num_slots < 2:
        raise ValueError(f"--num-slots {num_slots} is not allowed; choose an integer >= 2")
    if profile_dir and tiny:
        raise ValueError("--profile-dir needs CUDA ranks (not --tiny)")
    modes = ["resident"] + [m for m in modes if m != "resident"]
    return DloRun(tuple(modes), steps, warmup, tiny, num_slots, plan_h2d_gbps, profile_dir)


def targets_for(world: int) -> dict:
    """Issue 17's targets at ``world`` ranks: which ratio, its maximum, and the largest
    per-rank pinned fraction of the model. At N = 2 streaming is link-bound (floor above
    resident), from N = 4 the floor is the resident step itself."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 2:
        raise ValueError(f"world={world!r}: DLO targets are defined for an integer of ranks >= 2")
    pinned = math.floor((1 / world + 0.01) * 100 + 1e-9) / 100
    if world == 2:
        return {"ratio": "ratio_to_floor", "ratio_max": 1.1, "pinned_fraction_max": pinned}
    return {"ratio": "ratio_to_resident", "ratio_max": 1.05, "pinned_fraction_max": pinned}


def parse_nproc(text: str) -> list[int]:
    """'2,4,8' -> [2, 4, 8] (each >= 1, no repeats)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--nproc {text!r}: allowed a comma list of distinct rank counts >= 1, e.g. 2 or 2,4,8")
    return values


class Clock:
    def __init__(self, rank: int):
        self.rank, self.t0 = rank, time.perf_counter()

    def log(self, msg: str, all_ranks: bool = False) -> None:
        if self.rank == 0 or all_ranks:
            print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - self.t0:6.1f}s rank {self.rank}] {msg}",
                  flush=True)


# --------------------------------------------------------------------------- model
def build_model(cfg: dict, device, seed: int = 0, weight_fill: str = "normal"):
    """FluxTransformer2DModel on ``device`` with N(0, 0.02) weights (``weight_fill="student-t"``:
    Student-t, df=4, std 0.02), zero biases and unit norm scales, generated on ``device``
    (meta construction: no CPU init)."""
    if weight_fill not in ("normal", "student-t"):
        raise ValueError(f"weight_fill={weight_fill!r} is not allowed; choose from: normal, student-t")
    import torch
    from diffusers import FluxTransformer2DModel

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    with torch.device("meta"):
        model = FluxTransformer2DModel(**cfg)
    model = model.to(dtype).to_empty(device=device).eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            is_norm = "norm" in type(mod).__name__.lower()
            for name, p in mod.named_parameters(recurse=False):
                if name == "bias":
                    p.zero_()
                elif is_norm and name == "weight":
                    p.fill_(1)
                elif weight_fill == "student-t":
                    _student_t_(p, gen)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    if list(model.buffers()):
        raise RuntimeError("this Flux version has buffers, which meta construction leaves uninitialised")
    return model


def _student_t_(p, gen, chunk: int = 1 << 26) -> None:
    """``p`` <- Student-t (df=4) scaled to std 0.02, in chunks (bounded scratch memory)."""
    from weightstream.fills import fill

    flat = p.view(-1)
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        flat[start:start + n].copy_(fill("student-t", (n,), dtype=p.dtype, generator=gen, device=p.device,
                                         scale=0.02))


def model_inputs(model, device, rank: int, tiny: bool):
    from weightstream.models import flux_inputs

    tokens, text = (16, 8) if tiny else (4096, 512)
    return flux_inputs(model, image_tokens=tokens, text_tokens=text, device=device, seed=1 + rank)


# --------------------------------------------------------------------------- timing
def measure_h2d(device, cuda: bool, dist) -> float:
    """Best GB/s of 1 GiB pinned host -> device copies, every rank at once."""
    if not cuda:
        return 0.0
    from perf.common import measure_h2d_gbps

    return measure_h2d_gbps(device, reps=5, barrier=dist.barrier)[0]


def _steps(fn, n: int, cuda: bool) -> list[float]:
    from perf.common import timed_steps

    return timed_steps(fn, n, 0, cuda).ms


def measure_allgather(device, cuda: bool, dist, world: int, out_bytes: int) -> float:
    """Output GB/s of all_gather_into_tensor with a ``out_bytes`` output (median of 5)."""
    import torch

    from weightstream.offload.sources.dlo import _all_gather_tensor_fn

    gather = _all_gather_tensor_fn()
    shard = out_bytes // world
    bufs = {"inp": torch.ones(shard, dtype=torch.uint8, device=device),
            "out": torch.empty(shard * world, dtype=torch.uint8, device=device)}
    gather(bufs["out"], bufs["inp"])
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    times = _steps(lambda: gather(bufs["out"], bufs["inp"]), 5, cuda)
    bufs.clear()
    return shard * world / (statistics.median(times) / 1e3) / 1e9


# --------------------------------------------------------------------------- modes
def run_mode(mode, model, inputs, ref, args, ctx):
    """Time one offloaded mode; return (figures, model with its weights back on the device)."""
    import torch
    import torch.distributed as dist

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.offload.dlo.topology import ParallelConfig

    clock, device, cuda = ctx["clock"], ctx["device"], ctx["cuda"]
    transfer = {"dlo-allgather": "allgather", "dlo-rank-local": "rank-local",
                **{m: "allgather" for m in CODED_MODES}}.get(mode)
    codec = CODED_MODES.get(mode, "none")
    cfg = OffloadConfig.layerwise(weight_transfer=transfer, weight_codec=codec, num_slots=args.num_slots,
                                  resident_layers=0,  # every block streamed, as named (not the planned default)
                                  progress=ctx["rank"] == 0)
    dist.barrier()
    t0 = time.perf_counter()
    if transfer is None:
        om = OffloadedTransformer(model, cfg, device=device)
    else:
        om = OffloadedTransformer(model, cfg, device=device, parallel=ParallelConfig.data_parallel())
    setup_s = time.perf_counter() - t0
    if args.plan_h2d_gbps is not None and om._streamed.codec_planner is not None:
        om._streamed.codec_planner.h2d_gbps = args.plan_h2d_gbps  # plan as if the link ran at this rate
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    clock.log(f"{mode}: set up in {setup_s:.1f} s; warm-up {args.warmup} + {args.steps} steps")
    with torch.no_grad():
        for _ in range(args.warmup):
            out = om(**inputs)[0]
        settle = 0
        while om.stats().get("coding_in_background") and settle < 2000:  # auto, rank-local: wait for the coded
            out, settle = om(**inputs)[0], settle + 1  # blocks (AllGather codes at once: never here)
        if settle:
            clock.log(f"{mode}: {settle} more untimed steps while the blocks were coded in the background")
        dist.barrier()
        last = {"om": om}
        times = _steps(lambda: last.__setitem__("out", last["om"](**inputs)[0]), args.steps, cuda)
    exact = bool(torch.equal(last["out"], ref))
    prof = _profile(mode, lambda: om(**inputs), args, ctx) if args.profile_dir else None
    s = om.stats()
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None
    t0 = time.perf_counter()
    model = om.disable()  # a collective with AllGather; the full weights are back on the device
    restore_s = time.perf_counter() - t0
    last.clear()
    del om, out
    gc.collect()  # the host store (and its registration) goes with the backend's reference cycles
    if cuda:
        torch.cuda.empty_cache()
    fig = dict(
        step_ms=statistics.median(times), step_ms_all=[round(t, 3) for t in times], bit_exact=exact,
        pinned_host_gb_per_rank=s["pinned_bytes"] / 1e9, host_gb_per_rank=s["host_bytes"] / 1e9,
        model_gb=s.get("model_bytes", s["streamed_bytes_per_step"] + s["resident_bytes"]) / 1e9,
        streamed_gb=s["streamed_bytes_per_step"] / 1e9,
        h2d_gb_per_rank=s.get("h2d_bytes_per_step", s["streamed_bytes_per_step"]) / 1e9,
        shard_group_size=s.get("shard_group_size", 1), setup_s=setup_s, restore_s=restore_s,
        peak_device_gb=peak, pin_failure=s["pin_failure"],
    )
    fig.update({k: s[k] for k in ("coded_bytes", "bits_per_weight", "coded_ratio", "coded_blocks") if k in s})
    if s.get("codec_plan"):  # weight_codec="auto": what the ranks planned together, and its prediction
        fig["codec_plan"] = {k: s["codec_plan"][k] for k in ("codec", "coded_blocks", "predicted_ms", "uncoded_ms",
                                                             "compute_ms", "h2d_gbps", "decode_gbps", "plan_s")}
    if prof is not None:
        fig["profile"] = prof
    clock.log(f"{mode}: median {fig['step_ms']:.1f} ms/step (rank {ctx['rank']}), bit-exact {exact}, pinned "
              f"{fig['pinned_host_gb_per_rank']:.2f} GB of {fig['model_gb']:.2f} GB", all_ranks=True)
    return fig, model


def _profile(mode, run, args, ctx) -> dict | None:
    """Two more steps, every rank alike (collectives); rank 0 runs them under torch.profiler and
    returns the lanes without their gap lists (perf/lanes.py; the full summary is in the folder)."""
    import torch.distributed as dist

    from perf.lanes import profile_steps

    dist.barrier()
    if ctx["rank"] != 0:
        for _ in range(2):
            run()
        return None
    s = profile_steps(run, 2, args.profile_dir, f"dlo-{mode}-slots{args.num_slots}", keep_trace=False)
    return {k: v for k, v in s.items() if k not in ("gaps", "gaps_in_time_order")}


def rank_main(args: "DloRun", rank: int, world: int, local: int, summary: str | None = None) -> int:
    """One rank: the H2D and all-gather rates, the resident step, then each mode; rank 0 writes
    the assembled result to ``summary`` (JSON) for the process that started the ranks."""
    import torch
    import torch.distributed as dist

    _nccl_env()
    clock = Clock(rank)
    cuda = not args.tiny
    if cuda:
        if torch.cuda.device_count() <= local:
            print(f"rank {rank}: needs GPU {local}, found {torch.cuda.device_count()} (use --tiny on CPU)",
                  file=sys.stderr)
            return 2
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    try:
        clock.log(f"{world} ranks, {'NCCL on ' + torch.cuda.get_device_name(device) if cuda else 'gloo on CPU'}, "
                  f"torch {torch.__version__}")
        ctx = dict(clock=clock, device=device, cuda=cuda, rank=rank)
        h2d = measure_h2d(device, cuda, dist)
        gather_bytes = GATHER_BYTES if cuda else GATHER_BYTES_TINY
        ag = measure_allgather(device, cuda, dist, world, gather_bytes)
        clock.log(f"H2D {h2d:.1f} GB/s per rank (1 GiB pinned, all ranks at once); all-gather {ag:.1f} GB/s "
                  f"({gather_bytes / 1e6:.0f} MB output)", all_ranks=True)
        t0 = time.perf_counter()
        fill = "student-t" if any(m in CODED_MODES for m in args.modes) else "normal"
        model = build_model(FLUX_TINY if args.tiny else FLUX_12B, device, weight_fill=fill)
        inputs = model_inputs(model, device, rank, args.tiny)
        if cuda:
            torch.cuda.synchronize()
        clock.log(f"built the random-weight Flux on {device} in {time.perf_counter() - t0:.1f} s")
        with torch.no_grad():
            for _ in range(max(args.warmup, 1)):
                ref = model(**inputs)[0]
            dist.barrier()
            res_times = _steps(lambda: model(**inputs)[0], args.steps, cuda)
        per_rank = {"resident": dict(step_ms=statistics.median(res_times),
                                     step_ms_all=[round(t, 3) for t in res_times])}
        clock.log(f"resident: median {per_rank['resident']['step_ms']:.1f} ms/step", all_ranks=True)
        failed = {}
        for mode in args.modes:
            if mode == "resident":
                continue
            try:
                per_rank[mode], model = run_mode(mode, model, inputs, ref, args, ctx)
            except Exception as e:  # a failed mode is reported; the others still run
                failed[mode] = f"{type(e).__name__}: {e}"
                clock.log(f"{mode} failed: {failed[mode]}", all_ranks=True)
                break  # the weights may be gone with it
        everyone = [None] * world
        dist.all_gather_object(everyone, dict(modes=per_rank, failed=failed, h2d=h2d, ag=ag))
        if rank == 0:
            result = assemble(args, everyone, world, torch.cuda.get_device_name(device) if cuda else "cpu")
            report(result, clock)
            if summary:
                Path(summary).write_text(json.dumps(result))
            return 0 if result["targets"]["met"] is not False and not result.get("failed") else 1
        return 0
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- result
def targets_met(fig: dict | None, targets: dict | None) -> bool | None:
    """AllGather's figures against ``targets_for(N)`` (None: nothing to judge)."""
    if not fig or not targets:
        return None
    return bool(fig[targets["ratio"]] <= targets["ratio_max"]
                and fig["pinned_fraction"] <= targets["pinned_fraction_max"]
                and fig["bit_exact"])


def assemble(args, everyone: list[dict], world: int, gpu: str) -> dict:
    import torch

    from perf.common import git_commit
    from perf.results import floor_ms

    h2d = min(e["h2d"] for e in everyone)
    ag = min(e["ag"] for e in everyone)
    resident = max(e["modes"]["resident"]["step_ms"] for e in everyone)
    modes = {"resident": {"step_ms": round(resident, 3),
                          "step_ms_per_rank": [round(e["modes"]["resident"]["step_ms"], 3) for e in everyone]}}
    for mode in args.modes:
        figs = [e["modes"].get(mode) for e in everyone]
        if mode == "resident" or any(f is None for f in figs):
            continue
        f0 = figs[0]
        if h2d > 0:
            # one floor definition (perf/common.py): each rank's link carries its own H2D bytes
            # (a 1/N shard under AllGather) at the best rate measured on the slowest rank; the
            # all-gather runs over NVLink beside the copies, so it is no serial term here
            floor = floor_ms(resident, f0["h2d_gb_per_rank"] * 1e9, h2d)
        else:  # CPU smoke test: no link to measure
            floor = resident
        step = max(f["step_ms"] for f in figs)
        modes[mode] = dict(
            step_ms=round(step, 3), floor_ms=round(floor, 3), ratio_to_floor=round(step / floor, 4),
            ratio_to_resident=round(step / resident, 4),
            pinned_host_gb_per_rank=round(max(f["pinned_host_gb_per_rank"] for f in figs), 4),
            pinned_fraction=round(max(f["pinned_host_gb_per_rank"] for f in figs) / f0["model_gb"], 4),
            host_fraction=round(max(f["host_gb_per_rank"] for f in figs) / f0["model_gb"], 4),
            host_gb_per_rank=round(max(f["host_gb_per_rank"] for f in figs), 4),
            model_gb=round(f0["model_gb"], 4), streamed_gb=round(f0["streamed_gb"], 4),
            h2d_gb_per_rank=round(f0["h2d_gb_per_rank"], 4), shard_group_size=f0["shard_group_size"],
            bit_exact=all(f["bit_exact"] for f in figs),
            step_ms_per_rank=[round(f["step_ms"], 3) for f in figs],
            peak_device_gb=None if f0["peak_device_gb"] is None else round(max(f["peak_device_gb"] for f in figs), 3),
            setup_s=round(max(f["setup_s"] for f in figs), 2), restore_s=round(max(f["restore_s"] for f in figs), 2),
        )
        if f0.get("profile"):
            modes[mode]["profile_rank0"] = f0["profile"]
        if f0["pin_failure"]:
            modes[mode]["pin_failure"] = f0["pin_failure"]
        if mode in CODED_MODES:
            modes[mode].update(coded_figures(f0, resident, h2d, world, step))
        if f0.get("codec_plan"):  # weight_codec="auto": the same plan on every rank
            modes[mode]["codec_plan"] = f0["codec_plan"]
            modes[mode]["coded_blocks"] = f0["coded_blocks"]
            modes[mode]["plans_agree"] = len({tuple(f["codec_plan"]["coded_blocks"]) for f in figs}) == 1
    fill = "student-t" if any(m in CODED_MODES for m in args.modes) else "normal"
    for mode, f in modes.items():  # per mode too: a result file merges the modes of several runs
        f["weight_fill"] = fill
        if mode != "resident":  # and the resident step its ratios are to (a merged file's may be newer)
            f.update(num_slots=args.num_slots, resident_ms=round(resident, 3),
                     allgather_busbw_gbps=round(ag * (world - 1) / world, 2) if ag > 0 else None)
    targets = targets_for(world) if world >= 2 else None
    met = targets_met(modes.get("dlo-allgather"), targets) if h2d > 0 else None
    coded = [modes[m] for m in CODED_MODES if m in modes]  # met when one coded mode meets it
    coded_met = None if not coded or h2d <= 0 else any(
        c["ratio_to_resident"] <= CODED_TARGET and c["bit_exact"] for c in coded)
    commit, dirty = git_commit()
    result = {
        "scenario": SCENARIO + ("-tiny" if args.tiny else ""), "gpu": gpu, "gpus": world, "commit": commit,
        "dirty": dirty, "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "h2d_gbps": round(h2d, 2) if h2d > 0 else None, "allgather_gbps": round(ag, 2) if ag > 0 else None,
        "allgather_busbw_gbps": round(ag * (world - 1) / world, 2) if ag > 0 else None,
        "allgather_backend": "gloo" if args.tiny else "nccl",
        "steps": args.steps, "warmup": args.warmup, "num_slots": args.num_slots, "modes": modes,
        "targets": {**(targets or {}), "met": met},
        "weight_fill": fill,
    }
    if coded is not None:
        result["targets"].update(coded_ratio_max=CODED_TARGET, coded_met=coded_met)
    failed = {m: e["failed"][m] for e in everyone for m in e["failed"]}
    if failed:
        result["failed"] = failed
    return result


def coded_figures(f0: dict, resident: float, h2d: float, world: int, step: float) -> dict:
    """A coded mode's figures: coded size, and its ratio to the UNCODED floor (raw bytes / N per
    rank over H2D), which replaces the floor of the coded bytes it moved (kept as coded_floor_ms)."""
    from perf.results import floor_ms

    raw_per_rank = f0["streamed_gb"] * 1e9 / world
    out = {"coded_bytes": int(f0.get("coded_bytes", 0)), "coded_gb": round(f0.get("coded_bytes", 0) / 1e9, 4),
           "bits_per_weight": round(f0.get("bits_per_weight", 0.0), 4),
           "coded_ratio": round(f0.get("coded_ratio", 0.0), 4)}
    if h2d > 0:
        uncoded, coded = floor_ms(resident, raw_per_rank, h2d), floor_ms(resident, f0["h2d_gb_per_rank"] * 1e9, h2d)
        out.update(floor_ms=round(uncoded, 3), ratio_to_floor=round(step / uncoded, 4),
                   coded_floor_ms=round(coded, 3))
    return out


def report(result: dict, clock: Clock) -> None:
    """Rank 0's summary lines: each mode's step against its floor, and the targets' verdict."""
    from perf.results import validate_result

    for mode, f in result["modes"].items():
        extra = "" if mode == "resident" else (
            f", floor {f['floor_ms']:.1f} ms, x{f['ratio_to_floor']:.3f} floor, pinned {f['pinned_host_gb_per_rank']:.2f}"
            f" of {f['model_gb']:.2f} GB per rank, bit-exact {f['bit_exact']}")
        clock.log(f"{mode:15s} {f['step_ms']:8.1f} ms/step{extra}")
    t = result["targets"]
    verdict = "met" if t["met"] else "NOT met" if t["met"] is False else "n/a"
    if "ratio" in t:
        clock.log(f"targets at {result['gpus']} ranks (AllGather {t['ratio']} <= {t['ratio_max']}, pinned per rank "
                  f"<= {t['pinned_fraction_max']} x model): {verdict}")
    try:
        validate_result(result)
    except ValueError as e:
        clock.log(f"result does not validate: {e}")


# --------------------------------------------------------------------------- launch
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, args: "DloRun", summary: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.exit(rank_main(args, rank, world, rank, summary))


def run_world(args: "DloRun", world: int) -> tuple[int, dict | str]:
    """Start ``world`` ranks (fresh processes) and wait; (exit code, rank 0's result or why there is none)."""
    import multiprocessing as mp
    import tempfile

    if not args.tiny:
        import torch

        if torch.cuda.device_count() < world:
            return 3, f"not run: {world} ranks need {world} GPUs, torch sees {torch.cuda.device_count()}"
    if args.tiny:  # CPU ranks: fork them from one process that imported torch and diffusers once
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "weightstream.offload.distributed",
                                    "diffusers.models.transformers.transformer_flux"])
    else:  # CUDA: fresh processes
        ctx = mp.get_context("spawn")
    port = _free_port()
    _nccl_env()  # the ranks inherit it
    with tempfile.TemporaryDirectory() as tmp:
        summary = os.path.join(tmp, "result.json")
        procs = [ctx.Process(target=_spawned, args=(r, world, port, args, summary)) for r in range(world)]
        with safe_path():  # a forkserver starts on the first start(): the checkout's root not first on its path
            for p in procs:
                p.start()
        for p in procs:
            p.join()
        code = max((p.exitcode if p.exitcode is not None else 1) for p in procs)
        if not os.path.exists(summary):
            return max(code, 1), f"failed: no result (exit codes {[p.exitcode for p in procs]})"
        return code, json.loads(Path(summary).read_text())


def run_dlo(args: DloRun, nproc: list[int], out_dir: str | Path | None = None) -> tuple[int, dict, list[Path]]:
    """Each N of ``nproc`` in fresh ranks (under torchrun: this process is one rank of the one N);
    every result is filed in ``out_dir`` (default perf/results; --tiny: a temporary folder),
    merged over the file of its GPU kind. Returns (exit code, {N: result or why none}, paths)."""
    from perf.results import scaling_table, write_result

    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix="weightstream-perf-tiny-") if args.tiny else \
            Path(__file__).resolve().parent / "results"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        with tempfile.TemporaryDirectory() as tmp:
            summary = os.path.join(tmp, "result.json")
            code = rank_main(args, rank, world, int(os.environ.get("LOCAL_RANK", rank)), summary if rank == 0 else None)
            if rank != 0:
                return code, {}, []
            results = {world: json.loads(Path(summary).read_text())}
        codes = [code]
    else:
        codes, results = [], {}
        for world in nproc:
            code, results[world] = run_world(args, world)
            codes.append(code)
            if isinstance(results[world], str):
                print(f"N={world}: {results[world]}", flush=True)
    paths = [write_result(out_dir, res) for res in results.values() if isinstance(res, dict)]
    for path in paths:
        print(f"wrote {path}", flush=True)
    print("\nDLO scaling, " + SCENARIO + ("-tiny (CPU, gloo)" if args.tiny else "") + ":", flush=True)
    print(scaling_table(results), flush=True)
    return max(codes), results, paths
