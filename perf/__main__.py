"""`python -m perf run|check|baseline|list` (and the internal `_worker`, `_touch`, `_ckpt`)."""
from __future__ import annotations

import argparse
import sys


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "_worker":
        import os

        from perf.worker import worker_main
        rc = worker_main(argv[1:])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # skip interpreter teardown (seconds with a 24 GB host model); the result line is out
    if argv and argv[0] == "_ckpt":
        from perf.worker import ckpt_main
        return ckpt_main(argv[1:])
    if argv and argv[0] == "_touch":
        from perf.worker import touch_main
        return touch_main(argv[1:])

    p = argparse.ArgumentParser(prog="python -m perf", description="weightstream benchmarks and regression check")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run modes of a scenario, each in a fresh process; write the result JSON")
    r.add_argument("--scenario", required=True, help="flux-12b-1024 | flux-12b-512 | wan-14b-480p (+ -tiny)")
    r.add_argument("--modes", default="resident,layerwise,diffusers-block,diffusers-leaf",
                   help="comma-separated (default: %(default)s)")
    r.add_argument("--steps", type=int, default=5, help="timed steps per mode (default 5)")
    r.add_argument("--warmup", type=int, default=2, help="warm-up steps per mode (default 2)")
    r.add_argument("--out", default=None, help="results folder (default perf/results; --tiny: a temporary folder)")
    r.add_argument("--tiny", action="store_true", help="toy-sized model of the same structure")
    r.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    r.add_argument("--touch-gb", type=float, default=None,
                   help="host GB to touch first (default 2x the model; 0 = skip; tiny: 0)")
    r.add_argument("--trace-dir", default=None, help="also save an NVML trace + HTML report per mode here")
    r.add_argument("--mode-timeout", type=float, default=None, help="kill a mode's worker after this many s")
    r.add_argument("--ckpt-dir", default=None,
                   help="checkpoint folder for -mmap modes (default /tmp/weightstream-perf-ckpt/<scenario>-seed0)")
    r.add_argument("--merge", action="store_true",
                   help="keep modes of an existing result file (same scenario, GPU, commit) that this run skips")

    c = sub.add_parser("check", help="compare a result's ratios with the GPU's baseline")
    c.add_argument("results", nargs="+")
    c.add_argument("--baseline", default=None, help="default perf/baselines/<gpu-slug>.json")
    c.add_argument("--tolerance", type=float, default=0.05, help="allowed relative worsening (default 0.05)")

    b = sub.add_parser("baseline", help="write/update perf/baselines/<gpu-slug>.json from results")
    b.add_argument("results", nargs="+")
    b.add_argument("--out", default=None, help="baseline file (default perf/baselines/<gpu-slug>.json)")

    sub.add_parser("list", help="scenarios and modes")
    args = p.parse_args(argv)

    if args.cmd == "run":
        from perf.harness import run
        try:
            _, path, ok = run(args.scenario, _split(args.modes), steps=args.steps, warmup=args.warmup,
                              out_dir=args.out, tiny=args.tiny, device=args.device,
                              touch_gb=args.touch_gb, trace_dir=args.trace_dir,
                              mode_timeout=args.mode_timeout, merge=args.merge, ckpt_dir=args.ckpt_dir)
        except ValueError as e:
            print(f"perf run: {e}", file=sys.stderr)
            return 2
        if path is None:
            print("perf run: no mode finished; no result written", file=sys.stderr)
            return 1
        print(f"result: {path}")
        return 0 if ok else 1
    if args.cmd == "check":
        from perf.check import check_main
        return check_main(args.results, args.baseline, args.tolerance)
    if args.cmd == "baseline":
        from perf.check import baseline_main
        return baseline_main(args.results, args.out)
    if args.cmd == "list":
        from perf.modes import PEER_MODES
        from perf.scenarios import SCENARIOS
        for s in SCENARIOS.values():
            print(f"{s.name:16s} {s.description}")
        print("modes: resident, layerwise, layerwise-r<N>, layerwise-mmap, graphs, " + ", ".join(PEER_MODES))
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
