"""Benchmark: fused `materialise` vs a plain device-to-device copy of the same bytes.

Block images shaped like Flux.1 blocks in bf16 (d=3072, 24 heads of 128):
a single-stream block (~283 MB, 8 tensors) and a double-stream block
(~680 MB, 24 tensors). The wire image holds the checkpoint layout:
attention QKV weights and biases head-interleaved (QKV_REORDER to the fused
[q; k; v] layout; in the single block only the QKV rows of the fused
linear1, its MLP rows are plain IDENTITY rows beside them), MLP weights
sharded per tensor over `--world-size` ranks as after an all-gather
(SHARD_UNPACK), everything else IDENTITY at new offsets.

"bytes moved" = bytes written to the runtime image (= `bytes_moved(table)`);
the kernel reads as many, so DRAM traffic is twice that. GB/s = bytes moved /
median time. The baseline is `dst[:n].copy_(src[:n])` for the same n bytes,
timed the same way in the same run; the target is triton >= 0.8 x copy.
Timing: CUDA events around each call after warm-up, median of `--iters`.

    python perf/bench_materialise.py                # merges into perf/results/materialise-<gpu kind>.json
    python perf/bench_materialise.py --tile-bytes 8192 16384 32768 --check
"""
from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # `python perf/bench_materialise.py`
    sys.path.append(str(ROOT))  # last: its kernels/ folder is weightstream.kernels, not the PyPI `kernels`

import torch  # noqa: E402

from perf.common import short_commit  # noqa: E402
TARGET_RATIO = 0.8
ALIGN = 512  # tensor alignment inside block images (DESIGN.md, HostStore)
D, HEADS, HEAD_DIM, MLP = 3072, 24, 128, 4 * 3072
BF16 = 2


