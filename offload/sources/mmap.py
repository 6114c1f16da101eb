"""The mmap checkpoint source: stream DiT blocks straight from safetensors (or GGUF) files.

The DiT is built on the ``meta`` device; every expected tensor is bound to a
(file, key) of read-only mapped safetensors files (``mmap`` ACCESS_READ), so
no private full-model copy is ever made. Several processes on one node
streaming the same checkpoint share its page cache; only the two staging
buffers (and the device slots) are private.

Per streamed block one of two copy paths is chosen at setup:

direct (CUDA, primary)
    The file ranges the block reads are registered with ``cudaHostRegister``
    (flag cudaHostRegisterReadOnly, else 0; chunks of at most 1 GiB, page
    aligned, under ``pinned_memory_budget_gb``), and :meth:`MmapSource.load`
    copies the block's tensors straight from the mapping into the slot's
    runtime offsets on the copy stream, no host packing. Runtime offsets are
    assigned in file order, so tensors adjacent in the file whose sizes keep
    512-byte alignment merge into one copy. Tensors whose checkpoint layout
    differs from the runtime layout by a declared kernel transform
    (``param.mmap_kernel_transform = ("qkv_reorder", num_heads, num_kv_heads)``)
    are copied into a per-slot wire buffer and written into the slot by ONE
    ``materialise`` launch per block (its segment table uploaded at setup).

staging (fallback)
    Blocks that cannot be copied directly (CPU device, no registration,
    budget exhausted, a Python ``mmap_weight_transform`` callable) are packed
    by a background thread into two host buffers (see :mod:`..host.staging`); the
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
Each file's identity (``st_dev``, ``st_ino``), size, ``st_mtime_ns`` and
``st_ctime_ns`` are recorded when it is opened and checked (``fstat`` of the
open file, a few microseconds per file) at every step start, before the packer
thread reads, before a ring reload, and in the ``state_dict`` / ``disable``
paths; a difference raises :class:`CheckpointChangedError` naming the file. A
write during a step is seen at the next check. A writer that puts the size and
the mtime back (``cp -p`` of a same-size file, ``os.utime``) still moves the
ctime, which no user call can set; so do chmod, touch, a hard link and a rename
of the file itself (errors too: build a new wrapper). The one ctime change
accepted is the file losing its last name (an atomic replace over its path, or
its deletion), which changes no byte (:class:`~..host.checkpoint.FileWatch`).
``state_dict()`` values are views of the mapping: read them before replacing
anything in place.

Resident blocks may be any set (``resident_layers=[1, 3]``); ``'auto'`` is
refused: auto placement writes demoted blocks back into their source, and
this source is read-only (as ``update_weights`` of streamed tensors is).

Entry point: :func:`offload_from_safetensors` (public as
:func:`weightstream.offload_from_safetensors`). Checkpoint parsing and meta binding
live in :mod:`..host.checkpoint` and :mod:`..host.binding`, registration in
:mod:`..host.registration`, copy plans and the registration of checkpoint pages in
:mod:`..host.copy_plans`, the stager in :mod:`..host.staging`.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator

import torch

from weightstream.kernels.materialise import materialise, materialise_torch

from weightstream.offload.placeholders import drop_storage
from weightstream.offload.host.binding import TensorBinding, host_tensor
from weightstream.offload.host.checkpoint import Checkpoint, CheckpointChangedError, _listing
from weightstream.offload.host.arena import copy_from_image
from ..layout import BlockLayout
from ..misuse import StreamedWriteError, WeightUpdateError
from weightstream.offload.host.staging import Stager, StagingError, check_threads
from .base import SourceCaps, WeightSource
from .pinned import CodedSource
from weightstream.offload.host.copy_plans import BlockPlan, CheckpointPages, Run, build_plan, choose_paths, file_keys, file_ordered_layout, pack_block, split_run


class MmapSource(WeightSource):
    """WeightSource over the read-only checkpoint mapping (see the module docstring)."""

    name = "mmap"
    caps = SourceCaps(read_only=True)

    def __init__(self, req, ckpt: Checkpoint, bindings: dict[int, TensorBinding], *, copy_path: str = "auto",
                 staging_threads: int | None = None, timings: dict | None = None):
        t0 = time.perf_counter()
        self.ckpt, self.bindings, self.config = ckpt, bindings, req.config
        self.device = torch.device(req.device)
        self.cuda = self.device.type == "cuda"
        self.staging_threads = check_threads(staging_threads)
        self.tensors = [[t for _, _, t in ts] for ts in req.tensors]
        nfiles = len(ckpt.files)
        self.layouts = [file_ordered_layout(lay, file_keys(ts, bindings, nfiles))
                        for lay, ts in zip(req.layouts, self.tensors)]
        self.plans = [build_plan(k, lay, ts, bindings) for k, (lay, ts) in enumerate(zip(self.layouts, self.tensors))]
        self.slot_bytes = max(lay.nbytes for lay in self.layouts)
        choose_paths(self.plans, cuda=self.cuda, pin_memory=self.config.pin_memory, copy_path=copy_path)
        self.pages = CheckpointPages(ckpt)
        self.pin_failure = self.pages.register([p for p in self.plans if p.direct], self.config) if self.cuda else None
        self.pack_threads: set[str] = set()  # names of the threads that ran pack() (staging)
        self._views = self._host_views()
        with torch.no_grad():  # streamed tensors leave meta: the executor binds placeholders and slot views
            drop_storage([t for ts in self.tensors for t in ts if t.device.type == "meta"], self.device)
        self.slots, self.streams, self.wire, self._copies, self.stager = [], None, [], [], None
        self.timings = dict(timings or {}, store_s=time.perf_counter() - t0)

    # -- executor side ---------------------------------------------------------
    def attach(self, slots: list[torch.Tensor], streams, device) -> None:
        """Wire buffers and materialise tables of direct blocks, their copy pairs per slot, the stager."""
        self.slots, self.streams = slots, streams
        direct = [p for p in self.plans if p.direct]
        wire = max((p.wire_nbytes for p in direct), default=0)
        self.wire = [torch.empty(wire, dtype=torch.uint8, device=self.device) for _ in slots] if wire else []
        for p in direct:
            if p.table is not None:
                p.table.upload(self.device)
        self._materialise = materialise if self.cuda else materialise_torch  # the kernel is tested in tests/kernels
        # _copies[k][s]: (destination view, source view) pairs of direct block k into slot s
        self._copies = [self._pairs(p) if p.direct else None for p in self.plans]
        if self.stager is not None:  # attached again (a rebuilt ring): the old packer goes first
            self.stager.stop()
        self.stager = self._start_stager()

    def _pairs(self, p: BlockPlan) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        files, bounds = self.ckpt.files, self.pages.bounds
        runs = [piece for r in p.runs for piece in split_run(r, bounds)]
        wire_runs = [piece for r in p.wire_runs for piece in split_run(r, bounds)]
        src = lambda r: files[r.file].u8[r.src : r.src + r.nbytes]  # noqa: E731
        local = [(h.pin_memory() if self.cuda else h, d) for h, d in p.local]
        per_slot = []
        for s, slot in enumerate(self.slots):
            pairs = [(slot[r.dst : r.dst + r.nbytes], src(r)) for r in runs]
            pairs += [(self.wire[s][r.dst : r.dst + r.nbytes], src(r)) for r in wire_runs]
            pairs += [(slot[d : d + h.numel()], h) for h, d in local]
            per_slot.append(pairs)
        return per_slot

    def _start_stager(self) -> Stager | None:
        staged = {p.k for p in self.plans if not p.direct}
        if not staged:
            return None
        n = len(self.plans)  # position p loads streamed block p % n

        def positions(start: int) -> Iterator[int]:
            p = start
            while True:
                if p % n in staged:
                    yield p
                p += 1

        nbytes = max(self.layouts[k].nbytes for k in staged)
        stager = Stager(self.pack, positions, lambda p: p % n, nbytes, self.device, pin=self.cuda,
                        threads=self.staging_threads)
        weakref.finalize(self, stager.stop)
        return stager

    def side_streams(self) -> list:
        return []  # every load runs on the executor's copy stream

    def before_use(self, k: int, slot: int, stream, tag=None) -> None:
        """Nothing to do: a load is complete when the stream it returned is."""

    def load(self, k: int, slot: int, *, position: int, after=None, tag=None):
        """Direct blocks: copies straight from the mapping (plus one materialise launch
        for kernel transforms). Staged blocks: wait for the packer thread's buffer
        (this thread copies nothing on the host), H2D it, hand it back."""
        if self.plans[k].direct:
            self._load_direct(k, slot)
        else:
            self._load_staged(k, slot, position)
        return None if self.streams is None else self.streams.current_stream(self.device)

    def _load_direct(self, k: int, s: int) -> None:
        for dst, src in self._copies[k][s]:
            dst.copy_(src, non_blocking=self.cuda)
        table = self.plans[k].table
        if table is not None:
            self._access("write", ("wire", s), k)
            self._access("read_begin", ("wire", s), k)
            self._materialise(self.wire[s], self.slots[s], table)
            self._access("read_end", ("wire", s), k)

    def _load_staged(self, k: int, s: int, position: int) -> None:
        if position % len(self.plans) != k:  # the stager packs block p % n for position p: never another block
            raise RuntimeError(f"mmap source: position {position} loads block {k}, but the stager packs block "
                               f"{position % len(self.plans)} there (a schedule over a subset of the source's blocks)")
        try:
            b = self.stager.acquire(position)
        except StagingError as e:  # a file changed under the packer: the named error, not a packing failure
            if isinstance(e.__cause__, CheckpointChangedError):
                raise CheckpointChangedError(str(e.__cause__)) from e
            raise
        copy_from_image(self.slots[s][: self.layouts[k].nbytes], self.stager.buffers[b].tensor)
        if self.cuda:
            self.stager.h2d_done[b].record(self.streams.current_stream(self.device))
        self.stager.release(b, position)

    def _access(self, kind: str, key, block: int) -> None:
        if self.streams is not None:
            self.streams.access(kind, key, block)

    def pack(self, k: int, buf: torch.Tensor, pool=None) -> None:
        """Write streamed block ``k``'s runtime image into host bytes ``buf`` (stager thread)."""
        self.pack_threads.add(threading.current_thread().name)
        pack_block(self.ckpt, self.plans[k], buf, pool)
        if pool is not None:
            self.pack_threads |= pool.thread_names

    def check(self) -> None:
        """Raise CheckpointChangedError if a mapped file changed, StreamedWriteError if a tensor
        ``state_dict()`` handed out was edited in place (every step start, every replay)."""
        self.ckpt.check_unchanged()
        edited = [f for f in self.ckpt.files if f.handed is not None and f.handed._version]
        if edited:
            for f in edited:
                f.handed = None  # from now on state_dict() hands out the file's bytes again
            self._views.update(self._host_views())
            raise StreamedWriteError(
                f"a tensor state_dict() gave of {', '.join(f.path.name for f in edited)} was edited in place; the "
                "mmap source streams the read-only checkpoint mapping, so the model kept its weights and the edit "
                "was dropped (state_dict() reads the file again). Change weights in an in-memory "
                "OffloadedTransformer, or write a new checkpoint and stream that")

    def reload(self) -> None:
        """Before the ring reloads pending slots: the files are checked; the stager
        restarts at the reloaded positions by itself (``acquire``)."""
        self.ckpt.check_unchanged()

    def uncapturable(self) -> str | None:
        """Why a CUDA graph cannot hold this source's copies (None: it can). torch
        refuses, inside a capture, copies from host memory it does not count as
        pinned, and file pages registered with cudaHostRegister do not count (seen
        on the H200 with torch 2.11: ``is_pinned()`` False for every direct source)."""
        for per_slot in self._copies:
            for pairs in per_slot or ():
                for _, src in pairs:
                    if not src.is_pinned():
                        return ("cuda_graphs='on' cannot capture the mmap source's direct copies: torch refuses "
                                "copies from the registered checkpoint pages inside a CUDA graph (they do not count "
                                "as pinned); use cuda_graphs='off' with this source, or load the weights into memory "
                                "and use OffloadedTransformer (pinned host store) for CUDA graphs")
                    return None  # one source tells: every direct copy reads the same registered mapping
        return None

    def remove(self) -> None:
        """Executor teardown: stop the packer thread, drop the per-slot copy pairs."""
        if self.stager is not None:
            self.stager.stop()
        self._copies, self.wire, self.slots = [], [], []

    # -- host side ---------------------------------------------------------------
    def _host_views(self) -> "_HostViews":
        eager, lazy = {}, {}
        for k, ts in enumerate(self.tensors):
            for t, spec in zip(ts, self.layouts[k].tensors):
                b = self.bindings.get(id(t))
                if b is None:
                    host = next(h for h, d in self.plans[k].local if d == spec.offset)
                    eager[id(t)] = host.view(spec.dtype).view(spec.shape)
                elif b.transform is None and b.kernel is None:
                    eager[id(t)] = self.ckpt.tensor(b.src, handed=True)
                else:
                    lazy[id(t)] = (lambda b=b: host_tensor(self.ckpt, b))
        return _HostViews(eager, lazy, self.check)

    def host_views(self) -> "_HostViews":
        """id(tensor) -> runtime host tensor; every lookup checks the files first."""
        return self._views

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        self.check_write(k, index)

    def check_write(self, k: int, index: int) -> None:
        """Streamed tensors are read-only here (update_weights calls this before any write)."""
        raise WeightUpdateError(
            f"update_weights: {_listing([self._name(k, index)])} stream from the read-only checkpoint mapping, "
            "which is immutable; load the new weights through an in-memory OffloadedTransformer instead")

    def _name(self, k: int, index: int) -> str:
        return f"{self.layouts[k].name}.{self.layouts[k].tensors[index].name}"

    def image(self, k: int) -> torch.Tensor:
        """Block ``k``'s runtime image (offsets of ``layouts[k]``) in a fresh device tensor.
        Checks the files before reading and after the copies (restore)."""
        self.ckpt.check_unchanged()
        img = torch.empty(self.layouts[k].nbytes, dtype=torch.uint8, device=self.device)
        files = self.ckpt.files
        with torch.no_grad():
            for t, spec in zip(self.tensors[k], self.layouts[k].tensors):
                b = self.bindings.get(id(t))
                if b is not None and b.transform is None and b.kernel is None:
                    # byte copies cut where registrations meet (a copy may not span two)
                    for r in split_run(Run(b.src.file, b.src.offset, spec.offset, spec.nbytes), self.pages.bounds):
                        img[r.dst : r.dst + r.nbytes].copy_(files[r.file].u8[r.src : r.src + r.nbytes])
                else:
                    spec.view_of(img).copy_(self._views[id(t)])
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.ckpt.check_unchanged()
        return img

    # -- figures and teardown ------------------------------------------------------
    @property
    def pinned(self) -> bool:
        """True when every block copies directly from registered checkpoint pages."""
        return self.cuda and all(p.direct for p in self.plans)

    @property
    def direct_blocks(self) -> list[int]:
        return [p.k for p in self.plans if p.direct]

    @property
    def staged_blocks(self) -> list[int]:
        return [p.k for p in self.plans if not p.direct]

    def stats(self) -> dict:
        plans = self.plans
        out = {
            "source": self.name,
            "host_bytes": sum(lay.nbytes for lay in self.layouts),
            "pinned_bytes": self.pages.nbytes,
            "pinned": self.pinned,
            "pin_failure": self.pin_failure,
            "h2d_bytes_per_step": sum(p.wire_bytes if p.direct else self.layouts[p.k].nbytes for p in plans),
            "slot_bytes": self.slot_bytes,
            "checkpoint_files": len(self.ckpt.files),
            "checkpoint_bytes": self.ckpt.nbytes,
            "direct_blocks": len(self.direct_blocks),
            "staged_blocks": len(self.staged_blocks),
            "staged_because": sorted({p.staged_because for p in plans if not p.direct and p.staged_because}),
            "registered_bytes": self.pages.nbytes,
            "registration_chunks": self.pages.chunks,
            "register_flags": self.pages.flags,
            "copies_per_step": sum(len(pairs[0]) for pairs in self._copies if pairs),
            "materialise_launches_per_step": sum(1 for p in plans if p.direct and p.table is not None),
            "wire_bytes": sum(w.numel() for w in self.wire),
            **self.timings,
        }
        out.update(self.stager.stats() if self.stager is not None else {"staging_buffers": 0, "staging_bytes": 0})
        return out

    def close(self) -> None:
        """Stop the packer, unregister the checkpoint pages, drop the mappings (idempotent)."""
        self.remove()
        self.pages.release()
        for p in self.plans:
            p.direct = False
        self._views.clear()
        self.ckpt.close()

    def __repr__(self) -> str:
        return (
            f"MmapSource({len(self.layouts)} blocks, {sum(lay.nbytes for lay in self.layouts) / 1e9:.3f} GB from "
            f"{len(self.ckpt.files)} file(s), {len(self.direct_blocks)} direct, {len(self.staged_blocks)} staged, "
            f"registered {self.pages.nbytes / 1e9:.3f} GB)"
        )


