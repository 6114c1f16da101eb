"""Pinned host images: every streamed block as one contiguous image in a host arena.

The default source. Blocks are packed block by block into a :class:`HostStore`
(registered with CUDA under ``pinned_memory_budget_gb``); a load is one H2D
copy of the image into the slot on the copy stream. ``state_dict()`` values are
views of the arena (zero-copy), and an in-place edit of one is picked up at the
next step start through the arena's version counter (:meth:`host_version`).

Blocks the store could not pin (beyond ``pinned_memory_budget_gb``, or a failed
registration) always stage on CUDA: a :class:`~..host.staging.Stager` packer thread
walks the schedule's positions ahead of the forward pass and copies each such
block's pageable image into one of two pinned bounce buffers (split over
:class:`~..host.staging.CopyPool` threads for large blocks); ``load`` only waits for
the packed buffer, issues the H2D from it, records the stager's ``h2d_done``
event and hands the buffer back. So their copies overlap compute instead of
serialising with it as a pageable ``copy_`` does. No config key turns this off;
``stage=False`` (benchmarks: the pageable path, measured) and ``stage=True``
(tests: every unpinned block, also on the CPU) are constructor arguments. CUDA
graphs cannot hold a staged load (it waits on a host thread): the graph runner
refuses a store that is not all pinned, and :meth:`uncapturable` says why.

Coded images (``codec`` not "none"): :class:`CodedSource` is the same copy over a
:class:`~..host.images.BlockImages` store (each block raw or losslessly coded, pinned block by
block) composed with a :class:`~.decode.DecodeStage`. Per load (the copy stream current): one
H2D of the block's coded bytes into the slot's coded buffer, then one decode launch into the
slot on the stage's decode stream (the next block's H2D overlaps it; only the decode waits for
the slot's release) or on the copy stream; with CUDA graphs the decode is issued at use
(:func:`~.decode.decode_placement`). The decode tables go to the device at ``attach`` and never
move: a re-encoded block (``write``, edited host views) updates its table in place, so captured
graphs keep reading the current weights. Each block copies a fixed byte count (``copy_bytes``):
a re-encode that grows past it still works eagerly, but makes graphs captured before it
unusable (named error at the next step). A raw block (``codec="auto"``, not coded by a plan)
copies its plain image straight into the slot.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..discovery import Block
from weightstream.offload.host.arena import HostStore, copy_from_image
from ..layout import BlockLayout
from ..placeholders import drop_storage
from weightstream.offload.host.packing import pack_blocks
from ..schedule import Schedule
from weightstream.offload.host.staging import Stager, check_threads
from .base import SourceCaps, WeightSource
from .decode import DecodeStage, decode_placement, runs
from ...kernels._buffers import canonical_device
from ...kernels.codec_format import DecodeTable
from weightstream.offload.codecs import AUTO, codec_levels
from weightstream.offload.host.images import BlockImages, DeviceSide
from weightstream.offload.host.recode import SAMPLE_BYTES

# staged blocks of at least this many bytes are packed over the CopyPool's threads
POOL_MIN_BYTES = 8 << 20
STAGE_CHOICES = (None, True, False)


@dataclass
class SourceRequest:
    """What a source factory gets from :class:`StreamedBlocks` (before anything is packed)."""

    config: object  # OffloadConfig
    device: torch.device
    blocks: list[Block]  # the streamed blocks, in discovery order
    tensors: list[list[tuple[str, str, torch.Tensor]]]  # per streamed block: (name, kind, tensor) in layout order
    layouts: list[BlockLayout]  # runtime layouts (build_layout)
    schedule: Schedule
    codec: str = "none"  # the weight codec the builder selected ("none", a codec name, "auto"); sources read this

    def objects(self, k: int) -> list[torch.Tensor]:
        return [t for _, _, t in self.tensors[k]]

    def pin_budget(self) -> int | None:
        gb = self.config.pinned_memory_budget_gb
        return None if gb is None else int(gb * 1e9)

    @property
    def pin(self) -> bool:
        return bool(self.config.pin_memory) and self.device.type == "cuda"


class PinnedSource(WeightSource):
    """Block images in one (pinned) host arena; one H2D copy per load."""

    name = "pinned"
    caps = SourceCaps()
    pool_min_bytes = POOL_MIN_BYTES  # staged images this large pack over the CopyPool's threads

    def __init__(self, req: SourceRequest, *, stage: bool | None = None, staging_threads: int | None = None):
        """``stage``: None (default): on CUDA, every block the store did not pin
        stages through the bounce buffers; True: every unpinned block stages, on
        any device (tests); False: none do (unpinned blocks copy with a pageable
        ``copy_``). ``staging_threads``: packing threads (see :func:`~..host.staging.check_threads`)."""
        if stage not in STAGE_CHOICES:
            raise ValueError(f"stage={stage!r} is not allowed; choose from: None (auto), True, False")
        self.staging_threads = check_threads(staging_threads)
        self.layouts = list(req.layouts)
        self.device = req.device
        self.slot_bytes = max(lay.nbytes for lay in self.layouts)
        self.store = HostStore(self.layouts, pin=req.pin, budget_bytes=req.pin_budget())
        pack_blocks(self.store, [req.objects(k) for k in range(len(self.layouts))],
                    lambda ts: drop_storage(ts, req.device), progress=req.config.progress,
                    what=f"packing {len(self.layouts)} blocks into host memory")
        self._views = {id(t): hv for k in range(len(self.layouts))
                       for t, hv in zip(req.objects(k), self.store.views(k))}
        on = stage if stage is not None else req.device.type == "cuda"
        self.staged = [bool(on) and not self.store.is_pinned(k) for k in range(len(self.layouts))]
        self.num_positions = req.schedule.n  # position p loads streamed block p % n (unless slot_bytes_of says)
        self._ring: list[int] = []  # source index of the block each ring position loads
        self._next_ring: list[int] | None = None
        self.slots: list[torch.Tensor] = []
        self.streams = None
        self.stager: Stager | None = None
        self._packer: _Packer | None = None
        # bounce buffer's data_ptr -> the arena's version when its pack began: a pack older than an
        # in-place host edit is never handed out, whichever executor path re-primes
        self._packed_version: dict[int, int] = {}

    def slot_bytes_of(self, ks) -> int:
        """Bytes of a slot that holds any of blocks ``ks`` (auto placement streams a subset).

        The executor calls this with the blocks its schedule streams, in ring order,
        right before :meth:`attach`: the stager walks that order (position p loads
        ``ks[p % len(ks)]``; every load checks it)."""
        self._next_ring = list(ks)
        return max(self.layouts[k].nbytes for k in ks)

    # -- the executor's side --------------------------------------------------------
    def attach(self, slots, streams, device) -> None:
        self.slots, self.streams = slots, streams
        if self.stager is not None:  # attached again (a rebuilt ring): the old packer goes first
            self.stager.stop()
            self.stager = None
        ring = self._next_ring if self._next_ring is not None else list(range(self.num_positions))
        self._ring, self._next_ring = ring, None
        staged = frozenset(p for p, k in enumerate(ring) if self.staged[k])
        if not staged:
            return
        n = len(ring)
        self._packed_version.clear()
        self._packer = self.packer()
        self.stager = Stager(self._packer, _positions(staged, n), lambda p: ring[p % n],
                             max(self.layouts[ring[p]].nbytes for p in staged), self.device,
                             pin=self.device.type == "cuda", threads=self.staging_threads,
                             new_event=None if streams is None else streams.new_event)
        weakref.finalize(self, self.stager.stop)
        self._buffer_ptrs = [buf.tensor.data_ptr() for buf in self.stager.buffers]

    def packer(self) -> "_Packer":
        """The stager's pack function (runs on its threads)."""
        return _Packer(self.store, self.pool_min_bytes, self._packed_version)

    def load(self, k: int, slot: int, *, position: int, after, tag):
        if self.staged[k]:
            return self._load_staged(k, slot, position)
        src = self.store.image(k)
        copy_from_image(self.slots[slot][: src.numel()], src)  # chunk-safe: one registration per copy
        return None if self.device.type != "cuda" else torch.cuda.current_stream(self.device)

    def _load_staged(self, k: int, slot: int, position: int):
        """Wait for the packer thread's buffer (no host copy on this thread), H2D
        it on the current (copy) stream, record ``h2d_done``, hand it back."""
        st, streams, ring = self.stager, self.streams, self._ring
        if ring[position % len(ring)] != k:  # the packer packs ring[p % n] for position p: never another block
            raise RuntimeError(f"pinned source: position {position} loads block {k}, but the stager packs block "
                               f"{ring[position % len(ring)]} there (the executor did not report its ring order)")
        b = st.acquire(position)
        if self._packed_version.get(self._buffer_ptrs[b]) != self.store.arena._version:  # packed before a host edit
            st.invalidate()
            b = st.acquire(position)
        if streams is not None:
            streams.access("read_begin", ("stage", b), k)
        copy_from_image(self.slots[slot][: self.layouts[k].nbytes], st.buffers[b].tensor)
        cs = None
        if streams is not None:
            cs = streams.current_stream(self.device)
            streams.access("read_end", ("stage", b), k)
            st.h2d_done[b].record(cs)  # the packer waits on it before it rewrites buffer b
        st.release(b, position)
        return cs if self.device.type == "cuda" else None

    def reload(self) -> None:
        """Before pending slots are re-copied (host images changed, a re-prime):
        drop the blocks packed ahead; the stager restarts at the next load."""
        if self.stager is not None:
            self.stager.invalidate()

    def uncapturable(self) -> str | None:
        if self.stager is None:
            return None
        return (f"cuda_graphs='on' cannot capture the {sum(self.staged)} block(s) that stage through pinned bounce "
                "buffers (each load waits for a host packer thread); raise pinned_memory_budget_gb so every block "
                "is pinned, or use cuda_graphs='off'")

    def remove(self) -> None:
        """Executor teardown: stop the packer thread (waits for its pack in progress) and
        let go of the slots (their device memory goes with the executor's)."""
        if self.stager is not None:
            self.stager.stop()
        self.slots = []

    def host_version(self) -> int:
        """Moves when any host view is written in place through torch (one integer read)."""
        return self.store.arena._version

    # -- host side -----------------------------------------------------------------------
    def host_views(self) -> dict[int, torch.Tensor]:
        return self._views

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            self.layouts[k].tensors[index].view_of(self.store.image(k)).copy_(value)

    def image(self, k: int) -> torch.Tensor:
        out = torch.empty(self.layouts[k].nbytes, dtype=torch.uint8, device=self.device)
        copy_from_image(out, self.store.image(k))
        return out

    def stats(self) -> dict:
        s = self.store
        failure = s.pin_failure
        if failure is not None and self.stager is not None:
            failure += (f"; {sum(self.staged)} block(s) stage through two pinned bounce buffers "
                        "(CUDA graphs cannot capture those loads)")
        out = {"source": self.name, "host_bytes": s.nbytes, "pinned_bytes": s.pinned_bytes, "pinned": s.pinned,
               "pin_failure": failure, "h2d_bytes_per_step": sum(lay.nbytes for lay in self.layouts),
               "slot_bytes": self.slot_bytes, "staged_blocks": sum(self.staged)}
        out.update(self.staging_stats())
        return out

    def staging_stats(self) -> dict:
        """The stager's ``staging_*`` figures, plus the bytes it packed and their rate."""
        if self.stager is None:
            return {"staging_buffers": 0, "staging_bytes": 0}
        out = self.stager.stats()
        packed = self._packer.bytes
        out["staging_packed_bytes"] = packed
        out["staging_pack_gbps"] = round(packed / out["staging_pack_s"] / 1e9, 3) if out["staging_pack_s"] else None
        return out

    def close(self) -> None:
        self.remove()  # never release host memory under a running packer
        self.store.close()
        self._views.clear()

    def __repr__(self) -> str:
        staged = f", {sum(self.staged)} staged through {self.stager!r}" if self.stager is not None else ""
        return f"PinnedSource({self.store!r}{staged})"


