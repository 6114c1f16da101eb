"""Encoding block images for the coded sources (pure, CPU, on worker threads).

One block's tensors coded into one coded image (:func:`encode_image`, :func:`encode_into`, one
tensor per worker: :func:`encode_tensors_into`), blocks coded a few at a time in block order
(:func:`encoded_in_order`, :func:`in_order`), and the host sizes a coded block may take
(:func:`_capacity`, its worst case; :func:`_slack`, what every load copies beyond its coded
size). Used by :mod:`.images`, :mod:`weightstream.offload.checkpoint_offload` and the DLO source.
"""
from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import torch

from weightstream.kernels.codec_encode import encode
from weightstream.kernels.codec_format import (BYTE_DTYPES, DEFAULT_TILE, HEADER_BYTES, PATCHED, CodecSegment,
                                               DecodeTable, read_header)
from weightstream.offload.host.arena import PAGE
from weightstream.offload.host.packing import usable_cpus
from weightstream.offload.layout import BlockLayout, TensorSpec, align_up

# coded (float8: the byte is the symbol); every other dtype (int8 / uint8 of GGUF and torchao, fp32, ...) is
# stored raw (k = 8), and a coded tensor larger than its raw bound (:func:`_raw_bound`) too
CODED_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
_ALIGN = 16  # coded tensors start 16-byte aligned (codec format)


