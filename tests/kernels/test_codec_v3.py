"""Version 3 of the codec (codec "exp-kp", `encode(levels=PATCHED)`): one level, the escapes a
per-tile patch list of (uint16 position, symbol) that the kernel applies after the tile. Round
trips on raw bits through the reference, the Triton kernel (interpreter on CPU) against the
reference, the format's fields, and the reference's checks. Exact comparisons only."""
import pytest
import torch

from weightstream.fills import fill
from weightstream.kernels import codec as codec_mod
from weightstream.kernels import codec_encode
from weightstream.kernels.codec import decode, decode_tensor
from weightstream.kernels.codec import _words_for  # the launch's path choice (private)
from weightstream.kernels.codec_encode import encode, encode_block
from weightstream.kernels.codec_format import (
    DEFAULT_TILE,
    HEADER_BYTES,
    PATCHED,
    CodecSegment,
    DecodeTable,
    read_header,
)

from codec_cases import (
    DTYPES,
    SMALL_TILE,
    _all_patterns,
    _bits,
    _edge_input,
    _every_symbol,
    _gpu_decode_eager_and_graph,
    _gpu_ok,
    _kernel_vs_reference,
    _poke,
    _random_bits,
    _roundtrip,
    _weightlike_bits,
)


def _patches(blob: torch.Tensor):
    """(base stream incl. the total, positions, symbols) of a version-3 blob."""
    h = read_header(blob)
    base = blob[h.base_off : h.base_off + 8 * (h.num_tiles + 1)].clone().view(torch.int64).tolist()
    pos = (blob[h.exc_off : h.exc_off + 2 * h.num_exceptions].clone().view(torch.int16).to(torch.int64) & 0xFFFF)
    sym = blob[h.patch_sym_off : h.patch_sym_off + h.num_exceptions]
    return base, pos.tolist(), sym.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [None, 1, 2, 3, 5, 7])
