"""Lossless codec for 16-bit and float8 weights: the one-launch Triton decoder and its torch references.

Block images can be stored coded in host memory; the coded bytes are copied
H2D and `decode` writes the raw 16-bit weights into the device slot in ONE
Triton launch for any number of tensors (a `DecodeTable`, like materialise's
`SegmentTable`). `encode` (`kernels/codec_encode.py`) runs once at pack time
on the CPU with vectorised torch ops; the coded tensor format, its header and
the `DecodeTable` are in `kernels/codec_format.py`, the `@triton.jit` bodies in
`kernels/_codec_kernels.py`. `decode_torch` is the plain-torch reference of
`decode` with the same semantics, `decode_tensor` decodes one coded tensor.
Everything is lossless on raw bits (NaN payloads, +-inf, subnormals and -0
round-trip exactly): values are never touched by float arithmetic.

Decode (`decode(src, dst, table)`): a program decodes one tile of one tensor:
it finds its tensor by binary search over the table's tile prefix sums, loads
the raw bytes and code planes of its tile (contiguous), marks escapes, takes a
prefix sum (`tl.cumsum`) of the escape mask plus the tile's base to index the
exception stream (version 2: the level-2 codes, and a second prefix sum of
the level-2 escapes plus the tile's base2 for theirs; compiled in only for a
table that holds a version-2 tensor, `DecodeTable.two_level`: with it, exp-k
decoded 306 instead of 509 GB/s on the H200), looks up the table,
and stores 16-bit elements (float8 tensors: the symbol is the element, stored as a byte through
a uint8 view of the destination; compiled in only for a table that holds one, `DecodeTable.bytes8`;
they never take the word path). Full tiles of tensors whose level-1 table is a window of
consecutive symbols (weights' exponents nearly always are; 2 <= k <= 4, k2 <= 3, no carry
past 255; `codec_format._word_window`) take a four-elements-per-word path instead (`DecodeTable.words`):
code bytes plus the window's first symbol in one add, escapes flagged, counted and ranked
per uint32 word, each word's exceptions (version 2: its level-2 codes, then its level-2
exceptions) read as one 4-byte window and moved to their bytes, two uint32 stores per word.
On the H200 (Flux double block, Student-t, exp-k) it decoded 777 GB/s against 505 for the
element path (43c277b). The element path decodes a tile `ELEM_CHUNK` elements at a time
(escape ranks carried from chunk to chunk): compiled in the same kernel, a whole-tile element
path held the word path at about half its own speed (registers, occupancy; the word path
alone ran 1277-1810 GB/s, docs/performance.md); chunked (512), with 4 warps, exp-k / exp-k2 /
exp-kp decode 1519 / 799 / 1790 GB/s (daab061). The chunks are a runtime loop: unrolled (1401 / 825 /
1947 GB/s, 0ddf8a2) a tile compiled TILE / ELEM_CHUNK copies of the element path and exp-k2's first
step on a fresh machine did not finish in 80 s (docs/performance.md). No host
sync, no allocation, fixed launch configuration, no autotune: capturable in a
CUDA graph after `table.upload(device)` and one eager call. Traffic per
element: ~1.4 bytes read (raw, codes, escapes) and 2 written.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from ._buffers import check_byte_buffers, device_table
from .codec_format import (_PLANES, BYTE_DTYPES, VERSION3, CodedHeader, DecodeTable, _as_bytes, _code2_bytes,
                           read_header)

__all__ = ["decode", "decode_torch", "decode_tensor", "bytes_moved"]

ELEM_CHUNK = 512  # elements the element path decodes at a time (a tile in TILE / ELEM_CHUNK steps); at 4 warps
# 512 against 1024 decodes exp-k 1274.6 vs 1115.5, exp-k2 703.1 vs 631.9, exp-kp 1493.7 vs 1470.3 GB/s (H200,
# docs/performance.md): fewer live registers beside the word path. A runtime loop over
# the chunks (not unrolled: compiles 4-8x faster, exp-k2 at tile 16384 14 s instead of minutes): 1519 / 799 / 1790
# GB/s against 1401 / 825 / 1947 unrolled (H200, docs/performance.md)
# Under TRITON_INTERPRET=1 (CPU) the same kernel decodes whole tiles: the chunks only lower the GPU's live
# registers, and the interpreter's cost is per op (chunks of 1024 doubled the CPU suite's coded tests). The
# bytes are the same either way; tests set this smaller to run the chunked path on the CPU.
INTERPRET_ELEM_CHUNK = 1 << 16  # MAX_TILE


def bytes_moved(table: DecodeTable) -> int:
    """Bytes one `decode(src, dst, table)` moves: coded bytes read + decoded bytes written."""
    if not isinstance(table, DecodeTable):
        raise TypeError(f"table must be a DecodeTable, got {type(table).__name__}")
    return table.coded_nbytes + table.decoded_nbytes


# ----------------------------------------------------------------------------
# launcher and reference
# ----------------------------------------------------------------------------


def _check_buffers(src, dst, table) -> None:
    check_byte_buffers(src, dst, table, DecodeTable, "decode")
    if dst.numel() and dst.data_ptr() % 2:
        raise ValueError("dst must start at an even address (16-bit elements are stored)")


def decode(src: torch.Tensor, dst: torch.Tensor, table: DecodeTable) -> int:
    """Decode every coded tensor of `table` from `src` into `dst` in one launch.

    src, dst: 1-D contiguous uint8 tensors on one CUDA device (or CPU under
    TRITON_INTERPRET=1), not overlapping. Returns the decoded bytes written.
    Launch order is the caller's current stream. Capturable in a CUDA graph
    after `table.upload(dst.device)` and one eager call (compilation).
    """
    tab = device_table(src, dst, table, DecodeTable, "decode")
    if dst.numel() and dst.data_ptr() % 2:
        raise ValueError("dst must start at an even address (16-bit elements are stored)")
    if tab is None:
        return 0
    from ._codec_kernels import _decode_kernel  # triton is imported only when launching

    _decode_kernel[(table.num_tiles,)](
        src,
        dst[: table.dst_nbytes - table.dst_nbytes % 2].view(torch.int16),
        dst[: table.dst_nbytes],
        tab,
        table.num_segments,
        TILE=table.tile,
        SEARCH_STEPS=table.search_steps,
        DST_ALIGN=table.dst_align,
        GATHER=table.gather_planes,
        LEVEL2=table.two_level,
        PATCHED=table.patched,
        RANKED=table.ranked,
        CHUNK=_elem_chunk(table),
        BYTES=table.bytes8,
        WORDS=_words_for(src, dst, table),
        num_warps=table.num_warps,
    )
    return table.decoded_nbytes


def _elem_chunk(table: DecodeTable) -> int:
    """The element path's chunk for this launch (whole tiles without gathered planes)."""
    if not table.gather_planes:
        return table.tile
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return min(table.tile, INTERPRET_ELEM_CHUNK if interpreted else ELEM_CHUNK)


