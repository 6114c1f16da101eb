"""GGUF files as mmap checkpoints: the header (v2 / v3, little-endian) parsed here; the file is
mapped read-only by :class:`~.checkpoint.GGUFFile` exactly as a safetensors file is.

A tensor of a GGUF file becomes a :class:`~.checkpoint.CkptTensor` the way diffusers' GGUF
loader (``load_gguf_checkpoint``) reads it: F32 and F16 (and the plain integer / F64 types) are
typed entries; every other ggml type (Q8_0, Q4_K, ..., BF16: diffusers keeps BF16 as a
``GGUFParameter`` too) is a uint8 entry of diffusers' byte shape ``(*rows, bytes per row)``
with its ggml type in ``quant_type``. GGUF lists dims fastest first (``ne0``), so the torch
shape is the dims reversed. No ``gguf`` import: the block sizes below are the ggml format's own
(``gguf.GGML_QUANT_SIZES``; tests/test_quantized_gguf_mmap.py compares the two).

A malformed header (bad magic, a version other than 2 or 3, a big-endian file, an unknown ggml
type, dims that do not fill whole blocks, offsets outside the file or overlapping, a string or
count past the end) raises :class:`Malformed` naming the file, the key and the value, which
:class:`~.checkpoint.GGUFFile` raises as a ``CheckpointFormatError`` (this module imports nothing
of the checkpoint's: it is the parser, the checkpoint builds on it).
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import torch


class Malformed(ValueError):
    """A malformed GGUF header (the message names the file, the key and the value)."""


def _short(value, n: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= n else r[: n - 3] + "..."


MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml type -> (name, values per block, bytes per block) (ggml.h; gguf.GGML_QUANT_SIZES)
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# the ggml types diffusers' loader keeps as plain tensors (the rest become GGUFParameters)
PLAIN = {0: torch.float32, 1: torch.float16, 24: torch.int8, 25: torch.int16, 26: torch.int32, 27: torch.int64,
         28: torch.float64}

# GGUF metadata value types: struct format of the scalars; 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def type_name(ggml_type: int) -> str:
    """The ggml type's name (``"Q8_0"``), or ``"type <n>"`` for a number this parser does not know."""
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else f"type {ggml_type}"


