"""DLO shares: this rank's 1/N of every block, raw or coded per block, in one store.

Block ``k``'s share is of its raw image (``raw[k]``) or of its coded image (``tables[k]``
decodes it). ``shard_bytes[k] = shard_size(bytes, N)`` (512-aligned, the last share
zero-padded) and rank ``r`` holds bytes ``[r * shard, (r + 1) * shard)``: gathered rank-major,
the ``N * shard`` bytes *are* the image (the raw one: parameters are views at their layout
offsets; the coded one: what one decode turns into the block image). A coded share is sized
with slack (:func:`~.encode._slack`) so a slightly larger re-encode keeps its size and captured
graphs stay valid; a larger one is re-sharded (:meth:`Shares.set_coded` says so).

Each share is its own page-aligned anonymous mapping (:func:`~.registration.map_anonymous`),
registered whole with CUDA (:class:`~.registration.BlockRegistration`) while pinning is on and
within ``budget_bytes`` (first come, first pinned); the rest stays pageable (one warning).
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch

from weightstream.kernels.codec_format import DecodeTable
from weightstream.offload.dlo.control import CodedPiece, ShardPiece
from weightstream.offload.dlo.topology import shard_size
from weightstream.offload.host.arena import PAGE
from weightstream.offload.host.encode import _slack
from weightstream.offload.host.registration import BlockRegistration, map_anonymous, release_all
from weightstream.offload.layout import BlockLayout, TensorSpec, align_up
from weightstream.offload.progress import format_bytes

__all__ = ["Shares", "write_share", "joined"]


def _raw_bytes(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The ``spec.nbytes`` bytes ``t`` occupies in a block image (uint8, 1-D)."""
    t = t.detach()
    _check_tensor(spec, t)
    if t.is_contiguous() and tuple(t.stride()) == spec.stride and t.numel() * t.element_size() == spec.nbytes:
        return t.reshape(-1).view(torch.uint8)
    tmp = torch.zeros(spec.nbytes, dtype=torch.uint8, device=t.device)
    dataclasses.replace(spec, offset=0).view_of(tmp).copy_(t)
    return tmp


def _check_tensor(spec: TensorSpec, t: torch.Tensor) -> None:
    if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
        raise ValueError(f"tensor {spec.name!r} is {t.dtype} {tuple(t.shape)}, the layout says "
                         f"{spec.dtype} {spec.shape}")


def write_share(share: torch.Tensor, lo: int, spec: TensorSpec, t: torch.Tensor) -> None:
    """Write the bytes of tensor ``spec`` (value ``t``) that fall in ``share``: bytes
    ``[lo, lo + share.numel())`` of the block image (a tensor outside it is only checked)."""
    a, b = max(lo, spec.offset), min(lo + share.numel(), spec.offset + spec.nbytes)
    if a >= b:
        _check_tensor(spec, t)
        return
    raw = _raw_bytes(t, spec)
    share[a - lo : b - lo].copy_(raw[a - spec.offset : b - spec.offset])


def joined(blobs: list[torch.Tensor]) -> torch.Tensor:
    """A block's coded tensors back to back (its coded image)."""
    return torch.cat(blobs) if blobs else torch.empty(0, dtype=torch.uint8)


