"""Lossless codec for 16-bit weights: CPU encoder, one-launch Triton decoder.

Block images can be stored coded in host memory; the coded bytes are copied
H2D and `decode` writes the raw 16-bit weights into the device slot in ONE
Triton launch for any number of tensors (a `DecodeTable`, like materialise's
`SegmentTable`). `encode` runs once at pack time on the CPU with vectorised
torch ops. `decode_torch` is the plain-torch reference of `decode` with the
same semantics. Everything is lossless on raw bits (NaN payloads, +-inf,
subnormals and -0 round-trip exactly): values are never touched by float
arithmetic.

The code
--------
Every 16-bit element is split into a *symbol* byte, which is entropy-poor in
weights, and a *raw* byte, which is stored as is:

- bfloat16 (sign 1, exponent 8, mantissa 7): symbol = the exponent,
  raw = sign << 7 | mantissa.
- float16 / int16 (anything else 16-bit): symbol = the high byte (fp16: sign,
  5-bit exponent, 2 mantissa bits), raw = the low byte. fp16's exponent does
  not fill a byte, so its high byte is coded instead; it gains less
  (~0.85-0.89 of the bytes on weight-like fills vs ~0.69-0.71 for bf16).

Symbols are coded per tensor with `k` bits each (0 <= k <= 8, chosen by the
encoder to minimise the coded size, or given):

- 1 <= k <= 7: a table of the `2^k - 1` most frequent symbols; code `j` means
  `table[j]`, the code `2^k - 1` is the escape: the symbol is the next byte of
  the exception stream (exceptions are in element order).
- k = 8: the code is the symbol itself (no table, no escapes).
- k = 0: no code stream; every symbol is `table[0]` (one symbol value only).

So a coded element costs 8 + k bits plus 8 bits per escape. On bf16 weights
k = 3 wins: 0.69 (uniform init), 0.70 (Gaussian), 0.71 (Student-t df=4) of
the raw bytes, against an exponent-entropy bound of 0.64 / 0.66 / 0.67.

Two levels (version 2, `encode(..., levels=2)`, codec "exp-k2"): the escapes
of a level-1 code with `k` bits (1 <= k <= 7) are coded again, each with `k2`
bits (1 <= k2 <= 7) against a second table of the `2^k2 - 1` symbols that
follow the level-1 ones in frequency; the level-2 code `2^k2 - 1` escapes to
a raw exception byte. An element costs 8 + k bits, plus k2 bits per level-1
escape, plus 8 bits per level-2 escape (and 8 bytes per tile for a second
base stream). The encoder picks (k, k2) from the same histogram, one-level
codes included: when none of the two-level ones is smaller, `levels=2` writes
the version-1 bytes. On Student-t bf16 weights (k, k2) = (2, 3) wins:
10.98-11.06 bits per weight (0.686-0.691 of the bytes, depending on where the
tensor's scale falls between powers of two; 11.31-11.35 with one level).

Coded tensor format (one flat uint8 buffer, little-endian, 16-byte aligned
streams, total length a multiple of 16)
------------------------------------------------------------------------
Header, `HEADER_BYTES` = 80 bytes, then the table:

    offset size field
     0      4   magic b"WSC1"
     4      1   version (1)
     5      1   dtype code (0 bfloat16, 1 float16, 2 int16; `DTYPE_CODES`)
     6      1   k
     7      1   table_len (2^k - 1 for 1 <= k <= 7, 1 for k = 0, 0 for k = 8)
     8      8   numel
    16      4   tile: elements per tile (power of two, MIN_TILE..MAX_TILE)
    20      4   reserved (0)
    24      8   num_exceptions
    32      8   raw_off    \
    40      8   code_off    |  byte offsets of the four streams from the
    48      8   base_off    |  start of the coded tensor
    56      8   exc_off    /
    64      8   nbytes: total coded bytes (the buffer's length)
    72      8   reserved (0)
    80      table_len bytes: table[j] = symbol of code j; zero padding to 16

Streams (each starts 16-byte aligned):

raw  (numel bytes): the raw byte of every element.
code (num_tiles * tile * k / 8 bytes): per tile, `k` bits per element as
     bit planes of width 8, 4, 2 and 1 (the binary digits of k, widest
     first); plane w holds the code bits [k mod w, k mod w + w) -- i.e. the
     narrower planes hold the low bits. Plane w of a tile is tile * w / 8
     bytes; byte j of it packs the elements j + s * span (span = tile * w / 8,
     s = 0 .. 8 / w - 1) at bit offset w * s. The last tile is padded with
     code 0. So a decoder loads contiguous bytes per plane, never straddling.
base (num_tiles int64): escapes before each tile (the tile's first index
     into the exception stream), so a tile decodes on its own with a prefix
     sum over its escape mask.
exc  (num_exceptions bytes): the escaped symbols in element order.

Version 2 (two levels; `HEADER2_BYTES` = 96 bytes, then the table). The
80 bytes above with these fields changed or used, then two more:

     4      1   version (2)
     6      1   k (level-1 bits, 1..7)
     7      1   table_len = (2^k - 1) + (2^k2 - 1): the level-1 symbols, then
                the level-2 ones (level-2 code j means table[2^k - 1 + j])
    20      4   k2 (level-2 bits, 1..7)
    24      8   num_exceptions: level-2 escapes (bytes of the exc stream)
    56      8   exc_off: the level-2 exception bytes
    72      8   num_escapes: level-1 escapes (= level-2 codes)
    80      8   code2_off: byte offset of the level-2 code stream
    88      8   base2_off: byte offset of the level-2 base stream
    96      table_len bytes; zero padding to 16

Streams: raw, code and base as in version 1 (code holds the k-bit level-1
codes, base the level-1 escapes before each tile), then

code2 (ceil(num_escapes * k2 / 8) + 1 bytes, 16-byte aligned): the k2-bit
      level-2 code of every level-1 escape in escape (= element) order,
      packed densely: escape r's code is the bits [r * k2, (r + 1) * k2) of
      the stream, bit b being bit b % 8 of byte b // 8; then one zero byte,
      so a two-byte read at any code's first byte stays inside the stream.
base2 (num_tiles int64, 16-byte aligned): level-2 escapes before each tile
      (the tile's first index into the exception stream).
exc   (num_exceptions bytes): the symbols of the level-2 escapes, in
      element order.

A tile decodes on its own: the prefix sum of its level-1 escape mask plus
its base gives each escape's index r (its code2 position), the prefix sum
of its level-2 escape mask plus its base2 gives each level-2 escape's
exception byte.

Version 3 (patches; `encode(..., levels=PATCHED)`, codec "exp-kp"): the
80-byte header of version 1 with version 3 and 1 <= k <= 7 (a k without
escapes writes version 1); k is chosen pricing an escape at 3 bytes. Streams:
raw and code as in version 1, then

base  ((num_tiles + 1) int64): patches before each tile, then the total, so
      tile t's patches are entries base[t] .. base[t + 1] - 1.
pos   (num_exceptions uint16, at exc_off): each patch's element index in its
      tile, in element order.
sym   (num_exceptions bytes, at `CodedHeader.patch_sym_off` = exc_off + 2 *
      num_exceptions rounded up to 16): each patch's symbol.

A tile decodes without looking at its escapes (an escape code decodes to
whatever its table slot or window gives), then rewrites its patched elements
from its patch range: no prefix sum and no exception loads per element, so it
decodes ~1.2x faster than version 1 (1790 vs 1519 GB/s on the H200, daab061; 1.4x, 1947 vs 1401,
with the element path's chunks unrolled)
for ~0.6 more bits per weight on Student-t (11.9 vs 11.3).

`coded_bytes` (= `CodedHeader.nbytes`) and `bits_per_weight`
(= 8 * coded_bytes / numel) describe a coded tensor; `encode_block` lays
several coded tensors out in one buffer at 16-byte aligned offsets and returns
the `DecodeTable` that decodes them into a block image in one launch.

Encode (`encode`, CPU): chunks of 1 Mi elements, each split into symbol
and raw bytes with int16 shifts and narrowing casts, coded by a subtraction
and a clamp when the table is a window of consecutive symbols (as weight
exponents are; otherwise a 256-entry lookup), packed into planes with byte
shifts and ors, escapes found with numpy's flatnonzero. k and the table come
from the histogram of every 4th chunk of 256 Ki elements for tensors over 1 Mi
elements. It costs about five passes of a plain copy over the tensor on one
core (about 0.6-0.9 GB/s of raw bytes per core, measured with one intra-op
thread); intermediate memory is about 1.5x the tensor. Torch's ops here are
small and per chunk: run encoders side by side on worker threads with ONE
intra-op thread each (as offload/sources/coded.py does), not one encoder over
torch's intra-op pool, which is slower per core (its threads spin and thrash).

Decode (`decode(src, dst, table)`): a program decodes one tile of one tensor:
it finds its tensor by binary search over the table's tile prefix sums, loads
the raw bytes and code planes of its tile (contiguous), marks escapes, takes a
prefix sum (`tl.cumsum`) of the escape mask plus the tile's base to index the
exception stream (version 2: the level-2 codes, and a second prefix sum of
the level-2 escapes plus the tile's base2 for theirs; compiled in only for a
table that holds a version-2 tensor, `DecodeTable.two_level`: with it, exp-k
decoded 306 instead of 509 GB/s on the H200), looks up the table,
and stores 16-bit elements. Full tiles of tensors whose level-1 table is a window of
consecutive symbols (weights' exponents nearly always are; 2 <= k <= 4, k2 <= 3, no carry
past 255; `_word_window`) take a four-elements-per-word path instead (`DecodeTable.words`):
code bytes plus the window's first symbol in one add, escapes flagged, counted and ranked
per uint32 word, each word's exceptions (version 2: its level-2 codes, then its level-2
exceptions) read as one 4-byte window and moved to their bytes, two uint32 stores per word.
On the H200 (Flux double block, Student-t, exp-k) it decoded 777 GB/s against 505 for the
element path (43c277b). The element path decodes a tile `ELEM_CHUNK` elements at a time
(escape ranks carried from chunk to chunk): compiled in the same kernel, a whole-tile element
path held the word path at about half its own speed (registers, occupancy; the word path
alone ran 1277-1810 GB/s, perf/probe_words_only.py); chunked (512), with 4 warps, exp-k / exp-k2 /
exp-kp decode 1519 / 799 / 1790 GB/s (daab061). The chunks are a runtime loop: unrolled (1401 / 825 /
1947 GB/s, 0ddf8a2) a tile compiled TILE / ELEM_CHUNK copies of the element path and exp-k2's first
step on a fresh machine spent minutes compiling (call62). No host
sync, no allocation, fixed launch configuration, no autotune: capturable in a
CUDA graph after `table.upload(device)` and one eager call. Traffic per
element: ~1.4 bytes read (raw, codes, escapes) and 2 written.
"""
from __future__ import annotations

