"""CodedSource: streamed block images stored losslessly coded, decoded on the copy side.

``weight_codec="exp-k"`` (:mod:`weightstream.kernels.codec`): every 16-bit
float tensor of a block keeps its sign/mantissa byte raw and codes its
exponent byte as a k-bit table code with escapes (about 0.70 of the bytes on
bf16 weights); every other tensor is stored raw (k = 8: its bytes as they
are) in the same coded image, so one decode launch writes the whole block.
``weight_codec="exp-k2"``: the same with the escapes coded again at a second
level (``encode(..., levels=2)``, about 0.69 of the bytes on Student-t bf16
weights); a tensor where two levels gain nothing keeps the one-level bytes.
``weight_codec="exp-kp"``: one level, the escapes a per-tile patch list
(``encode(..., levels=PATCHED)``, format version 3: about 0.74 of the bytes,
the fastest decode). Every table compiles its codec's kernel paths
(``coded_encode.decode_paths``), so a re-encode under captured graphs decodes.

Host side. One anonymous arena holds, per block, a region as large as the
block's worst case (every tensor at k = 8); only the coded prefix is ever
written, so only it takes memory. A block is encoded on worker threads, its
coded bytes written to its region, its original tensors dropped (the region
is now the one host copy) and its region registered with CUDA (page-locked),
block by block, within ``pinned_memory_budget_gb``. A failure part-way gives
the dropped tensors their weights back (decoded) before it raises.

Per load (the executor's copy stream is current): one H2D copy of the
block's coded bytes into the slot's coded buffer on that stream, then one
Triton decode launch from it into the slot on the source's decode stream
(``decode_stream=True``, the default: the next block's H2D overlaps this
decode; events order the decode after its copy and the next copy into the
same coded buffer after the decode that read it; only the decode waits for
the slot's release, so copies run ahead of compute by a ring turn), or on the
copy stream itself (``decode_stream=False``: copy and decode serialised). With CUDA graphs the
decode is issued at use instead (``decode_at="use"``, :func:`decode_placement`): the executor
calls :meth:`CodedSource.before_use` just before the block computes, and the decode runs on the
compute stream, after the next block's copy was issued. The decode tables go to
the device at ``attach`` and never move: a re-encoded block (``write``,
edited host views) updates its table in place, so captured CUDA graphs keep
reading the current weights. Each block copies a fixed byte count (its coded
size at build plus a small slack, ``copy_bytes``): a re-encode that grows past
it still works eagerly, but makes graphs captured before it unusable (named
error at the next step: disable() and wrap again).

Host views (``state_dict()``) are decoded host copies, made on first use.
Their version counters are checked at every step start (``check``): a copy
edited in place through torch is re-encoded and ``host_version()`` moves, so
the executor re-copies the slots already loaded and the edit reaches the very
next forward, as with the pinned store. Writes that bypass torch's version counter (numpy,
ctypes, ``.data`` of a view) are not seen. A decoded copy whose views are all
gone is dropped at the next check.
"""
from __future__ import annotations

import contextlib
import dataclasses
import mmap
import time
import warnings
import weakref
from collections.abc import Mapping, MutableMapping

import torch

from ...kernels._buffers import canonical_device
from ...kernels.codec import decode_any
from ...kernels.codec_format import DecodeTable
from weightstream.offload.host.registration import HOST_REGISTER_READ_ONLY, BlockRegistration, release_all
from weightstream.offload.host.arena import PAGE, copy_from_image
from weightstream.offload.host.packing import malloc_trim
from ..layout import BlockLayout, align_up
from weightstream.offload.placeholders import drop_storage
from ..progress import Progress
from .base import SourceCaps, WeightSource
from weightstream.offload.host.recode import AutoCoding
from weightstream.offload.codecs import AUTO, CODECS, CodedCaptureStaleError, codec_levels, module_codec
from weightstream.offload.host.encode import _ALIGN, _capacity, _slack, _write, encode_into, encode_tensors_into, encode_workers, encoded_in_order, in_order

