"""Benchmark: lossless weight codec (`weightstream.kernels.codec`).

Per weight fill (uniform init, Gaussian, Student-t df=4; `weightstream.fills`)
and per size (one 3072x12288 bf16 tensor = a Flux MLP weight, a Flux.1
single-stream block of ~283 MB, a double-stream block of ~680 MB):

- per dtype (``--dtypes``, default bf16; ``fp16``, and ``fp8`` / ``fp8-e5m2``: the fill made in
  bf16 and cast to float8_e4m3fn / float8_e5m2, as diffusers' layerwise casting stores weights;
  the codec's 8-bit path codes the whole byte, mode names end in ``-fp8`` / ``-fp8-e5m2``; their
  entropy bound is H / 8 of the bytes, H the byte entropy);
- per codec (``--codec``, default both: ``exp-k`` one level, ``exp-k2`` two levels,
  mode names of exp-k2 end in ``-k2``): coded ratio (coded / raw bytes), bits per
  weight, chosen k (and k2) per tensor, exponent entropy (the bound for this code:
  (8 + H) / 16 of the bytes);
- CPU encode rate on ONE core (`torch.set_num_threads(1)`), raw bytes / s by
  wall time and by the process's CPU time (fair on a busy machine), and with
  torch's default intra-op threads;
- GPU: decode GB/s = decoded bytes / median time (`triton.testing.do_bench`,
  return_mode="median"), eager and replayed from a CUDA graph, against a
  device-to-device copy of the same output bytes (`ratio_to_copy`); also the
  DRAM traffic rate (coded bytes read + decoded bytes written) / time.
  Each decode is checked byte for byte against the original tensors first.

- GPU encode (``--no-gpu-encode`` skips it): the Triton encoder (`kernels/codec_encode_gpu.py`)
  on each mode's tensors as one device buffer, raw GB/s (``gpu_encode_gbps``) beside the CPU
  encoder's one-core rate; its bytes are checked equal to the CPU encoder's first. And an identity
  check on a realistic tensor (``--no-identity`` skips it; modes ``encode-identity-64mb[-k2|-kp]``):
  64 MB of bf16 random-normal * 0.02, coded on the GPU and on one CPU core with every codec,
  byte-identical, both encode rates and the decode rate.

- build path (``--build``, on by default): the coded source's encode as setup runs it
  (`offload.host.encode.encoded_in_order`: one block per worker thread, torch's
  intra-op threads at 1) over ``--build-blocks`` blocks of the first size, at
  1..N workers (``--build-workers``, default powers of two up to the usable
  cores, and the cores): raw GB/s in aggregate and per worker (modes
  ``triton-build-w<W>``), and a whole `CodedSource` build (encode + store into its
  arena, unpinned) at its default worker count (``triton-build-source``).

Without a GPU (or with --cpu) only the coding figures and the encode rates are
measured. Results: merged into perf/results/codec-<gpu kind>.json (codec-cpu-cpu.json
on CPU; this run's modes replace those of the same name, each mode names its commit)
with the metadata keys of perf/results.py.

    python perf/bench_codec.py                      # on the H200: tensor + single block, all fills
    python perf/bench_codec.py --sizes tensor single double --tiles 2048 4096 8192 --num-warps 4 8 16
    python perf/bench_codec.py --cpu --sizes tensor # coding figures only
    python perf/bench_codec.py --sizes tensor single --fills student-t --no-build
                                                    # GPU encode GB/s next to CPU encode and decode, identity check
    python perf/bench_codec.py --sizes tensor single --fills student-t --codec exp-k exp-k2 --no-build
                                                    # one level vs two: bits/weight and decode GB/s
    python perf/bench_codec.py --sizes tensor single --dtypes fp8 fp8-e5m2 --no-build
                                                    # the 8-bit path: ratio, CPU / GPU encode and decode GB/s
    python perf/bench_codec.py --cpu --sizes single --fills gaussian --no-threaded-encode --build-blocks 32
                                                    # the setup figure: build-path GB/s at 1..cores workers
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python perf/bench_codec.py`
    sys.path.append(str(Path(__file__).resolve().parent.parent))  # last: its kernels/ is weightstream.kernels

from perf.bench_materialise import _flux_block  # noqa: E402  (Flux block tensor shapes)
from perf.common import short_commit  # noqa: E402
from perf.results import validate_result, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET_GBPS = 300.0  # decoded bf16 per second on an H200
SIZES = ("tensor", "single", "double")
CODEC_SUFFIX = {"exp-k": "", "exp-k2": "-k2", "exp-kp": "-kp"}  # mode-name suffix per codec (offload.codecs.CODECS)


def _shapes(size: str) -> list[tuple[int, ...]]:
    if size == "tensor":
        return [(3072, 12288)]
    return [shape for _, shape, _ in _flux_block(size)]


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def make_tensors(size: str, kind: str, device: str, seed: int = 0, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """CPU tensors of `size` filled with `kind` (sampled on `device`); float8: the bf16 fill cast."""
    from weightstream.fills import fill

    gen = torch.Generator(device=device).manual_seed(seed)
    make = torch.bfloat16 if dtype in FP8 else dtype
    return [fill(kind, s, generator=gen, device=device, dtype=make).to(dtype).cpu() for s in _shapes(size)]


def encode_stats(tensors, tile: int, threaded: bool = True, codec: str = "exp-k") -> tuple[torch.Tensor, object, dict]:
    """Encode on one core with ``codec``; (coded buffer, DecodeTable, figures)."""
    from weightstream.kernels.codec_encode import encode_block, symbol_entropy
    from weightstream.kernels.codec_format import read_header
    from weightstream.offload.codecs import codec_levels

    levels = codec_levels(codec)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        buf, table = encode_block(tensors, tile=tile, levels=levels)
        enc_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    finally:
        torch.set_num_threads(threads)
    all_s = None
    if threaded:
        t0 = time.perf_counter()
        encode_block(tensors, tile=tile, levels=levels)  # torch's default intra-op threads
        all_s = time.perf_counter() - t0
    raw = sum(t.numel() * t.element_size() for t in tensors)
    numel = sum(t.numel() for t in tensors)
    heads = [read_header(buf, s.src_offset) for s in table.segments]
    entropy = sum(symbol_entropy(t) * t.numel() for t in tensors) / numel
    byte = tensors[0].dtype in FP8  # the symbol is the whole byte: the bound is H / 8
    figs = {
        "raw_bytes": raw,
        "coded_bytes": table.coded_nbytes,
        "coded_ratio": round(table.coded_nbytes / raw, 5),
        "bits_per_weight": round(table.bits_per_weight, 4),
        "exponent_entropy_bits": round(entropy, 4),
        "entropy_bound_ratio": round(entropy / 8 if byte else (8 + entropy) / 16, 5),
        "dtype": str(tensors[0].dtype).removeprefix("torch."),
        "codec": codec,
        "k": sorted({h.k for h in heads}),
        "k2": sorted({h.k2 for h in heads}),  # 0: a one-level tensor
        "escape_fraction": round(sum(h.num_escapes if h.k2 else h.num_exceptions for h in heads) / numel, 5),
        "exception_fraction": round(sum(h.num_exceptions for h in heads) / numel, 5),  # raw bytes escaped
        "encode_s_one_core": round(enc_s, 4),
        "encode_gbps_one_core": round(raw / enc_s / 1e9, 4),
        "encode_gbps_one_core_cpu_time": round(raw / cpu_s / 1e9, 4),  # robust to a busy machine
        "encode_gbps_all_threads": round(raw / all_s / 1e9, 4) if all_s else None,
        "encode_threads": threads,
        "tile": tile,
    }
    return buf, table, figs


def usable_cores() -> int:
    from weightstream.offload.host.encode import encode_workers

    return encode_workers()


def default_build_workers(cores: int) -> list[int]:
    """1, 2, 4, ... below ``cores``, then ``cores``."""
    out, w = [], 1
    while w < cores:
        out.append(w)
        w *= 2
    return out + [cores]


def _build_blocks(tensors, blocks: int):
    """``blocks`` block layouts over the same tensors (the encoder only reads them)."""
    from weightstream.offload.layout import build_layout

    named = [(f"t{i}", "parameter", t) for i, t in enumerate(tensors)]
    return [build_layout(k, f"blocks.{k}", named) for k in range(blocks)], [list(tensors) for _ in range(blocks)]


def build_figures(tensors, blocks: int, workers: list[int], reps: int = 1) -> dict:
    """Build-path encode rates (modes ``triton-build-w<W>`` and ``triton-build-source``), each the
    median of ``reps`` runs; every run's coded bytes are checked equal to the first run's."""
    from weightstream.offload.sources.pinned import CodedSource
    from weightstream.offload.host.encode import encoded_in_order

    layouts, objs = _build_blocks(tensors, blocks)
    raw = blocks * sum(t.numel() * t.element_size() for t in tensors)
    modes, ref = {}, None
    for w in workers:
        runs = []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            coded = [torch.cat(b) for b, _ in encoded_in_order(layouts, objs, workers=w)]
            runs.append((time.perf_counter() - t0, time.process_time() - c0))
            ref = coded if ref is None else ref
            if any(not torch.equal(a, b) for a, b in zip(ref, coded)):
                raise SystemExit(f"the build at {w} workers coded other bytes than at {workers[0]}")
            del coded
        modes[f"triton-build-w{w}"] = _rate(raw, runs, w, blocks)
    runs = []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        src = CodedSource(layouts, objs, device="cpu", pin=False, drop=lambda ts: None)
        runs.append((time.perf_counter() - t0, time.process_time() - c0))
        if any(not torch.equal(src.region(k)[: r.numel()], r) for k, r in enumerate(ref)):
            raise SystemExit("the coded source's build coded other bytes than encoded_in_order")
        del src
    modes["triton-build-source"] = _rate(raw, runs, usable_cores(), blocks)
    return modes


def _rate(raw: int, runs, workers: int, blocks: int) -> dict:
    wall = sorted(r[0] for r in runs)[len(runs) // 2]
    cpu = sorted(r[1] for r in runs)[len(runs) // 2]
    gbps = raw / wall / 1e9
    return {"step_ms": wall * 1e3, "build_s": wall, "gbps": gbps, "gbps_per_worker": gbps / workers,
            "cpu_gbps_per_core": raw / cpu / 1e9, "workers": workers, "cores": usable_cores(),
            "blocks": blocks, "raw_bytes": raw, "reps": len(runs)}


def _median_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def gpu_figures(tensors, buf, table, options: dict, graph: bool) -> dict:
    from weightstream.kernels.codec import decode
    from weightstream.kernels.codec_format import DecodeTable

    table = DecodeTable(table.segments, **options)
    src = buf.cuda()
    dst = torch.zeros(table.dst_nbytes, dtype=torch.uint8, device="cuda")
    decode(src, dst, table)
    torch.cuda.synchronize()
    for s, t in zip(table.segments, tensors):
        if not torch.equal(dst[s.dst_offset : s.dst_end], t.reshape(-1).view(torch.uint8).cuda()):
            raise SystemExit(f"decode differs from the original tensor at dst offset {s.dst_offset}")
    n = table.decoded_nbytes
    ms = _median_ms(lambda: decode(src, dst, table))
    figs = {"step_ms": ms, "ms": ms, "gbps": n / ms / 1e6, "dram_gbps": (n + table.coded_nbytes) / ms / 1e6,
            **table.options(), "tiles": table.num_tiles, "tensors": table.num_segments}
    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode(src, dst, table)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            decode(src, dst, table)
        figs["graph_ms"] = _median_ms(g.replay)
        figs["graph_gbps"] = n / figs["graph_ms"] / 1e6
        del g
    return figs


def gpu_encode_figures(tensors, buf, codec: str, tile: int) -> dict:
    """The Triton encoder (kernels/codec_encode_gpu.py) on ``tensors`` as one device buffer (a
    block image: each 512-byte aligned), raw GB/s = raw bytes / median time (one host sync per
    encode: the histograms); its bytes must be ``buf`` (the CPU encoder's, encode_block)."""
    from weightstream.kernels.codec_encode_gpu import EncodeJob, encode_jobs
    from weightstream.offload.codecs import codec_levels

    levels, jobs, at = codec_levels(codec), [], 0
    for t in tensors:
        jobs.append(EncodeJob(at, t.numel() * t.element_size(), t.dtype))
        at = -(-(at + t.numel() * t.element_size()) // 512) * 512
    src = torch.zeros(at, dtype=torch.uint8, device="cuda")
    for j, t in zip(jobs, tensors):
        src[j.src_offset : j.src_offset + j.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    out = torch.empty(buf.numel() + 4096, dtype=torch.uint8, device="cuda")
    coded, _, _ = encode_jobs(src, jobs, out, levels=levels, tile=tile)
    if not torch.equal(coded.cpu(), buf):
        raise SystemExit(f"the GPU encoder's bytes differ from the CPU encoder's ({codec}, tile {tile})")
    raw = sum(j.nbytes for j in jobs)
    ms = _median_ms(lambda: encode_jobs(src, jobs, out, levels=levels, tile=tile))
    del src, out
    return {"gpu_encode_ms": ms, "gpu_encode_gbps": raw / ms / 1e6, "gpu_encode_identical": True}


def identity_figures(codecs, mb: int = 64, dt: str = "bf16") -> dict:
    """A realistic tensor (``mb`` MB of bf16 random-normal * 0.02; ``dt`` fp8 / fp8-e5m2: cast to
    float8, ``mb`` MB of it) coded on the GPU and on the CPU (one core) with every codec:
    byte-identical, raw GB/s of both; then decoded (GB/s decoded)."""
    from weightstream.kernels.codec import decode
    from weightstream.kernels.codec_encode import encode
    from weightstream.kernels.codec_encode_gpu import encode_gpu
    from weightstream.kernels.codec_format import CodecSegment, DecodeTable, read_header
    from weightstream.offload.codecs import codec_levels

    gen = torch.Generator().manual_seed(0)
    dtype = DTYPES[dt]
    x = (torch.randn((mb << 20) // dtype.itemsize, generator=gen) * 0.02).to(torch.bfloat16).to(dtype)
    xd, modes = x.cuda(), {}
    for codec in codecs:
        levels = codec_levels(codec)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            want = encode(x, levels=levels)
            cpu_s = time.perf_counter() - t0
        finally:
            torch.set_num_threads(threads)
        got = encode_gpu(xd, levels=levels)
        same = torch.equal(got.cpu(), want)
        if not same:
            raise SystemExit(f"identity check failed: the GPU encoder's {codec} bytes differ from the CPU encoder's")
        ms = _median_ms(lambda: encode_gpu(xd, levels=levels))
        table = DecodeTable([CodecSegment(0, 0, read_header(want))])
        raw = x.numel() * x.element_size()
        dst = torch.empty(raw, dtype=torch.uint8, device="cuda")
        dms = _median_ms(lambda: decode(got, dst, table))
        if not torch.equal(dst.cpu(), x.view(torch.uint8)):
            raise SystemExit(f"identity check failed: {codec} decode differs from the tensor")
        suffix = "" if dt == "bf16" else f"-{dt}"
        modes[f"encode-identity-{mb}mb{suffix}{CODEC_SUFFIX[codec]}"] = {
            "step_ms": ms, "gpu_encode_ms": ms, "gpu_encode_gbps": raw / ms / 1e6,
            "cpu_encode_gbps_one_core": raw / cpu_s / 1e9, "decode_gbps": raw / dms / 1e6, "identical": same,
            "raw_bytes": raw, "coded_bytes": want.numel(), "coded_ratio": want.numel() / raw, "codec": codec,
            "dtype": dt}
    return modes


def _variants(name: str, args):
    """(mode name, DecodeTable launch options) for every combination of the swept options; a
    mode name carries a suffix for each option that is not its list's first choice."""
    for words in args.words:
        for planes in args.planes:
            for warps in args.num_warps:
                mode = name + ("" if warps == args.num_warps[0] else f"-w{warps}")
                mode += "" if planes == args.planes[0] else f"-{planes}"
                mode += "" if words == args.words[0] else f"-words{words}"
                yield mode, {"num_warps": warps, "gather_planes": planes == "gather", "words": words == "on"}


def copy_ms(nbytes: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _median_ms(lambda: b.copy_(a))
    del a, b
    return ms


def run(args) -> dict:
    modes = {}
    gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if gpu else "cpu"
    for size in args.sizes:
        copy = None
        for kind, dt in [(k, d) for d in args.dtypes for k in args.fills]:
            tensors = make_tensors(size, kind, device, dtype=DTYPES[dt])
            for ti, tile, codec in [(i, t, c) for i, t in enumerate(args.tiles) for c in args.codec]:
                buf, table, figs = encode_stats(tensors, tile, args.threaded_encode, codec)
                name = f"triton-{size}-{kind}" + ("" if dt == "bf16" else f"-{dt}") + ("" if ti == 0 else f"-t{tile}")
                name += CODEC_SUFFIX[codec]
                print(f"[{name}] {figs['raw_bytes'] / 1e6:.1f} MB -> {figs['coded_bytes'] / 1e6:.1f} MB "
                      f"(ratio {figs['coded_ratio']:.4f}, {figs['bits_per_weight']:.3f} bits/weight, k {figs['k']}, "
                      f"k2 {figs['k2']}, "
                      f"entropy bound {figs['entropy_bound_ratio']:.4f}); encode {figs['encode_gbps_one_core']:.2f} "
                      f"GB/s on one core ({figs['encode_gbps_one_core_cpu_time']:.2f} by CPU time), "
                      f"{figs['encode_gbps_all_threads']} GB/s on {figs['encode_threads']} threads", flush=True)
                if not gpu:
                    modes[name] = {"step_ms": figs["encode_s_one_core"] * 1e3, **figs}
                    continue
                if copy is None:
                    copy = copy_ms(figs["raw_bytes"])
                    modes[f"copy-{size}"] = {"step_ms": copy, "ms": copy, "gbps": figs["raw_bytes"] / copy / 1e6,
                                             "bytes": figs["raw_bytes"]}
                enc = gpu_encode_figures(tensors, buf, codec, tile) if args.gpu_encode else {}
                if enc:
                    print(f"  [{name}] GPU encode {enc['gpu_encode_ms']:.3f} ms = {enc['gpu_encode_gbps']:.1f} GB/s "
                          f"raw (CPU one core {figs['encode_gbps_one_core']:.2f}); bytes identical", flush=True)
                for vi, (mode, options) in enumerate(_variants(name, args)):
                    g = gpu_figures(tensors, buf, table, options, graph=args.graph and vi == 0)
                    modes[mode] = {**g, "ratio_to_copy": copy / g["ms"], **figs, **enc}
                    gr = f", graph {g['graph_gbps']:.1f} GB/s" if "graph_gbps" in g else ""
                    print(f"  [{mode}] decode {g['ms']:.3f} ms = {g['gbps']:.1f} GB/s decoded "
                          f"({g['dram_gbps']:.1f} GB/s DRAM){gr}; copy {copy:.3f} ms, "
                          f"x copy {copy / g['ms']:.3f}", flush=True)
                del buf, table
            del tensors
        if gpu:
            torch.cuda.empty_cache()
    idents = ["bf16"] + [d for d in args.dtypes if DTYPES[d] in FP8] if gpu and args.identity else []
    for dt in idents:
        for mode, f in identity_figures(args.codec, dt=dt).items():
            print(f"[{mode}] {f['raw_bytes'] / 1e6:.0f} MB randn * 0.02 ({dt}): GPU encode {f['gpu_encode_gbps']:.1f} "
                  f"GB/s, CPU encode {f['cpu_encode_gbps_one_core']:.2f} GB/s on one core, decode "
                  f"{f['decode_gbps']:.1f} GB/s, ratio {f['coded_ratio']:.4f}; bytes identical: {f['identical']}",
                  flush=True)
            modes[mode] = f
    if args.build:
        modes.update(run_build(args))
    return modes


def run_build(args) -> dict:
    workers = args.build_workers or default_build_workers(usable_cores())
    tensors = make_tensors(args.sizes[0], args.build_fill, "cpu")
    modes = build_figures(tensors, args.build_blocks, workers, args.build_reps)
    for name, f in modes.items():
        print(f"[{name}] {f['raw_bytes'] / 1e9:.2f} GB in {f['blocks']} blocks: {f['gbps']:.2f} GB/s on "
              f"{f['workers']} workers = {f['gbps_per_worker']:.3f} GB/s per worker "
              f"({f['cpu_gbps_per_core']:.3f} GB/s per core by CPU time; {f['cores']} usable cores)", flush=True)
    return modes


def main(argv=None) -> int:
    from weightstream.fills import FILLS
    from weightstream.kernels.codec_format import DEFAULT_NUM_WARPS, DEFAULT_TILE

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=SIZES, default=["tensor", "single"],
                   help="tensor = one 3072x12288 weight, single = ~283 MB Flux block, double = ~680 MB block")
    p.add_argument("--fills", nargs="+", choices=FILLS, default=list(FILLS))
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"],
                   help="weight dtypes (fp16 codes the high byte, fp8 / fp8-e5m2 the whole byte of the bf16 fill "
                        "cast to float8; mode names get a -<dtype> suffix)")
    p.add_argument("--tiles", type=int, nargs="+", default=[DEFAULT_TILE], help="elements per tile (first = default)")
    p.add_argument("--codec", nargs="+", choices=sorted(CODEC_SUFFIX), default=sorted(CODEC_SUFFIX),
                   help="codecs to code with (exp-k: one level; exp-k2: two levels, modes suffixed -k2)")
    p.add_argument("--num-warps", type=int, nargs="+", default=[DEFAULT_NUM_WARPS])
    p.add_argument("--planes", nargs="+", choices=["gather", "reshape"], default=["gather", "reshape"],
                   help="code-plane load variant(s) of the kernel (first = unsuffixed mode name)")
    p.add_argument("--words", nargs="+", choices=["on", "off"], default=["on"],
                   help="the four-elements-per-word path for window tables (first = unsuffixed mode name)")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph replay figures")
    p.add_argument("--cpu", action="store_true", help="coding figures and encode rate only (no GPU)")
    p.add_argument("--no-threaded-encode", dest="threaded_encode", action="store_false",
                   help="skip the encode rate with torch's default threads (slow on a shared machine)")
    p.add_argument("--no-build", dest="build", action="store_false", help="skip the build-path encode rates")
    p.add_argument("--no-gpu-encode", dest="gpu_encode", action="store_false",
                   help="skip the GPU encoder's rate (and its byte-identity check) per mode")
    p.add_argument("--no-identity", dest="identity", action="store_false",
                   help="skip the 64 MB bf16 identity check (GPU vs CPU encoder bytes, encode and decode GB/s)")
    p.add_argument("--build-workers", type=int, nargs="+", default=None,
                   help="worker counts of the build path (default: 1, 2, 4, ... and the usable cores)")
    p.add_argument("--build-blocks", type=int, default=None,
                   help="blocks of the first --sizes entry the build path codes (default: 2x the most workers)")
    p.add_argument("--build-fill", choices=FILLS, default="gaussian", help="weight fill of the build-path blocks")
    p.add_argument("--build-reps", type=int, default=3, help="runs per build figure (median)")
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results", help="results folder")
    p.add_argument("--check", action="store_true", help=f"exit 1 if a decode is below {TARGET_GBPS} GB/s")
    args = p.parse_args(argv)
    for key in ("build_blocks", "build_reps"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.build_workers is not None and min(args.build_workers) < 1:
        p.error(f"--build-workers must all be >= 1, got {args.build_workers}")
    if args.build_blocks is None:
        args.build_blocks = 2 * max(args.build_workers or [usable_cores()])

    modes = run(args)
    on_gpu = torch.cuda.is_available() and not args.cpu
    gpu = torch.cuda.get_device_name() if on_gpu else "cpu"
    commit = short_commit()
    result = {
        "scenario": "codec" if on_gpu else "codec-cpu",
        "gpu": gpu,
        "gpus": 1 if on_gpu else 0,
        "commit": commit,
        "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gbps": "decoded bytes / median ms (do_bench); dram_gbps adds the coded bytes read; "
                "on CPU step_ms is the one-core encode time",
        "modes": modes,
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    validate_result(result)
    path = write_result(args.out, result)
    print(f"wrote {path}")
    low = [m for m, f in modes.items() if m.startswith("triton") and "gbps" in f and f["gbps"] < TARGET_GBPS]
    if on_gpu and low:
        print(f"below {TARGET_GBPS} GB/s: {', '.join(low)}", file=sys.stderr)
    return 1 if args.check and on_gpu and low else 0


if __name__ == "__main__":
    sys.exit(main())
