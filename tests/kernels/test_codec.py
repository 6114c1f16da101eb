"""Lossless weight codec: encode -> reference decode is the identity on raw bits,
the Triton decoder (under TRITON_INTERPRET=1 on CPU) writes the same bytes as
the reference, and the coded sizes are what the format promises.
Every comparison is exact (`torch.equal` on integer views)."""
import math

import pytest
import torch

from weightstream.fills import FILLS, fan_in, fill
from weightstream.kernels.codec import (
    DEFAULT_TILE,
    HEADER_BYTES,
    CodecSegment,
    DecodeTable,
    bytes_moved,
    decode,
    decode_tensor,
    decode_torch,
    encode,
    encode_block,
    read_header,
    symbol_entropy,
)
from weightstream.kernels.codec import _words_for  # the launch's path choice (private)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.int16]
SMALL_TILE = 128  # the smallest tile: several tiles at interpreter-friendly sizes


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.int16)


def _all_patterns(dtype, seed=0) -> torch.Tensor:
    """Every 16-bit pattern once, shuffled (NaN payloads, +-inf, subnormals, -0 included)."""
    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(seed))
    return (perm - 32768).to(torch.int16).view(dtype)


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


# -- exhaustive ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [None, 1, 2, 3, 5, 7, 8])
def test_exhaustive_roundtrip_reference(dtype, k):
    x = _all_patterns(dtype)
    blob = _roundtrip(x, k=k)
    head = read_header(blob)
    assert head.k == (8 if k is None else k)  # 256 equally frequent symbols: nothing to gain
    if k is not None and k < 8:
        assert head.num_exceptions == 65536 - 256 * (2**k - 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [3, 8])
def test_exhaustive_kernel(dtype, k):
    x = _all_patterns(dtype, seed=1)
    buf, table = encode_block([x], k=k)
    out = _kernel_vs_reference(buf, table)
    assert torch.equal(out[: 2 * 65536], x.view(torch.uint8))


def test_special_values_survive():
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3.0e38, -1.0]
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.tensor(specials * 50, dtype=torch.float32).to(dtype)
        nan_payloads = torch.tensor([0x7FC1, 0x7F81, -0x7F, -0x1], dtype=torch.int16).view(dtype)
        _roundtrip(torch.cat([x, nan_payloads]))


# -- fills -----------------------------------------------------------------

# coded bytes / raw bytes on weight-like fills; bf16 bounds from the exponent
# entropy (DESIGN.md: 0.64 / 0.66 / 0.67) plus ~1/32 for the fixed-length code
RATIO_BOUNDS = {
    torch.bfloat16: {"uniform": (0.66, 0.70), "gaussian": (0.68, 0.71), "student-t": (0.69, 0.72)},
    torch.float16: {"uniform": (0.80, 0.90), "gaussian": (0.80, 0.91), "student-t": (0.80, 0.91)},
}


