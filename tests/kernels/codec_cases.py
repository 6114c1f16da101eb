"""Shared inputs and checks of the codec tests (tests/kernels/test_codec*.py): bit patterns from
integer arithmetic alone (the same on every torch), the reference round trip, the kernel against the
reference on one canvas, and the GPU eager-and-graph decode. Every comparison is exact."""
import pytest
import torch

from weightstream.fills import FILLS, fill
from weightstream.kernels.codec import decode, decode_tensor, decode_torch
from weightstream.kernels.codec_encode import encode
from weightstream.kernels.codec_format import DecodeTable, read_header


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.int16]
SMALL_TILE = 128  # the smallest tile: several tiles at interpreter-friendly sizes


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.int16)


def _all_patterns(dtype, seed=0) -> torch.Tensor:
    """Every 16-bit pattern once, shuffled (NaN payloads, +-inf, subnormals, -0 included)."""
    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(seed))
    return (perm - 32768).to(torch.int16).view(dtype)


def _every_symbol(dtype, per: int = 8, seed: int = 0) -> torch.Tensor:
    """Every coded symbol (the exponent byte: bits 7-14 of bf16, the high byte of fp16) ``per``
    times, each with other bits drawn from its 256 patterns, shuffled: the kernel's whole symbol
    space at ``per / 256`` of :func:`_all_patterns`' tiles (the bits beside the symbol are copied
    raw). Kernel sweeps over k and paths use it; every pattern runs once per dtype and path."""
    x = _all_patterns(dtype, seed)
    s = x.view(torch.int16).to(torch.int32) & 0xFFFF
    sym = (s >> 7) & 0xFF if dtype == torch.bfloat16 else s >> 8
    order = torch.argsort(sym, stable=True)  # 256 runs of one symbol, 256 patterns each
    keep = order[torch.arange(65536) % 256 < per]
    return x[keep[torch.randperm(keep.numel(), generator=torch.Generator().manual_seed(seed))]]


def _roundtrip(x: torch.Tensor, **kw) -> torch.Tensor:
    blob = encode(x, **kw)
    head = read_header(blob)
    assert blob.numel() == head.nbytes and head.nbytes % 16 == 0
    y = decode_tensor(blob, x.shape)
    assert y.dtype == x.dtype
    assert torch.equal(_bits(y), _bits(x))
    return blob


def _kernel_vs_reference(buf: torch.Tensor, table: DecodeTable, seed=0):
    """Kernel and reference on one random canvas (bytes outside segments must survive)."""
    gen = torch.Generator().manual_seed(seed)
    canvas = torch.randint(0, 256, (table.dst_nbytes + 64,), dtype=torch.uint8, generator=gen)
    out = canvas.clone().to(DEVICE)
    ref = canvas.clone()
    assert decode(buf.to(DEVICE), out, table) == table.decoded_nbytes
    assert decode_torch(buf, ref, table) == table.decoded_nbytes
    out = out.cpu()
    assert torch.equal(out, ref)
    covered = torch.zeros(canvas.numel(), dtype=torch.bool)
    for s in table.segments:
        covered[s.dst_offset : s.dst_end] = True
    assert torch.equal(out[~covered], canvas[~covered])
    return out


def _edge_input(numel: int, dtype) -> torch.Tensor:
    """Student-t bf16 bits of `numel` elements, viewed as `dtype` (seeded by the size)."""
    gen = torch.Generator().manual_seed(numel)
    x = fill("student-t", (numel,), dtype=torch.float32, generator=gen).to(torch.bfloat16).view(torch.int16)
    return x.view(dtype)


def _random_bits(numel: int, seed: int) -> torch.Tensor:
    return torch.randint(-32768, 32768, (numel,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(seed)).to(torch.int16)


def _gpu_ok():
    if torch.cuda.get_device_capability() < (7, 0):
        pytest.fail("Triton needs compute capability >= 7.0")


def _flux_like(gen):
    """A Flux single-stream-block-like set of tensors (scaled down 4x per dim), all fills."""
    shapes = [(2304, 768), (2304,), (5376, 768), (5376,), (128,), (768, 3840), (768,)]
    out = []
    for i, s in enumerate(shapes):
        x = fill(FILLS[i % 3], s, generator=gen)
        out.append(x if i != 2 else x.float().to(torch.float16))
    return out


def _gpu_decode_eager_and_graph(buf, table, ref):
    """Decode `buf` on CUDA eagerly, then from a captured CUDA graph (replayed into a zeroed
    `dst`); both must equal the reference bytes `ref`. Returns (src, dst, graph)."""
    src = buf.cuda()
    dst = torch.zeros_like(ref, device="cuda")
    decode(src, dst, table)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), ref)
    table.upload(dst.device)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode(src, dst, table)  # warm-up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        decode(src, dst, table)
    dst.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), ref)
    return src, dst, graph


def _weightlike_bits(numel: int, window: int = 8, dtype=torch.bfloat16) -> torch.Tensor:
    """bf16 bit patterns from integer arithmetic alone (no RNG: the same on every torch):
    exponents mostly in a window of `window` (7: the coder's table is a window; 8: a lookup),
    every 97th element anywhere, so the coder escapes. Other dtypes view the same bits."""
    h = (torch.arange(numel, dtype=torch.int64) * 2654435761) % 4294967291
    exp = torch.where(h % 97 == 0, (h >> 11) % 256, 126 - window + (h >> 3) % window)
    bits = ((h >> 20) & 1) << 15 | exp << 7 | (h & 0x7F)
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(dtype)


def _skewed_bits(numel: int, dtype=torch.bfloat16, window: bool = True) -> torch.Tensor:
    """Weight-like bf16 bit patterns from integer arithmetic alone (no RNG): exponents
    126, 125, ... with Student-t-like falling frequencies (18, 14, 12, 8, 4, 3, 2, 1, 1, 1 in
    64), every 97th element anywhere. window=False moves the second most frequent exponent
    away (the level-1 table is then a lookup, not a window). Other dtypes view the bits."""
    h = (torch.arange(numel, dtype=torch.int64) * 2654435761) % 4294967291
    off = torch.bucketize((h >> 3) % 64, torch.tensor([18, 32, 44, 52, 56, 59, 61, 62, 63]), right=True)
    if not window:
        off = torch.where(off == 1, torch.full_like(off, 40), off)
    exp = torch.where(h % 97 == 0, (h >> 11) % 256, 126 - off)
    bits = ((h >> 20) & 1) << 15 | exp << 7 | (h & 0x7F)
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(dtype)


def _poke(blob: torch.Tensor, at: int, fmt: str, value: int) -> torch.Tensor:
    """A copy of `blob` with `value` packed little-endian (struct `fmt`) at byte `at`."""
    import struct

    raw = bytearray(blob.numpy().tobytes())
    struct.pack_into("<" + fmt, raw, at, value)
    return torch.frombuffer(raw, dtype=torch.uint8).clone()
