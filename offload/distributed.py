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
rank).

Trust (DESIGN.md: nothing lost, no hang; every rank learns of a failure):

- Setup: before anything is packed, one bounded collective compares every
  rank's config (weight_transfer, num_slots, resident_layers, cuda_graphs,
  graph_boundary_loads), block layout, dtypes and, with ``dlo_verify_weights``
  (default), a digest of a few KB sampled from every block's weights; a
  difference raises the same ``ValueError`` on every rank, naming both values
  ("rank 1 num_slots=3, rank 0 num_slots=2", or the block). Rank-local DLO
  takes part too when its sharding group is initialised.
- Every DLO wait is bounded by ``dlo_timeout_s`` (default 60 s): gloo waits
  with ``Work.wait(timeout)``, NCCL control collectives poll
  ``Work.is_completed()``. A timeout raises :class:`DLOCollectiveError`.
- AllGather, an exception inside the model (the same on every rank or on one):
  the rank that stopped issues the rest of the step's gathers from its intact
  host shards (no compute), so every rank issued the same collectives; then
  one small agreement at the end of every eager step tells each rank whether
  any rank failed in it, and the ranks that did not raise a ``RuntimeError``
  naming the failed rank and its error. The ring stays in step: the next
  forward runs normally, and ``gather_state_dict()`` / ``disable()`` work.
  (On NCCL the agreement waits on the host for the step's work: one
  synchronisation per eager step.)
