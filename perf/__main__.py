"""`python -m perf run|check|baseline|list` (and the internal `_worker`, `_touch`, `_ckpt`)."""
from __future__ import annotations

import argparse
import sys

from weightstream.checkout import root_last


def main(argv: list[str] | None = None) -> int:
    root_last()  # the checkout's kernels/ folder must not shadow the PyPI `kernels` (weightstream/checkout.py)
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
    r = sub.add_parser("run", help="run modes of a scenario; merge them into perf/results/<scenario>-<gpu kind>.json",
                       description="Runs the modes (each in a fresh process, DLO modes on --nproc ranks) and merges "
                                   "them into <out>/<scenario>-<gpu kind>.json: this run's modes replace those of "
                                   "the same name, the others stay. `python -m perf list` lists scenarios and modes.")
    r.add_argument("--scenario", required=True, help="flux-12b-1024 | flux-12b-512 | wan-14b-480p (+ -tiny) | module-swap")
    r.add_argument("--modes", default=None,
                   help="comma-separated (default: resident,layerwise,diffusers-block,diffusers-leaf; "
                        "with --nproc: resident,dlo-allgather,dlo-rank-local; module-swap: all of its modes)")
    r.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 5)")
    r.add_argument("--warmup", type=int, default=None, help="warm-up steps per mode (default 2)")
    r.add_argument("--out", default=None, help="results folder (default perf/results; --tiny: a temporary folder)")
    r.add_argument("--tiny", action="store_true", help="toy-sized model of the same structure")
    r.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    r.add_argument("--profile-dir", default=None,
                   help="after the timed steps, profile more under torch.profiler; copy-lane gaps and kernel time "
                        "per class (perf/lanes.py) into the result and this folder")
    w = r.add_argument_group("single-GPU modes (each in a fresh process)")
    w.add_argument("--touch-gb", type=float, default=None,
                   help="host GB to touch first (default 2x the model; 0 = skip; tiny: 0)")
    w.add_argument("--trace-dir", default=None, help="also save an NVML trace + HTML report per mode here")
    w.add_argument("--mode-timeout", type=float, default=None, help="kill a mode's worker after this many s")
    w.add_argument("--ckpt-dir", default=None,
                   help="checkpoint folder for -mmap modes (default /tmp/weightstream-perf-ckpt/<scenario>-seed0)")
    d = r.add_argument_group("dlo-* modes (flux-12b-1024, one rank per GPU; --tiny: CPU ranks over gloo)")
    d.add_argument("--nproc", default=None, help="ranks: N or a list run in turn, e.g. 2,4,8 (default 2)")
    d.add_argument("--num-slots", type=int, default=None, help="device block slots of the offloaded modes (default 2)")
    d.add_argument("--plan-h2d-gbps", type=float, default=None,
                   help="dlo-allgather-codedauto plans with this link rate instead of the measured one")
    m = r.add_argument_group("--scenario module-swap (GPU only)")
    m.add_argument("--encoder-gb", type=float, default=None, help="encoder size (default 9.5: T5-XXL)")
    m.add_argument("--dit-gb", type=float, default=None, help="DiT size (default 23.8: Flux.1-dev)")
    m.add_argument("--width", type=int, default=None, help="Linear width (default 4096: 32 MiB per layer)")
    m.add_argument("--rounds", type=int, default=None, help="timed rounds per mode after a warm-up round (default 3)")
    m.add_argument("--peer-rounds", type=int, default=None, help="timed rounds of diffusers-model (default 2)")
    m.add_argument("--fill", default=None, help="normal | student-t (default: student-t when a coded mode runs)")
    m.add_argument("--run-mb", type=float, default=None,
                   help="coded modes: copy/decode run size in MiB (default: the library's; 0 = one copy, one decode)")

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
        from perf.harness import run_cli
        try:
            return run_cli(args)
        except ValueError as e:
            print(f"perf run: {e}", file=sys.stderr)
            return 2
    if args.cmd == "check":
        from perf.check import check_main
        return check_main(args.results, args.baseline, args.tolerance)
    if args.cmd == "baseline":
        from perf.check import baseline_main
        return baseline_main(args.results, args.out)
    if args.cmd == "list":
        from perf.harness import list_text
        print(list_text())
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