class _Reader:
    """Little-endian reads of a GGUF header from an open file, bounds-checked; the header is read
    in pieces as the parse needs it (names, dims and metadata: never the tensor data)."""

    def __init__(self, path: Path, f, size: int):
        self.path, self.f, self.buf, self.at, self.size = path, f, b"", 0, size

    def _have(self, n: int, what: str) -> None:
        if self.at + n > len(self.buf):
            self.buf += self.f.read(max(self.at + n - len(self.buf), 1 << 20))
        if self.at + n > len(self.buf):
            raise Malformed(f"{self.path}: the GGUF header ends inside {what} (byte {self.at} of a "
                            f"{self.size}-byte file): truncated, or not a GGUF file")

    def take(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self._have(n, what)
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += n
        return v

    def string(self, what: str) -> str:
        n = self.take("Q", what)
        if self.at + n > self.size:
            raise Malformed(f"{self.path}: {what} is {n} bytes long, past the file's end (byte "
                            f"{self.at} of a {self.size}-byte file): truncated or corrupt")
        self._have(n, what)
        raw = self.buf[self.at : self.at + n]
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Malformed(f"{self.path}: {what} is not UTF-8 ({_short(raw)})") from None

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, n = self.take("I", what), self.take("Q", what)
            if self.at + n > self.size:
                raise Malformed(f"{self.path}: {what} holds {n} values, past the file's end")
            return [self.value(etype, what) for _ in range(n)]
        raise Malformed(f"{self.path}: {what} has metadata value type {vtype}; GGUF knows 0-12")


def _read_header(path: Path, f, size: int) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]], int]:
    """(metadata, [(name, dims as stored, ggml type, relative offset)], data start) of an open GGUF file."""
    r = _Reader(path, f, size)
    try:
        r._have(24, "the GGUF preamble")
    except Malformed:
        pass  # a file shorter than the preamble: named below by its first bytes
    if len(r.buf) < 24 or r.buf[:4] != MAGIC:
        raise Malformed(f"{path}: not a GGUF file (its first bytes are {_short(bytes(r.buf[:4]))}, "
                        f"not {MAGIC!r}; {size} bytes)")
    r.at = 4
    version = r.take("I", "the version")
    if version not in VERSIONS:
        be = struct.unpack_from(">I", r.buf, 4)[0]
        why = "a big-endian GGUF file; convert it to little-endian" if be in VERSIONS else "choose from: 2, 3"
        raise Malformed(f"{path}: GGUF version {version} is not read here ({why})")
    n_tensors, n_kv = r.take("Q", "the tensor count"), r.take("Q", "the metadata count")
    meta = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        meta[key] = r.value(r.take("I", f"the type of metadata {key!r}"), f"metadata {key!r}")
    infos = []
    for i in range(n_tensors):
        name = r.string(f"the name of tensor {i}")
        nd = r.take("I", f"the dims count of tensor {name!r}")
        if nd > 4:
            raise Malformed(f"{path}: tensor {name!r} has {nd} dims; GGUF allows at most 4")
        dims = tuple(r.take("Q", f"the dims of tensor {name!r}") for _ in range(nd))
        infos.append((name, dims, r.take("I", f"the type of tensor {name!r}"), r.take("Q", f"the offset of {name!r}")))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise Malformed(f"{path}: general.alignment is {_short(align)}, not a power of two")
    return meta, infos, -(-r.at // align) * align


def _entry(path: Path, name: str, dims: tuple[int, ...], ggml_type: int, rel: int, data: int,
           size: int) -> tuple[torch.dtype, tuple[int, ...], int, int, int | None]:
    """(dtype, shape, absolute offset, nbytes, quant type or None) of one tensor info."""
    where = f"{path}: tensor {name!r}"
    if ggml_type not in GGML_TYPES:
        raise Malformed(f"{where}: ggml type {ggml_type} is not one this loader reads; known: "
                        f"{', '.join(n for n, _, _ in GGML_TYPES.values())}")
    tname, block, nbytes_block = GGML_TYPES[ggml_type]
    shape = tuple(reversed(dims))  # ne0 (fastest) is the last torch dim
    numel = 1
    for s in shape:
        numel *= s
    if shape and shape[-1] % block:
        raise Malformed(f"{where}: its rows of {shape[-1]} values do not fill whole {tname} blocks of "
                        f"{block} values (shape {shape}); the file is corrupt")
    nbytes = numel // block * nbytes_block
    if ggml_type in PLAIN:
        dtype, quant = PLAIN[ggml_type], None
    else:  # diffusers' byte shape: (*rows, blocks per row * bytes per block)
        dtype, quant = torch.uint8, ggml_type
        shape = shape[:-1] + (shape[-1] // block * nbytes_block,) if shape else shape
    if data + rel + nbytes > size:
        raise Malformed(f"{where}: offset {rel} + {nbytes} bytes of {tname} lie outside the file's "
                        f"{size - data} data bytes (truncated or corrupt: re-download or re-write it)")
    return dtype, shape, data + rel, nbytes, quant


def read_tensors(path: Path, f, size: int) -> tuple[dict, dict[str, tuple]]:
    """(metadata, name -> (dtype, shape, offset, nbytes, quant type)) of the open GGUF file ``f``
    (``size`` bytes); :class:`Malformed` for a malformed header, duplicate names or overlapping data."""
    meta, infos, data = _read_header(path, f, size)
    out: dict[str, tuple] = {}
    for name, dims, ggml_type, rel in infos:
        if name in out:
            raise Malformed(f"{path}: tensor {name!r} appears twice in its GGUF header")
        out[name] = _entry(path, name, dims, ggml_type, rel, data, size)
    spans = sorted((off, off + n, k) for k, (_, _, off, n, _) in out.items() if n)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise Malformed(f"{path}: tensors {a!r} and {b!r} overlap (bytes [{begin}, {end}) of the file); the "
                            "file is corrupt: re-write it")
    return meta, out


def read_file(path) -> tuple[dict, dict[str, tuple]]:
    """:func:`read_tensors` of the GGUF file at ``path`` (header only: nothing mapped, no data read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return read_tensors(path, f, os.fstat(f.fileno()).st_size)
    except OSError as e:
        raise ValueError(f"cannot open checkpoint file {str(path)!r}: {e}") from e
