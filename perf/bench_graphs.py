"""Benchmark entry for the CUDA-graphs issue.

    python -m perf.bench_graphs [--resident-layers 55] [--big] [--steps 5 --warmup 3] [--tiny]

1. `flux-12b-512` with enough resident blocks that the streamed ones hide behind
   compute (default 55 of 57: the two streamed single blocks are prefetched
   while the resident ones compute), so per-block Python and launch overhead
   dominate: modes `resident`, `resident-graph`, `layerwise-r<R>` (eager) and
   `graphs-r<R>`; the result carries `ratio_to_resident_graph` on the graphs
   mode. Target: graphs <= 1.05 x resident-graph, clearly below eager.
2. `--big`: `flux-12b-1024` and `wan-14b-480p` with `layerwise`, `graphs`
   (the default graph_boundary_loads='auto', i.e. 'next-step' there) and
   `graphs-ingraph` ('in-graph'); graphs must not be slower than eager there.

Warm-up must cover the graph policy's eager warm-up and one capture per phase
(two with an odd streamed block count), hence `--warmup 3` by default.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python perf/bench_graphs.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf.harness import DEFAULT_OUT, Clock, run  # noqa: E402


def plan(resident_layers: int, big: bool) -> list[tuple[str, list[str]]]:
    r = f"r{resident_layers}"
    runs = [("flux-12b-512", ["resident", "resident-graph", f"layerwise-{r}", f"graphs-{r}"])]
    if big:
        runs += [(sc, ["resident", "layerwise", "graphs", "graphs-ingraph"]) for sc in ("flux-12b-1024", "wan-14b-480p")]
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.bench_graphs", description=__doc__.split("\n\n")[0])
    p.add_argument("--resident-layers", type=int, default=55)
    p.add_argument("--big", action="store_true", help="also flux-12b-1024 and wan-14b-480p (layerwise vs graphs)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    if args.resident_layers < 0:
        p.error(f"--resident-layers={args.resident_layers} must be >= 0")
    clock = Clock()
    ok_all = True
    for scenario, modes in plan(args.resident_layers, args.big):
        try:
            _, path, ok = run(scenario, modes, steps=args.steps, warmup=args.warmup, out_dir=args.out,
                              tiny=args.tiny, device=args.device, clock=clock)
        except ValueError as e:
            print(f"bench_graphs: {e}", file=sys.stderr)
            return 2
        ok_all &= ok
        print(f"result: {path}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
