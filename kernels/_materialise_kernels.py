"""Triton bodies for `weightstream.kernels.materialise` (private).

One launch materialises a whole block: the grid is the total number of
BLOCK-byte tiles over all segments of a table, and each program

1. binary-searches the table's tile prefix sums for its segment,
2. reads that segment's record (see `materialise._pack_table` for the layout),
3. maps its tile to one contiguous destination range inside one destination
   row and the one contiguous source range that row comes from,
4. copies it as bytes.

Tiles never cross a row, so every tile is a plain contiguous copy: the
transform only changes where a row's bytes are read from, never the order of
bytes inside a row. Payload is moved as uint8 and never touched by arithmetic,
so the copy is exact for every dtype. Offsets are rebuilt as `(x // ALIGN) *
ALIGN` so the compiler can prove ALIGN-byte alignment and issue vector
(up to 16-byte) loads and stores on full tiles.
"""
import triton
import triton.language as tl

# Transform codes; must match `materialise.Transform`.
_IDENTITY = tl.constexpr(0)
_SHARD_UNPACK = tl.constexpr(1)
_QKV_REORDER = tl.constexpr(2)
_QKV_INTERLEAVE = tl.constexpr(3)

# int64 fields per segment record; must match `materialise._pack_table`.
_NUM_FIELDS = tl.constexpr(8)


@triton.jit
def _materialise_kernel(
    src_ptr,
    dst_ptr,
    table_ptr,
    num_segments,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    TAIL_ALIGN: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)

    # table_ptr[0 : num_segments + 1] are the tile prefix sums (first 0, last
    # the grid size); find seg with tile_start[seg] <= pid < tile_start[seg + 1].
    lo = pid * 0
    hi = lo + num_segments
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(table_ptr + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seg = lo
    tile_start = tl.load(table_ptr + seg)

    rec = table_ptr + (num_segments + 1) + seg * _NUM_FIELDS
    src_offset = tl.load(rec + 0)
    dst_offset = tl.load(rec + 1)
    nbytes = tl.load(rec + 2)
    kind = tl.load(rec + 3)
    row_bytes = tl.load(rec + 4)
    param_a = tl.load(rec + 5)  # SHARD_UNPACK: source rank stride; QKV: num_heads
    param_b = tl.load(rec + 6)  # QKV: num_kv_heads
    tiles_per_row = tl.load(rec + 7)

    local = pid - tile_start
    row = local // tiles_per_row
    col = (local - row * tiles_per_row) * BLOCK
    row_start = row * row_bytes  # inside the segment's destination range

    # Which source row feeds destination row `row` (in units of bytes).
    # QKV: heads of head_bytes (= row_bytes); H query heads, G kv groups,
    # per = H // G query heads per group, a group of the interleaved layout is
    # per + 2 heads: [q_0 .. q_{per-1}, k, v].
    num_heads = tl.maximum(param_a, 1)
    num_kv = tl.maximum(param_b, 1)
    per = num_heads // num_kv
    group_len = per + 2
    # interleaved -> fused (destination row is a fused head index)
    is_q = row < num_heads
    is_k = row < num_heads + num_kv
    q_src = (row // per) * group_len + row % per
    k_src = (row - num_heads) * group_len + per
    v_src = (row - num_heads - num_kv) * group_len + per + 1
    reorder_src = tl.where(is_q, q_src, tl.where(is_k, k_src, v_src))
    # fused -> interleaved (destination row is an interleaved head index)
    g = row // group_len
    j = row - g * group_len
    interleave_src = tl.where(j < per, g * per + j, tl.where(j == per, num_heads + g, num_heads + num_kv + g))

    src_row = tl.where(
        kind == _SHARD_UNPACK,
        row * param_a,
        tl.where(
            kind == _QKV_REORDER,
            reorder_src * row_bytes,
            tl.where(kind == _QKV_INTERLEAVE, interleave_src * row_bytes, row_start),
        ),
    )

    # Valid bytes in this tile: stop at the row end and at the segment end.
    limit = tl.minimum(row_bytes - col, nbytes - row_start - col)
    limit = (limit // TAIL_ALIGN) * TAIL_ALIGN  # exact: a hint that masks come in TAIL_ALIGN runs
    src_start = ((src_offset + src_row + col) // ALIGN) * ALIGN
    dst_start = ((dst_offset + row_start + col) // ALIGN) * ALIGN
    offs = tl.arange(0, BLOCK)
    if limit >= BLOCK:
        data = tl.load(src_ptr + src_start + offs)
        tl.store(dst_ptr + dst_start + offs, data)
    else:
        mask = offs < limit
        data = tl.load(src_ptr + src_start + offs, mask=mask)
        tl.store(dst_ptr + dst_start + offs, data, mask=mask)