__all__ = ["CodedSource", "CodedCaptureStaleError", "CodedRegion", "coded_source", "check_codec_supported", "CODECS",
           "codec_levels", "decode_placement", "module_codec", "AUTO"]

ENCODE_ON = ("cpu", "device")  # where CodedSource codes its blocks
DECODE_AT = ("load", "use")  # when CodedSource issues a block's decode (see CodedSource.__init__)
_NEVER = object()  # capture tag of an event never recorded


def check_codec_supported(config, where: str) -> None:
    """ValueError naming ``weight_codec`` when ``where`` (a source that cannot code) is asked to."""
    codec = getattr(config, "weight_codec", "none")
    if codec != "none":
        raise ValueError(
            f"weight_codec={codec!r} is not allowed with {where}: coded weights are not supported "
            "there yet (only the pinned host source of layer mode decodes them); choose from: none")


def coded_source(req, *, encode_on: str = "cpu") -> "CodedSource":
    """The factory :class:`~weightstream.offload.streamed.StreamedBlocks` calls for ``weight_codec != 'none'``
    (``encode_on``: see :class:`CodedSource`)."""
    cfg = req.config
    if req.codec != AUTO:
        codec_levels(req.codec)
    budget = cfg.pinned_memory_budget_gb
    return CodedSource(
        req.layouts, [[t for _, _, t in ts] for ts in req.tensors], device=req.device,
        pin=cfg.pin_memory, budget_bytes=None if budget is None else int(budget * 1e9), progress=cfg.progress,
        drop=lambda ts: drop_storage(ts, req.device), encode_on=encode_on, codec=req.codec, **decode_placement(cfg),
    )


def decode_placement(cfg) -> dict:
    """Where the coded sources decode, by config (``decode_at`` and ``decode_stream`` of
    :class:`CodedSource`). Eager: at load, on the decode stream. CUDA graphs: at use, on the
    compute stream. Captured at load, each block's decode became the first dependant of its
    copy, and the step graph's copies ran at ~50 GB/s instead of 55 (flux graphs-coded 0.806x
    the uncoded floor); issued at use, after the next block's copy, 0.713x (0.732x on
    the decode stream). Eager, decoding at load stays the faster (flux 0.746-0.753x vs 0.757x
    at use on the decode stream). Outputs are the same bytes either way."""
    if cfg.cuda_graphs == "on":
        return {"decode_at": "use", "decode_stream": False}
    return {"decode_at": "load", "decode_stream": True}


