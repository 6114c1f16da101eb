"""Materialise a block's runtime layout from its wire bytes in one fused launch.

A block image arrives in a device buffer in *wire layout* (checkpoint layout,
or per-tensor shards after an all-gather) and must become the *runtime
layout* inside a device slot. A `SegmentTable` says, for every destination
byte range, where its bytes come from and how they are permuted; `materialise`
runs the whole table as ONE Triton launch; `materialise_torch` is the
plain-torch reference with identical semantics.

Everything is bytes: `src` and `dst` are 1-D contiguous uint8 tensors (a view
of any dtype's storage), offsets and sizes are in bytes, and transforms only
move whole byte ranges, so results are exact for bf16, fp16, fp32, fp8, int8
or any other dtype.

Transforms (each a segment writing `[dst_offset, dst_offset + nbytes)`):

IDENTITY
    `dst[d : d + n] = src[s : s + n]`. Concatenation into a fused projection
    is several IDENTITY segments writing adjacent destination ranges, see
    `concat_segments`.

SHARD_UNPACK (per-tensor sharding)
    The source is the rank-major buffer that `all_gather_into_tensor` writes
    when every rank contributes one *shard* of `rank_stride` bytes, and shard
    r holds chunk r of every tensor back to back. For one tensor of `nbytes`
    bytes split into chunks of `chunk_bytes` (the last ones shorter or empty),
    chunk r lives at `src_offset + r * rank_stride` (src_offset = the chunk's
    offset inside a shard) and is written to
    `dst[dst_offset + r * chunk_bytes : ...]`; the result is the tensor in
    ordinary tensor-major order. `shard_layout` / `shard_unpack_segments` /
    `pack_shards_torch` build such layouts.
    The *other* sharding, where each rank holds a contiguous chunk of the flat
    block image, needs no transform at all: the gathered buffer already is the
    image (plus tail padding), so its table is identity.

QKV_REORDER (head-interleaved -> fused)
    Source: the checkpoint's grouped layout along the output-feature (row)
    dimension, per kv group g: its `num_heads // num_kv_heads` query heads,
    then its key head, then its value head:
    `[q_g0..., k_0, v_0, q_g1..., k_1, v_1, ...]`.
    Destination: the fused layout `[q_0 .. q_{H-1}, k_0 .. k_{G-1}, v_0 .. v_{G-1}]`.
    A head is `head_bytes` = head_dim * in_features * element size bytes
    (head_dim * element size for a bias). MHA is num_kv_heads == num_heads.
    Separate q, k, v tensors need no reorder: three IDENTITY segments into
    adjacent ranges (`concat_segments`).

QKV_INTERLEAVE
    The inverse of QKV_REORDER (fused -> head-interleaved).

Hot path: `SegmentTable` validates the segments once, packs them with tile
prefix sums into one int64 tensor and keeps one device copy per device
(`table.upload(device)`), so a `materialise` call does no allocation, no
host-device copy, no sync and no autotuning: it can be captured in a CUDA
graph once the table is uploaded and the kernel compiled (one eager call).

Speed: a program copies one `tile_bytes` tile that never crosses a
destination row (a head, a shard chunk, or the whole tensor for IDENTITY).
Full tiles use 16-byte accesses when every segment's source/destination
offset (and row size / rank stride) is a multiple of 16 (`table.align`), and
tail tiles too when every size is (`table.tail_align`); one odd offset drops
the whole launch to narrower accesses, so keep tensors 16-byte (better 512)
aligned in both images. Rows much smaller than a tile (a bias's heads) waste
most of their program; they are small.

Not supported in one segment: QKV reordering of a tensor that is itself
per-tensor sharded (shard the image contiguously instead, or unpack first).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ._buffers import PackedTable, canonical_device, check_byte_buffers, device_table

__all__ = [
    "Transform",
    "Segment",
    "SegmentTable",
    "ShardLayout",
    "materialise",
    "materialise_torch",
    "bytes_moved",
    "concat_segments",
    "qkv_separate_segments",
    "shard_layout",
    "shard_unpack_segments",
    "pack_shards_torch",
    "DEFAULT_TILE_BYTES",
    "DEFAULT_NUM_WARPS",
]

# Fixed launch config (no autotune: the launch must be capturable).
DEFAULT_TILE_BYTES = 16384
DEFAULT_NUM_WARPS = 4
_MAX_ALIGN = 16  # widest vector access (bytes)


class Transform(enum.IntEnum):
    """How a segment's destination rows are sourced. Values are kernel codes."""

    IDENTITY = 0
    SHARD_UNPACK = 1
    QKV_REORDER = 2
    QKV_INTERLEAVE = 3


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class Segment:
    """One destination byte range and where its bytes come from.

    Fields (all bytes):
      src_offset, dst_offset, nbytes: the source start and the destination
        range `[dst_offset, dst_offset + nbytes)`.
      transform: a `Transform`.
      row_bytes: SHARD_UNPACK: chunk bytes per rank; QKV_*: bytes per head.
        0 for IDENTITY.
      rank_stride: SHARD_UNPACK: bytes between consecutive ranks' shards in
        the source (the per-rank shard size). 0 otherwise.
      num_heads, num_kv_heads: QKV_* only (0 otherwise);
        num_heads % num_kv_heads == 0.
    Prefer the constructors `identity`, `shard_unpack`, `qkv_reorder`,
    `qkv_interleave`.
    """

    src_offset: int
    dst_offset: int
    nbytes: int
    transform: Transform = Transform.IDENTITY
    row_bytes: int = 0
    rank_stride: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0

    def __post_init__(self) -> None:
        _check_int("src_offset", self.src_offset, 0)
        _check_int("dst_offset", self.dst_offset, 0)
        _check_int("nbytes", self.nbytes, 0)
        try:
            object.__setattr__(self, "transform", Transform(self.transform))
        except ValueError:
            names = [t.name for t in Transform]
            raise ValueError(f"transform must be one of {names}, got {self.transform!r}") from None
        for name in ("row_bytes", "rank_stride", "num_heads", "num_kv_heads"):
            _check_int(name, getattr(self, name), 0)
        t = self.transform
        if t == Transform.IDENTITY:
            if self.row_bytes or self.rank_stride or self.num_heads or self.num_kv_heads:
                raise ValueError("IDENTITY segment takes no row_bytes/rank_stride/num_heads/num_kv_heads")
        elif t == Transform.SHARD_UNPACK:
            _check_int("row_bytes (chunk bytes)", self.row_bytes, 1)
            if self.rank_stride < self.row_bytes:
                raise ValueError(
                    f"rank_stride must be >= row_bytes (chunk bytes) {self.row_bytes}, got {self.rank_stride}"
                )
            if self.num_heads or self.num_kv_heads:
                raise ValueError("SHARD_UNPACK segment takes no num_heads/num_kv_heads")
        else:
            _check_int("num_heads", self.num_heads, 1)
            _check_int("num_kv_heads", self.num_kv_heads, 1)
            _check_int("row_bytes (head bytes)", self.row_bytes, 1)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
                )
            want = (self.num_heads + 2 * self.num_kv_heads) * self.row_bytes
            if self.nbytes != want:
                raise ValueError(
                    f"nbytes must be (num_heads + 2 * num_kv_heads) * head bytes = {want} for {t.name}, "
                    f"got {self.nbytes}"
                )
            if self.rank_stride:
                raise ValueError(f"{t.name} segment takes no rank_stride")

    # -- constructors ---------------------------------------------------
    @classmethod
    def identity(cls, src_offset: int, dst_offset: int, nbytes: int) -> "Segment":
        return cls(src_offset, dst_offset, nbytes)

    @classmethod
    def shard_unpack(
        cls, src_offset: int, dst_offset: int, nbytes: int, chunk_bytes: int, rank_stride: int
    ) -> "Segment":
        return cls(src_offset, dst_offset, nbytes, Transform.SHARD_UNPACK, chunk_bytes, rank_stride)

    @classmethod
    def qkv_reorder(
        cls, src_offset: int, dst_offset: int, num_heads: int, num_kv_heads: int, head_bytes: int
    ) -> "Segment":
        """Head-interleaved (per group: q heads, k, v) -> fused [q; k; v]."""
        _check_int("head_bytes", head_bytes, 1)
        nbytes = (num_heads + 2 * num_kv_heads) * head_bytes
        return cls(src_offset, dst_offset, nbytes, Transform.QKV_REORDER, head_bytes, 0, num_heads, num_kv_heads)

    @classmethod
    def qkv_interleave(
        cls, src_offset: int, dst_offset: int, num_heads: int, num_kv_heads: int, head_bytes: int
    ) -> "Segment":
        """Fused [q; k; v] -> head-interleaved (the inverse of `qkv_reorder`)."""
        _check_int("head_bytes", head_bytes, 1)
        nbytes = (num_heads + 2 * num_kv_heads) * head_bytes
        return cls(src_offset, dst_offset, nbytes, Transform.QKV_INTERLEAVE, head_bytes, 0, num_heads, num_kv_heads)

    # -- geometry -------------------------------------------------------
    @property
    def tile_row_bytes(self) -> int:
        """Destination row length: tiles never cross a row."""
        return self.row_bytes if self.transform != Transform.IDENTITY else self.nbytes

    @property
    def src_end(self) -> int:
        """One past the last source byte this segment reads."""
        if self.nbytes == 0:
            return self.src_offset
        if self.transform == Transform.SHARD_UNPACK:
            last = (self.nbytes - 1) // self.row_bytes
            return self.src_offset + last * self.rank_stride + (self.nbytes - last * self.row_bytes)
        return self.src_offset + self.nbytes

    @property
    def dst_end(self) -> int:
        return self.dst_offset + self.nbytes


