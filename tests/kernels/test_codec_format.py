"""The coded tensor format (kernels/codec_format.py): header fields, stream offsets, per-tile bases
(levels 1 and 2), `encode_block`'s layout, and `read_header`'s checks of every field. Every
comparison is exact."""
import pytest
import torch

from weightstream.fills import FILLS, fill
from weightstream.kernels.codec import decode_tensor
from weightstream.kernels.codec_encode import encode, encode_block
from weightstream.kernels.codec_format import HEADER_BYTES, CodecSegment, DecodeTable, read_header

from codec_cases import SMALL_TILE, _kernel_vs_reference, _poke, _roundtrip


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


def test_header_fields():
    x = fill("student-t", (1000,), generator=torch.Generator().manual_seed(8))
    blob = encode(x, tile=256)
    assert bytes(blob[:4].tolist()) == b"WSC1"
    h = read_header(blob)
    assert (h.dtype, h.numel, h.tile, h.k, len(h.table)) == (torch.bfloat16, 1000, 256, 3, 7)
    assert h.raw_off == 96 and h.code_off == 96 + 1008 and h.base_off == h.code_off + 4 * 96
    assert h.exc_off == h.base_off + 32 and h.nbytes == -(-(h.exc_off + h.num_exceptions) // 16) * 16
    assert h.raw_off >= HEADER_BYTES + 7 and h.decoded_bytes == 2000


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
