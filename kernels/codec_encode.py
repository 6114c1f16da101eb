"""CPU encoder of the lossless weight codec, 16-bit and float8 (format: `kernels/codec_format.py`).

`encode` codes one tensor, `encode_block` several into one buffer with the `DecodeTable`
that decodes them in one launch (`kernels/codec.py`), `symbol_entropy` is the bound the
code is measured against. The bytes are persisted in coded sidecars: any change here that
moves a byte is a format change (tests/kernels/test_codec_encode.py holds golden digests).

Encode (`encode`, CPU): chunks of 2 Mi elements, each split into symbol
and raw bytes with int16 shifts and narrowing casts, coded by a subtraction
and a clamp when the table is a window of consecutive symbols (as weight
exponents are; otherwise a 256-entry lookup), packed into planes with byte
shifts and ors, escapes found with numpy's flatnonzero. k and the table come
from the histogram of every 4th chunk of 256 Ki elements for tensors over 1 Mi
elements. It costs about five passes of a plain copy over the tensor on one
core (about 0.6-0.9 GB/s of raw bytes per core, measured with one intra-op
thread); intermediate memory is about 1.5x the tensor. Torch's ops here are
small and per chunk: run encoders side by side on worker threads with ONE
intra-op thread each (as offload/host/encode.py does), not one encoder over
torch's intra-op pool, which is slower per core (its threads spin and thrash).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .codec_choose import choose as choose_code
from .codec_format import (
    _PLANES,
    DEFAULT_NUM_WARPS,
    DEFAULT_TILE,
    DTYPE_CODES,
    LEVELS,
    PATCHED,
    VERSION2,
    VERSION3,
    CodecSegment,
    CodedHeader,
    DecodeTable,
    _check_int,
    _check_tile,
    _code2_bytes,
    _layout,
    _round_up,
    _table_len,
    read_header,
    split_of,
)

__all__ = ["encode", "encode_block", "symbol_entropy"]

_CHUNK = 1 << 18  # elements per histogram chunk (the sample of every 4th one picks k: part of the format)
_CODE_CHUNK = 1 << 21  # elements coded per step: any multiple of the tile gives the same bytes. Each
# torch/numpy call holds the GIL while it parses its arguments (~40 per chunk): fewer, larger chunks
# hold it less, but every worker's scratch and temporaries grow with the chunk (~6 bytes/element).
# H200 host, flux coded setup: 1 Mi elements 17.4 s (3a79e14), 8 Mi 16.0 s (c99ccf1: not the GIL
# then); 2 Mi keeps a worker's scratch ~12 MB (tests/test_pack_rss.py counts it)
_DEVICE_CODE_CHUNK = 1 << 26  # elements per step when coding on a GPU (launch-bound, not memory-bound)


def _split_chunk(v: torch.Tensor, split: int, scratch: _Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol, raw) bytes of contiguous int16 elements `v` (narrowing casts keep the low byte;
    `split`: `codec_format.split_of` of the dtype), or of uint8 elements (split 2: the byte is the
    symbol, raw is empty). With `scratch`, the int16 intermediates and the symbols live in its
    buffers (the symbols are overwritten by the next call); raw is always a new tensor."""
    if scratch is None:
        scratch = _Scratch(v.numel())
    n = v.numel()
    a, b, sym = scratch.a[:n], scratch.b[:n], scratch.sym[:n]
    if split == 2:
        return sym.copy_(v), v.new_empty(0)
    bf16 = split == 0
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
    split: int  # codec_format.split_of(dtype)
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
        sym, raw = _split_chunk(v, self.split, self.scratch)
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


def _histogram(elems: torch.Tensor, split: int, step: int, sample: int, scratch: _Scratch) -> torch.Tensor:
    """Symbol counts over every `sample`-th chunk of `step` elements."""
    hist = torch.zeros(256, dtype=torch.int64, device=elems.device)
    for a in range(0, elems.numel(), step * sample):
        sym, _ = _split_chunk(elems[a : a + step], split, scratch)
        hist += torch.bincount(sym, minlength=256)
    return hist.cpu()


def encode(
    tensor: torch.Tensor, *, k: int | None = None, tile: int = DEFAULT_TILE, table: Sequence[int] | None = None,
    out: torch.Tensor | None = None, levels: int = 1, k2: int | None = None, _torch_index: bool | None = None,
) -> torch.Tensor:
    """Code a bfloat16 / float16 / int16 / float8_e4m3fn / float8_e5m2 tensor into a new flat uint8 CPU buffer
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
    split = split_of(tensor.dtype)
    elems = tensor.detach().to(dev).contiguous().reshape(-1).view(torch.uint8 if split == 2 else torch.int16)
    step = _round_up(_CHUNK, tile)
    # on a GPU, fewer launches per byte: chunks as large as the whole tensor up to 64 Mi elements
    code_step = _round_up(max(_CODE_CHUNK if dev.type == "cpu" else _DEVICE_CODE_CHUNK, tile), tile)
    scratch = _Scratch(min(max(code_step, step), _round_up(elems.numel(), tile)), dev)  # >= any chunk
    sample = 4 if elems.numel() > 4 * step and table is None else 1

    def choose(sample: int, table):
        hist = _histogram(elems, split, step, sample, scratch)
        if table is not None:
            return _given_table(hist.tolist(), k, table) + (0,)
        return choose_code(hist.numpy(), k, levels, tile, k2, patched=levels == PATCHED)

    kk, table, window, kk2 = choose(sample, table)
    if kk == 0 and sample > 1:  # one symbol in the sample: make sure of the whole tensor
        kk, table, window, kk2 = choose(1, None)
    coder = _Coder(kk, table, window, tile, split, [], [], [], [], scratch,
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
    nraw = head.raw_bytes
    if c.raw and nraw:
        torch.cat(c.raw, out=out[head.raw_off : head.raw_off + nraw])
    out[head.raw_off + nraw : head.code_off].zero_()
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
            at += t.numel() * t.element_size()
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
    """Shannon entropy (bits) of the coded symbol (bf16: exponent; float8: the byte; else high byte)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_CODES:
        raise TypeError(f"tensor must be a torch.Tensor of dtype in {list(DTYPE_CODES)}")
    split = split_of(tensor.dtype)
    elems = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8 if split == 2 else torch.int16)
    hist = torch.zeros(256, dtype=torch.float64)
    scratch = _Scratch(min(_CHUNK, elems.numel()))
    for a in range(0, elems.numel(), _CHUNK):
        sym, _ = _split_chunk(elems[a : a + _CHUNK], split, scratch)
        hist += torch.bincount(sym, minlength=256)
    p = hist[hist > 0] / hist.sum().clamp(min=1)
    return float(-(p * p.log2()).sum())
