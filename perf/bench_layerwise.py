"""Benchmark entry for the layerwise issue: resident vs layerwise on the two
big scenarios, optionally against diffusers' block-level group offload.

    python -m perf.bench_layerwise [--source memory|mmap|both] [--peers] [--steps 5 --warmup 2] [--tiny]

`--source mmap` runs mode `layerwise-mmap` instead of `layerwise`: blocks
streamed straight from a safetensors checkpoint of the same random weights
(`offload_from_safetensors`); the checkpoint is written once per scenario,
untimed, to /tmp/weightstream-perf-ckpt (or `--ckpt-dir`; one per scenario:
Flux 24 GB, Wan 29 GB of disk). `--source both` runs both modes. Each
scenario writes its own result file (see `python -m perf run`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python perf/bench_layerwise.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf.harness import DEFAULT_OUT, Clock, run  # noqa: E402

SCENARIOS = ("flux-12b-1024", "wan-14b-480p")


def modes_for(source: str, peers: bool) -> list[str]:
    modes = ["resident"]
    if source in ("memory", "both"):
        modes.append("layerwise")
    if source in ("mmap", "both"):
        modes.append("layerwise-mmap")
    if peers:
        modes.append("diffusers-block")
    return modes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.bench_layerwise", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", choices=("memory", "mmap", "both"), default="memory")
    p.add_argument("--peers", action="store_true", help="add diffusers-block")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="default: %(default)s")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--ckpt-root", default=None, help="folder for the -mmap checkpoints (one subfolder per scenario)")
    args = p.parse_args(argv)
    clock = Clock()
    ok_all, paths = True, []
    for sc in [s for s in args.scenarios.split(",") if s]:
        try:
            _, path, ok = run(sc, modes_for(args.source, args.peers), steps=args.steps, warmup=args.warmup,
                              out_dir=args.out, tiny=args.tiny, device=args.device, trace_dir=args.trace_dir,
                              ckpt_dir=str(Path(args.ckpt_root) / sc) if args.ckpt_root else None, clock=clock)
        except ValueError as e:
            print(f"bench_layerwise: {e}", file=sys.stderr)
            return 2
        ok_all &= ok and path is not None
        if path:
            paths.append(str(path))
    for path in paths:
        print(f"result: {path}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
