"""GPU encoder of the lossless weight codec (16-bit and float8): the CPU encoder's bytes, coded on the device.

`encode_jobs(src, jobs, out)` codes any number of tensors ("jobs": byte ranges of one device
buffer, such as a block image in a staging buffer) into `out`, back to back, with the bytes
`kernels/codec_encode.py` `encode` writes for each (its reference: the format is
`kernels/codec_format.py`, golden digests in tests/kernels/test_codec_encode.py hold both to it).
`encode_gpu(tensor)` codes one CUDA tensor, as `encode(tensor)` does on the CPU.

How (the `@triton.jit` bodies are in `kernels/_codec_encode_kernels.py`):

1. one launch over every tile of every job: each job's symbol histogram, whole and over the chunks
   the CPU encoder samples (every 4th of 256 Ki elements for tensors over 1 Mi elements);
2. the one host sync: the histograms (2 KB per job) come to the host, which chooses k, k2 and the
   tables with the CPU encoder's rule (`kernels/codec_choose.py`, the one chooser of both),
   counts the escapes from the whole histogram and lays every coded tensor out (`_layout`; a job
   whose coded size passes its `max_coded` is coded raw as int16, k = 8, as the host store does);
3. the headers and tables scattered into the zeroed output, then one launch writes every raw byte,
   code plane and per-tile escape count, a prefix sum over the counts gives each tile its base,
   one launch ranks and compacts the escapes (exceptions; level-2 codes and exceptions; patches),
   and one more packs the level-2 codes.

No per-element Python: the host's work per job is a few loops over 256 counts. Every comparison of
the tests is exact (`torch.equal` on the bytes).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from .codec_choose import choose
from .codec_encode import _CHUNK
from .codec_format import (BYTE_DTYPES, DEFAULT_TILE, DTYPE_CODES, LEVELS, PATCHED, STREAM_ALIGN, CodedHeader,
                           _check_int, _check_tile, _layout, _round_up, split_of)

__all__ = ["EncodeJob", "encode_jobs", "encode_gpu", "bytes_moved"]

_FIELDS = 16  # int64 fields per job record: must match _codec_encode_kernels._NUM_FIELDS
_PACK2_BLOCK = 1024  # level-2 code bytes per program of _pack2_kernel
_MAX_NUMEL = (1 << 31) - 1  # int32 histograms and counts


@dataclass(frozen=True)
class EncodeJob:
    """One tensor to code: `nbytes` bytes at byte `src_offset` (even) of the source, read as
    16-bit elements of `dtype` (bfloat16, float16 or int16; an odd byte count reads a zero high
    byte last: the source must hold that byte, its value is not used), or as 8-bit elements
    (float8_e4m3fn / float8_e5m2). `k`: None chooses it (as `encode`), or the bits per code.
    `max_coded`: a coded tensor of more bytes is coded as its raw int16 bits at k = 8 instead
    (the host store's bound; a float8 tensor too, as `offload/host/encode.py` does)."""

    src_offset: int
    nbytes: int
    dtype: torch.dtype
    k: int | None = None
    max_coded: int | None = None

    def __post_init__(self) -> None:
        _check_int("src_offset", self.src_offset, 0)
        if self.src_offset % 2:
            raise ValueError(f"src_offset must be even (16-bit elements), got {self.src_offset}")
        _check_int("nbytes", self.nbytes, 0, 2 * _MAX_NUMEL)
        if self.dtype not in DTYPE_CODES:
            raise TypeError(f"dtype must be one of {list(DTYPE_CODES)}, got {self.dtype}")
        if self.k is not None:
            _check_int("k", self.k, 0, 8)
        if self.max_coded is not None:
            _check_int("max_coded", self.max_coded, 0)

    @property
    def numel(self) -> int:
        return self.nbytes if self.dtype in BYTE_DTYPES else -(-self.nbytes // 2)


def bytes_moved(heads: Sequence[CodedHeader]) -> int:
    """Raw bytes read (once) plus coded bytes written by an encode of `heads`' tensors."""
    return sum(h.decoded_bytes + h.nbytes for h in heads)


def _lut(head: CodedHeader) -> list[int]:
    """symbol -> level-1 code (256 entries), then symbol -> level-2 code (256; version 2)."""
    k, t = head.k, head.table
    if k == 8:
        one = list(range(256))
    elif k == 0:
        one = [0] * 256
    else:
        n1 = (1 << k) - 1
        one = [n1] * 256
        for j, s in enumerate(t[:n1]):
            one[s] = j
    two = [0] * 256
    if head.k2:
        n1, n2 = (1 << k) - 1, (1 << head.k2) - 1
        two = [n2] * 256
        for j, s in enumerate(t[n1 : n1 + n2]):
            two[s] = j
    return one + two


def _choose_head(job: EncodeJob, hist: torch.Tensor, levels: int, tile: int) -> CodedHeader:
    """The header `encode` writes for `job`, from its histograms ([512]: whole, then sampled)."""
    numel, dtype = job.numel, job.dtype
    if job.k == 8:
        return _layout(dtype, 8, (), numel, tile, 0)
    full, samp = hist[:256].numpy(), hist[256:].numpy()
    k, table, _, k2 = choose(samp, job.k, levels, tile, patched=levels == PATCHED)
    if k == 0 and numel > 4 * _CHUNK:  # one symbol in the sample: make sure of the whole tensor
        k, table, _, k2 = choose(full, job.k, levels, tile, patched=levels == PATCHED)
    counts = full.tolist()
    if k == 0 and any(c for s, c in enumerate(counts) if s != table[0]):
        raise ValueError(f"k=0 needs every symbol to be table[0]={table[0]}")
    esc = exc = 0
    if 1 <= k <= 7:
        esc = numel - sum(counts[s] for s in table[: (1 << k) - 1])
        exc = numel - sum(counts[s] for s in table) if k2 else esc
    head = _layout(dtype, k, table, numel, tile, exc, k2, esc, levels == PATCHED and 0 < k < 8)
    if job.max_coded is not None and head.nbytes > job.max_coded:
        return _layout(torch.int16, 8, (), -(-job.nbytes // 2), tile, 0)
    return head


def _record(job: EncodeJob, head: CodedHeader | None, tile_start: int, out_off: int, tmp2_off: int) -> list[int]:
    sample = 4 if job.numel > 4 * _CHUNK else 1
    split = split_of(head.dtype if head is not None else job.dtype)
    numel = head.numel if head is not None else job.numel  # a float8 job coded raw: int16 elements
    rec = [job.src_offset, numel, job.nbytes, split, tile_start]
    if head is None:  # the histogram pass reads fields 0-4 and 15 only
        return rec + [0] * 10 + [sample]
    patched = head.version == 3
    return rec + [out_off, head.raw_off, head.code_off, head.base_off, head.exc_off, head.k, head.k2, tmp2_off,
                  head.base2_off, head.patch_sym_off if patched else -1, sample]


def _up(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on ``dev`` without a stream sync (staged in pinned memory on CUDA)."""
    if dev.type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


def _check_src(src: torch.Tensor, jobs) -> None:
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a torch.Tensor, got {type(src).__name__}")
    if src.dtype != torch.uint8 or src.dim() != 1 or (src.numel() > 1 and src.stride(0) != 1):
        raise TypeError(f"src must be a 1-D contiguous uint8 tensor, got {src.dtype} of shape {tuple(src.shape)}")
    if src.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"src must be a CUDA tensor (or set TRITON_INTERPRET=1), got {src.device}")
    if src.numel() and src.data_ptr() % 2:
        raise ValueError("src must start at an even address (16-bit elements are read)")
    for i, job in enumerate(jobs):
        if not isinstance(job, EncodeJob):
            raise TypeError(f"jobs[{i}] must be an EncodeJob, got {type(job).__name__}")
        end = job.src_offset + job.nbytes + job.nbytes % 2  # an odd byte count loads the next byte too
        if end > src.numel():
            raise ValueError(f"jobs[{i}] reads bytes [{job.src_offset}, {end}) but src "
                             f"has {src.numel()}")


def _tiles(tiles: list[int], dev: torch.device) -> tuple[list[int], int, torch.Tensor]:
    """Each job's first tile, the total, and the job of every tile (on ``dev``)."""
    starts = [0]
    for n in tiles:
        starts.append(starts[-1] + n)
    tile_job = _up(torch.repeat_interleave(torch.arange(len(tiles), dtype=torch.int32),
                                           torch.tensor(tiles, dtype=torch.int64)), dev)
    return starts, starts[-1], tile_job


def encode_jobs(src: torch.Tensor, jobs: Sequence[EncodeJob], out: torch.Tensor | None = None, *,
                levels: int = 1, tile: int = DEFAULT_TILE) -> tuple[torch.Tensor, list[CodedHeader], list[int]]:
    """Code every job's bytes of `src` (a 1-D uint8 CUDA buffer) into `out` (a 1-D uint8 buffer on
    its device, 16-byte aligned; default a new one), back to back from its start: the bytes of
    `encode(tensor, k=job.k, tile=tile, levels=levels)` for each job's tensor. Returns (the coded
    bytes, a view of `out`; each job's `CodedHeader`; each coded tensor's offset in it). Issued on
    the current stream; the host waits once, for the histograms. `src` is only read."""
    _check_src(src, jobs)
    _check_tile(tile)
    _check_int("levels", levels, min(LEVELS), max(LEVELS))
    dev = src.device
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1
                            or out.device != dev or (out.numel() > 1 and out.stride(0) != 1)
                            or out.data_ptr() % STREAM_ALIGN):
        raise TypeError(f"out must be a 1-D contiguous, {STREAM_ALIGN}-byte aligned uint8 tensor on {dev} or None")
    from ._codec_encode_kernels import _code_kernel, _escape_kernel, _histogram_kernel, _pack2_kernel

    jobs = list(jobs)
    starts, total_tiles, tile_job = _tiles([-(-j.numel // tile) for j in jobs], dev)
    hist = torch.zeros(len(jobs), 512, dtype=torch.int32, device=dev)
    if total_tiles:
        recs = _up(torch.tensor([_record(j, None, s, 0, 0) for j, s in zip(jobs, starts)], dtype=torch.int64), dev)
        _histogram_kernel[(total_tiles,)](src, recs, tile_job, hist, TILE=tile, STEP=_round_up(_CHUNK, tile))
    hist = hist.to(torch.int64).cpu()  # the one host sync
    heads = [_choose_head(j, hist[i], levels, tile) for i, j in enumerate(jobs)]
    offsets, at, tmp2, v2, esc_at = [], 0, [], [], 0
    for i, h in enumerate(heads):
        offsets.append(at)
        tmp2.append(esc_at)  # where job i's level-2 codes go in the scratch buffer (version 2)
        if h.k2:
            v2.append(i)
            esc_at += h.num_escapes
        at += h.nbytes
    if out is None:
        out = torch.empty(at, dtype=torch.uint8, device=dev)
    elif out.numel() < at:
        raise ValueError(f"out has {out.numel()} bytes, the coded tensors need {at}")
    coded = out[:at]
    coded.zero_()
    prefix, where = [], []
    for h, o in zip(heads, offsets):
        pieces = [(o, h.pack())]
        if h.version == 3:  # the base stream's last entry: the total
            pieces.append((o + h.base_off + 8 * h.num_tiles, h.num_exceptions.to_bytes(8, "little")))
        for at_, b in pieces:
            prefix.append(torch.frombuffer(bytearray(b), dtype=torch.uint8))
            where.append(torch.arange(at_, at_ + len(b), dtype=torch.int64))
    if heads:
        coded[_up(torch.cat(where), dev)] = _up(torch.cat(prefix), dev)
    if any(h.numel != j.numel for h, j in zip(heads, jobs)):  # float8 jobs coded raw: int16 elements
        starts, total_tiles, tile_job = _tiles([h.num_tiles for h in heads], dev)
    if not total_tiles:
        return coded, heads, offsets
    recs = _up(torch.tensor([_record(j, h, s, o, t2) for j, h, s, o, t2 in zip(jobs, heads, starts, offsets, tmp2)],
                            dtype=torch.int64), dev)
    lut = _up(torch.tensor([_lut(h) for h in heads], dtype=torch.uint8), dev)
    counts = torch.empty(total_tiles, dtype=torch.int32, device=dev)
    counts2 = torch.empty(total_tiles, dtype=torch.int32, device=dev)
    _code_kernel[(total_tiles,)](src, coded, recs, tile_job, lut, counts, counts2, TILE=tile)
    if not any(1 <= h.k <= 7 for h in heads):
        return coded, heads, offsets
    excl = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    excl2 = torch.cumsum(counts2, 0, dtype=torch.int64) - counts2 if v2 else excl
    scratch = torch.empty(max(1, esc_at), dtype=torch.uint8, device=dev)
    _escape_kernel[(total_tiles,)](src, coded, recs, tile_job, lut, excl, excl2, scratch, TILE=tile)
    if v2:
        esc = [heads[i].num_escapes for i in v2]
        nb = max((n * heads[i].k2 + 7) // 8 for n, i in zip(esc, v2))
        if nb:
            code2 = [offsets[i] + heads[i].code2_off for i in v2]
            small = _up(torch.tensor([v2, esc, code2], dtype=torch.int64), dev)
            _pack2_kernel[(-(-nb // _PACK2_BLOCK), len(v2))](coded, recs, small[0], scratch, small[1], small[2],
                                                             BLOCK=_PACK2_BLOCK)
    return coded, heads, offsets


def encode_gpu(tensor: torch.Tensor, *, k: int | None = None, tile: int = DEFAULT_TILE, levels: int = 1,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """One bfloat16 / float16 / int16 / float8 tensor on a CUDA device coded there: the bytes of
    `encode(tensor, k=k, tile=tile, levels=levels)` (kernels/codec_encode.py), as a uint8 buffer
    on its device (a view of the start of `out` when given)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPE_CODES:
        raise TypeError(f"tensor dtype must be one of {list(DTYPE_CODES)}, got {tensor.dtype}")
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n % 2 or flat.data_ptr() % 2:  # the kernels load byte pairs: an odd span reads one byte past its end
        flat = torch.cat([flat, flat.new_zeros(1)])
    coded, _, _ = encode_jobs(flat, [EncodeJob(0, n, tensor.dtype, k)], out, levels=levels, tile=tile)
    return coded
