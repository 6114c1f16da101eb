"""H2D copy rate issued eagerly vs from a captured CUDA graph, alone and beside compute.

    python perf/bench_graph_copy.py [--mb 400] [--chunks 1 4] [--reps 5] [--host pinned reg-4k reg-huge]

graphs-coded streams the same bytes as layerwise-coded but its copies ran at
~49 GB/s against ~53 eager (a profile of the seventh session). This separates
the two suspects: the memcpy node itself (``graph-alone`` vs ``eager-alone``)
and contention with the compute it overlaps (``*-beside-gemm``: a bf16 GEMM
loop on another stream, in the same graph for the graph modes, as the step
graph holds both; ``*-beside-d2d``: device-to-device copies, which load HBM
as the decode and memory-bound kernels do; ``*-beside-decode``: the codec's decode kernel from a
coded buffer, the coded step's own pattern). ``--host``: where the source bytes live: ``pinned``
(``pin_memory``, cudaHostAlloc), ``reg-4k`` (an anonymous mapping registered with cudaHostRegister,
as the coded store's arena), ``reg-huge`` (the same with MADV_HUGEPAGE, as the raw HostStore's arena).
Each copy moves ``--mb`` MB of pinned host memory as
``--chunks`` pieces; GB/s = bytes / (copy stream's median time between events).
Results: ``perf/results/graphcopy-<gpu>-<commit>.json``.
"""
from __future__ import annotations

import argparse
import mmap
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from perf.common import save_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _copies(dst: torch.Tensor, src: torch.Tensor, chunks: int) -> None:
    for d, s in zip(dst.chunk(chunks), src.chunk(chunks)):
        d.copy_(s, non_blocking=True)


def _gemm_loop(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, n: int) -> None:
    for _ in range(n):
        torch.mm(a, b, out=out)


def _d2d_loop(x: torch.Tensor, y: torch.Tensor, n: int) -> None:
    for _ in range(n):
        y.copy_(x)


def _host(kind: str, nbytes: int):
    """(pinned uint8 host tensor of ``nbytes``, a callable that releases it) of the given kind."""
    if kind == "pinned":
        t = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        return t, lambda: None
    from weightstream.offload.host_memory import _cuda_register, _cuda_unregister

    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind == "reg-huge":
        m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)  # fault the pages in (huge ones where the kernel grants them) before registering
    err = _cuda_register(t.data_ptr(), nbytes)
    if err is not None:
        raise RuntimeError(f"--host {kind}: {err}")

    def release():
        torch.cuda.synchronize()
        _cuda_unregister(t.data_ptr())
    return t, release


def _decoder(mb: int):
    """A callable running the decode kernel once over ``mb`` MB of coded bf16 (Gaussian weights)."""
    from weightstream.kernels.codec import CodecSegment, DecodeTable, decode, encode, read_header

    w = (torch.randn((mb << 20) // 2, device="cuda") * 0.02).to(torch.bfloat16)
    buf = encode(w)
    table = DecodeTable([CodecSegment(0, 0, read_header(buf))])
    table.upload(w.device)
    out = torch.empty_like(w).view(torch.uint8)
    return lambda: decode(buf, out, table)


def _timed(fn) -> float:
    """ms the copy stream spends from its start event to its end event in one `fn` call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    fn(start, end)
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def measure(mb: int, chunks: int, reps: int, gemm_n: int, host: str = "pinned") -> dict[str, float]:
    """GB/s of the copy per mode: eager / graph, alone / beside a GEMM loop / D2D copies / decodes."""
    nbytes = mb << 20
    src, release = _host(host, nbytes)
    src.random_(0, 256)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    decode_once = _decoder(256)

    def work(load):
        if load == "gemm":
            _gemm_loop(a, b, out, gemm_n)
        elif load == "d2d":
            _d2d_loop(big, big2, 2 * gemm_n)  # ~0.45 ms per GB each way at ~4.5 TB/s
        elif load == "decode":
            for _ in range(4 * gemm_n):  # ~0.35 ms per 256 MB decoded at ~750 GB/s
                decode_once()
    copy_s, comp_s = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def pattern(origin, load: str | None, start, end) -> None:
        """Fork the copy and compute streams off `origin`: the load on one, the copy between two
        events on the other; join them back."""
        copy_s.wait_stream(origin)
        comp_s.wait_stream(origin)
        if load:
            with torch.cuda.stream(comp_s):
                work(load)
        with torch.cuda.stream(copy_s):
            start.record()
            _copies(dst, src, chunks)
            end.record()
        origin.wait_stream(copy_s)
        origin.wait_stream(comp_s)

    def eager(load: str | None):
        return lambda start, end: pattern(main, load, start, end)

    def graphed(load: str | None):
        g = torch.cuda.CUDAGraph()
        ev = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(2)]
        side = torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):  # warm-up outside capture
            _copies(dst, src, chunks)
            _gemm_loop(a, b, out, 1)
            _d2d_loop(big, big2, 1)
            decode_once()
        main.wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=side):
            pattern(side, load, ev[0], ev[1])

        def run(start, end):
            g.replay()
            torch.cuda.synchronize()
            run.ms = ev[0].elapsed_time(ev[1])
        return run, lambda: run.ms

    figs = {}
    for load in (None, "gemm", "d2d", "decode"):
        tag = f"beside-{load}" if load else "alone"
        fn = eager(load)
        _timed(fn)
        ms = [_timed(fn) for _ in range(reps)]
        figs[f"eager-{tag}"] = statistics.median(ms)
        run, last = graphed(load)
        run(None, None)
        ms = []
        for _ in range(reps):
            run(None, None)
            ms.append(last())
        figs[f"graph-{tag}"] = statistics.median(ms)
    release()
    return {m: round(nbytes / (v / 1e3) / 1e9, 2) for m, v in figs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=400, help="MB per copy (a Flux double block coded is ~400 MB)")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 4], help="pieces each copy is issued as")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--host", nargs="+", default=["pinned"], choices=["pinned", "reg-4k", "reg-huge"],
                   help="host memory kinds to copy from (see the module doc)")
    p.add_argument("--gemm-n", type=int, default=12, help="8192^3 bf16 GEMMs beside each copy (~1 ms each)")
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_graph_copy needs a CUDA device", file=sys.stderr)
        return 2
    modes = {}
    for host in args.host:
        for c in args.chunks:
            for m, gbps in measure(args.mb, c, args.reps, args.gemm_n, host).items():
                modes[f"{host}-{m}-c{c}"] = {"h2d_gbps": gbps, "mb": args.mb, "chunks": c, "host": host}
                print(f"  [{host}-{m}-c{c}] {gbps:.2f} GB/s", flush=True)
    save_result(args.out, "graphcopy", {"modes": modes})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
