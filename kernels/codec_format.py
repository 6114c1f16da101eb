"""The coded tensor format of the lossless weight codec (16-bit and float8): header, stream layout, decode table.

`kernels/codec_encode.py` writes this format (on the CPU, or on a GPU with the same bytes),
`kernels/codec.py` decodes it (one Triton launch per `DecodeTable`, and its plain-torch
reference). The format is persisted in coded sidecars: every byte below is part of it.

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

- float8_e4m3fn / float8_e5m2 (8-bit elements): symbol = the whole byte, no raw
  byte (the raw stream is empty: raw_off = code_off). Everything else (the k-bit
  table code, escapes, two levels, patches, tiles) is as for 16-bit elements,
  and a coded element costs k bits plus 8 per escape. Coding the byte beats
  splitting it into a coded sign/exponent and raw mantissa bits on fp8-cast
  weights (measured on the CPU, 4 Mi elements, `encode` / `levels=2`, 2026-12-03):
  Gaussian std 0.02 e4m3fn 0.750 / 0.700 of the bytes (byte entropy 0.665;
  exponent coded, sign and mantissa raw: 0.753), e5m2 0.763 / 0.732 (0.685);
  Student-t df=4 std 0.02 e4m3fn 0.754 / 0.754, e5m2 0.773 / 0.769; Gaussian
  std 1.0 e4m3fn 0.884 / 0.867 (its exponents fill the range). int8 / uint8
  (GGUF, torchao int8) are not a coded dtype: they stay raw.

So a coded 16-bit element costs 8 + k bits plus 8 bits per escape. On bf16 weights
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
     5      1   dtype code (0 bfloat16, 1 float16, 2 int16, 3 float8_e4m3fn,
                4 float8_e5m2; `DTYPE_CODES`)
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

raw  (numel bytes; 0 for 8-bit elements): the raw byte of every element.
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
the `DecodeTable` that decodes them into a block image in one launch
(`kernels/codec_encode.py`).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from ._buffers import PackedTable

__all__ = [
    "CodedHeader",
    "CodecSegment",
    "DecodeTable",
    "BYTE_DTYPES",
    "DTYPE_CODES",
    "DEFAULT_TILE",
    "DEFAULT_NUM_WARPS",
    "HEADER_BYTES",
    "HEADER2_BYTES",
    "LEVELS",
    "PATCHED",
    "MIN_TILE",
    "MAX_TILE",
    "read_header",
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
MIN_TILE, MAX_TILE = 128, 65536  # tile * k / 8 stays a multiple of 16 bytes
STREAM_ALIGN = 16
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.int16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
BYTE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # 8-bit elements: the byte is the symbol, no raw stream
_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_PLANES = (8, 4, 2, 1)
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


def split_of(dtype: torch.dtype) -> int:
    """How an element of ``dtype`` splits (the decoder's and the GPU encoder's record field): 0
    bfloat16 (symbol the exponent), 1 other 16-bit (symbol the high byte), 2 8-bit (symbol the byte)."""
    return 0 if dtype == torch.bfloat16 else (2 if dtype in BYTE_DTYPES else 1)


def elem_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a coded dtype (1 for float8, else 2)."""
    return 1 if dtype in BYTE_DTYPES else 2


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
    def raw_bytes(self) -> int:
        """Bytes of the raw stream: one per element, none for 8-bit elements."""
        return 0 if self.dtype in BYTE_DTYPES else self.numel

    @property
    def coded_bytes(self) -> int:
        return self.nbytes

    @property
    def decoded_bytes(self) -> int:
        return elem_bytes(self.dtype) * self.numel

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
    code_off = _round_up(raw_off + (0 if dtype in BYTE_DTYPES else numel), STREAM_ALIGN)
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
# decode table
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CodecSegment:
    """One coded tensor at byte `src_offset` of the coded buffer, decoded to
    `[dst_offset, dst_offset + header.decoded_bytes)` of the destination (`dst_offset` even,
    8-bit elements too)."""

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
            raise ValueError(f"dst_offset must be even (16-bit elements; 8-bit ones too), got {self.dst_offset}")

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
    if h.dtype in BYTE_DTYPES:  # the word path joins raw and symbol bytes into 16-bit elements
        return -1
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
        split = split_of(h.dtype)
        records += [o + h.raw_off, o + h.code_off, o + h.base_off, o + h.exc_off, o + h.table_off]
        # the destination in elements (8-bit: bytes; a multiple of the table's dst_align either way)
        records += [s.dst_offset // elem_bytes(h.dtype), h.numel, h.k, split]
        records += [h.k2, o + h.code2_off if h.k2 else 0, o + h.base2_off if h.k2 else 0]  # version 2
        records += [_word_window(h)]
        records += [o + h.patch_sym_off if h.version == VERSION3 else -1]  # version 3: patch symbols
    return torch.tensor(starts + records, dtype=torch.int64), starts[-1]


class DecodeTable(PackedTable):
    """Validated, packed segments of one decode launch, with cached device copies.

    All non-empty segments must share one tile size; destination ranges must
    not overlap. num_warps and gather_planes (each element loads its own code
    plane bytes instead of a load-once-and-reshape) are launch options that do
    not change the result. level2 / patch / ranked / bytes8: compile the kernel's
    level-2 code / patch loop / ranked exceptions / 8-bit stores even if no segment
    needs them (`two_level` / `patched` / `ranked` / `bytes8` hold what is compiled):
    a table re-encoded in place under a captured CUDA graph may gain such tensors
    (a float8 tensor stored raw, as int16, may code after an update), and the
    captured kernel must decode them.
    Packed (int64): [tile_start_0 = 0, ..., tile_start_S =
    num_tiles, then per segment (raw, code, base, exc, table) absolute source
    byte offsets, destination element offset, numel, k, split, then k2 and the
    (code2, base2) absolute source byte offsets (version 2; 0, 0, 0 for version 1); split is
    `split_of(dtype)` (2: 8-bit elements, whose destination offset is in bytes),
    the word window (-1: none), the patch symbols' absolute offset (version 3; -1)].
    """

    def __init__(
        self, segments: Sequence[CodecSegment], *, num_warps: int = DEFAULT_NUM_WARPS, gather_planes: bool = True,
        words: bool = True, level2: bool = False, patch: bool = False, ranked: bool = False, bytes8: bool = False,
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
        for name, v in (("words", words), ("level2", level2), ("patch", patch), ("ranked", ranked),
                        ("bytes8", bytes8)):
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
        self._paths = {"level2": level2, "patch": patch, "ranked": ranked, "bytes8": bytes8}
        self.src_nbytes = max((s.src_end for s in live), default=0)
        self.dst_nbytes = max((s.dst_end for s in live), default=0)
        self.coded_nbytes = sum(s.header.nbytes for s in live)
        self.decoded_nbytes = sum(s.header.decoded_bytes for s in live)
        self.numel = sum(s.header.numel for s in live)
        # the kernel's 8-bit stores are compiled only for a table holding a float8 tensor (or bytes8=True)
        self.bytes8 = bytes8 or any(s.header.dtype in BYTE_DTYPES for s in live)
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
        n = self.numel
        return 8.0 * self.coded_nbytes / n if n else 0.0

    def __repr__(self) -> str:
        return (
            f"DecodeTable({self.num_segments} tensors, {self.coded_nbytes} coded -> {self.decoded_nbytes} bytes, "
            f"{self.bits_per_weight:.3f} bits/weight, {self.num_tiles} tiles of {self.tile})"
        )

