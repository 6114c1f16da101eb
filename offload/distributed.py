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
image per rank (:class:`~.sources.dlo_coded.CodedShardSource`: H2D of the coded
shard, all-gather of coded bytes, one decode into the slot), and rank-local
streams full coded blocks (:class:`~.sources.coded.CodedSource`). Coded shards
are not a plain share of the weights: ``local_state_dict()`` holds
:class:`~.sources.dlo_coded.CodedPiece` values, joined by
:func:`~.sources.dlo_coded.merge_coded_shards`.

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

import sys

import torch
from torch import nn

from .config import OffloadConfig
from .discovery import OffloadPlan
from .dlo_guard import AllGatherGuard, DLOGuard
from .sources.dlo import ShardedHostViews, ShardedStore, ShardSource, _all_gather_tensor_fn  # noqa: F401  (re-exported)
from .sources.pinned import SourceRequest, pinned_source
from .sources.coded import coded_source
from .sources.dlo_coded import CodedShardSource
from .streamed import StreamedBlocks
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
    "ShardSource",
    "DEFAULT_PATH_KEYS",
    "DLOCollectiveError",
    "ShardPiece",
    "merge_shards",
]


def build_streamed(module: nn.Module, config: OffloadConfig, device: torch.device,
                   plan: OffloadPlan | None, parallel: ParallelConfig, *, dlo: DLOPlan | None = None,
                   cls: type = StreamedBlocks, source_cls: type | None = None) -> StreamedBlocks:
    """The DLO backend of ``OffloadedTransformer(..., parallel=...)``: the one
    StreamedBlocks with a DLO source (AllGather shards, or rank-local pinned
    images) and a DLO guard. ``dlo``, ``cls`` and ``source_cls`` let tests run it
    over a fake group. ``weight_codec != 'none'``: AllGather streams coded shards
    (:class:`CodedShardSource`), rank-local full coded blocks (:class:`CodedSource`).

    All compatibility rules are checked before any tensor is touched.
    """
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(f"parallel must be a weightstream ParallelConfig, got {type(parallel).__name__}")
    coded = config.weight_codec != "none"
    if source_cls is None:
        source_cls = CodedShardSource if coded else ShardSource
    if dlo is None:
        dlo = plan_dlo(config, parallel, device)
    if config.graph_boundary_loads == "next-step":
        # a DLO step keeps its boundary loads (gathers) inside the graph, as
        # verified on 2x H200; the next-step variant is not verified with collectives
        raise ValueError(
            f"graph_boundary_loads={config.graph_boundary_loads!r} is not supported with distributed "
            "layerwise offload (DLO); choose: auto (in-graph under DLO), in-graph"
        )
    control = _control_for(parallel, dlo, config, device)
    allgather = dlo.transfer == "allgather"
    guard = AllGatherGuard(control) if allgather else DLOGuard()

    def source(req: SourceRequest):
        _check_peers(control, config, dlo, req)
        if not allgather:
            return coded_source(req) if coded else pinned_source(req)
        guard.source = source_cls(req, group=dlo.group, world=dlo.group_size, rank=dlo.rank,
                                  gather=source_cls.gather_mode(dlo, config.dlo_timeout_s, device),
                                  timeout_s=config.dlo_timeout_s,
                                  failure=lambda: guard.failure)
        return guard.source

    sb = cls(module, config, device, plan, source=source, guard=guard, prime="first_forward", next_step=False)
    sb.parallel, sb.dlo, sb.control = parallel, dlo, control
    sb.add_stats(lambda: _dlo_stats(sb))
    sb.add_root_hook(module.register_forward_pre_hook(lambda m, a: _before_forward(sb)))
    if allgather:
        sb.add_root_hook(module.register_forward_hook(lambda m, a, o: _end_forward(sb, guard), always_call=True))
    return sb


def _end_forward(sb: StreamedBlocks, guard: AllGatherGuard) -> None:
    """The end-of-step agreement; then, where every rank completed the step, weight_codec='auto'
    plans and codes (the same collectives on every rank: offload/auto_codec_gather.py)."""
    exc = sys.exc_info()[1]
    planner = sb.codec_planner
    try:
        guard.end_forward(sb.executor, exc)
    except BaseException:
        if planner is not None:
            planner.discard()
        raise
    if planner is None:
        return
    if exc is None and sb.executor.capture_tag is None:
        planner.after_agreed_step()
    else:
        planner.discard()


def _before_forward(sb: StreamedBlocks) -> None:
    sb.executor.check_usable()
    if sb.guard.collective:
        sb.guard.begin_forward(sb.executor)


def _check_peers(control, config, dlo, req: SourceRequest) -> None:
    """One bounded collective before anything is packed: every rank of the group must
    agree on the config, the block layout and (dlo_verify_weights) sampled weights."""
    if control is None:
        return
    try:
        mine = fit_digest(setup_digest(config, dlo, req.layouts, req.tensors, req.schedule.num_blocks))
    except Exception as e:  # tell the peers rather than leave them waiting
        mine = {"error": f"{type(e).__name__}: {e}"}
    digests = control.gather_json(mine, "the DLO setup check")
    errors = [f"rank {r}: {d['error']}" for r, d in enumerate(digests) if "error" in d]
    errors += digest_mismatches([d for d in digests]) if not errors else []
    if errors:
        raise ValueError(
            f"distributed layerwise offload (DLO) over {control.world} ranks: "
            "the ranks disagree at setup: " + "; ".join(errors)
            + ". Every rank of the sharding group needs the same config, model and weights"
        )


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
