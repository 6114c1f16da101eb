"""Distributed layerwise offload (DLO) over an existing ``torch.distributed`` topology.

DLO never creates process groups: the caller owns the topology and describes
it with a :class:`ParallelConfig` (sizes and groups of DP, SP, TP, HSDP).
The weight-sharding group is the DP group when ``dp > 1``, else the SP group
when ``sp > 1``, else none (rank-local). TP is never used for it.

Two weight transfers (``layer_options.dit.weight_transfer``):

``allgather``
    Each rank packs and pins only its ``1/N`` share of every block image:
    ``shard = align_up(ceil(image_bytes / N), 512)`` and rank ``r`` holds bytes
    ``[r * shard, (r + 1) * shard)`` of the flat image (the last share
    zero-padded). Gathered rank-major, the ``N * shard`` bytes *are* the block
    image, so parameters are views at their layout offsets: no unpack step.
    Per block (CUDA):

    1. copy stream: wait until the gather that last read this shard slot is
       done, H2D of the local shard into the shard slot, record ``shard_loaded``;
    2. communication stream: wait ``shard_loaded`` and the block slot's
       ``freed`` event, ``all_gather_into_tensor(block_slot, shard_slot)``
       (``async_op=True``; ``work.wait()`` makes the communication stream wait
       on NCCL's stream), record ``loaded`` (compute waits on it) and
       ``shard_read`` (the next H2D into that shard slot waits on it);
    3. compute stream: waits ``loaded``, computes, records ``freed``.

    On CPU (gloo) the same code runs with synchronous copies and blocking
    collectives. Host memory per rank is about model / N.

``rank-local``
    Full blocks per rank through the ordinary :class:`LayerwiseExecutor`; no
    DLO collective. TP-local or HSDP-local tensors stream as they are.

Both prime their first loads at the first forward (in the same order on every
rank). In AllGather mode an exception part-way (from a collective, a copy, or
a forward that stopped between streamed blocks) marks the backend unusable:
the ranks may be out of step in their collectives, so later forwards raise a
``RuntimeError`` naming the original failure instead of hanging.

Request waves: with AllGather and ``dp > 1`` every DP rank computes its own
request in lock-step collectives, so a wave needs an explicit, equal
``num_inference_steps`` and identical path-affecting arguments on every rank;
:func:`validate_wave` checks that with one small collective.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import OffloadConfig
from .discovery import OffloadPlan
from .executor import LayerwiseExecutor, _Record
from .host_store import HostStore, Progress, copy_from_image
from .layout import TENSOR_ALIGN, BlockLayout, TensorSpec, align_up
from .schedule import Load
from .transformer import StreamedBlocks, drop_storage

__all__ = [
    "ParallelConfig",
    "DLOPlan",
    "plan_dlo",
    "resolve_transfer",
    "build_streamed",
    "validate_wave",
    "shard_size",
    "AllGatherStreamedBlocks",
    "RankLocalStreamedBlocks",
    "DEFAULT_PATH_KEYS",
]

_DIMS = ("dp", "sp", "tp", "hsdp")

# Request arguments that change what the transformer computes per step (shapes,
# CFG on/off, batch), compared across a DP wave by validate_wave.
DEFAULT_PATH_KEYS = (
    "height", "width", "num_frames", "num_images_per_prompt", "guidance_scale", "true_cfg_scale",
    "max_sequence_length", "negative_prompt", "negative_prompt_embeds",
)
# Keys whose presence, not value, changes the path (a negative prompt turns CFG on).
_PRESENCE_KEYS = frozenset({"negative_prompt", "negative_prompt_embeds", "negative_pooled_prompt_embeds"})


# --------------------------------------------------------------------------- topology
@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The caller's existing parallel topology, as DLO consumes it.

    dp, sp, tp, hsdp: sizes (ints >= 1). dp_group, sp_group, tp_group,
    hsdp_group: the matching ``torch.distributed`` process groups; ``None``
    stands for the default (world) group and must then match its size when
    DLO needs the group. DLO only reads this; it never creates a group.

    HSDP combines with SP only: HSDP together with DP > 1 or TP > 1 is
    rejected here, before anything else looks at the model.
    """

    dp: int = 1
    sp: int = 1
    tp: int = 1
    hsdp: int = 1
    dp_group: Any = None
    sp_group: Any = None
    tp_group: Any = None
    hsdp_group: Any = None

    def __post_init__(self) -> None:
        for dim in _DIMS:
            v = getattr(self, dim)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"ParallelConfig.{dim}={v!r} is not allowed; expected an int >= 1")
            if v < 1:
                raise ValueError(f"ParallelConfig.{dim}={v!r} is not allowed; expected an int >= 1")
        if self.hsdp > 1 and (self.dp > 1 or self.tp > 1):
            raise ValueError(
                f"ParallelConfig(hsdp={self.hsdp}, dp={self.dp}, tp={self.tp}) is not allowed: HSDP "
                "combines with SP only, not with DP > 1 or TP > 1; use hsdp=1 or dp=1 and tp=1"
            )

    @classmethod
    def data_parallel(cls, group=None) -> "ParallelConfig":
        """Pure DP over ``group`` (default: the world group); needs an initialised process group."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "ParallelConfig.data_parallel() needs an initialised torch.distributed process group; "
                "call torch.distributed.init_process_group(...) first (DLO never creates one)"
            )
        return cls(dp=dist.get_world_size(group), dp_group=group)

    @property
    def shard_dim(self) -> str | None:
        """The dimension whose group DLO shards weights over: "dp", "sp" or None. Never "tp"."""
        if self.dp > 1:
            return "dp"
        if self.sp > 1:
            return "sp"
        return None

    @property
    def shard_size(self) -> int:
        dim = self.shard_dim
        return 1 if dim is None else getattr(self, dim)

    def describe(self) -> str:
        return ", ".join(f"{d}={getattr(self, d)}" for d in _DIMS)


def shard_size(image_bytes: int, n: int) -> int:
    """Bytes of one rank's share of a block image: ceil(image / n) rounded up to 512."""
    if n < 1:
        raise ValueError(f"n={n} ranks is not allowed; expected >= 1")
    return align_up(-(-image_bytes // n), TENSOR_ALIGN)


@dataclasses.dataclass(frozen=True)
class DLOPlan:
    """What DLO will do for one model on this rank (decided before any tensor moves)."""

    transfer: str  # "allgather" | "rank-local"
    requested: str | None  # layer_options.dit.weight_transfer as given (None: unset)
    group: Any  # process group of the weight collective (None: default group or none)
    group_size: int  # ranks sharing the host weights (1 for rank-local)
    rank: int  # this rank's index in that group (0 for rank-local)
    dim: str | None  # "dp" | "sp" | None
    backend: str | None  # the group's backend ("nccl", "gloo") for allgather


def resolve_transfer(config: OffloadConfig, parallel: ParallelConfig) -> str:
    """Check the DLO compatibility rules and return the transfer to use.

    Pure: reads only the two configs. Every rejection is a ``ValueError`` that
    names the values and the way out. An unset ``weight_transfer`` means
    "allgather" when the sharding group has more than one rank (the DLO
    default), else "rank-local"; "allgather" over a group of one rank runs
    rank-local (there is nothing to gather).
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
    requested = config.weight_transfer
    transfer = requested or ("allgather" if parallel.shard_size > 1 else "rank-local")
    if transfer == "allgather":
        said = ("layer_options.dit.weight_transfer='allgather'" if requested else
                f"layer_options.dit.weight_transfer unset (the DLO default 'allgather' for "
                f"{parallel.shard_dim}={parallel.shard_size})")
        fix = "set layer_options.dit.weight_transfer='rank-local'"
        if parallel.tp > 1:
            raise ValueError(
                f"{said} with tp={parallel.tp} is not allowed: DLO never all-gathers over tensor-parallel "
                f"ranks and would bypass the TP-aware weight layout; {fix} (TP-local tensors then stream as they are)"
            )
        if parallel.hsdp > 1:
            raise ValueError(
                f"{said} with hsdp={parallel.hsdp} is not allowed: HSDP already shards the parameters, so a "
                f"DLO AllGather would double-shard them; {fix} (HSDP keeps its own gathers)"
            )
        if config.resident_layers > 0:
            raise ValueError(
                f"layer_options.dit.resident_layers={config.resident_layers} with {said} is not allowed: "
                f"resident layers require weight_transfer='rank-local'; {fix} or resident_layers=0"
            )
        if parallel.shard_size == 1:
            transfer = "rank-local"
    return transfer


def _resolve_group(parallel: ParallelConfig, dim: str):
    """(group, size, rank) of ``dim``'s group; ValueError when it does not match the config."""
    size = getattr(parallel, dim)
    group = getattr(parallel, f"{dim}_group")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"ParallelConfig.{dim}={size} needs an initialised torch.distributed process group, but none is "
            "initialised; DLO consumes an existing topology and never creates one: call "
            "torch.distributed.init_process_group(...) and pass the group as "
            f"ParallelConfig({dim}_group=...)"
        )
    actual = dist.get_world_size(group)
    if actual != size:
        which = f"{dim}_group" if group is not None else f"{dim}_group=None (the default group)"
        raise ValueError(
            f"ParallelConfig.{dim}={size} does not match {which}, which has {actual} ranks; pass the "
            f"{dim} process group of {size} ranks"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process is not a member of ParallelConfig.{dim}_group")
    return group, size, rank


def plan_dlo(config: OffloadConfig, parallel: ParallelConfig, device: torch.device) -> DLOPlan:
    """Rules, then the group this rank uses. No collective, no tensor moves."""
    transfer = resolve_transfer(config, parallel)
    if transfer == "rank-local":
        return DLOPlan("rank-local", config.weight_transfer, None, 1, 0, parallel.shard_dim, None)
    dim = parallel.shard_dim
    group, size, rank = _resolve_group(parallel, dim)
    backend = str(dist.get_backend(group))
    if backend == "nccl" and torch.device(device).type != "cuda":
        raise ValueError(
            f"device={str(device)!r} with the NCCL {dim} group is not allowed: NCCL gathers CUDA tensors; "
            "pass device='cuda:<local rank>' or use a gloo group on CPU"
        )
    return DLOPlan("allgather", config.weight_transfer, group, size, rank, dim, backend)


def build_streamed(module: nn.Module, config: OffloadConfig, device: torch.device,
                   plan: OffloadPlan | None, parallel: ParallelConfig) -> StreamedBlocks:
    """The DLO backend of ``OffloadedTransformer(..., parallel=...)``.

    All compatibility rules are checked before any tensor is touched.
    """
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(f"parallel must be a weightstream ParallelConfig, got {type(parallel).__name__}")
    dlo = plan_dlo(config, parallel, device)
    cls = AllGatherStreamedBlocks if dlo.transfer == "allgather" else RankLocalStreamedBlocks
    return cls(module, config, device, plan, parallel, dlo)


# --------------------------------------------------------------------------- host shards
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
        lo, hi = self.range(k)
        a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
        if a >= b:
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                _raw_bytes(t, spec)  # raises the shape/dtype error
            return
        raw = _raw_bytes(t, spec)
        self.image(k)[a - lo : b - lo].copy_(raw[a - spec.offset : b - spec.offset])

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
                "call .gather_state_dict() on every rank of the sharding group (a collective), or "
                "disable() first"
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


# --------------------------------------------------------------------------- executors
def _all_gather_tensor_fn():
    # torch >= 2.13 renames all_gather_into_tensor (now a deprecated alias) to all_gather_single.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GuardedExecutor(LayerwiseExecutor):
    """LayerwiseExecutor that primes at the first forward and turns a failed
    copy into a sticky, named failure."""

    mode = "rank-local"

    def __init__(self, blocks, store, schedule, device, *, record_events: bool = False, streams=None):
        self.failure: str | None = None
        super().__init__(blocks, store, schedule, device, record_events=record_events, prime="first_forward",
                         streams=streams)

    def check_usable(self, what: str = "this forward") -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"weightstream DLO ({self.mode}) is unusable after an earlier failure on this rank: "
                f"{self.failure}. {what[:1].upper() + what[1:]} was stopped before any transfer"
                + (" or collective, so it cannot hang on ranks that are out of step; rebuild the "
                   "OffloadedTransformer on every rank of the sharding group"
                   if self.mode == "allgather" else "; rebuild the OffloadedTransformer")
            )

    def mark_failed(self, what: str) -> None:
        if self.failure is None:
            self.failure = what

    def _issue(self, load: Load, *, wait_free: bool = True) -> None:
        self.check_usable()
        try:
            self._load(load, wait_free=wait_free)
        except Exception as e:
            self.mark_failed(f"{type(e).__name__}: {e} (loading block {self.blocks[load.block].name!r}, "
                             f"step {self.schedule.step_of(load.position)})")
            raise

    def _load(self, load: Load, *, wait_free: bool) -> None:
        super()._issue(load, wait_free=wait_free)

    def before_block(self, block: int) -> None:
        self.check_usable()
        super().before_block(block)


class AllGatherExecutor(GuardedExecutor):
    """Streams 1/N shards over H2D and all-gathers them into the block slots."""

    mode = "allgather"

    def __init__(self, blocks, store: ShardedStore, schedule, device, *, group, world: int,
                 gather: str = "tensor", record_events: bool = False, streams=None):
        if gather not in ("tensor", "list"):
            raise ValueError(f"gather={gather!r} is not allowed; choose from: tensor, list")
        self.group, self.world, self.gather = group, world, gather
        super().__init__(blocks, store, schedule, device, record_events=record_events, streams=streams)
        self.shard_slots = [torch.empty(store.max_shard, dtype=torch.uint8, device=self.device)
                            for _ in self.slots]
        if self.streams is not None:
            self.comm_stream = self.streams.new_stream(self.device)
            for t in self.shard_slots if self.cuda else ():
                t.record_stream(self.copy_stream)
            for t in self.slots if self.cuda else ():
                t.record_stream(self.comm_stream)
            self.shard_loaded = [self.streams.new_event() for _ in self.slots]
            self.shard_read = [self.streams.new_event() for _ in self.slots]
            self._read_tag = [None] * len(self.slots)  # capture context of shard_read (see executor)

    def _slot_size(self) -> int:
        # a gathered image is world * shard bytes: the block image plus the last share's padding
        return max(self.store.world * sb for sb in self.store.shard_bytes)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False):
        """``out`` (world * n bytes) <- every rank's ``inp`` (n bytes), rank-major."""
        if self.gather == "list":
            parts = list(out.view(self.world, -1).unbind(0))
            return dist.all_gather(parts, inp, group=self.group, async_op=async_op)
        return _all_gather_tensor_fn()(out, inp, group=self.group, async_op=async_op)

    def _load(self, load: Load, *, wait_free: bool) -> None:
        k = load.block - self.schedule.resident
        sb = self.store.shard_bytes[k]
        src = self.store.image(k)
        shard = self.shard_slots[load.slot][:sb]
        full = self.slots[load.slot][: self.world * sb]
        step = self.schedule.step_of(load.position)
        rec_copy = rec_gather = None
        if self.log is not None:
            rec_copy = _Record(step, load.block, "copy")
            rec_gather = _Record(step, load.block, "gather")
            self.log.records += [rec_copy, rec_gather]
        if self.streams is None:
            if rec_copy is not None:
                rec_copy.start = self.log.mark()
            copy_from_image(shard, src)
            if rec_copy is not None:
                rec_copy.end = rec_gather.start = self.log.mark()
            self.all_gather(full, shard)
            if rec_gather is not None:
                rec_gather.end = self.log.mark()
            return
        slot = load.slot
        cs, comm = self.copy_stream, self.comm_stream
        if self._read_tag[slot] == self.capture_tag:
            cs.wait_event(self.shard_read[slot])  # the gather that last read this shard slot is done
        elif wait_free and load.after_position is not None:
            # inside a capture whose shard_read was recorded elsewhere: join the copy
            # stream to the capture through this capture's slot-free event
            cs.wait_event(self.freed[slot])
        with self.streams.stream(cs):
            if rec_copy is not None:
                rec_copy.start = self.log.mark(cs)
            copy_from_image(shard, src)  # a shard over one registration chunk is split
            self.streams.access("write", ("shard", slot), load.block)
            self.shard_loaded[slot].record(cs)
            if rec_copy is not None:
                rec_copy.end = self.log.mark(cs)
        comm.wait_event(self.shard_loaded[slot])
        if wait_free and load.after_position is not None:
            comm.wait_event(self.freed[slot])  # compute no longer reads this block slot
        with self.streams.stream(comm):
            if rec_gather is not None:
                rec_gather.start = self.log.mark(comm)
            self.streams.access("read_begin", ("shard", slot), load.block)
            work = self.all_gather(full, shard, async_op=True)
            work.wait()  # the comm stream waits for the collective's stream (no host block)
            self.streams.access("write", slot, load.block)
            self.streams.access("read_end", ("shard", slot), load.block)
            self.loaded[slot].record(comm)
            self.shard_read[slot].record(comm)
            self._load_tag[slot] = self._read_tag[slot] = self.capture_tag
            if rec_gather is not None:
                rec_gather.end = self.log.mark(comm)

    def before_block(self, block: int) -> None:
        self.check_usable()
        try:
            super().before_block(block)
        except Exception as e:
            self.mark_failed(f"{type(e).__name__}: {e}")
            raise

    def after_block(self, block: int) -> None:
        try:
            super().after_block(block)
        except Exception as e:
            self.mark_failed(f"{type(e).__name__}: {e}")
            raise

    def _resync(self) -> None:
        # A forward stopped between streamed blocks: other ranks may have issued
        # more gathers than this one, so re-priming could pair wrong collectives.
        self.mark_failed(f"a forward stopped part-way through the streamed blocks (at position {self.position}, "
                         f"block {self.blocks[self.schedule.block_at(self.position)].name!r})")
        self.check_usable()

    def side_streams(self) -> list:
        return super().side_streams() + ([self.comm_stream] if self.streams is not None else [])

    def reset(self) -> None:
        # Re-priming on one rank alone (e.g. after a capture failed there) would
        # issue gathers its peers do not: stop instead of desynchronising them.
        self.mark_failed(f"the ring had to be reset at position {self.position} (a failed graph capture "
                         "or an interrupted step); under AllGather every rank must reset together")
        self.check_usable()

    def step_interrupted(self, exc: BaseException | None) -> None:
        """Called after the model's forward; marks the backend unusable when it
        stopped between streamed blocks."""
        if self.position % self.schedule.n == 0:
            return
        cause = f"{type(exc).__name__}: {exc}" if exc is not None else "the forward returned early"
        self.mark_failed(f"{cause} (the forward stopped after {self.position % self.schedule.n} of "
                         f"{self.schedule.n} streamed blocks)")

    def synchronize(self) -> None:
        if self.streams is not None:
            self.comm_stream.synchronize()
        super().synchronize()

    def gather_image(self, k: int) -> torch.Tensor:
        """Block ``k``'s full image in a fresh device tensor (a collective; outside the hot path)."""
        sb = self.store.shard_bytes[k]
        full = torch.empty(self.world * sb, dtype=torch.uint8, device=self.device)
        shard = torch.empty(sb, dtype=torch.uint8, device=self.device)
        copy_from_image(shard, self.store.image(k))  # the gather below is ordered after it
        self.all_gather(full, shard)
        return full

    def remove(self) -> None:
        super().remove()
        self.shard_slots = []