- A failed or timed-out collective marks the backend unusable: no further
  collective is issued (a timed-out gloo operation stays pending and would
  pair with the next one; a size mismatch aborts the process; an NCCL one
  blocks its communicator). Forwards, ``gather_state_dict()`` and
  ``disable()`` then raise at once, naming the way out:
  ``local_state_dict()`` on every rank (no collective: tensors wholly in this
  rank's share, :class:`ShardPiece` for the rest) and :func:`merge_shards` of
  them is the full state dict.
- A CUDA-graph capture is kept only when it succeeded on every rank (one
  small agreement per capture); otherwise every rank resets to the captured
  step's start and runs it eagerly.

Request waves: with AllGather and ``dp > 1`` every DP rank computes its own
request in lock-step collectives, so a wave needs an explicit, equal
``num_inference_steps`` and identical path-affecting arguments on every rank;
:func:`validate_wave` checks that with one small collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from .config import OffloadConfig
from .discovery import OffloadPlan
from .executor import LayerwiseExecutor, _Record
from .host_store import HostStore, Progress, copy_from_image
from .layout import TENSOR_ALIGN, BlockLayout, TensorSpec
from .schedule import Load
from .streamed import StreamedBlocks, drop_storage
from .dlo_control import (  # noqa: F401  (re-exported: distributed.py stays the DLO entry module)
    _AGREE_MAGIC, _CONTROL_CAP, _DIGEST_SAMPLE_BYTES, _STATUS_BYTES, _STATUS_INTS, DEFAULT_PATH_KEYS,
    DLOCollectiveError, ShardPiece, _Control, _control_for, _layout_digest, _weight_digest, bounded_wait,
    digest_mismatches, fit_digest, merge_shards, setup_digest, validate_wave,
)
from .dlo_topology import DLOPlan, ParallelConfig, _resolve_group, plan_dlo, resolve_transfer, shard_size  # noqa: F401


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
    "DLOCollectiveError",
    "ShardPiece",
    "merge_shards",
]


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
                 gather: str = "tensor", record_events: bool = False, control: _Control | None = None,
                 timeout_s: float = 60.0, streams=None):
        if gather not in ("tensor", "list"):
            raise ValueError(f"gather={gather!r} is not allowed; choose from: tensor, list")
        self.group, self.world, self.gather = group, world, gather
        self.control, self.timeout_s = control, timeout_s
        self.ncoll = 0  # DLO collectives this rank issued eagerly on the group (compared to recover)
        self._reset_to: int | None = None  # step start every rank agreed to reset to (a capture failed somewhere)
        self._capture_start = 0
        self._forward_start = 0  # position when the current forward began
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

    @property
    def capture_tag(self):
        return self._capture_tag

    @capture_tag.setter
    def capture_tag(self, tag) -> None:
        # a capture starts at a step boundary: where every rank resets to if it fails on any
        if tag is not None and getattr(self, "_capture_tag", None) is None:
            self._capture_start = self.position
        self._capture_tag = tag

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
            work = self.all_gather(full, shard, async_op=True)
            self.ncoll += 1
            bounded_wait(work, self.timeout_s, f"the gather of block {self.blocks[load.block].name!r}")
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
            self.ncoll += self.capture_tag is None  # a captured gather runs at replay, on every rank alike
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
        # Re-priming on one rank alone would issue gathers its peers do not: only a
        # reset every rank agreed to (agree_capture) runs; anything else stops.
        if self._reset_to is None:
            self.mark_failed(f"the ring had to be reset at position {self.position} (a failed graph capture "
                             "or an interrupted step); under AllGather every rank must reset together")
            self.check_usable()
        target, self._reset_to = self._reset_to, None
        self.synchronize()
        self._to_step_boundary()
        self.position = target
        self.capture_tag = None
        self.reload_pending()  # the same gathers, in the same order, on every rank

    # -- decisions every rank takes together (bounded by dlo_timeout_s) --------------
    def _agree(self, flag: bool, what: str, note: str = "") -> list[dict]:
        """Every rank's position, collectives issued, ``flag`` and ``note``: one small collective."""
        rows = self.control.status([self.position, self.ncoll, int(flag)], note, f"the DLO agreement on {what}")
        self.ncoll += 1
        return [{"position": r[0], "ncoll": r[1], "flag": bool(r[2]), "note": n} for r, n in rows]

    def agree_capture(self, ok: bool) -> bool:
        """Capture succeeded on every rank? One small collective per capture; when it did
        not everywhere, every rank resets to the captured step's start and runs it eagerly."""
        try:
            rows = self._agree(not ok, "a CUDA-graph capture")
        except DLOCollectiveError as e:
            self.mark_failed(str(e))
            raise
        agreed = not any(r["flag"] for r in rows)
        if not agreed:
            self._reset_to = self._capture_start
        return agreed

    def begin_forward(self) -> None:
        self._forward_start = self.position

    def end_forward(self, exc: BaseException | None) -> None:
        """After every eager forward: a rank that stopped part-way first issues the
        step's remaining gathers (its host shards are intact), so every rank issued
        the same collectives; then one small agreement: when any rank raised in
        this step, every rank that did not raises too. The ring stays in step and
        usable. A failed collective instead marks the backend unusable."""
        if self.capture_tag is not None or self.failure is not None:
            return  # a capture (agree_capture decides) or no collective may run any more
        if exc is None and self._bound is None and self.position % self.schedule.n and \
                self.position != self._forward_start:
            self.finish_step()  # its last blocks were skipped by design (SD3 skip_layers): not a failure
        stopped = exc is not None or self.position % self.schedule.n != 0 or self.position == self._forward_start
        note = ""
        if stopped:
            note = (f"{type(exc).__name__}: {exc}" if exc is not None else "the forward returned early") + (
                f" (after {self.position - self._forward_start} of {self.schedule.n} streamed blocks)")
            try:
                self._drain()
            except Exception as e:
                self.mark_failed(f"{type(e).__name__}: {e} (completing the step's gathers after: {note})")
                raise
        try:
            rows = self._agree(stopped, "the end of a step", note)
        except DLOCollectiveError as e:
            self.mark_failed(str(e))
            raise
        if len({(r["position"], r["ncoll"]) for r in rows}) > 1:
            self.mark_failed("the ranks are out of step after a step (" + ", ".join(
                f"rank {i}: position {r['position']}, {r['ncoll']} collectives" for i, r in enumerate(rows)) + ")")
            self.check_usable()
        failed = [(i, r["note"]) for i, r in enumerate(rows) if r["flag"]]
        if failed and exc is None:
            raise RuntimeError(
                "weightstream DLO (allgather): this step failed on " + "; ".join(
                    f"rank {i}: {n}" for i, n in failed)
                + ". This rank's output of the step is discarded; every rank completed the step's gathers, "
                "so the next forward runs normally"
            )

    def _drain(self) -> None:
        """Issue the gathers the rest of this step would have issued (no compute)."""
        n, p = self.schedule.n, self.position
        end = p + n if p == self._forward_start else -(-p // n) * n
        if not self._primed:
            self._prime()
        if self._bound is not None:
            self._unbind(self._bound)
        self._late = None
        if self.streams is not None:  # after whatever compute the step did launch
            for side in self.side_streams():
                side.wait_stream(self.streams.current_stream(self.device))
        for q in range(p, end):
            nxt = self.schedule.after_compute(q)
            if nxt is not None:
                self._issue(nxt, wait_free=False)
        self.position = end

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
        work = self.all_gather(full, shard, async_op=True)
        self.ncoll += 1
        bounded_wait(work, self.timeout_s, f"the gather of block {self.store.layouts[k].name!r}", poll=self.cuda)
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
        self.control = _control_for(parallel, dlo, config, device)
        super().__init__(module, config, device, plan)
        self._root_hooks = [module.register_forward_pre_hook(self._before_forward)]

    def _before_forward(self, module, args):
        self.executor.check_usable()

    def _check_peers(self, layouts, tensors) -> None:
        """One bounded collective before anything is packed: every rank of the group must
        agree on the config, the block layout and (dlo_verify_weights) sampled weights."""
        if self.control is None:
            return
        try:
            mine = fit_digest(setup_digest(self.config, self.dlo, layouts, tensors, len(self.blocks)))
        except Exception as e:  # tell the peers rather than leave them waiting
            mine = {"error": f"{type(e).__name__}: {e}"}
        digests = self.control.gather_json(mine, "the DLO setup check")
        errors = [f"rank {r}: {d['error']}" for r, d in enumerate(digests) if "error" in d]
        errors += digest_mismatches([d for d in digests]) if not errors else []
        if errors:
            raise ValueError(
                f"distributed layerwise offload (DLO) over {self.control.world} ranks: "
                "the ranks disagree at setup: " + "; ".join(errors)
                + ". Every rank of the sharding group needs the same config, model and weights"
            )

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

    def _build_store(self, layouts, tensors):
        self._check_peers(layouts, tensors)
        return super()._build_store(layouts, tensors)

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

    def _before_forward(self, module, args):
        super()._before_forward(module, args)
        self.executor.begin_forward()

    def _after_forward(self, module, args, output):
        self.executor.end_forward(sys.exc_info()[1])

    def _build_store(self, layouts, tensors) -> ShardedStore:
        self._check_peers(layouts, tensors)
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
            work = _all_gather_tensor_fn()(probe_out, probe_in, group=self.dlo.group, async_op=True)
        except (RuntimeError, NotImplementedError):
            return "list"
        bounded_wait(work, self.config.dlo_timeout_s, "the DLO gather probe")
        return "tensor"

    def _build_executor(self) -> AllGatherExecutor:
        return AllGatherExecutor(
            self.blocks, self.store, self.schedule, self.device, group=self.dlo.group,
            world=self.dlo.group_size, gather=self._gather_mode(), record_events=self.config.record_events,
            control=self.control, timeout_s=self.config.dlo_timeout_s, streams=self.streams,
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

    def _ready_to_gather(self, what: str) -> None:
        """After a failed collective no further one is issued: a timed-out gloo
        operation stays pending and would pair with the next collective (a size
        mismatch aborts the process), an NCCL one blocks its communicator. The
        host shards are intact, so the way out is rank-local."""
        ex = self.executor
        if ex.failure is not None:
            raise RuntimeError(
                f"{what} is a collective, and this rank's DLO collectives stopped after a failure "
                f"({ex.failure}). The host shards are intact: call local_state_dict() on every rank (no "
                "collective) and join them with weightstream.offload.distributed.merge_shards([...])"
            )

    def _gather_images(self, what: str) -> list[torch.Tensor]:
        self._ready_to_gather(what)
        ex = self.executor
        ex.synchronize()
        return [ex.gather_image(k) for k in range(len(self.tensors))]

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict on CPU (a collective: call on every rank of the sharding group).

        Also after a failure: when every rank calls it and the ranks issued the
        same collectives, it gathers the host shards; otherwise it raises and
        names :meth:`local_state_dict`."""
        names = {id(t): name for name, t in self.module.state_dict(keep_vars=True).items()}
        out = {name: t.detach().to("cpu", copy=True) for name, t in self.module.state_dict(keep_vars=True).items()}
        fulls = self._gather_images("gather_state_dict()")
        with torch.no_grad():
            for k, ts in enumerate(self.tensors):
                for (_, _, t), spec in zip(ts, self.layouts[k].tensors):
                    if id(t) in names:
                        out[names[id(t)]] = spec.view_of(fulls[k]).to("cpu", copy=True)
        return out

    def local_state_dict(self) -> dict:
        """This rank's weights with no collective (usable after any failure).

        Non-streamed tensors as in ``state_dict()``; a streamed tensor that lies
        wholly in this rank's share of its block is a CPU tensor; any other is a
        :class:`ShardPiece` holding the bytes this rank has (possibly none).
        ``merge_shards`` of every rank's result is the full state dict."""
        where = {id(t): (k, spec) for k, ts in enumerate(self.tensors)
                 for (_, _, t), spec in zip(ts, self.layouts[k].tensors)}
        out = {}
        # resident tensors are read on a stream of their own: after a timed-out
        # gather the compute stream may wait forever on the stuck collective
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for name, t in self.module.state_dict(keep_vars=True).items():
                loc = where.get(id(t))
                out[name] = t.detach().to("cpu", copy=True) if loc is None else self._local_piece(name, *loc)
        return out

    def _local_piece(self, name: str, k: int, spec: TensorSpec):
        lo, hi = self.store.range(k)
        a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
        whole = dataclasses.replace(spec, offset=0)
        if a == spec.offset and b == spec.offset + spec.nbytes:
            return dataclasses.replace(spec, offset=spec.offset - lo).view_of(self.store.image(k)).clone()
        data = self.store.image(k)[a - lo : b - lo].clone() if a < b else torch.empty(0, dtype=torch.uint8)
        return ShardPiece(name, whole, max(0, a - spec.offset), data)

    def restore(self) -> nn.Module:
        """Full weights back on every rank's device (a collective: every rank gathers each block once).

        Also after a failure, under the rule of :meth:`gather_state_dict`; every
        block is gathered before any tensor changes, so a failure part-way
        leaves the backend as it was."""
        ex = self.executor
        fulls = self._gather_images("disable()")
        self._remove_root_hooks()
        with torch.no_grad():
            for k, ts in enumerate(self.tensors):
                for (_, _, t), spec in zip(ts, self.layouts[k].tensors):
                    t.data = spec.view_of(fulls[k]).clone()
        del fulls
        ex.remove()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.store.close()
        self.host_views.clear()
        return self.module


