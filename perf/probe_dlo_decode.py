"""One-GPU proxy of a coded DLO rank's on-device work: the link removed, the decode kept.

    python perf/probe_dlo_decode.py [--modes raw,coded,coded2,graphs-coded] [--steps 5] [--profile-dir D]

Issue 14's DLO target (2x H200, coded AllGather step <= 1.10 x resident) needs two GPUs. What one
GPU can measure is the part of a rank's step that is not NCCL: every rank decodes every block of
the step (23.7 GB of bf16 for flux-12b-1024), beside the compute it overlaps. This probe wraps the
bench_dlo Flux (Student-t weights, one request) layerwise, then moves the source's block store
from host memory to device memory, so each load is a device-to-device copy of the block's bytes
(the coded ones under a codec) and, coded, one decode into the slot on the decode stream. Modes:

- ``raw``: ``weight_codec="none"``, the raw images copied device to device: the ring's own cost;
- ``coded`` / ``coded2`` / ``codedp``: ``exp-k`` / ``exp-k2`` / ``exp-kp``, copy + decode;
- ``graphs-<mode>``: the same with ``cuda_graphs="on"`` (the copies and decodes captured).

``--coded-fraction F`` (coded modes): only that share of the blocks coded, evenly spread, the
others raw (what ``weight_codec="auto"`` leaves when the link needs only part of the step coded:
offload/auto_codec_gather.py under DLO AllGather); the wrap is ``weight_codec="auto"`` with its
planner removed and the blocks coded at once (``code_blocks``).

Per mode: median step, ``ratio_to_resident``, bit-exactness against the resident step, the bytes
copied per step, and with ``--profile-dir`` rank 0's kernel time per class (perf/lanes.py) over
two more steps. ``coded`` minus ``raw`` is what the decode adds to a rank's step; a 2-rank run adds
NCCL's kernels (its gather writes the coded image, half of it from the peer over NVLink) and
halves the H2D. A proxy, not the target: the target is measured by ``perf/bench_dlo.py`` on x2.
Results: ``perf/results/dlodecode-<gpu>-<commit>[-s<slots>].json``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from perf.common import save_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CODECS = {"raw": "none", "coded": "exp-k", "coded2": "exp-k2", "codedp": "exp-kp"}
MODES = tuple(CODECS) + tuple(f"graphs-{m}" for m in CODECS)


def parse_modes(text: str) -> list[str]:
    """'raw,coded' -> ['raw', 'coded'] (each from MODES, no repeats)."""
    modes = [m for m in text.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise ValueError(f"--modes {text!r}: allowed a comma list of distinct modes from: {', '.join(MODES)}")
    return modes


def _moved(host: torch.Tensor, device) -> torch.Tensor:
    """A copy of ``host`` on ``device``. Through an unregistered clone: a store is registered with
    CUDA in pieces, and one copy across two registrations fails ("invalid argument")."""
    return host.clone().to(device)


def store_on(source, device) -> callable:
    """Move ``source``'s block store (a PinnedSource's arena, or a CodedSource's arena and
    backing regions) to ``device``; return the function that puts the host store back.
    Its loads then copy from ``device``: same bytes, same order, no host link."""
    if hasattr(source, "store") and hasattr(source.store, "arena"):  # PinnedSource: HostStore images
        host = source.store.arena
        if any(getattr(source, "staged", [])):
            raise ValueError("store_on: some blocks are staged (pageable), which copies from the stager's "
                             "buffers, not the arena; pin the whole store")
        source.store.arena = _moved(host, device)

        def back():
            source.store.arena = host
        return back
    if hasattr(source, "arena") and hasattr(source, "_backing"):  # CodedSource: arena + read-only regions
        host, backing = source.arena, list(source._backing)
        source.arena = _moved(host, device)
        source._backing = [None if b is None else _moved(b, device) for b in backing]

        def back():
            source.arena, source._backing = host, backing
        return back
    raise TypeError(f"store_on: {type(source).__name__} is not a PinnedSource or CodedSource")


def _mode_config(mode: str, num_slots: int, fraction: float = 1.0):
    from weightstream import OffloadConfig

    base = mode.removeprefix("graphs-")
    codec = CODECS[base] if fraction == 1.0 or base == "raw" else "auto"
    return OffloadConfig.layerwise(weight_codec=codec, num_slots=num_slots,
                                   cuda_graphs="on" if mode.startswith("graphs-") else "off", progress=True)


def spread(n: int, fraction: float) -> list[int]:
    """``round(n * fraction)`` of ``range(n)``, evenly spread (0 < fraction <= 1)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--coded-fraction {fraction!r} is not allowed; allowed: 0 < F <= 1")
    m = max(1, round(n * fraction))
    return sorted({min(n - 1, int((i + 0.5) * n / m)) for i in range(m)})


def code_part(om, mode: str, fraction: float) -> list[int]:
    """With a fraction below 1: remove the auto planner and code ``spread`` blocks at once."""
    base = mode.removeprefix("graphs-")
    if fraction == 1.0 or base == "raw":
        return []
    planner = om._streamed.codec_planner
    planner.remove()
    src = om._streamed.source
    ks = spread(len(src.layouts), fraction)
    src.code_blocks(ks, CODECS[base], progress=True, background=False)
    return ks