def _words_for(src: torch.Tensor, dst: torch.Tensor, table: DecodeTable) -> bool:
    """Whether this launch takes the word path: the table allows it, src starts 8-byte aligned (its
    int64 base loads) and dst 4-byte aligned (its uint32 stores): they would fault otherwise."""
    return table.words and src.data_ptr() % 8 == 0 and dst.data_ptr() % 4 == 0


def _unpack_codes(buf: torch.Tensor, head: CodedHeader) -> torch.Tensor:
    """The k-bit codes of every element (int32), from the plane layout."""
    tiles, tile, k = head.num_tiles, head.tile, head.k
    planes = buf[head.code_off : head.base_off].view(tiles, tile * k // 8).to(torch.int32)
    code = torch.zeros(tiles, tile, dtype=torch.int32, device=buf.device)
    at = 0
    for w in _PLANES:
        if not k & w:
            continue
        per, span = 8 // w, tile * w // 8
        plane = planes[:, at : at + span]
        for s in range(per):
            code[:, s * span : (s + 1) * span] |= ((plane >> (w * s)) & ((1 << w) - 1)) << (k & (w - 1))
        at += span
    return code.reshape(-1)[: head.numel]


def _decode_one(buf: torch.Tensor, head: CodedHeader) -> torch.Tensor:
    """Reference decode of one coded tensor (`buf` starts at its header) -> int16 elements
    (8-bit elements: uint8)."""
    n = head.numel
    raw = buf[head.raw_off : head.raw_off + head.raw_bytes].to(torch.int32)
    if head.k == 0:
        sym = torch.full((n,), head.table[0], dtype=torch.int32, device=buf.device)
    elif head.k == 8:
        sym = _unpack_codes(buf, head)
    else:
        code = _unpack_codes(buf, head)
        n1 = (1 << head.k) - 1
        table = torch.tensor(list(head.table[:n1]) + [0], dtype=torch.int32, device=buf.device)
        sym = table[code.long()]
        esc = code == n1
        if head.version == VERSION3:
            sym[_patch_index(buf, head, esc)] = buf[head.patch_sym_off : head.patch_sym_off + head.num_exceptions].to(
                torch.int32)
            esc = None
        elif head.k2:
            exc = _level2_symbols(buf, head, int(esc.sum()))
        else:
            exc = _exceptions(buf, head, int(esc.sum()))
        if esc is not None:
            sym[esc] = exc  # element order
    if head.dtype in BYTE_DTYPES:
        return sym.to(torch.uint8)
    if head.dtype == torch.bfloat16:
        val = ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7F)
    else:
        val = (sym << 8) | raw
    return (val - ((val >> 15) << 16)).to(torch.int16)  # two's complement of the 16 bits


