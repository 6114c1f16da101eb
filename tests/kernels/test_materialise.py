"""materialise(): Triton kernel vs plain-torch reference, and the reference vs
obviously-correct constructions. Byte-moving, so every comparison is exact
(`torch.equal` on uint8 views). On CPU the kernel runs under TRITON_INTERPRET=1
(set by tests/conftest.py), so sizes here are small."""
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from weightstream.kernels.materialise import (
    Segment,
    SegmentTable,
    ShardLayout,
    Transform,
    bytes_moved,
    concat_segments,
    materialise,
    materialise_torch,
    pack_shards_torch,
    qkv_separate_segments,
    shard_layout,
    shard_unpack_segments,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8]
SMALL_TILE = 64  # several tiles per segment at interpreter-friendly sizes


def _rand(shape, dtype, gen):
    """A tensor of `dtype` with random bytes (any bit pattern, NaNs included)."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def _b(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _canvas(n, gen):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def _run_both(src, table, dst_size, gen):
    """Kernel and reference on the same random canvas; returns both results (CPU)."""
    canvas = _canvas(dst_size, gen)
    dst_k = canvas.clone().to(DEVICE)
    dst_r = canvas.clone().to(DEVICE)
    src = src.to(DEVICE)
    assert materialise(src, dst_k, table) == bytes_moved(table)
    assert materialise_torch(src, dst_r, table) == bytes_moved(table)
    return dst_k.cpu(), dst_r.cpu(), canvas


def _interleave(q, k, v, num_heads, num_kv_heads):
    """Checkpoint layout built from real q/k/v weights: per group, its q heads, its k, its v."""
    per = num_heads // num_kv_heads
    tail = q.shape[1:]
    hd = q.shape[0] // num_heads
    return torch.cat(
        [
            q.reshape(num_kv_heads, per, hd, *tail),
            k.reshape(num_kv_heads, 1, hd, *tail),
            v.reshape(num_kv_heads, 1, hd, *tail),
        ],
        dim=1,
    ).reshape(-1, *tail)


# -- identity / concat ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 3, 17, 1023])
def test_identity_all_dtypes_odd_sizes(dtype, numel):
    gen = torch.Generator().manual_seed(numel)
    x = _rand((numel,), dtype, gen)
    esize = x.element_size()
    src = torch.cat([_canvas(5 * esize, gen), _b(x)])  # tensor at an odd-ish source offset
    seg = Segment.identity(5 * esize, 3 * esize, numel * esize)
    table = SegmentTable([seg], tile_bytes=SMALL_TILE)
    out, ref, canvas = _run_both(src, table, (numel + 7) * esize, gen)
    assert torch.equal(out, ref)
    assert torch.equal(out[3 * esize : 3 * esize + x.numel() * esize], _b(x))
    assert torch.equal(out[: 3 * esize], canvas[: 3 * esize])  # bytes outside segments untouched
    assert torch.equal(out[(numel + 3) * esize :], canvas[(numel + 3) * esize :])


def test_concat_into_fused_projection():
    gen = torch.Generator().manual_seed(1)
    a, b, c = (_rand(s, torch.bfloat16, gen) for s in [(3, 5), (7, 5), (1, 5)])
    offs = [16, 200, 97]
    src = _canvas(400, gen)
    for off, t in zip(offs, (a, b, c)):
        src[off : off + t.numel() * 2] = _b(t)
    segs = concat_segments([(o, t.numel() * 2) for o, t in zip(offs, (a, b, c))], dst_offset=32)
    assert [s.dst_offset for s in segs] == [32, 32 + 30, 32 + 100]
    table = SegmentTable(segs, tile_bytes=SMALL_TILE)
    out, ref, _ = _run_both(src, table, 256, gen)
    assert torch.equal(out, ref)
    assert torch.equal(out[32 : 32 + 110], _b(torch.cat([a, b, c])))


def test_qkv_separate_segments_is_torch_cat():
    gen = torch.Generator().manual_seed(2)
    q, k, v = _rand((12, 4), torch.float16, gen), _rand((4, 4), torch.float16, gen), _rand((4, 4), torch.float16, gen)
    src = torch.cat([_b(v), _canvas(3, gen), _b(q), _b(k)])  # any source order
    segs = qkv_separate_segments((35, q.numel() * 2), (131, k.numel() * 2), (0, v.numel() * 2), dst_offset=0)
    table = SegmentTable(segs, tile_bytes=SMALL_TILE)
    out, ref, _ = _run_both(src, table, 160, gen)
    assert torch.equal(out, ref)
    assert torch.equal(out, _b(torch.cat([q, k, v])))


def test_identity_runs_are_merged_and_table_is_identity():
    segs = concat_segments([(0, 100), (100, 28), (128, 3)], dst_offset=0)
    table = SegmentTable(segs)
    assert table.num_segments == 1 and table.is_identity and table.nbytes == 131
    assert not SegmentTable([Segment.identity(0, 16, 100)]).is_identity
    assert not SegmentTable([Segment.qkv_reorder(0, 0, 2, 2, 8)]).is_identity
    assert SegmentTable([]).is_identity  # nothing to move


def test_alignment_follows_offsets_rows_and_sizes():
    def aligns(*segs):
        t = SegmentTable(segs)
        return t.align, t.tail_align

    assert aligns(Segment.identity(512, 1024, 4096)) == (16, 16)
    assert aligns(Segment.identity(512, 1024, 3)) == (16, 1)
    assert aligns(Segment.identity(512, 1028, 4096)) == (4, 16)
    assert aligns(Segment.qkv_reorder(0, 0, 2, 1, 6)) == (2, 2)
    assert aligns(Segment.shard_unpack(0, 0, 64, 32, 33)) == (1, 16)
    assert aligns(Segment.shard_unpack(0, 0, 40, 32, 48)) == (16, 8)


# -- grouped QKV ----------------------------------------------------------

QKV_CASES = [  # (num_heads, num_kv_heads, head_dim, in_features); in_features 1 = a bias
    (4, 4, 3, 5),  # MHA
    (6, 2, 2, 3),  # GQA
    (3, 1, 1, 7),  # odd head count, MQA
    (5, 5, 1, 1),  # MHA bias, odd
    (9, 3, 2, 1),  # GQA bias
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,in_features", QKV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_reorder_and_inverse(dtype, num_heads, num_kv_heads, head_dim, in_features):
    gen = torch.Generator().manual_seed(num_heads * 100 + num_kv_heads)
    q = _rand((num_heads * head_dim, in_features), dtype, gen)
    k = _rand((num_kv_heads * head_dim, in_features), dtype, gen)
    v = _rand((num_kv_heads * head_dim, in_features), dtype, gen)
    fused = _b(torch.cat([q, k, v]))
    inter = _b(_interleave(q, k, v, num_heads, num_kv_heads))
    head_bytes = head_dim * in_features * q.element_size()
    n = fused.numel()

    fwd = SegmentTable([Segment.qkv_reorder(3, 1, num_heads, num_kv_heads, head_bytes)], tile_bytes=16)
    out, ref, _ = _run_both(torch.cat([_canvas(3, gen), inter]), fwd, n + 2, gen)
    assert torch.equal(ref[1 : 1 + n], fused)  # the reference vs torch.cat of real q/k/v
    assert torch.equal(out, ref)

    inv = SegmentTable([Segment.qkv_interleave(0, 0, num_heads, num_kv_heads, head_bytes)], tile_bytes=16)
    out, ref, _ = _run_both(fused, inv, n, gen)
    assert torch.equal(ref, inter)
    assert torch.equal(out, ref)


def test_qkv_reorder_gqa_rows_by_hand():
    # 4 q heads, 2 kv groups, 1-byte heads: checkpoint q0 q1 k0 v0 q2 q3 k1 v1
    src = torch.tensor([10, 11, 20, 30, 12, 13, 21, 31], dtype=torch.uint8)
    table = SegmentTable([Segment.qkv_reorder(0, 0, 4, 2, 1)])
    out = torch.zeros(8, dtype=torch.uint8)
    materialise_torch(src, out, table)
    assert out.tolist() == [10, 11, 12, 13, 20, 21, 30, 31]


# -- per-tensor shard unpack ---------------------------------------------


def _gathered_by_hand(tensors, layout: ShardLayout) -> torch.Tensor:
    """Rank-major all-gather output built from row slices of the real tensors."""
    shards = []
    for r in range(layout.world_size):
        shard = torch.zeros(layout.shard_bytes, dtype=torch.uint8)
        for t, cb, co in zip(tensors, layout.chunk_bytes, layout.chunk_offsets):
            rows = cb // (t[0].numel() * t.element_size())
            part = _b(t[r * rows : (r + 1) * rows])
            shard[co : co + part.numel()] = part
        shards.append(shard)
    return torch.cat(shards)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_unpack_per_tensor(world_size):
    gen = torch.Generator().manual_seed(world_size)
    shapes = [(7, 3), (1, 1), (16, 8), (5,), (3, 17), (64, 2)]
    tensors = [_rand(s if len(s) == 2 else (s[0], 1), dt, gen) for s, dt in zip(shapes, DTYPES + [torch.bfloat16])]
    layout = shard_layout(
        [t.numel() * t.element_size() for t in tensors],
        world_size,
        row_bytes=[t[0].numel() * t.element_size() for t in tensors],
    )
    for cb, rb, nb in zip(layout.chunk_bytes, [t[0].numel() * t.element_size() for t in tensors], layout.tensor_nbytes):
        assert cb % rb == 0 and cb % 16 == 0 and cb * world_size >= nb  # whole rows, aligned, covering
    image = torch.zeros(max(o + n for o, n in zip(layout.tensor_offsets, layout.tensor_nbytes)), dtype=torch.uint8)
    for t, off in zip(tensors, layout.tensor_offsets):
        image[off : off + t.numel() * t.element_size()] = _b(t)

    gathered = _gathered_by_hand(tensors, layout)
    assert torch.equal(pack_shards_torch(image, layout), gathered)

    table = SegmentTable(shard_unpack_segments(layout, src_offset=16), tile_bytes=SMALL_TILE)
    src = torch.cat([_canvas(16, gen), gathered])
    out, ref, canvas = _run_both(src, table, image.numel(), gen)
    assert torch.equal(out, ref)
    for t, off in zip(tensors, layout.tensor_offsets):
        n = t.numel() * t.element_size()
        assert torch.equal(out[off : off + n], _b(t))


def test_shard_unpack_partial_last_chunk_by_hand():
    # 10 bytes in chunks of 4 over 3 ranks with 6-byte shards: ranks hold 0-3, 4-7, 8-9
    src = torch.tensor([0, 1, 2, 3, 99, 99, 4, 5, 6, 7, 99, 99, 8, 9, 99, 99, 99, 99], dtype=torch.uint8)
    table = SegmentTable([Segment.shard_unpack(0, 0, 10, 4, 6)])
    assert table.src_nbytes == 14
    out = torch.zeros(10, dtype=torch.uint8)
    materialise_torch(src, out, table)
    assert out.tolist() == list(range(10))
    out.zero_()
    materialise(src.to(DEVICE), out := out.to(DEVICE), table)
    assert out.cpu().tolist() == list(range(10))


# -- mixed tables ---------------------------------------------------------


def _random_table(rng: random.Random, aligned: bool):
    unit = 16 if aligned else 1
    segs, dst, src_size = [], rng.randrange(0, 3) * unit, 0
    for _ in range(rng.randrange(1, 9)):
        kind = rng.choice(list(Transform))
        src_off = rng.randrange(0, 200) * unit
        if kind == Transform.IDENTITY:
            seg = Segment.identity(src_off, dst, rng.randrange(1, 300) * (1 if not aligned else rng.choice([1, 16])))
        elif kind == Transform.SHARD_UNPACK:
            chunk = rng.randrange(1, 80) * unit
            stride = chunk + rng.randrange(0, 3) * unit
            seg = Segment.shard_unpack(src_off, dst, rng.randrange(1, 4 * chunk), chunk, stride)
        else:
            kv = rng.randrange(1, 4)
            heads = kv * rng.randrange(1, 4)
            make = Segment.qkv_reorder if kind == Transform.QKV_REORDER else Segment.qkv_interleave
            seg = make(src_off, dst, heads, kv, rng.randrange(1, 12) * unit)
        segs.append(seg)
        src_size = max(src_size, seg.src_end)
        dst = seg.dst_end + rng.randrange(0, 3) * unit
    rng.shuffle(segs)
    return segs, src_size, dst


@pytest.mark.parametrize("seed", range(6))
def test_mixed_random_tables(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    segs, src_size, dst_size = _random_table(rng, aligned=seed % 2 == 0)
    table = SegmentTable(segs, tile_bytes=rng.choice([16, 32, 128, 1024]))
    src = _canvas(src_size + rng.randrange(0, 5), gen)
    out, ref, canvas = _run_both(src, table, dst_size + 5, gen)
    assert torch.equal(out, ref)
    covered = torch.zeros(dst_size + 5, dtype=torch.bool)
    for s in segs:
        covered[s.dst_offset : s.dst_end] = True
    assert torch.equal(out[~covered], canvas[~covered])


def test_one_block_all_transforms():
    """A small block: fused QKV from a GQA checkpoint, its bias, an MLP weight
    sharded over 2 ranks, a norm weight copied as is, all in one table/launch."""
    gen = torch.Generator().manual_seed(7)
    H, G, hd, d = 6, 2, 4, 8
    q, k, v = (_rand((n * hd, d), torch.bfloat16, gen) for n in (H, G, G))
    qb, kb, vb = (_rand((n * hd,), torch.bfloat16, gen) for n in (H, G, G))
    mlp = _rand((24, d), torch.bfloat16, gen)
    norm = _rand((d,), torch.float32, gen)
    inter_w, inter_b = _b(_interleave(q, k, v, H, G)), _b(_interleave(qb, kb, vb, H, G))
    layout = shard_layout([mlp.numel() * 2], 2, row_bytes=[d * 2], tensor_offsets=[1024])
    gathered = pack_shards_torch(torch.cat([torch.zeros(1024, dtype=torch.uint8), _b(mlp)]), layout)
    wire = torch.cat([inter_w, inter_b, _b(norm), gathered])
    o_b = inter_w.numel()
    o_n = o_b + inter_b.numel()
    o_s = o_n + norm.numel() * 4
    segs = [
        Segment.qkv_reorder(0, 0, H, G, hd * d * 2),
        Segment.qkv_reorder(o_b, 640, H, G, hd * 2),
        Segment.identity(o_n, 768, norm.numel() * 4),
        *shard_unpack_segments(layout, src_offset=o_s),
    ]
    table = SegmentTable(segs, tile_bytes=128)
    out, ref, _ = _run_both(wire, table, 1024 + mlp.numel() * 2, gen)
    assert torch.equal(out, ref)
    assert torch.equal(out[:640], _b(torch.cat([q, k, v])))
    assert torch.equal(out[640:720], _b(torch.cat([qb, kb, vb])))
    assert torch.equal(out[768:800], _b(norm))
    assert torch.equal(out[1024:], _b(mlp))


def test_empty_table_moves_nothing():
    table = SegmentTable([Segment.identity(0, 0, 0)])
    dst = torch.full((4,), 7, dtype=torch.uint8, device=DEVICE)
    assert materialise(torch.zeros(4, dtype=torch.uint8, device=DEVICE), dst, table) == 0
    assert dst.tolist() == [7, 7, 7, 7] and table.num_tiles == 0


def test_upload_is_cached():
    table = SegmentTable([Segment.identity(0, 0, 4)])
    assert table.upload(DEVICE) is table.upload(DEVICE)
    assert table.packed().dtype == torch.int64


# -- validation -----------------------------------------------------------


def test_launcher_validation():
    table = SegmentTable([Segment.identity(0, 0, 8)])
    u8 = lambda n: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    for fn in (materialise, materialise_torch):
        with pytest.raises(TypeError, match="src dtype must be torch.uint8"):
            fn(torch.zeros(8, dtype=torch.bfloat16), u8(8), table)
        with pytest.raises(TypeError, match="dst dtype must be torch.uint8"):
            fn(u8(8), torch.zeros(2, dtype=torch.float32), table)
        with pytest.raises(TypeError, match="src must be a torch.Tensor"):
            fn(b"12345678", u8(8), table)
        with pytest.raises(TypeError, match="table must be a SegmentTable"):
            fn(u8(8), u8(8), [Segment.identity(0, 0, 8)])
        with pytest.raises(ValueError, match="src must be a 1-D contiguous"):
            fn(u8(16).view(2, 8), u8(8), table)
        with pytest.raises(ValueError, match="dst must be a 1-D contiguous"):
            fn(u8(8), u8(16)[::2], table)
        with pytest.raises(ValueError, match="src has 7 bytes but the table reads up to byte 8"):
            fn(u8(7), u8(8), table)
        with pytest.raises(ValueError, match="dst has 7 bytes but the table writes up to byte 8"):
            fn(u8(8), u8(7), table)
        with pytest.raises(ValueError, match="one device"):
            fn(u8(8), torch.zeros(8, dtype=torch.uint8, device="meta"), table)
        buf = u8(12)
        with pytest.raises(ValueError, match="overlap in memory"):
            fn(buf[:8], buf[4:], table)
    bytes_moved(table)
    with pytest.raises(TypeError, match="table must be a SegmentTable"):
        bytes_moved([])


def test_table_and_segment_validation():
    with pytest.raises(ValueError, match="destination ranges overlap"):
        SegmentTable([Segment.identity(0, 0, 10), Segment.identity(100, 9, 4)])
    SegmentTable([Segment.identity(0, 0, 10), Segment.identity(0, 10, 4)])  # adjacent is fine, sources may overlap
    with pytest.raises(TypeError, match=r"segments\[1\] must be a Segment"):
        SegmentTable([Segment.identity(0, 0, 1), (0, 0, 1)])
    with pytest.raises(ValueError, match="tile_bytes must be a power of two"):
        SegmentTable([], tile_bytes=48)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        SegmentTable([], num_warps=3)
    with pytest.raises(ValueError, match="src_offset must be >= 0"):
        Segment.identity(-1, 0, 1)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        Segment.identity(0, 0, 1.0)
    with pytest.raises(ValueError, match="transform must be one of"):
        Segment(0, 0, 1, transform=9)
    with pytest.raises(ValueError, match="IDENTITY segment takes no"):
        Segment(0, 0, 1, row_bytes=4)
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        Segment.qkv_reorder(0, 0, 5, 2, 8)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        Segment.qkv_interleave(0, 0, 4, 0, 8)
    with pytest.raises(ValueError, match=r"nbytes must be \(num_heads \+ 2 \* num_kv_heads\)"):
        Segment(0, 0, 10, Transform.QKV_REORDER, row_bytes=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="rank_stride must be >= row_bytes"):
        Segment.shard_unpack(0, 0, 10, 8, 4)
    with pytest.raises(ValueError, match="row_bytes \\(chunk bytes\\) must be >= 1"):
        Segment.shard_unpack(0, 0, 10, 0, 4)
    with pytest.raises(ValueError, match=r"tensor_nbytes\[0\] \(10\) must be a multiple of row_bytes\[0\] \(4\)"):
        shard_layout([10], 2, row_bytes=[4])
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        shard_layout([10], 0)


def test_segment_is_frozen_and_transform_is_enum():
    seg = Segment(0, 0, 3, 2, row_bytes=1, num_heads=1, num_kv_heads=1)
    assert seg.transform is Transform.QKV_REORDER
    with pytest.raises(AttributeError):
        seg.nbytes = 3


# -- GPU ------------------------------------------------------------------


def _gpu_ok():
    if torch.cuda.get_device_capability() < (7, 0):
        pytest.skip("Triton needs compute capability >= 7.0")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_large_tables_match_reference(seed):
    """Tens of MB per table; even seeds 512-byte aligned (vector path), odd seeds not."""
    _gpu_ok()
    rng = random.Random(100 + seed)
    segs, dst = [], 0
    for _ in range(20):
        kind = rng.choice(list(Transform))
        unit = 512 if seed % 2 == 0 else rng.choice([1, 2, 3])
        src_off = rng.randrange(0, 1 << 13) * unit
        if kind == Transform.IDENTITY:
            segs.append(Segment.identity(src_off, dst, rng.randrange(1, 1 << 13) * unit + rng.randrange(0, 2)))
        elif kind == Transform.SHARD_UNPACK:
            chunk = rng.randrange(1, 1 << 11) * unit
            segs.append(Segment.shard_unpack(src_off, dst, rng.randrange(1, 3 * chunk), chunk, chunk + 512))
        else:
            kv = rng.choice([1, 2, 3, 8])
            make = Segment.qkv_reorder if kind == Transform.QKV_REORDER else Segment.qkv_interleave
            segs.append(make(src_off, dst, kv * rng.choice([1, 3, 4]), kv, rng.randrange(1, 1 << 7) * unit))
        dst = segs[-1].dst_end + rng.randrange(0, 4) * unit
    table = SegmentTable(segs)
    torch.manual_seed(seed)
    src = torch.randint(0, 256, (max(s.src_end for s in segs),), dtype=torch.uint8, device="cuda")
    out = torch.zeros(dst, dtype=torch.uint8, device="cuda")
    ref = torch.zeros_like(out)
    materialise(src, out, table)
    materialise_torch(src, ref, table)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_qkv_real_weights(dtype):
    _gpu_ok()
    gen = torch.Generator().manual_seed(3)
    H, G, hd, d = 24, 8, 128, 3072
    q, k, v = _rand((H * hd, d), dtype, gen), _rand((G * hd, d), dtype, gen), _rand((G * hd, d), dtype, gen)
    inter = _b(_interleave(q, k, v, H, G)).cuda()
    out = torch.empty_like(inter)
    materialise(inter, out, SegmentTable([Segment.qkv_reorder(0, 0, H, G, hd * d * q.element_size())]))
    assert torch.equal(out.cpu(), _b(torch.cat([q, k, v])))


_GRAPH_SCRIPT = textwrap.dedent(
    """
    import torch
    from weightstream.kernels.materialise import Segment, SegmentTable, materialise, materialise_torch
    segs = [Segment.qkv_reorder(0, 0, 12, 4, 4096), Segment.identity(1 << 20, 81920, 777),
            Segment.shard_unpack(2 << 20, 90112, 300000, 163840, 200000)]
    table = SegmentTable(segs)
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(400000, dtype=torch.uint8, device="cuda")
    ref = torch.zeros_like(dst)
    table.upload(dst.device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        materialise(src, dst, table)  # compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        materialise(src, dst, table)
    for _ in range(3):
        src.random_(0, 256)  # new wire bytes after capture are picked up at replay
        dst.zero_()
        graph.replay()
        materialise_torch(src, ref, table)
        torch.cuda.synchronize()
        assert torch.equal(dst, ref)
    print("ok")
    """
)


@pytest.mark.gpu
def test_gpu_graph_capture_replay():
    """Captured in its own process (graph capture state must not leak between tests)."""
    _gpu_ok()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
