"""Probe: does a decode that patches escapes after the tile (no scan, no per-word exception loads) run faster
and steal less compute than today's word path?

    python perf/probe_patch_decode.py [--mb 680] [--gemm-ms 20]

Same raw and code streams as an exp-k (version 1) tensor; the exceptions are instead a list of (in-tile
position uint16, symbol uint8) per tile with a tile prefix of counts. The probe kernel decodes a tile's words
with every escape code taken as the window's last symbol + 1, then (barrier) rewrites the tile's escapes from
the list. Standalone GB/s and the steal beside a GEMM loop (as perf/bench_decode_steal.py) for: today's
decode, the probe, the probe without its patch loop (an upper bound). Checks the probe bit-exact.
Results: ``perf/results/probepatch-<gpu>-<commit>.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import triton
import triton.language as tl

from perf.bench_decode_steal import _median_ms  # noqa: E402
from perf.common import save_result  # noqa: E402
from weightstream.kernels._codec_kernels import _join16, _plane_words  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@triton.jit
def _probe(raw_ptr, code_ptr, pos_ptr, sym_ptr, start_ptr, dst_ptr, window,
           K: tl.constexpr, TILE: tl.constexpr, PATCH: tl.constexpr, PATCHES: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    NW: tl.constexpr = TILE // 4
    wi = tl.arange(0, NW)
    raw = tl.load(raw_ptr.to(tl.pointer_type(tl.uint32)) + t * NW + wi)
    tile_code = t * (TILE // 8) * K
    code = tl.zeros([NW], tl.uint32)
    if K & 4:
        code |= _plane_words(code_ptr, tile_code, K, 4, TILE)
    if K & 2:
        code |= _plane_words(code_ptr, tile_code, K, 2, TILE)
    if K & 1:
        code |= _plane_words(code_ptr, tile_code, K, 1, TILE)
    sym = code + (window * 0x01010101).to(tl.uint32)
    out = tl.reshape(tl.join(_join16(raw, sym, 0, False), _join16(raw, sym, 0, True)), [2 * NW])
    tl.store(dst_ptr.to(tl.pointer_type(tl.uint32)) + t * (TILE // 2) + tl.arange(0, 2 * NW), out)
    if PATCHES:
        n0 = tl.load(start_ptr + t)
        n1 = tl.load(start_ptr + t + 1)
        if n1 > n0:
            tl.debug_barrier()
            for i in range(n0, n1, PATCH):
                j = i + tl.arange(0, PATCH)
                m = j < n1
                p = tl.load(pos_ptr + j, mask=m, other=0).to(tl.int32)
                s = tl.load(sym_ptr + j, mask=m, other=0).to(tl.int32)
                r = tl.load(raw_ptr + t * TILE + p, mask=m, other=0).to(tl.int32)
                v = ((r & 0x80) << 8) | (s << 7) | (r & 0x7F)
                tl.store(dst_ptr.to(tl.pointer_type(tl.int16)) + t * TILE + p, v.to(tl.int16), mask=m)


def _streams(w: torch.Tensor, buf: torch.Tensor, head, tile: int):
    from weightstream.kernels.codec import _word_window

    window = _word_window(head)
    if window < 0 or head.tile != tile or w.numel() % tile:
        raise SystemExit(f"probe needs a window table and full tiles: window {window}, tile {head.tile}")
    raw = buf[head.raw_off: head.raw_off + w.numel()]
    code = buf[head.code_off: head.base_off]
    e = (w.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    esc = (e < window) | (e >= window + (1 << head.k) - 1)
    idx = torch.nonzero(esc.flatten()).flatten()
    pos = (idx % tile).to(torch.int16).contiguous()
    sym = e.flatten()[idx].to(torch.uint8).contiguous()
    counts = torch.bincount(idx // tile, minlength=w.numel() // tile)
    start = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=w.device)
    start[1:] = torch.cumsum(counts, 0)
    return raw.contiguous(), code.contiguous(), pos, sym, start, window, idx.numel()


def measure(mb: int, gemm_ms: float, reps: int, tile: int = 4096, patch: int = 256, warps: int = 8,
            k: int | None = None) -> dict:
    from weightstream.kernels.codec import CodecSegment, DecodeTable, decode, encode, read_header

    n = ((mb << 20) // 2) // tile * tile
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.empty(n, device="cuda")
    w.normal_(generator=g)
    chi = torch.empty(n, device="cuda").normal_(generator=g) ** 2
    for _ in range(3):
        chi += torch.empty(n, device="cuda").normal_(generator=g) ** 2
    w = (w / torch.sqrt(chi / 4) * 0.02).to(torch.bfloat16)  # Student-t df=4, scale 0.02
    del chi
    buf = encode(w.cpu(), k=k).to("cuda")
    head = read_header(buf.cpu())
    raw, code, pos, sym, start, window, nexc = _streams(w, buf, head, tile)
    out = torch.empty_like(w)
    table = DecodeTable([CodecSegment(0, 0, head)])
    table.upload(w.device)

    def today():
        decode(buf, out.view(torch.uint8), table)

    def probe(patches=True):
        return lambda: _probe[(n // tile,)](raw, code, pos, sym, start, out, window, K=head.k, TILE=tile,
                                            PATCH=patch, PATCHES=patches, num_warps=warps)

    probe()()
    torch.cuda.synchronize()
    exact = bool(torch.equal(out.view(torch.int16), w.view(torch.int16)))
    today()
    torch.cuda.synchronize()
    exact_today = bool(torch.equal(out.view(torch.int16), w.view(torch.int16)))

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    one = _median_ms(lambda: torch.mm(a, a, out=c), reps)
    loops = max(1, round(gemm_ms / one))

    def gemms():
        for _ in range(loops):
            torch.mm(a, a, out=c)

    t_gemm = _median_ms(gemms, reps)
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    res = {"mb": mb, "k": head.k, "exceptions_per_elem": round(nexc / n, 5), "gemm_ms": round(t_gemm, 3),
           "exact_probe": exact, "exact_today": exact_today, "patch": patch, "num_warps": warps,
           "bits_v1": round(8 * head.nbytes / n, 3), "bits_patch": round((n * (8 + head.k) + nexc * 24) / n, 3),
           "variants": {}}
    print(res, flush=True)
    for name, fn in (("today", today), ("probe", probe(True)), ("probe-nopatch", probe(False))):
        fn()
        t_dec = _median_ms(fn, reps)

        def both():
            side.wait_stream(main)
            with torch.cuda.stream(side):
                fn()
            gemms()
            main.wait_stream(side)

        t_both = _median_ms(both, reps)
        r = {"decode_ms": round(t_dec, 3), "decode_gbps": round(2 * n / t_dec / 1e6, 1),
             "steal_ms": round(t_both - t_gemm, 3)}
        res["variants"][name] = r
        print(name, r, flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=680)
    p.add_argument("--gemm-ms", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--patch", type=int, nargs="+", default=[256])
    p.add_argument("--num-warps", type=int, nargs="+", default=[8])
    p.add_argument("--k", type=int, nargs="+", default=[3], choices=[2, 3, 4])
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_patch_decode needs a CUDA device", file=sys.stderr)
        return 2
    runs = [measure(args.mb, args.gemm_ms, args.reps, patch=pt, warps=nw, k=k)
            for k in args.k for pt in args.patch for nw in args.num_warps]
    save_result(args.out, "probepatch", {"runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