import dataclasses
import math
import os
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ._buffers import PackedTable, canonical_device, check_byte_buffers, device_table

__all__ = [
    "CodedHeader",
    "CodecSegment",
    "DecodeTable",
    "DTYPE_CODES",
    "DEFAULT_TILE",
    "DEFAULT_NUM_WARPS",
    "HEADER_BYTES",
    "HEADER2_BYTES",
    "LEVELS",
    "PATCHED",
    "MIN_TILE",
    "MAX_TILE",
    "encode",
    "encode_block",
    "read_header",
    "decode",
    "decode_torch",
    "decode_tensor",
    "bytes_moved",
    "symbol_entropy",
]

MAGIC = b"WSC1"
VERSION = 1  # the one-level code ("exp-k"); version 2 is the two-level one ("exp-k2", VERSION2)
VERSION2 = 2
VERSION3 = 3  # one level, the escapes a patch list of (position in tile, symbol) ("exp-kp")
VERSIONS = (VERSION, VERSION2, VERSION3)
PATCHED = 3  # encode(levels=PATCHED) writes version 3 (the form, not a count of levels)
LEVELS = (1, 2, PATCHED)  # encode(levels=...): 1 writes version 1, 2 the smaller of version 2 and version 1
HEADER_BYTES = 80
HEADER2_BYTES = 96  # version 2: the version-1 header, then code2_off and base2_off
DEFAULT_TILE = 4096  # elements per tile (and per program)
DEFAULT_NUM_WARPS = 4  # H200, Student-t Flux blocks, chunked element path (20978ee, chunk 1024): 4 warps 1196 / 719 / 1731
# GB/s decoded (exp-k / exp-k2 / exp-kp) against 1035 / 541 / 1528 at 8
ELEM_CHUNK = 512  # elements the element path decodes at a time (a tile in TILE / ELEM_CHUNK steps); at 4 warps
# 512 against 1024 decodes exp-k 1274.6 vs 1115.5, exp-k2 703.1 vs 631.9, exp-kp 1493.7 vs 1470.3 GB/s (H200,
# perf/probe_words_only.py --elem-chunk, calls 56-57): fewer live registers beside the word path. A runtime loop over
# the chunks (not unrolled: compiles 4-8x faster, exp-k2 at tile 16384 14 s instead of minutes): 1519 / 799 / 1790
# GB/s (call63) against 1401 / 825 / 1947 unrolled (call58)
# Under TRITON_INTERPRET=1 (CPU) the same kernel decodes whole tiles: the chunks only lower the GPU's live
# registers, and the interpreter's cost is per op (chunks of 1024 doubled the CPU suite's coded tests). The
# bytes are the same either way; tests set this smaller to run the chunked path on the CPU.
INTERPRET_ELEM_CHUNK = 1 << 16  # MAX_TILE
MIN_TILE, MAX_TILE = 128, 65536  # tile * k / 8 stays a multiple of 16 bytes
STREAM_ALIGN = 16
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.int16: 2}
_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_PLANES = (8, 4, 2, 1)
_CHUNK = 1 << 18  # elements per histogram chunk (the sample of every 4th one picks k: part of the format)
_CODE_CHUNK = 1 << 21  # elements coded per step: any multiple of the tile gives the same bytes. Each
# torch/numpy call holds the GIL while it parses its arguments (~40 per chunk): fewer, larger chunks
# hold it less, but every worker's scratch and temporaries grow with the chunk (~6 bytes/element).
# H200 host, flux coded setup: 1 Mi elements 17.4 s (3a79e14), 8 Mi 16.0 s (c99ccf1: not the GIL
# then); 2 Mi keeps a worker's scratch ~12 MB (tests/test_pack_rss.py counts it)
_DEVICE_CODE_CHUNK = 1 << 26  # elements per step when coding on a GPU (launch-bound, not memory-bound)
_HEADER = struct.Struct("<4sBBBBQIIQQQQQQQ")  # 80 bytes, see the module docstring
_HEADER2 = struct.Struct("<QQ")  # version 2: code2_off, base2_off (after the 80 bytes of _HEADER)
if _HEADER.size != HEADER_BYTES or _HEADER.size + _HEADER2.size != HEADER2_BYTES:  # pragma: no cover
    raise ImportError(f"codec header structs are {_HEADER.size} + {_HEADER2.size} bytes, expected "
                      f"{HEADER_BYTES} + {HEADER2_BYTES - HEADER_BYTES}")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _check_tile(tile) -> None:
    _check_int("tile", tile, MIN_TILE, MAX_TILE)
    if tile & (tile - 1):
        raise ValueError(f"tile must be a power of two in [{MIN_TILE}, {MAX_TILE}], got {tile}")


