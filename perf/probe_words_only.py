"""Probe: is the decode kernel held back by the element path compiled beside its word path (registers,
occupancy)? Times today's one-launch decode against a copy of its kernel with only the word path
compiled (full tiles of window tables; other tiles skipped, so that variant is not a decoder).

    python perf/probe_words_only.py [--size double] [--codec exp-k exp-kp] [--elem-chunk 1024 512]

``--elem-chunk``: the one-launch decode again with the element path's chunk (``codec.ELEM_CHUNK``, the
elements it decodes at a time) at each size: fewer live registers, more loop steps.

Results: ``perf/results/probewords-<gpu>-<commit>.json``.
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
from weightstream.kernels._codec_kernels import _NUM_FIELDS, _words  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@triton.jit
def _words_only_kernel(src_ptr, dst_ptr, table_ptr, num_segments, TILE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                       DST_ALIGN: tl.constexpr, LEVEL2: tl.constexpr, PATCHED: tl.constexpr, RANKED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0
    hi = lo + num_segments
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(table_ptr + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seg = lo
    t = pid - tl.load(table_ptr + seg)
    rec = table_ptr + (num_segments + 1) + seg * _NUM_FIELDS
    raw_abs = tl.load(rec + 0)
    code_abs = tl.load(rec + 1)
    base_abs = tl.load(rec + 2)
    exc_abs = tl.load(rec + 3)
    table_abs = tl.load(rec + 4)
    dst_elem = tl.load(rec + 5)
    numel = tl.load(rec + 6)
    k = tl.load(rec + 7)
    split = tl.load(rec + 8)
    window = tl.load(rec + 12)
    full = (t + 1) * TILE <= numel
    if full and window >= 0 and k == 3:
        _words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split, window, t,
               3, TILE, DST_ALIGN, LEVEL2, PATCHED, RANKED)
    elif full and window >= 0 and k == 4:
        _words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split, window, t,
               4, TILE, DST_ALIGN, LEVEL2, PATCHED, RANKED)


def encoded(size: str, codec: str):
    """Student-t tensors of ``size`` coded with ``codec`` once (the slow part): (coded bytes on the GPU, segments)."""
    from perf.bench_codec import make_tensors
    from weightstream.kernels.codec import encode_block
    from weightstream.offload.sources.codec_names import codec_levels

    buf, table = encode_block(make_tensors(size, "student-t", "cuda"), levels=codec_levels(codec))
    return buf.cuda(), table.segments


def measure(size: str, codec: str, warps: int, reps: int = 9, chunks=(), coded=None) -> dict:
    from weightstream.kernels.codec import DecodeTable, decode

    src, segments = coded if coded is not None else encoded(size, codec)
    table = DecodeTable(segments, num_warps=warps)
    dst = torch.zeros(table.dst_nbytes, dtype=torch.uint8, device="cuda")
    ref = torch.zeros_like(dst)
    tab = table.upload(dst.device)
    decode(src, ref, table)
    n = table.decoded_nbytes

    def words():
        _words_only_kernel[(table.num_tiles,)](src, dst.view(torch.int16), tab, table.num_segments, TILE=table.tile,
                                               SEARCH_STEPS=table.search_steps, DST_ALIGN=table.dst_align,
                                               LEVEL2=table.two_level, PATCHED=table.patched, RANKED=table.ranked,
                                               num_warps=warps)

    words()
    torch.cuda.synchronize()
    covered = sum(s.header.numel // table.tile * table.tile * 2 for s in table.segments if s.header.k in (3, 4))
    res = {"size": size, "codec": codec, "num_warps": warps, "decoded_bytes": n, "word_bytes": covered,
           "full_ms": _median_ms(lambda: decode(src, dst, table), reps), "words_only_ms": _median_ms(words, reps),
           "words_match": bool(torch.equal(dst[: 64 << 20], ref[: 64 << 20]))}
    res["full_gbps"] = round(n / res["full_ms"] / 1e6, 1)
    res["elem_chunks"] = {c: _chunk_gbps(c, src, dst, ref, table, reps) for c in chunks}
    res["words_only_gbps"] = round(covered / res["words_only_ms"] / 1e6, 1)
    print(res, flush=True)
    return res


def _chunk_gbps(chunk: int, src, dst, ref, table, reps: int) -> dict:
    """The one-launch decode with the element path's chunk set to ``chunk`` (restored after)."""
    from weightstream.kernels import codec as codec_mod

    old = codec_mod.ELEM_CHUNK
    codec_mod.ELEM_CHUNK = chunk
    try:
        dst.zero_()
        codec_mod.decode(src, dst, table)
        exact = bool(torch.equal(dst, ref))
        ms = _median_ms(lambda: codec_mod.decode(src, dst, table), reps)
    finally:
        codec_mod.ELEM_CHUNK = old
    return {"ms": ms, "gbps": round(table.decoded_nbytes / ms / 1e6, 1), "exact": exact}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="double", choices=["tensor", "single", "double"])
    p.add_argument("--codec", nargs="+", default=["exp-k", "exp-kp"], choices=["exp-k", "exp-k2", "exp-kp"])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--num-warps", type=int, nargs="+", default=[8, 4])
    p.add_argument("--elem-chunk", type=int, nargs="+", default=[],
                   help="also time the full decode with these element-path chunks (powers of two, 64..4096)")
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = p.parse_args(argv)
    bad = [c for c in args.elem_chunk if c < 64 or c > 4096 or c & (c - 1)]
    if bad:
        p.error(f"--elem-chunk {bad[0]} is not allowed; choose powers of two from 64 to 4096")
    if not torch.cuda.is_available():
        print("probe_words_only needs a CUDA device", file=sys.stderr)
        return 2
    runs = []
    for c in args.codec:
        coded = encoded(args.size, c)
        runs += [measure(args.size, c, w, args.reps, args.elem_chunk, coded) for w in args.num_warps]
    save_result(args.out, "probewords", {"runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
