"""Distributed layerwise offload (DLO) on N GPUs: a Flux.1-sized DiT at 1024x1024, DP=N.

    python perf/bench_dlo.py [--nproc 2[,4,8]] [--modes resident,dlo-allgather,dlo-rank-local[,layerwise]]
    torchrun --nproc-per-node N perf/bench_dlo.py ...     (one N; without torchrun it starts the ranks itself)

One request per rank (DP=N, NCCL, one process per GPU). ``--nproc 2,4,8``
runs each N in turn, each in fresh processes on the first N GPUs with its own
resident step, writes one result file per N and prints the scaling table of
README.md (an N with more ranks than GPUs is skipped and named). Exit code:
0 when every N ran and met its targets (or has none, --tiny), 1 when one
missed them or failed, 3 when an N was skipped for want of GPUs. The random-weight
FluxTransformer2DModel (diffusers defaults, guidance_embeds=True, bf16,
11.9 B parameters) is built on the meta device and filled on the GPU with the
same seed on every rank; DLO packs its host store from those GPU weights and
``disable()`` gives them back for the next mode. Reported per mode: median
step time over ``--steps`` steps after ``--warmup`` (CUDA events; the slowest
rank counts, since a DP wave moves at its pace), pinned host GB per rank,
bit-exactness against the resident step, and the floor (one definition for
every bench, perf/common.py):

    max(resident, bytes each rank copies host -> device / H2D)

(a 1/N shard per rank under AllGather; the all-gather runs over NVLink beside
the copies, so it adds no serial term). H2D GB/s: the best of 1 GiB pinned
copies, all ranks at once, on the slowest rank. All-gather GB/s (reported, not
in the floor): output bytes / time of an all_gather_into_tensor with a 700 MB
output (``allgather_gbps``), and NCCL's bus bandwidth, that times (N - 1) / N
(``allgather_busbw_gbps``). Targets (issue 17), per N:
N = 2: AllGather step <= 1.1 x floor, pinned per rank <= 0.51 x model;
N >= 4: step <= 1.05 x resident, pinned per rank <= 1/N + 0.01 x model
(0.26 at 4, 0.13 at 8, rounded down to 2 places).
``dlo-allgather-coded`` (issue 14): AllGather of losslessly coded shards
(``weight_codec="exp-k"``: each rank copies its share of the coded image, the
gather moves coded bytes, each rank decodes); ``-coded2`` / ``-codedp``: the
same with ``exp-k2`` / ``exp-kp``; ``-codedauto``: ``weight_codec="auto"`` (the ranks
plan together after the first warm-up step and code only the blocks the link
needs: ``coded_blocks`` and the plan in ``codec_plan``; needs ``--warmup`` >= 2,
so the timed steps run on the coded shares). ``--num-slots`` sets the device block slots
(recorded as ``num_slots``); ``--profile-dir`` adds rank 0's profile of two more
steps per offloaded mode (``profile_rank0``: copy lane, kernel ms per class --
nccl, decode, other -- and per stream). A run with it fills every weight
matrix Student-t (df=4, std 0.02, ``weightstream.fills``, as perf/modes.py's
coded modes: exponent statistics like trained weights) for all its modes. It
reports ``coded_bytes`` / ``bits_per_weight`` / ``coded_ratio``, its
``ratio_to_floor`` against the UNCODED floor (raw shard bytes / H2D: below 1.0
beats any uncoded stream) beside ``coded_floor_ms``, and issue 14's target
(step <= 1.10 x resident) as ``targets.coded_met``.
Writes perf/results/flux-12b-1024-<gpu-slug>-x<N>-<commit>.json (rank 0);
``WEIGHTSTREAM_COMMIT`` names the commit where the tree has no .git.
``--tiny`` runs a tiny Flux on CPU ranks over gloo (a smoke test of every
path, the all-gather measurement with a 16 MB output; writes result files only
with --out).
"""
from __future__ import annotations

