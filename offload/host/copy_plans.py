"""Copy plans of the mmap source: runtime layouts in checkpoint-file order,
copy runs from the mapping into a slot, kernel segments, the staging pack
(pure), and :class:`CheckpointPages`, the owner of the registered pages.

A streamed block reaches its slot either by copies straight from the mapped
checkpoint (``runs``: identity tensors; ``wire_runs``: tensors a kernel
transform rewrites, copied into a wire buffer first) or through a host buffer
packed by :func:`pack_block` (staging). Only :class:`CheckpointPages` touches CUDA.
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from dataclasses import dataclass

import torch

from weightstream.kernels.materialise import SegmentTable, materialise_torch

from weightstream.offload.host.binding import TensorBinding, apply_transform
from weightstream.offload.host.checkpoint import Checkpoint
from weightstream.offload.config import OffloadConfig
from weightstream.offload.host.registration import HOST_REGISTER_READ_ONLY, _pages, _Registration, direct_after_registration, plan_registration
from weightstream.offload.host.arena import PAGE
from weightstream.offload.layout import TENSOR_ALIGN, BlockLayout, align_up
from weightstream.offload.progress import Progress

COPY_PATHS = ("auto", "direct", "staging")


@dataclass(frozen=True)
class Run:
    """Copy ``nbytes`` from byte ``src`` of checkpoint file ``file`` to ``dst`` of the slot (or wire buffer)."""

    file: int
    src: int
    dst: int
    nbytes: int


def merge_runs(items: list[Run]) -> list[Run]:
    """Merge copies adjacent in the file whose destinations keep the same relative placement."""
    out: list[Run] = []
    for r in sorted(items, key=lambda r: (r.file, r.src)):
        p = out[-1] if out else None
        if p is not None and p.file == r.file and p.src + p.nbytes == r.src and p.dst + p.nbytes == r.dst:
            out[-1] = Run(p.file, p.src, p.dst, p.nbytes + r.nbytes)
        elif r.nbytes:
            out.append(r)
    return out


def split_run(r: Run, chunk_bounds: dict[int, set[int]]) -> list[Run]:
    """``r`` cut where registrations meet (``chunk_bounds``: file -> offsets where
    registered ranges start or end): a copy whose source spans two registered
    ranges fails (CUDA invalid argument, seen on the H200)."""
    cuts = sorted(b for b in chunk_bounds.get(r.file, ()) if r.src < b < r.src + r.nbytes)
    out, at = [], r.src
    for b in cuts + [r.src + r.nbytes]:
        out.append(Run(r.file, at, r.dst + (at - r.src), b - at))
        at = b
    return out


def file_ordered_layout(layout: BlockLayout, keys: list[tuple]) -> BlockLayout:
    """The same tensors (same order, so the executor's views still pair up),
    with 512-aligned offsets assigned in checkpoint-file order."""
    order = sorted(range(len(layout.tensors)), key=lambda i: keys[i])
    offsets = [0] * len(order)
    off = 0
    for i in order:
        off = align_up(off, TENSOR_ALIGN)
        offsets[i] = off
        off += layout.tensors[i].nbytes
    specs = tuple(dataclasses.replace(s, offset=o) for s, o in zip(layout.tensors, offsets))
    return BlockLayout(layout.index, layout.name, specs, align_up(max(off, 1), TENSOR_ALIGN))


def file_keys(tensors: list[torch.Tensor], bindings: dict[int, TensorBinding], nfiles: int) -> list[tuple]:
    """(file, offset) of each tensor's checkpoint bytes; unbound tensors sort last."""
    return [(bindings[id(t)].src.file, bindings[id(t)].src.offset) if id(t) in bindings else (nfiles, 0)
            for t in tensors]


@dataclass
class BlockPlan:
    """How streamed block ``k`` gets into a slot."""

    k: int
    name: str
    runs: list[Run]  # identity tensors: mapping -> slot
    kernel: list[tuple[TensorBinding, int, SegmentTable]]  # (binding, slot offset, host table): QKV etc.
    wire_runs: list[Run]  # kernel tensors' wire bytes: mapping -> wire buffer
    wire_nbytes: int
    table: SegmentTable | None  # wire buffer -> slot, one launch
    callables: list[tuple[TensorBinding, object]]  # (binding, TensorSpec): host transform (staging only)
    local: list[tuple[torch.Tensor, int]]  # (host bytes, slot offset): unbound real buffers of the block
    direct: bool = False
    staged_because: str | None = None

    def ranges(self) -> list[tuple[int, int, int]]:
        """(file, start, end) byte ranges of the checkpoint this block reads on the direct path."""
        return [(r.file, r.src, r.src + r.nbytes) for r in self.runs + self.wire_runs]

    @property
    def wire_bytes(self) -> int:
        """Bytes one direct load moves host -> device (mapping runs, wire runs, private buffers)."""
        return sum(r.nbytes for r in self.runs + self.wire_runs) + sum(h.numel() for h, _ in self.local)


def build_plan(k: int, layout: BlockLayout, tensors: list[torch.Tensor], bindings: dict[int, TensorBinding]) -> BlockPlan:
    runs, kernel, callables, local, wire_items = [], [], [], [], []
    wire = 0
    for spec, t in zip(layout.tensors, tensors):
        b = bindings.get(id(t))
        if b is None:  # a real buffer no checkpoint key names (non-persistent): a small private copy
            local.append((t.detach().reshape(-1).view(torch.uint8).clone(), spec.offset))
        elif b.transform is not None:
            callables.append((b, spec))
        elif b.kernel is not None:
            wire = align_up(wire, TENSOR_ALIGN)
            kernel.append((b, spec.offset, SegmentTable([b.kernel_segment(0, 0)])))
            wire_items.append((Run(b.src.file, b.src.offset, wire, b.src.nbytes), b.kernel_segment(wire, spec.offset)))
            wire += b.src.nbytes
        else:
            runs.append(Run(b.src.file, b.src.offset, spec.offset, spec.nbytes))
    table = SegmentTable([seg for _, seg in wire_items]) if wire_items else None
    return BlockPlan(
        k, layout.name, merge_runs(runs), kernel, merge_runs([r for r, _ in wire_items]), wire, table, callables,
        local,
    )


def choose_paths(plans: list[BlockPlan], *, cuda: bool, pin_memory: bool, copy_path: str) -> None:
    """Mark each plan direct, or staged with the reason (registration may stage more later)."""
    if copy_path not in COPY_PATHS:
        raise ValueError(f"copy_path={copy_path!r} is not allowed; choose from: {', '.join(COPY_PATHS)}")
    for p in plans:
        p.direct, p.staged_because = False, None
        if p.callables:
            p.staged_because = f"mmap_weight_transform on {p.callables[0][0].name!r}"
        elif copy_path == "staging":
            p.staged_because = "copy_path='staging'"
        elif cuda and not pin_memory:
            p.staged_because = "pin_memory=False"
        elif not cuda and copy_path == "auto":
            p.staged_because = "CPU device"
        else:
            p.direct = True


def pack_block(ckpt: Checkpoint, plan: BlockPlan, buf: torch.Tensor, pool=None) -> None:
    """Write ``plan``'s runtime image into host bytes ``buf`` (the checkpoint runs
    split over ``pool``'s threads when given). Checks the files before reading (a
    truncated file would SIGBUS this thread) and after (never a mixed image)."""
    files = ckpt.files
    ckpt.check_unchanged()
    with torch.no_grad():
        if pool is not None:  # raw addresses: check the bounds torch slicing would have
            base = buf.data_ptr()
            for r in plan.runs:
                if r.dst + r.nbytes > buf.numel() or r.src + r.nbytes > files[r.file].u8.numel():
                    raise ValueError(f"pack: run {r} of block {plan.k} is out of bounds of its buffer or file")
            pool.copy([(base + r.dst, files[r.file].u8.data_ptr() + r.src, r.nbytes) for r in plan.runs])
        else:
            for r in plan.runs:
                buf[r.dst : r.dst + r.nbytes].copy_(files[r.file].u8[r.src : r.src + r.nbytes])
        for b, dst, table in plan.kernel:
            materialise_torch(ckpt.bytes(b.src), buf[dst : dst + b.src.nbytes], table)
        for b, spec in plan.callables:
            spec.view_of(buf).copy_(apply_transform(b, ckpt.tensor(b.src)))
        for host, dst in plan.local:
            buf[dst : dst + host.numel()].copy_(host)
    ckpt.check_unchanged()


class CheckpointPages:
    """Owner of the ``cudaHostRegister`` ranges of checkpoint pages that direct blocks read."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self._reg = _Registration()
        self._finalizer = weakref.finalize(self, self._reg.release)
        self.chunks = 0
        self.flags: int | None = None
        self.bounds: dict[int, set[int]] = {}  # file -> offsets where registrations start or end

    @property
    def nbytes(self) -> int:
        return self._reg.bytes

    def register(self, plans: list[BlockPlan], config: OffloadConfig) -> str | None:
        """Register the pages of ``plans`` (direct ones) within the budget; plans whose
        pages are not all registered turn staged. Returns the pin failure (None: none)."""
        if not plans:
            return None
        bases = [f.base for f in self.ckpt.files]
        pages = [_pages(p.ranges(), bases, PAGE) for p in plans]
        gb = config.pinned_memory_budget_gb
        accepted, chunks = plan_registration(pages, None if gb is None else int(gb * 1e9))
        reasons = []
        if len(accepted) < len(plans):
            reasons.append(f"pinned_memory_budget_gb={gb} covers the checkpoint pages of {len(accepted)} of "
                           f"{len(plans)} direct-copy blocks")
        done, err = self._register_chunks(chunks, config.progress)
        if err is not None:
            reasons.append(err)
        staged = 0
        for p, direct in zip(plans, direct_after_registration(pages, accepted, done)):
            if not direct:
                p.direct, p.staged_because = False, "checkpoint pages not registered"
                staged += 1
        if not reasons:
            return None
        failure = "; ".join(reasons) + f": {staged} block(s) stage through two pinned buffers instead (slower H2D, same results)"
        warnings.warn(f"weightstream: {failure}", stacklevel=6)
        return failure

    def _register_chunks(self, chunks, progress: bool) -> tuple[list, str | None]:
        bar = Progress("registering checkpoint pages", sum(n for _, _, n in chunks), progress)
        flags, done = [HOST_REGISTER_READ_ONLY, 0], []
        for f, start, size in chunks:
            err = self._reg.register(start, size, flags)
            if err is not None:
                return done, f"{err} for {size} bytes of {self.ckpt.files[f].path} (read-only flag, then flags 0)"
            self.flags = self._reg.flag
            flags = [self.flags]  # keep what worked
            done.append((f, start, size))
            base = self.ckpt.files[f].base
            self.bounds.setdefault(f, set()).update((start - base, start + size - base))
            bar.update(size)
            self.chunks = len(done)
        return done, None

    def release(self) -> None:
        """Unregister (callers make sure no copy still reads the pages)."""
        self._finalizer()
        self.bounds.clear()
