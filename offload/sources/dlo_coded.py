"""DLO AllGather with coded shards: each rank holds 1/N of every block's *coded* image.

``weight_transfer='allgather'`` with ``weight_codec='exp-k'`` (or ``'exp-k2'``). At build every
rank encodes every block with the deterministic encoder of
:mod:`.coded` (the same bytes on every rank), and keeps only its share of the
coded image: ``shard = shard_size(coded + slack, N)`` (512-aligned, the last
share zero-padded; the slack lets a slightly larger re-encode keep its shard
size, so captured graphs stay valid). Per load (the :class:`.dlo.ShardSource`
pipeline, gathering coded bytes):

1. copy stream: H2D of the coded shard into the shard slot;
2. communication stream: ``all_gather`` of the coded shards into the slot's
   coded buffer (``N * shard`` bytes: the coded image, then padding), then one
   Triton decode launch from it into the block slot (the decode tables went to
   the device at ``attach``); the executor records ``loaded`` there. Only the
   decode waits for compute to release the slot: the gather of block p + 2
   runs during block p's compute, the decode during block p + 1's.

Each rank's link moves ``coded / N`` bytes per block, the gather ``coded``.

``weight_codec='auto'`` (:mod:`..auto_codec_gather` plans, the same on every
rank): every block starts as a share of its *raw* image (``raw[k]``), gathered
straight into the block slot with no decode, as :class:`.dlo.ShardSource` does;
:meth:`CodedShardSource.code_blocks` then codes the planned blocks at once (a
gather of each raw image, the deterministic encode, this rank's share of it).

Updates (``update_weights``, a collective as for :class:`ShardSource`: every
rank calls it with the same weights): ``write`` keeps the new values; the
executor's ``reload`` then gathers and decodes each written block (in block
order, the same on every rank), patches it, re-encodes it and stores this
rank's share again (re-sharded when the new coded size passes ``N * shard``;
CUDA graphs captured before then refuse to replay: named error).

``state_dict()``: as :class:`ShardSource` (a rank holds a share: the error
names ``gather_state_dict()``). ``local_state_dict()`` gives, per streamed
tensor, a :class:`CodedPiece` (a :class:`ShardPiece` of the tensor's *coded*
bytes that fall in this rank's share); :func:`..dlo_control.merge_shards` of every
rank's result (any codec; ``merge_coded_shards`` is the same function) joins and
decodes them into the full state dict (no collective).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from ...kernels.codec import decode_any
from ...kernels.codec_format import DecodeTable
from weightstream.offload.dlo.control import CodedPiece, merge_shards
from weightstream.offload.dlo.topology import shard_size
from ..layout import BlockLayout, TensorSpec
from ..progress import Progress
from .base import SourceCaps
from weightstream.offload.codecs import AUTO
from weightstream.offload.codecs import CodedCaptureStaleError, codec_levels
from weightstream.offload.host.recode import SAMPLE_BYTES, checked_blocks, sample_coded
from weightstream.offload.host.encode import _slack, encode_image, encoded_in_order
from .dlo import ShardedHostViews, ShardSource, write_share
from .pinned import SourceRequest
from ..placeholders import drop_storage

__all__ = ["CodedShardSource", "CodedShardStore", "CodedPiece", "merge_coded_shards"]

_NO_DECODE = object()  # a coded buffer's decode tag before its first decode (no capture context matches it)


def decode_into(src: torch.Tensor, dst: torch.Tensor, table: DecodeTable) -> None:
    """One decode launch (Triton on CUDA, the torch reference on the CPU)."""
    decode_any(src, dst, table)


def _joined(blobs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(blobs) if blobs else torch.empty(0, dtype=torch.uint8)


class CodedShardStore:
    """This rank's share of every block's coded image, one host tensor per block (pinned
    within the budget). The same interface as :class:`.dlo.ShardedStore` where the
    executor side reads it (``shard_bytes``, ``max_shard``, ``image``, ``range``)."""

    def __init__(self, layouts: list[BlockLayout], world: int, rank: int, *, pin: bool,
                 budget_bytes: int | None = None):
        self.layouts, self.world, self.rank = list(layouts), world, rank
        self.want_pin = bool(pin) and torch.cuda.is_available()
        self.budget, self.pin_failure = budget_bytes, None
        n = len(self.layouts)
        self.shard_bytes, self.coded = [0] * n, [0] * n
        self.tables: list[DecodeTable | None] = [None] * n
        self._shards: list[torch.Tensor | None] = [None] * n
        self._pinned = [False] * n

    @property
    def max_shard(self) -> int:
        return max(self.shard_bytes)

    def image(self, k: int) -> torch.Tensor:
        return self._shards[k]

    def range(self, k: int) -> tuple[int, int]:
        """Byte range [lo, hi) of block k's coded image held here."""
        lo = self.rank * self.shard_bytes[k]
        return lo, lo + self.shard_bytes[k]

    def set(self, k: int, coded: torch.Tensor, table: DecodeTable, *, fresh: bool = False) -> bool:
        """Store this rank's share of block ``k``'s coded image; True when it was re-sharded
        (a new shard size: the coded image outgrew ``N * shard``). ``fresh``: sized anew from the
        coded bytes (a raw block becoming coded)."""
        old = self.shard_bytes[k]
        resharded = fresh or old == 0 or coded.numel() > self.world * old
        sb = shard_size(coded.numel() + _slack(self.layouts[k]), self.world) if resharded else old
        lo = self.rank * sb
        share = torch.zeros(sb, dtype=torch.uint8)
        part = coded[lo : lo + sb]
        share[: part.numel()] = part
        self._store(k, share, coded.numel(), table)
        return resharded and old != 0

    def set_raw(self, k: int, tensors) -> None:
        """Store this rank's share of block ``k``'s raw image, from its tensors (``weight_codec='auto'``
        before a plan codes the block): gathered, the shares are the image itself."""
        sb = shard_size(self.layouts[k].nbytes, self.world)
        share = torch.zeros(sb, dtype=torch.uint8)  # alignment gaps and the last rank's padding
        with torch.no_grad():
            for spec, t in zip(self.layouts[k].tensors, tensors):
                write_share(share, self.rank * sb, spec, t)
        self._store(k, share, 0, None)

    def _store(self, k: int, share: torch.Tensor, coded: int, table: DecodeTable | None) -> None:
        """Block ``k``'s new share, in fresh host memory where its size changed. Nothing of the
        block's state changes before the bytes are in place (a failed allocation keeps the old share)."""
        sb = share.numel()
        if self._shards[k] is not None and self._shards[k].numel() == sb:
            dst, pinned = self._shards[k], self._pinned[k]
        else:
            dst, pinned = self._alloc(k, sb)
        dst.copy_(share)
        self.shard_bytes[k], self._shards[k], self._pinned[k] = sb, dst, pinned
        self.coded[k], self.tables[k] = coded, table

    def _alloc(self, k: int, n: int) -> tuple[torch.Tensor, bool]:
        """``n`` bytes of host memory for block ``k``'s share, and whether they are pinned."""
        if not self.want_pin or self.pin_failure is not None:
            return torch.empty(n, dtype=torch.uint8), False
        others = sum(sb for j, (sb, p) in enumerate(zip(self.shard_bytes, self._pinned)) if p and j != k)
        if self.budget is not None and others + n > self.budget:
            self.pin_failure = (f"pinned-memory budget of {self.budget / 1e9:.2f} GB reached; coded shards from "
                                f"{self.layouts[k].name!r} on stay in pageable memory (slower H2D, same results)")
            warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=5)
            return torch.empty(n, dtype=torch.uint8), False
        return torch.empty(n, dtype=torch.uint8, pin_memory=True), True

    @property
    def nbytes(self) -> int:
        return sum(self.shard_bytes)

    @property
    def pinned_bytes(self) -> int:
        return sum(sb for sb, p in zip(self.shard_bytes, self._pinned) if p)

    @property
    def pinned(self) -> bool:
        return self.want_pin and all(self._pinned)

    def close(self) -> None:
        self._shards = [None] * len(self._shards)
        self._pinned = [False] * len(self._pinned)

    def __repr__(self) -> str:
        return (f"CodedShardStore(rank {self.rank}/{self.world}, {len(self.layouts)} blocks, "
                f"{self.nbytes / 1e9:.3f} GB coded share, pinned {self.pinned_bytes / 1e9:.3f} GB)")


