"""DLO AllGather: this rank's share over H2D, then an all-gather; coded shares end with a decode.

The bytes live in one store, :class:`~weightstream.offload.host.shares.Shares`: this rank's
``1/N`` share of every block, of its raw image or of its coded image, per block. Gathered
rank-major, the ``N * shard`` bytes *are* that image. Per load (CUDA):

1. copy stream: wait until the gather that last read this shard slot is done, H2D of the
   local share into the shard slot, record ``shard_loaded``;
2. communication stream: wait ``shard_loaded``; ``all_gather_into_tensor`` (``async_op=True``;
   ``work.wait()`` makes the communication stream wait on NCCL's stream), then record
   ``shard_read`` (the next H2D into that shard slot waits on it). A raw block is gathered into
   the block slot itself, after the slot's ``freed`` event (parameters are views at their
   layout offsets: no unpack step; the executor records ``loaded`` on the communication
   stream). A coded block is gathered into the slot's coded buffer of the
   :class:`~.decode.DecodeStage` (after the decode that last read that buffer, not after the
   slot's release: the gather of block p + 2 runs during block p's compute), and the stage
   decodes it into the slot on its decode stream, after the slot's release (the executor
   records ``loaded`` there).

On CPU (gloo) the same code runs with synchronous copies, blocking collectives and a
synchronous decode. Each rank's link moves ``shard`` bytes per block, the gather ``N * shard``.

``weight_codec`` (read from the request, :attr:`SourceRequest.codec`): ``"none"`` keeps raw
shares; a codec name codes every block at build (the deterministic encoder: the same bytes
on every rank); ``"auto"`` starts with raw shares and :meth:`ShardSource.code_blocks` codes
the blocks a plan (:mod:`~weightstream.offload.plan.coding`, the same on every
rank) chose, at once (a gather of each raw image, the encode, this rank's share of it).

Updates (``update_weights``, a collective: every rank calls it with the same weights): a raw
block's new values go straight into this rank's share; a coded block keeps them until the
executor's ``reload``, which gathers and decodes each written block (in block order, the same
on every rank), patches it, re-encodes it and stores this rank's share again (re-sharded when
the new coded size passes ``N * shard``; CUDA graphs captured before then refuse to replay).

``state_dict()``: a rank holds a share (the error names ``gather_state_dict()``);
``local_state_dict()`` gives this rank's pieces (raw: the tensor or a :class:`ShardPiece`;
coded: a :class:`CodedPiece` of its coded bytes), which
:func:`~weightstream.offload.dlo.control.merge_shards` joins (and decodes) with no collective.
The topology rules live in :mod:`..dlo.topology`, the failure policy in :mod:`..dlo.guard`.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from weightstream.offload.codecs import AUTO, CodedCaptureStaleError, codec_levels
from weightstream.offload.misuse import ShardedWeightError
from weightstream.offload.dlo.control import bounded_wait
from weightstream.offload.host.arena import copy_from_image
from weightstream.offload.host.encode import encode_image, encoded_in_order
from weightstream.offload.host.recode import SAMPLE_BYTES, checked_blocks, sample_coded
from weightstream.offload.host.shares import Shares, joined
from ..event_log import _Record
from ..layout import TENSOR_ALIGN
from ..placeholders import drop_storage
from ..progress import Progress
from .base import SourceCaps, WeightSource
from .decode import DecodeStage
from .pinned import SourceRequest


class ShardedHostViews(Mapping):
    """``host_views`` of an AllGather backend: no rank holds a streamed tensor whole.

    Reading one raises a clear error (a gather is a collective, so it cannot
    happen behind ``state_dict()`` on one rank); non-streamed tensors are not
    in it, as in the rank-local store.
    """

    def __init__(self, ids, world: int):
        self._ids = set(ids)
        self._world = world

    def __getitem__(self, key):
        if key in self._ids:
            raise ShardedWeightError(
                f"this rank holds only 1/{self._world} of each streamed tensor (DLO AllGather); "
                "call .gather_state_dict() on every rank of the sharding group (a collective), "
                "local_state_dict() (this rank's share, no collective), or disable() first. A streamed "
                "weight's .data reads it too: LoRA calls that read base weights (diffusers' load_lora_weights "
                "after offloading, fuse_lora, peft's merge) are not supported here; load the LoRA before "
                "offloading (it runs unfused) or use layer_options.dit.weight_transfer='rank-local'"
            )
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return key in self._ids

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def clear(self) -> None:
        self._ids.clear()


def _all_gather_tensor_fn():
    # torch >= 2.13 renames all_gather_into_tensor (now a deprecated alias) to all_gather_single.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardSource(WeightSource):
    """DLO AllGather: this rank's share over H2D, an all-gather, a decode for coded shares."""

    name = "dlo-allgather"
    caps = SourceCaps(collective=True, sharded=True)
    coding_active = False  # blocks are coded at once, on every rank together (never in the background)
    merge_hint = "weightstream.offload.distributed.merge_shards([...])"  # how local_state_dict()s join
    loading: int | None = None  # block whose load or gather is under way (left set when a BaseException stops it)

    def __init__(self, req: SourceRequest, *, group, world: int, rank: int, gather: str, timeout_s: float,
                 failure=lambda: None):
        if gather not in ("tensor", "list"):
            raise ValueError(f"gather={gather!r} is not allowed; choose from: tensor, list")
        codec = req.codec
        self.codes = codec != "none"  # blocks may be coded (a codec, or "auto": when a plan says so)
        self.auto = codec == AUTO
        # blocks built and re-encoded with this codec (auto: the plan's, None until then)
        self.codec = codec if self.codes and not self.auto else None
        self.levels = None if self.codec is None else codec_levels(self.codec)
        if self.codes:
            self.name = "dlo-allgather-coded"
            self.caps = SourceCaps(collective=True, sharded=True, codes_blocks=True)
        self.layouts = list(req.layouts)
        self.device, self.group, self.world, self.gather = req.device, group, world, gather
        self.timeout_s = timeout_s
        self._failure = failure  # the guard's failure (no gather after one)
        self.ncoll = 0  # DLO collectives this rank issued eagerly on the group (compared to recover)
        self.store = Shares(self.layouts, world, rank, pin=req.pin, budget_bytes=req.pin_budget())
        self._pack(req)
        # a raw block is gathered into the slot itself: its image plus the last share's padding
        self.slot_bytes = max([lay.nbytes for lay in self.layouts] +
                              [world * sb for sb, r in zip(self.store.shard_bytes, self.raw) if r])
        self._ids = {id(t): (k, i) for k in range(len(self.layouts)) for i, t in enumerate(req.objects(k))}
        self._host_views = ShardedHostViews(self._ids, world)
        self.slots, self.shard_slots, self.streams = [], [], None
        # gathered coded bytes end in one decode stage at load: eager on its decode stream (the gather
        # of block p + 2 overlaps block p's compute); under CUDA graphs on the communication stream
        # after the gather, as captured before the decode stage existed (a capture holding the
        # decode stream failed: cudaErrorStreamCaptureIsolation, tests/test_dlo_auto_codec_gpu.py)
        graphs = req.config.cuda_graphs == "on"
        self.stage = DecodeStage(self.layouts, decode_at="load", decode_stream=not graphs) if self.codes else None
        self._patches: dict[int, dict[int, torch.Tensor]] = {}

    raw = property(lambda self: self.store.raw)  # block k's share is of its raw image (no decode)
    _captured = property(lambda self: self.stage is not None and self.stage.captured)  # (recode.checked_blocks)

    def _pack(self, req: SourceRequest) -> None:
        """Encode (worker threads) or copy, keep this rank's share; the originals are released
        only once every share is stored: this rank keeps 1/N of each block, so a failure
        part-way could not be undone from the store (host memory peaks at model + model/N)."""
        n = len(self.layouts)
        what = "coding" if self.levels is not None else "packing"
        bar = Progress(f"{what} {n} blocks, keeping this rank's 1/{self.world} share",
                       sum(lay.nbytes for lay in self.layouts), req.config.progress)
        try:
            objs = [req.objects(k) for k in range(n)]
            if self.levels is None:  # raw shares (weight_codec 'none', or 'auto' before a plan)
                for k, lay in enumerate(self.layouts):
                    self.store.set_raw(k, objs[k])
                    bar.update(lay.nbytes)
            else:
                for k, (blobs, table) in enumerate(encoded_in_order(self.layouts, objs, levels=self.levels)):
                    self.store.set_coded(k, joined(blobs), table)
                    bar.update(self.layouts[k].nbytes)
        except BaseException:
            self.store.close()
            raise
        finally:
            bar.close()
        for k in range(n):
            drop_storage(req.objects(k), req.device)  # only this rank's share stays in host memory

    # -- the executor's side --------------------------------------------------------
    def attach(self, slots, streams, device) -> None:
        self.slots, self.streams = slots, streams
        self.shard_slots = [torch.empty(self.store.max_shard, dtype=torch.uint8, device=device) for _ in slots]
        if self.stage is not None:  # coded buffers, the decode stream; every table on the device now
            self.stage.attach(slots, streams, device, self._coded_buf_bytes(), self.store.tables)
        if streams is None:
            return
        self.comm_stream = streams.new_stream(device)
        self.shard_loaded = [streams.new_event() for _ in slots]
        self.shard_read = [streams.new_event() for _ in slots]
        self._read_tag = [None] * len(slots)  # capture context of shard_read (see the executor's load tags)
        if device.type == "cuda":
            copy = torch.cuda.current_stream(device)  # the executor's copy stream (current during attach)
            for t in self.shard_slots:
                t.record_stream(copy)
            for t in slots:
                t.record_stream(self.comm_stream)
            if self.stage is not None:
                for s in range(len(slots)):
                    self.stage.buffer(s).record_stream(self.comm_stream)

    def side_streams(self) -> list:
        if self.streams is None:
            return []
        return [self.comm_stream, *(self.stage.side_streams() if self.stage is not None else [])]

    def waits_for_free_of(self, k: int) -> bool:
        """The shard's H2D runs ahead into its own buffer; only the gather (raw) or decode waits for the slot."""
        return True

    @staticmethod
    def gather_mode(dlo, timeout_s: float, device: torch.device) -> str:
        """"tensor" (all_gather_into_tensor) or "list" (all_gather into views of the
        output: the same bytes) where the backend lacks the former. NCCL: always "tensor"."""
        if dlo.backend == "nccl":
            return "tensor"
        # gloo gained all_gather_into_tensor late; probe once (same call on every rank)
        probe_out = torch.empty(dlo.group_size * TENSOR_ALIGN, dtype=torch.uint8, device=device)
        probe_in = torch.zeros(TENSOR_ALIGN, dtype=torch.uint8, device=device)
        try:
            work = _all_gather_tensor_fn()(probe_out, probe_in, group=dlo.group, async_op=True)
        except (RuntimeError, NotImplementedError):
            return "list"
        bounded_wait(work, timeout_s, "the DLO gather probe")
        return "tensor"

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False):
        """``out`` (world * n bytes) <- every rank's ``inp`` (n bytes), rank-major."""
        if self.gather == "list":
            parts = list(out.view(self.world, -1).unbind(0))
            return dist.all_gather(parts, inp, group=self.group, async_op=async_op)
        return _all_gather_tensor_fn()(out, inp, group=self.group, async_op=async_op)

    def cut_short(self) -> str | None:
        """What a BaseException that is not an Exception (KeyboardInterrupt, SystemExit, a
        cancellation) stopped part-way: a load (H2D, gather, decode) or a gather of a block,
        whose collective may or may not have run and whose slot holds part of it; None."""
        k = self.loading
        return None if k is None else f"the transfer (load or gather) of block {self.layouts[k].name!r}"

    def load(self, k: int, slot: int, *, position: int, after, tag):
        self.loading = k
        if self.stage is not None:
            self.stage.note_load(tag)
        sb = self.store.shard_bytes[k]
        src = self.store.image(k)
        shard = self.shard_slots[slot][:sb]
        full = self._gather_out(k, slot)
        name = self.layouts[k].name
        log = self.event_log
        rec = None if log is None else _Record(self.step_of(position), self.layouts[k].index, "gather")
        if self.streams is None:
            copy_from_image(shard, src)
            if rec is not None:
                rec.start = log.mark()
            work = self.all_gather(full, shard, async_op=True)
            self.ncoll += 1
            bounded_wait(work, self.timeout_s, f"the gather of block {name!r}")
            if rec is not None:
                rec.end = log.mark()
                log.records.append(rec)
            if not self.raw[k]:
                self.stage.decode(full, self.slots[slot], self.store.tables[k])
            self.loading = None
            return None
        streams, comm = self.streams, self.comm_stream
        cs = streams.current_stream(self.device)  # the executor's copy stream
        block = self.layouts[k].index
        if self._read_tag[slot] == tag:
            cs.wait_event(self.shard_read[slot])  # the gather that last read this shard slot is done
        elif after is not None:
            # inside a capture whose shard_read was recorded elsewhere: join the copy
            # stream to the capture through this capture's slot-free event
            cs.wait_event(after)
        copy_from_image(shard, src)  # a shard over one registration chunk is split
        streams.access("write", ("shard", slot), block)
        self.shard_loaded[slot].record(cs)
        comm.wait_event(self.shard_loaded[slot])
        if not self.raw[k]:
            self.stage.before_write(slot, comm, tag, after)  # after the decode that last read the buffer
        elif after is not None:
            comm.wait_event(after)  # compute no longer reads what the gather writes
        with streams.stream(comm):
            if rec is not None:
                rec.start = log.mark(comm)
            if self.raw[k] and self.stage is not None:
                self.stage.before_raw(slot, comm, tag)  # a skipped coded block's decode may write the slot
            streams.access("read_begin", ("shard", slot), block)
            work = self.all_gather(full, shard, async_op=True)
            work.wait()  # the comm stream waits for the collective's stream (no host block)
            self.ncoll += tag is None  # a captured gather runs at replay, on every rank alike
            streams.access("read_end", ("shard", slot), block)
            self.shard_read[slot].record(comm)
            self._read_tag[slot] = tag
            if rec is not None:
                rec.end = log.mark(comm)
                log.records.append(rec)
            done = comm
            if not self.raw[k]:  # the stage decodes the gathered coded image into the slot
                done = self.stage.written(k, slot, full.numel(), self.store.tables[k], comm, tag, after)
        self.loading = None
        return done

    def _gather_out(self, k: int, slot: int) -> torch.Tensor:
        """Where block ``k``'s gather lands: the block slot itself (raw), the stage's coded buffer (coded)."""
        n = self.world * self.store.shard_bytes[k]
        return self.slots[slot][:n] if self.raw[k] else self.stage.buffer(slot)[:n]

    def _coded_buf_bytes(self) -> int:
        """A coded buffer holds a gathered coded image (raw blocks are gathered into the slot)."""
        return max([self.world * sb for sb, r in zip(self.store.shard_bytes, self.raw) if not r], default=0)

    def captures_dropped(self) -> None:
        if self.stage is not None:
            self.stage.forget_captures()

    def check_replay(self) -> None:
        """Before a replay: refuse graphs captured before a re-shard."""
        if self.stage is not None:
            self.stage.check()

    def uncapturable(self) -> str | None:
        if self.codes and self.device.type == "cuda" and not self.store.pinned:
            return f"some coded shards are in pageable host memory ({self.store.pin_failure or 'pin_memory is off'})"
        return None

    def link_bytes(self, k: int) -> int:
        """Bytes one load of block ``k`` moves over this rank's host link: its share."""
        return self.store.shard_bytes[k]

    # -- weight_codec="auto" (plan/coding.py plans, every rank alike) ----------------
    def sample(self, k: int, codecs, max_bytes: int | None = SAMPLE_BYTES) -> dict:
        """Raw block ``k`` (a collective: its image is gathered) encoded aside with each codec of
        ``codecs``, nothing stored: codec -> :func:`~..host.recode.sample_coded`'s result. The
        encoder is deterministic, so every rank computes the same sizes."""
        if not self.raw[k]:
            raise ValueError(f"block {self.layouts[k].name!r} is coded already; sample() reads raw blocks")
        lay = self.layouts[k]
        image = self.image(k).cpu()[: lay.nbytes]
        return {c: sample_coded(lay, image, codec_levels(c), max_bytes) for c in codecs}

    def coded_shard_bytes(self, k: int, coded: int) -> int:
        """This rank's link bytes for block ``k`` coded in ``coded`` bytes (its share of them, slack included)."""
        return self.store.coded_shard_bytes(k, coded)

    def code_blocks(self, ks, codec: str, *, progress: bool = False, background: bool = False) -> None:
        """weight_codec="auto": code raw blocks ``ks`` with ``codec`` now. A collective, in block
        order, the same on every rank: each block's raw image is gathered, encoded (deterministic:
        the same bytes everywhere), and this rank keeps its share of the coded image, sized anew.
        Between steps only, before any CUDA graph is captured."""
        if background:
            raise ValueError("code_blocks: background=True is not allowed with DLO AllGather: every rank switches "
                             "a block to coded at the same step; allowed: background=False")
        if self.stage is None:
            raise ValueError(f"code_blocks: this source streams raw shares (weight_codec='none'); codec={codec!r} "
                             "is not allowed; allowed: weight_codec='auto' sources code blocks")
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
                self.store.set_coded(k, joined(blobs), table, fresh=True)
                self.stage.upload(k, table)
                bar.update(lay.nbytes)
        finally:
            bar.close()
            self._fit_buffers()

    # -- host side -----------------------------------------------------------------------
    def host_views(self) -> "ShardedHostViews":
        return self._host_views

    def locate(self, tensor_id: int) -> tuple[int, int] | None:
        """(block, tensor index) of a streamed tensor object, None for others."""
        return self._ids.get(tensor_id)

    def check_write(self, k: int, index: int) -> None:
        """With a codec, an update may need gathers (every rank re-encodes whole blocks): refused after a failure."""
        if self.codes:
            self.ready_to_gather("update_weights() with coded DLO shards")

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        """A raw block: this rank's part of the new value into its share. A coded block: keep the
        new value; :meth:`reload` (the same on every rank) re-encodes the block."""
        spec = self.layouts[k].tensors[index]
        if self.raw[k]:
            with torch.no_grad():
                self.store.write_raw(k, spec, value)
            return
        if value.dtype != spec.dtype or tuple(value.shape) != spec.shape:
            raise ValueError(f"tensor {spec.name!r} is {value.dtype} {tuple(value.shape)}, the layout says "
                             f"{spec.dtype} {spec.shape}")
        self._patches.setdefault(k, {})[index] = value.detach().to("cpu", copy=True)

    def reload(self) -> None:
        """Re-encode every written coded block (gather + decode, patch, encode, keep the share),
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
        blobs, table = encode_image(self.layouts[k], [s.view_of(image) for s in specs], levels=self.levels)
        if self.store.set_coded(k, joined(blobs), table):
            self._fit_buffers()
            self.stage.grew(self._coded_buf_bytes(), "a weight update")  # captured graphs gather the old shards
        self.stage.retable(k, table)

    def _fit_buffers(self) -> None:
        """Shard slots and coded buffers large enough for every block's share (between steps)."""
        if not self.slots:
            return
        if self.store.max_shard > self.shard_slots[0].numel():
            self.shard_slots = [torch.empty(self.store.max_shard, dtype=torch.uint8, device=self.device)
                                for _ in self.slots]
        self.stage.fit(self._coded_buf_bytes())

    def ready_to_gather(self, what: str) -> None:
        """After a failed collective no further one is issued: a timed-out gloo
        operation stays pending and would pair with the next collective (a size
        mismatch aborts the process), an NCCL one blocks its communicator. The
        host shards are intact, so the way out is rank-local."""
        failure = self._failure()
        if failure is None and self.cut_short() is not None:
            failure = f"{self.cut_short()} was cut short part-way"
        if failure is not None:
            raise RuntimeError(
                f"{what} is a collective, and this rank's DLO collectives stopped after a failure "
                f"({failure}). The host shards are intact: call local_state_dict() on every rank (no "
                "collective) and join them with " + self.merge_hint
            )

    def image(self, k: int) -> torch.Tensor:
        """Block ``k``'s full image in a fresh device tensor (a collective: a gather, then the decode
        of a coded block; outside the hot path)."""
        self.ready_to_gather("this call")
        self.loading = k
        sb = self.store.shard_bytes[k]
        full = torch.empty(self.world * sb, dtype=torch.uint8, device=self.device)
        shard = torch.empty(sb, dtype=torch.uint8, device=self.device)
        copy_from_image(shard, self.store.image(k))  # the gather below is ordered after it
        work = self.all_gather(full, shard, async_op=True)
        self.ncoll += 1
        bounded_wait(work, self.timeout_s, f"the gather of block {self.layouts[k].name!r}",
                     poll=self.device.type == "cuda")
        self.loading = None
        if self.raw[k]:
            return full
        out = torch.zeros(self.layouts[k].nbytes, dtype=torch.uint8, device=self.device)
        DecodeStage.decode(full, out, self.store.tables[k])
        return out

    def local_piece(self, name: str, k: int, index: int):
        """Tensor ``index`` of block ``k`` as far as this rank holds it (:meth:`Shares.piece`)."""
        return self.store.piece(name, k, index)

    def stats(self) -> dict:
        s = self.store
        out = {"source": self.name, "host_bytes": s.nbytes, "pinned_bytes": s.pinned_bytes, "pinned": s.pinned,
               "pin_failure": s.pin_failure, "h2d_bytes_per_step": sum(s.shard_bytes),
               "slot_bytes": self.slot_bytes, "gather": self.gather, "shard_bytes": sum(s.shard_bytes)}
        if not self.codes:
            return out
        raw = sum(lay.nbytes for lay in self.layouts)
        coded16 = [(g.header.nbytes, g.header.numel) for t in s.tables if t is not None for g in t._live
                   if g.header.k != 8 or g.header.dtype != torch.int16]
        c16, n16 = sum(c for c, _ in coded16), sum(n for _, n in coded16)
        # a raw block (weight_codec='auto', not coded by the plan) moves its raw image
        moved = sum(lay.nbytes if r else c for lay, r, c in zip(self.layouts, self.raw, s.coded))
        out.update({"coded_bytes": moved, "raw_bytes": raw, "coded_ratio": moved / raw if raw else 0.0,
                    "bits_per_weight": 8.0 * c16 / n16 if n16 else 0.0,
                    "coded_blocks": len(self.raw) - sum(self.raw), "codec": self.codec,
                    "gathered_bytes_per_step": self.world * sum(s.shard_bytes), **self.stage.stats()})
        return out

    def remove(self) -> None:
        self.slots, self.shard_slots = [], []
        if self.stage is not None:
            self.stage.remove()

    def close(self) -> None:
        self.store.close()
        self._host_views.clear()
        if self.stage is not None:
            self.stage.close()

    def __repr__(self) -> str:
        return f"ShardSource({self.store!r}, gather={self.gather})"
