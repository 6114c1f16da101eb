"""DLO shards: this rank's 1/N of every block image; a load is the shard's H2D, then an all-gather.

Each rank packs and pins only its ``1/N`` share of every block image:
``shard = align_up(ceil(image_bytes / N), 512)`` and rank ``r`` holds bytes
``[r * shard, (r + 1) * shard)`` of the flat image (the last share
zero-padded). Gathered rank-major, the ``N * shard`` bytes *are* the block
image, so parameters are views at their layout offsets: no unpack step.
Per load (CUDA):

1. copy stream: wait until the gather that last read this shard slot is done,
   H2D of the local shard into the shard slot, record ``shard_loaded``;
2. communication stream: wait ``shard_loaded`` and the block slot's ``freed``
   event, ``all_gather_into_tensor(block_slot, shard_slot)`` (``async_op=True``;
   ``work.wait()`` makes the communication stream wait on NCCL's stream); the
   executor records ``loaded`` there, and this source ``shard_read`` (the next
   H2D into that shard slot waits on it).

On CPU (gloo) the same code runs with synchronous copies and blocking
collectives. The topology rules live in :mod:`..dlo_topology`, the failure
policy in :mod:`..dlo_guard`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist

from weightstream.offload.dlo.control import ShardPiece, bounded_wait
from ..event_log import _Record
from weightstream.offload.dlo.topology import shard_size
from weightstream.offload.host.arena import HostStore, copy_from_image
from ..layout import TENSOR_ALIGN, BlockLayout, TensorSpec
from .base import SourceCaps, WeightSource
from .pinned import SourceRequest
from ..placeholders import drop_storage


def _raw_bytes(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The ``spec.nbytes`` bytes ``t`` occupies in a block image (uint8, 1-D)."""
    t = t.detach()
    if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
        raise ValueError(f"tensor {spec.name!r} is {t.dtype} {tuple(t.shape)}, the layout says "
                         f"{spec.dtype} {spec.shape}")
    if t.is_contiguous() and tuple(t.stride()) == spec.stride and t.numel() * t.element_size() == spec.nbytes:
        return t.reshape(-1).view(torch.uint8)
    tmp = torch.zeros(spec.nbytes, dtype=torch.uint8, device=t.device)
    dataclasses.replace(spec, offset=0).view_of(tmp).copy_(t)
    return tmp


def write_share(share: torch.Tensor, lo: int, spec: TensorSpec, t: torch.Tensor) -> None:
    """Write the bytes of tensor ``spec`` (value ``t``) that fall in ``share``: bytes
    ``[lo, lo + share.numel())`` of the block image (a tensor outside it is only checked)."""
    a, b = max(lo, spec.offset), min(lo + share.numel(), spec.offset + spec.nbytes)
    if a >= b:
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            _raw_bytes(t, spec)  # raises the shape/dtype error
        return
    raw = _raw_bytes(t, spec)
    share[a - lo : b - lo].copy_(raw[a - spec.offset : b - spec.offset])