class Shares:
    """This rank's share of every block, raw or coded per block (see the module docstring)."""

    def __init__(self, layouts: list[BlockLayout], world: int, rank: int, *, pin: bool,
                 budget_bytes: int | None = None):
        self.layouts, self.world, self.rank = list(layouts), world, rank
        n = len(self.layouts)
        self.want_pin = bool(pin) and torch.cuda.is_available()
        self.budget, self.pin_failure = budget_bytes, None
        self._register_failed = False  # a registration error: nothing more is pinned
        self.shard_bytes = [0] * n
        self.raw = [True] * n  # block k's share is of its raw image (no decode)
        self.coded = [0] * n  # bytes of block k's coded image (0: raw)
        self.tables: list[DecodeTable | None] = [None] * n
        self._shares: list[torch.Tensor | None] = [None] * n
        self._regs = [BlockRegistration() for _ in range(n)]
        self._finalizer = weakref.finalize(self, release_all, self._regs)

    # -- access --------------------------------------------------------------------
    @property
    def max_shard(self) -> int:
        return max(self.shard_bytes)

    def image(self, k: int) -> torch.Tensor:
        """This rank's ``shard_bytes[k]`` bytes of block ``k`` (raw or coded)."""
        return self._shares[k]

    def range(self, k: int) -> tuple[int, int]:
        """Byte range [lo, hi) of block k's (raw or coded) image held here (hi may pass its end: padding)."""
        lo = self.rank * self.shard_bytes[k]
        return lo, lo + self.shard_bytes[k]

    def raw_shard_bytes(self, k: int) -> int:
        return shard_size(self.layouts[k].nbytes, self.world)

    def coded_shard_bytes(self, k: int, coded: int) -> int:
        """Share bytes of block ``k`` coded in ``coded`` bytes (slack included)."""
        return shard_size(coded + _slack(self.layouts[k]), self.world)

    # -- filling -------------------------------------------------------------------
    def set_raw(self, k: int, tensors) -> None:
        """Block ``k``'s share of its raw image, from its tensors (in layout order)."""
        specs = self.layouts[k].tensors
        tensors = list(tensors)
        if len(tensors) != len(specs):
            raise ValueError(f"block {self.layouts[k].name!r}: {len(tensors)} tensors given, layout has {len(specs)}")
        for spec, t in zip(specs, tensors):
            _check_tensor(spec, t)  # all checked before any byte is written
        sb = self.raw_shard_bytes(k)

        def fill(share: torch.Tensor) -> None:  # zeroed: alignment gaps and the last rank's padding stay 0
            with torch.no_grad():
                for spec, t in zip(specs, tensors):
                    write_share(share, self.rank * sb, spec, t)

        self._store(k, sb, fill, 0, None)

    def write_raw(self, k: int, spec: TensorSpec, t: torch.Tensor) -> None:
        """Write the part of tensor ``spec`` (value ``t``) of raw block ``k`` in this rank's share."""
        if not self.raw[k]:
            raise ValueError(f"block {self.layouts[k].name!r} is coded; write_raw() writes raw shares")
        write_share(self.image(k), self.range(k)[0], spec, t)

    def set_coded(self, k: int, coded: torch.Tensor, table: DecodeTable, *, fresh: bool = False) -> bool:
        """Store this rank's share of block ``k``'s coded image; True when it was re-sharded
        (a new shard size: the coded image outgrew ``N * shard``). ``fresh``: sized anew from the
        coded bytes (a raw block becoming coded)."""
        old = 0 if self.raw[k] else self.shard_bytes[k]
        resharded = fresh or old == 0 or coded.numel() > self.world * old
        sb = self.coded_shard_bytes(k, coded.numel()) if resharded else old
        part = coded[self.rank * sb : (self.rank + 1) * sb]
        self._store(k, sb, lambda share: share[: part.numel()].copy_(part), coded.numel(), table)
        return resharded and old != 0

    def _store(self, k: int, sb: int, fill, coded: int, table: DecodeTable | None) -> None:
        """Block ``k``'s new share of ``sb`` bytes, written by ``fill(zeroed share)``: in fresh host
        memory (a new anonymous mapping, zero-filled) where its size changed, else through a
        zeroed buffer copied over the old share. Nothing of the block's state changes before the
        bytes are in place (a failed allocation or fill keeps the old share); callers made sure
        no copy still reads the old one."""
        old = self._shares[k]
        if old is not None and old.numel() == sb:
            share = torch.zeros(sb, dtype=torch.uint8)
            fill(share)
            old.copy_(share)
        else:
            mapping = map_anonymous(max(align_up(sb, PAGE), PAGE),
                                    f"this rank's share of block {self.layouts[k].name!r}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # frombuffer warns about writable buffers
                share = torch.frombuffer(mapping, dtype=torch.uint8)[:sb]
            fill(share)
            self._regs[k].release()
            self._shares[k] = share
        self.shard_bytes[k], self.coded[k], self.tables[k], self.raw[k] = sb, coded, table, table is None
        self.pin(k)

    def pin(self, k: int) -> None:
        """Register block ``k``'s share (whole) unless pinning is off, failed, over budget, or done."""
        if not self.want_pin or self._register_failed or self._regs[k].bytes:
            return
        size = align_up(self.shard_bytes[k], PAGE)
        if self.budget is not None and self.pinned_bytes + size > self.budget:
            if self.pin_failure is None:
                self.pin_failure = (f"pinned-memory budget of {format_bytes(self.budget)} reached; shares from "
                                    f"{self.layouts[k].name!r} on stay in pageable memory (slower H2D, same results)")
                warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=4)
            return
        err = self._regs[k].register(self._shares[k].data_ptr(), size)
        if err is not None:
            self._register_failed = True
            self.pin_failure = f"{err} for the share of block {self.layouts[k].name!r}; host memory stays pageable"
            warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=4)

    # -- reading back --------------------------------------------------------------
    def piece(self, name: str, k: int, index: int):
        """Tensor ``index`` of block ``k`` as far as this rank holds it. Raw: a CPU tensor when
        wholly in this rank's share, else a :class:`ShardPiece` (possibly empty). Coded: a
        :class:`CodedPiece` of the tensor's coded bytes held here (an empty tensor for an empty one)."""
        spec = self.layouts[k].tensors[index]
        lo, hi = self.range(k)
        whole = dataclasses.replace(spec, offset=0)
        if self.raw[k]:
            a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
            if a == spec.offset and b == spec.offset + spec.nbytes:
                return dataclasses.replace(spec, offset=spec.offset - lo).view_of(self.image(k)).clone()
            return ShardPiece(name, whole, max(0, a - spec.offset), self._bytes(k, a, b))
        if not spec.nbytes:
            return torch.empty(spec.shape, dtype=spec.dtype)
        seg = next(s for s in self.tables[k].segments if s.dst_offset == spec.offset)
        n = seg.header.nbytes
        blob = TensorSpec(spec.name, spec.kind, torch.uint8, (n,), (1,), 0, n)
        a, b = max(lo, seg.src_offset), min(hi, seg.src_offset + n)
        return CodedPiece(name, blob, max(0, a - seg.src_offset), self._bytes(k, a, b), target=whole)

    def _bytes(self, k: int, a: int, b: int) -> torch.Tensor:
        lo = self.range(k)[0]
        return self.image(k)[a - lo : b - lo].clone() if a < b else torch.empty(0, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        return sum(self.shard_bytes)

    @property
    def pinned_bytes(self) -> int:
        return sum(r.bytes for r in self._regs)

    @property
    def pinned(self) -> bool:
        """Every block's share is page-locked."""
        return self.want_pin and all(r.bytes for r in self._regs)

    def close(self) -> None:
        """Unregister the shares (after in-flight copies) and let go of them."""
        self._finalizer()
        self._shares = [None] * len(self._shares)

    def __repr__(self) -> str:
        coded = len(self.raw) - sum(self.raw)
        return (f"Shares(rank {self.rank}/{self.world}, {len(self.layouts)} blocks ({coded} coded), "
                f"{format_bytes(self.nbytes)} host, pinned {format_bytes(self.pinned_bytes)})")