def _flux_block(kind: str):
    """[(name, shape, role)] in model order; role in {identity, qkv, shard, linear1}."""
    if kind == "single":  # FluxSingleTransformerBlock
        return [
            ("norm.linear.weight", (3 * D, D), "identity"),
            ("norm.linear.bias", (3 * D,), "identity"),
            ("linear1.weight", (3 * D + MLP, D), "linear1"),  # fused [qkv; mlp_in]
            ("linear1.bias", (3 * D + MLP,), "linear1"),
            ("attn.norm_q.weight", (HEAD_DIM,), "identity"),
            ("attn.norm_k.weight", (HEAD_DIM,), "identity"),
            ("linear2.weight", (D, D + MLP), "shard"),
            ("linear2.bias", (D,), "identity"),
        ]
    out = []
    for s in ("img", "txt"):  # FluxTransformerBlock
        out += [
            (f"{s}_mod.linear.weight", (6 * D, D), "identity"),
            (f"{s}_mod.linear.bias", (6 * D,), "identity"),
            (f"{s}_attn.qkv.weight", (3 * D, D), "qkv"),
            (f"{s}_attn.qkv.bias", (3 * D,), "qkv"),
            (f"{s}_attn.norm_q.weight", (HEAD_DIM,), "identity"),
            (f"{s}_attn.norm_k.weight", (HEAD_DIM,), "identity"),
            (f"{s}_attn.proj.weight", (D, D), "identity"),
            (f"{s}_attn.proj.bias", (D,), "identity"),
            (f"{s}_mlp.0.weight", (MLP, D), "shard"),
            (f"{s}_mlp.0.bias", (MLP,), "identity"),
            (f"{s}_mlp.2.weight", (D, MLP), "shard"),
            (f"{s}_mlp.2.bias", (D,), "identity"),
        ]
    return out


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def build_table(kind: str, world_size: int, tile_bytes: int, num_warps: int):
    """(SegmentTable, wire_bytes, runtime_bytes, description) for a Flux-like block."""
    from weightstream.kernels.materialise import (
        Segment,
        SegmentTable,
        shard_layout,
        shard_unpack_segments,
    )

    tensors = _flux_block(kind)
    # runtime image: model order, 512-aligned
    dst_offs, at = [], 0
    for _, shape, _ in tensors:
        at = _round_up(at, ALIGN)
        dst_offs.append(at)
        at += torch.Size(shape).numel() * BF16
    runtime_bytes = _round_up(at, ALIGN)

    segs, wire_at = [], 0
    sharded = []
    for (name, shape, role), dst in zip(tensors, dst_offs):
        nbytes = torch.Size(shape).numel() * BF16
        in_f = shape[1] if len(shape) == 2 else 1
        head = HEAD_DIM * in_f * BF16
        if role == "shard":
            sharded.append((nbytes, dst, shape[1] * BF16))
            continue
        wire_at = _round_up(wire_at, ALIGN)
        if role == "qkv":
            segs.append(Segment.qkv_reorder(wire_at, dst, HEADS, HEADS, head))
        elif role == "linear1":
            qkv = 3 * D * in_f * BF16
            segs.append(Segment.qkv_reorder(wire_at, dst, HEADS, HEADS, head))
            segs.append(Segment.identity(wire_at + qkv, dst + qkv, nbytes - qkv))
        else:
            segs.append(Segment.identity(wire_at, dst, nbytes))
        wire_at += nbytes
    layout = shard_layout(
        [n for n, _, _ in sharded],
        world_size,
        tensor_offsets=[d for _, d, _ in sharded],
        row_bytes=[r for _, _, r in sharded],
        align=ALIGN,
    )
    gathered_at = _round_up(wire_at, ALIGN)
    segs += shard_unpack_segments(layout, src_offset=gathered_at)
    wire_bytes = gathered_at + layout.gathered_bytes
    table = SegmentTable(segs, tile_bytes=tile_bytes, num_warps=num_warps)
    return table, wire_bytes, runtime_bytes, f"{kind} block, {len(tensors)} tensors, {len(segs)} segments"


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median of per-call CUDA-event times after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def run(args) -> dict:
    from weightstream.kernels.materialise import bytes_moved, materialise, materialise_torch

    torch.manual_seed(0)
    modes = {}
    blocks = {"single": "300mb", "double": "700mb"}
    for kind in args.blocks:
        label = blocks[kind]
        tables = [build_table(kind, args.world_size, t, args.num_warps) for t in args.tile_bytes]
        _, wire_bytes, runtime_bytes, desc = tables[0]
        src = torch.randint(0, 256, (wire_bytes,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros(runtime_bytes, dtype=torch.uint8, device="cuda")
        n = bytes_moved(tables[0][0])
        mb = f"wire {wire_bytes / 1e6:.1f} MB, runtime {runtime_bytes / 1e6:.1f} MB, moved {n / 1e6:.1f} MB"
        print(f"[{label}] {desc}: {mb}")

        ref = torch.zeros_like(dst)
        materialise_torch(src, ref, tables[0][0])
        for table, *_ in tables:  # correctness and compilation before timing
            dst.zero_()
            materialise(src, dst, table)
            torch.cuda.synchronize()
            if not torch.equal(dst, ref):
                raise SystemExit(f"materialise differs from materialise_torch ({table!r})")

        copy_src, copy_dst = src[:n], torch.empty(n, dtype=torch.uint8, device="cuda")
        ms = time_ms(lambda: copy_dst.copy_(copy_src), args.warmup, args.iters)
        del copy_dst
        copy_ms = ms
        modes[f"copy-{label}"] = {"step_ms": ms, "ms": ms, "gbps": _gbps(n, ms), "bytes_moved": n}
        for i, (table, *_) in enumerate(tables):
            name = f"triton-{label}" if i == 0 else f"triton-{label}-tile{table.tile_bytes}"
            ms = time_ms(lambda: materialise(src, dst, table), args.warmup, args.iters)
            modes[name] = {
                "step_ms": ms,
                "ms": ms,
                "gbps": _gbps(n, ms),
                "ratio_to_copy": copy_ms / ms,
                "bytes_moved": n,
                "tile_bytes": table.tile_bytes,
                "num_warps": table.num_warps,
                "segments": table.num_segments,
                "tiles": table.num_tiles,
                "align": table.align,
            }
        if args.graph:
            table = tables[0][0]
            try:
                graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    materialise(src, dst, table)
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph):
                    materialise(src, dst, table)
                ms = time_ms(graph.replay, args.warmup, args.iters)
                modes[f"triton-graph-{label}"] = {
                    "step_ms": ms, "ms": ms, "gbps": _gbps(n, ms), "ratio_to_copy": copy_ms / ms, "bytes_moved": n,
                }
                del graph
            except Exception as exc:  # report, keep the eager figures
                print(f"[{label}] graph capture failed: {exc!r}", file=sys.stderr)
        del src, dst, ref, copy_src
        torch.cuda.empty_cache()
    return modes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", nargs="+", choices=["single", "double"], default=["single", "double"],
                   help="single = ~300 MB Flux single-stream block, double = ~700 MB double-stream block")
    p.add_argument("--world-size", type=int, default=2, help="ranks the MLP weights are sharded over (default 2)")
    p.add_argument("--tile-bytes", type=int, nargs="+", default=None,
                   help="tile sizes to time; the first is reported as triton-<size> (default: the library default)")
    p.add_argument("--num-warps", type=int, default=None, help="warps per program (default: the library default)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph replay mode")
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results", help="results folder")
    p.add_argument("--check", action="store_true", help=f"exit 1 if any triton mode is below {TARGET_RATIO} x copy")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_materialise needs a CUDA GPU", file=sys.stderr)
        return 2
    from weightstream.kernels.materialise import DEFAULT_NUM_WARPS, DEFAULT_TILE_BYTES

    args.tile_bytes = args.tile_bytes or [DEFAULT_TILE_BYTES]
    args.num_warps = args.num_warps or DEFAULT_NUM_WARPS

    modes = run(args)
    gpu = torch.cuda.get_device_name()
    commit = short_commit()
    result = {
        "scenario": "materialise",
        "gpu": gpu,
        "gpus": 1,
        "commit": commit,
        "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "bytes_moved": "bytes written to the runtime image per call; reads are as many; gbps = bytes_moved / ms",
        "world_size": args.world_size,
        "modes": modes,
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    from perf.results import write_result

    path = write_result(args.out, result)

    print(f"\n{'mode':<28} {'MB moved':>9} {'ms':>8} {'GB/s':>8} {'x copy':>7}")
    for name, m in modes.items():
        ratio = f"{m['ratio_to_copy']:.3f}" if "ratio_to_copy" in m else "-"
        print(f"{name:<28} {m['bytes_moved'] / 1e6:>9.1f} {m['ms']:>8.3f} {m['gbps']:>8.1f} {ratio:>7}")
    print(f"(GB/s counts bytes written; DRAM traffic is 2x. target: triton >= {TARGET_RATIO} x copy)\nwrote {path}")
    low = [k for k, m in modes.items() if "ratio_to_copy" in m and m["ratio_to_copy"] < TARGET_RATIO]
    if low:
        print(f"below target: {', '.join(low)}", file=sys.stderr)
    return 1 if args.check and low else 0


if __name__ == "__main__":
    sys.exit(main())