def pinned_source(req: SourceRequest) -> PinnedSource:
    return PinnedSource(req)


def _positions(staged: frozenset, n: int):
    """The stager's walk: the positions from ``start`` on whose block is staged."""
    def positions(start: int):
        p = start
        while True:
            if p % n in staged:
                yield p
            p += 1
    return positions


class _Packer:
    """Copies block ``k``'s pageable image into a bounce buffer (on the stager's
    threads). Holds the store weakly: a dropped source stops its stager."""

    def __init__(self, store: HostStore, pool_min_bytes: int, versions: dict):
        self._store = weakref.ref(store)
        self.pool_min_bytes = pool_min_bytes
        self.versions = versions  # bounce buffer's data_ptr -> arena version its pack read
        self.bytes = 0

    def __call__(self, k: int, buf: torch.Tensor, pool) -> None:
        store = self._store()
        if store is None:
            raise RuntimeError("weightstream: the host store was released while its stager ran")
        version = store.arena._version
        img = store.image(k)
        n = img.numel()
        if n > buf.numel():
            raise ValueError(f"block {k}: image of {n} bytes does not fit the {buf.numel()}-byte staging buffer")
        if pool is not None and n >= self.pool_min_bytes:
            pool.copy([(buf.data_ptr(), img.data_ptr(), n)])
        else:
            with torch.no_grad():
                buf[:n].copy_(img)
        self.bytes += n
        self.versions[buf.data_ptr()] = version


