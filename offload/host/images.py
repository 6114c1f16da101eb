"""BlockImages: the host image store of streamed blocks, raw or losslessly coded per block.

``codec="exp-k"`` (:mod:`weightstream.kernels.codec`): every 16-bit float tensor of a block
keeps its sign/mantissa byte raw and codes its exponent byte as a k-bit table code with
escapes (about 0.70 of the bytes on bf16 weights); every other tensor is stored raw (k = 8:
its bytes as they are) in the same coded image, so one decode launch writes the whole block.
``codec="exp-k2"``: the same with the escapes coded again at a second level
(``encode(..., levels=2)``, about 0.69 of the bytes on Student-t bf16 weights); a tensor where
two levels gain nothing keeps the one-level bytes. ``codec="exp-kp"``: one level, the escapes
a per-tile patch list (``encode(..., levels=PATCHED)``, format version 3: about 0.74 of the
bytes, the fastest decode). Every table compiles its codec's kernel paths
(``encode.decode_paths``), so a re-encode under captured graphs decodes. ``codec="auto"``:
every block is stored raw (its plain image) until :meth:`~.recode.AutoCoding.code_blocks`
codes the ones a plan chose.

One anonymous arena holds, per block, a region as large as the block's worst case (every
tensor at k = 8); only the coded prefix is ever written, so only it takes memory. A block is
encoded on worker threads, its coded bytes written to its region, its original tensors
dropped (the region is now the one host copy) and its region registered with CUDA
(page-locked, :mod:`.registration`), block by block, within the pin budget. A failure part-way
gives the dropped tensors their weights back (decoded) before it raises. A block's coded bytes
may also lie elsewhere (:class:`CodedRegion`: a mapped coded sidecar, read-only) until it is
re-encoded. Each block copies a fixed byte count (its coded size at build plus a small slack,
``copy_bytes``).

Host views (``state_dict()``) are decoded host copies, made on first use. Their version
counters are checked at every step start (:meth:`check`): a copy edited in place through torch
is re-encoded and :attr:`edits` moves, so the executor re-copies the slots already loaded.
Writes that bypass torch's version counter (numpy, ctypes, ``.data`` of a view) are not seen.
A decoded copy whose views are all gone is dropped at the next check.

The store knows no device buffers: what its changes mean on the device (a table changed, coded
copies grew, copies in flight) it tells its :class:`DeviceSide` (the transport over it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
import weakref
from collections.abc import MutableMapping

import torch

from weightstream.kernels._buffers import canonical_device
from weightstream.kernels.codec import decode_any
from weightstream.kernels.codec_format import DecodeTable
from weightstream.offload.codecs import AUTO, CodedCaptureStaleError, codec_levels
from weightstream.offload.host.arena import PAGE, copy_from_image
from weightstream.offload.host.encode import (_ALIGN, _capacity, _slack, _write, encode_into, encode_tensors_into,
                                              encode_workers, encoded_in_order, in_order)
from weightstream.offload.host.encode_device import by_offset, code_on_device, fill_from_tensors, piece_bytes_for, pieces
from weightstream.offload.host.packing import malloc_trim
from weightstream.offload.host.recode import WHOLE_ON_DEVICE, AutoCoding
from weightstream.offload.host.registration import HOST_REGISTER_READ_ONLY, BlockRegistration, map_anonymous, release_all
from weightstream.offload.layout import BlockLayout, align_up
from weightstream.offload.placeholders import drop_storage
from weightstream.offload.progress import Progress

__all__ = ["BlockImages", "CodedRegion", "DeviceSide", "ENCODE_ON"]

ENCODE_ON = ("cpu", "device", "in-place")  # where the store codes its blocks (in-place: on the GPU, see _build)


@dataclasses.dataclass(frozen=True)
class CodedRegion:
    """A block's coded bytes already laid out elsewhere (a mapped coded sidecar, read-only):
    ``data`` (its first ``coded`` bytes, then slack; every load copies all of it), ``table``."""

    data: torch.Tensor
    table: DecodeTable
    coded: int


class DeviceSide:
    """What the store tells the device side over it (a transport with a decode stage); the
    defaults do nothing (no device side attached)."""

    captured = False  # graphs were captured over the loads (code_blocks refuses then)

    def retabled(self, k: int) -> None:
        """Block ``k`` was re-encoded in place: its table has new contents, the same size."""

    def recoded(self, k: int) -> None:
        """Block ``k`` has a new table (it became coded)."""

    def grew(self) -> None:
        """A re-encode made a block's coded copy larger than before."""

    def fit_buffers(self) -> None:
        """Blocks became coded: buffers large enough for their copies."""

    def copies_event(self):
        """An event after every copy issued so far (None: none in flight, or no streams)."""
        return None

    def sync_copies(self) -> None:
        """Wait for the copies issued so far (before a region they may read is rewritten)."""