class _HostViews(dict):
    """id(tensor) -> runtime host tensor; transformed ones are computed when read
    (no private copy kept). Every lookup first runs ``check`` (the files unchanged)."""

    def __init__(self, eager: dict, lazy: dict, check):
        super().__init__(eager)
        self._lazy, self._check = lazy, check

    def get(self, key, default=None):
        if key not in self:
            return default
        return self[key]

    def __getitem__(self, key):
        self._check()
        if key in self._lazy:
            return self._lazy[key]()
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        return key in self._lazy or super().__contains__(key)

    def clear(self) -> None:
        self._lazy.clear()
        super().clear()


# ----------------------------------------------------------------------------
# the coded mmap source: the pinned copy transport + decode stage over blocks
# encoded from the mapping, or over the regions of a coded sidecar
# ----------------------------------------------------------------------------


class _SidecarTrust:
    """A mapped coded sidecar (:class:`~..host.sidecar._Watched`) and its verifier: a block's mapped
    bytes are trusted once its checksum matched; reads off the hot path ``fstat`` the sidecar
    first. Called by the store as ``trust(images, k)`` (it holds no reference to the source)."""

    def __init__(self, sidecar, verifier):
        self.sidecar, self.verifier = sidecar, verifier

    @staticmethod
    def left(images) -> str:
        """What the user still has when the mapped sidecar changed (for the error message)."""
        private = [lay.name for k, lay in enumerate(images.layouts) if not images.borrowed(k)]
        held = (f"the blocks re-encoded into this process's memory are intact ({', '.join(private)})" if private
                else "no block was re-encoded into this process's memory (update_weights, an edited state_dict() copy)")
        return (f"No weight is read from it any more: {held}; for the others build a new wrapper from the "
                "checkpoint (coded_sidecar='auto' encodes it again and rewrites the sidecar, 'off' encodes without one).")

    def __call__(self, images, k: int) -> None:
        """Before block ``k``'s mapped sidecar bytes are read: the sidecar unchanged (one fstat)
        and the block's checksum matched (waits for its own verification)."""
        if not images.borrowed(k):
            return
        self.sidecar.check(lambda: self.left(images))
        self.verifier.wait(k)