@dataclasses.dataclass(frozen=True)
class CodedRegion:
    """A block's coded bytes already laid out elsewhere (a mapped coded sidecar, read-only):
    ``data`` (its first ``coded`` bytes, then slack; every load copies all of it), ``table``."""

    data: torch.Tensor
    table: DecodeTable
    coded: int


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
    a value put back is served decoded again from the source, never stored."""

    def __init__(self, source: "CodedSource", where: dict[int, tuple[int, int]]):
        self._source, self._all, self._where = source, where, dict(where)

    def __getitem__(self, key: int) -> torch.Tensor:
        k, i = self._where[key]
        return self._source.host_view(k, i)

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


class CodedSource(AutoCoding, WeightSource):
    """Lossless coded block images in pinned host memory; H2D of the coded bytes on the copy
    stream and a Triton decode into the slot on the decode stream (see the module docstring)."""

    name_suffix = ""  # the source's name: "coded-" + its codec + this
    # the coded H2D runs ahead of the slot's release (its own buffer); only the decode into the
    # slot waits for ``after`` (the slot-free event). Measured on flux-12b-1024 it changed nothing
    # (319.6 ms at 3a79e14, 320.4 after, c99ccf1): the copy lane was already busy the whole step
    # (trace at 9aef8fd), its coded copies moving 53 GB/s; kept as the looser correct order

    def __init__(self, layouts: list[BlockLayout], objs: list[list[torch.Tensor]], *, device, pin: bool = True,
                 budget_bytes: int | None = None, progress: bool = False, drop=None, decode_stream: bool = True,
                 encoded=None, encode_on: str = "cpu", codec: str = "exp-k", decode_at: str = "load"):
        """``encode_on``: "cpu" (worker threads) or "device" (a CUDA ``device``: each block is
        copied there and coded with the same integer ops, the coded bytes copied back: the
        same bytes; not measured on the H200 yet, so not the default). ``codec``: one of
        :data:`CODECS` (blocks built and re-encoded with it). ``decode_at``: "load" (the decode
        is issued with the copy) or "use" (the executor issues it just before the block's
        compute, :meth:`before_use`: on the decode stream, or with ``decode_stream=False`` on
        the compute stream; the next block's copy is then issued before this decode).
        ``codec="auto"``: every block is stored raw (its plain image, copied straight into the
        slot, no decode) until :meth:`code_blocks` codes the ones a plan chose."""
        if decode_at not in DECODE_AT:
            raise ValueError(f"decode_at={decode_at!r} is not allowed; choose from: {', '.join(DECODE_AT)}")
        self.decode_at = decode_at
        self.caps = SourceCaps(codes_blocks=True, writes_at_use=decode_at == "use")
        self.levels = None if codec == AUTO else codec_levels(codec)
        self.codec, self.name = codec, f"coded-{codec}{self.name_suffix}"
        self.raw = [codec == AUTO] * len(layouts)  # block k stored as its plain image (weight_codec="auto")
        self._raw_version = [0] * len(layouts)  # writes of a raw block's region (stale background encodes)
        self._coding = None  # a coded_background.BackgroundCoding while code_blocks(background=True) runs
        self._coding_progress = False
        self._retiring: dict = {}  # block -> coded_auto._Retiring giving its raw region back (a swapped-in block)
        if encode_on not in ENCODE_ON:
            raise ValueError(f"encode_on={encode_on!r} is not allowed; choose from: {', '.join(ENCODE_ON)}")
        if encode_on == "device" and canonical_device(device).type != "cuda":
            raise ValueError(f"encode_on='device' needs a CUDA device, got device={device!r}; choose encode_on='cpu'")
        self.encode_on = encode_on
        self.layouts = list(layouts)
        self.device = canonical_device(device)
        self.slot_bytes = max(lay.nbytes for lay in self.layouts)
        self._ids = {id(t): (k, i) for k, ts in enumerate(objs) for i, t in enumerate(ts)}
        self._init_arena()
        self.want_pin = bool(pin) and self.device.type == "cuda" and torch.cuda.is_available()
        self.budget, self.pin_failure = budget_bytes, None
        self._regs = [BlockRegistration() for _ in self.layouts]
        self._finalizer = weakref.finalize(self, release_all, self._regs)
        self.tables: list[DecodeTable | None] = [None] * len(self.layouts)
        self.coded = [0] * len(self.layouts)  # coded bytes of block k
        self.copy_bytes = [0] * len(self.layouts)  # bytes every load of block k copies
        self._decoded: dict[int, _Decoded] = {}
        self._dirty: set[int] = set()
        self._runs: dict[int, tuple] = {}  # runs(): block -> (its table, run_bytes, runs)
        self._streams = self._slots = None
        self._buffers: list[torch.Tensor] = []
        self._dev_tables: list[torch.Tensor | None] = []
        self._copy_stream = None
        self.decode_stream = bool(decode_stream)  # decode on a side stream, overlapping the next H2D
        self._dstream = None
        self._captured = False
        self._stale: str | None = None
        self._host_edits = 0  # re-encodes of edited host copies so far (host_version)
        # block k's coded bytes lie in _backing[k] (a CodedRegion's read-only data) until it is re-encoded
        self._backing: list[torch.Tensor | None] = [None] * len(self.layouts)
        t0 = time.perf_counter()
        self._build(objs, drop or (lambda ts: drop_storage(ts, "cpu")), progress, encoded)
        self.encode_s = time.perf_counter() - t0

    # -- build -------------------------------------------------------------------
    def _init_arena(self) -> None:
        self.offsets, off = [], 0
        self.capacity = [max(_capacity(lay), align_up(lay.nbytes, PAGE)) for lay in self.layouts]
        for cap in self.capacity:
            self.offsets.append(off)
            off += cap
        self._map = mmap.mmap(-1, max(off, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # no MADV_HUGEPAGE (unlike the HostStore): on the H200 it changed neither the coded copies'
        # rate eager (9aef8fd: 322.3 ms vs 320.4) nor with graphs (41d75b8: 338.7 vs 339.4-342.6; a
        # graph-captured copy runs 55.5 GB/s from 4 KB and from huge registered pages alike), and each
        # region's partly written last huge page costs up to 2 MB
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about writable buffers
            self.arena = torch.frombuffer(self._map, dtype=torch.uint8)

    def region(self, k: int) -> torch.Tensor:
        """Block ``k``'s host region (its coded bytes first)."""
        if self._backing[k] is not None:
            return self._backing[k]
        return self.arena[self.offsets[k] : self.offsets[k] + self.capacity[k]]

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
                for k in range(n):  # weight_codec="auto": plain images first (code_blocks codes some later)
                    self._store_raw(k, objs[k])
                    stored(k)
            elif encoded is None and self.encode_on == "device":
                for k in range(n):  # one block at a time on the GPU (H2D, code, D2H into the region)
                    dev = [t.detach().to(self.device) for t in objs[k]]
                    self._commit(k, *encode_into(self.region(k), self.layouts[k], dev, levels=self.levels), grow=True)
                    del dev
                    stored(k)
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

    # -- the executor's side ------------------------------------------------------
    def attach(self, slots: list[torch.Tensor], streams, device: torch.device) -> None:
        """One device buffer per slot for the coded bytes (plus, with ``decode_stream``, the
        decode stream and two events per slot); every decode table on the device now (never
        inside a capture)."""
        self._slots, self._streams, self.device = slots, streams, canonical_device(device)
        self._alloc_buffers()
        self._dev_tables = [t.upload(self.device) if t is not None and t.num_tiles else None for t in self.tables]
        if streams is not None and (self.decode_stream or self.decode_at == "use"):
            if self.decode_stream:
                self._dstream = streams.new_stream(self.device)
            self._copied = [streams.new_event() for _ in slots]  # H2D into coded[s] done
            self._read = [streams.new_event() for _ in slots]  # decode from coded[s] done
            self._read_tag: list = [_NEVER] * len(slots)  # capture context each _read was recorded in
            self._copied_tag: list = [_NEVER] * len(slots)  # capture context each _copied was recorded in
            self._free: list = [None] * len(slots)  # decode_at="use": the slot-free event its load got

    def _buffer_bytes(self) -> int:
        """Bytes of a slot's coded buffer: the largest coded copy (raw blocks copy into the slot)."""
        return max((c for c, raw in zip(self.copy_bytes, self.raw) if not raw), default=0)

    def _alloc_buffers(self) -> None:
        size = self._buffer_bytes()
        self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in self._slots]

    def side_streams(self) -> list:
        return [self._dstream] if self._dstream is not None else []

    def load(self, k: int, slot: int, *, position: int = 0, after=None, tag=None):
        """H2D of block ``k``'s coded bytes into the slot's coded buffer on the current (copy)
        stream, then one decode launch into ``slots[slot]`` on that stream or, with
        ``decode_stream``, on the decode stream (so the next H2D overlaps this decode);
        returns the stream that decoded."""
        if self._dirty:
            self._fold()
        st = self._streams
        if tag is not None:
            self._captured = True
        if self.raw[k]:
            return self._load_raw(k, slot, after, tag)
        if st is None:  # CPU, no streams: decode straight from the host region, synchronously
            self._decode(self.region(k)[: self.copy_bytes[k]], self._slots[slot], k)
            return None
        self._copy_stream = st.current_stream(self.device)
        if self.decode_at == "use":
            return self._copy(k, slot, tag, after)
        return self._issue(k, slot, tag, after)

    def waits_for_free_of(self, k: int) -> bool:
        """Whether load(k) orders its slot write after ``after`` itself: a coded block's H2D runs
        ahead into its own buffer (the decode waits); a raw block's copy writes the slot, so the
        executor waits before it (and its copy record times the copy alone: the link rate
        weight_codec="auto" plans with; measured with the wait inside, Wan's read 9.2 GB/s)."""
        return not self.raw[k]

    def _load_raw(self, k: int, slot: int, after, tag):
        """A raw block (weight_codec="auto", not coded): one H2D of its plain image straight into
        the slot, after the last decode into it (the executor waited for the slot's release, see
        :meth:`waits_for_free_of`); no decode (:meth:`before_use` does nothing for it)."""
        n, dst, src, st = self.layouts[k].nbytes, self._slots[slot], self.region(k), self._streams
        if st is None:
            dst[:n].copy_(src[:n])
            return None
        cs = self._copy_stream = st.current_stream(self.device)
        if self._dstream is not None and self._read_tag[slot] == tag:
            cs.wait_stream(self._dstream)  # a skipped coded block's decode may still write the slot
        copy_from_image(dst[:n], src[:n])  # after the slot's release: the executor waited (waits_for_free_of)
        if self.caps.writes_at_use:  # the executor notes no load-time write for this source: noted here
            st.access("write", slot, self.layouts[k].index)
        return cs

    def _copy(self, k: int, slot: int, tag, after):
        """decode_at="use": the H2D alone, after the last decode that read the coded buffer (or,
        when that decode was recorded in another capture context, after the slot's release)."""
        n, st, cs = self.copy_bytes[k], self._streams, self._copy_stream
        if self._read_tag[slot] == tag:
            cs.wait_event(self._read[slot])
        elif after is not None:
            cs.wait_event(after)
        copy_from_image(self._buffers[slot][:n], self.region(k)[:n])
        st.access("write", ("coded", slot), self.layouts[k].index)
        self._copied[slot].record(cs)
        self._copied_tag[slot], self._free[slot] = tag, after
        return cs

    def before_use(self, k: int, slot: int, stream, tag=None) -> None:
        """decode_at="use": decode block ``k`` from the slot's coded buffer into ``slots[slot]``;
        ``stream`` (the compute stream) has waited for the copy. On the decode stream (ordered
        after the copy and the slot's release; ``stream`` waits for the decode), else on
        ``stream``. Every use decodes (a block run again after an exception decodes again: its
        coded buffer is not reloaded before the block's post-hook)."""
        if self.decode_at != "use" or self._streams is None or self.raw[k]:
            return
        st, ds, key, what = self._streams, self._dstream, ("coded", slot), self.layouts[k].index
        if ds is not None:
            if self._copied_tag[slot] == tag:
                ds.wait_event(self._copied[slot])
                if self._free[slot] is not None:
                    ds.wait_event(self._free[slot])
            else:  # copied in another capture context: ``stream`` is ordered after it (step start)
                ds.wait_stream(stream)
        with st.stream(ds if ds is not None else stream):
            st.access("read_begin", key, what)
            self._decode(self._buffers[slot][: self.copy_bytes[k]], self._slots[slot], k)
            st.access("read_end", key, what)
            st.access("write", slot, what)  # the slot's write (the executor notes none at load)
            self._read[slot].record(ds if ds is not None else stream)
            self._read_tag[slot] = tag
        if ds is not None:
            stream.wait_event(self._read[slot])

    def _issue(self, k: int, slot: int, tag=None, after=None):
        """``after``: the slot-free event (None: the slot is free already); the H2D into the
        coded buffer waits only for the last decode that read that buffer, the decode waits
        for ``after`` too."""
        n, st, cs = self.copy_bytes[k], self._streams, self._copy_stream
        buf, what, key = self._buffers[slot][:n], self.layouts[k].index, ("coded", slot)
        ds = self._dstream
        if ds is not None and self._read_tag[slot] == tag:  # the last decode from coded[slot] read it
            cs.wait_event(self._read[slot])
        elif after is not None:  # no decode stream (it decodes on this stream), or a capture whose
            cs.wait_event(after)  # _read was recorded elsewhere: ordered through the slot's readers
        copy_from_image(buf, self.region(k)[:n])
        st.access("write", key, what)
        if ds is not None:
            self._copied[slot].record(cs)
            ds.wait_event(self._copied[slot])
            if after is not None:
                ds.wait_event(after)  # compute no longer reads the slot the decode writes
        with st.stream(ds if ds is not None else cs):
            st.access("read_begin", key, what)
            self._decode(buf, self._slots[slot], k)
            st.access("read_end", key, what)
            if ds is not None:
                self._read[slot].record(ds)
                self._read_tag[slot] = tag
        return ds if ds is not None else cs

    def _decode(self, src: torch.Tensor, dst: torch.Tensor, k: int) -> None:
        self.decode_table(src, dst, self.tables[k])

    @staticmethod
    def decode_table(src: torch.Tensor, dst: torch.Tensor, table: DecodeTable) -> None:
        """One decode launch of ``table`` (Triton on CUDA, the plain-torch reference on the
        CPU), on the current stream."""
        decode_any(src, dst, table)

    def runs(self, k: int, run_bytes: int) -> list[tuple[int, int, DecodeTable]]:
        """Block ``k``'s coded bytes cut between tensors into runs of about ``run_bytes`` (one
        run when ``run_bytes <= 0``): ``(start, end, table)`` each, in order, ``table`` decoding
        that run's tensors (source offsets from the start of the block's coded bytes, as
        ``tables[k]``), so a copy of run i+1 can overlap the decode of run i. Cached until the
        block is re-encoded."""
        table = self.tables[k]
        hit = self._runs.get(k)
        if hit is not None and hit[0] is table and hit[1] == run_bytes:
            return hit[2]
        groups: list[list] = [[]]
        start = 0
        for seg in sorted(table.segments, key=lambda sg: sg.src_offset):
            if groups[-1] and run_bytes > 0 and seg.src_end - start > run_bytes:
                groups.append([])
                start = seg.src_offset
            groups[-1].append(seg)
        out, at = [], 0
        for group in groups:
            end = max((sg.src_end for sg in group), default=at)
            out.append((at, end, DecodeTable(group, **table.options())))
            at = end
        self._runs[k] = (table, run_bytes, out)
        return out

    def check(self) -> None:
        """Step start / before a replay: refuse stale captures; re-encode decoded host copies
        edited in place (then :meth:`host_version` moves and the executor re-copies the slots
        already loaded)."""
        if self._stale is not None:
            raise CodedCaptureStaleError(self._stale)
        if self._decoded:
            self._sweep()
        if self._coding is not None:
            self._take_coded()

    def slot_bytes_of(self, ks) -> int:
        """Slot bytes for a ring that streams only blocks ``ks`` (auto placement): their largest image."""
        return max((self.layouts[k].nbytes for k in ks), default=self.slot_bytes)

    def link_bytes(self, k: int) -> int:
        """Bytes one load of block ``k`` moves over the host link (the planner's transfer term)."""
        return self.copy_bytes[k]

    def host_version(self) -> int:
        """Moves when a step start re-encoded an edited host copy (the executor then re-copies
        the slots already loaded for upcoming positions)."""
        return self._host_edits

    def reload(self) -> None:
        """Before the executor re-copies pending slots (update_weights): re-encode written blocks."""
        if self._dirty:
            self._fold()

    def uncapturable(self) -> str | None:
        """Why CUDA graphs cannot hold the loads: a copy from pageable memory cannot be captured."""
        if self.device.type == "cuda" and not all(r.bytes for r in self._regs):
            why = self.pin_failure or "pin_memory is off"
            return f"some coded blocks are in pageable host memory ({why})"
        return None

    def remove(self) -> None:
        """Executor teardown: no threads to stop; let go of the slots and the coded buffers."""
        self._slots, self._buffers = [], []

    # -- host views, edits, writes --------------------------------------------------
    def host_views(self) -> Mapping[int, torch.Tensor]:
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
            self._host_edits += 1  # the executor re-copies the slots already loaded (host_version)
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
                self._retable(k)
                d.version = d.image._version
        self._dirty.clear()
        if grown:
            self._grew()

    def _retable(self, k: int) -> None:
        """Block ``k``'s new table into its device tensor, in place (graphs read it at replay)."""
        if not self._dev_tables or self._dev_tables[k] is None:
            return
        dev = self._dev_tables[k]
        dev.copy_(self.tables[k]._host)  # same size: one record per tensor, fixed tile counts
        self.tables[k]._device[self.device] = dev

    def _grew(self) -> None:
        if not self._slots:  # not attached, or the executor was torn down
            return
        if self._buffer_bytes() > self._buffers[0].numel():
            self._alloc_buffers()
        if self._captured:
            self._stale = (
                "a weight update or an edit of a state_dict() tensor made a coded block larger than the bytes "
                "the captured CUDA graphs copy for it; those graphs would read it truncated. disable() the "
                "model and wrap it again (or use cuda_graphs='off')")

    # -- images --------------------------------------------------------------------
    def image(self, k: int) -> torch.Tensor:
        """Block ``k``'s runtime image in a fresh tensor on the device (current stream)."""
        if self._dirty:
            self._fold()
        d = self._decoded.get(k)
        if d is not None:
            return d.image.to(self.device, copy=True)
        return self._decode_to(k, self.device)

    def _decode_host(self, k: int) -> torch.Tensor:
        if self.raw[k]:
            return self.region(k)[: self.layouts[k].nbytes].clone()
        if self.device.type == "cuda" and self.tables[k].num_tiles:
            return self._decode_to(k, self.device).cpu()
        return self._decode_to(k, torch.device("cpu"))

    def _decode_to(self, k: int, device: torch.device) -> torch.Tensor:
        if self.raw[k]:
            return self.region(k)[: self.layouts[k].nbytes].to(device, copy=True)
        out = torch.zeros(self.layouts[k].nbytes, dtype=torch.uint8, device=device)
        n = self.copy_bytes[k]
        src = self.region(k)[:n]
        if device.type == "cuda":
            buf = torch.empty(n, dtype=torch.uint8, device=device)
            copy_from_image(buf, src)
            src = buf
        self._decode(src, out, k)
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
            "source": self.name,
            "host_bytes": sum(align_up(c, PAGE) for c in self.copy_bytes),
            "pinned_bytes": sum(r.bytes for r in self._regs),
            "pinned": self.want_pin and all(r.bytes for r in self._regs),
            "pin_failure": self.pin_failure,
            "h2d_bytes_per_step": sum(self.copy_bytes),
            "slot_bytes": self.slot_bytes,
            "coded_bytes": sum(self.coded),
            "raw_bytes": raw,
            "coded_ratio": sum(self.coded) / raw if raw else 0.0,
            "bits_per_weight": _bits_per_weight(self.tables),
            "encode_s": self.encode_s,
            "coded_blocks": len(self.raw) - sum(self.raw),
            "coding_in_background": None if self._coding is None else sum(self.raw[k] for k in self._coding.ks),
            "coded_buffer_bytes": sum(b.numel() for b in self._buffers),
            "decode": f"at {self.decode_at}, on the " + ("decode" if self.decode_stream else
                                                           "copy" if self.decode_at == "load" else "compute") + " stream",
        }

    def close(self) -> None:
        """Unregister the regions; drop decoded copies and device buffers."""
        if self._coding is not None:
            self._end_job()
        self._settle()
        self._finalizer()
        self._decoded.clear()
        self._runs.clear()
        self._buffers = []
        self._dev_tables = []

    def __repr__(self) -> str:
        s = self.stats()
        return (f"CodedSource({len(self.layouts)} blocks, {s['coded_bytes'] / 1e9:.3f} GB coded of "
                f"{s['raw_bytes'] / 1e9:.3f} GB, pinned {s['pinned_bytes'] / 1e9:.3f} GB)")


def _bits_per_weight(tables) -> float:
    """Coded bits per 16-bit weight over the tensors ``tables`` code (raw k = 8 ones left out)."""
    coded16 = [(s.header.nbytes, s.header.numel) for t in tables if t is not None for s in t._live
               if s.header.k != 8 or s.header.dtype != torch.int16]
    c16, n16 = sum(c for c, _ in coded16), sum(n for _, n in coded16)
    return 8.0 * c16 / n16 if n16 else 0.0