def run_mode(mode: str, model, inputs, ref, args, device):
    """(figures, the model with its weights back) of one mode."""
    from perf.common import timed_steps
    from weightstream import OffloadedTransformer

    t0 = time.perf_counter()
    om = OffloadedTransformer(model, _mode_config(mode, args.num_slots, args.coded_fraction), device=device)
    coded_ks = code_part(om, mode, args.coded_fraction)
    setup_s = time.perf_counter() - t0
    source = om._streamed.source  # the probe's one reach inside: where the block store lies
    back = store_on(source, device)
    try:
        with torch.no_grad():
            holder = {}
            t = timed_steps(lambda: holder.__setitem__("out", om(**inputs)[0]), args.steps, args.warmup,
                            device.type == "cuda")
            exact = bool(torch.equal(holder["out"], ref))
            prof = None
            if args.profile_dir:
                from perf.lanes import profile_steps

                s = profile_steps(lambda: om(**inputs), 2, args.profile_dir, f"dlodecode-{mode}-s{args.num_slots}",
                                  keep_trace=args.keep_trace)
                prof = {k: v for k, v in s.items() if k not in ("gaps", "gaps_in_time_order")}
    finally:
        back()
    s = om.stats()
    model = om.disable()
    del om
    copied = s["h2d_bytes_per_step"] if coded_ks else s.get("coded_bytes", s["streamed_bytes_per_step"])
    fig = {"step_ms": round(statistics.median(t.ms), 3), "step_ms_all": [round(x, 3) for x in t.ms],
           "bit_exact": exact, "setup_s": round(setup_s, 2), "copied_gb_per_step": round(copied / 1e9, 4),
           "decoded_gb_per_step": 0.0}
    if "coded_bytes" in s:
        decoded = sum(lay.nbytes for k, lay in enumerate(source.layouts) if not source.raw[k]) \
            if coded_ks else s["streamed_bytes_per_step"]
        fig["decoded_gb_per_step"] = round(decoded / 1e9, 4)
    if coded_ks:
        fig.update(coded_fraction=args.coded_fraction, coded_block_count=len(coded_ks), blocks=len(source.layouts))
    fig.update({k: s[k] for k in ("coded_bytes", "bits_per_weight", "coded_ratio") if k in s})
    if prof is not None:
        fig["profile"] = prof
    return fig, model


def measure(args) -> dict:
    from perf.bench_dlo import FLUX_12B, build_model, model_inputs
    from perf.common import timed_steps

    device = torch.device("cuda", torch.cuda.current_device())
    model = build_model(FLUX_12B, device, weight_fill="student-t")
    inputs = model_inputs(model, device, 0, False)
    with torch.no_grad():
        ref = model(**inputs)[0]
        res = timed_steps(lambda: model(**inputs)[0], args.steps, args.warmup, True)
        prof = None
        if args.profile_dir:
            from perf.lanes import profile_steps

            prof = profile_steps(lambda: model(**inputs), 2, args.profile_dir, "dlodecode-resident",
                                 keep_trace=args.keep_trace)["kernel_totals"]
    resident = statistics.median(res.ms)
    print(f"resident: {resident:.1f} ms/step", flush=True)
    out = {"scenario": "flux-12b-1024", "weight_fill": "student-t", "num_slots": args.num_slots,
           "steps": args.steps, "warmup": args.warmup, "resident_ms": round(resident, 3), "modes": {}}
    if prof is not None:
        out["resident_kernel_totals"] = prof
    for mode in args.modes:
        fig, model = run_mode(mode, model, inputs, ref, args, device)
        fig["ratio_to_resident"] = round(fig["step_ms"] / resident, 4)
        fig["excess_ms"] = round(fig["step_ms"] - resident, 3)
        out["modes"][mode] = fig
        print(f"{mode}: {fig['step_ms']:.1f} ms/step = {fig['ratio_to_resident']:.4f}x resident "
              f"(+{fig['excess_ms']:.1f} ms), copies {fig['copied_gb_per_step']:.2f} GB, bit-exact {fig['bit_exact']}",
              flush=True)
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="raw,coded", help=f"comma list from {', '.join(MODES)} (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--num-slots", type=int, default=2)
    p.add_argument("--profile-dir", default=None, help="two more steps per mode under torch.profiler")
    p.add_argument("--keep-trace", action="store_true", help="with --profile-dir: keep each gzipped trace too")
    p.add_argument("--coded-fraction", type=float, default=1.0,
                   help="coded modes: code only this share of the blocks, evenly spread (default: all)")
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = p.parse_args(argv)
    try:
        args.modes = parse_modes(args.modes)
    except ValueError as e:
        p.error(str(e))
    try:
        spread(1, args.coded_fraction)
    except ValueError as e:
        p.error(str(e))
    if args.steps < 1 or args.warmup < 0 or args.num_slots < 2:
        p.error(f"--steps >= 1, --warmup >= 0, --num-slots >= 2; got {args.steps}, {args.warmup}, {args.num_slots}")
    if not torch.cuda.is_available():
        print("probe_dlo_decode needs a CUDA device", file=sys.stderr)
        return 2
    suffix = ("" if args.num_slots == 2 else f"-s{args.num_slots}") + (
        "" if args.coded_fraction == 1.0 else f"-f{round(args.coded_fraction * 100)}")
    save_result(args.out, "dlodecode", measure(args), suffix=suffix)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