# --------------------------------------------------------------------------- backends
class _DLOStreamedBlocks(StreamedBlocks):
    """Shared part of the two DLO backends (stats, failure hooks)."""

    # a DLO step keeps its boundary loads (gathers) inside the graph: 'auto' is 'in-graph'
    supports_next_step = False

    def __init__(self, module, config, device, plan, parallel: ParallelConfig, dlo: DLOPlan):
        if config.graph_boundary_loads == "next-step":
            # a DLO step keeps its boundary loads (gathers) inside the graph, as
            # verified on 2x H200; the next-step variant is not verified with collectives
            raise ValueError(
                f"graph_boundary_loads={config.graph_boundary_loads!r} is not supported with distributed "
                "layerwise offload (DLO); choose: auto (in-graph under DLO), in-graph"
            )
        self.parallel, self.dlo = parallel, dlo
        super().__init__(module, config, device, plan)
        self._root_hooks = [module.register_forward_pre_hook(self._before_forward)]

    def _before_forward(self, module, args):
        self.executor.check_usable()

    @property
    def transfer(self) -> str:
        return self.dlo.transfer

    @property
    def usable(self) -> bool:
        return self.executor.failure is None

    def stats(self) -> dict:
        s = super().stats()
        streamed = sum(lay.nbytes for lay in self.layouts)
        s.update(
            transfer=self.dlo.transfer,
            shard_group=self.dlo.dim,
            shard_group_size=self.dlo.group_size,
            shard_rank=self.dlo.rank,
            parallel=self.parallel.describe(),
            host_bytes=self.store.nbytes,
            pinned_host_gb_per_rank=self.store.pinned_bytes / 1e9,
            model_bytes=streamed + self.resident_bytes,
            h2d_bytes_per_step=self._h2d_bytes_per_step(),
            usable=self.executor.failure is None,
            failure=self.executor.failure,
        )
        return s

    def _h2d_bytes_per_step(self) -> int:
        return sum(lay.nbytes for lay in self.layouts)

    def _remove_root_hooks(self) -> None:
        for h in self._root_hooks:
            h.remove()
        self._root_hooks = []


