"""Distributed layerwise offload (DLO) over an existing ``torch.distributed`` topology.

DLO never creates process groups: the caller owns the topology and describes
it with a :class:`ParallelConfig` (sizes and groups of DP, SP, TP, HSDP).
The weight-sharding group is the DP group when ``dp > 1``, else the SP group
when ``sp > 1``, else none (rank-local). TP is never used for it.

Two weight transfers (``layer_options.dit.weight_transfer``):

``allgather``
    Each rank packs and pins only its ``1/N`` share of every block image
    (:class:`~.sources.dlo.ShardSource`); a load is the shard's H2D, then an
    all-gather into the block slot. Host memory per rank is about model / N.

``rank-local``
    Full blocks per rank through the ordinary :class:`LayerwiseExecutor`; no
    DLO collective. TP-local or HSDP-local tensors stream as they are.

With ``weight_codec='exp-k'`` AllGather keeps 1/N of every block's *coded*
image per rank (:class:`~.sources.dlo.ShardSource` over coded shares: H2D of the coded
shard, all-gather of coded bytes, one decode into the slot), and rank-local
streams full coded blocks (:class:`~.sources.pinned.CodedSource`). Coded shards
are not a plain share of the weights: ``local_state_dict()`` holds
:class:`CodedPiece` values, which :func:`merge_shards` joins and decodes.

Both prime their first loads at the first forward (in the same order on every
rank).

Trust (DESIGN.md: nothing lost, no hang; every rank learns of a failure):

- Setup: before anything is packed, one bounded collective compares every
  rank's config (weight_transfer, num_slots, resident_layers, cuda_graphs,
  graph_boundary_loads), block layout, dtypes, the names and shapes of the
  resident tensors and, with ``dlo_verify_weights`` (default), an exact digest
  of every byte of every streamed block and resident tensor (SHA-1, hashed on
  worker threads); a difference raises the same ``ValueError`` on every rank,
  naming both values ("rank 1 num_slots=3, rank 0 num_slots=2", or the first
  block and tensor whose weights differ, found with at most two more small
  collectives). Rank-local DLO takes part too when its sharding group is
  initialised.
- Every DLO wait is bounded by ``dlo_timeout_s`` (default 60 s): gloo waits
  with ``Work.wait(timeout)``, NCCL control collectives poll
  ``Work.is_completed()``. A timeout raises :class:`DLOCollectiveError`.
- AllGather, an exception of any type inside the model (the same on every rank
  or on one; a ``KeyboardInterrupt``, ``SystemExit`` or cancellation too: the
  wrapper reports those, which torch's ``always_call`` hooks never see, through
  ``StreamedBlocks.forward_aborted``): the rank that stopped issues the rest of
  the step's gathers from its intact host shards (no compute), so every rank
  issued the same collectives; then one small agreement at the end of every
  eager step tells each rank whether any rank failed in it; the rank that
  stopped re-raises its own exception, the ranks that did not raise a
  ``RuntimeError`` naming the failed rank and its error. The ring stays in
  step: the next forward runs normally, and ``gather_state_dict()`` /
  ``disable()`` work. (On NCCL the agreement waits on the host for the step's
  work: one synchronisation per eager step.)
- A transfer cut short part-way (a ``KeyboardInterrupt`` inside a load's H2D,
  gather or decode, or inside a gather outside a forward), or a forward that
  ended without its end-of-step agreement, ends the backend on that rank,
  named: its collective may or may not have run, and the slot it was filling
  is never decoded into or read. Its peers' next collective fails within
  ``dlo_timeout_s``.
- A failed or timed-out collective marks the backend unusable: no further
  collective is issued (a timed-out gloo operation stays pending and would
  pair with the next one; a size mismatch aborts the process; an NCCL one
  blocks its communicator). Forwards, ``gather_state_dict()`` and
  ``disable()`` then raise at once, naming the way out:
  ``local_state_dict()`` on every rank (no collective: tensors wholly in this
  rank's share, :class:`ShardPiece` for the rest, :class:`CodedPiece` for coded
  tensors) and :func:`merge_shards` of them is the full state dict, whatever the
  codec (coded pieces are decoded on the CPU); pieces it cannot join raise
  :class:`ShardMergeError`.
- A CUDA-graph capture is kept only when it succeeded on every rank (one
  small agreement per capture); otherwise every rank resets to the captured
  step's start and runs it eagerly.

Request waves: with AllGather and ``dp > 1`` every DP rank computes its own
request in lock-step collectives, so a wave needs an explicit, equal
``num_inference_steps`` and identical path-affecting arguments on every rank;
:func:`validate_wave` checks that with one small collective.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .config import OffloadConfig
from .discovery import OffloadPlan
from .host.quantized import expand
from weightstream.offload.dlo.guard import AllGatherGuard, DLOGuard
from .sources.dlo import ShardSource
from .build import default_source, streamed_blocks
from .sources.pinned import SourceRequest
from .sources.select import Topology, select
from .streamed import StreamedBlocks
from weightstream.offload.dlo.control import DEFAULT_PATH_KEYS, CodedPiece, DLOCollectiveError, ShardMergeError, ShardPiece, WeightDigest, _control_for, digest_mismatches, fit_digest, merge_shards, setup_digest, validate_wave, weight_mismatches
from weightstream.offload.dlo.topology import DLOPlan, ParallelConfig, plan_dlo, resolve_transfer, shard_size


__all__ = [
    "ParallelConfig",
    "DLOPlan",
    "plan_dlo",
    "resolve_transfer",
    "build_streamed",
    "validate_wave",
    "shard_size",
    "ShardSource",
    "DEFAULT_PATH_KEYS",
    "DLOCollectiveError",
    "ShardPiece",
    "CodedPiece",
    "ShardMergeError",
    "merge_shards",
]


def build_streamed(module: nn.Module, config: OffloadConfig, device: torch.device,
                   plan: OffloadPlan | None, parallel: ParallelConfig, *, dlo: DLOPlan | None = None,
                   cls: type = StreamedBlocks, source_cls: type | None = None) -> StreamedBlocks:
    """The DLO backend of ``OffloadedTransformer(..., parallel=...)``: the one
    StreamedBlocks with a DLO source (AllGather shards, or rank-local pinned
    images) and a DLO guard. ``dlo``, ``cls`` and ``source_cls`` let tests run it
    over a fake group. ``weight_codec != 'none'``: AllGather streams coded shards
    (:class:`ShardSource`), rank-local full coded blocks (:class:`CodedSource`).

    All compatibility rules are checked before any tensor is touched.
    """
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(f"parallel must be a weightstream ParallelConfig, got {type(parallel).__name__}")
    if source_cls is None:
        source_cls = ShardSource  # raw or coded shares (weight_codec)
    if dlo is None:
        dlo = plan_dlo(config, parallel, device)
    if config.graph_boundary_loads == "next-step":
        # a DLO step keeps its boundary loads (gathers) inside the graph, as
        # verified on 2x H200; the next-step variant is not verified with collectives
        raise ValueError(
            f"graph_boundary_loads={config.graph_boundary_loads!r} is not supported with distributed "
            "layerwise offload (DLO); choose: auto (in-graph under DLO), in-graph"
        )
    selection = select(config, Topology(dlo.group_size, dlo.rank, dlo.transfer, device.type))  # the support matrix
    control = _control_for(parallel, dlo, config, device)
    allgather = selection.transport == "dlo-allgather"
    guard = AllGatherGuard(control) if allgather else DLOGuard()

    def source(req: SourceRequest):
        _check_peers(control, config, dlo, req, module)
        if not allgather:
            return default_source(selection)(req)
        guard.source = source_cls(req, group=dlo.group, world=dlo.group_size, rank=dlo.rank,
                                  gather=source_cls.gather_mode(dlo, config.dlo_timeout_s, device),
                                  timeout_s=config.dlo_timeout_s,
                                  failure=lambda: guard.failure)
        return guard.source

    sb = streamed_blocks(module, config, device, plan, selection, source=source, guard=guard, prime="first_forward",
                         next_step=False, cls=cls)
    sb.parallel, sb.dlo, sb.control = parallel, dlo, control
    sb.add_stats(lambda: _dlo_stats(sb))
    sb.add_root_hook(DLOForwardCheck(sb))
    if allgather:
        sb.add_forward_end(f"weightstream.dlo_end_of_step[{type(module).__name__}]",
                           functools.partial(_end_forward, sb, guard))
    return sb


class DLOForwardCheck:
    """Named, removable forward pre-hook on the DiT, ahead of the executor's own (``prepend``:
    those may issue loads): before every forward, a DLO backend that failed stops here, named,
    before any transfer or collective; under AllGather the guard notes where the step starts and
    refuses a ring left out of step (:meth:`AllGatherGuard.begin_forward`)."""

    def __init__(self, sb: StreamedBlocks):
        self.name = f"weightstream.dlo_check[{type(sb.module).__name__}]"
        self._sb = sb
        self._handle = sb.module.register_forward_pre_hook(self, prepend=True)

    def __call__(self, module, args) -> None:
        ex = self._sb.executor
        ex.acquire()  # another thread inside: ConcurrentUseError before anything here changes
        ex.release()
        ex.check_usable()
        if self._sb.guard.collective:
            self._sb.guard.begin_forward(ex)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __repr__(self) -> str:
        return f"DLOForwardCheck({self.name}, {'removed' if self._handle is None else 'active'})"


def _end_forward(sb: StreamedBlocks, guard: AllGatherGuard, exc: BaseException | None) -> None:
    """At the end of every forward, however it ended (``exc``: what it raised, or None; a
    KeyboardInterrupt or any other BaseException too, through StreamedBlocks.forward_aborted):
    the end-of-step agreement; then, where every rank completed the step, weight_codec='auto'
    plans and codes (the same collectives on every rank: offload/plan/auto.py).

    After a BaseException that is not an Exception this raises nothing of its own: the rank
    re-raises what stopped it (a failure of the drain or the agreement is kept, sticky, and
    named by the next call)."""
    planner = sb.auto_step
    try:
        guard.end_forward(sb.executor, exc)
    except BaseException as e:
        if planner is not None:
            planner.discard()
        if isinstance(e, Exception) and exc is not None and not isinstance(exc, Exception):
            return
        raise
    if planner is None:
        return
    if exc is None and sb.executor.capture_tag is None:
        planner.after_agreed_step()
    else:
        planner.discard()


def _check_peers(control, config, dlo, req: SourceRequest, module: nn.Module) -> None:
    """One bounded collective before anything is packed: every rank of the group must agree
    on the config, the block layout and (dlo_verify_weights) every byte of the weights;
    where the weights differ, at most two more small collectives name the first block and
    tensor that differ (the same on every rank: each decides from the gathered digests)."""
    if control is None:
        return
    weights = None
    try:
        resident = _resident_tensors(module, req)
        weights = WeightDigest.of(req.layouts, req.tensors, resident) if config.dlo_verify_weights else None
        mine = fit_digest(setup_digest(config, dlo, req.layouts, req.schedule.num_blocks, resident, weights,
                                         req.codec))
    except Exception as e:  # tell the peers rather than leave them waiting
        mine = {"error": f"{type(e).__name__}: {e}"}
    digests = control.gather_json(mine, "the DLO setup check")
    errors = [f"rank {r}: {d['error']}" for r, d in enumerate(digests) if "error" in d]
    errors += digest_mismatches(digests) if not errors else []
    if not errors and weights is not None:
        errors += weight_mismatches(control, weights, digests)
    if errors:
        raise ValueError(
            f"distributed layerwise offload (DLO) over {control.world} ranks: "
            "the ranks disagree at setup: " + "; ".join(errors)
            + ". Every rank of the sharding group needs the same config, model and weights"
        )


def _resident_tensors(module: nn.Module, req: SourceRequest) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` outside the streamed blocks, by name (tied ones once)."""
    streamed = {id(t) for ts in req.tensors for _, _, t in ts}
    out, seen = {}, set()
    named = [*module.named_parameters(), *module.named_buffers()]
    for name, _, t in [e for n, o in named for e in expand(n, "", o)]:  # tensor subclasses: inner tensors
        if id(t) not in streamed and id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _dlo_stats(sb: StreamedBlocks) -> dict:
    dlo, src = sb.dlo, sb.source.stats()
    return dict(
        transfer=dlo.transfer,
        shard_group=dlo.dim,
        shard_group_size=dlo.group_size,
        shard_rank=dlo.rank,
        parallel=sb.parallel.describe(),
        pinned_host_gb_per_rank=src["pinned_bytes"] / 1e9,
        model_bytes=sum(lay.nbytes for lay in sb.layouts) + sb.resident_bytes,
        usable=sb.executor.failure is None,
        failure=sb.executor.failure,
    )