# ----------------------------------------------------------------------------
# header
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CodedHeader:
    """The parsed header of one coded tensor (offsets relative to its start).

    Version 2 (two levels, k2 >= 1): `table` holds the 2^k - 1 level-1 symbols then the
    2^k2 - 1 level-2 ones, `num_escapes` counts the level-1 escapes (= level-2 codes),
    `num_exceptions` and `exc_off` are the level-2 exception bytes; version 1 leaves
    k2, num_escapes, code2_off and base2_off at 0."""

    dtype: torch.dtype
    k: int
    table: tuple[int, ...]
    numel: int
    tile: int
    num_exceptions: int
    raw_off: int
    code_off: int
    base_off: int
    exc_off: int
    nbytes: int
    version: int = VERSION
    k2: int = 0
    num_escapes: int = 0
    code2_off: int = 0
    base2_off: int = 0

    @property
    def num_tiles(self) -> int:
        return -(-self.numel // self.tile)

    @property
    def table_off(self) -> int:
        """Byte offset of the symbol table (right after the header)."""
        return HEADER2_BYTES if self.version == VERSION2 else HEADER_BYTES

    @property
    def patch_sym_off(self) -> int:
        """Version 3: byte offset of the patch list's symbols (its positions are at exc_off)."""
        return _round_up(self.exc_off + 2 * self.num_exceptions, STREAM_ALIGN)

    @property
    def base_entries(self) -> int:
        """Entries of the base stream: one per tile, version 3 one more (the total)."""
        return self.num_tiles + (self.version == VERSION3)

    @property
    def coded_bytes(self) -> int:
        return self.nbytes

    @property
    def decoded_bytes(self) -> int:
        return 2 * self.numel

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / self.numel if self.numel else 0.0

    @property
    def ratio(self) -> float:
        """coded bytes / raw bytes."""
        return self.nbytes / self.decoded_bytes if self.numel else 0.0

    def pack(self) -> bytes:
        fixed = _HEADER.pack(
            MAGIC, self.version, DTYPE_CODES[self.dtype], self.k, len(self.table), self.numel, self.tile, self.k2,
            self.num_exceptions, self.raw_off, self.code_off, self.base_off, self.exc_off, self.nbytes,
            self.num_escapes,
        )
        if self.version == VERSION2:
            fixed += _HEADER2.pack(self.code2_off, self.base2_off)
        return fixed + bytes(self.table) + bytes(_round_up(len(self.table), STREAM_ALIGN) - len(self.table))


def _layout(dtype, k: int, table: Sequence[int], numel: int, tile: int, num_exc: int, k2: int = 0,
            num_esc: int = 0, patched: bool = False) -> CodedHeader:
    """The stream offsets of a coded tensor (version 2 when k2 >= 1: `num_exc` level-2
    exceptions of `num_esc` level-1 escapes; version 3 when `patched`: `num_exc` patches)."""
    raw_off = _round_up((HEADER2_BYTES if k2 else HEADER_BYTES) + len(table), STREAM_ALIGN)
    tiles = -(-numel // tile)
    code_off = _round_up(raw_off + numel, STREAM_ALIGN)
    base_off = code_off + tiles * tile * k // 8  # a multiple of 16 (tile >= 128)
    if patched:
        exc_off = _round_up(base_off + 8 * (tiles + 1), STREAM_ALIGN)
        nbytes = _round_up(_round_up(exc_off + 2 * num_exc, STREAM_ALIGN) + num_exc, STREAM_ALIGN)
        return CodedHeader(dtype, k, tuple(table), numel, tile, num_exc, raw_off, code_off, base_off, exc_off, nbytes,
                           VERSION3)
    if not k2:
        exc_off = base_off + 8 * tiles
        nbytes = _round_up(exc_off + num_exc, STREAM_ALIGN)
        return CodedHeader(dtype, k, tuple(table), numel, tile, num_exc, raw_off, code_off, base_off, exc_off, nbytes)
    code2_off = _round_up(base_off + 8 * tiles, STREAM_ALIGN)
    base2_off = _round_up(code2_off + _code2_bytes(num_esc, k2), STREAM_ALIGN)
    exc_off = base2_off + 8 * tiles
    nbytes = _round_up(exc_off + num_exc, STREAM_ALIGN)
    return CodedHeader(dtype, k, tuple(table), numel, tile, num_exc, raw_off, code_off, base_off, exc_off, nbytes,
                       VERSION2, k2, num_esc, code2_off, base2_off)


def _code2_bytes(num_esc: int, k2: int) -> int:
    """Bytes of the level-2 code stream: k2 bits per escape, packed, then one byte of zero
    padding (so a 16-bit read at any code's first byte stays inside the stream)."""
    return (num_esc * k2 + 7) // 8 + 1


def _as_bytes(buf, name: str = "buf") -> torch.Tensor:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError(f"{name} must be a 1-D torch.uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}")
    return buf


def read_header(buf: torch.Tensor, offset: int = 0) -> CodedHeader:
    """Parse and check the header of the coded tensor at byte `offset` of `buf`."""
    _as_bytes(buf)
    _check_int("offset", offset, 0)
    if offset + HEADER_BYTES > buf.numel():
        raise ValueError(f"buf has {buf.numel()} bytes, too few for a header at offset {offset}")
    raw = bytes(buf[offset : offset + HEADER_BYTES].cpu().numpy().tobytes())
    (magic, version, dcode, k, tlen, numel, tile, k2, num_exc, raw_off, code_off, base_off, exc_off, nbytes,
     num_esc) = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"no coded tensor at offset {offset}: magic {magic!r}, expected {MAGIC!r}")
    if version not in VERSIONS:
        raise ValueError(f"coded tensor version {version} is not supported (only {', '.join(map(str, VERSIONS))})")
    if dcode not in _DTYPES:
        raise ValueError(f"coded tensor dtype code {dcode} is not one of {sorted(_DTYPES)}")
    got = (raw_off, code_off, base_off, exc_off, nbytes)
    if version == VERSION2:
        k2, extra = _check_levels(buf, offset, k, k2, tlen)
        got += extra
    elif version == VERSION3:
        if not 1 <= k <= 7 or tlen != (1 << k) - 1 or k2 or num_esc:
            raise ValueError(f"coded tensor (version 3) has k={k}, table_len={tlen}, k2={k2}, num_escapes={num_esc}; "
                             "allowed: k in [1, 7] with 2^k - 1 entries, k2 = num_escapes = 0")
    else:
        if k > 8 or tlen != _table_len(k):
            raise ValueError(f"coded tensor has k={k} and table_len={tlen}; allowed: k in [0, 8] with 2^k - 1 "
                             "entries")
        k2 = num_esc = 0
    _check_tile(tile)
    head_len = HEADER2_BYTES if version == VERSION2 else HEADER_BYTES
    table = tuple(buf[offset + head_len : offset + head_len + tlen].tolist())
    head = _layout(_DTYPES[dcode], k, table, numel, tile, num_exc, k2, num_esc, version == VERSION3)
    want = (head.raw_off, head.code_off, head.base_off, head.exc_off, head.nbytes)
    if version == VERSION2:
        want += (head.code2_off, head.base2_off)
    if got != want:
        raise ValueError(f"coded tensor at offset {offset} has inconsistent stream offsets {got}")
    if offset + nbytes > buf.numel():
        raise ValueError(f"coded tensor at offset {offset} needs {nbytes} bytes, buf has {buf.numel() - offset}")
    return head


def _check_levels(buf: torch.Tensor, offset: int, k: int, k2: int, tlen: int) -> tuple[int, tuple[int, int]]:
    """Version 2's level fields and its (code2_off, base2_off)."""
    if not (1 <= k <= 7 and 1 <= k2 <= 7) or tlen != (1 << k) - 1 + (1 << k2) - 1:
        raise ValueError(f"coded tensor (version 2) has k={k}, k2={k2} and table_len={tlen}; allowed: k and k2 "
                         "in [1, 7] with 2^k - 1 + 2^k2 - 1 entries")
    if offset + HEADER2_BYTES > buf.numel():
        raise ValueError(f"buf has {buf.numel()} bytes, too few for a version-2 header at offset {offset}")
    extra = _HEADER2.unpack(bytes(buf[offset + HEADER_BYTES : offset + HEADER2_BYTES].cpu().numpy().tobytes()))
    return k2, extra


def _table_len(k: int) -> int:
    return 1 if k == 0 else (0 if k == 8 else (1 << k) - 1)


# ----------------------------------------------------------------------------
# encoder (CPU, chunked, vectorised)
# ----------------------------------------------------------------------------


def _split_chunk(v: torch.Tensor, bf16: bool, scratch: _Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol, raw) bytes of contiguous int16 elements `v` (narrowing casts keep the low byte).
    With `scratch`, the int16 intermediates and the symbols live in its buffers (the symbols
    are overwritten by the next call); raw is always a new tensor."""
    if scratch is None:
        scratch = _Scratch(v.numel())
    n = v.numel()
    a, b, sym = scratch.a[:n], scratch.b[:n], scratch.sym[:n]
    torch.bitwise_right_shift(v, 7 if bf16 else 8, out=a)
    sym.copy_(a)
    if not bf16:
        return sym, v.to(torch.uint8)
    torch.bitwise_and(v, -32641, out=a)  # 0x807F: sign and mantissa
    torch.bitwise_right_shift(a, 8, out=b)  # the arithmetic shift copies the sign into bit 7
    return sym, a.bitwise_or_(b).to(torch.uint8)


class _Scratch:
    """Buffers one encode reuses chunk after chunk: fresh multi-MB temporaries per chunk
    cost page faults (the allocator hands large blocks back to the OS) of the order of the
    arithmetic itself."""

    def __init__(self, n: int, device=None):
        self.a = torch.empty(n, dtype=torch.int16, device=device)
        self.b = torch.empty(n, dtype=torch.int16, device=device)
        self.sym = torch.empty(n, dtype=torch.uint8, device=device)
        self.codes = torch.empty(n, dtype=torch.uint8, device=device)


def _given_table(counts: list[int], k: int, table: tuple[int, ...]):
    if k == 0 and any(c for s, c in enumerate(counts) if s != table[0]):
        raise ValueError(f"k=0 needs every symbol to be table[0]={table[0]}")
    window = table[0] if k and all(s == (table[0] + j) & 0xFF for j, s in enumerate(table)) else None
    return k, table, window


def _choose(hist: torch.Tensor, k: int | None, table: tuple[int, ...] | None = None, esc_bytes: int = 1):
    """(k, table, window start or None) minimising the coded size for the
    symbol histogram `hist` (of the tensor or a sample of it), an escape
    costing `esc_bytes` (version 3: a 2-byte position and the symbol)."""
    counts = hist.tolist()
    if table is not None:
        return _given_table(counts, k, table)
    numel = sum(counts)
    order = sorted(range(256), key=lambda s: (-counts[s], s))
    distinct = sum(1 for c in counts if c)
    if k == 0 and distinct > 1:
        raise ValueError(f"k=0 needs a tensor with one symbol value, this one has {distinct}")
    best = None
    for kk in range(9) if k is None else [k]:
        if kk == 0 and distinct > 1:
            continue
        exc = 0 if kk in (0, 8) else numel - sum(counts[s] for s in order[: _table_len(kk)])
        if best is None or numel * kk / 8 + esc_bytes * exc < best[0]:
            best = (numel * kk / 8 + esc_bytes * exc, kk)
    kk = best[1]
    if kk in (0, 8):
        return kk, (order[0],) if kk == 0 else (), None
    n_tab = (1 << kk) - 1
    window = _best_window(counts, n_tab)
    if sum(counts[(window + j) & 0xFF] for j in range(n_tab)) == sum(counts[s] for s in order[:n_tab]):
        return kk, tuple((window + j) & 0xFF for j in range(n_tab)), window
    return kk, tuple(order[:n_tab]), None


def _cost1(counts: list[int], k: int, table: tuple[int, ...]) -> float:
    """Bytes of a one-level code beyond the raw bytes (codes and exceptions) for `counts`."""
    numel = sum(counts)
    return numel * k / 8 + (0 if k in (0, 8) else numel - sum(counts[s] for s in table))


def _choose2(hist: torch.Tensor, k: int | None, k2: int | None, tile: int):
    """(k, table, window start or None, k2) minimising the coded size for the symbol
    histogram `hist` over one-level codes (k2 = 0, as `_choose`) and two-level ones (k2 >= 1:
    the level-1 table of the 2^k - 1 most frequent symbols, then the 2^k2 - 1 next ones).
    A two-level code pays k2 bits per level-1 escape, a byte per level-2 escape and 8 bytes
    per tile (its second base stream)."""
    if k in (0, 8) or k2 == 0:
        if k2:
            raise ValueError(f"k2={k2} needs k in [1, 7] (k={k} has no escapes to code at a second level)")
        return _choose(hist, k) + (0,)
    best = None
    if k2 is None:  # the one-level code is a candidate
        one = _choose(hist, k)
        best = (_cost1(hist.tolist(), one[0], one[1]), one + (0,))
    counts = hist.tolist()
    numel = sum(counts)
    order = sorted(range(256), key=lambda s: (-counts[s], s))
    cum = [0]
    for s in order:
        cum.append(cum[-1] + counts[s])
    for k1 in range(1, 8) if k is None else [k]:
        for kk2 in range(1, 8) if not k2 else [k2]:
            n1, n2 = (1 << k1) - 1, (1 << kk2) - 1
            esc1, esc2 = numel - cum[n1], numel - cum[n1 + n2]
            cost = numel * k1 / 8 + esc1 * kk2 / 8 + esc2 + 8 * numel / tile
            if best is None or cost < best[0]:
                best = (cost, (k1, None, None, kk2))
    k1, table, window, kk2 = best[1]
    if kk2 == 0:
        return best[1]
    _, t1, window = _choose(hist, k1)
    rest = [s for s in order if s not in set(t1)]
    return k1, tuple(t1) + tuple(rest[: (1 << kk2) - 1]), window, kk2


def _best_window(counts: list[int], width: int) -> int:
    """Start of the circular window of `width` symbols holding the most elements."""
    ext = counts + counts[:width]
    run = sum(ext[:width])
    best, start = run, 0
    for s in range(1, 256):
        run += ext[s + width - 1] - ext[s - 1]
        if run > best:
            best, start = run, s
    return start


def _pack_planes(codes: torch.Tensor, k: int, tile: int) -> torch.Tensor:
    """(tiles, tile) uint8 codes -> (tiles, tile * k / 8) bytes in the plane layout."""
    tiles = codes.shape[0]
    out = torch.empty(tiles, tile * k // 8, dtype=torch.uint8, device=codes.device)
    at = 0
    for w in _PLANES:
        if not k & w:
            continue
        per, span = 8 // w, tile * w // 8
        low = k & (w - 1)  # code bits below this plane
        bits = codes >> low if low else codes
        if low + w < k:  # higher planes exist: keep this plane's bits only
            bits = bits & ((1 << w) - 1)
        bits = bits.view(tiles, per, span)
        acc = out[:, at : at + span]
        acc.copy_(bits[:, 0])
        for s in range(1, per):
            acc.bitwise_or_(bits[:, s] << (w * s))
        at += span
    return out


def _check_table(k, table) -> tuple[int, ...] | None:
    if table is None:
        return None
    if k is None or k == 8:
        raise ValueError(f"table needs k in [0, 7] to be given with it, got k={k}")
    table = tuple(table)
    if len(table) != _table_len(k) or len(set(table)) != len(table):
        raise ValueError(f"table must hold {_table_len(k)} distinct symbols for k={k}, got {table}")
    for s in table:
        _check_int("table symbol", s, 0, 255)
    return table


@dataclass
class _Coder:
    """One tensor's code parameters and the coded pieces collected chunk by chunk."""

    k: int
    table: tuple[int, ...]
    window: int | None
    tile: int
    bf16: bool
    raw: list
    codes: list
    exc: list
    bases: list  # per chunk: (level-1) escapes before each of its tiles (int64, whole tensor)
    scratch: _Scratch
    num_exc: int = 0  # exceptions so far (version 2: level-2 ones)
    torch_index: bool = False  # escapes found with torch (any device) instead of numpy (CPU)
    k2: int = 0  # version 2: bits per level-2 code (0: one level)
    codes2: list = dataclasses.field(default_factory=list)  # per chunk: the level-2 code of each escape
    bases2: list = dataclasses.field(default_factory=list)  # per chunk: level-2 escapes before each tile
    num_esc: int = 0  # level-1 escapes so far
    lut2: torch.Tensor | None = None  # version 2: symbol -> level-2 code (`lut(2)`)
    patched: bool = False  # version 3: the escapes' positions in their tiles are kept too
    pos: list = dataclasses.field(default_factory=list)  # version 3, per chunk: int16 positions in the tile

    def lut(self, level: int = 1) -> torch.Tensor:
        """symbol -> code of `level` (the level's escape code for symbols not in its table)."""
        k, n1 = (self.k, 0) if level == 1 else (self.k2, (1 << self.k) - 1)
        part = self.table[n1 : n1 + (1 << k) - 1]
        lut = torch.full((256,), (1 << k) - 1, dtype=torch.uint8)
        lut[list(part)] = torch.arange(len(part), dtype=torch.uint8)
        return lut.to(self.scratch.sym.device)

    def add(self, v: torch.Tensor, lut: torch.Tensor | None) -> None:
        """Code one chunk of int16 elements (a whole number of tiles, except the last chunk)."""
        sym, raw = _split_chunk(v, self.bf16, self.scratch)
        self.raw.append(raw)
        k, tile = self.k, self.tile
        if k == 0:
            if not bool((sym == self.table[0]).all()):
                raise ValueError(f"k=0 needs every symbol to be table[0]={self.table[0]}")
            return
        tiles = -(-sym.numel() // tile)
        if sym.numel() < tiles * tile:  # pad the last tile with symbols of code 0
            pad = self.table[0] if self.table else 0
            sym = torch.cat([sym, torch.full((tiles * tile - sym.numel(),), pad, dtype=torch.uint8,
                                             device=sym.device)])
        if k == 8:
            codes = sym
        elif self.window is not None:  # the table is a contiguous (mod 256) window of symbols
            codes = torch.sub(sym, self.window, out=self.scratch.codes[: sym.numel()]).clamp_(max=(1 << k) - 1)
        else:
            codes = lut[sym.long()]
        codes = codes.view(tiles, tile)
        self.codes.append(_pack_planes(codes, k, tile))
        if k < 8 and self.torch_index:  # the same indices with torch ops, where the chunk lives
            idx = torch.nonzero(codes.reshape(-1) == (1 << k) - 1).flatten()
            starts = torch.arange(tiles, dtype=torch.int64, device=idx.device) * tile
            self.bases.append(torch.searchsorted(idx, starts) + self.num_esc)
            self.num_esc += idx.numel()
            if self.patched:
                self.pos.append((idx % tile).to(torch.int16))
            self._escaped(idx, sym[idx], starts)
        elif k < 8:
            # numpy's compare and flatnonzero: ~5x faster than torch's uint8 == scalar, ~10x than nonzero
            idx = np.flatnonzero(codes.reshape(-1).numpy() == (1 << k) - 1)
            starts = np.arange(tiles) * tile
            self.bases.append(torch.from_numpy(np.searchsorted(idx, starts) + self.num_esc))
            self.num_esc += idx.size
            if self.patched:
                self.pos.append(torch.from_numpy((idx % tile).astype(np.int16)))  # wraps past 32767: uint16 bits
            self._escaped(idx, sym.numpy()[idx], starts)

    def _escaped(self, idx, esc, starts) -> None:
        """One chunk's escapes (element indices `idx`, symbols `esc`; tile starts `starts`; all
        torch tensors or all numpy arrays, the same bytes either way): version 1 keeps the
        symbols as exceptions; version 2 codes them at level 2 and keeps its escapes' symbols
        and per-tile bases."""
        if self.k2 == 0:
            self._exceptions(esc if isinstance(esc, torch.Tensor) else torch.from_numpy(esc))
            return
        if isinstance(esc, torch.Tensor):
            code2 = self.lut2[esc.long()]
            hit = code2 == (1 << self.k2) - 1
            self.bases2.append(torch.searchsorted(idx[hit], starts) + self.num_exc)
        else:
            code2 = self.lut2.numpy()[esc]
            hit = code2 == (1 << self.k2) - 1
            self.bases2.append(torch.from_numpy(np.searchsorted(idx[hit], starts) + self.num_exc))
            code2, esc, hit = torch.from_numpy(code2), torch.from_numpy(esc), torch.from_numpy(hit)
        self.codes2.append(code2)
        self._exceptions(esc[hit])

    def _exceptions(self, symbols: torch.Tensor) -> None:
        self.exc.append(symbols)
        self.num_exc += symbols.numel()


def _histogram(elems: torch.Tensor, bf16: bool, step: int, sample: int, scratch: _Scratch) -> torch.Tensor:
    """Symbol counts over every `sample`-th chunk of `step` elements."""
    hist = torch.zeros(256, dtype=torch.int64, device=elems.device)
    for a in range(0, elems.numel(), step * sample):
        sym, _ = _split_chunk(elems[a : a + step], bf16, scratch)
        hist += torch.bincount(sym, minlength=256)
    return hist.cpu()


def encode(
    tensor: torch.Tensor, *, k: int | None = None, tile: int = DEFAULT_TILE, table: Sequence[int] | None = None,
    out: torch.Tensor | None = None, levels: int = 1, k2: int | None = None, _torch_index: bool | None = None,
) -> torch.Tensor:
    """Code a bfloat16 / float16 / int16 tensor into a new flat uint8 CPU buffer
    (or, with `out`, at the start of `out` when it fits: the result is then a view of it).

    levels: 1 (the one-level code, version 1, codec "exp-k") or 2 (codec "exp-k2": the
    level-1 escapes are coded again with k2 bits, version 2, whenever that is smaller than
    every one-level code; otherwise the result is the version-1 bytes of levels=1) or
    PATCHED (3, codec "exp-kp": one level, the escapes a per-tile patch list of positions
    and symbols, version 3, k chosen with 3 bytes per escape; a k without escapes, 0 or 8,
    writes version 1).
    k2 (levels=2 only): None picks it with k; 0 forces one level (version 1); 1..7 forces
    a two-level code (needs k in [1, 7] or None). table needs k2=0 with levels=2.

    k: bits per symbol code (0..8, see the module doc); None picks the k that
    gives the smallest buffer (from the symbol histogram of the tensor, or of
    every 4th chunk of 256 Ki elements for tensors over 1 Mi elements).
    tile: elements per tile (a power of two in [MIN_TILE, MAX_TILE]); every
    tensor decoded in one launch needs the same. table: the symbol table to
    use (needs k in [0, 7]; 2^k - 1 distinct symbols, one for k = 0), default
    the most frequent symbols. A CUDA tensor is coded on its device (the
    same integer ops: the same bytes; the result is a CUDA buffer unless
    `out` is given); other non-CPU or non-contiguous tensors are copied to a
    contiguous CPU tensor first. Read the header of the result with
    `read_header`. out: a 1-D contiguous uint8 CPU tensor not overlapping
    `tensor`; a coded tensor longer than it goes to a new buffer instead (the
    caller tells by `result.data_ptr() == out.data_ptr()`); its bytes are the
    same either way.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPE_CODES:
        raise TypeError(f"tensor dtype must be one of {list(DTYPE_CODES)}, got {tensor.dtype}")
    if k is not None:
        _check_int("k", k, 0, 8)
    _check_tile(tile)
    _check_levels_args(levels, k2, table)
    table = _check_table(k, table)
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1
                            or out.device.type != "cpu" or not out.is_contiguous()):
        raise TypeError(f"out must be a 1-D contiguous uint8 CPU tensor or None, got "
                        f"{out.dtype if isinstance(out, torch.Tensor) else type(out).__name__}")
    dev = tensor.device if tensor.device.type == "cuda" else torch.device("cpu")
    elems = tensor.detach().to(dev).contiguous().reshape(-1).view(torch.int16)
    bf16, step = tensor.dtype == torch.bfloat16, _round_up(_CHUNK, tile)
    # on a GPU, fewer launches per byte: chunks as large as the whole tensor up to 64 Mi elements
    code_step = _round_up(max(_CODE_CHUNK if dev.type == "cpu" else _DEVICE_CODE_CHUNK, tile), tile)
    scratch = _Scratch(min(max(code_step, step), _round_up(elems.numel(), tile)), dev)  # >= any chunk
    sample = 4 if elems.numel() > 4 * step and table is None else 1

    def choose(sample: int, table):
        hist = _histogram(elems, bf16, step, sample, scratch)
        if levels == PATCHED:
            return _choose(hist, k, table, esc_bytes=3) + (0,)
        return _choose(hist, k, table) + (0,) if levels == 1 or table is not None else _choose2(hist, k, k2, tile)

    kk, table, window, kk2 = choose(sample, table)
    if kk == 0 and sample > 1:  # one symbol in the sample: make sure of the whole tensor
        kk, table, window, kk2 = choose(1, None)
    coder = _Coder(kk, table, window, tile, bf16, [], [], [], [], scratch,
                   torch_index=dev.type != "cpu" if _torch_index is None else bool(_torch_index), k2=kk2,
                   patched=levels == PATCHED and 0 < kk < 8)
    if kk2:
        coder.lut2 = coder.lut(2)
    lut = coder.lut() if 0 < kk < 8 and window is None else None
    for a in range(0, elems.numel(), code_step):
        coder.add(elems[a : a + code_step], lut)
    return _assemble(coder, tensor.dtype, elems.numel(), out)


def _check_levels_args(levels, k2, table) -> None:
    _check_int("levels", levels, min(LEVELS), max(LEVELS))
    if k2 is not None:
        _check_int("k2", k2, 0, 7)
        if levels != 2:
            raise ValueError(f"k2={k2} needs levels=2 (got levels={levels})")
    if table is not None and levels == 2 and k2 != 0:
        raise ValueError(f"table with levels=2 needs k2=0 (a one-level code), got k2={k2}")


def _pack_bits(vals: torch.Tensor, width: int, nbytes: int) -> torch.Tensor:
    """uint8 values of `width` (<= 7) bits packed densely, value r at bits [r * width, (r + 1) * width)
    (bit b of the stream = bit b % 8 of byte b // 8), zero-padded to `nbytes` bytes. Eight values
    fill `width` bytes exactly: each group of eight is joined in an int64 and its low `width`
    bytes are kept (little-endian, as every target of this package is)."""
    groups = -(-vals.numel() // 8)
    v = torch.zeros(groups * 8, dtype=torch.uint8, device=vals.device)
    v[: vals.numel()] = vals
    v = v.view(groups, 8)
    acc = torch.empty(groups, dtype=torch.int64, device=vals.device).copy_(v[:, 0])  # stride 1 (a view below)
    for j in range(1, 8):
        acc.bitwise_or_(v[:, j].to(torch.int64).bitwise_left_shift_(j * width))
    packed = acc.view(torch.uint8).view(groups, 8)[:, :width].reshape(-1)  # zeros past the last value
    out = torch.zeros(nbytes, dtype=torch.uint8, device=vals.device)
    n = min(nbytes, packed.numel())
    out[:n] = packed[:n]
    return out


def _put_level2(out: torch.Tensor, c: _Coder, head: CodedHeader) -> None:
    """Version 2's streams after the level-1 bases: level-2 codes, level-2 bases (and the
    zero padding between them)."""
    dev = out.device
    out[head.base_off + 8 * head.num_tiles : head.code2_off].zero_()
    n2 = _code2_bytes(c.num_esc, c.k2)
    codes2 = torch.cat(c.codes2) if c.codes2 else torch.zeros(0, dtype=torch.uint8, device=dev)
    out[head.code2_off : head.code2_off + n2] = _pack_bits(codes2.to(dev), c.k2, n2)
    out[head.code2_off + n2 : head.base2_off].zero_()
    bases2 = torch.cat(c.bases2) if c.bases2 else torch.zeros(head.num_tiles, dtype=torch.int64, device=dev)
    out[head.base2_off : head.exc_off] = bases2.to(dev).view(torch.uint8)


def _put_patches(out: torch.Tensor, c: _Coder, head: CodedHeader) -> None:
    """Version 3's streams after the per-tile bases: the total (the last base entry), the
    patch positions (uint16), the patch symbols, zero padding between and after."""
    dev, n = out.device, head.num_exceptions
    total = torch.tensor([n], dtype=torch.int64, device=dev)
    end = head.base_off + 8 * head.num_tiles
    out[end : end + 8] = total.view(torch.uint8)
    out[end + 8 : head.exc_off].zero_()
    if n:
        out[head.exc_off : head.exc_off + 2 * n] = torch.cat([p.to(dev) for p in c.pos]).view(torch.uint8)
    out[head.exc_off + 2 * n : head.patch_sym_off].zero_()
    if n:
        torch.cat(c.exc, out=out[head.patch_sym_off : head.patch_sym_off + n])
    out[head.patch_sym_off + n :].zero_()


def _assemble(c: _Coder, dtype: torch.dtype, n: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """Lay a coded tensor out in one buffer (see the module docstring): the start of `into`
    when it fits, else a new one (on the device the pieces were coded on; coded on a GPU
    into a CPU `into`, the buffer is laid out there and copied into it)."""
    num_exc = sum(e.numel() for e in c.exc)
    head = _layout(dtype, c.k, c.table, n, c.tile, num_exc, c.k2, c.num_esc, c.patched)
    dev = c.scratch.sym.device
    fits = into is not None and into.numel() >= head.nbytes
    if fits and into.device == dev:
        out = into[: head.nbytes]
    else:
        out = torch.empty(head.nbytes, dtype=torch.uint8, device=dev)
    hdr = head.pack()
    out[: len(hdr)] = torch.frombuffer(bytearray(hdr), dtype=torch.uint8).to(dev)
    out[len(hdr) : head.raw_off].zero_()
    if c.raw:
        torch.cat(c.raw, out=out[head.raw_off : head.raw_off + n])
    out[head.raw_off + n : head.code_off].zero_()
    codes = out[head.code_off : head.base_off]
    if c.codes:
        torch.cat([x.reshape(-1) for x in c.codes], out=codes)
    bases = torch.cat(c.bases) if c.bases else torch.zeros(head.num_tiles, dtype=torch.int64, device=dev)
    out[head.base_off : head.base_off + 8 * head.num_tiles] = bases.view(torch.uint8)
    if head.version == VERSION2:
        _put_level2(out, c, head)
    if head.version == VERSION3:
        _put_patches(out, c, head)
    else:
        if num_exc:
            torch.cat(c.exc, out=out[head.exc_off : head.exc_off + num_exc])
        out[head.exc_off + num_exc :].zero_()
    if fits and into.device != dev:
        return into[: head.nbytes].copy_(out)  # D2H of the coded bytes
    return out


# ----------------------------------------------------------------------------
# decode table
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CodecSegment:
    """One coded tensor at byte `src_offset` of the coded buffer, decoded to
    `[dst_offset, dst_offset + 2 * header.numel)` of the destination."""

    src_offset: int
    dst_offset: int
    header: CodedHeader

    def __post_init__(self) -> None:
        _check_int("src_offset", self.src_offset, 0)
        _check_int("dst_offset", self.dst_offset, 0)
        if not isinstance(self.header, CodedHeader):
            raise TypeError(f"header must be a CodedHeader, got {type(self.header).__name__}")
        if self.src_offset % STREAM_ALIGN:
            raise ValueError(f"src_offset must be a multiple of {STREAM_ALIGN}, got {self.src_offset}")
        if self.dst_offset % 2:
            raise ValueError(f"dst_offset must be even (16-bit elements), got {self.dst_offset}")

    @property
    def src_end(self) -> int:
        return self.src_offset + self.header.nbytes

    @property
    def dst_end(self) -> int:
        return self.dst_offset + self.header.decoded_bytes


def _word_window(h: CodedHeader) -> int:
    """The level-1 table's first symbol when the kernel may decode the tensor four elements per
    word: 2 <= k <= 4, the level-1 table is the window [w, w + 2^k - 1) with w + 2^k - 1 <= 255
    (so adding w to every code byte, the escape code included, never carries) and, for two
    levels, k2 <= 3 (a level-2 table of at most 7 symbols, held in registers); -1 otherwise."""
    n = (1 << h.k) - 1
    if not 2 <= h.k <= 4 or h.k2 > 3 or len(h.table) < n:
        return -1
    w = h.table[0]
    if w + n > 255 or any(s != w + j for j, s in enumerate(h.table[:n])):
        return -1
    return w


def _pack_records(segs: Sequence[CodecSegment], tile: int) -> tuple[torch.Tensor, int]:
    starts, records = [0], []
    for s in segs:
        h, o = s.header, s.src_offset
        starts.append(starts[-1] + -(-h.numel // tile))
        split = 0 if h.dtype == torch.bfloat16 else 1
        records += [o + h.raw_off, o + h.code_off, o + h.base_off, o + h.exc_off, o + h.table_off]
        records += [s.dst_offset // 2, h.numel, h.k, split]
        records += [h.k2, o + h.code2_off if h.k2 else 0, o + h.base2_off if h.k2 else 0]  # version 2
        records += [_word_window(h)]
        records += [o + h.patch_sym_off if h.version == VERSION3 else -1]  # version 3: patch symbols
    return torch.tensor(starts + records, dtype=torch.int64), starts[-1]


class DecodeTable(PackedTable):
    """Validated, packed segments of one decode launch, with cached device copies.

    All non-empty segments must share one tile size; destination ranges must
    not overlap. num_warps and gather_planes (each element loads its own code
    plane bytes instead of a load-once-and-reshape) are launch options that do
    not change the result. level2 / patch / ranked: compile the kernel's level-2
    code / patch loop / ranked exceptions even if no segment needs them
    (`two_level` / `patched` / `ranked` hold what is compiled): a table re-encoded
    in place under a captured CUDA graph may gain such tensors, and the captured
    kernel must decode them.
    Packed (int64): [tile_start_0 = 0, ..., tile_start_S =
    num_tiles, then per segment (raw, code, base, exc, table) absolute source
    byte offsets, destination element offset, numel, k, split, then k2 and the
    (code2, base2) absolute source byte offsets (version 2; 0, 0, 0 for version 1),
    the word window (-1: none), the patch symbols' absolute offset (version 3; -1)].
    """

    def __init__(
        self, segments: Sequence[CodecSegment], *, num_warps: int = DEFAULT_NUM_WARPS, gather_planes: bool = True,
        words: bool = True, level2: bool = False, patch: bool = False, ranked: bool = False,
    ) -> None:
        self.segments: tuple[CodecSegment, ...] = tuple(segments)
        for i, seg in enumerate(self.segments):
            if not isinstance(seg, CodecSegment):
                raise TypeError(f"segments[{i}] must be a CodecSegment, got {type(seg).__name__}")
        _check_int("num_warps", num_warps, 1, 32)
        if num_warps & (num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {num_warps}")
        self.num_warps = num_warps
        if not isinstance(gather_planes, bool):
            raise TypeError(f"gather_planes must be a bool, got {gather_planes!r}")
        self.gather_planes = gather_planes
        for name, v in (("words", words), ("level2", level2), ("patch", patch), ("ranked", ranked)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {v!r}")
        live = sorted((s for s in self.segments if s.header.numel), key=lambda s: s.dst_offset)
        tiles = {s.header.tile for s in live}
        if len(tiles) > 1:
            raise ValueError(f"segments: all coded tensors of one launch need one tile size, got {sorted(tiles)}")
        self.tile = tiles.pop() if tiles else DEFAULT_TILE
        for a, b in zip(live, live[1:]):
            if a.dst_end > b.dst_offset:
                raise ValueError(
                    f"segments: destination ranges overlap: [{a.dst_offset}, {a.dst_end}) and "
                    f"[{b.dst_offset}, {b.dst_end})"
                )
        self._live = tuple(live)
        # the kernel's level-2 code is compiled only for a table holding a version-2 tensor (or
        # level2=True), its patch loop only for one holding a version-3 tensor (or patch=True)
        self.two_level = level2 or any(s.header.k2 for s in live)
        self.patched = patch or any(s.header.version == VERSION3 for s in live)
        # ... and the ranked exceptions (versions 1 and 2 with escapes) only for one holding such a tensor
        # (or ranked=True): without them, tables of version-3 and escape-free tensors run a leaner kernel
        self.ranked = ranked or self.two_level or any(s.header.version != VERSION3 and 0 < s.header.k < 8
                                                      for s in live)
        self._paths = {"level2": level2, "patch": patch, "ranked": ranked}
        self.src_nbytes = max((s.src_end for s in live), default=0)
        self.dst_nbytes = max((s.dst_end for s in live), default=0)
        self.coded_nbytes = sum(s.header.nbytes for s in live)
        self.decoded_nbytes = sum(s.header.decoded_bytes for s in live)
        self.dst_align = math.gcd(16, *(s.dst_offset for s in live)) // 2 if live else 8  # in elements
        self._host, self.num_tiles = _pack_records(live, self.tile)
        self.search_steps = max(1, math.ceil(math.log2(max(1, len(live)))))
        # the four-elements-per-word path (window tables, full tiles) stores uint32 words: even element offsets
        self.words = words and self.dst_align >= 2 and any(_word_window(s.header) >= 0 for s in live)
        self._words_option = words
        self._device: dict[torch.device, torch.Tensor] = {}

    def options(self) -> dict:
        """The launch options (they never change the decoded bytes), to build a table alike."""
        return {"num_warps": self.num_warps, "gather_planes": self.gather_planes, "words": self._words_option,
                **self._paths}

    @classmethod
    def from_buffer(cls, buf: torch.Tensor, src_offsets: Sequence[int], dst_offsets: Sequence[int],
                    **kwargs) -> "DecodeTable":
        """Parse the coded tensors at `src_offsets` of `buf` (host bytes) into a table."""
        if len(src_offsets) != len(dst_offsets):
            raise ValueError(f"src_offsets and dst_offsets differ in length: {len(src_offsets)} != {len(dst_offsets)}")
        segs = [CodecSegment(s, d, read_header(buf, s)) for s, d in zip(src_offsets, dst_offsets)]
        return cls(segs, **kwargs)

    @property
    def num_segments(self) -> int:
        return len(self._live)

    @property
    def bits_per_weight(self) -> float:
        n = self.decoded_nbytes // 2
        return 8.0 * self.coded_nbytes / n if n else 0.0

    def __repr__(self) -> str:
        return (
            f"DecodeTable({self.num_segments} tensors, {self.coded_nbytes} coded -> {self.decoded_nbytes} bytes, "
            f"{self.bits_per_weight:.3f} bits/weight, {self.num_tiles} tiles of {self.tile})"
        )


_canonical_device = canonical_device


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
        dst[: table.dst_nbytes].view(torch.int16),
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
    """Reference decode of one coded tensor (`buf` starts at its header) -> int16 elements."""
    n = head.numel
    raw = buf[head.raw_off : head.raw_off + n].to(torch.int32)
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


# ----------------------------------------------------------------------------
# blocks and statistics
# ----------------------------------------------------------------------------


def encode_block(
    tensors: Sequence[torch.Tensor],
    dst_offsets: Sequence[int] | None = None,
    *,
    k: int | None = None,
    tile: int = DEFAULT_TILE,
    align: int = 512,
    num_warps: int = DEFAULT_NUM_WARPS,
    gather_planes: bool = True,
    words: bool = True,
    levels: int = 1,
    k2: int | None = None,
) -> tuple[torch.Tensor, DecodeTable]:
    """Code `tensors` into one flat uint8 CPU buffer (each at a 16-byte aligned
    offset) and return it with the `DecodeTable` that decodes them into a block
    image: tensor i at `dst_offsets[i]` (default: back to back, each at an
    `align`-byte aligned offset, like the host store's block images). k, tile,
    levels, k2: as `encode`'s, for every tensor."""
    _check_int("align", align, 2)
    if align % 2:
        raise ValueError(f"align must be even, got {align}")
    if dst_offsets is None:
        dst_offsets, at = [], 0
        for t in tensors:
            at = _round_up(at, align)
            dst_offsets.append(at)
            at += 2 * t.numel()
    if len(dst_offsets) != len(tensors):
        raise ValueError(f"dst_offsets has {len(dst_offsets)} entries for {len(tensors)} tensors")
    blobs = [encode(t, k=k, tile=tile, levels=levels, k2=k2) for t in tensors]
    src_offsets, at = [], 0
    for b in blobs:
        src_offsets.append(at)
        at += b.numel()  # a multiple of 16
    buf = torch.cat(blobs) if blobs else torch.zeros(0, dtype=torch.uint8)
    segs = [CodecSegment(s, d, read_header(b)) for s, d, b in zip(src_offsets, dst_offsets, blobs)]
    return buf, DecodeTable(segs, num_warps=num_warps, gather_planes=gather_planes, words=words)


def symbol_entropy(tensor: torch.Tensor) -> float:
    """Shannon entropy (bits) of the coded symbol (bf16: exponent; else high byte)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_CODES:
        raise TypeError(f"tensor must be a torch.Tensor of dtype in {list(DTYPE_CODES)}")
    elems = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.int16)
    hist = torch.zeros(256, dtype=torch.float64)
    scratch = _Scratch(min(_CHUNK, elems.numel()))
    for a in range(0, elems.numel(), _CHUNK):
        sym, _ = _split_chunk(elems[a : a + _CHUNK], tensor.dtype == torch.bfloat16, scratch)
        hist += torch.bincount(sym, minlength=256)
    p = hist[hist > 0] / hist.sum().clamp(min=1)
    return float(-(p * p.log2()).sum())
