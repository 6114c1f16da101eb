"""Probe: per-step times of a mode, with the host running ahead or synchronising every step.

    python -m perf.probe_pacing [--scenario flux-12b-1024] [--modes graphs-nextstep,graphs,layerwise] [--steps 5]

With an odd block count the CUDA-graph schedules alternate two graphs (one
per slot phase); timing each step after a device synchronisation shows a
phase whose graph is slower than the other (how the slow H2D copies of the
first next-step schedule were found; see LayerwiseExecutor). Pacings:

- ``free``: call after call (what the perf worker does);
- ``device-sync``: ``torch.cuda.synchronize()`` after every step.

Each mode runs in a fresh process. Results: ``perf/results/pacing-<scenario>-<gpu>-<commit>.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from perf.common import gpu_slug, short_commit

ROOT = Path(__file__).resolve().parent.parent
PACINGS = ("free", "device-sync")


def _steps(run, pacing: str, steps: int):
    import torch

    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    torch.cuda.synchronize()
    for s, e in marks:
        s.record()
        run()
        e.record()
        if pacing == "device-sync":
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return [round(s.elapsed_time(e), 3) for s, e in marks]


def one(scenario_name: str, mode: str, steps: int) -> dict:
    import torch

    from perf.modes import parse_mode, prepare
    from perf.scenarios import build_inputs, build_model, get_scenario

    scenario, tiny = get_scenario(scenario_name)
    device = torch.device("cuda", torch.cuda.current_device())
    spec = parse_mode(mode, scenario)
    model = build_model(scenario, tiny=tiny, device="cpu", seed=0, progress=lambda m: None)
    inputs = build_inputs(scenario, device, tiny=tiny)
    prepared = prepare(spec, model, scenario, device, record_events=False)
    del model
    run = lambda: prepared.module(**inputs)  # noqa: E731
    out = {}
    with torch.no_grad():
        for _ in range(3):  # warm-up: eager, then a capture per phase
            run()
        torch.cuda.synchronize()
        for pacing in PACINGS:
            run()
            ms = _steps(run, pacing, steps)
            out[pacing] = {"step_ms": round(statistics.median(ms), 3), "step_ms_all": ms}
            print(f"[probe_pacing] {scenario_name} {mode} {pacing:<12} median {out[pacing]['step_ms']:.1f} ms  "
                  f"all {ms}", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.probe_pacing", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="flux-12b-1024")
    p.add_argument("--modes", default="graphs-nextstep,graphs,layerwise")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    p.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._one:
        print(json.dumps({"_probe": 1, "mode": args._one, "pacings": one(args.scenario, args._one, args.steps)}))
        return 0
    import torch

    results = {}
    for mode in [m for m in args.modes.split(",") if m]:
        cmd = [sys.executable, "-m", "perf.probe_pacing", "--scenario", args.scenario, "--steps", str(args.steps),
               "--_one", mode]
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        line = next((s for s in proc.stdout.splitlines() if s.startswith('{"_probe"')), None)
        results[mode] = json.loads(line)["pacings"] if line else {"error": f"exit {proc.returncode}"}
    gpu = torch.cuda.get_device_name()
    commit = short_commit()
    doc = {"probe": "pacing", "scenario": args.scenario, "gpu": gpu, "commit": commit, "torch": torch.__version__,
           "steps": args.steps, "modes": results}
    args.out.mkdir(parents=True, exist_ok=True)
    slug = gpu_slug(gpu)
    path = args.out / f"pacing-{args.scenario}-{slug}-{commit}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