def _span_bytes(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The bytes of ``t``'s strided span as the block image holds them (uint8; on ``t``'s
    device when that is CUDA: the encoder codes there, else on the CPU)."""
    t = t.detach()
    dev = t.device if t.device.type == "cuda" else torch.device("cpu")
    if t.device == dev and t.is_contiguous() and tuple(t.stride()) == spec.stride:
        return t.reshape(-1).view(torch.uint8)
    out = torch.zeros(spec.nbytes, dtype=torch.uint8, device=dev)
    dataclasses.replace(spec, offset=0).view_of(out).copy_(t)
    return out


def _raw_bound(spec: TensorSpec) -> int:
    """Coded bytes of ``spec`` at k = 8 (its bytes as they are): what any encoding is held to."""
    n = -(-spec.nbytes // 2)
    tiles = -(-n // DEFAULT_TILE)
    return align_up(align_up(HEADER_BYTES, _ALIGN) + align_up(n, _ALIGN) + tiles * DEFAULT_TILE + 8 * tiles, _ALIGN)


def decode_paths(levels: int, fp8: bool = False) -> dict:
    """The kernel paths every table of a source coding with ``levels`` compiles (DecodeTable's
    level2 / patch / ranked / bytes8): a block re-encoded under a captured graph may hold a version
    its first table did not (a small tensor whose best code had no escapes), so they never depend
    on it. "exp-kp" writes no ranked escapes (version 3, or version 1 with k 0 or 8): not ranked.
    ``fp8``: the block holds a float8 tensor (:func:`has_fp8`; coded now, or raw now and coded
    after an update): the 8-bit stores are compiled whatever its first table holds."""
    return {"level2": levels == 2, "patch": levels == PATCHED, "ranked": levels != PATCHED, "bytes8": bool(fp8)}


def has_fp8(specs) -> bool:
    """Whether any of ``specs`` (a block's :class:`TensorSpec` s) is a non-empty float8 tensor."""
    return any(s.dtype in BYTE_DTYPES and s.nbytes for s in specs)


def _encode_tensor(t: torch.Tensor, spec: TensorSpec, out: torch.Tensor | None = None,
                   levels: int = 1) -> torch.Tensor:
    """``t`` coded (at the start of ``out`` when it fits, see :func:`~weightstream.kernels.codec_encode.encode`;
    ``levels`` 2: codec "exp-k2")."""
    if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
        raise ValueError(f"tensor {spec.name!r}: got {t.dtype} {tuple(t.shape)}, the layout says "
                         f"{spec.dtype} {spec.shape}")
    raw = _span_bytes(t, spec)
    if spec.dtype in CODED_DTYPES:
        blob = encode(raw.view(spec.dtype), out=out, levels=levels)
        if blob.numel() <= _raw_bound(spec):
            return blob
    if raw.numel() % 2:  # odd byte count: one pad byte (the next tensor starts 512-aligned)
        raw = torch.cat([raw, raw.new_zeros(1)])
    return encode(raw.view(torch.int16), k=8, out=out)


def encode_image(layout: BlockLayout, tensors, region: torch.Tensor | None = None, *, levels: int = 1):
    """Coded tensors of one block (empty ones left out) and the table decoding them into its image.
    With ``region`` (a block region, :func:`_capacity` bytes), the coded tensors are written back
    to back at its start and the blobs returned are views of it. ``levels``: see :data:`CODEC_LEVELS`."""
    blobs, segs, at = [], [], 0
    for spec, t in zip(layout.tensors, tensors):
        if not spec.nbytes:
            continue
        out = None if region is None else region[at:]
        blob = _encode_tensor(t, spec, out, levels)
        if out is not None and blob.data_ptr() != out.data_ptr():  # did not fit where it goes: copy
            blob = out[: blob.numel()].copy_(blob)  # (raises if the region is too small)
        blobs.append(blob)
        segs.append(CodecSegment(at, spec.offset, read_header(blob)))
        at += blob.numel()
    return blobs, DecodeTable(segs, **decode_paths(levels, has_fp8(layout.tensors)))


def encode_into(region: torch.Tensor, layout: BlockLayout, tensors, *, levels: int = 1) -> tuple[int, DecodeTable]:
    """``encode_image`` coding straight into the start of ``region`` (on the worker: no copy
    afterwards, and the first touch of the region's pages runs in parallel too); returns
    (coded bytes, table)."""
    blobs, table = encode_image(layout, tensors, region, levels=levels)
    return sum(b.numel() for b in blobs), table


def encode_tensors_into(region: torch.Tensor, layout: BlockLayout, tensors, *,
                        workers: int | None = None, levels: int = 1) -> tuple[int, DecodeTable]:
    """:func:`encode_into` with the block's tensors encoded on worker threads (a few tensors
    ahead, each into its own buffer, copied into ``region`` in order): the same bytes, for
    blocks too few to keep the workers busy one block each (module offload: 2 components of
    a pipeline encoded one tensor at a time reached 0.3 GB/s on the H200 host, 9aef8fd)."""
    items = [(spec, t) for spec, t in zip(layout.tensors, tensors) if spec.nbytes]
    segs, at = [], 0
    work = lambda i: _encode_tensor(items[i][1], items[i][0], levels=levels)  # noqa: E731
    with contextlib.closing(in_order(len(items), work, workers=workers)) as coded:
        for (spec, _), blob in zip(items, coded):
            region[at : at + blob.numel()].copy_(blob)  # (raises if the region is too small)
            segs.append(CodecSegment(at, spec.offset, read_header(blob)))
            at += blob.numel()
    return at, DecodeTable(segs, **decode_paths(levels, has_fp8(layout.tensors)))


def _write(region: torch.Tensor, blobs: list[torch.Tensor]) -> int:
    at = 0
    for b in blobs:
        region[at : at + b.numel()].copy_(b)  # a block's coded tensors fit its region (_capacity)
        at += b.numel()
    return at


def encoded_in_order(layouts: list[BlockLayout], objs: list[list[torch.Tensor]], *, workers: int | None = None,
                     levels: int = 1):
    """``encode_image`` of every block, computed on worker threads a few blocks ahead and
    yielded in block order (torch's copies and shifts release the GIL). See :func:`in_order`
    for the threads; ``workers`` defaults to :func:`encode_workers`."""
    return in_order(len(layouts), lambda k: encode_image(layouts[k], objs[k], levels=levels), workers=workers)


def encode_workers() -> int:
    """Encode worker threads: the cores this process may run on (:func:`~.packing.usable_cpus`)."""
    return usable_cpus()


@contextlib.contextmanager
def one_intra_op_thread():
    """torch's intra-op threads set to 1 inside the block, restored after it, on error too.

    Each encode worker is one thread doing small per-chunk ops: with torch's default
    intra-op threads (one per core) every worker's ops fan out to a pool of its own and
    W workers x N threads thrash (16 cores: 0.2-0.4 GB/s in all). ``torch.set_num_threads``
    is process-wide: other threads of the process run single-threaded torch ops meanwhile.
    Threads started inside the block take 1 (torch reads the count lazily per thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_order(n: int, work, *, workers: int | None = None, ahead: int | None = None):
    """``work(k)`` for k in 0..n-1 on ``workers`` threads (default :func:`encode_workers`),
    at most ``ahead`` in flight (default: the workers + 2; results waiting for the consumer
    bound host memory), yielded in order; torch runs one intra-op thread per worker meanwhile
    (:func:`one_intra_op_thread`, restored when the generator finishes or is closed)."""
    workers = max(1, min(encode_workers() if workers is None else workers, n, ahead or n))
    ahead = workers + 2 if ahead is None else max(1, ahead)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightstream-encode")
    with one_intra_op_thread(), pool:
        futs = {k: pool.submit(work, k) for k in range(min(n, ahead))}
        try:
            for k in range(n):
                done = futs.pop(k).result()
                if k + ahead < n:
                    futs[k + ahead] = pool.submit(work, k + ahead)
                yield done
        finally:
            for f in futs.values():
                f.cancel()


def _capacity(layout: BlockLayout) -> int:
    return max(PAGE, align_up(sum(_raw_bound(s) for s in layout.tensors if s.nbytes), PAGE))


def _slack(layout: BlockLayout) -> int:
    """Bytes beyond the coded size every load copies, so that a re-encode a little larger
    (an update, an edit) still fits what captured graphs copy."""
    return align_up(layout.nbytes // 256 + 4096, _ALIGN)