def test_v3_exhaustive_roundtrip_reference(dtype, k):
    x = _all_patterns(dtype)
    blob = _roundtrip(x, k=k, levels=PATCHED)
    h = read_header(blob)
    if k is None:  # every symbol equally often: k = 8, no escapes, so version 1
        assert (h.version, h.k) == (1, 8)
        return
    assert h.version == 3 and h.table_off == HEADER_BYTES and h.k == k
    assert h.num_exceptions == int(sum(1 for s in (x.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
                                       if ((s >> 7) & 0xFF if dtype == torch.bfloat16 else s >> 8) not in h.table))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("words", [True, False])
def test_v3_every_symbol_kernel(dtype, k, words):
    """Every symbol, escaped or coded, at the small tile (16 tiles of patches) for each k and path."""
    x = _every_symbol(dtype, seed=k)
    blob = encode(x, k=k, levels=PATCHED, tile=SMALL_TILE)
    table = DecodeTable([CodecSegment(0, 0, read_header(blob))], words=words)
    assert table.patched
    out = _kernel_vs_reference(blob, table, seed=k)
    assert torch.equal(out[: 2 * x.numel()], x.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("words", [True, False])
def test_v3_exhaustive_kernel(dtype, words):
    """Every 16-bit pattern through the kernel, at the default tile (the reference round trip of
    every pattern for every k is test_v3_exhaustive_roundtrip_reference)."""
    x = _all_patterns(dtype)
    blob = encode(x, k=3, levels=PATCHED)
    table = DecodeTable([CodecSegment(0, 0, read_header(blob))], words=words)
    assert table.patched
    out = _kernel_vs_reference(blob, table, seed=3)
    assert torch.equal(out[: 2 * x.numel()], x.view(torch.uint8))


@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 3 * 128 + 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_v3_edge_sizes(numel, dtype):
    x = _edge_input(numel, dtype)
    _roundtrip(x, tile=SMALL_TILE, levels=PATCHED)
    buf, table = encode_block([x, x.flip(0)], tile=SMALL_TILE, k=3, levels=PATCHED)
    assert table.num_tiles == 2 * -(-numel // SMALL_TILE)
    out = _kernel_vs_reference(buf, table, seed=numel)
    assert torch.equal(out[: 2 * numel], x.view(torch.uint8))


def test_v3_patches_at_tile_boundaries():
    """Escapes at the first and last element of tiles, runs across a boundary and tiles with
    none: the base stream counts them per tile (then the total), positions are in-tile."""
    n = 5 * SMALL_TILE + 17
    x = torch.full((n,), 1.0, dtype=torch.bfloat16)
    rare = [0, SMALL_TILE - 1, SMALL_TILE, 2 * SMALL_TILE - 1, *range(3 * SMALL_TILE - 3, 3 * SMALL_TILE + 4), n - 1]
    x[rare] = torch.tensor([2.0**e for e in range(-60, -60 + len(rare))], dtype=torch.bfloat16)
    blob = _roundtrip(x, k=2, tile=SMALL_TILE, table=[126, 127, 128], levels=PATCHED)
    base, pos, sym = _patches(blob)
    assert base == [0, 2, 4, 7, 11, 11, 12]
    assert [b * SMALL_TILE + p for b, p in zip([0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 5], pos)] == rare
    assert sym == [e + 127 for e in range(-60, -60 + len(rare))]
    for words in (True, False):
        _kernel_vs_reference(blob, DecodeTable([CodecSegment(0, 0, read_header(blob))], words=words))


def test_v3_many_patches_per_tile():
    """More patches in one tile than one pass of the kernel's patch loop (256): k=1, random bits."""
    x = _random_bits(3 * DEFAULT_TILE + 9, 7).view(torch.bfloat16)
    blob = _roundtrip(x, k=1, levels=PATCHED)
    base, _, _ = _patches(blob)
    assert max(b - a for a, b in zip(base, base[1:])) > 3 * 256
    for words in (True, False):
        _kernel_vs_reference(blob, DecodeTable([CodecSegment(0, 0, read_header(blob))], words=words))


@pytest.mark.parametrize("words", [True, False])
def test_v3_word_path(words):
    """Window tables at the default tile take the word path without a scan (`_words_for`)."""
    t = fill("student-t", (3 * DEFAULT_TILE + 5,), generator=torch.Generator().manual_seed(3))
    for k in (2, 3, 4):
        buf, table = encode_block([t], k=k, levels=PATCHED, words=words)
        assert table.patched and table.words is words and not table.ranked  # the lean kernel
        assert _words_for(buf, torch.empty(table.dst_nbytes, dtype=torch.uint8), table) is words
        out = _kernel_vs_reference(buf, table, seed=k)
        assert torch.equal(out[: table.dst_nbytes], t.view(torch.uint8))


def test_v3_beside_versions_1_and_2_in_one_launch():
    """One table holding version-1, version-2 and version-3 tensors (both compiled paths)."""
    gen = torch.Generator().manual_seed(9)
    ts = [fill("student-t", (2 * SMALL_TILE + 3,), generator=gen) for _ in range(3)] + [_every_symbol(torch.float16)]
    blobs = [encode(ts[0], tile=SMALL_TILE), encode(ts[1], tile=SMALL_TILE, levels=2, k=2, k2=3),
             encode(ts[2], tile=SMALL_TILE, levels=PATCHED), encode(ts[3], tile=SMALL_TILE, levels=PATCHED, k=4)]
    segs, at, off = [], 0, 0
    for b in blobs:
        h = read_header(b)
        segs.append(CodecSegment(at, off, h))
        at, off = at + b.numel(), (off + 2 * h.numel + 47) // 16 * 16
    assert [s.header.version for s in segs] == [1, 2, 3, 3]
    for words in (True, False):
        table = DecodeTable(segs, words=words)
        assert table.patched and table.two_level and table.ranked
        out = _kernel_vs_reference(torch.cat(blobs), table)
        for sg, t in zip(segs, ts):
            assert torch.equal(out[sg.dst_offset : sg.dst_end].view(torch.int16), _bits(t))


def test_v3_off_alignment_buffers_take_the_element_path():
    """A src off an 8-byte boundary or a dst off a 4-byte one: the element path (byte loads)."""
    t = fill("student-t", (2 * DEFAULT_TILE + 7,), generator=torch.Generator().manual_seed(1))
    buf, table = encode_block([t], levels=PATCHED)
    for src_shift, dst_shift in ((1, 0), (0, 2), (3, 6)):
        src = torch.zeros(buf.numel() + src_shift, dtype=torch.uint8)[src_shift:]
        src.copy_(buf)
        dst = torch.zeros(table.dst_nbytes + dst_shift, dtype=torch.uint8)[dst_shift:]
        assert not _words_for(src, dst, table)
        decode(src, dst, table)
        assert torch.equal(dst, t.view(torch.uint8))


def test_v3_k_choice_prices_an_escape_at_three_bytes():
    """The encoder picks the k that minimises k bits per element plus 3 bytes per escape; a k
    without escapes (here 0: one symbol) writes version 1."""
    t = fill("student-t", (1 << 20,), generator=torch.Generator().manual_seed(4))
    sizes = {k: read_header(encode(t, k=k, levels=PATCHED)).nbytes for k in range(1, 8)}
    h = read_header(encode(t, levels=PATCHED))
    assert h.version == 3 and h.nbytes == min(sizes.values()) and sizes[h.k] == h.nbytes
    assert 11.8 <= h.bits_per_weight <= 12.2 and h.k in (3, 4)
    one = read_header(encode(torch.ones(1000, dtype=torch.bfloat16), levels=PATCHED))
    assert (one.version, one.k) == (1, 0)
    full = read_header(encode(_random_bits(1000, 3), levels=PATCHED, k=8))
    assert (full.version, full.k) == (1, 8)


def test_v3_header_fields():
    x = fill("student-t", (1000,), generator=torch.Generator().manual_seed(8))
    blob = encode(x, tile=256, levels=PATCHED, k=2)
    h = read_header(blob)
    assert (h.version, h.k, len(h.table), h.table_off, h.base_entries) == (3, 2, 3, 80, 5)
    assert h.raw_off == 96 and h.code_off == 96 + 1008 and h.base_off == h.code_off + 2 * 4 * 32
    assert h.exc_off == h.base_off + 48 and h.patch_sym_off == -(-(h.exc_off + 2 * h.num_exceptions) // 16) * 16
    assert h.nbytes == -(-(h.patch_sym_off + h.num_exceptions) // 16) * 16 == blob.numel()
    assert not blob[h.exc_off + 2 * h.num_exceptions : h.patch_sym_off].any()
    assert not blob[h.patch_sym_off + h.num_exceptions :].any()


def test_v3_header_validation():
    x = fill("student-t", (1000,), generator=torch.Generator().manual_seed(8))
    blob = encode(x, tile=256, levels=PATCHED, k=3)
    h = read_header(blob)
    with pytest.raises(ValueError, match="version 3"):
        read_header(_poke(blob, 6, "B", 8))  # k = 8 has no escapes to patch
    with pytest.raises(ValueError, match="version 3"):
        read_header(_poke(blob, 20, "I", 2))  # k2 is version 2's
    with pytest.raises(ValueError, match="inconsistent stream offsets"):
        read_header(_poke(blob, 56, "Q", h.exc_off - 16))
    with pytest.raises(ValueError, match="inconsistent stream offsets"):
        read_header(_poke(blob, 24, "Q", h.num_exceptions + 200))  # more patches than the bytes hold


def test_v3_reference_checks_the_patch_list():
    """The reference refuses a patch list that does not name the escapes (position or count)."""
    x = fill("student-t", (1000,), generator=torch.Generator().manual_seed(8))
    blob = encode(x, tile=256, levels=PATCHED, k=3)
    h = read_header(blob)
    assert h.num_exceptions > 2
    base, pos, _ = _patches(blob)
    moved = _poke(blob, h.exc_off, "H", (pos[0] + 1) % 256)
    with pytest.raises(ValueError, match="patch positions are not its escapes"):
        decode_tensor(moved)
    with pytest.raises(ValueError, match="base stream"):
        decode_tensor(_poke(blob, h.base_off + 8 * h.num_tiles, "Q", base[-1] - 1))


def test_v3_validation():
    x = fill("student-t", (1000,), generator=torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="k2=3 needs levels=2"):
        encode(x, levels=PATCHED, k2=3)
    with pytest.raises(ValueError, match="levels must be in"):
        encode(x, levels=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_v3_bytes_do_not_depend_on_chunk_or_index_path(dtype, monkeypatch):
    """The numpy and torch escape paths and any code chunk give the same version-3 bytes."""
    x = _weightlike_bits(600_000, window=8, dtype=dtype)
    whole = encode(x, levels=PATCHED, k=3)
    assert read_header(whole).version == 3 and read_header(whole).num_exceptions > 1000
    assert torch.equal(encode(x, levels=PATCHED, k=3, _torch_index=True), whole)
    monkeypatch.setattr(codec_encode, "_CODE_CHUNK", 3 * DEFAULT_TILE)
    assert torch.equal(encode(x, levels=PATCHED, k=3), whole)


def test_v3_tile_positions_past_int16():
    """A 65,536-element tile: positions past 32,767 are stored as uint16 bits."""
    x = _random_bits(65536 + 100, 11).view(torch.bfloat16)
    blob = _roundtrip(x, k=4, tile=65536, levels=PATCHED)
    _, pos, _ = _patches(blob)
    assert max(pos) > 60000
    for words in (True, False):  # the kernel reads them as two bytes: the same elements
        _kernel_vs_reference(blob, DecodeTable([CodecSegment(0, 0, read_header(blob))], words=words))


# -- GPU -------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_v3_decode_matches_reference_and_graph():
    _gpu_ok()
    gen = torch.Generator().manual_seed(0)
    ts = [fill("student-t", (3072, 3072), generator=gen), fill("uniform", (3072,), generator=gen),
          fill("gaussian", (1000, 77), generator=gen).half(), _all_patterns(torch.bfloat16)]
    for k in (None, 2, 3):
        buf, table = encode_block(ts, k=k, levels=PATCHED)
        assert table.patched and table.words
        ref = torch.zeros(table.dst_nbytes + 512, dtype=torch.uint8)
        codec_mod.decode_torch(buf, ref, table)
        for s, t in zip(table.segments, ts):
            assert torch.equal(ref[s.dst_offset : s.dst_end], t.reshape(-1).view(torch.uint8))
        _gpu_decode_eager_and_graph(buf, table, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("numel", [1, 4097, 3_000_001])
def test_gpu_v3_encode_on_the_gpu_gives_the_cpu_bytes(numel):
    x = _weightlike_bits(numel)
    want = encode(x, levels=PATCHED)
    assert torch.equal(encode(x.cuda(), levels=PATCHED).cpu(), want)


def test_forced_paths_decode_every_version_alike():
    """DecodeTable(level2=True / patch=True) compiles those paths for a table that does not need
    them (a source's tables, re-encoded in place under a captured graph, may gain such tensors):
    the bytes stay the reference's, options() carries the flags, and they must be bools."""
    gen = torch.Generator().manual_seed(21)
    t = fill("student-t", (2 * DEFAULT_TILE + 9,), generator=gen)
    buf, plain = encode_block([t, t.flip(0)], k=3)
    assert not plain.two_level and not plain.patched
    assert plain.ranked  # version 1 with escapes
    for paths in ({"level2": True}, {"patch": True}, {"level2": True, "patch": True}):
        table = DecodeTable(plain.segments, **paths)
        assert table.two_level == paths.get("level2", False) and table.patched == paths.get("patch", False)
        assert {k: table.options()[k] for k in paths} == paths
        assert DecodeTable(plain.segments, **table.options()).options() == table.options()
        for words in (True, False):
            _kernel_vs_reference(buf, DecodeTable(plain.segments, words=words, **paths))
    with pytest.raises(TypeError, match="patch must be a bool"):
        DecodeTable(plain.segments, patch=1)
    # a version-3 table (plus escape-free version-1 tensors) runs unranked unless ranked=True
    ts = [t, torch.ones(300, dtype=torch.bfloat16), _random_bits(999, 2)]
    blobs = [encode(ts[0], levels=PATCHED, k=3), encode(ts[1], levels=PATCHED), encode(ts[2], levels=PATCHED, k=8)]
    segs, at, off = [], 0, 0
    for b in blobs:
        h = read_header(b)
        segs.append(CodecSegment(at, off, h))
        at, off = at + b.numel(), (off + 2 * h.numel + 15) // 16 * 16
    assert [(s.header.version, s.header.k) for s in segs] == [(3, 3), (1, 0), (1, 8)]
    for ranked in (False, True):
        for words in (True, False):
            table = DecodeTable(segs, words=words, ranked=ranked)
            assert table.ranked is ranked and table.patched
            out = _kernel_vs_reference(torch.cat(blobs), table)
            for sg, x in zip(segs, ts):
                assert torch.equal(out[sg.dst_offset : sg.dst_end].view(torch.int16), _bits(x))


@pytest.mark.parametrize("chunk", [32, 64])
def test_element_path_in_chunks_carries_escape_ranks(chunk, monkeypatch):
    """The element path decodes a tile ELEM_CHUNK elements at a time; escape ranks (version 1),
    level-2 ranks (version 2) and patches (version 3) must carry across the chunks: every version
    with escapes in every chunk, partial last tiles, words on and off, against the reference."""
    monkeypatch.setattr(codec_mod, "ELEM_CHUNK", chunk)
    monkeypatch.setattr(codec_mod, "INTERPRET_ELEM_CHUNK", chunk)  # the chunk in force on the CPU
    gen = torch.Generator().manual_seed(chunk)
    n = 3 * SMALL_TILE + 45
    st = fill("student-t", (n,), generator=gen)
    rnd = _random_bits(n, chunk).view(torch.bfloat16)
    blobs = [encode(st, tile=SMALL_TILE, k=2), encode(st, tile=SMALL_TILE, levels=2, k=2, k2=2),
             encode(rnd, tile=SMALL_TILE, levels=2, k=3, k2=3), encode(st, tile=SMALL_TILE, levels=PATCHED, k=2),
             encode(rnd.view(torch.float16), tile=SMALL_TILE, k=5), _all_patterns(torch.bfloat16)[:n].contiguous()]
    blobs[-1] = encode(blobs[-1], tile=SMALL_TILE, k=4)
    segs, at, off = [], 0, 0
    for b in blobs:
        h = read_header(b)
        assert h.num_exceptions > 8 * (n // chunk) // 8  # escapes throughout
        segs.append(CodecSegment(at, off, h))
        at, off = at + b.numel(), (off + 2 * h.numel + 31) // 16 * 16
    for words in (True, False):
        _kernel_vs_reference(torch.cat(blobs), DecodeTable(segs, words=words))


_COMPILE_IR = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from weightstream.kernels._codec_kernels import _decode_kernel
sig = {"src_ptr": "*u8", "dst_ptr": "*i16", "dst8_ptr": "*u8", "table_ptr": "*i64", "num_segments": "i64"}
for chunk in map(int, sys.argv[1:]):
    const = dict(TILE=4096, SEARCH_STEPS=4, DST_ALIGN=8, GATHER=True, LEVEL2=False, WORDS=False, PATCHED=False,
                 RANKED=True, CHUNK=chunk, BYTES=False)
    names = list(sig) + list(const)
    src = ASTSource(_decode_kernel, {**sig, **{k: "constexpr" for k in const}},
                    constexprs={(names.index(k),): v for k, v in const.items()})
    print(len(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ttir"]))
"""


def test_element_path_chunks_are_a_loop_not_unrolled():
    """The element path's chunks run as a loop: unrolled, a tile of TILE / CHUNK chunks compiled that
    many copies (twice), and a fresh machine's first exp-k2 step did not finish in 80 s (docs/performance.md).
    Compiled for sm_90 without a GPU (a subprocess: the interpreter is on in this one), the kernel's
    IR at 16 chunks a tile must be about the size it is at 2."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_IR, "256", "2048"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    many, few = map(int, run.stdout.split())
    assert many < 1.2 * few, (many, few)


def _reencoded_in_place(old_blobs, new_blobs, paths: dict):
    """A table built from `old_blobs` (with `paths`), its records then overwritten in place by those
    of `new_blobs` at the same offsets: what a captured CUDA graph replays after a source re-encodes
    a block (`CodedSource._retable`). The old table keeps its compiled paths (two_level, patched,
    ranked, words): the launch below uses them, as the captured kernel does."""
    cap = max(max(o.numel(), n.numel()) for o, n in zip(old_blobs, new_blobs))
    src_new = torch.zeros(cap * len(old_blobs), dtype=torch.uint8)  # the region after the re-encode
    segs_old, segs_new, off = [], [], 0
    for i, (o, n) in enumerate(zip(old_blobs, new_blobs)):
        src_new[i * cap : i * cap + n.numel()] = n
        segs_old.append(CodecSegment(i * cap, off, read_header(o)))
        segs_new.append(CodecSegment(i * cap, off, read_header(n)))
        off += (2 * read_header(o).numel + 15) // 16 * 16
    old, new = DecodeTable(segs_old, **paths), DecodeTable(segs_new, **paths)
    assert old.packed().shape == new.packed().shape
    old._host.copy_(new._host)  # the device copy of a CPU table is its host tensor
    return src_new, old, new


@pytest.mark.parametrize("codec", ["exp-kp", "exp-k2"])
def test_reencode_in_place_into_another_version_decodes_with_the_source_paths(codec):
    """A small tensor whose best code had no escapes (version 1, k = 0) gains escapes when its weights
    change: exp-kp re-encodes it as version 3, exp-k2 as version 2. A table compiled with its source's
    paths (`coded_encode.decode_paths`) decodes the new records; one compiled for the old tensors only
    (no patch loop / no level-2 code) would not."""
    from weightstream.offload.codecs import codec_levels
    from weightstream.offload.host.encode import decode_paths

    levels = codec_levels(codec)
    gen = torch.Generator().manual_seed(31)
    const = torch.full((3 * SMALL_TILE + 5,), 1.0, dtype=torch.bfloat16)
    st = fill("student-t", (3 * SMALL_TILE + 5,), generator=gen)
    rnd = _random_bits(3 * SMALL_TILE + 5, 5).view(torch.bfloat16)
    kw = {"k": 2, "k2": 3} if codec == "exp-k2" else {"k": 3}
    old_blobs = [encode(const, tile=SMALL_TILE, levels=levels), encode(-const, tile=SMALL_TILE, levels=levels)]
    new_blobs = [encode(rnd, tile=SMALL_TILE, levels=levels, **kw), encode(st, tile=SMALL_TILE, levels=levels)]
    assert [read_header(b).k for b in old_blobs] == [0, 0]  # escape-free: version 1, no paths of their own
    assert read_header(new_blobs[0]).version == (3 if levels == PATCHED else 2)
    src, table, new = _reencoded_in_place(old_blobs, new_blobs, decode_paths(levels))
    assert (table.patched, table.two_level) == (new.patched, new.two_level)
    out = torch.zeros(table.dst_nbytes, dtype=torch.uint8)
    decode(src, out, table)
    ref = torch.zeros_like(out)
    codec_mod.decode_torch(src, ref, new)
    assert torch.equal(out, ref)
    assert torch.equal(out[: 2 * rnd.numel()].view(torch.int16), _bits(rnd))
    # the same without the source's paths: the kernel compiled for version-1 tensors decodes wrongly
    src, bare, _ = _reencoded_in_place(old_blobs, new_blobs, {})
    wrong = torch.zeros_like(out)
    decode(src, wrong, bare)
    assert not torch.equal(wrong, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["exp-kp", "exp-k2"])
def test_gpu_graph_replays_a_table_reencoded_into_another_version(codec):
    """The CPU test above through a captured CUDA graph: capture the decode of escape-free version-1
    tensors with the source's paths, re-encode into another version at the same offsets, update the
    device table in place, replay: the new weights, bit for bit."""
    from weightstream.offload.codecs import codec_levels
    from weightstream.offload.host.encode import decode_paths

    _gpu_ok()
    levels = codec_levels(codec)
    n = 5 * DEFAULT_TILE + 77
    const = torch.full((n,), 1.0, dtype=torch.bfloat16)
    new_t = [fill("student-t", (n,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    old_blobs = [encode(const, levels=levels), encode(-const, levels=levels)]
    new_blobs = [encode(t, levels=levels) for t in new_t]
    assert {read_header(b).version for b in new_blobs} == {3 if levels == PATCHED else 2}
    cap = max(b.numel() for b in old_blobs + new_blobs)
    segs, off = [], 0
    for i, b in enumerate(old_blobs):
        segs.append(CodecSegment(i * cap, off, read_header(b)))
        off += (2 * n + 15) // 16 * 16
    table = DecodeTable(segs, **decode_paths(levels))
    src = torch.zeros(2 * cap, dtype=torch.uint8, device="cuda")
    for i, b in enumerate(old_blobs):
        src[i * cap : i * cap + b.numel()] = b.cuda()
    dst = torch.zeros(table.dst_nbytes, dtype=torch.uint8, device="cuda")
    dev_table = table.upload(dst.device)
    decode(src, dst, table)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode(src, dst, table)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(src, dst, table)
    new = DecodeTable([CodecSegment(s.src_offset, s.dst_offset, read_header(b)) for s, b in zip(segs, new_blobs)],
                      **decode_paths(levels))
    for i, b in enumerate(new_blobs):
        src[i * cap : i * cap + b.numel()] = b.cuda()
    dev_table.copy_(new._host)  # as CodedSource._retable does
    graph.replay()
    torch.cuda.synchronize()
    for s, t in zip(segs, new_t):
        assert torch.equal(dst[s.dst_offset : s.dst_end].cpu(), t.view(torch.uint8))
