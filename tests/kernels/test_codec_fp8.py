"""The codec's 8-bit element path (kernels/codec_format.py: float8_e4m3fn / float8_e5m2, the byte is
the symbol, no raw stream): the CPU encoder against the torch reference decoder, the Triton decoder
and the GPU encoder under TRITON_INTERPRET=1 (small tiles), golden digests, every 8-bit pattern, the
host store's rule (int8 / uint8 stay raw), and on a GPU a large fp8 tensor through the compiled
kernels. Every comparison is exact (`torch.equal` on the bytes)."""
import hashlib

import pytest
import torch

from weightstream.kernels.codec import decode_tensor
from weightstream.kernels.codec_encode import encode, encode_block
from weightstream.kernels.codec_encode_gpu import EncodeJob, encode_gpu, encode_jobs
from weightstream.kernels.codec_format import PATCHED, DecodeTable, read_header
from weightstream.offload.host.encode import _encode_tensor, _raw_bound, encode_image
from weightstream.offload.host.encode_device import by_offset, code_on_device, fill_from_tensors, pieces
from weightstream.offload.layout import build_layout

from codec_cases import DEVICE, SMALL_TILE, _gpu_decode_eager_and_graph, _gpu_ok, _kernel_vs_reference

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
LEVELS = [1, 2, PATCHED]
TILE = 4 * SMALL_TILE


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _fp8_bits(numel: int, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Weight-like float8 bytes from integer arithmetic alone (no RNG, no float cast: the same on
    every torch): the exponent field with falling frequencies, sign and mantissa from the hash,
    every 61st byte anywhere (escapes)."""
    mbits = 3 if dtype == torch.float8_e4m3fn else 2
    top = 6 if mbits == 3 else 14  # the most frequent exponent field
    h = (torch.arange(numel, dtype=torch.int64) * 2654435761) % 4294967291
    off = torch.bucketize((h >> 3) % 64, torch.tensor([20, 36, 46, 54, 58, 61, 63]), right=True)
    b = ((h >> 20) & 1) << 7 | (top - off) << mbits | (h & ((1 << mbits) - 1))
    b = torch.where(h % 61 == 0, (h >> 11) % 256, b)
    return b.to(torch.uint8).view(dtype)


def _cast(kind: str, numel: int, dtype, std: float = 0.02, seed: int = 0) -> torch.Tensor:
    """fp8-cast weights as diffusers' layerwise casting stores them (bf16 weights cast)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) if kind == "gaussian" else \
        torch.distributions.StudentT(4.0).sample((numel,)).clamp(-50, 50)
    return (x * std).to(torch.bfloat16).to(dtype)


def _every_pattern(dtype, seed: int = 0) -> torch.Tensor:
    """Every 8-bit pattern once, shuffled (NaN, +-inf of e5m2, subnormals, -0 included)."""
    return torch.randperm(256, generator=torch.Generator().manual_seed(seed)).to(torch.uint8).view(dtype)


def _roundtrip(x: torch.Tensor, **kw) -> torch.Tensor:
    blob = encode(x, **kw)
    head = read_header(blob)
    assert head.dtype == x.dtype and head.raw_bytes == 0 and head.raw_off == head.code_off
    assert blob.numel() == head.nbytes and head.nbytes % 16 == 0 and head.decoded_bytes == x.numel()
    y = decode_tensor(blob, x.shape)
    assert y.dtype == x.dtype and torch.equal(_u8(y), _u8(x))
    return blob


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("levels", LEVELS)
def test_round_trip_sizes_and_levels(dtype, levels):
    for n in (1, TILE - 1, TILE, TILE + 1, 3 * TILE + 1):
        _roundtrip(_fp8_bits(n, dtype), levels=levels, tile=TILE)
    for k in range(1, 9):  # every k, escapes or none
        _roundtrip(_fp8_bits(2 * TILE + 3, dtype), k=k, levels=levels, tile=TILE)
    _roundtrip(torch.full((300,), 0x38, dtype=torch.uint8).view(dtype), tile=TILE)  # one symbol: k = 0
    _roundtrip(torch.zeros(0, dtype=dtype), levels=levels)


@pytest.mark.parametrize("dtype", FP8)
def test_every_8_bit_pattern_round_trips(dtype):
    x = _every_pattern(dtype)
    for levels in LEVELS:
        for k in range(1, 9):
            _roundtrip(x, k=k, levels=levels, tile=SMALL_TILE)
        _roundtrip(x, levels=levels, tile=SMALL_TILE)


def test_fp8_cast_weights_code_below_their_bytes():
    """The measured ratios (docs/codecs.md): fp8-cast Gaussian / Student-t weights at std 0.02."""
    bounds = {(torch.float8_e4m3fn, "gaussian"): (0.76, 0.71), (torch.float8_e5m2, "gaussian"): (0.77, 0.74),
              (torch.float8_e4m3fn, "student-t"): (0.77, 0.77), (torch.float8_e5m2, "student-t"): (0.78, 0.78)}
    for (dtype, kind), (one, two) in bounds.items():
        x = _cast(kind, 1 << 18, dtype)
        r1 = read_header(_roundtrip(x)).ratio
        r2 = read_header(_roundtrip(x, levels=2)).ratio
        assert r1 < one and r2 <= r1 and r2 < two, (dtype, kind, r1, r2)


def test_int8_is_not_a_coded_dtype_and_the_host_keeps_it_raw():
    for dtype in (torch.int8, torch.uint8):
        with pytest.raises(TypeError, match="tensor dtype must be one of"):
            encode(torch.zeros(16, dtype=dtype))
    gen = torch.Generator().manual_seed(0)
    ts = [("i", "param", torch.randint(-128, 128, (1001,), generator=gen, dtype=torch.int8)),
          ("q", "param", _fp8_bits(40000)),
          ("n", "param", torch.randint(0, 256, (4096,), generator=gen, dtype=torch.uint8).view(torch.float8_e5m2))]
    lay = build_layout(0, "b", ts)
    blobs, table = encode_image(lay, [t for _, _, t in ts])
    heads = [read_header(b) for b in blobs]
    assert heads[0].dtype == torch.int16 and heads[0].k == 8  # int8: raw, its bytes as int16
    assert heads[1].dtype == torch.float8_e4m3fn and heads[1].k < 8 and heads[1].nbytes < 40000
    # incompressible fp8: k = 8, its code stream the bytes as they are (within the raw bound)
    assert heads[2].k == 8 and heads[2].num_exceptions == 0 and heads[2].nbytes <= _raw_bound(lay.tensors[2])
    image = torch.zeros(lay.nbytes, dtype=torch.uint8)
    from weightstream.kernels.codec import decode_torch

    decode_torch(torch.cat(blobs), image, table)
    for spec, (_, _, t) in zip(lay.tensors, ts):
        assert torch.equal(image[spec.offset : spec.offset + spec.nbytes], _u8(t))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("levels", LEVELS)
def test_triton_decoder_with_mixed_tables(levels, packed):
    """One launch decoding fp8 tensors (odd byte counts) beside bf16 / fp16 ones: 512-byte aligned
    (the bf16 word path beside the fp8 element path) or packed at even offsets, some 2 mod 4: the
    reference's bytes, bytes outside the tensors untouched."""
    from codec_cases import _skewed_bits

    ts = [_fp8_bits(TILE + 1), _skewed_bits(3 * TILE), _fp8_bits(2 * TILE - 1, torch.float8_e5m2),
          _every_pattern(torch.float8_e4m3fn).repeat(3), _skewed_bits(TILE + 5, torch.float16), _fp8_bits(7)]
    dst = None
    if packed:
        dst, at = [], 0
        for t in ts:
            at += at % 2 + (2 if len(dst) % 2 else 0)  # even, some 2 mod 4
            dst.append(at)
            at += t.numel() * t.element_size()
    buf, table = encode_block(ts, dst, tile=TILE, levels=levels)
    dst = [s.dst_offset for s in table.segments]
    assert table.bytes8
    assert table.words == (not packed) if levels == 1 else not (packed and table.words)  # packed: no uint32 stores
    out = _kernel_vs_reference(buf, table)
    for t, d in zip(ts, dst):
        assert torch.equal(out[d : d + t.numel() * t.element_size()], _u8(t))
    k8 = DecodeTable(table.segments, gather_planes=False)  # the whole-tile element path
    _kernel_vs_reference(buf, k8)


def test_triton_decoder_fp8_only_and_patched_paths():
    xs = [_fp8_bits(3 * TILE + 17), _fp8_bits(TILE, torch.float8_e5m2)]
    for levels in LEVELS:
        buf, table = encode_block(xs, tile=TILE, levels=levels)
        _kernel_vs_reference(buf, table)
        _kernel_vs_reference(buf, DecodeTable(table.segments, level2=True, patch=True, ranked=True))


def _concat(tensors):
    jobs, parts, at = [], [], 0
    for t in tensors:
        b = _u8(t)
        pad = -(at + b.numel()) % 512
        jobs.append(EncodeJob(at, b.numel(), t.dtype))
        parts += [b, torch.zeros(pad, dtype=torch.uint8)]
        at += b.numel() + pad
    return torch.cat(parts), jobs


@pytest.mark.parametrize("levels", LEVELS)
def test_gpu_encoder_gives_the_cpu_bytes(levels):
    from codec_cases import _skewed_bits

    xs = [_fp8_bits(1), _fp8_bits(TILE - 1), _fp8_bits(3 * TILE + 1, torch.float8_e5m2),
          _every_pattern(torch.float8_e5m2),
          torch.full((300,), 0x41, dtype=torch.uint8).view(torch.float8_e4m3fn), _skewed_bits(TILE + 1),
          torch.zeros(0, dtype=torch.float8_e4m3fn)]
    src, jobs = _concat(xs)
    coded, heads, offsets = encode_jobs(src.to(DEVICE), jobs, levels=levels, tile=TILE)
    coded = coded.cpu()
    for x, h, o in zip(xs, heads, offsets):
        want = encode(x, levels=levels, tile=TILE)
        assert read_header(want) == h and torch.equal(coded[o : o + h.nbytes], want), (x.dtype, x.numel(), h)
    for k in (1, 5, 8):
        kjobs = [EncodeJob(j.src_offset, j.nbytes, j.dtype, k) for j in jobs[1:4]]
        coded, heads, offsets = encode_jobs(src.to(DEVICE), kjobs, levels=levels, tile=TILE)
        for x, h, o in zip(xs[1:4], heads, offsets):
            assert torch.equal(coded.cpu()[o : o + h.nbytes], encode(x, k=k, levels=levels, tile=TILE)), k


def test_gpu_encoder_of_one_odd_tensor():
    """``encode_gpu`` of one float8 tensor of an odd byte count (and of a view at an odd address):
    the kernels load byte pairs, so it codes a padded copy; the CPU bytes."""
    x = _fp8_bits(TILE + 3)
    view = _fp8_bits(2 * TILE + 2)[1:]  # odd storage offset and odd length
    for t in (x, view):
        assert torch.equal(encode_gpu(t.to(DEVICE), tile=TILE).cpu(), encode(t, tile=TILE))


def test_gpu_encoder_raw_past_the_bound_as_the_host_does():
    """A float8 job past its max_coded is coded as its bytes in int16 elements at k = 8 (an odd byte
    count with a zero high byte last): the host store's rule, on fewer tiles than the job's own."""
    xs = [_fp8_bits(1001), _fp8_bits(3 * TILE, torch.float8_e5m2)]
    src, jobs = _concat(xs)
    jobs = [EncodeJob(j.src_offset, j.nbytes, j.dtype, None, 64) for j in jobs]
    coded, heads, offsets = encode_jobs(src.to(DEVICE), jobs, tile=TILE)
    for x, h, o in zip(xs, heads, offsets):
        b = _u8(x)
        b = torch.cat([b, b.new_zeros(b.numel() % 2)])
        assert h.dtype == torch.int16 and torch.equal(coded.cpu()[o : o + h.nbytes], encode(b.view(torch.int16), k=8,
                                                                                              tile=TILE))


def test_block_with_fp8_through_the_staging_pair():
    """code_on_device (RecordingStreams on the CPU): encode_image's bytes and table for a block of a
    layerwise-casting model's kinds of tensors (fp8 weights, bf16 norms and biases)."""
    g = torch.Generator().manual_seed(2)
    ts = [("w", "param", _cast("gaussian", 96 * 128, torch.float8_e4m3fn).view(96, 128)),
          ("b", "param", (torch.randn(96, generator=g) * 0.02).bfloat16()),
          ("v", "param", _cast("student-t", 1001, torch.float8_e5m2)),
          ("n", "param", torch.ones(128, dtype=torch.bfloat16))]
    lay = build_layout(0, "b0", ts)
    objs = [t for _, _, t in ts]
    for levels in LEVELS:
        got = {}
        region = torch.zeros(2 * lay.nbytes + 65536, dtype=torch.uint8)
        code_on_device(DEVICE, [pieces(0, lay, 1 << 20)], levels, fill_from_tensors(lambda k, specs: by_offset(
            lay, objs, specs)), lambda k, at, n: (region[at : at + n], "pageable"),
            lambda k, n, table: got.setdefault(k, (n, table)))
        blobs, table = encode_image(lay, objs, levels=levels)
        want = torch.cat(blobs)
        assert got[0][0] == want.numel() and torch.equal(region[: want.numel()], want)
        assert got[0][1].segments == table.segments and got[0][1].options() == table.options()
        assert table.bytes8 and table.options()["bytes8"]  # the block holds fp8 tensors: compiled for them


def test_a_block_with_raw_fp8_compiles_the_8_bit_stores():
    """A block whose fp8 tensor is stored raw (int16 at k = 8: incompressible) may code it after an
    update; a CUDA graph captured over its first table replays the kernel compiled for that table, so
    the table compiles the 8-bit stores already (bytes8), and decodes the re-encoded block."""
    from weightstream.kernels.codec import decode

    gen = torch.Generator().manual_seed(4)
    n = 4097  # two tiles of fp8 bytes at k = 8 pass the raw bound of one tile of int16 elements
    noise = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ts = [("q", "param", noise), ("b", "param", (torch.randn(64, generator=gen) * 0.02).bfloat16())]
    lay = build_layout(0, "b0", ts)
    blobs, first = encode_image(lay, [t for _, _, t in ts])
    assert read_header(blobs[0]).dtype == torch.int16 and first.bytes8  # raw now, compiled for fp8 anyway
    i = torch.arange(n)
    new = torch.where(i % 97 == 0, 0x45, torch.tensor([0x30, 0x31, 0xB0])[i % 3]).to(torch.uint8).view(
        torch.float8_e4m3fn)  # three bytes and escapes: k = 2
    blobs2, second = encode_image(lay, [new, ts[1][2]])
    assert read_header(blobs2[0]).dtype == torch.float8_e4m3fn and read_header(blobs2[0]).k < 8
    replay = DecodeTable(second.segments, **first.options())  # the new records, the first table's paths
    assert replay.bytes8 == first.bytes8
    out = torch.zeros(lay.nbytes, dtype=torch.uint8)
    decode(torch.cat(blobs2), out, replay)
    assert torch.equal(out[:n], _u8(new))


# sha256 of the coded bytes of _fp8_bits as the 8-bit path first shipped them (2026-12-03)
GOLDEN_SHA256 = {
    ("e4m3fn", 1): "ba0ce768d688a618d419117e5ba784a7e99d6ecbfb21598e586db83b88d715f0",
    ("e5m2", 2): "a5afc168bc62064edddc46d8eba7626bc2d5b445a3f31fa4deceeb4158c04cfc",
    ("e4m3fn", PATCHED): "b959539dcefe339ad802e288571190afa34875fde23b4e5104c178428d1d5541",
}


def _golden(case):
    name, levels = case
    dtype = torch.float8_e4m3fn if name == "e4m3fn" else torch.float8_e5m2
    return _fp8_bits(1_200_001, dtype), levels


@pytest.mark.parametrize("case", sorted(GOLDEN_SHA256))
def test_golden_digests(case):
    x, levels = _golden(case)
    blob = encode(x, levels=levels)
    head = read_header(blob)
    assert 1 <= head.k <= 7 and head.num_exceptions > 0
    assert hashlib.sha256(blob.numpy().tobytes()).hexdigest() == GOLDEN_SHA256[case]


def test_spec_rule_codes_fp8_and_keeps_the_raw_bound():
    spec_t = _fp8_bits(1 << 16)
    lay = build_layout(0, "b", [("q", "param", spec_t)])
    blob = _encode_tensor(spec_t, lay.tensors[0])
    assert read_header(blob).dtype == torch.float8_e4m3fn and blob.numel() < 0.9 * (1 << 16)


@pytest.mark.gpu
def test_gpu_large_fp8_tensor_through_the_compiled_kernels():
    """The compiled kernels on CUDA: a 64 MB fp8-cast Gaussian tensor and a Student-t one, every
    level: the GPU encoder gives the CPU bytes, the decoder (eager and from a CUDA graph) the
    tensor's bytes; the golden digests on the GPU encoder."""
    _gpu_ok()
    for case, digest in GOLDEN_SHA256.items():
        x, levels = _golden(case)
        got = encode_gpu(x.cuda(), levels=levels).cpu()
        assert hashlib.sha256(got.numpy().tobytes()).hexdigest() == digest, case
    big = [_cast("gaussian", 64 << 20, torch.float8_e4m3fn), _cast("student-t", 24 << 20, torch.float8_e5m2, seed=1)]
    for x in big:
        for levels in LEVELS:
            blob = encode(x, levels=levels)
            assert torch.equal(encode_gpu(x.cuda(), levels=levels).cpu(), blob), (x.dtype, levels)
            table = DecodeTable.from_buffer(blob, [0], [0])
            # measured on the H200: e4m3fn Gaussian below 0.8 of its bytes, e5m2 Student-t 0.82 (two mantissa
            # bits: the coded exponent is a smaller share of each byte)
            assert table.bytes8 and read_header(blob).ratio < (0.8 if x.dtype == torch.float8_e4m3fn else 0.85)
            _gpu_decode_eager_and_graph(blob, table, _u8(x).clone())


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from weightstream.kernels._codec_kernels import _decode_kernel
from weightstream.kernels._codec_encode_kernels import _code_kernel, _escape_kernel
target = GPUTarget("cuda", 90, 32)

def build(fn, sig, const):
    names = list(sig) + list(const)
    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in const}},
                    constexprs={(names.index(k),): v for k, v in const.items()})
    return len(triton.compile(src, target=target, options={"num_warps": 4}).asm["ttir"])

sig = {"src_ptr": "*u8", "dst_ptr": "*i16", "dst8_ptr": "*u8", "table_ptr": "*i64", "num_segments": "i64"}
build(_decode_kernel, sig, dict(TILE=4096, SEARCH_STEPS=4, DST_ALIGN=8, GATHER=True, LEVEL2=True, WORDS=True,
                                PATCHED=True, RANKED=True, CHUNK=512, BYTES=True))  # every path
enc = {"src_ptr": "*u8", "out_ptr": "*u8", "rec_ptr": "*i64", "tile_job_ptr": "*i32", "lut_ptr": "*u8"}
build(_code_kernel, {**enc, "count_ptr": "*i32", "count2_ptr": "*i32"}, dict(TILE=4096))
build(_escape_kernel, {**enc, "excl_ptr": "*i64", "excl2_ptr": "*i64", "tmp2_ptr": "*u8"}, dict(TILE=4096))
print("compiled")
"""


def test_kernels_with_the_8_bit_path_compile_for_sm90():
    """The decoder with its 8-bit stores (BYTES, every other path on) and the encoder's code and
    escape kernels (their 8-bit symbol loads) compile for sm_90 without a
    GPU (a subprocess: the interpreter is on in this one): what the interpreter runs is what compiles."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