class ShardedStore:
    """This rank's share of every block image, in one pinned host arena.

    ``layouts`` are the real block layouts (offsets into the gathered image);
    ``image(k)`` is this rank's ``shard_bytes[k]`` bytes of block ``k``.
    """

    def __init__(self, layouts: list[BlockLayout], world: int, rank: int, *, pin: bool,
                 budget_bytes: int | None = None):
        self.layouts = list(layouts)
        self.world, self.rank = world, rank
        self.shard_bytes = [shard_size(lay.nbytes, world) for lay in self.layouts]
        self.max_shard = max(self.shard_bytes)
        shards = [BlockLayout(lay.index, f"{lay.name}[shard {rank}/{world}]", (), sb)
                  for lay, sb in zip(self.layouts, self.shard_bytes)]
        self._host = HostStore(shards, pin=pin, budget_bytes=budget_bytes)

    def image(self, k: int) -> torch.Tensor:
        return self._host.image(k)

    def views(self, k: int):
        raise RuntimeError("an AllGather DLO store holds 1/N of each block; full views need a gather")

    def range(self, k: int) -> tuple[int, int]:
        """Byte range [lo, hi) of block k's image held here (hi may pass the image end: padding)."""
        lo = self.rank * self.shard_bytes[k]
        return lo, lo + self.shard_bytes[k]

    def write(self, k: int, spec: TensorSpec, t: torch.Tensor) -> None:
        """Write the part of tensor ``spec`` (value ``t``) that falls in this rank's share."""
        write_share(self.image(k), self.range(k)[0], spec, t)

    def pack(self, k: int, tensors: list[torch.Tensor]) -> None:
        specs = self.layouts[k].tensors
        if len(tensors) != len(specs):
            raise ValueError(f"block {self.layouts[k].name!r}: {len(tensors)} tensors given, layout has {len(specs)}")
        with torch.no_grad():
            self.image(k).zero_()  # alignment gaps and the last rank's padding
            for spec, t in zip(specs, tensors):
                self.write(k, spec, t)

    def pin(self, k: int) -> None:
        self._host.pin(k)

    def close(self) -> None:
        self._host.close()

    @property
    def nbytes(self) -> int:
        return self._host.nbytes

    @property
    def pinned(self) -> bool:
        return self._host.pinned

    @property
    def pinned_bytes(self) -> int:
        return self._host.pinned_bytes

    @property
    def pin_failure(self) -> str | None:
        return self._host.pin_failure

    def __repr__(self) -> str:
        return (f"ShardedStore(rank {self.rank}/{self.world}, {len(self.layouts)} blocks, "
                f"{self.nbytes / 1e9:.3f} GB host, pinned {self.pinned_bytes / 1e9:.3f} GB)")


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
            raise RuntimeError(
                f"this rank holds only 1/{self._world} of each streamed tensor (DLO AllGather); "
                "call .gather_state_dict() on every rank of the sharding group (a collective), "
                "local_state_dict() (this rank's share, no collective), or disable() first"
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
    """DLO AllGather: this rank's shard over H2D, then an all-gather into the block slot."""

    name = "dlo-allgather"
    caps = SourceCaps(collective=True, sharded=True)

    def __init__(self, req: SourceRequest, *, group, world: int, rank: int, gather: str, timeout_s: float,
                 failure=lambda: None):
        if gather not in ("tensor", "list"):
            raise ValueError(f"gather={gather!r} is not allowed; choose from: tensor, list")
        self.layouts = list(req.layouts)
        self.device, self.group, self.world, self.gather = req.device, group, world, gather
        self.timeout_s = timeout_s
        self._failure = failure  # the guard's failure (no gather after one)
        self.ncoll = 0  # DLO collectives this rank issued eagerly on the group (compared to recover)
        self.store = ShardedStore(self.layouts, world, rank, pin=req.pin, budget_bytes=req.pin_budget())
        # a gathered image is world * shard bytes: the block image plus the last share's padding
        self.slot_bytes = max(world * sb for sb in self.store.shard_bytes)
        self._pack(req)
        self._ids = {id(t): (k, i) for k in range(len(self.layouts)) for i, t in enumerate(req.objects(k))}
        self._host_views = ShardedHostViews(self._ids, world)
        self.slots, self.shard_slots, self.streams = [], [], None

    def _pack(self, req: SourceRequest) -> None:
        """The originals are released only once every share is packed: this rank keeps
        1/N of each block, so a failure part-way could not be undone from the store
        (host memory peaks at model + model/N during setup)."""
        from ..progress import Progress

        store = self.store
        bar = Progress(f"packing this rank's 1/{self.world} share of {len(self.layouts)} blocks",
                       store.nbytes, req.config.progress)
        try:
            for k in range(len(self.layouts)):
                store.pack(k, req.objects(k))
                store.pin(k)
                bar.update(store.shard_bytes[k])
        except BaseException:
            store.close()
            raise
        for k in range(len(self.layouts)):
            drop_storage(req.objects(k), req.device)  # only this rank's share stays in host memory

    # -- the executor's side --------------------------------------------------------
    def attach(self, slots, streams, device) -> None:
        self.slots, self.streams = slots, streams
        self.shard_slots = [torch.empty(self.store.max_shard, dtype=torch.uint8, device=device) for _ in slots]
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

    def side_streams(self) -> list:
        return [self.comm_stream] if self.streams is not None else []

    def waits_for_free_of(self, k: int) -> bool:
        """The shard's H2D runs ahead into its own buffer; only the gather waits for the slot."""
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

    loading: int | None = None  # block whose load or gather is under way (left set when a BaseException stops it)

    def cut_short(self) -> str | None:
        """What a BaseException that is not an Exception (KeyboardInterrupt, SystemExit, a
        cancellation) stopped part-way: a load (H2D, gather, decode) or a gather of a block,
        whose collective may or may not have run and whose slot holds part of it; None."""
        k = self.loading
        return None if k is None else f"the transfer (load or gather) of block {self.layouts[k].name!r}"

    def load(self, k: int, slot: int, *, position: int, after, tag):
        self.loading = k
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
            self._after_gather(k, slot, None, None)
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
        if after is not None and self._gather_waits_free(k, slot, tag):
            comm.wait_event(after)  # compute no longer reads what the gather writes
        with streams.stream(comm):
            if rec is not None:
                rec.start = log.mark(comm)
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
            self._after_gather(k, slot, after, tag)
        self.loading = None
        return comm

    def _gather_out(self, k: int, slot: int) -> torch.Tensor:
        """Where block ``k``'s gather lands: the block slot itself (the coded source: a coded buffer)."""
        return self.slots[slot][: self.world * self.store.shard_bytes[k]]

    def _gather_waits_free(self, k: int, slot: int, tag) -> bool:
        """Whether block ``k``'s gather into ``slot`` waits for the slot's release: it writes the block slot itself."""
        return True

    def _after_gather(self, k: int, slot: int, after, tag) -> None:
        """Work after the gather on the communication stream (current): none here (the coded source
        decodes; ``after`` and ``tag`` are the load's)."""

    # -- host side -----------------------------------------------------------------------
    def host_views(self) -> "ShardedHostViews":
        return self._host_views

    def locate(self, tensor_id: int) -> tuple[int, int] | None:
        """(block, tensor index) of a streamed tensor object, None for others."""
        return self._ids.get(tensor_id)

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            self.store.write(k, self.layouts[k].tensors[index], value)

    merge_hint = "weightstream.offload.distributed.merge_shards([...])"  # how local_state_dict()s join

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
        """Block ``k``'s full image in a fresh device tensor (a collective; outside the hot path)."""
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
        return full

    def local_piece(self, name: str, k: int, index: int):
        """Tensor ``index`` of block ``k`` as far as this rank holds it: a CPU tensor when
        wholly in this rank's share, else a :class:`ShardPiece` (possibly empty)."""
        spec = self.layouts[k].tensors[index]
        lo, hi = self.store.range(k)
        a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
        whole = dataclasses.replace(spec, offset=0)
        if a == spec.offset and b == spec.offset + spec.nbytes:
            return dataclasses.replace(spec, offset=spec.offset - lo).view_of(self.store.image(k)).clone()
        data = self.store.image(k)[a - lo : b - lo].clone() if a < b else torch.empty(0, dtype=torch.uint8)
        return ShardPiece(name, whole, max(0, a - spec.offset), data)

    def stats(self) -> dict:
        s = self.store
        return {"source": self.name, "host_bytes": s.nbytes, "pinned_bytes": s.pinned_bytes, "pinned": s.pinned,
                "pin_failure": s.pin_failure, "h2d_bytes_per_step": sum(s.shard_bytes),
                "slot_bytes": self.slot_bytes, "gather": self.gather, "shard_bytes": sum(s.shard_bytes)}

    def remove(self) -> None:
        self.slots, self.shard_slots = [], []

    def close(self) -> None:
        self.store.close()
        self._host_views.clear()

    def __repr__(self) -> str:
        return f"ShardSource({self.store!r}, gather={self.gather})"