# one merge for every codec (raw pieces joined, coded ones joined and decoded): the name the coded
# tests and docs used, the same function
merge_coded_shards = merge_shards


class CodedShardSource(ShardSource):
    """DLO AllGather of coded shards, decoded into the slot after the gather (module docstring)."""

    name = "dlo-allgather-coded"
    caps = SourceCaps(collective=True, sharded=True, codes_blocks=True)

    def __init__(self, req: SourceRequest, *, group, world: int, rank: int, gather: str, timeout_s: float,
                 failure=lambda: None):
        self.auto = req.config.weight_codec == AUTO  # every block raw until a plan codes some (code_blocks)
        # blocks built and re-encoded with this codec (auto: the plan's, None until then)
        self.levels = None if self.auto else codec_levels(req.config.weight_codec)
        self.codec = None if self.auto else req.config.weight_codec
        self.raw = [self.auto] * len(req.layouts)  # block k's share is of its raw image (no decode)
        if gather not in ("tensor", "list"):
            raise ValueError(f"gather={gather!r} is not allowed; choose from: tensor, list")
        self.layouts = list(req.layouts)
        self.device, self.group, self.world, self.gather = req.device, group, world, gather
        self.timeout_s, self._failure, self.ncoll = timeout_s, failure, 0
        self.store = CodedShardStore(self.layouts, world, rank, pin=req.pin, budget_bytes=req.pin_budget())
        self._pack(req)
        # a raw block is gathered into the slot itself: its image plus the last share's padding
        self.slot_bytes = max([lay.nbytes for lay in self.layouts] +
                              [world * sb for sb, r in zip(self.store.shard_bytes, self.raw) if r])
        self._ids = {id(t): (k, i) for k in range(len(self.layouts)) for i, t in enumerate(req.objects(k))}
        self._host_views = ShardedHostViews(self._ids, world)
        self.slots, self.shard_slots, self.streams = [], [], None
        self.coded_bufs: list[torch.Tensor] = []
        self._dev_tables: dict[int, torch.Tensor] = {}
        self._patches: dict[int, dict[int, torch.Tensor]] = {}
        self._captured, self._stale = False, None

    def _pack(self, req: SourceRequest) -> None:
        """Encode (worker threads), keep this rank's share; originals are dropped only when
        every share is stored (a failure part-way leaves the model as it was)."""
        n = len(self.layouts)
        what = "packing" if self.auto else "coding"
        bar = Progress(f"{what} {n} blocks, keeping this rank's 1/{self.world} share",
                       sum(lay.nbytes for lay in self.layouts), req.config.progress)
        try:
            objs = [req.objects(k) for k in range(n)]
            if self.auto:  # raw shares; a plan codes blocks later (code_blocks)
                for k, lay in enumerate(self.layouts):
                    self.store.set_raw(k, objs[k])
                    bar.update(lay.nbytes)
            else:
                for k, (blobs, table) in enumerate(encoded_in_order(self.layouts, objs, levels=self.levels)):
                    self.store.set(k, _joined(blobs), table)
                    bar.update(self.layouts[k].nbytes)
        except BaseException:
            self.store.close()
            raise
        finally:
            bar.close()
        for k in range(n):
            drop_storage(req.objects(k), req.device)

    # -- the executor's side --------------------------------------------------------
    def attach(self, slots, streams, device) -> None:
        super().attach(slots, streams, device)
        self.coded_bufs = [torch.empty(self._coded_buf_bytes(), dtype=torch.uint8, device=device) for _ in slots]
        self._decode_tag = [_NO_DECODE] * len(slots)  # capture context of each coded buffer's last decode
        # every table on the device now (never inside a capture); re-encodes update these in place
        self._dev_tables = {k: t.upload(self.device) for k, t in enumerate(self.store.tables)
                            if t is not None and t.num_tiles}
        if device.type == "cuda" and streams is not None:
            for t in self.coded_bufs:
                t.record_stream(self.comm_stream)

    def _coded_buf_bytes(self) -> int:
        """A coded buffer holds a gathered coded image (raw blocks are gathered into the slot)."""
        return max([self.world * sb for sb, r in zip(self.store.shard_bytes, self.raw) if not r], default=0)

    def _gather_out(self, k: int, slot: int) -> torch.Tensor:
        if self.raw[k]:
            return self.slots[slot][: self.world * self.store.shard_bytes[k]]
        return self.coded_bufs[slot][: self.world * self.store.shard_bytes[k]]

    def _gather_waits_free(self, k: int, slot: int, tag) -> bool:
        """A raw block's gather writes the slot: it waits for the slot's release. A coded block's
        gather writes the slot's coded buffer, not the slot, so it runs while compute still
        reads the slot (only the decode waits for the release): the communication stream's order
        puts it after the decode that last read that buffer. A decode issued in another capture
        context (eager vs a graph, or another graph) is not in that order: then the gather waits
        for the slot's release, which follows that decode's block."""
        return self.raw[k] or self._decode_tag[slot] != tag

    def _after_gather(self, k: int, slot: int, after, tag) -> None:
        """The decode of the gathered coded image into the block slot (communication stream),
        once compute no longer reads the slot (``after``); a raw block was gathered into the slot."""
        if self.raw[k]:
            return
        st, key, block = self.streams, ("coded", slot), self.layouts[k].index
        if st is not None:
            st.access("write", key, block)  # the gather just wrote it, on this stream
            if after is not None:
                self.comm_stream.wait_event(after)  # the decode writes the block slot
            st.access("read_begin", key, block)
        decode_into(self.coded_bufs[slot], self.slots[slot], self.store.tables[k])
        if st is not None:
            st.access("read_end", key, block)
            self._decode_tag[slot] = tag

    def load(self, k: int, slot: int, *, position: int, after, tag):
        if tag is not None:
            self._captured = True
        return super().load(k, slot, position=position, after=after, tag=tag)

    # -- weight_codec="auto" (offload/auto_codec.py: GatherAutoCodec plans, every rank alike) -------------
    coding_active = False  # blocks are coded at once, on every rank together (never in the background)

    def sample(self, k: int, codecs, max_bytes: int | None = SAMPLE_BYTES) -> dict:
        """Raw block ``k`` (a collective: its image is gathered) encoded aside with each codec of
        ``codecs``, nothing stored: codec -> :func:`.coded_auto.sample_coded`'s (whole block's
        coded bytes, coded sample, table, bytes it decodes to). The encoder is deterministic, so
        every rank computes the same sizes."""
        if not self.raw[k]:
            raise ValueError(f"block {self.layouts[k].name!r} is coded already; sample() reads raw blocks")
        lay = self.layouts[k]
        image = self.image(k).cpu()[: lay.nbytes]
        return {c: sample_coded(lay, image, codec_levels(c), max_bytes) for c in codecs}

    def coded_shard_bytes(self, k: int, coded: int) -> int:
        """This rank's link bytes for block ``k`` coded in ``coded`` bytes (its share of them, slack included)."""
        return shard_size(coded + _slack(self.layouts[k]), self.world)

    def code_blocks(self, ks, codec: str, *, progress: bool = False, background: bool = False) -> None:
        """weight_codec="auto": code raw blocks ``ks`` with ``codec`` now. A collective, in block
        order, the same on every rank: each block's raw image is gathered, encoded (deterministic:
        the same bytes everywhere), and this rank keeps its share of the coded image, sized anew.
        Between steps only, before any CUDA graph is captured."""
        if background:
            raise ValueError("code_blocks: background=True is not allowed with DLO AllGather: every rank switches "
                             "a block to coded at the same step; allowed: background=False")
        ks, levels = checked_blocks(self, ks, codec, "gathers")
        if not ks:
            return
        self.ready_to_gather("coding blocks (weight_codec='auto')")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # between steps: in-flight copies may read the shares
        self.levels, self.codec = levels, codec
        bar = Progress(f"coding {len(ks)} blocks with {codec}, keeping this rank's 1/{self.world} share",
                       sum(self.layouts[k].nbytes for k in ks), progress)
        try:
            for k in ks:
                lay = self.layouts[k]
                image = self.image(k).cpu()[: lay.nbytes]
                blobs, table = encode_image(lay, [spec.view_of(image) for spec in lay.tensors], levels=levels)
                self.store.set(k, _joined(blobs), table, fresh=True)
                self.raw[k] = False
                if self.slots and table.num_tiles:
                    self._dev_tables[k] = table.upload(self.device)
                bar.update(lay.nbytes)
        finally:
            bar.close()
            self._fit_buffers()

    def check(self) -> None:
        """Step start / before a replay: refuse graphs captured before a re-shard."""
        if self._stale is not None:
            raise CodedCaptureStaleError(self._stale)

    def uncapturable(self) -> str | None:
        if self.device.type == "cuda" and not self.store.pinned:
            return f"some coded shards are in pageable host memory ({self.store.pin_failure or 'pin_memory is off'})"
        return None

    def link_bytes(self, k: int) -> int:
        """Bytes one load of block ``k`` moves over this rank's host link."""
        return self.store.shard_bytes[k]

    # -- host side -----------------------------------------------------------------------
    def image(self, k: int) -> torch.Tensor:
        """Block ``k``'s decoded image in a fresh device tensor (a collective: gather, then decode;
        a raw block's gathered image as it is)."""
        coded = super().image(k)
        if self.raw[k]:
            return coded
        out = torch.zeros(self.layouts[k].nbytes, dtype=torch.uint8, device=self.device)
        decode_into(coded, out, self.store.tables[k])
        return out

    def check_write(self, k: int, index: int) -> None:
        """An update needs gathers (every rank re-encodes whole blocks): refused after a failure."""
        self.ready_to_gather("update_weights() with coded DLO shards")

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        """Keep the new value; :meth:`reload` (the same on every rank) re-encodes the block."""
        spec = self.layouts[k].tensors[index]
        if value.dtype != spec.dtype or tuple(value.shape) != spec.shape:
            raise ValueError(f"tensor {spec.name!r} is {value.dtype} {tuple(value.shape)}, the layout says "
                             f"{spec.dtype} {spec.shape}")
        self._patches.setdefault(k, {})[index] = value.detach().to("cpu", copy=True)

    def reload(self) -> None:
        """Re-encode every written block (gather + decode, patch, encode, keep the share),
        in block order: the same collectives on every rank."""
        if not self._patches:
            return
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise CodedCaptureStaleError("coded weights changed while a CUDA graph was being captured; "
                                             "call the model again")
            torch.cuda.synchronize(self.device)  # not the hot path: in-flight copies may read the shares
        patches, self._patches = self._patches, {}
        for k in sorted(patches):
            self._reencode(k, patches[k])

    def _reencode(self, k: int, patch: dict[int, torch.Tensor]) -> None:
        image = self.image(k).cpu()
        specs = self.layouts[k].tensors
        for i, v in patch.items():
            specs[i].view_of(image).copy_(v)
        if self.raw[k]:  # a raw block keeps its raw share (same size)
            self.store.set_raw(k, [s.view_of(image) for s in specs])
            return
        blobs, table = encode_image(self.layouts[k], [s.view_of(image) for s in specs], levels=self.levels)
        if self.store.set(k, _joined(blobs), table):
            self._resharded()
        self._retable(k)

    def _retable(self, k: int) -> None:
        """Block ``k``'s new table into its device tensor, in place (graphs read it at replay)."""
        if not self.coded_bufs:
            return
        table, dev = self.store.tables[k], self._dev_tables.get(k)
        if dev is not None:
            dev.copy_(table._host)  # same size: one record per tensor, fixed tile counts
            table._device[self.device] = dev

    def _fit_buffers(self) -> None:
        """Shard slots and coded buffers large enough for every block's share (between steps)."""
        if not self.slots:
            return
        have = self.coded_bufs[0].numel() if self.coded_bufs else 0
        if self.store.max_shard > self.shard_slots[0].numel() or self._coded_buf_bytes() > have:
            self.shard_slots = [torch.empty(self.store.max_shard, dtype=torch.uint8, device=self.device)
                                for _ in self.slots]
            self.coded_bufs = [torch.empty(self._coded_buf_bytes(), dtype=torch.uint8, device=self.device)
                               for _ in self.slots]
            self._decode_tag = [_NO_DECODE] * len(self.slots)

    def _resharded(self) -> None:
        if not self.slots:
            return
        self._fit_buffers()
        if self._captured:
            self._stale = ("a weight update made a coded block larger than the coded shards the captured CUDA "
                           "graphs copy and gather for it; disable() the model and wrap it again (or use "
                           "cuda_graphs='off')")

    def local_piece(self, name: str, k: int, index: int):
        """This rank's coded bytes of tensor ``index`` of block ``k`` as a :class:`CodedPiece`
        (an empty tensor for an empty one); :func:`merge_shards` joins every rank's."""
        if self.raw[k]:
            return super().local_piece(name, k, index)
        spec = self.layouts[k].tensors[index]
        if not spec.nbytes:
            return torch.empty(spec.shape, dtype=spec.dtype)
        seg = next(s for s in self.store.tables[k].segments if s.dst_offset == spec.offset)
        n = seg.header.nbytes
        blob = TensorSpec(spec.name, spec.kind, torch.uint8, (n,), (1,), 0, n)
        lo, hi = self.store.range(k)
        a, b = max(lo, seg.src_offset), min(hi, seg.src_offset + n)
        data = self.store.image(k)[a - lo : b - lo].clone() if a < b else torch.empty(0, dtype=torch.uint8)
        return CodedPiece(name, blob, max(0, a - seg.src_offset), data,
                          target=dataclasses.replace(spec, offset=0))

    def stats(self) -> dict:
        s = self.store
        raw = sum(lay.nbytes for lay in self.layouts)
        coded16 = [(g.header.nbytes, g.header.numel) for t in s.tables if t is not None for g in t._live
                   if g.header.k != 8 or g.header.dtype != torch.int16]
        c16, n16 = sum(c for c, _ in coded16), sum(n for _, n in coded16)
        # a raw block (weight_codec='auto', not coded by the plan) moves its raw image
        moved = sum(lay.nbytes if r else c for lay, r, c in zip(self.layouts, self.raw, s.coded))
        return {"source": self.name, "host_bytes": s.nbytes, "pinned_bytes": s.pinned_bytes, "pinned": s.pinned,
                "pin_failure": s.pin_failure, "h2d_bytes_per_step": sum(s.shard_bytes),
                "slot_bytes": self.slot_bytes, "gather": self.gather, "shard_bytes": sum(s.shard_bytes),
                "coded_bytes": moved, "raw_bytes": raw, "coded_ratio": moved / raw if raw else 0.0,
                "bits_per_weight": 8.0 * c16 / n16 if n16 else 0.0,
                "coded_blocks": len(self.raw) - sum(self.raw), "codec": self.codec,
                "gathered_bytes_per_step": self.world * sum(s.shard_bytes)}

    def remove(self) -> None:
        super().remove()
        self.coded_bufs = []

    def __repr__(self) -> str:
        return f"CodedShardSource({self.store!r}, gather={self.gather})"