def _num_tiles(seg: Segment, tile_bytes: int) -> tuple[int, int]:
    """(tiles_per_row, tiles) of a non-empty segment."""
    row = seg.tile_row_bytes
    tiles_per_row = -(-row // tile_bytes)
    full_rows, tail = divmod(seg.nbytes, row)
    return tiles_per_row, full_rows * tiles_per_row + -(-tail // tile_bytes)


class SegmentTable(PackedTable):
    """A validated, packed segment table with cached device copies.

    `segments` is kept as given. Construction checks that destination ranges
    do not overlap, merges IDENTITY runs that are contiguous in both source
    and destination, and packs the table (int64):
      [tile_start_0 = 0, ..., tile_start_S = num_tiles,
       S records of (src_offset, dst_offset, nbytes, transform, row_bytes,
                     rank_stride | num_heads, num_kv_heads, tiles_per_row)].
    `tile_bytes` (a power of two) and `num_warps` are the fixed launch config.
    """

    def __init__(
        self,
        segments: Iterable[Segment],
        *,
        tile_bytes: int = DEFAULT_TILE_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
    ) -> None:
        self.segments: tuple[Segment, ...] = tuple(segments)
        for i, seg in enumerate(self.segments):
            if not isinstance(seg, Segment):
                raise TypeError(f"segments[{i}] must be a Segment, got {type(seg).__name__}")
        _check_int("tile_bytes", tile_bytes, _MAX_ALIGN)
        if tile_bytes & (tile_bytes - 1):
            raise ValueError(f"tile_bytes must be a power of two, got {tile_bytes}")
        _check_int("num_warps", num_warps, 1)
        if num_warps & (num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {num_warps}")
        self.tile_bytes = tile_bytes
        self.num_warps = num_warps

        live = sorted((s for s in self.segments if s.nbytes), key=lambda s: s.dst_offset)
        for a, b in zip(live, live[1:]):
            if a.dst_end > b.dst_offset:
                raise ValueError(
                    f"segments: destination ranges overlap: [{a.dst_offset}, {a.dst_end}) and "
                    f"[{b.dst_offset}, {b.dst_end})"
                )
        self._runs: tuple[Segment, ...] = tuple(_merge_identity(live))
        self.src_nbytes = max((s.src_end for s in self._runs), default=0)
        self.dst_nbytes = max((s.dst_end for s in self._runs), default=0)
        self.nbytes = sum(s.nbytes for s in self._runs)
        self.is_identity = all(
            s.transform == Transform.IDENTITY and s.src_offset == s.dst_offset for s in self._runs
        )
        self.align, self.tail_align = _table_align(self._runs)
        self._host, self.num_tiles = _pack_table(self._runs, tile_bytes)
        self.search_steps = max(1, math.ceil(math.log2(max(1, len(self._runs)))))
        self._device: dict[torch.device, torch.Tensor] = {}

    @property
    def num_segments(self) -> int:
        """Segments after merging contiguous identity runs (what the kernel sees)."""
        return len(self._runs)

    def __repr__(self) -> str:
        kinds = {}
        for s in self._runs:
            kinds[s.transform.name] = kinds.get(s.transform.name, 0) + 1
        return (
            f"SegmentTable({len(self.segments)} segments -> {self.num_segments} runs {kinds}, "
            f"{self.nbytes} bytes, {self.num_tiles} tiles of {self.tile_bytes}, align {self.align}/{self.tail_align}"
            f"{', identity' if self.is_identity else ''})"
        )


_canonical_device = canonical_device


def _merge_identity(segs: Sequence[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for s in segs:
        p = out[-1] if out else None
        if (
            p is not None
            and p.transform == Transform.IDENTITY
            and s.transform == Transform.IDENTITY
            and p.dst_end == s.dst_offset
            and p.src_offset + p.nbytes == s.src_offset
        ):
            out[-1] = Segment(p.src_offset, p.dst_offset, p.nbytes + s.nbytes)
        else:
            out.append(s)
    return out


def _table_align(segs: Sequence[Segment]) -> tuple[int, int]:
    """(align, tail_align): the largest powers of two <= 16 dividing every
    tile's source and destination start, and every tile's length."""
    start = tail = _MAX_ALIGN
    for s in segs:
        start = math.gcd(start, s.src_offset, s.dst_offset)
        tail = math.gcd(tail, s.nbytes)
        if s.transform != Transform.IDENTITY:
            start = math.gcd(start, s.row_bytes, s.rank_stride)
            tail = math.gcd(tail, s.row_bytes)
    return start, tail  # divisors of 16 are powers of two


def _pack_table(segs: Sequence[Segment], tile_bytes: int) -> tuple[torch.Tensor, int]:
    starts = [0]
    records = []
    for s in segs:
        tiles_per_row, tiles = _num_tiles(s, tile_bytes)
        starts.append(starts[-1] + tiles)
        a = s.rank_stride if s.transform == Transform.SHARD_UNPACK else s.num_heads
        records += [s.src_offset, s.dst_offset, s.nbytes, int(s.transform)]
        records += [s.tile_row_bytes, a, s.num_kv_heads, tiles_per_row]
    return torch.tensor(starts + records, dtype=torch.int64), starts[-1]


def bytes_moved(table: SegmentTable) -> int:
    """Bytes one `materialise(src, dst, table)` writes (it reads as many)."""
    if not isinstance(table, SegmentTable):
        raise TypeError(f"table must be a SegmentTable, got {type(table).__name__}")
    return table.nbytes


# ----------------------------------------------------------------------------
# launcher and reference
# ----------------------------------------------------------------------------


def _check_buffers(src, dst, table) -> None:
    check_byte_buffers(src, dst, table, SegmentTable, "materialise")


def materialise(src: torch.Tensor, dst: torch.Tensor, table: SegmentTable) -> int:
    """Write `table`'s runtime layout into `dst` from wire bytes `src` in one launch.

    src, dst: 1-D contiguous uint8 tensors on one CUDA device (or CPU under
    TRITON_INTERPRET=1), not overlapping. Returns the bytes written. Launch
    order is the caller's current stream. Capturable in a CUDA graph after
    `table.upload(dst.device)` and one eager call (kernel compilation).
    """
    tab = device_table(src, dst, table, SegmentTable, "materialise")
    if tab is None:
        return 0
    from ._materialise_kernels import _materialise_kernel  # triton is imported only when launching

    _materialise_kernel[(table.num_tiles,)](
        src,
        dst,
        tab,
        table.num_segments,
        BLOCK=table.tile_bytes,
        ALIGN=table.align,
        TAIL_ALIGN=table.tail_align,
        SEARCH_STEPS=table.search_steps,
        num_warps=table.num_warps,
    )
    return table.nbytes


def _qkv_source_rows(transform: Transform, num_heads: int, num_kv_heads: int) -> list[int]:
    """Source head index of every destination head."""
    per = num_heads // num_kv_heads
    interleaved = []  # interleaved position -> fused head index
    for g in range(num_kv_heads):
        interleaved += [g * per + j for j in range(per)]
        interleaved += [num_heads + g, num_heads + num_kv_heads + g]
    if transform == Transform.QKV_INTERLEAVE:
        return interleaved
    fused = [0] * len(interleaved)  # fused head -> interleaved position
    for pos, head in enumerate(interleaved):
        fused[head] = pos
    return fused


def materialise_torch(src: torch.Tensor, dst: torch.Tensor, table: SegmentTable) -> int:
    """Plain-torch reference of `materialise` (same checks, same bytes); any device."""
    _check_buffers(src, dst, table)
    for s in table.segments:
        if s.nbytes == 0:
            continue
        out = dst[s.dst_offset : s.dst_end]
        if s.transform == Transform.IDENTITY:
            out.copy_(src[s.src_offset : s.src_offset + s.nbytes])
        elif s.transform == Transform.SHARD_UNPACK:
            for r, d in enumerate(range(0, s.nbytes, s.row_bytes)):
                n = min(s.row_bytes, s.nbytes - d)
                base = s.src_offset + r * s.rank_stride
                out[d : d + n].copy_(src[base : base + n])
        else:
            heads = src[s.src_offset : s.src_offset + s.nbytes].view(-1, s.row_bytes)
            rows = torch.tensor(_qkv_source_rows(s.transform, s.num_heads, s.num_kv_heads), device=src.device)
            out.view(-1, s.row_bytes).copy_(heads.index_select(0, rows))
    return table.nbytes


# ----------------------------------------------------------------------------
# table builders
# ----------------------------------------------------------------------------


def concat_segments(parts: Sequence[tuple[int, int]], dst_offset: int) -> list[Segment]:
    """IDENTITY segments copying `parts` = [(src_offset, nbytes), ...] to adjacent
    destination ranges starting at `dst_offset` (fusing tensors into one projection)."""
    out, d = [], dst_offset
    for i, part in enumerate(parts):
        if len(part) != 2:
            raise ValueError(f"parts[{i}] must be (src_offset, nbytes), got {part!r}")
        out.append(Segment.identity(part[0], d, part[1]))
        d += part[1]
    return out


def qkv_separate_segments(
    q: tuple[int, int], k: tuple[int, int], v: tuple[int, int], dst_offset: int
) -> list[Segment]:
    """Separate q, k, v tensors ((src_offset, nbytes) each) -> fused [q; k; v] at `dst_offset`."""
    return concat_segments([q, k, v], dst_offset)


@dataclass(frozen=True)
class ShardLayout:
    """Per-tensor sharding of a block over `world_size` ranks.

    Tensor t (`tensor_nbytes[t]` bytes at `tensor_offsets[t]` of the
    tensor-major runtime image) is cut into world_size chunks of
    `chunk_bytes[t]` (whole rows; the last chunks may be shorter or empty).
    Every rank's shard is `shard_bytes` long and holds its chunk of tensor t at
    `chunk_offsets[t]`, zero-padded to chunk_bytes[t]. After
    `all_gather_into_tensor` the gathered buffer is the shards rank-major:
    rank r's shard at `r * shard_bytes`.
    """

    world_size: int
    shard_bytes: int
    tensor_offsets: tuple[int, ...]
    tensor_nbytes: tuple[int, ...]
    chunk_bytes: tuple[int, ...]
    chunk_offsets: tuple[int, ...]

    @property
    def gathered_bytes(self) -> int:
        return self.world_size * self.shard_bytes


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def shard_layout(
    tensor_nbytes: Sequence[int],
    world_size: int,
    *,
    tensor_offsets: Sequence[int] | None = None,
    row_bytes: Sequence[int] | None = None,
    align: int = _MAX_ALIGN,
) -> ShardLayout:
    """Plan per-tensor row-chunk sharding of tensors of `tensor_nbytes` bytes.

    tensor_offsets: where each tensor sits in the runtime image (default:
    packed back to back, each at an `align`-aligned offset). row_bytes: bytes
    per row of each tensor (default 1): chunks hold whole rows, ceil(rows / N)
    rows rounded up so chunks are `align`-byte multiples.
    """
    _check_int("world_size", world_size, 1)
    _check_int("align", align, 1)
    n = len(tensor_nbytes)
    for i, b in enumerate(tensor_nbytes):
        _check_int(f"tensor_nbytes[{i}]", b, 0)
    rows_b = list(row_bytes) if row_bytes is not None else [1] * n
    if len(rows_b) != n:
        raise ValueError(f"row_bytes must have {n} entries, got {len(rows_b)}")
    if tensor_offsets is None:
        offs, at = [], 0
        for b in tensor_nbytes:
            at = _round_up(at, align)
            offs.append(at)
            at += b
    else:
        offs = list(tensor_offsets)
        if len(offs) != n:
            raise ValueError(f"tensor_offsets must have {n} entries, got {len(offs)}")
    chunks, chunk_offs, at = [], [], 0
    for i, (b, rb) in enumerate(zip(tensor_nbytes, rows_b)):
        _check_int(f"row_bytes[{i}]", rb, 1)
        if b % rb:
            raise ValueError(f"tensor_nbytes[{i}] ({b}) must be a multiple of row_bytes[{i}] ({rb})")
        step = align // math.gcd(rb, align)  # rows per aligned unit
        chunk_rows = _round_up(-(-(b // rb) // world_size), step)
        chunks.append(max(chunk_rows * rb, align))
        at = _round_up(at, align)
        chunk_offs.append(at)
        at += chunks[-1]
    shard_bytes = _round_up(max(at, 1), align)
    return ShardLayout(world_size, shard_bytes, tuple(offs), tuple(tensor_nbytes), tuple(chunks), tuple(chunk_offs))


def _layout_rows(layout: ShardLayout):
    return zip(layout.tensor_offsets, layout.tensor_nbytes, layout.chunk_bytes, layout.chunk_offsets)


def shard_unpack_segments(layout: ShardLayout, src_offset: int = 0) -> list[Segment]:
    """SHARD_UNPACK segments turning the gathered buffer (at `src_offset` of the
    source) into the tensor-major runtime image."""
    return [
        Segment.shard_unpack(src_offset + co, off, nb, cb, layout.shard_bytes)
        for off, nb, cb, co in _layout_rows(layout)
    ]


def pack_shards_torch(image: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """Reference inverse of SHARD_UNPACK: tensor-major uint8 `image` -> the
    rank-major gathered buffer (rank r's shard is `[r * shard_bytes, (r + 1) * shard_bytes)`)."""
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.dim() != 1:
        raise TypeError("image must be a 1-D torch.uint8 tensor")
    out = torch.zeros(layout.gathered_bytes, dtype=torch.uint8, device=image.device)
    for off, nb, cb, co in _layout_rows(layout):
        if off + nb > image.numel():
            raise ValueError(f"image has {image.numel()} bytes, a tensor ends at {off + nb}")
        for r in range(layout.world_size):
            lo, hi = r * cb, min((r + 1) * cb, nb)
            if lo < hi:
                base = r * layout.shard_bytes + co
                out[base : base + hi - lo] = image[off + lo : off + hi]
    return out
