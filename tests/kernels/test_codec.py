"""Lossless weight codec, the decoder: the Triton decoder (under TRITON_INTERPRET=1 on CPU) writes
the same bytes as the reference `decode_torch` for every version-1 and version-2 layout (every k,
odd sizes and offsets, the four-elements-per-word path), and the launcher's checks. Every
comparison is exact (`torch.equal` on integer views)."""
import pytest
import torch

from weightstream.fills import FILLS, fill
from weightstream.kernels.codec import bytes_moved, decode, decode_tensor, decode_torch
from weightstream.kernels.codec import _words_for  # the launch's path choice (private)
from weightstream.kernels.codec_encode import encode, encode_block
from weightstream.kernels.codec_format import DEFAULT_TILE, CodecSegment, DecodeTable, read_header

from codec_cases import (
    DEVICE,
    DTYPES,
    SMALL_TILE,
    _all_patterns,
    _bits,
    _edge_input,
    _flux_like,
    _gpu_decode_eager_and_graph,
    _gpu_ok,
    _kernel_vs_reference,
    _random_bits,
    _roundtrip,
    _skewed_bits,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [3, 8])
def test_exhaustive_kernel(dtype, k):
    x = _all_patterns(dtype, seed=1)
    buf, table = encode_block([x], k=k)
    out = _kernel_vs_reference(buf, table)
    assert torch.equal(out[: 2 * 65536], x.view(torch.uint8))


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


def test_empty_table_moves_nothing():
    buf, table = encode_block([torch.zeros(0, dtype=torch.bfloat16)])
    dst = torch.full((4,), 7, dtype=torch.uint8, device=DEVICE)
    assert decode(buf.to(DEVICE), dst, table) == 0 and dst.tolist() == [7, 7, 7, 7]
    assert table.num_tiles == 0


def test_upload_is_cached():
    _, table = encode_block([torch.ones(3, dtype=torch.bfloat16)])
    assert table.upload(DEVICE) is table.upload(DEVICE)


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
        numel = SMALL_TILE + 19 * i % SMALL_TILE + 1  # two tiles, the second partial
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