class RankLocalStreamedBlocks(_DLOStreamedBlocks):
    """DLO without a weight collective: full blocks per rank, ordinary streaming."""

    def _build_executor(self) -> GuardedExecutor:
        return GuardedExecutor(self.blocks, self.store, self.schedule, self.device,
                               record_events=self.config.record_events, streams=self.streams)

    def restore(self) -> nn.Module:
        self._remove_root_hooks()
        return super().restore()


class AllGatherStreamedBlocks(_DLOStreamedBlocks):
    """DLO AllGather: this rank keeps 1/N of every block image; blocks are gathered on the device."""

    def __init__(self, module, config, device, plan, parallel, dlo):
        super().__init__(module, config, device, plan, parallel, dlo)
        self._root_hooks.append(module.register_forward_hook(self._after_forward, always_call=True))

    def _after_forward(self, module, args, output):
        self.executor.step_interrupted(sys.exc_info()[1])

    def _build_store(self, layouts, tensors) -> ShardedStore:
        cfg, device, dlo = self.config, self.device, self.dlo
        pin_budget = cfg.pinned_memory_budget_gb
        store = ShardedStore(
            layouts, dlo.group_size, dlo.rank,
            pin=cfg.pin_memory and device.type == "cuda",
            budget_bytes=None if pin_budget is None else int(pin_budget * 1e9),
        )
        progress = Progress(f"packing this rank's 1/{dlo.group_size} share of {len(layouts)} blocks",
                            store.nbytes, cfg.progress)
        # The originals are released only once every share is packed: this rank
        # keeps 1/N of each block, so a failure part-way could not be undone
        # from the store (host memory peaks at model + model/N during setup).
        try:
            for k, ts in enumerate(tensors):
                store.pack(k, [t for _, _, t in ts])
                store.pin(k)
                progress.update(store.shard_bytes[k])
        except BaseException:
            store.close()
            raise
        for ts in tensors:
            drop_storage([t for _, _, t in ts], device)  # only this rank's share stays in host memory
        return store

    def _host_views(self) -> ShardedHostViews:
        return ShardedHostViews((id(t) for ts in self.tensors for _, _, t in ts), self.dlo.group_size)

    def _gather_mode(self) -> str:
        """"tensor" (all_gather_into_tensor) or "list" (all_gather into views of the
        output: the same bytes) where the backend lacks the former. NCCL: always "tensor"."""
        if self.dlo.backend == "nccl":
            return "tensor"
        # gloo gained all_gather_into_tensor late; probe once (same call on every rank)
        probe_out = torch.empty(self.dlo.group_size * TENSOR_ALIGN, dtype=torch.uint8, device=self.device)
        probe_in = torch.zeros(TENSOR_ALIGN, dtype=torch.uint8, device=self.device)
        try:
            _all_gather_tensor_fn()(probe_out, probe_in, group=self.dlo.group)
            return "tensor"
        except (RuntimeError, NotImplementedError):
            return "list"

    def _build_executor(self) -> AllGatherExecutor:
        return AllGatherExecutor(
            self.blocks, self.store, self.schedule, self.device, group=self.dlo.group,
            world=self.dlo.group_size, gather=self._gather_mode(), record_events=self.config.record_events,
            streams=self.streams,
        )

    def _h2d_bytes_per_step(self) -> int:
        return sum(self.store.shard_bytes)

    def stats(self) -> dict:
        s = super().stats()
        s["gather"] = self.executor.gather
        s["shard_bytes"] = sum(self.store.shard_bytes)
        return s

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = False) -> list[str]:
        """Write new weights: each rank keeps its share of streamed tensors; others in place.

        Call on every rank of the sharding group with the same weights: the
        slots already primed for the next step are re-gathered (a collective).
        """
        ex = self.executor
        ex.check_usable("update_weights()")
        current = self._current_for_update(state_dict, strict)
        where = {id(t): (k, spec) for k, ts in enumerate(self.tensors)
                 for (_, _, t), spec in zip(ts, self.layouts[k].tensors)}
        ex.synchronize()
        written = []
        with torch.no_grad():
            for key, new in state_dict.items():
                obj = current[key]
                loc = where.get(id(obj))
                if loc is None:
                    if tuple(new.shape) != tuple(obj.shape) or new.dtype != obj.dtype:
                        raise ValueError(f"update_weights: {key!r} is {new.dtype} {tuple(new.shape)}, the "
                                         f"model has {obj.dtype} {tuple(obj.shape)}")
                    obj.data.copy_(new)
                else:
                    k, spec = loc
                    if tuple(new.shape) != spec.shape or new.dtype != spec.dtype:
                        raise ValueError(f"update_weights: {key!r} is {new.dtype} {tuple(new.shape)}, the "
                                         f"model has {spec.dtype} {spec.shape}")
                    self.store.write(k, spec, new)
                written.append(key)
        ex.reload_pending()  # a collective: slots prefetched before the update hold old weights
        return written

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict on CPU (a collective: call on every rank of the sharding group)."""
        ex = self.executor
        ex.check_usable("gather_state_dict()")
        ex.synchronize()
        names = {id(t): name for name, t in self.module.state_dict(keep_vars=True).items()}
        out = {name: t.detach().to("cpu", copy=True) for name, t in self.module.state_dict(keep_vars=True).items()}
        with torch.no_grad():
            for k, ts in enumerate(self.tensors):
                full = ex.gather_image(k)
                for (_, _, t), spec in zip(ts, self.layouts[k].tensors):
                    if id(t) in names:
                        out[names[id(t)]] = spec.view_of(full).to("cpu", copy=True)
        return out

    def restore(self) -> nn.Module:
        """Full weights back on every rank's device (a collective: every rank gathers each block once)."""
        ex = self.executor
        ex.check_usable("disable()")
        self._remove_root_hooks()
        ex.synchronize()
        with torch.no_grad():
            for k, ts in enumerate(self.tensors):
                full = ex.gather_image(k)
                for (_, _, t), spec in zip(ts, self.layouts[k].tensors):
                    t.data = spec.view_of(full).clone()
                del full
        ex.remove()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.store.close()
        self.host_views.clear()
        return self.module


