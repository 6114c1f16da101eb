"""The coded ring's stream pattern alone, eager vs from a CUDA graph, by where the decode runs.

    python perf/bench_coded_ring.py [--blocks 24] [--mb 256] [--gemm-n 1] [--memsets 0] [--reps 5]

graphs-coded steps slower than layerwise-coded (flux 0.795x vs 0.746x the uncoded floor, call24)
although a graph-captured pinned copy runs at full rate alone, beside GEMMs and beside decodes
(bench_graph_copy). The graph step's penalty grows with the decode's duration (~70% of it per
block, exp-k and exp-k2 alike). This rebuilds CodedSource's per-block pattern with no model: an H2D
of the coded bytes into one of two coded buffers, a decode of them into one of two slots, GEMMs
that read the slot; events order copy -> decode -> compute, the next copy into a coded buffer after
the decode that read it, and the decode into a slot after the compute that read it. ``--place``:
the decode runs on its own stream (``side``, CodedSource today), on the copy stream (``copy``) or
on the compute stream just before the block's GEMMs (``compute``); ``none`` copies only (the
floor). Reports ms per step and the H2D GB/s it implies (blocks x coded bytes / step time).
Results: ``perf/results/codedring-<gpu>-<commit>.json``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from perf.common import save_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PLACES = ("none", "side", "copy", "compute")


class Ring:
    """Two coded buffers, two slots, copy / decode / compute streams and the events between them."""

    def __init__(self, mb: int, gemm_n: int, memsets: int = 0):
        from weightstream.kernels.codec import CodecSegment, DecodeTable, encode, read_header

        w = (torch.randn((mb << 20) // 2, device="cuda") * 0.02).to(torch.bfloat16)
        coded = encode(w)
        self.table = DecodeTable([CodecSegment(0, 0, read_header(coded))])
        self.table.upload(w.device)
        self.host = coded.cpu().pin_memory()
        self.nbytes = self.host.numel()
        self.bufs = [torch.empty_like(coded) for _ in range(2)]
        self.slots = [torch.empty(w.numel() * 2, dtype=torch.uint8, device="cuda") for _ in range(2)]
        n = 8192
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        self.gemm_n, self.memsets = gemm_n, memsets
        self.flag = torch.empty(1, dtype=torch.int32, device="cuda")  # zeroed by a memset node, as cuBLAS does
        self._memset = None
        if memsets:
            import ctypes

            fn = ctypes.CDLL("libcuda.so.1").cuMemsetD32Async  # torch's zero_ is a kernel, not a memset
            fn.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
            self._memset = lambda: fn(self.flag.data_ptr(), 0, 1, torch.cuda.current_stream().cuda_stream)
        self.copy_s, self.dec_s, self.comp_s = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        ev = lambda: [torch.cuda.Event() for _ in range(2)]  # noqa: E731
        self.copied, self.read, self.ready, self.free = ev(), ev(), ev(), ev()

    def _decode(self, s: int) -> None:
        from weightstream.kernels.codec import decode

        decode(self.bufs[s], self.slots[s], self.table)

    def _compute(self, s: int) -> None:
        b = self.slots[s][: self.a.numel() * 2].view(torch.bfloat16).view_as(self.a)
        for i in range(max(self.gemm_n, self.memsets)):
            if i < self.memsets and self._memset() != 0:
                raise RuntimeError("cuMemsetD32Async failed")
            if i < self.gemm_n:
                torch.mm(self.a, b, out=self.out)

    def step(self, origin, blocks: int, place: str) -> None:
        """One step's pattern forked off and joined back into ``origin``; every wait is on an event
        recorded earlier in the same step (so it captures)."""
        cs, ds, ps = self.copy_s, self.dec_s, self.comp_s
        for st in (cs, ds, ps):
            st.wait_stream(origin)
        dec_on = {"side": ds, "copy": cs, "compute": ps}.get(place)
        for k in range(blocks):
            s = k % 2
            if k >= 2:  # the coded buffer's last reader is done
                cs.wait_event(self.read[s] if dec_on is not None else self.free[s])
            with torch.cuda.stream(cs):
                self.bufs[s].copy_(self.host, non_blocking=True)
                self.copied[s].record(cs)
            if dec_on is not None:
                dec_on.wait_event(self.copied[s])
                if k >= 2 and dec_on is not ps:
                    dec_on.wait_event(self.free[s])  # compute no longer reads the slot
                with torch.cuda.stream(dec_on):
                    self._decode(s)
                    self.read[s].record(dec_on)
                    self.ready[s].record(dec_on)
                ps.wait_event(self.ready[s])
            else:
                ps.wait_event(self.copied[s])
            with torch.cuda.stream(ps):
                self._compute(s)
                self.free[s].record(ps)
        for st in (cs, ds, ps):
            origin.wait_stream(st)


def measure(ring: Ring, blocks: int, place: str, reps: int) -> dict[str, float]:
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(run) -> float:
        torch.cuda.synchronize()
        start.record(main)
        run()
        end.record(main)
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    eager = lambda: ring.step(main, blocks, place)  # noqa: E731
    timed(eager)
    e_ms = statistics.median(timed(eager) for _ in range(reps))
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.graph(g, stream=side):
        ring.step(side, blocks, place)
    timed(g.replay)
    g_ms = statistics.median(timed(g.replay) for _ in range(reps))
    gb = blocks * ring.nbytes / 1e9
    return {"eager_ms": round(e_ms, 3), "graph_ms": round(g_ms, 3),
            "eager_gbps": round(gb / (e_ms / 1e3), 2), "graph_gbps": round(gb / (g_ms / 1e3), 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--mb", type=int, default=256, help="decoded MB per block (coded ~0.7 of it is copied)")
    p.add_argument("--gemm-n", type=int, default=1, help="8192^3 bf16 GEMMs per block (~1.5 ms each)")
    p.add_argument("--memsets", type=int, default=0, help="4-byte memsets per block among its GEMMs (the flux "
                   "graph has ~7 per block: cuBLAS zeroing its stream-K flags)")
    p.add_argument("--place", nargs="+", default=list(PLACES), choices=PLACES)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_coded_ring needs a CUDA device", file=sys.stderr)
        return 2
    ring = Ring(args.mb, args.gemm_n, args.memsets)
    modes = {}
    for place in args.place:
        r = measure(ring, args.blocks, place, args.reps)
        modes[place] = {**r, "blocks": args.blocks, "coded_mb": round(ring.nbytes / 2**20, 1), "gemm_n": args.gemm_n,
                       "memsets": args.memsets}
        print(f"  [{place}] eager {r['eager_ms']:.2f} ms ({r['eager_gbps']:.2f} GB/s), graph {r['graph_ms']:.2f} ms "
              f"({r['graph_gbps']:.2f} GB/s)", flush=True)
    save_result(args.out, "codedring", {"modes": modes}, suffix=f"-m{args.memsets}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