class CodedSource(WeightSource, DeviceSide):
    """The pinned copy transport over a :class:`~..host.images.BlockImages` store (raw or coded
    per block) with a :class:`~.decode.DecodeStage`: one H2D of a coded block's bytes into the
    slot's coded buffer on the copy stream, decoded into the slot by the stage (at load, on its
    decode stream or the copy stream; or at use); a raw block (weight_codec="auto", not coded)
    copies its plain image straight into the slot. The coded H2D runs ahead of the slot's
    release (its own buffer); only the decode waits for ``after`` (the slot-free event)."""

    name_suffix = ""  # the source's name: "coded-" + its codec + this

    def __init__(self, layouts: list[BlockLayout], objs: list[list[torch.Tensor]], *, device, pin: bool = True,
                 budget_bytes: int | None = None, progress: bool = False, drop=None, decode_stream: bool = True,
                 encoded=None, encode_on: str | None = None, codec: str = "exp-k", decode_at: str = "load", trust=None):
        """The store's arguments (``encode_on``, ``codec``, ``encoded``, ...: :class:`BlockImages`),
        the stage's (``decode_at``, ``decode_stream``: :class:`DecodeStage`)."""
        self.stage = DecodeStage(list(layouts), decode_at=decode_at, decode_stream=decode_stream)
        self.images = BlockImages(layouts, objs, device=device, pin=pin, budget_bytes=budget_bytes, progress=progress,
                                  drop=drop, encoded=encoded, encode_on=encode_on, codec=codec, trust=trust)
        self.images.attach_side(self)
        self.caps = SourceCaps(codes_blocks=True, writes_at_use=decode_at == "use")
        self.layouts = self.images.layouts
        self.device = self.images.device
        self.slot_bytes = max(lay.nbytes for lay in self.layouts)
        self._copy_stream = self._streams = None
        self._runs: dict[int, tuple] = {}  # runs(): block -> (its table, run_bytes, runs)

    # -- the store, as the planners and module offload read it ------------------------------
    name = property(lambda self: (f"coded-auto({self.images.codec})" if self.images.auto and self.images.codec != AUTO
                                  else f"coded-{self.images.codec}") + self.name_suffix)
    raw = property(lambda self: self.images.raw)
    tables = property(lambda self: self.images.tables)
    coded = property(lambda self: self.images.coded)
    copy_bytes = property(lambda self: self.images.copy_bytes)
    capacity = property(lambda self: self.images.capacity)
    codec = property(lambda self: self.images.codec)
    levels = property(lambda self: self.images.levels)
    pin_failure = property(lambda self: self.images.pin_failure)
    coding_active = property(lambda self: self.images.coding_active)
    decode_at = property(lambda self: self.stage.decode_at)
    decode_stream = property(lambda self: self.stage.decode_stream)
    encode_s = property(lambda self: self.images.encode_s)
    arena = property(lambda self: self.images.arena)
    offsets = property(lambda self: self.images.offsets)

    def region(self, k: int) -> torch.Tensor:
        return self.images.region(k)

    def sample(self, k: int, codecs, max_bytes: int | None = SAMPLE_BYTES) -> dict:
        return {c: self.images.sample(k, c, max_bytes) for c in codecs}

    def code_blocks(self, ks, codec: str, *, progress: bool = False, background: bool = False) -> None:
        self.images.code_blocks(ks, codec, progress=progress, background=background)

    def capture_deferred(self) -> str | None:
        return self.images.capture_deferred()

    def block_stats(self, k: int) -> dict:
        return self.images.block_stats(k)

    decode_table = staticmethod(DecodeStage.decode)

    def runs(self, k: int, run_bytes: int) -> list[tuple[int, int, DecodeTable]]:
        """Block ``k``'s coded bytes in runs of about ``run_bytes`` (:func:`.decode.runs`); cached
        until the block is re-encoded."""
        table = self.images.tables[k]
        hit = self._runs.get(k)
        if hit is not None and hit[0] is table and hit[1] == run_bytes:
            return hit[2]
        out = runs(table, run_bytes)
        self._runs[k] = (table, run_bytes, out)
        return out

    # -- what the store tells its device side (DeviceSide) -----------------------------------
    @property
    def captured(self) -> bool:
        return self.stage.captured

    def retabled(self, k: int) -> None:
        self.stage.retable(k, self.images.tables[k])

    def recoded(self, k: int) -> None:
        self.stage.upload(k, self.images.tables[k])

    def grew(self) -> None:
        self.stage.grew(self.images.buffer_bytes(), "a weight update or an edit of a state_dict() tensor")

    def fit_buffers(self) -> None:
        self.stage.fit(self.images.buffer_bytes())

    def copies_event(self):
        if self._copy_stream is None or self.device.type != "cuda":
            return None
        event = self._streams.new_event()
        event.record(self._copy_stream)
        return event

    def sync_copies(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    # -- the executor's side ------------------------------------------------------
    def attach(self, slots: list[torch.Tensor], streams, device: torch.device) -> None:
        """The stage's coded buffers, decode stream and events; every decode table on the device now."""
        self._streams, self.device = streams, canonical_device(device)
        self.stage.attach(slots, streams, self.device, self.images.buffer_bytes(), self.images.tables)

    def side_streams(self) -> list:
        return self.stage.side_streams()

    def load(self, k: int, slot: int, *, position: int = 0, after=None, tag=None):
        """H2D of block ``k``'s coded bytes into the slot's coded buffer on the current (copy)
        stream, decoded by the stage (at load: returns the stream that decoded); a raw block
        copies into the slot."""
        self.images.fold()
        st, images = self._streams, self.images
        self.stage.note_load(tag)
        if images.raw[k]:
            return self._load_raw(k, slot, tag)
        n = images.copy_bytes[k]
        if st is None:  # CPU, no streams: decode straight from the host region, synchronously
            self.stage.decode(images.region(k)[:n], self.stage.slot(slot), images.tables[k])
            return None
        cs = self._copy_stream = st.current_stream(self.device)
        self.stage.before_write(slot, cs, tag, after)
        copy_from_image(self.stage.buffer(slot)[:n], images.region(k)[:n])
        return self.stage.written(k, slot, n, images.tables[k], cs, tag, after)

    def waits_for_free_of(self, k: int) -> bool:
        """Whether load(k) orders its slot write after ``after`` itself: a coded block's H2D runs
        ahead into its own buffer (the decode waits); a raw block's copy writes the slot, so the
        executor waits before it (and its copy record times the copy alone: the link rate
        weight_codec="auto" plans with; measured with the wait inside, Wan's read 9.2 GB/s)."""
        return not self.images.raw[k]

    def _load_raw(self, k: int, slot: int, tag):
        """A raw block (weight_codec="auto", not coded): one H2D of its plain image straight into
        the slot, after the last decode into it (the executor waited for the slot's release, see
        :meth:`waits_for_free_of`); no decode (:meth:`before_use` does nothing for it)."""
        n, dst, src, st = self.layouts[k].nbytes, self.stage.slot(slot), self.images.region(k), self._streams
        if st is None:
            dst[:n].copy_(src[:n])
            return None
        cs = self._copy_stream = st.current_stream(self.device)
        self.stage.before_raw(slot, cs, tag)
        copy_from_image(dst[:n], src[:n])  # after the slot's release: the executor waited (waits_for_free_of)
        self.stage.raw_written(k, slot)
        return cs

    def before_use(self, k: int, slot: int, stream, tag=None) -> None:
        """decode_at="use": the stage decodes block ``k`` into the slot now (raw blocks: nothing)."""
        if self.images.raw[k]:
            return
        self.stage.before_use(k, slot, stream, self.images.copy_bytes[k], self.images.tables[k], tag)

    def captures_dropped(self) -> None:
        self.stage.forget_captures()

    def check_replay(self) -> None:
        self.stage.check()  # a block re-encoded larger than the captured copies: those graphs are stale

    def check(self) -> None:
        """Step start / before a replay: re-encode decoded host copies edited in place (then
        :meth:`host_version` moves and the executor re-copies the slots already loaded); swap in
        blocks coded in the background. Stale captures are refused by :meth:`check_replay`."""
        self.images.check()

    def slot_bytes_of(self, ks) -> int:
        """Slot bytes for a ring that streams only blocks ``ks`` (auto placement): their largest image."""
        return max((self.layouts[k].nbytes for k in ks), default=self.slot_bytes)

    def link_bytes(self, k: int) -> int:
        """Bytes one load of block ``k`` moves over the host link (the planner's transfer term)."""
        return self.images.copy_bytes[k]

    def host_version(self) -> int:
        """Moves when a step start re-encoded an edited host copy or blocks became coded (the
        executor then re-copies the slots already loaded for upcoming positions)."""
        return self.images.edits

    def reload(self) -> None:
        """Before the executor re-copies pending slots (update_weights): re-encode written blocks."""
        self.images.fold()

    def uncapturable(self) -> str | None:
        """Why CUDA graphs cannot hold the loads: a copy from pageable memory cannot be captured."""
        if self.device.type == "cuda" and not self.images.all_pinned:
            why = self.images.pin_failure or "pin_memory is off"
            return f"some coded blocks are in pageable host memory ({why})"
        return None

    def remove(self) -> None:
        """Executor teardown: no threads to stop; let go of the slots and the coded buffers."""
        self.stage.remove()

    # -- host side ------------------------------------------------------------------
    def host_views(self):
        return self.images.host_views()

    def host_view(self, k: int, i: int) -> torch.Tensor:
        return self.images.host_view(k, i)

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        """Tensor ``index`` of block ``k`` = ``value`` (re-encoded at the next reload/load/check)."""
        self.images.write(k, index, value)

    def image(self, k: int) -> torch.Tensor:
        """Block ``k``'s runtime image in a fresh tensor on the device (current stream)."""
        return self.images.image(k, self.device)

    def stats(self) -> dict:
        return {"source": self.name, **self.images.stats(), "slot_bytes": self.slot_bytes, **self.stage.stats()}

    def close(self) -> None:
        """Unregister the regions; drop decoded copies and device buffers."""
        self.images.close()
        self._runs.clear()
        self.stage.close()

    def __repr__(self) -> str:
        s = self.images.stats()
        return (f"CodedSource({len(self.layouts)} blocks, {s['coded_bytes'] / 1e9:.3f} GB coded of "
                f"{s['raw_bytes'] / 1e9:.3f} GB, pinned {s['pinned_bytes'] / 1e9:.3f} GB)")


def coded_source(req: SourceRequest, *, encode_on: str | None = None) -> CodedSource:
    """The factory :class:`~weightstream.offload.streamed.StreamedBlocks` calls for ``req.codec != 'none'``
    (``encode_on``: see :class:`BlockImages`)."""
    cfg = req.config
    if req.codec != AUTO:
        codec_levels(req.codec)
    return CodedSource(
        req.layouts, [[t for _, _, t in ts] for ts in req.tensors], device=req.device,
        pin=cfg.pin_memory, budget_bytes=req.pin_budget(), progress=cfg.progress,
        drop=lambda ts: drop_storage(ts, req.device), encode_on=encode_on, codec=req.codec, **decode_placement(cfg),
    )
