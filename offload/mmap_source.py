"""mmap checkpoint source: stream DiT blocks straight from safetensors files.

The DiT is built on the ``meta`` device; every expected tensor is bound to a
(file, key) of read-only mapped safetensors files (``mmap`` ACCESS_READ), so
no private full-model copy is ever made. Several processes on one node
streaming the same checkpoint share its page cache; only the two staging
buffers (and the device slots) are private.

Per streamed block one of two copy paths is chosen at setup:

direct (CUDA, primary)
    The file ranges the block reads are registered with ``cudaHostRegister``
    (flag cudaHostRegisterReadOnly, else 0; chunks of at most 1 GiB, page
    aligned, under ``pinned_memory_budget_gb``), and ``_issue`` copies the
    block's tensors straight from the mapping into the slot's runtime offsets
    on the copy stream, no host packing. Runtime offsets are assigned in file
    order, so tensors adjacent in the file whose sizes keep 512-byte
    alignment merge into one copy. Tensors whose checkpoint layout differs
    from the runtime layout by a declared kernel transform
    (``param.mmap_kernel_transform = ("qkv_reorder", num_heads, num_kv_heads)``)
    are copied into a per-slot wire buffer and written into the slot by ONE
    ``materialise`` launch per block (its segment table uploaded at setup).

staging (fallback)
    Blocks that cannot be copied directly (CPU device, no registration,
    budget exhausted, a Python ``mmap_weight_transform`` callable) are packed
    by a background thread into two host buffers (see :mod:`staging`); the
    forward thread only waits for a packed buffer and issues the H2D.

Model opt-in (as in vLLM-Omni's mmap loader): diffusers models load from a
diffusers-format folder without a mapping (checkpoint keys are runtime
names). Other models declare ``_supports_mmap_loading = True`` and/or
``_remap_ckpt_key(name) -> runtime name | None`` (None: intentionally
ignored key); sources come from the ``source`` argument or the model's
``weights_sources`` attribute. A parameter may carry
``mmap_weight_transform`` (a callable checkpoint tensor -> runtime tensor
that preserves dtype and element count; it must not modify its input, which
is a read-only view of the mapping) or ``mmap_kernel_transform``.

Checkpoint files must not change while they are mapped. Replace a checkpoint
atomically: write the new file elsewhere on the same filesystem, then rename
it over the old path (``os.replace``). A process that mapped the old file keeps
its mapping of the old inode and streams the old weights, whole and
consistent, until a new wrapper maps the new file. Writing a mapped file in
place (``cp new.safetensors old.safetensors``, ``open(path, "r+b")``) changes
the bytes under the mapping, so a step could mix old and new weights, and
truncating it makes any read past the new end kill the process with SIGBUS.
Each file's identity (``st_dev``, ``st_ino``), size and ``st_mtime_ns`` are
recorded when it is opened and checked (``fstat`` of the open file, a few
microseconds per file) at every step start, before the packer thread reads, before a
ring reload, and in the ``state_dict`` / ``disable`` paths; a difference
raises :class:`CheckpointChangedError` naming the file. A write during a
step is seen at the next check; a writer that keeps both the size and the
mtime (``cp -p`` of a same-size file) is not detected. ``state_dict()``
values are views of the mapping: read them before replacing anything in
place.

Entry point: :func:`offload_from_safetensors`. Checkpoint parsing and meta
binding live in :mod:`checkpoint`, registration in :mod:`host_memory`.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from weightstream.kernels.materialise import SegmentTable, materialise, materialise_torch

from .config import OffloadConfig
from .discovery import OffloadPlan, discover_blocks
from .executor import LayerwiseExecutor
from .checkpoint import (  # noqa: F401  (re-exported: the mmap source's public names)
    DIFFUSERS_WEIGHTS, KERNEL_TRANSFORMS, Checkpoint, CheckpointChangedError, CkptTensor, SafetensorsFile,
    TensorBinding, WeightsSource, _give_data, _listing, _named_tensors, apply_transform, as_sources,
    bind_checkpoint, changed_message, check_opt_in, host_tensor, meta_from_pretrained, on_meta,
)
from .host_memory import (  # noqa: F401  (re-exported)
    HOST_REGISTER_READ_ONLY, REGISTER_CHUNK, _covered, _cuda_register, _merge_intervals, _pages, _Registration,
    _size, direct_after_registration, plan_registration,
)
from .host_store import PAGE, Progress, copy_from_image
from .layout import TENSOR_ALIGN, BlockLayout, align_up, block_tensors
from .schedule import Load, Schedule
from .staging import CopyPool, Stager, StagingError, check_threads
from .transformer import OffloadedTransformer, StreamedBlocks, resolve_device

__all__ = [
    "WeightsSource",
    "Checkpoint",
    "as_sources",
    "offload_from_safetensors",
    "on_meta",
    "meta_from_pretrained",
    "bind_checkpoint",
    "plan_registration",
    "direct_after_registration",
    "CheckpointChangedError",
    "COPY_PATHS",
]

COPY_PATHS = ("auto", "direct", "staging")

# ----------------------------------------------------------------------------
# block plans: layouts in file order, copy runs, kernel segments
# ----------------------------------------------------------------------------


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



# ----------------------------------------------------------------------------
# the store
# ----------------------------------------------------------------------------


class MmapStore:
    """Host side of the mmap source: layouts, copy plans, registered checkpoint ranges.

    Duck-types the parts of :class:`HostStore` the rest of the controller reads
    (``layouts``, ``views``, ``pinned``, ``pinned_bytes``, ``pin_failure``,
    ``nbytes``, ``close``). There are no block images: ``image()`` raises.
    """

    def __init__(self, ckpt: Checkpoint, bindings: dict[int, TensorBinding], layouts: list[BlockLayout],
                 tensors: list[list[torch.Tensor]], device: torch.device, config: OffloadConfig, copy_path: str):
        t0 = time.perf_counter()
        self.ckpt, self.bindings, self.device = ckpt, bindings, device
        keys = []
        for lay, ts in zip(layouts, tensors):
            big = (len(ckpt.files), 0)
            keys.append([(bindings[id(t)].src.file, bindings[id(t)].src.offset) if id(t) in bindings else big
                         for t in ts])
        self.layouts = [file_ordered_layout(lay, kk) for lay, kk in zip(layouts, keys)]
        self.tensors = tensors
        self.plans = [build_plan(k, lay, ts, bindings) for k, (lay, ts) in enumerate(zip(self.layouts, tensors))]
        self.nbytes = sum(lay.nbytes for lay in self.layouts)
        self.pin_failure: str | None = None
        self._reg = _Registration()
        self._finalizer = weakref.finalize(self, self._reg.release)
        self.register_chunks = 0
        self.register_flags: int | None = None
        self.chunk_bounds: dict[int, set[int]] = {}  # file -> offsets where registrations start or end
        self.pack_threads: set[str] = set()  # names of the threads that ran pack() (staging)
        cuda = device.type == "cuda"
        for p in self.plans:
            if p.callables:
                p.staged_because = f"mmap_weight_transform on {p.callables[0][0].name!r}"
            elif copy_path == "staging":
                p.staged_because = "copy_path='staging'"
            elif cuda and not config.pin_memory:
                p.staged_because = "pin_memory=False"
            elif not cuda and copy_path == "auto":
                p.staged_because = "CPU device"
            else:
                p.direct = True
        if cuda:
            self._register([p for p in self.plans if p.direct], config)
        self.setup_s = time.perf_counter() - t0

    def _register(self, plans: list[BlockPlan], config: OffloadConfig) -> None:
        if not plans:
            return
        bases = [f.base for f in self.ckpt.files]
        pages = [_pages(p.ranges(), bases, PAGE) for p in plans]
        gb = config.pinned_memory_budget_gb
        budget = None if gb is None else int(gb * 1e9)
        accepted, chunks = plan_registration(pages, budget)
        reasons = []
        if len(accepted) < len(plans):
            reasons.append(
                f"pinned_memory_budget_gb={gb} covers the checkpoint pages of {len(accepted)} of {len(plans)} "
                "direct-copy blocks"
            )
        progress = Progress("registering checkpoint pages", sum(n for _, _, n in chunks), config.progress)
        flags = [HOST_REGISTER_READ_ONLY, 0]
        done = []
        for f, start, size in chunks:
            err = None
            for flag in flags:
                err = _cuda_register(start, size, flag)
                if err is None:
                    flags = [flag]  # keep what worked
                    self.register_flags = flag
                    break
            if err is not None:
                reasons.append(f"{err} for {size} bytes of {self.ckpt.files[f].path} (read-only flag, then flags 0)")
                break
            self._reg.ptrs.append(start)
            self._reg.bytes += size
            done.append((f, start, size))
            progress.update(size)
        self.register_chunks = len(done)
        for f, start, size in done:
            base = self.ckpt.files[f].base
            self.chunk_bounds.setdefault(f, set()).update((start - base, start + size - base))
        staged = 0
        for p, direct in zip(plans, direct_after_registration(pages, accepted, done)):
            if not direct:
                p.direct = False
                p.staged_because = "checkpoint pages not registered"
                staged += 1
        if reasons:
            self.pin_failure = "; ".join(reasons) + (
                f": {staged} block(s) stage through two pinned buffers instead (slower H2D, same results)"
            )
            warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=5)

    def split(self, r: Run) -> list[Run]:
        """``r`` cut where registrations meet: a copy whose source spans two
        registered ranges fails (CUDA invalid argument, seen on the H200)."""
        cuts = sorted(b for b in self.chunk_bounds.get(r.file, ()) if r.src < b < r.src + r.nbytes)
        out, at = [], r.src
        for b in cuts + [r.src + r.nbytes]:
            out.append(Run(r.file, at, r.dst + (at - r.src), b - at))
            at = b
        return out

    # -- packing (staging thread) ----------------------------------------------
    def pack(self, k: int, buf: torch.Tensor, pool: CopyPool | None = None) -> None:
        """Write streamed block ``k``'s runtime image into host bytes ``buf``
        (the checkpoint runs split over ``pool``'s threads when given)."""
        self.pack_threads.add(threading.current_thread().name)
        plan, files = self.plans[k], self.ckpt.files
        self.ckpt.check_unchanged()  # before reading: a truncated file would SIGBUS this thread
        with torch.no_grad():
            if pool is not None:  # raw addresses: check the bounds torch slicing would have
                base = buf.data_ptr()
                for r in plan.runs:
                    if r.dst + r.nbytes > buf.numel() or r.src + r.nbytes > files[r.file].u8.numel():
                        raise ValueError(f"pack: run {r} of block {k} is out of bounds of its buffer or file")
                pool.copy([(base + r.dst, files[r.file].u8.data_ptr() + r.src, r.nbytes) for r in plan.runs])
                self.pack_threads |= pool.thread_names
            else:
                for r in plan.runs:
                    buf[r.dst : r.dst + r.nbytes].copy_(files[r.file].u8[r.src : r.src + r.nbytes])
            for b, dst, table in plan.kernel:
                materialise_torch(self.ckpt.bytes(b.src), buf[dst : dst + b.src.nbytes], table)
            for b, spec in plan.callables:
                spec.view_of(buf).copy_(apply_transform(b, self.ckpt.tensor(b.src)))
            for host, dst in plan.local:
                buf[dst : dst + host.numel()].copy_(host)
        self.ckpt.check_unchanged()  # a write during the pack: never hand out a mixed image

    # -- HostStore surface -------------------------------------------------------
    def image(self, k: int) -> torch.Tensor:
        raise RuntimeError("the mmap store keeps no block images: blocks are copied from the checkpoint mapping")

    def views(self, k: int) -> list[torch.Tensor]:
        """Runtime-layout host tensors of block ``k`` (read-only mapping views where untransformed)."""
        out = []
        for spec, t in zip(self.layouts[k].tensors, self.tensors[k]):
            b = self.bindings.get(id(t))
            if b is None:
                host = next(h for h, d in self.plans[k].local if d == spec.offset)
                out.append(host.view(spec.dtype).view(spec.shape))
            else:
                out.append(host_tensor(self.ckpt, b))
        return out

    @property
    def pinned(self) -> bool:
        """True when every block copies directly from registered checkpoint pages."""
        return self.device.type == "cuda" and all(p.direct for p in self.plans)

    @property
    def pinned_bytes(self) -> int:
        return self._reg.bytes

    @property
    def direct_blocks(self) -> list[int]:
        return [p.k for p in self.plans if p.direct]

    @property
    def staged_blocks(self) -> list[int]:
        return [p.k for p in self.plans if not p.direct]

    def unregister(self) -> None:
        """Unregister the checkpoint pages. Callers make sure no copy still reads them."""
        self._finalizer()
        self.chunk_bounds.clear()
        for p in self.plans:
            p.direct = False

    def close(self) -> None:
        """Unregister the checkpoint pages and drop the mappings."""
        self.unregister()
        self.ckpt.close()

    def __repr__(self) -> str:
        return (
            f"MmapStore({len(self.layouts)} blocks, {self.nbytes / 1e9:.3f} GB from {len(self.ckpt.files)} file(s), "
            f"{len(self.direct_blocks)} direct, {len(self.staged_blocks)} staged, "
            f"registered {self.pinned_bytes / 1e9:.3f} GB)"
        )


# ----------------------------------------------------------------------------
# executor
# ----------------------------------------------------------------------------


class MmapExecutor(LayerwiseExecutor):
    """LayerwiseExecutor whose copies come from the checkpoint mapping (direct) or the stager."""

    def __init__(self, blocks, store: MmapStore, schedule: Schedule, device, *, record_events: bool = False,
                 staging_threads: int | None = None, streams=None):
        super().__init__(blocks, store, schedule, device, record_events=record_events, prime="first_forward",
                         streams=streams)
        plans = store.plans
        wire = max((p.wire_nbytes for p in plans if p.direct), default=0)
        self.wire = [torch.empty(wire, dtype=torch.uint8, device=self.device) for _ in self.slots] if wire else []
        for p in plans:
            if p.direct and p.table is not None:
                p.table.upload(self.device)
        use_kernel = self.cuda or os.environ.get("TRITON_INTERPRET") == "1"
        self._materialise = materialise if use_kernel else materialise_torch
        # _copies[k][s]: (destination view, source view) pairs of direct block k into slot s
        self._copies: list[list[list[tuple[torch.Tensor, torch.Tensor]]] | None] = []
        for p in plans:
            if not p.direct:
                self._copies.append(None)
                continue
            per_slot = []
            runs = [piece for r in p.runs for piece in store.split(r)]
            wire_runs = [piece for r in p.wire_runs for piece in store.split(r)]
            for s, slot in enumerate(self.slots):
                pairs = [(slot[r.dst : r.dst + r.nbytes], self._src(r)) for r in runs]
                pairs += [(self.wire[s][r.dst : r.dst + r.nbytes], self._src(r)) for r in wire_runs]
                pairs += [(slot[d : d + h.numel()], self._local(h)) for h, d in p.local]
                per_slot.append(pairs)
            self._copies.append(per_slot)
        self.stager: Stager | None = None
        staged = set(store.staged_blocks)
        if staged:
            n = schedule.n
            nbytes = max(store.layouts[k].nbytes for k in staged)

            def positions(start: int) -> Iterator[int]:
                p = start
                while True:
                    if (p % n) in staged:
                        yield p
                    p += 1

            self.stager = Stager(store.pack, positions, lambda p: p % n, nbytes, self.device, pin=self.cuda,
                                 threads=staging_threads)
            weakref.finalize(self, self.stager.stop)
        self._prime()

    def _src(self, r: Run) -> torch.Tensor:
        return self.store.ckpt.files[r.file].u8[r.src : r.src + r.nbytes]

    def _local(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory() if self.cuda else host

    def _copy(self, load: Load) -> None:
        """Direct blocks: copies straight from the mapping (plus one materialise
        launch for kernel transforms). Staged blocks: wait for the packer thread's
        buffer (this thread copies nothing on the host), H2D it, hand it back."""
        k = load.block - self.schedule.resident
        plan = self.store.plans[k]
        if plan.direct:
            self._copy_direct(k, load.slot, plan)
            return
        try:
            b = self.stager.acquire(load.position)
        except StagingError as e:  # a file changed under the packer: the named error, not a packing failure
            if isinstance(e.__cause__, CheckpointChangedError):
                raise CheckpointChangedError(str(e.__cause__)) from e
            raise
        n = self.store.layouts[k].nbytes
        src = self.stager.buffers[b].tensor
        slot = self.slots[load.slot]
        copy_from_image(slot[:n], src)  # one registration per copy
        if self.cuda:
            self.stager.h2d_done[b].record(self.streams.current_stream(self.device))
        self.stager.release(b, load.position)

    def uncapturable_copies(self) -> str | None:
        """Why a CUDA graph cannot hold this source's copies (None: it can). torch
        refuses, inside a capture, copies from host memory it does not count as
        pinned, and file pages registered with cudaHostRegister do not count (seen
        on the H200 with torch 2.11: ``is_pinned()`` False for every direct source)."""
        for per_slot in self._copies:
            for pairs in per_slot:
                for _, src in pairs:
                    if not src.is_pinned():
                        return ("cuda_graphs='on' cannot capture the mmap source's direct copies: torch refuses "
                                "copies from the registered checkpoint pages inside a CUDA graph (they do not count "
                                "as pinned); use cuda_graphs='off' with this source, or load the weights into memory "
                                "and use OffloadedTransformer (pinned host store) for CUDA graphs")
                    return None  # one source tells: every direct copy reads the same registered mapping
        return None

    def _copy_direct(self, k: int, s: int, plan: BlockPlan) -> None:
        for dst, src in self._copies[k][s]:
            dst.copy_(src, non_blocking=self.cuda)
        if plan.table is not None:
            self._materialise(self.wire[s], self.slots[s], plan.table)

    # -- checkpoint checks (a few fstat calls per step, never per block) -------
    def check_usable(self) -> None:
        """Raise CheckpointChangedError if a mapped file changed (the graph runner
        calls this before every step, replays included)."""
        self.store.ckpt.check_unchanged()

    def _start_step(self) -> None:
        self.store.ckpt.check_unchanged()  # once per step, however the step was entered or skipped into
        super()._start_step()

    def reload_pending(self) -> None:
        """Re-copy the slots of the upcoming positions from the mapping (direct
        blocks) or through the stager, which restarts at those positions (staged
        blocks): after an interrupted step or a failed capture the slots hold
        other blocks' bytes."""
        self.store.ckpt.check_unchanged()
        super().reload_pending()

    def remove(self) -> None:
        super().remove()
        if self.stager is not None:
            self.stager.stop()
        self._copies = []
        self.wire = []

    def stats(self) -> dict:
        out = {"copies_per_step": sum(len(pairs[0]) for pairs in self._copies if pairs),
               "materialise_launches_per_step": sum(1 for p in self.store.plans if p.direct and p.table is not None),
               "wire_bytes": sum(w.numel() for w in self.wire)}
        if self.stager is not None:
            out.update(self.stager.stats())
        else:
            out.update({"staging_buffers": 0, "staging_bytes": 0})
        return out


# ----------------------------------------------------------------------------
# StreamedBlocks and the wrapper
# ----------------------------------------------------------------------------


class MmapStreamedBlocks(StreamedBlocks):
    """StreamedBlocks whose streamed tensors stay in the checkpoint mapping."""

    def __init__(self, module: nn.Module, config: OffloadConfig, device: torch.device, plan: OffloadPlan | None,
                 ckpt: Checkpoint, copy_path: str = "auto", staging_threads: int | None = None):
        t0 = time.perf_counter()
        self.ckpt, self.copy_path = ckpt, copy_path
        self.staging_threads = check_threads(staging_threads)
        blocks = discover_blocks(module, plan)
        if config.resident_layers >= len(blocks):  # same message as StreamedBlocks, before any loading
            raise ValueError(
                f"layer_options.dit.resident_layers={config.resident_layers} leaves no block to stream: "
                f"{type(module).__name__} has {len(blocks)} blocks; allowed: 0..{len(blocks) - 1}"
            )
        sched = Schedule(len(blocks), config.resident_layers, config.num_slots)
        streamed_ids = {id(t) for i in sched.streamed for _, _, t in block_tensors(blocks[i].module)}
        self.bindings = bind_checkpoint(module, ckpt)
        self.bind_s = time.perf_counter() - t0
        # streamed tensors: meta, checkpoint dtype, runtime shape (the layouts read these);
        # everything else: loaded to the device now, from the mapping
        t1 = time.perf_counter()
        with torch.no_grad():
            for name, t in _named_tensors(module):
                b = self.bindings.get(id(t))
                if b is None:
                    continue
                if id(t) in streamed_ids:
                    _give_data(t, torch.empty(b.shape, dtype=b.dtype, device="meta"))
                else:
                    _give_data(t, host_tensor(ckpt, b).to(device, copy=True))
        self.resident_load_s = time.perf_counter() - t1
        self.store = None
        try:
            super().__init__(module, config, device, plan)
        except BaseException:
            if self.store is not None:
                self.store.close()
            raise
        left = [n for n, t in _named_tensors(module) if t.device.type == "meta"]
        if left:  # pragma: no cover - bind_checkpoint guarantees this
            self.close()
            raise ValueError(f"tensors left on the meta device after setup: {_listing(left)}")
        try:
            ckpt.check_unchanged()  # resident weights were read from the mapping during setup
        except CheckpointChangedError:
            self.close()
            raise
        self.setup_s = ckpt.open_s + (time.perf_counter() - t0)

    @property
    def host_views(self) -> dict[int, torch.Tensor]:
        """id(tensor) -> host view (state_dict, update_weights); checks the files first."""
        self.ckpt.check_unchanged()
        return self._views

    @host_views.setter
    def host_views(self, views) -> None:
        self._views = views

    def _build_store(self, layouts, tensors) -> MmapStore:
        objs = [[t for _, _, t in ts] for ts in tensors]
        self.store = MmapStore(self.ckpt, self.bindings, layouts, objs, self.device, self.config, self.copy_path)
        self.layouts = self.store.layouts
        return self.store

    def _host_views(self) -> dict[int, torch.Tensor]:
        eager, lazy = {}, {}
        for k, ts in enumerate(self.tensors):
            specs = self.store.layouts[k].tensors
            for (_, _, t), spec in zip(ts, specs):
                b = self.bindings.get(id(t))
                if b is None:
                    host = next(h for h, d in self.store.plans[k].local if d == spec.offset)
                    eager[id(t)] = host.view(spec.dtype).view(spec.shape)
                elif b.transform is None and b.kernel is None:
                    eager[id(t)] = self.ckpt.tensor(b.src)
                else:
                    lazy[id(t)] = (lambda b=b: host_tensor(self.ckpt, b))
        return _HostViews(eager, lazy)

    def _build_executor(self) -> MmapExecutor:
        with torch.no_grad():  # streamed tensors leave meta: the executor binds placeholders and slot views
            for ts in self.tensors:
                for _, _, t in ts:
                    if t.device.type == "meta":
                        _give_data(t, torch.empty(0, dtype=t.dtype, device=self.device))
        return MmapExecutor(self.blocks, self.store, self.schedule, self.device,
                            record_events=self.config.record_events, staging_threads=self.staging_threads,
                            streams=self.streams)

    def restore(self) -> nn.Module:
        """Give every streamed tensor a private device copy of its weights; tear down.

        Raises CheckpointChangedError before anything is torn down if a file
        changed, and after the copies if one changed while they ran."""
        self.ckpt.check_unchanged()
        self.executor.remove()
        self.store.unregister()  # copies below come from pageable pages: no registration to span
        with torch.no_grad():
            for k, ts in enumerate(self.tensors):
                for (_, _, t), hv in zip(ts, self.store.views(k)):
                    t.data = hv.to(self.device, copy=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.ckpt.check_unchanged()
        self.store.close()
        self._views.clear()
        return self.module

    def update_weights(self, state_dict, *, strict: bool = False) -> list[str]:
        current = self.module.state_dict(keep_vars=True)
        streamed = [k for k in state_dict if k in current and id(current[k]) in self.host_views]
        if streamed:
            raise ValueError(
                f"update_weights: {_listing(streamed)} stream from the read-only checkpoint mapping, which is "
                "immutable; load the new weights through an in-memory OffloadedTransformer instead"
            )
        return super().update_weights(state_dict, strict=strict)

    def stats(self) -> dict:
        s = super().stats()
        st = self.store
        s.update({
            "source": "mmap",
            "checkpoint_files": len(self.ckpt.files),
            "checkpoint_bytes": self.ckpt.nbytes,
            "direct_blocks": len(st.direct_blocks),
            "staged_blocks": len(st.staged_blocks),
            "staged_because": sorted({p.staged_because for p in st.plans if not p.direct and p.staged_because}),
            "registered_bytes": st.pinned_bytes,
            "registration_chunks": st.register_chunks,
            "register_flags": st.register_flags,
            "open_s": self.ckpt.open_s,
            "bind_s": self.bind_s,
            "resident_load_s": self.resident_load_s,
            "store_s": st.setup_s,
        })
        s.update(self.executor.stats())
        return s

    def close(self) -> None:
        """Tear down without restoring weights (the model stays on placeholders)."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.remove()
        self.store.close()


class _HostViews(dict):
    """id(tensor) -> runtime host tensor; transformed ones are computed when read (no private copy kept)."""

    def __init__(self, eager: dict, lazy: dict):
        super().__init__(eager)
        self._lazy = lazy

    def get(self, key, default=None):
        if key in self._lazy:
            return self._lazy[key]()
        return super().get(key, default)

    def __getitem__(self, key):
        if key in self._lazy:
            return self._lazy[key]()
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        return key in self._lazy or super().__contains__(key)

    def clear(self) -> None:
        self._lazy.clear()
        super().clear()


def offload_from_safetensors(
    model_on_meta: nn.Module,
    source=None,
    config=None,
    *,
    device=None,
    plan: OffloadPlan | None = None,
    copy_path: str = "auto",
    staging_threads: int | None = None,
) -> OffloadedTransformer:
    """Stream ``model_on_meta``'s blocks straight from safetensors files.

    model_on_meta: the DiT with its parameters on ``meta`` (see :func:`on_meta`,
    :func:`meta_from_pretrained`); it is bound in place and wrapped.
    source: a folder (diffusers layout), a .safetensors file, an index.json,
    a :class:`WeightsSource`, a dict with keys path/prefix/subfolder, or a list
    of these; None: the model's ``weights_sources``.
    config: as for :class:`OffloadedTransformer` (layer mode, rank-local).
    copy_path: "auto" (direct DMA from registered pages on CUDA, staging on
    CPU or where registration is not possible), "direct" (also on CPU:
    synchronous copies straight from the mapping, for tests), or "staging".
    staging_threads: threads that pack staged blocks (int >= 1; None: the
    CPUs available less two, at most 16). 1 packs on the packer thread alone
    (torch's multi-threaded copy).
    """
    if not isinstance(model_on_meta, nn.Module):
        raise TypeError(f"model_on_meta must be a torch.nn.Module, got {type(model_on_meta).__name__}")
    if copy_path not in COPY_PATHS:
        raise ValueError(f"copy_path={copy_path!r} is not allowed; choose from: {', '.join(COPY_PATHS)}")
    check_threads(staging_threads)
    cfg = OffloadConfig.coerce(config)
    if cfg.mode != "layer":
        raise ValueError(f"mode={cfg.mode!r} is not allowed for the mmap source; choose from: layer")
    from .sources.coded import check_codec_supported  # (one line: the mmap source is being ported)

    check_codec_supported(cfg, "the mmap source (offload_from_safetensors)")
    if "dit" not in cfg.components:
        raise ValueError(f"components={list(cfg.components)!r} does not select 'dit'; the mmap source streams a DiT")
    if cfg.weight_transfer == "allgather":
        raise ValueError(
            "layer_options.dit.weight_transfer='allgather' is not allowed for the mmap source; choose from: "
            "rank-local (every process maps the same checkpoint and shares its page cache)"
        )
    dev = resolve_device(device)
    check_opt_in(model_on_meta)
    ckpt = Checkpoint(as_sources(source, model_on_meta))
    try:
        streamed = MmapStreamedBlocks(model_on_meta, cfg, dev, plan, ckpt, copy_path, staging_threads)
    except BaseException:
        ckpt.close()
        raise
    return OffloadedTransformer(model_on_meta, cfg, device=dev, streamed=streamed)