def _patch_index(buf: torch.Tensor, head: CodedHeader, esc: torch.Tensor) -> torch.Tensor:
    """Version 3: the element index of every patch (tile start from the base stream plus the
    uint16 position); ValueError unless they are exactly the escapes `esc` marks."""
    n, tiles = head.num_exceptions, head.num_tiles
    base = buf[head.base_off : head.base_off + 8 * (tiles + 1)].clone().view(torch.int64)
    counts = base[1:] - base[:-1]
    if int(base[0]) != 0 or int(base[-1]) != n or bool((counts < 0).any()):
        raise ValueError(f"coded tensor (version 3) has a base stream inconsistent with its {n} patches")
    pos = buf[head.exc_off : head.exc_off + 2 * n].clone().view(torch.int16).to(torch.int64) & 0xFFFF
    tile_of = torch.repeat_interleave(torch.arange(tiles, device=buf.device), counts.to(buf.device))
    index = tile_of * head.tile + pos
    if not torch.equal(index, torch.nonzero(esc).flatten()):
        raise ValueError("coded tensor (version 3): its patch positions are not its escapes")
    return index


def _exceptions(buf: torch.Tensor, head: CodedHeader, escapes: int) -> torch.Tensor:
    """The exception bytes (int32) of a coded tensor that marks `escapes` of them."""
    exc = buf[head.exc_off : head.exc_off + head.num_exceptions].to(torch.int32)
    if escapes != exc.numel():
        raise ValueError(f"coded tensor has {escapes} escapes but {exc.numel()} exceptions")
    return exc


def _level2_symbols(buf: torch.Tensor, head: CodedHeader, escapes: int) -> torch.Tensor:
    """Version 2: the symbols (int32) of the `escapes` level-1 escapes, in element order: the
    k2-bit code of escape r at bit r * k2 of the level-2 code stream indexes the level-2
    table; its escape code takes the next level-2 exception byte."""
    if escapes != head.num_escapes:
        raise ValueError(f"coded tensor has {escapes} level-1 escapes but its header says {head.num_escapes}")
    k2, n1 = head.k2, (1 << head.k) - 1
    stream = buf[head.code2_off : head.code2_off + _code2_bytes(escapes, k2)].to(torch.int32)
    bit = torch.arange(escapes, dtype=torch.int64, device=buf.device) * k2
    pair = stream[bit >> 3] | (stream[(bit >> 3) + 1] << 8)  # the stream has a byte past its last code
    code2 = (pair >> (bit & 7)) & ((1 << k2) - 1)
    table2 = torch.tensor(list(head.table[n1:]) + [0], dtype=torch.int32, device=buf.device)
    sym = table2[code2]
    esc2 = code2 == (1 << k2) - 1
    sym[esc2] = _exceptions(buf, head, int(esc2.sum()))
    return sym


def decode_any(src: torch.Tensor, dst: torch.Tensor, table: DecodeTable) -> int:
    """The decode a source runs: the Triton kernel on CUDA, the plain-torch reference on the
    CPU (same bytes; the kernel itself is tested against the reference under
    ``TRITON_INTERPRET=1`` in tests/kernels). Returns the decoded bytes written."""
    return decode(src, dst, table) if dst.device.type == "cuda" else decode_torch(src, dst, table)


def decode_torch(src: torch.Tensor, dst: torch.Tensor, table: DecodeTable) -> int:
    """Plain-torch reference of `decode` (same checks, same bytes); any device."""
    _check_buffers(src, dst, table)
    for s in table._live:
        vals = _decode_one(src[s.src_offset : s.src_end], s.header)
        dst[s.dst_offset : s.dst_end].copy_(vals.view(torch.uint8))
    return table.decoded_nbytes


def decode_tensor(buf: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
    """Reference decode of one coded tensor (as `encode` returns it) to a new tensor
    of its dtype, shaped `shape` (default 1-D), on `buf`'s device."""
    head = read_header(_as_bytes(buf))
    out = _decode_one(buf, head).view(head.dtype)
    return out if shape is None else out.view(tuple(shape))

