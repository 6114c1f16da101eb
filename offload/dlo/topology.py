"""DLO topology rules: pure functions of the config and the process groups.

Which group shards the host weights (DP, else SP, never TP), which transfer
runs (AllGather or rank-local), and the rejections (TP > 1, HSDP with
AllGather, ...), all before any tensor moves. No collectives here.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from weightstream.offload.config import OffloadConfig
from weightstream.offload.config_schema import _keeps_resident
from weightstream.offload.layout import TENSOR_ALIGN, align_up
from weightstream.offload.misuse import UnsupportedCombinationError

_DIMS = ("dp", "sp", "tp", "hsdp")


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
            raise UnsupportedCombinationError(
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

    Pure: reads only the two configs. Every rejection is an
    :class:`~..misuse.UnsupportedCombinationError` (a ``ValueError``) that names the
    values and the way out. An unset ``weight_transfer`` means
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
            raise UnsupportedCombinationError(
                f"{said} with tp={parallel.tp} is not allowed: DLO never all-gathers over tensor-parallel "
                f"ranks and would bypass the TP-aware weight layout; {fix} (TP-local tensors then stream as they are)"
            )
        if parallel.hsdp > 1:
            raise UnsupportedCombinationError(
                f"{said} with hsdp={parallel.hsdp} is not allowed: HSDP already shards the parameters, so a "
                f"DLO AllGather would double-shard them; {fix} (HSDP keeps its own gathers)"
            )
        if _keeps_resident(config.resident_layers):  # an int > 0, "auto" or a list of blocks
            raise UnsupportedCombinationError(
                f"layer_options.dit.resident_layers={config.resident_layers!r} with {said} is not allowed: "
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
        raise UnsupportedCombinationError(
            f"device={str(device)!r} with the NCCL {dim} group is not allowed: NCCL gathers CUDA tensors; "
            "pass device='cuda:<local rank>' or use a gloo group on CPU"
        )
    return DLOPlan("allgather", config.weight_transfer, group, size, rank, dim, backend)