@pytest.mark.parametrize("kind", FILLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fills_roundtrip_and_ratio(kind, dtype):
    x = fill(kind, (384, 1024), dtype=dtype, generator=torch.Generator().manual_seed(3))
    head = read_header(_roundtrip(x))
    lo, hi = RATIO_BOUNDS[dtype][kind]
    assert lo <= head.ratio <= hi, (kind, dtype, head.ratio, head.k)
    assert head.bits_per_weight == pytest.approx(16 * head.ratio)
    # no code beats the symbol entropy: 8 raw bits + H per element
    assert head.bits_per_weight >= 8 + symbol_entropy(x) - 1e-6
    if dtype == torch.bfloat16:
        assert head.k in (2, 3)


def test_fills_are_deterministic_and_scaled():
    a = fill("student-t", (64, 256), generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    b = fill("student-t", (64, 256), generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    assert torch.equal(a, b)
    assert a.std().item() == pytest.approx(1 / math.sqrt(256), rel=0.15)
    u = fill("uniform", (64, 256), generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    assert u.abs().max().item() <= 1 / math.sqrt(256)
    g = fill("gaussian", (4096,), scale=2.0, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    assert g.std().item() == pytest.approx(2.0, rel=0.1)
    kurt = lambda t: ((t - t.mean()) ** 4).mean() / t.var() ** 2  # noqa: E731
    big = (256, 1024)
    t4 = fill("student-t", big, generator=torch.Generator().manual_seed(6), dtype=torch.float32)
    g4 = fill("gaussian", big, generator=torch.Generator().manual_seed(6), dtype=torch.float32)
    assert kurt(t4) > 4.5 > kurt(g4)  # heavy tails
    assert fan_in((3, 4, 5)) == 20 and fan_in((7,)) == 7 and fan_in(()) == 1


def test_fill_validation():
    with pytest.raises(ValueError, match="kind must be one of"):
        fill("laplace", (2,))
    with pytest.raises(ValueError, match="df must be an int >= 1"):
        fill("student-t", (2,), df=0)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        fill("gaussian", (2,), scale=-1.0)
    with pytest.raises(ValueError, match="shape must have sizes >= 0"):
        fill("gaussian", (2, -1))


# -- edge cases ------------------------------------------------------------


def _edge_input(numel: int, dtype) -> torch.Tensor:
    """Student-t bf16 bits of `numel` elements, viewed as `dtype` (seeded by the size)."""
    gen = torch.Generator().manual_seed(numel)
    x = fill("student-t", (numel,), dtype=torch.float32, generator=gen).to(torch.bfloat16).view(torch.int16)
    return x.view(dtype)


@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 3 * 128 + 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_sizes(numel, dtype):
    x = _edge_input(numel, dtype)
    blob = _roundtrip(x, tile=SMALL_TILE)
    buf, table = encode_block([x, x.flip(0)], tile=SMALL_TILE, k=3)
    assert table.num_tiles == 2 * -(-numel // SMALL_TILE)
    out = _kernel_vs_reference(buf, table, seed=numel)
    assert torch.equal(out[: 2 * numel], x.view(torch.uint8))
    assert read_header(blob).num_tiles == -(-numel // SMALL_TILE)


def test_escapes_at_tile_boundaries():
    """Escapes at the first and last element of tiles and runs of them across a
    boundary: each tile must find its exceptions through its stored base."""
    n = 5 * SMALL_TILE + 17
    x = torch.full((n,), 1.0, dtype=torch.bfloat16)
    rare = [0, SMALL_TILE - 1, SMALL_TILE, 2 * SMALL_TILE - 1, *range(3 * SMALL_TILE - 3, 3 * SMALL_TILE + 4), n - 1]
    vals = torch.tensor([2.0**e for e in range(-60, -60 + len(rare))], dtype=torch.bfloat16)
    x[rare] = vals
    x[4 * SMALL_TILE : 4 * SMALL_TILE + 5] = 0.5  # a second common symbol
    blob = _roundtrip(x, k=2, tile=SMALL_TILE, table=[126, 127, 128])
    head = read_header(blob)
    assert head.num_exceptions == len(rare)
    bases = blob[head.base_off : head.exc_off].view(torch.int64).tolist()
    assert bases == [0, 2, 4, 7, 11, 11]  # escapes before each tile
    _kernel_vs_reference(blob, DecodeTable([CodecSegment(0, 0, head)]))
    head_lut = read_header(encode(x, k=2, tile=SMALL_TILE))  # default table: 127, 126 and one rare symbol
    assert head_lut.num_exceptions == len(rare) - 1


@pytest.mark.parametrize("k", [1, 3, 7])
def test_all_escapes(k):
    """A table of symbols that never occur: every element is an exception."""
    x = fill("gaussian", (3 * SMALL_TILE + 1,), generator=torch.Generator().manual_seed(k))
    table = list(range(256 - (2**k - 1), 256))  # exponents of NaN/inf and huge values: absent
    blob = _roundtrip(x, k=k, table=table, tile=SMALL_TILE)
    head = read_header(blob)
    assert head.num_exceptions == x.numel() and head.table == tuple(table)
    segs = [CodecSegment(0, 0, head)]
    _kernel_vs_reference(blob, DecodeTable(segs))


def test_table_not_a_window_uses_lookup():
    """A table whose symbols are not consecutive exponents (the encoder's LUT path)."""
    x = fill("gaussian", (2 * SMALL_TILE + 3,), generator=torch.Generator().manual_seed(9))
    x[::7] = 0.0  # exponent 0 becomes frequent, far from the others
    blob = _roundtrip(x, k=3, tile=SMALL_TILE)
    head = read_header(blob)
    assert 0 in head.table and head.table != tuple(range(head.table[0], head.table[0] + 7))
    _kernel_vs_reference(blob, DecodeTable([CodecSegment(0, 0, head)]))


def test_single_symbol_uses_no_code_stream():
    x = fill("uniform", (1000,), dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    x = (x.abs() + 1.0).clamp(max=1.99).to(torch.bfloat16)  # every exponent is 127 (1 <= |x| < 2)
    head = read_header(_roundtrip(x, tile=SMALL_TILE))
    assert head.k == 0 and head.table == (127,) and head.num_exceptions == 0
    assert head.nbytes == head.raw_off + 1000 + 8 * 8 + 8  # raw bytes + tile bases, no codes
    x16 = torch.full((300,), -2.5, dtype=torch.float16)
    head16 = read_header(_roundtrip(x16, tile=SMALL_TILE))
    assert head16.k == 0
    buf, table = encode_block([x, x16, -x], tile=SMALL_TILE, align=16)
    _kernel_vs_reference(buf, table)


def test_sampled_histogram_never_trusts_one_symbol():
    """Over 1 Mi elements the encoder picks k from every 4th chunk of 256 Ki;
    a rare symbol outside the sample must still be coded (escape or k > 0)."""
    x = torch.full((5 << 18,), 1.0, dtype=torch.bfloat16)
    x[300_000] = 4.0  # in chunk 1, which the sample skips
    head = read_header(_roundtrip(x))
    assert head.k == 1 and head.table == (127,) and head.num_exceptions == 1  # 4.0 is the one escape
    with pytest.raises(ValueError, match="k=0 needs a tensor with one symbol value, this one has 2"):
        encode(x, k=0)
    with pytest.raises(ValueError, match="k=0 needs every symbol to be table"):
        encode(x, k=0, table=[127])


def test_mixed_block_one_launch():
    """Tensors of three dtypes, every k, odd sizes, at odd-but-even destination offsets."""
    gen = torch.Generator().manual_seed(11)
    blobs, segs, src_at, dst_at = [], [], 0, 6
    for i, k in enumerate([0, 1, 2, 3, 4, 5, 6, 7, 8, None]):
        dtype = DTYPES[i % 3]
        x = fill(FILLS[i % 3], (200 + 37 * i,), generator=gen)
        if k == 0:
            x = torch.full((150,), 3.0, dtype=torch.bfloat16)
        x = x.view(torch.int16).view(dtype) if dtype != torch.float16 else x.float().to(dtype)
        blob = encode(x, k=k, tile=SMALL_TILE)
        blobs.append(blob)
        segs.append(CodecSegment(src_at, dst_at, read_header(blob)))
        src_at += blob.numel()
        dst_at += 2 * x.numel() + 2 * (i % 4)
    table = DecodeTable(segs[::-1])  # any order
    assert table.dst_align == 1  # offsets are only even: scalar stores
    assert bytes_moved(table) == table.coded_nbytes + table.decoded_nbytes
    out = _kernel_vs_reference(torch.cat(blobs), table)
    gathered = _kernel_vs_reference(torch.cat(blobs), DecodeTable(segs, gather_planes=False, num_warps=2))
    assert torch.equal(gathered, out)
    assert not DecodeTable(segs).two_level  # version-1 tensors only: the one-level kernel


def test_encode_block_layout():
    gen = torch.Generator().manual_seed(4)
    ts = [fill(k, s, generator=gen) for k, s in zip(FILLS, [(33, 8), (100,), (5, 5, 5)])]
    buf, table = encode_block(ts, tile=SMALL_TILE)
    assert [s.dst_offset for s in table.segments] == [0, 1024, 1536]
    assert table.dst_align == 8 and table.tile == SMALL_TILE
    assert table.coded_nbytes == buf.numel() == sum(read_header(encode(t, tile=SMALL_TILE)).nbytes for t in ts)
    assert table.bits_per_weight == pytest.approx(8 * buf.numel() / sum(t.numel() for t in ts))
    re = DecodeTable.from_buffer(buf, [s.src_offset for s in table.segments], [s.dst_offset for s in table.segments])
    assert torch.equal(re.packed(), table.packed())
    out = _kernel_vs_reference(buf, table)
    for s, t in zip(table.segments, ts):
        assert torch.equal(out[s.dst_offset : s.dst_end], t.reshape(-1).view(torch.uint8))


def test_empty_table_moves_nothing():
    buf, table = encode_block([torch.zeros(0, dtype=torch.bfloat16)])
    dst = torch.full((4,), 7, dtype=torch.uint8, device=DEVICE)
    assert decode(buf.to(DEVICE), dst, table) == 0 and dst.tolist() == [7, 7, 7, 7]
    assert table.num_tiles == 0


def test_upload_is_cached():
    _, table = encode_block([torch.ones(3, dtype=torch.bfloat16)])
    assert table.upload(DEVICE) is table.upload(DEVICE)


def test_header_fields():
    x = fill("student-t", (1000,), generator=torch.Generator().manual_seed(8))
    blob = encode(x, tile=256)
    assert bytes(blob[:4].tolist()) == b"WSC1"
    h = read_header(blob)
    assert (h.dtype, h.numel, h.tile, h.k, len(h.table)) == (torch.bfloat16, 1000, 256, 3, 7)
    assert h.raw_off == 96 and h.code_off == 96 + 1008 and h.base_off == h.code_off + 4 * 96
    assert h.exc_off == h.base_off + 32 and h.nbytes == -(-(h.exc_off + h.num_exceptions) // 16) * 16
    assert h.raw_off >= HEADER_BYTES + 7 and h.decoded_bytes == 2000


# -- validation ------------------------------------------------------------


def test_encode_validation():
    x = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="tensor dtype must be one of"):
        encode(torch.ones(4))
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        encode([1.0])
    with pytest.raises(ValueError, match=r"k must be in \[0, 8\], got 9"):
        encode(x, k=9)
    with pytest.raises(ValueError, match="tile must be a power of two"):
        encode(x, tile=1000)
    with pytest.raises(ValueError, match=r"tile must be in \[128, 65536\], got 64"):
        encode(x, tile=64)
    with pytest.raises(ValueError, match="k=0 needs a tensor with one symbol value"):
        encode(torch.tensor([1.0, 4.0], dtype=torch.bfloat16), k=0)
    with pytest.raises(ValueError, match="table must hold 3 distinct symbols for k=2"):
        encode(x, k=2, table=[1, 2])
    with pytest.raises(ValueError, match="table needs k in"):
        encode(x, table=[1])


def test_header_validation():
    blob = encode(torch.ones(10, dtype=torch.bfloat16))
    bad = blob.clone()
    bad[0] = ord("X")
    with pytest.raises(ValueError, match="no coded tensor at offset 0"):
        read_header(bad)
    with pytest.raises(ValueError, match="too few for a header"):
        read_header(blob[:40])
    with pytest.raises(ValueError, match="needs .* bytes, buf has"):
        read_header(blob[:-16])
    bad = blob.clone()
    bad[32] += 16  # raw_off
    with pytest.raises(ValueError, match="inconsistent stream offsets"):
        read_header(bad)
    with pytest.raises(TypeError, match="buf must be a 1-D torch.uint8 tensor"):
        read_header(blob.view(torch.int16))


def test_launcher_and_table_validation():
    buf, table = encode_block([torch.ones(8, dtype=torch.bfloat16)])
    u8 = lambda n: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    for fn in (decode, decode_torch):
        with pytest.raises(TypeError, match="src dtype must be torch.uint8"):
            fn(buf.view(torch.int16), u8(16), table)
        with pytest.raises(TypeError, match="table must be a DecodeTable"):
            fn(buf, u8(16), [])
        with pytest.raises(ValueError, match="src has 16 bytes but the table reads up to byte"):
            fn(buf[:16], u8(16), table)
        with pytest.raises(ValueError, match="dst has 15 bytes but the table writes up to byte 16"):
            fn(buf, u8(15), table)
        with pytest.raises(ValueError, match="dst must start at an even address"):
            fn(buf, u8(20)[1:18], table)
        with pytest.raises(ValueError, match="overlap in memory"):
            big = torch.cat([buf, u8(64)])
            fn(big[: buf.numel()], big[16:], table)
    head = table.segments[0].header
    with pytest.raises(ValueError, match="src_offset must be a multiple of 16"):
        CodecSegment(8, 0, head)
    with pytest.raises(ValueError, match="dst_offset must be even"):
        CodecSegment(0, 3, head)
    with pytest.raises(ValueError, match="destination ranges overlap"):
        DecodeTable([CodecSegment(0, 0, head), CodecSegment(0, 14, head)])
    other = read_header(encode(torch.ones(8, dtype=torch.bfloat16), tile=256))
    with pytest.raises(ValueError, match="need one tile size"):
        DecodeTable([CodecSegment(0, 0, head), CodecSegment(0, 64, other)])
    with pytest.raises(TypeError, match="gather_planes must be a bool"):
        DecodeTable([], gather_planes=1)
    with pytest.raises(TypeError, match="words must be a bool"):
        DecodeTable([], words=1)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        DecodeTable([], num_warps=3)
    with pytest.raises(TypeError, match=r"segments\[0\] must be a CodecSegment"):
        DecodeTable([(0, 0, head)])
    with pytest.raises(TypeError, match="table must be a DecodeTable"):
        bytes_moved(None)


# -- the four-elements-per-word path ------------------------------------------


def _random_bits(numel: int, seed: int) -> torch.Tensor:
    return torch.randint(-32768, 32768, (numel,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(seed)).to(torch.int16)


def _word_cases(tile: int):
    """(tensor, k, table) coded with window tables the word path takes, escapes from none to
    every element (words holding 0..4 exceptions at every alignment of the exception stream)."""
    gen = torch.Generator().manual_seed(5)
    n = 3 * tile + 5  # a partial last tile (decoded element by element)
    st = fill("student-t", (n,), generator=gen)
    return [
        (st, 3, None),  # the encoder's window, ~6% escapes
        (st, 2, None),  # ~35% escapes
        (st, 4, None),  # almost none
        (_random_bits(n, 1), 2, (0, 1, 2)),  # ~99% escapes: words with 4
        (_random_bits(n, 2), 3, tuple(range(248, 255))),  # the highest window that cannot carry
        (_random_bits(n, 3).view(torch.float16), 4, tuple(range(240, 255))),
        (fill("gaussian", (n,), generator=gen).abs().half(), 3, tuple(range(37, 44))),  # fp16 (split): high byte
    ]


@pytest.mark.parametrize("words", [True, False])
def test_word_path_matches_the_reference(words):
    """Window tables (2 <= k <= 4, window + 2^k - 1 <= 255) decode four elements per word
    (`DecodeTable.words`); the bytes must equal the reference and the element path's."""
    cases = _word_cases(SMALL_TILE)
    blobs = [encode(t, k=k, table=tab, tile=SMALL_TILE) for t, k, tab in cases]
    heads = [read_header(b) for b in blobs]
    assert all(h.table == tuple(range(h.table[0], h.table[0] + 2**h.k - 1)) for h in heads)
    segs, at, off = [], 0, 0
    for b, h in zip(blobs, heads):
        segs.append(CodecSegment(at, off, h))
        at, off = at + b.numel(), (off + 2 * h.numel + 79) // 16 * 16  # 16-byte aligned, gaps between
    table = DecodeTable(segs, words=words)
    assert table.words is words and table.options()["words"] is words
    out = _kernel_vs_reference(torch.cat(blobs), table)
    for sg, (t, _, _) in zip(segs, cases):
        assert torch.equal(out[sg.dst_offset : sg.dst_end].view(torch.int16), _bits(t))


def test_word_path_is_taken_only_where_it_is_exact():
    """Tables the word path cannot add (a carry past the byte, not a window, k outside 2..4,
    a level-2 code over 3 bits) and odd element destinations leave it off; decoding stays exact."""
    x = _random_bits(2 * SMALL_TILE, 4)
    off_cases = [
        dict(k=4, table=tuple(range(241, 256))),  # window + 15 = 256: the add would carry
        dict(k=3, table=(1, 2, 3, 4, 5, 6, 8)),  # not a window
        dict(k=1, table=(7,)),
        dict(k=5, table=tuple(range(0, 31))),
        dict(k=8),
        dict(k=2, levels=2, k2=4),
    ]
    for kw in off_cases:
        blob = encode(x, tile=SMALL_TILE, **kw)
        if "k2" in kw:  # level 1 a window, but a level-2 table of 15: not held in registers
            blob = encode(_skewed_bits(x.numel()), tile=SMALL_TILE, **kw)
            assert read_header(blob).table[:3] == (124, 125, 126)
        table = DecodeTable([CodecSegment(0, 0, read_header(blob))])
        assert not table.words, kw
        _kernel_vs_reference(blob, table)
    blob = encode(x, k=3, table=tuple(range(100, 107)), tile=SMALL_TILE)
    head = read_header(blob)
    assert DecodeTable([CodecSegment(0, 0, head)]).words
    odd = DecodeTable([CodecSegment(0, 2, head)])  # element offset 1: uint32 stores would straddle
    assert not odd.words
    out = _kernel_vs_reference(blob, odd)
    assert torch.equal(out[2 : 2 + 2 * x.numel()].view(torch.int16), x)
    # a src off an 8-byte boundary or a dst off a 4-byte one: the element path, same bytes (one and two levels)
    u8 = lambda n: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    for blob in (blob, encode(_skewed_bits(x.numel()), k=2, k2=2, levels=2, tile=SMALL_TILE)):
        want = decode_tensor(blob).view(torch.int16)
        table = DecodeTable([CodecSegment(0, 0, read_header(blob))])
        assert table.words
        assert _words_for(blob, u8(2 * x.numel()), table)
        for shift in (1, 4):
            src, dst = torch.cat([u8(shift), blob])[shift:], u8(2 * x.numel() + 2)[2:]
            assert src.data_ptr() % 8 and dst.data_ptr() % 4 == 2
            assert not _words_for(src, u8(2 * x.numel()), table) and not _words_for(blob, dst, table)
            decode(src, dst, table)
            assert torch.equal(dst.view(torch.int16), want)


def _word_v2_cases(tile: int):
    """(tensor, k, k2) coded with two levels whose level-1 table is a window (the word path):
    every (k, k2) it takes on skewed weight-like bits, and level-1 escapes that mostly escape
    again (random bits beside a window of three frequent exponents: dense level-2 exceptions)."""
    n = 4 * tile + 9
    x = _skewed_bits(n)
    gen = torch.Generator().manual_seed(11)
    pos = torch.arange(n)
    frequent = ((62 + pos % 3) << 8 | pos % 256).to(torch.int16)  # int16: the high byte is the symbol
    dense = torch.where(pos % 2 == 0, frequent, _random_bits(n, 6))
    cases = [(x, k, k2) for k in (2, 3) for k2 in (1, 2, 3)]
    return cases + [(dense, 2, 3), (fill("student-t", (n,), generator=gen), 2, 3)]


def _coded_run(blobs, **options):
    segs, at, off = [], 0, 0
    for b in blobs:
        h = read_header(b)
        segs.append(CodecSegment(at, off, h))
        at, off = at + b.numel(), (off + 2 * h.numel + 79) // 16 * 16
    return torch.cat(blobs), DecodeTable(segs, **options)


@pytest.mark.parametrize("words", [True, False])
def test_word_path_two_levels(words):
    """Version 2 with a window level-1 table and k2 <= 3 decodes four elements per word too:
    level-2 codes read as one bit window per word, level-2 exceptions ranked per word."""
    cases = _word_v2_cases(SMALL_TILE)
    blobs = [encode(t, tile=SMALL_TILE, levels=2, k=k, k2=k2) for t, k, k2 in cases]
    heads = [read_header(b) for b in blobs]
    assert all(h.k2 for h in heads) and heads[-2].num_exceptions > heads[-2].numel // 3
    assert all(h.table[1 : 2**h.k - 1] == tuple(range(h.table[0] + 1, h.table[0] + 2**h.k - 1)) for h in heads)
    buf, table = _coded_run(blobs, words=words)
    assert table.words is words
    out = _kernel_vs_reference(buf, table)
    for sg, (t, _, _) in zip(table.segments, cases):
        assert torch.equal(out[sg.dst_offset : sg.dst_end].view(torch.int16), _bits(t))


# -- GPU -------------------------------------------------------------------


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


@pytest.mark.gpu
def test_gpu_decode_matches_reference_and_graph():
    """The real kernel on CUDA, byte for byte against the reference, eager and in a CUDA graph."""
    _gpu_ok()
    gen = torch.Generator().manual_seed(0)
    ts = _flux_like(gen) + [_all_patterns(torch.bfloat16), _all_patterns(torch.float16)]
    buf, table = encode_block(ts, tile=DEFAULT_TILE)
    ref = torch.zeros(table.dst_nbytes + 512, dtype=torch.uint8)
    decode_torch(buf, ref, table)
    for s, t in zip(table.segments, ts):
        assert torch.equal(ref[s.dst_offset : s.dst_end], t.reshape(-1).view(torch.uint8))
    src, dst, graph = _gpu_decode_eager_and_graph(buf, table, ref)
    # replay reads the coded bytes at replay time: flipped tensors coded with the
    # same k and tables have the same layout (table) and new contents
    ts2 = [t.flip(0) for t in ts]
    buf2 = _recode_same_layout(ts2, table)
    assert buf2.numel() == buf.numel() and not torch.equal(buf2, buf)
    src.copy_(buf2.cuda())
    graph.replay()
    torch.cuda.synchronize()
    for s, t in zip(table.segments, ts2):
        assert torch.equal(dst[s.dst_offset : s.dst_end].cpu(), t.reshape(-1).view(torch.uint8))


@pytest.mark.gpu
def test_gpu_word_path_matches_reference_and_graph():
    """The four-elements-per-word path on CUDA at the default tile: window tables from no
    escapes to every element, fp16, two levels, partial last tiles; eager and in a CUDA graph."""
    _gpu_ok()
    cases = _word_cases(DEFAULT_TILE)
    v2 = _word_v2_cases(DEFAULT_TILE)
    ts = [t for t, _, _ in cases] + [t for t, _, _ in v2]
    blobs = [encode(t, k=k, table=tab) for t, k, tab in cases]
    blobs += [encode(t, levels=2, k=k, k2=k2) for t, k, k2 in v2]
    segs, at, off = [], 0, 0
    for b, t in zip(blobs, ts):
        segs.append(CodecSegment(at, off, read_header(b)))
        at, off = at + b.numel(), off + 2 * t.numel() + 2046  # 8-byte aligned destinations, not all 16
    table = DecodeTable(segs)
    assert table.words
    buf = torch.cat(blobs)
    ref = torch.zeros(table.dst_nbytes, dtype=torch.uint8)
    decode_torch(buf, ref, table)
    for sg, t in zip(segs, ts):
        assert torch.equal(ref[sg.dst_offset : sg.dst_end], t.reshape(-1).view(torch.uint8))
    _gpu_decode_eager_and_graph(buf, table, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("src_shift, dst_shift", [(1, 0), (0, 2), (3, 6), (4, 0)])
def test_gpu_word_path_buffers_off_alignment(src_shift, dst_shift, levels):
    """A table that takes the word path, decoded from a src off an 8-byte boundary or into a dst
    off a 4-byte one: the launch falls back to the element path, whose base loads are bytes
    (no misaligned uint32 / int64 access)."""
    _gpu_ok()
    t = fill("student-t", (3, DEFAULT_TILE + 7), generator=torch.Generator().manual_seed(src_shift))
    buf, table = encode_block([t], levels=levels, k=2 if levels == 2 else None, k2=3 if levels == 2 else None)
    assert table.words and table.two_level == (levels == 2)
    src = torch.zeros(buf.numel() + src_shift, dtype=torch.uint8, device="cuda")[src_shift:]
    src.copy_(buf.cuda())
    dst = torch.zeros(table.dst_nbytes + dst_shift, dtype=torch.uint8, device="cuda")[dst_shift:]
    decode(src, dst, table)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), t.reshape(-1).view(torch.uint8))


def _recode_same_layout(tensors, table: DecodeTable) -> torch.Tensor:
    """Code `tensors` with the k and symbol tables of `table`'s segments, at its source offsets."""
    parts = []
    for t, s in zip(tensors, table.segments):
        h = s.header
        blob = encode(t, k=h.k, table=h.table if h.k < 8 else None, tile=h.tile)
        if read_header(blob).nbytes != h.nbytes:
            raise AssertionError(f"recoded tensor has {blob.numel()} bytes, the table has {h.nbytes}")
        parts.append(blob)
    return torch.cat(parts)


def test_recode_same_layout_keeps_the_table():
    """CPU check of the helper the GPU graph test relies on (sampled histograms included)."""
    gen = torch.Generator().manual_seed(12)
    ts = [fill("student-t", (4096, 320), generator=gen), fill("uniform", (333,), generator=gen)]
    buf, table = encode_block(ts, tile=SMALL_TILE)
    buf2 = _recode_same_layout([t.flip(0) for t in ts], table)
    table2 = DecodeTable.from_buffer(buf2, [s.src_offset for s in table.segments], [s.dst_offset for s in table.segments])
    assert torch.equal(table2.packed(), table.packed()) and not torch.equal(buf2, buf)
    ref = torch.zeros(table.dst_nbytes, dtype=torch.uint8)
    decode_torch(buf2, ref, table)
    for s, t in zip(table.segments, ts):
        assert torch.equal(ref[s.dst_offset : s.dst_end], t.flip(0).reshape(-1).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dst_shift", [0, 2, 16])
def test_gpu_big_tensor_unaligned_destinations(dst_shift):
    """A 3072x12288 Student-t tensor (Flux MLP size) plus a fp16 one at shifted destinations."""
    _gpu_ok()
    gen = torch.Generator().manual_seed(dst_shift)
    ts = [fill("student-t", (3072, 12288), generator=gen), fill("gaussian", (1000, 77), generator=gen).half()]
    offs = [dst_shift, dst_shift + 2 * ts[0].numel() + 6]
    buf, table = encode_block(ts, offs)
    dst = torch.zeros(table.dst_nbytes, dtype=torch.uint8, device="cuda")
    decode(buf.cuda(), dst, table)
    torch.cuda.synchronize()
    for s, t in zip(table.segments, ts):
        assert torch.equal(dst[s.dst_offset : s.dst_end].cpu(), t.reshape(-1).view(torch.uint8))


def _weightlike_bits(numel: int, window: int = 8, dtype=torch.bfloat16) -> torch.Tensor:
    """bf16 bit patterns from integer arithmetic alone (no RNG: the same on every torch):
    exponents mostly in a window of `window` (7: the coder's table is a window; 8: a lookup),
    every 97th element anywhere, so the coder escapes. Other dtypes view the same bits."""
    h = (torch.arange(numel, dtype=torch.int64) * 2654435761) % 4294967291
    exp = torch.where(h % 97 == 0, (h >> 11) % 256, 126 - window + (h >> 3) % window)
    bits = ((h >> 20) & 1) << 15 | exp << 7 | (h & 0x7F)
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(dtype)


# sha256 of the coded bytes as the format first shipped them (computed with the encoder before
# its speed-ups): the encoder may get faster, its bytes may not change
GOLDEN_SHA256 = {
    ("bf16-lookup", 5000): "822635647261d4d836d41a6c75cc60dad3ee31ac5a66732945d6dbccf3022541",
    ("bf16-lookup", 1_500_000): "3d182d68070e640887a0043c22af3bc405807d5219815e68d621d0360323fcb4",
    ("bf16-window", 1_500_000): "32180cab8a28c4aea23e797d91a149ca7ae5788c7717189bd8b3935853b9458f",
    ("fp16", 1_500_000): "4789bb8c91d561ed47c78e43461119370822314f1772025f7df9549aba166a17",
    ("int16-k8", 1_300_001): "fe0dda3ec4eaf54313e770073676825dabb4d61167b1f62c98e6eb850e864087",
}


def _golden_blob(case: str, numel: int) -> torch.Tensor:
    if case == "bf16-lookup":
        return encode(_weightlike_bits(numel))
    if case == "bf16-window":
        return encode(_weightlike_bits(numel, window=7))
    if case == "fp16":
        return encode(_weightlike_bits(numel, dtype=torch.float16))
    return encode(_weightlike_bits(numel, dtype=torch.int16), k=8, tile=1024)


@pytest.mark.parametrize("case, numel", sorted(GOLDEN_SHA256))
def test_encoded_bytes_are_the_format_golden_bytes(case, numel):
    import hashlib

    blob = _golden_blob(case, numel)
    head = read_header(blob)
    assert head.k == (8 if case == "int16-k8" else 3) and (head.num_exceptions > 0) == (case != "int16-k8")
    if case.startswith("bf16"):  # the window case codes by subtraction, the other by a lookup
        t = head.table
        assert all((b - a) % 256 == 1 for a, b in zip(t, t[1:])) == (case == "bf16-window")
    assert hashlib.sha256(blob.numpy().tobytes()).hexdigest() == GOLDEN_SHA256[(case, numel)]


def test_encoded_bytes_do_not_depend_on_intra_op_threads():
    t = fill("student-t", (1200, 1024), generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        blobs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            blobs.append(encode(t))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(blobs[0], b) for b in blobs[1:])
    assert torch.equal(decode_tensor(blobs[0], t.shape).view(torch.int16), t.view(torch.int16))


def test_bench_codec_build_path_figures():
    """perf/bench_codec.py's build-path rates: real encodes at 1 and 2 workers, figures that
    agree with each other, and a result file perf/results.py accepts."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from perf import bench_codec
    from perf.results import validate_result

    assert bench_codec.default_build_workers(16) == [1, 2, 4, 8, 16]
    assert bench_codec.default_build_workers(6) == [1, 2, 4, 6]
    assert bench_codec.default_build_workers(1) == [1]
    gen = torch.Generator().manual_seed(0)
    tensors = [fill("gaussian", (300, 1024), generator=gen),
               fill("gaussian", (64,), generator=gen, dtype=torch.float16)]
    modes = bench_codec.build_figures(tensors, blocks=3, workers=[1, 2], reps=2)
    assert sorted(modes) == ["triton-build-source", "triton-build-w1", "triton-build-w2"]
    raw = 3 * (300 * 1024 + 64) * 2
    for name, f in modes.items():
        assert f["raw_bytes"] == raw and f["blocks"] == 3 and f["reps"] == 2
        assert math.isclose(f["gbps"], raw / f["build_s"] / 1e9)
        assert math.isclose(f["gbps_per_worker"], f["gbps"] / f["workers"])
        assert f["cpu_gbps_per_core"] > 0 and math.isclose(f["step_ms"], 1e3 * f["build_s"])
    assert modes["triton-build-w2"]["workers"] == 2
    whole = modes["triton-build-source"]
    assert whole["workers"] == whole["cores"] == bench_codec.usable_cores()
    validate_result({"scenario": "codec-cpu", "gpu": "cpu", "gpus": 0, "commit": "abc", "torch": torch.__version__,
                     "date": "2026-01-01T00:00:00Z", "modes": modes})


def test_encode_into_out():
    t = fill("student-t", (700, 1600), generator=torch.Generator().manual_seed(5))
    ref = encode(t)
    big = torch.full((ref.numel() + 100,), 0xA5, dtype=torch.uint8)
    got = encode(t, out=big[16:])
    assert got.data_ptr() == big[16:].data_ptr() and torch.equal(got, ref)
    assert (big[:16] == 0xA5).all() and (big[16 + ref.numel():] == 0xA5).all(), "wrote outside the coded bytes"
    small = torch.zeros(ref.numel() - 1, dtype=torch.uint8)
    got = encode(t, out=small)
    assert got.data_ptr() != small.data_ptr() and torch.equal(got, ref) and not small.any()
    for bad in (torch.zeros(10, dtype=torch.int16), torch.zeros(2, 8, dtype=torch.uint8), [0] * 10):
        with pytest.raises(TypeError, match="out must be"):
            encode(t, out=bad)


@pytest.mark.parametrize("case", ["bf16-lookup", "bf16-window", "fp16"])
def test_encoded_bytes_do_not_depend_on_the_code_chunk(case, monkeypatch):
    """The encoder codes a tensor chunk by chunk (_CODE_CHUNK elements): any multiple of the tile
    gives the same bytes (the golden tensors fit one default chunk: cut them in many here)."""
    import weightstream.kernels.codec as codec_mod

    whole = _golden_blob(case, 1_500_000)
    monkeypatch.setattr(codec_mod, "_CODE_CHUNK", 3 * codec_mod.DEFAULT_TILE)
    assert torch.equal(_golden_blob(case, 1_500_000), whole)
    x = {"bf16-lookup": lambda: _weightlike_bits(1_500_000),
         "bf16-window": lambda: _weightlike_bits(1_500_000, window=7),
         "fp16": lambda: _weightlike_bits(1_500_000, dtype=torch.float16)}[case]()
    assert torch.equal(encode(x, _torch_index=True), whole)  # the torch escape path, chunk after chunk


@pytest.mark.parametrize("case", ["bf16-lookup", "bf16-window", "fp16"])
def test_torch_index_path_gives_the_golden_bytes(case):
    """The escape indices found with torch ops (the path a CUDA tensor takes: nonzero,
    searchsorted, indexing where the chunk lives) equal numpy's: the same golden bytes."""
    import hashlib

    x = {"bf16-lookup": lambda: _weightlike_bits(1_500_000),
         "bf16-window": lambda: _weightlike_bits(1_500_000, window=7),
         "fp16": lambda: _weightlike_bits(1_500_000, dtype=torch.float16)}[case]()
    blob = encode(x, _torch_index=True)
    assert hashlib.sha256(blob.numpy().tobytes()).hexdigest() == GOLDEN_SHA256[(case, 1_500_000)]


@pytest.mark.gpu
@pytest.mark.parametrize("numel", [1, 4095, 4097, 3_000_001])
def test_encode_on_the_gpu_gives_the_cpu_bytes(numel):
    """A CUDA tensor is coded on its device: the same bytes as the CPU encoder, into a CPU
    `out` (D2H) or as a CUDA buffer."""
    x = _weightlike_bits(numel)
    want = encode(x)
    on_gpu = encode(x.cuda())
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), want)
    out = torch.zeros(want.numel() + 64, dtype=torch.uint8)
    got = encode(x.cuda(), out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)


# -- two levels (version 2, codec "exp-k2") ---------------------------------


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, k2", [(None, None), (1, 1), (2, 3), (3, 2), (7, 7), (4, 0)])
def test_v2_exhaustive_roundtrip_reference(dtype, k, k2):
    x = _all_patterns(dtype)
    blob = _roundtrip(x, levels=2, k=k, k2=k2)
    head = read_header(blob)
    if k2 is None:  # 256 equally frequent symbols: one level (k = 8) is the smallest, version-1 bytes
        assert (head.version, head.k, head.k2) == (1, 8, 0) and torch.equal(blob, encode(x))
    elif k2 == 0:  # forced one level: exactly exp-k's bytes
        assert head.version == 1 and torch.equal(blob, encode(x, k=k))
    else:
        n1, n2 = 2**k - 1, 2**k2 - 1
        assert (head.version, head.k, head.k2, len(head.table)) == (2, k, k2, n1 + n2)
        assert head.num_escapes == 65536 - 256 * n1 and head.num_exceptions == 65536 - 256 * (n1 + n2)
        assert bytes(blob[:4].tolist()) == b"WSC1" and int(blob[4]) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, k2", [(2, 3), (3, 7), (1, 5)])
def test_v2_exhaustive_kernel(dtype, k, k2):
    x = _all_patterns(dtype, seed=1)
    buf, table = encode_block([x], levels=2, k=k, k2=k2)
    assert table.segments[0].header.k2 == k2
    out = _kernel_vs_reference(buf, table)
    assert torch.equal(out[: 2 * 65536], x.view(torch.uint8))


def test_v2_every_k1_k2_in_one_launch():
    """Every forced (k1, k2) in 1..7 x 1..7 beside version-1 tensors of every k, in one decode
    launch: the reference round trip of each and the kernel's bytes against the reference."""
    gen = torch.Generator().manual_seed(21)
    blobs, segs, src_at, dst_at = [], [], 0, 0
    cases = [(k1, k2) for k1 in range(1, 8) for k2 in range(1, 8)] + [(k, 0) for k in range(9)]
    for i, (k1, k2) in enumerate(cases):
        numel = 2 * SMALL_TILE + 19 * i % SMALL_TILE + 1
        x = fill(FILLS[i % 3], (numel,), generator=gen)
        if k1 == 0:
            x = torch.full((numel,), -3.0, dtype=torch.bfloat16)
        if i % 5 == 4:
            x = x.float().to(torch.float16)
        blob = _roundtrip(x, tile=SMALL_TILE, levels=2, k=k1, k2=k2)
        head = read_header(blob)
        assert (head.version, head.k, head.k2) == ((2, k1, k2) if k2 else (1, k1, 0))
        blobs.append(blob)
        segs.append(CodecSegment(src_at, dst_at, head))
        src_at += blob.numel()
        dst_at += 2 * numel + 2 * (i % 3)
    buf = torch.cat(blobs)
    out = _kernel_vs_reference(buf, DecodeTable(segs[::-1]))
    assert torch.equal(_kernel_vs_reference(buf, DecodeTable(segs, gather_planes=False, num_warps=2)), out)
    assert DecodeTable(segs).two_level


@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 3 * 128 + 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_v2_edge_sizes(numel, dtype):
    x = _edge_input(numel, dtype)
    blob = _roundtrip(x, tile=SMALL_TILE, levels=2, k=2, k2=3)
    head = read_header(blob)
    assert head.version == 2 and head.num_tiles == -(-numel // SMALL_TILE)
    assert head.nbytes >= head.exc_off + head.num_exceptions and head.code2_off % 16 == head.base2_off % 16 == 0
    _roundtrip(x, tile=SMALL_TILE, levels=2)  # the encoder's own choice
    buf, table = encode_block([x, x.flip(0)], tile=SMALL_TILE, levels=2, k=2, k2=3)
    assert table.num_tiles == 2 * -(-numel // SMALL_TILE)
    out = _kernel_vs_reference(buf, table, seed=numel)
    assert torch.equal(out[: 2 * numel], x.view(torch.uint8))


def test_v2_level2_escapes_in_one_tile():
    """Level-1 escapes spread over every tile, level-2 escapes (symbols in neither table) all
    in tile 3, runs of them at its ends: each tile finds both its level-2 codes (bit position
    from its base) and its exceptions (from its base2)."""
    n, t = 6 * SMALL_TILE + 17, SMALL_TILE
    pos = torch.arange(n)
    exps = torch.tensor([127, 126, 125])[pos % 3]  # the level-1 table (a window: 125..127)
    exps = torch.where(pos % 5 == 0, 120 + pos % 7 // 2, exps)  # level-2 symbols 120..123 in every tile
    rare = [3 * t, 3 * t + 1, 3 * t + 2, 3 * t + 50, 4 * t - 3, 4 * t - 2, 4 * t - 1]
    exps[rare] = torch.tensor([10, 20, 30, 200, 250, 0, 255])
    bits = (pos % 2) << 15 | exps << 7 | pos % 128
    x = (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.bfloat16)
    blob = _roundtrip(x, tile=t, levels=2, k=2, k2=2)
    head = read_header(blob)
    assert head.table[:3] == (125, 126, 127) and sorted(head.table[3:]) == [120, 121, 122]
    esc1 = int(((exps < 125) | (exps > 127)).sum())
    assert head.num_escapes == esc1 and head.num_exceptions == len(rare) + int((exps == 123).sum())
    bases2 = blob[head.base2_off : head.exc_off].view(torch.int64).tolist()
    per_tile = [int(((exps[i * t : (i + 1) * t] == 123)).sum()) for i in range(7)]
    per_tile[3] += len(rare)
    assert bases2 == [sum(per_tile[:i]) for i in range(7)]
    bases = blob[head.base_off : head.base_off + 8 * 7].view(torch.int64).tolist()
    assert bases == [int(((exps[: i * t] < 125) | (exps[: i * t] > 127)).sum()) for i in range(7)]
    _kernel_vs_reference(blob, DecodeTable([CodecSegment(0, 0, head)]))
    # k2 = 4: a level-2 table of 15 holds all 11 escaped symbols, no exception bytes left
    wide = _roundtrip(x, tile=t, levels=2, k=2, k2=4)
    assert read_header(wide).num_exceptions == 0
    _kernel_vs_reference(wide, DecodeTable([CodecSegment(0, 0, read_header(wide))]))


def test_v2_all_level1_escapes_and_empty_level2():
    """k1 = 1 (most elements escape at level 1), a tensor without any escape (an empty
    level-2 code stream) and one whose escapes all hit the level-2 table (no exception bytes)."""
    x = fill("gaussian", (3 * SMALL_TILE + 1,), generator=torch.Generator().manual_seed(4))
    blob = _roundtrip(x, tile=SMALL_TILE, levels=2, k=1, k2=7)
    head = read_header(blob)
    assert head.num_escapes > x.numel() // 2 and head.num_exceptions < head.num_escapes
    _kernel_vs_reference(blob, DecodeTable([CodecSegment(0, 0, head)]))
    three = torch.tensor([1.0, 2.0, 4.0], dtype=torch.bfloat16).repeat(200)  # 3 exponents
    none = read_header(_roundtrip(three, tile=SMALL_TILE, levels=2, k=2, k2=1))
    assert none.num_escapes == 0 and none.num_exceptions == 0
    five = torch.tensor([1.0, 2.0, 4.0, 8.0, 0.5], dtype=torch.bfloat16).repeat(100)
    head5 = read_header(_roundtrip(five, tile=SMALL_TILE, levels=2, k=2, k2=2))
    assert head5.num_escapes == 200 and head5.num_exceptions == 0
    for b in (three, five):
        buf, table = encode_block([b], tile=SMALL_TILE, levels=2, k=2, k2=2)
        _kernel_vs_reference(buf, table)


def test_v2_student_t_bits_per_weight():
    """exp-k2 on Student-t (df=4) bf16 weights of Flux's fan-in (3072): 10.98 bits per weight
    measured ((k, k2) = (2, 3); one level: 11.31). Other fan-ins move it with the scale's
    place between powers of two: 1024 -> 11.02, 5120 -> 11.06 (one level 11.32 / 11.34)."""
    x = fill("student-t", (3072, 3072), generator=torch.Generator().manual_seed(1))
    one, two = read_header(_roundtrip(x)), read_header(_roundtrip(x, levels=2))
    assert (two.version, two.k, two.k2) == (2, 2, 3)
    assert two.bits_per_weight <= 11.0 < 11.25 <= one.bits_per_weight, (two.bits_per_weight, one.bits_per_weight)
    assert two.bits_per_weight >= 8 + symbol_entropy(x) - 1e-6


@pytest.mark.parametrize("kind", FILLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_v2_never_larger_than_one_level(kind, dtype):
    x = fill(kind, (384, 1024), dtype=dtype, generator=torch.Generator().manual_seed(3))
    one, two = read_header(_roundtrip(x)), read_header(_roundtrip(x, levels=2))
    assert two.nbytes <= one.nbytes and (two.version == 1) == (two.nbytes == one.nbytes)
    if dtype == torch.bfloat16:
        assert two.version == 2 and two.nbytes < 0.985 * one.nbytes, (kind, two.bits_per_weight)


GOLDEN_V2_SHA256 = {
    "bf16-window": "7565bda942b3de13f3b17480ac363cff109c61f06c2101d39e9508ee2e54bc5a",
    "bf16-lookup": "0b708d712da0a71691221609318543f2b12fec55d39beebfccbdc49ef4f7dd6a",
    "fp16": "468d7d261fca064b136af8780b080a308d431737af6df7bf05c77cc08a1ab29e",
}
_V2_INPUTS = {
    "bf16-window": lambda: _skewed_bits(1_500_000),
    "bf16-lookup": lambda: _skewed_bits(1_500_000, window=False),
    "fp16": lambda: _skewed_bits(1_500_000, dtype=torch.float16),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_V2_SHA256))
@pytest.mark.parametrize("torch_index", [False, True])
def test_v2_encoded_bytes_are_the_golden_bytes(case, torch_index):
    """Version-2 bytes as first shipped (levels=2), from numpy's escape indices and from
    torch's (the path a CUDA tensor takes): the same golden bytes."""
    import hashlib

    blob = encode(_V2_INPUTS[case](), levels=2, _torch_index=torch_index)
    head = read_header(blob)
    assert head.version == 2 and (head.k, head.k2) == ((3, 3) if case == "fp16" else (2, 3))
    if case.startswith("bf16"):  # the window case codes level 1 by subtraction, the other by a lookup
        assert (head.table[:3] == (124, 125, 126)) == (case == "bf16-window")
    assert hashlib.sha256(blob.numpy().tobytes()).hexdigest() == GOLDEN_V2_SHA256[case]


@pytest.mark.parametrize("case", sorted(GOLDEN_V2_SHA256))
def test_v2_encoded_bytes_do_not_depend_on_the_code_chunk(case, monkeypatch):
    """Cut in many chunks, level-2 codes straddle chunk ends: the same bytes."""
    import weightstream.kernels.codec as codec_mod

    whole = encode(_V2_INPUTS[case](), levels=2)
    monkeypatch.setattr(codec_mod, "_CODE_CHUNK", 3 * codec_mod.DEFAULT_TILE)
    assert torch.equal(encode(_V2_INPUTS[case](), levels=2), whole)
    assert torch.equal(encode(_V2_INPUTS[case](), levels=2, _torch_index=True), whole)


def test_v2_validation():
    x = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"levels must be in \[1, 3\], got 4"):
        encode(x, levels=4)
    with pytest.raises(ValueError, match="k2=2 needs levels=2"):
        encode(x, k2=2)
    with pytest.raises(ValueError, match=r"k2 must be in \[0, 7\], got 8"):
        encode(x, levels=2, k2=8)
    with pytest.raises(ValueError, match=r"k2=3 needs k in \[1, 7\]"):
        encode(x, levels=2, k=8, k2=3)
    with pytest.raises(ValueError, match="table with levels=2 needs k2=0"):
        encode(x, levels=2, k=2, table=[1, 2, 3])
    assert torch.equal(encode(x, levels=2, k=2, k2=0, table=[1, 2, 127]), encode(x, k=2, table=[1, 2, 127]))


def _poke(blob: torch.Tensor, at: int, fmt: str, value: int) -> torch.Tensor:
    """A copy of `blob` with `value` packed little-endian (struct `fmt`) at byte `at`."""
    import struct

    raw = bytearray(blob.numpy().tobytes())
    struct.pack_into("<" + fmt, raw, at, value)
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


def test_v2_header_validation():
    x = fill("student-t", (1000,), generator=torch.Generator().manual_seed(8))
    blob = encode(x, tile=256, levels=2, k=2, k2=3)
    h = read_header(blob)
    assert (h.version, h.k, h.k2, len(h.table), h.table_off) == (2, 2, 3, 10, 96)
    assert h.raw_off == 112 and h.code_off == 112 + 1008 and h.base_off == h.code_off + 2 * 4 * 32
    code2_bytes = -(-h.num_escapes * 3 // 8) + 1
    assert h.code2_off == h.base_off + 32 and h.base2_off == -(-(h.code2_off + code2_bytes) // 16) * 16
    assert h.exc_off == h.base2_off + 32 and h.nbytes == -(-(h.exc_off + h.num_exceptions) // 16) * 16
    assert blob.numel() == h.nbytes and not blob[h.code2_off + code2_bytes - 1 : h.base2_off].any()
    for at, fmt, val, why in [(4, "B", 4, "version 4 is not supported"), (4, "B", 3, r"\(version 3\) has k=2"),
                              (20, "I", 0, "k=2, k2=0"),
                              (20, "I", 8, "k=2, k2=8"), (7, "B", 9, "table_len=9"),
                              (6, "B", 8, "k=8, k2=3"),
                              (80, "Q", h.code2_off + 16, "inconsistent stream offsets"),
                              (88, "Q", h.base2_off - 16, "inconsistent stream offsets"),
                              (72, "Q", h.num_escapes + 200, "inconsistent stream offsets")]:
        with pytest.raises(ValueError, match=why):
            read_header(_poke(blob, at, fmt, val))
    with pytest.raises(ValueError, match="too few for a version-2 header"):
        read_header(blob[:88])
    # a header that disagrees with its code streams: the reference decoder says so
    with pytest.raises(ValueError, match="level-1 escapes but its header says"):
        decode_tensor(_poke(blob, 72, "Q", h.num_escapes + 1))  # the same layout while in the padding
    v1 = encode(x, tile=256)
    assert read_header(_poke(v1, 72, "Q", 5)).k2 == 0  # version 1 ignores its reserved fields, as before


@pytest.mark.gpu
def test_gpu_v2_decode_matches_reference_and_graph():
    """Version-2 tensors (every forced (k1, k2), the encoder's own choices on Flux-like fills
    and a Flux-sized Student-t tensor) beside version-1 ones, decoded by the real kernel on
    CUDA in one launch, byte for byte against the reference, eagerly and in a CUDA graph."""
    _gpu_ok()
    gen = torch.Generator().manual_seed(7)
    blobs = [encode(t, levels=2) for t in _flux_like(gen)]
    blobs.append(encode(fill("student-t", (3072, 3072), generator=gen), levels=2))
    blobs += [encode(_all_patterns(torch.bfloat16), levels=2, k=2, k2=3), encode(_all_patterns(torch.float16))]
    for k1 in range(1, 8):
        for k2 in range(1, 8):
            blobs.append(encode(fill("student-t", (5000 + 97 * k1 * k2,), generator=gen), levels=2, k=k1, k2=k2))
    segs, src_at, dst_at = [], 0, 0
    for b in blobs:
        head = read_header(b)
        segs.append(CodecSegment(src_at, dst_at, head))
        src_at, dst_at = src_at + b.numel(), dst_at + head.decoded_bytes + 2
    table = DecodeTable(segs)
    assert sum(s.header.version == 2 for s in segs) >= 50 and any(s.header.version == 1 for s in segs)
    buf = torch.cat(blobs)
    ref = torch.zeros(table.dst_nbytes + 512, dtype=torch.uint8)
    decode_torch(buf, ref, table)
    for s, b in zip(segs, blobs):
        assert torch.equal(ref[s.dst_offset : s.dst_end], decode_tensor(b).view(torch.uint8))
    _gpu_decode_eager_and_graph(buf, table, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("numel", [1, 4097, 3_000_001])
def test_gpu_v2_encode_on_the_gpu_gives_the_cpu_bytes(numel):
    x = _skewed_bits(numel)
    want = encode(x, levels=2)
    assert numel == 1 or read_header(want).version == 2
    assert torch.equal(encode(x.cuda(), levels=2).cpu(), want)


def test_bench_codec_reports_both_codecs():
    """perf/bench_codec.py --codec exp-k exp-k2: the figures of each (CPU part), -k2 modes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from perf import bench_codec

    tensors = [fill("student-t", (512, 3072), generator=torch.Generator().manual_seed(2))]
    _, t1, one = bench_codec.encode_stats(tensors, DEFAULT_TILE, threaded=False, codec="exp-k")
    _, t2, two = bench_codec.encode_stats(tensors, DEFAULT_TILE, threaded=False, codec="exp-k2")
    assert (one["k"], one["k2"], two["k"], two["k2"]) == ([3], [0], [2], [3])
    assert two["coded_bytes"] < one["coded_bytes"] and two["bits_per_weight"] < 11.0 < one["bits_per_weight"]
    assert two["exception_fraction"] < one["exception_fraction"] < two["escape_fraction"]
    assert t2.segments[0].header.version == 2
    assert bench_codec.CODEC_SUFFIX == {"exp-k": "", "exp-k2": "-k2", "exp-kp": "-kp"}
    _, tp, patched = bench_codec.encode_stats(tensors, DEFAULT_TILE, threaded=False, codec="exp-kp")
    assert tp.segments[0].header.version == 3 and tp.patched
    assert one["coded_bytes"] < patched["coded_bytes"] < 0.77 * 2 * tensors[0].numel()