class MmapCodedSource(CodedSource):
    """The coded pinned transport over blocks built from a checkpoint mapping (encoded by
    :func:`~..checkpoint_offload.mmap_coded_source`) or lying in a mapped coded sidecar
    (:mod:`..host.sidecar`); a block's mapped bytes are checked (its checksum) at its first load."""

    name_suffix = "-mmap"  # "coded-<codec>-mmap"

    def __init__(self, layouts: list[BlockLayout], objs, *, sidecar=None, verifier=None, **kw):
        self.sidecar, self.verifier = sidecar, verifier
        self._sidecar_trust = _SidecarTrust(sidecar, verifier) if sidecar is not None else None
        self._trusted = [verifier is None] * len(layouts)  # block k may be loaded without a check
        if verifier is not None:
            weakref.finalize(self, verifier.stop, False)
        self.checkpoint_files, self.sidecar_stats = 0, {}
        super().__init__(layouts, objs, trust=self._sidecar_trust, **kw)

    def load(self, k: int, slot: int, *, position: int = 0, after=None, tag=None):
        if not self._trusted[k]:  # the first load only: one list read on the hot path after it
            self._sidecar_trust(self.images, k)
            self._trusted[k] = True
        return super().load(k, slot, position=position, after=after, tag=tag)

    def check(self) -> None:
        """Step start: the coded checks, and the mapped sidecar unchanged while any block streams
        from it (CheckpointChangedError naming what is left)."""
        super().check()
        images = self.images
        if self.sidecar is not None and any(images.borrowed(k) for k in range(len(self.layouts))):
            self.sidecar.check(lambda: _SidecarTrust.left(images))

    def uncapturable(self) -> str | None:
        why = super().uncapturable()
        if why is None and self.device.type == "cuda":
            for k in range(len(self.layouts)):
                if self.images.borrowed(k) and not self.images.region(k).is_pinned():
                    return ("cuda_graphs='on' cannot capture copies from the mapped coded sidecar: torch does not "
                            "count registered file pages as pinned; use coded_sidecar='off' (or cuda_graphs='off')")
        return why

    def stats(self) -> dict:
        extra = self.verifier.stats() if self.verifier is not None else {}
        return {**super().stats(), **self.sidecar_stats, **extra, "checkpoint_files": self.checkpoint_files}

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.stop()
        super().close()
        self.images.forget_borrowed()
        if self.sidecar is not None:
            self.sidecar.close()
