"""How much compute a decode beside it steals, by launch option (``DecodeTable`` num_warps, words).

    python perf/bench_decode_steal.py [--mb 680] [--gemm-ms 20] [--num-warps 8 4] [--words on off] [--codec exp-k exp-kp]

On a compute-bound model (wan-14b-480p) the coded step exceeds the resident one by about the
decode's standalone time (1.1%). For each launch option this times a bf16 GEMM loop alone, the
decode alone, and both together (the decode on a side stream, started with the loop);
``steal_ms`` = together - GEMMs alone, ``steal_frac`` = steal_ms / the first option's standalone
decode time. At 6864ab1 (H200) the default launch stole 2.2x its own time; a persistent grid of
264..8 programs (tried there, reverted) stole 2.9-4.5x. A decode variant for compute-bound models
should lower this figure, not only the standalone one.
Results: ``perf/results/decodesteal-<gpu>-<commit>.json``.
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


def _median_ms(fn, reps: int) -> float:
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start.record(main)
        fn()
        end.record(main)
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out[1:])  # the first is a warm-up


def measure(mb: int, gemm_ms: float, options: list[dict], reps: int, codec: str = "exp-k") -> dict:
    from weightstream.fills import fill
    from weightstream.kernels.codec import CodecSegment, DecodeTable, decode, encode, read_header
    from weightstream.offload.sources.codec_names import codec_levels

    w = fill("student-t", ((mb << 20) // 2,), generator=torch.Generator().manual_seed(0)).to("cuda")
    buf = encode(w, levels=codec_levels(codec))
    head = read_header(buf)
    out = torch.empty_like(w).view(torch.uint8)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    one = _median_ms(lambda: torch.mm(a, a, out=c), reps)
    n = max(1, round(gemm_ms / one))

    def gemms():
        for _ in range(n):
            torch.mm(a, a, out=c)

    t_gemm = _median_ms(gemms, reps)
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    res = {"codec": codec, "fill": "student-t", "version": head.version, "k": head.k, "mb": mb, "gemms": n, "gemm_ms": round(t_gemm, 3), "bits_per_weight": round(8 * head.nbytes / w.numel(), 3),
           "options": {}}
    full = None
    for opt in options:
        g = ",".join(f"{k}={v}" for k, v in opt.items())
        table = DecodeTable([CodecSegment(0, 0, head)], **opt)
        table.upload(w.device)
        t_dec = _median_ms(lambda: decode(buf, out, table), reps)
        full = t_dec if full is None else full

        def both():
            side.wait_stream(main)
            with torch.cuda.stream(side):
                decode(buf, out, table)
            gemms()
            main.wait_stream(side)

        t_both = _median_ms(both, reps)
        steal = t_both - t_gemm
        res["options"][g] = {"decode_ms": round(t_dec, 3), "decode_gbps": round(w.numel() * 2 / t_dec / 1e6, 1),
                                "both_ms": round(t_both, 3), "steal_ms": round(steal, 3),
                                "steal_frac": round(steal / full, 3)}
        print(f"  [{codec} {g}] decode {t_dec:.3f} ms ({w.numel() * 2 / t_dec / 1e6:.0f} GB/s); "
              f"GEMMs {t_gemm:.3f} -> {t_both:.3f} ms beside it: steals {steal:.3f} ms = {steal / full:.2f}x the "
              "first option's decode", flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=680, help="decoded MB (a Flux double block is ~680)")
    p.add_argument("--gemm-ms", type=float, default=20.0, help="length of the GEMM loop beside the decode")
    p.add_argument("--num-warps", type=int, nargs="+", default=[8], help="decode launch warps to try")
    p.add_argument("--words", nargs="+", default=["on"], choices=["on", "off"], help="the word path on / off")
    p.add_argument("--codec", nargs="+", default=["exp-k"], choices=["exp-k", "exp-k2", "exp-kp"],
                   help="codecs (weight_codec names) to decode")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = p.parse_args(argv)
    if any(w < 1 or w & (w - 1) for w in args.num_warps):
        p.error(f"--num-warps: powers of two >= 1, got {args.num_warps}")
    options = [{"num_warps": w, "words": x == "on"} for x in args.words for w in args.num_warps]
    if not torch.cuda.is_available():
        print("bench_decode_steal needs a CUDA device", file=sys.stderr)
        return 2
    runs = [measure(args.mb, args.gemm_ms, options, args.reps, codec) for codec in args.codec]
    save_result(args.out, "decodesteal", runs[0] if len(runs) == 1 else {"runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
