"""What every benchmark shares: the commit, the H2D measurement and the timed-step loop.

One floor definition everywhere (DESIGN.md section 7): a step can be no faster
than its compute (the resident step) nor than its streamed bytes over the best
H2D bandwidth measured in the same run: ``perf.results.floor_ms``.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GB = 1e9


def git_commit() -> tuple[str, bool]:
    """(sha, dirty). WEIGHTSTREAM_COMMIT overrides (copies without .git, e.g. the device)."""
    env = os.environ.get("WEIGHTSTREAM_COMMIT")
    if env:
        return env, False
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True, timeout=30).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                    capture_output=True, text=True, timeout=30).stdout.strip())
        return sha, dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def short_commit() -> str:
    sha = git_commit()[0]
    return sha if sha == "unknown" else sha[:12]


def measure_h2d_gbps(device, nbytes: int = 1 << 30, reps: int = 7, barrier=None) -> tuple[float, list[float]]:
    """(best, all) pinned host -> device GB/s of ``nbytes`` copies. The best is the
    floor's bandwidth: the link can do at least that. ``barrier`` (a callable)
    lines ranks up first, so that every rank's link is busy at once."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    if barrier is not None:
        barrier()
    ms = timed_steps(lambda: dst.copy_(src, non_blocking=True), reps, warmup=0, cuda=True).ms
    del src, dst
    rates = [nbytes / GB / (t / 1e3) for t in ms]
    return max(rates), rates


@dataclass
class Timing:
    ms: list[float]        # per timed step
    wall_ms: float         # host wall time per timed step (launch-ahead included)
    first_ms: float | None # the first warm-up step, synchronised (compile, capture, lazy set-up)
    out: object            # the last output


def timed_steps(run, steps: int, warmup: int, cuda: bool, after=None) -> Timing:
    """Warm-up, then ``steps`` timed steps. On CUDA each step is timed by events on
    the current stream with no host sync between steps; on the CPU by perf_counter.
    ``after`` runs (untimed on CUDA's events) after every step."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out, first_ms = None, None
    for i in range(warmup):
        t = time.perf_counter()
        out = run()
        sync()
        if i == 0:
            first_ms = (time.perf_counter() - t) * 1e3
        if after:
            after()
    sync()
    ms = []
    t0 = time.perf_counter()
    if cuda:
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for s_ev, e_ev in marks:
            s_ev.record()
            out = run()
            e_ev.record()
            if after:
                after()
        torch.cuda.synchronize()
        ms = [s_ev.elapsed_time(e_ev) for s_ev, e_ev in marks]
    else:
        for _ in range(steps):
            t = time.perf_counter()
            out = run()
            ms.append((time.perf_counter() - t) * 1e3)
            if after:
                after()
    wall = (time.perf_counter() - t0) * 1e3 / max(steps, 1)
    return Timing(ms, wall, first_ms, out)


def median(xs) -> float:
    return float(statistics.median(xs))