@dataclasses.dataclass
class _Decoded:
    """A block's decoded host image handed out as views (state_dict), with the version
    counter it had when the coded bytes last matched it."""

    image: torch.Tensor
    version: int
    handed: list = dataclasses.field(default_factory=list)  # weakrefs to views given out


class _HostViews(MutableMapping):
    """id(streamed tensor) -> its decoded host view, decoded on first access. Entries can be
    taken out and put back (auto placement keeps a promoted block's tensors on the device);
    a value put back is served decoded again from the store, never stored."""

    def __init__(self, images: "BlockImages", where: dict[int, tuple[int, int]]):
        self._images, self._all, self._where = images, where, dict(where)

    def __getitem__(self, key: int) -> torch.Tensor:
        k, i = self._where[key]
        return self._images.host_view(k, i)

    def __setitem__(self, key: int, value) -> None:
        if key not in self._all:
            raise KeyError(f"{key} is not a streamed tensor of this coded source")
        self._where[key] = self._all[key]

    def __delitem__(self, key: int) -> None:
        del self._where[key]

    def __contains__(self, key) -> bool:
        return key in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def clear(self) -> None:
        self._where = {}
        self._all = {}


class BlockImages(AutoCoding):
    """Per block, its host image raw or coded (see the module docstring)."""

    def __init__(self, layouts: list[BlockLayout], objs: list[list[torch.Tensor]], *, device, pin: bool = True,
                 budget_bytes: int | None = None, progress: bool = False, drop=None, encoded=None,
                 encode_on: str | None = None, codec: str = "exp-k", trust=None):
        """``encode_on``: "cpu" (worker threads) or "device" (a CUDA ``device``: blocks go up
        through a staging pair and are coded by the Triton encoder, the coded bytes copied back
        into their regions: the same bytes, :mod:`.encode_device`); None: "device" on a CUDA
        device, else "cpu". ``codec``: one of :data:`~weightstream.offload.codecs.CODECS` or "auto".
        ``encoded``: per block ``(blobs, table)`` or a :class:`CodedRegion`, instead of encoding
        ``objs``. ``trust(images, k)``: called before a borrowed region's bytes are decoded here."""
        self.levels = None if codec == AUTO else codec_levels(codec)
        self.codec, self.auto = codec, codec == AUTO
        if encode_on is None:
            encode_on = "device" if canonical_device(device).type == "cuda" else "cpu"
        if encode_on not in ENCODE_ON:
            raise ValueError(f"encode_on={encode_on!r} is not allowed; choose from: {', '.join(ENCODE_ON)}")
        if encode_on != "cpu" and canonical_device(device).type != "cuda":
            raise ValueError(f"encode_on={encode_on!r} needs a CUDA device, got device={device!r}; choose encode_on='cpu'")
        self.encode_on = encode_on
        self.layouts = list(layouts)
        self.device = canonical_device(device)
        self._side = None  # a weakref to the device side (the transport holds the store, not back)
        self.trust = trust
        n = len(self.layouts)
        self.raw = [self.auto] * n  # block k stored as its plain image (codec="auto")
        self._raw_version = [0] * n  # writes of a raw block's region (stale background encodes)
        self._coding = None  # a background.BackgroundCoding while code_blocks(background=True) runs
        self._coding_progress = False
        self._retiring: dict = {}  # block -> recode._Retiring giving its raw region back (a swapped-in block)
        self._ids = {id(t): (k, i) for k, ts in enumerate(objs) for i, t in enumerate(ts)}
        self._init_arena()
        self.want_pin = bool(pin) and self.device.type == "cuda" and torch.cuda.is_available()
        self.budget, self.pin_failure = budget_bytes, None
        self._regs = [BlockRegistration() for _ in self.layouts]
        self._finalizer = weakref.finalize(self, release_all, self._regs)
        self.tables: list[DecodeTable | None] = [None] * n
        self.coded = [0] * n  # coded bytes of block k
        self.copy_bytes = [0] * n  # bytes every load of block k copies
        self._decoded: dict[int, _Decoded] = {}
        self._dirty: set[int] = set()
        self.edits = 0  # re-encodes of edited host copies, blocks coded (the source's host_version)
        # block k's coded bytes lie in _backing[k] (a CodedRegion's read-only data) until it is re-encoded
        self._backing: list[torch.Tensor | None] = [None] * n
        t0 = time.perf_counter()
        self._build(objs, drop or (lambda ts: drop_storage(ts, "cpu")), progress, encoded)
        self.encode_s = time.perf_counter() - t0

    @property
    def side(self) -> DeviceSide:
        """The device side over the store (:meth:`attach_side`), or one that does nothing."""
        side = self._side() if self._side is not None else None
        return side if side is not None else DeviceSide()

    def attach_side(self, side: DeviceSide) -> None:
        self._side = weakref.ref(side)

    # -- build -------------------------------------------------------------------
    def _init_arena(self) -> None:
        self.offsets, off = [], 0
        self.capacity = [max(_capacity(lay), align_up(lay.nbytes, PAGE)) for lay in self.layouts]
        for cap in self.capacity:
            self.offsets.append(off)
            off += cap
        # huge pages (as the HostStore): the copies run as fast from 4 KB pages (55.5 GB/s on the
        # H200, eager and captured), but setup faults every page of the regions and registers
        # them: into fresh 4 KB pages a copy ran 1.3 GB/s and a registration 3.0 GB/s, into huge
        # ones 2.7 and 5.0 GB/s. Each region's partly written last huge page costs up to 2 MB.
        self._map = map_anonymous(max(off, PAGE), f"the coded host images of {len(self.layouts)} blocks", huge=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about writable buffers
            self.arena = torch.frombuffer(self._map, dtype=torch.uint8)

    def region(self, k: int) -> torch.Tensor:
        """Block ``k``'s host region (its coded bytes first)."""
        if self._backing[k] is not None:
            return self._backing[k]
        return self.arena[self.offsets[k] : self.offsets[k] + self.capacity[k]]

    def borrowed(self, k: int) -> bool:
        """Block ``k``'s coded bytes lie in a :class:`CodedRegion` (not yet re-encoded here)."""
        return self._backing[k] is not None

    def forget_borrowed(self) -> None:
        """The borrowed regions are going away (their mapping is closed): none is read any more."""
        self._backing = [None] * len(self._backing)

    def _build(self, objs, drop, progress, encoded=None) -> None:
        """Encode on worker threads (a few blocks ahead); store, drop, pin in block order.
        ``encoded``: per block ``(blobs, table)`` (stored in the arena) or a :class:`CodedRegion`
        (used where it lies) in block order, instead of encoding ``objs``."""
        n = len(self.layouts)
        bar = Progress(f"coding {n} blocks into host memory", sum(lay.nbytes for lay in self.layouts), progress)
        dropped: set[int] = set()
        trim = malloc_trim()

        def dropping(k: int) -> None:
            dropped.add(k)  # first: a drop that raises half way still gets its block given back
            drop(objs[k])  # the region is now the one host copy
            trim()  # tensors below malloc's mmap threshold go back to the OS only when trimmed

        def stored(k: int) -> None:
            if k not in dropped:
                dropping(k)
            self._pin(k)
            bar.update(self.layouts[k].nbytes)

        def work(k: int) -> None:
            """One block on a worker: encoded into its region, committed, its originals dropped
            at once (blocks coded ahead of the in-order pinning then hold coded bytes only: the
            setup peak stays near the model, tests/test_pack_rss.py)."""
            self._commit(k, *encode_into(self.region(k), self.layouts[k], objs[k], levels=self.levels), grow=True)
            dropping(k)

        try:
            if encoded is None and any(self.raw):
                for k in range(n):  # codec="auto": plain images first (code_blocks codes some later)
                    self._store_raw(k, objs[k])
                    stored(k)
            elif encoded is None and self.encode_on == "in-place":
                # raw images packed and pinned as the uncoded store packs them, then coded on the GPU where
                # they lie: DMA up from the registered region, the coded bytes DMA'd back into its start;
                # the raw registration is kept (no second registration, no tail given back)
                self.raw = [True] * n  # first: a failure half way gives the stored blocks back from raw bytes
                for k in range(n):
                    self._store_raw(k, objs[k])
                    stored(k)
                on_gpu = [k for k in range(n) if self.layouts[k].nbytes <= WHOLE_ON_DEVICE]
                self._code_on_device(on_gpu, progress, keep=True)
                for k in (k for k in range(n) if self.raw[k]):  # too large for the staging pair: on the CPU
                    self._apply_coded(k, *self._encode_now(k))
            elif encoded is None and self.encode_on == "device":  # up, coded on the GPU, down into the regions
                def done(k: int, at: int, table) -> None:
                    self._commit(k, at, table, grow=True)
                    stored(k)

                size = piece_bytes_for(self.device)
                code_on_device(self.device, [pieces(k, lay, size) for k, lay in enumerate(self.layouts)], self.levels,
                               fill_from_tensors(lambda k, specs: by_offset(self.layouts[k], objs[k], specs)),
                               lambda k, at, nbytes: (self.region(k)[at : at + nbytes], "pageable"), done,
                               release=True)
            elif encoded is None and n < encode_workers():
                for k in range(n):  # few large blocks (module offload's components): tensors in parallel
                    self._commit(k, *encode_tensors_into(self.region(k), self.layouts[k], objs[k], levels=self.levels),
                                 grow=True)
                    stored(k)
            elif encoded is None:
                with contextlib.closing(in_order(n, work)) as coded:  # closing: running work ends first
                    for k, _ in enumerate(coded):
                        stored(k)
                trim()  # the workers' scratch, freed into their malloc arenas after their last trim
            else:
                for k, item in enumerate(encoded):
                    if isinstance(item, CodedRegion):
                        self._adopt(k, item)  # used where it lies (a mapped sidecar)
                    else:
                        self._store(k, *item, grow=True)
                    stored(k)
        except BaseException:
            self._give_back(objs, sorted(dropped))
            raise
        finally:
            bar.close()

    def _give_back(self, objs, dropped: list[int]) -> None:
        """Nothing lost: dropped tensors get their weights back (decoded) before the error."""
        with torch.no_grad():
            for k in dropped:
                image = self._decode_host(k)
                for t, spec in zip(objs[k], self.layouts[k].tensors):
                    t.data = spec.view_of(image).clone()
        self.close()

    def _store_raw(self, k: int, tensors) -> None:
        """Block ``k``'s plain image (its layout, as the pinned store holds it) into its region."""
        region, lay = self.region(k), self.layouts[k]
        with torch.no_grad():
            for spec, t in zip(lay.tensors, tensors):
                if spec.nbytes:
                    spec.view_of(region).copy_(t.detach())
        self.coded[k], self.tables[k], self.copy_bytes[k] = lay.nbytes, None, lay.nbytes

    def _adopt(self, k: int, item: CodedRegion) -> None:
        if not item.coded <= item.data.numel() <= self.capacity[k]:
            raise ValueError(f"block {self.layouts[k].name!r}: a coded region of {item.data.numel()} bytes "
                             f"({item.coded} coded) does not fit its capacity of {self.capacity[k]} bytes")
        self._backing[k], self.tables[k], self.coded[k] = item.data, item.table, item.coded
        self.copy_bytes[k] = item.data.numel()

    def _store(self, k: int, blobs: list[torch.Tensor], table: DecodeTable, *, grow: bool) -> bool:
        """Write block ``k``'s coded tensors into its region; True when its copy size grew
        (or its copy source moved: a block re-encoded out of a read-only CodedRegion)."""
        moved = self._backing[k] is not None
        if self._retiring:
            self._settle(k)  # its raw region is being given back: written only after
        self._backing[k] = None
        return self._commit(k, _write(self.region(k), blobs), table, grow=grow, moved=moved)

    def _commit(self, k: int, at: int, table: DecodeTable, *, grow: bool, moved: bool = False) -> bool:
        """Block ``k``'s region holds ``at`` coded bytes decoded by ``table``; True when its copy
        size grew (or its source moved)."""
        self.coded[k], self.tables[k] = at, table
        need = min(self.capacity[k], align_up(at + _slack(self.layouts[k]), _ALIGN))
        if not grow and at <= self.copy_bytes[k] and not moved:
            return False
        old, self.copy_bytes[k] = self.copy_bytes[k], need
        return old != 0

    def _pin(self, k: int) -> None:
        """Register block ``k``'s copied bytes, whole or not at all (a copy must not read past its
        registration), unless pinning is off, failed, or over budget."""
        if not self.want_pin:
            return
        self._regs[k].release()  # callers made sure no copy reads the region now
        if self.pin_failure is not None:
            return
        size = align_up(self.copy_bytes[k], PAGE)
        total = sum(r.bytes for r in self._regs)
        if self.budget is not None and total + size > self.budget:
            self.pin_failure = (f"pinned-memory budget of {self.budget / 1e9:.2f} GB reached; coded blocks from "
                                f"{self.layouts[k].name!r} on stay in pageable memory (slower H2D, same results)")
            warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=3)
            return
        flags = (HOST_REGISTER_READ_ONLY, 0) if self._backing[k] is not None else (0,)
        err = self._regs[k].register(self.region(k).data_ptr(), size, flags)
        if err is not None:
            self.pin_failure = f"{err} for block {self.layouts[k].name!r}; its coded bytes stay pageable"
            warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=3)

    @property
    def all_pinned(self) -> bool:
        return all(r.bytes for r in self._regs)

    def buffer_bytes(self) -> int:
        """Bytes of a device buffer for any coded copy: the largest (raw blocks copy into the slot)."""
        return max((c for c, raw in zip(self.copy_bytes, self.raw) if not raw), default=0)

    # -- step start ----------------------------------------------------------------
    def check(self) -> None:
        """Step start / before a replay: re-encode decoded host copies edited in place (then
        :attr:`edits` moves); swap in the blocks a background job coded."""
        if self._decoded:
            self._sweep()
        if self._coding is not None:
            self._take_coded()

    def fold(self) -> None:
        """Re-encode written blocks (before a load or a re-copy reads them)."""
        if self._dirty:
            self._fold()

    # -- host views, edits, writes --------------------------------------------------
    def host_views(self) -> _HostViews:
        return _HostViews(self, dict(self._ids))

    def host_view(self, k: int, i: int) -> torch.Tensor:
        """Tensor ``i`` of block ``k`` in the block's decoded host copy (decoded on first use)."""
        d = self._decoded_block(k)
        view = self.layouts[k].tensors[i].view_of(d.image)
        d.handed.append(weakref.ref(view))
        return view

    def _decoded_block(self, k: int) -> _Decoded:
        d = self._decoded.get(k)
        if d is None:
            image = self._decode_host(k)
            d = self._decoded[k] = _Decoded(image, image._version)
        return d

    def _sweep(self) -> None:
        """Re-encode edited decoded copies; drop those nobody holds a view of any more."""
        edited = [k for k, d in self._decoded.items() if d.image._version != d.version]
        if edited:
            self._dirty.update(edited)
            self._fold()
            self.edits += 1  # the executor re-copies the slots already loaded (host_version)
        for k, d in list(self._decoded.items()):
            d.handed = [r for r in d.handed if r() is not None]
            if not d.handed and k not in self._dirty:
                del self._decoded[k]

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        """Tensor ``index`` of block ``k`` = ``value`` (re-encoded at the next reload/load/check)."""
        d = self._decoded_block(k)
        with torch.no_grad():
            self.layouts[k].tensors[index].view_of(d.image).copy_(value)
        self._dirty.add(k)

    def _fold(self) -> None:
        """Re-encode every dirty block from its decoded copy (not on the hot path)."""
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise CodedCaptureStaleError(
                    "coded weights changed while a CUDA graph was being captured; call the model again")
            torch.cuda.synchronize(self.device)  # in-flight copies may read the regions
        grown = False
        for k in [k for k in self._dirty if self.raw[k]]:  # raw blocks: the edited image as it is
            d = self._decoded[k]
            self.region(k)[: self.layouts[k].nbytes].copy_(d.image)
            self._raw_version[k] += 1
            d.version = d.image._version
            self._dirty.discard(k)
        dirty = sorted(self._dirty)
        images = [[s.view_of(self._decoded[k].image) for s in self.layouts[k].tensors] for k in dirty]
        with contextlib.closing(encoded_in_order([self.layouts[k] for k in dirty], images,
                                                 levels=self.levels)) as coded:
            for k, (blobs, table) in zip(dirty, coded):
                d = self._decoded[k]
                if self._store(k, blobs, table, grow=False):
                    grown = True
                    self._pin(k)
                self.side.retabled(k)
                d.version = d.image._version
        self._dirty.clear()
        if grown:
            self.side.grew()

    # -- images --------------------------------------------------------------------
    def image(self, k: int, device: torch.device) -> torch.Tensor:
        """Block ``k``'s runtime image in a fresh tensor on ``device`` (current stream)."""
        if self._dirty:
            self._fold()
        d = self._decoded.get(k)
        if d is not None:
            return d.image.to(device, copy=True)
        return self.decode_to(k, device)

    def _decode_host(self, k: int) -> torch.Tensor:
        if self.raw[k]:
            return self.region(k)[: self.layouts[k].nbytes].clone()
        if self.device.type == "cuda" and self.tables[k].num_tiles:
            return self.decode_to(k, self.device).cpu()
        return self.decode_to(k, torch.device("cpu"))

    def decode_to(self, k: int, device: torch.device) -> torch.Tensor:
        """Block ``k``'s image decoded into a fresh tensor on ``device`` (off the hot path)."""
        if self.trust is not None and self._backing[k] is not None:
            self.trust(self, k)  # never a decode of unchecked borrowed bytes
        if self.raw[k]:
            return self.region(k)[: self.layouts[k].nbytes].to(device, copy=True)
        out = torch.zeros(self.layouts[k].nbytes, dtype=torch.uint8, device=device)
        n = self.copy_bytes[k]
        src = self.region(k)[:n]
        if device.type == "cuda":
            buf = torch.empty(n, dtype=torch.uint8, device=device)
            copy_from_image(buf, src)
            src = buf
        decode_any(src, out, self.tables[k])
        return out

    # -- figures and teardown ---------------------------------------------------------
    def block_stats(self, k: int) -> dict:
        """Figures of block ``k`` alone: coded / raw / host / pinned bytes and bits per coded weight."""
        raw = self.layouts[k].nbytes
        return {"coded_bytes": self.coded[k], "raw_bytes": raw,
                "coded_ratio": self.coded[k] / raw if raw else 0.0,
                "bits_per_weight": _bits_per_weight([self.tables[k]]),
                "host_bytes": align_up(self.copy_bytes[k], PAGE), "copy_bytes": self.copy_bytes[k],
                "pinned_bytes": self._regs[k].bytes}

    def stats(self) -> dict:
        raw = sum(lay.nbytes for lay in self.layouts)
        return {
            "host_bytes": sum(align_up(c, PAGE) for c in self.copy_bytes),
            "pinned_bytes": sum(r.bytes for r in self._regs),
            "pinned": self.want_pin and self.all_pinned,
            "pin_failure": self.pin_failure,
            "h2d_bytes_per_step": sum(self.copy_bytes),
            "coded_bytes": sum(self.coded),
            "raw_bytes": raw,
            "coded_ratio": sum(self.coded) / raw if raw else 0.0,
            "bits_per_weight": _bits_per_weight(self.tables),
            "encode_s": self.encode_s,
            "coded_blocks": len(self.raw) - sum(self.raw),
            "coding_in_background": None if self._coding is None else sum(self.raw[k] for k in self._coding.ks),
        }

    def close(self) -> None:
        """Unregister the regions; drop decoded copies."""
        if self._coding is not None:
            self._end_job()
        self._settle()
        self._finalizer()
        self._decoded.clear()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"BlockImages({len(self.layouts)} blocks, {s['coded_bytes'] / 1e9:.3f} GB coded of "
                f"{s['raw_bytes'] / 1e9:.3f} GB, pinned {s['pinned_bytes'] / 1e9:.3f} GB)")


def _bits_per_weight(tables) -> float:
    """Coded bits per 16-bit weight over the tensors ``tables`` code (raw k = 8 ones left out)."""
    coded16 = [(s.header.nbytes, s.header.numel) for t in tables if t is not None for s in t._live
               if s.header.k != 8 or s.header.dtype != torch.int16]
    c16, n16 = sum(c for c, _ in coded16), sum(n for _, n in coded16)
    return 8.0 * c16 / n16 if n16 else 0.0