import os

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python perf/bench_dlo.py`
    sys.path.insert(0, str(REPO))

SCENARIO = "flux-12b-1024"
MODES = ("resident", "dlo-allgather", "dlo-rank-local", "layerwise", "dlo-allgather-coded", "dlo-allgather-coded2",
         "dlo-allgather-codedp", "dlo-allgather-codedauto")
CODED_MODES = {"dlo-allgather-coded": "exp-k", "dlo-allgather-coded2": "exp-k2",
               "dlo-allgather-codedp": "exp-kp", "dlo-allgather-codedauto": "auto"}  # their runs fill Student-t
CODED_TARGET = 1.10  # issue 14: 2x H200, coded AllGather step <= 1.10 x resident
FLUX_12B = dict(guidance_embeds=True)  # FluxTransformer2DModel defaults are Flux.1-dev sized
FLUX_TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                 axes_dims_rope=(4, 6, 6))
GiB = 1 << 30
GATHER_BYTES, GATHER_BYTES_TINY = 700_000_000, 16_000_000


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python perf/bench_dlo.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--modes", default="resident,dlo-allgather,dlo-rank-local",
                   help=f"comma list from {', '.join(MODES)} (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (>= 5 for a result)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", default="2", help="ranks to start when not under torchrun: N or a list, e.g. 2,4,8")
    p.add_argument("--tiny", action="store_true", help="tiny Flux on CPU ranks (gloo): a smoke test")
    p.add_argument("--out", default=None, help="result folder (default: perf/results; none with --tiny)")
    p.add_argument("--num-slots", type=int, default=2, help="device block slots of the offloaded modes (>= 2)")
    p.add_argument("--plan-h2d-gbps", type=float, default=None,
                   help="the auto mode plans with this link rate instead of the measured one (what a slower or "
                        "faster link would code; recorded in codec_plan.h2d_gbps)")
    p.add_argument("--profile-dir", default=None,
                   help="after each offloaded mode's timed steps, 2 more under torch.profiler on rank 0: lanes, "
                        "kernel time per class and stream (perf/lanes.py) into the result and this folder")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes {','.join(bad)} is not allowed; choose from: {', '.join(MODES)}")
    if "resident" not in modes:
        modes.insert(0, "resident")  # every floor needs the resident step
    args.modes = modes
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.plan_h2d_gbps is not None and not args.plan_h2d_gbps > 0:
        p.error(f"--plan-h2d-gbps {args.plan_h2d_gbps} is not allowed; allowed: a number > 0")
    if "dlo-allgather-codedauto" in args.modes and args.warmup < 2:
        p.error(f"--warmup {args.warmup} is not allowed with dlo-allgather-codedauto; allowed: >= 2 (the first step "
                "is measured and planned, the blocks coded after it)")
    if args.num_slots < 2:
        p.error(f"--num-slots {args.num_slots} is not allowed; choose an integer >= 2")
    if args.profile_dir and args.tiny:
        p.error("--profile-dir needs CUDA ranks (not --tiny)")
    try:
        args.nproc = parse_nproc(args.nproc)
    except ValueError as e:
        p.error(str(e))
    args.summary = None  # set by main(): where rank 0 also writes its result
    return args


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

    from weightstream.offload.distributed import _all_gather_tensor_fn

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
    from weightstream.offload.distributed import ParallelConfig

    clock, device, cuda = ctx["clock"], ctx["device"], ctx["cuda"]
    transfer = {"dlo-allgather": "allgather", "dlo-rank-local": "rank-local",
                **{m: "allgather" for m in CODED_MODES}}.get(mode)
    codec = CODED_MODES.get(mode, "none")
    cfg = OffloadConfig.layerwise(weight_transfer=transfer, weight_codec=codec, num_slots=args.num_slots,
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


def rank_main(args, rank: int, world: int, local: int) -> int:
    import torch
    import torch.distributed as dist

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
            write(result, args, clock)
            if args.summary:
                Path(args.summary).write_text(json.dumps(result))
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

    from perf.results import floor_ms

    from perf.common import git_commit

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
        "weight_fill": "student-t" if any(m in CODED_MODES for m in args.modes) else "normal",
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


def write(result: dict, args, clock: Clock) -> None:
    from perf.results import gpu_slug, validate_result

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
    out = args.out or (None if args.tiny else str(REPO / "perf" / "results"))
    if out is None:
        print(json.dumps(result, indent=1), flush=True)
        return
    name = f"{result['scenario']}-{gpu_slug(result['gpu'])}-x{result['gpus']}-{result['commit'][:12]}.json"
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    clock.log(f"wrote {path}")


# --------------------------------------------------------------------------- launch
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.exit(rank_main(args, rank, world, rank))


def run_world(args, world: int) -> tuple[int, dict | str]:
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
    with tempfile.TemporaryDirectory() as tmp:
        args.summary = os.path.join(tmp, "result.json")
        procs = [ctx.Process(target=_spawned, args=(r, world, port, args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        code = max((p.exitcode if p.exitcode is not None else 1) for p in procs)
        if not os.path.exists(args.summary):
            return max(code, 1), f"failed: no result (exit codes {[p.exitcode for p in procs]})"
        return code, json.loads(Path(args.summary).read_text())


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
    """README's "DLO scaling" table (markdown): one row per N from its result, or why it has none."""
    head = ("| N | resident | DLO AllGather | x resident | x floor | pinned per rank | host per rank | setup | "
            "bit-exact | all-gather (bus) |")
    lines = [head, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for n in sorted(results):
        res = results[n]
        if isinstance(res, str):
            lines.append(f"| {n} | {res} |" + " |" * 8)
            continue
        ag, res_fig = res["modes"].get("dlo-allgather"), res["modes"].get("resident")
        pinned, host = (_per_rank(ag, "pinned_host_gb_per_rank", "pinned_fraction"),
                        _per_rank(ag, "host_gb_per_rank", "host_fraction"))
        bus, alg = res.get("allgather_busbw_gbps"), res.get("allgather_gbps")
        if bus is None and alg:  # results before the bus figure: NCCL's (N - 1) / N of the output rate
            bus = alg * (n - 1) / n
        backend = res.get("allgather_backend", "gloo" if res.get("gpu") == "cpu" else "nccl")
        lines.append(
            f"| {n} | {_cell(res_fig, 'step_ms', '.1f')} ms | {_cell(ag, 'step_ms', '.1f')} ms | "
            f"{_cell(ag, 'ratio_to_resident', '.3f')} | {_cell(ag, 'ratio_to_floor', '.3f')} | {pinned} | {host} | "
            f"{_cell(ag, 'setup_s', '.1f')} s | {_cell(ag, 'bit_exact', '')} | "
            f"{'' if bus is None else f'{bus:.3g} GB/s {backend}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return rank_main(args, rank, world, int(os.environ.get("LOCAL_RANK", rank)))
    codes, results = [], {}
    for world in args.nproc:
        code, results[world] = run_world(args, world)
        codes.append(code)
        if isinstance(results[world], str):
            print(f"N={world}: {results[world]}", flush=True)
    print("\nDLO scaling, " + SCENARIO + ("-tiny (CPU, gloo)" if args.tiny else "") + ":", flush=True)
    print(scaling_table(results), flush=True)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