# --------------------------------------------------------------------------- request waves
def _path_value(key: str, v: Any):
    if key in _PRESENCE_KEYS:
        return v is not None and not (isinstance(v, (str, list, tuple)) and len(v) == 0)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return tuple(_path_value(key, x) for x in v)
    return (type(v).__name__, repr(v))


def _wave_summary(request: Any, path_keys) -> dict:
    try:
        if not isinstance(request, Mapping):
            return {"error": f"the request is a {type(request).__name__}, not a dict"}
        steps = request.get("num_inference_steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
            steps = ("invalid", repr(steps))
        elif isinstance(steps, int) and steps < 1:
            steps = ("invalid", repr(steps))
        return {"steps": steps, "path": {k: _path_value(k, request.get(k)) for k in path_keys}}
    except Exception as e:  # report locally broken requests on every rank, never hang
        return {"error": f"{type(e).__name__}: {e}"}


def _show(v) -> str:
    return "missing" if v is None else repr(v)


def validate_wave(request: Mapping, parallel: ParallelConfig, *, transfer: str | None = None,
                  path_keys=DEFAULT_PATH_KEYS) -> int | None:
    """Check that a DP request wave can run DLO AllGather in lock-step.

    Call on every rank of the DP group, with this rank's request (the
    pipeline's keyword arguments), before its first forward. With AllGather
    and ``dp > 1`` this does one small collective (``all_gather_object`` over
    the DP group; with NCCL the current CUDA device must be this rank's) and
    raises the same ``ValueError`` on every rank when ``num_inference_steps``
    is missing/None/invalid on any rank or differs, or when an argument in
    ``path_keys`` differs. Returns the wave's step count, or None (without a
    collective) for rank-local transfer or ``dp == 1``.

    ``transfer``: "allgather" | "rank-local" | None (the DLO default for
    ``parallel``: allgather when the sharding group has more than one rank).
    """
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
    if transfer is None:
        transfer = "allgather" if parallel.shard_size > 1 else "rank-local"
    if transfer not in ("allgather", "rank-local"):
        raise ValueError(f"transfer={transfer!r} is not allowed; choose from: allgather, rank-local")
    if transfer == "rank-local" or parallel.dp <= 1:
        return None
    group, size, _ = _resolve_group(parallel, "dp")
    path_keys = tuple(path_keys)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, _wave_summary(request, path_keys), group=group)
    errors = []
    broken = [(r, s["error"]) for r, s in enumerate(gathered) if "error" in s]
    for r, msg in broken:
        errors.append(f"dp rank {r}: {msg}")
    good = [(r, s) for r, s in enumerate(gathered) if "error" not in s]
    missing = [r for r, s in good if s["steps"] is None]
    invalid = [(r, s["steps"][1]) for r, s in good if isinstance(s["steps"], tuple)]
    if missing:
        errors.append(f"num_inference_steps is missing (or None) on dp rank(s) {missing}")
    for r, v in invalid:
        errors.append(f"num_inference_steps={v} on dp rank {r} is not a positive int")
    values = {r: s["steps"] for r, s in good if isinstance(s["steps"], int)}
    if len(set(values.values())) > 1:
        errors.append("num_inference_steps differs across the wave (" +
                      ", ".join(f"dp rank {r}: {v}" for r, v in values.items()) + ")")
    for key in path_keys:
        seen = {r: s["path"][key] for r, s in good}
        if len(set(map(repr, seen.values()))) > 1:
            errors.append(f"{key} differs across the wave (" +
                          ", ".join(f"dp rank {r}: {_show(v)}" for r, v in seen.items()) + ")")
    if errors:
        raise ValueError(
            f"request wave rejected before any weight collective (DLO AllGather over dp={size}): "
            + "; ".join(errors)
            + ". Every request in the wave needs an explicit, equal num_inference_steps and identical "
              f"{', '.join(path_keys)}; or use layer_options.dit.weight_transfer='rank-local'"
        )
    return next(iter(values.values()))
