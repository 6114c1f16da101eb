"""DLO control: bounded collectives, setup digests, rank-local reads, request waves.

Every wait here is bounded by ``dlo_timeout_s`` (:func:`bounded_wait`), so a
failure anywhere becomes an error everywhere within it; the small control
rows travel on a stream of their own. The setup digest (config, block layout,
sampled weights) is compared in one collective; ``local_state_dict`` pieces
merge back into full weights without any collective (:func:`merge_shards`);
:func:`validate_wave` checks a DP request wave before any weight collective.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .config import OffloadConfig
from .dlo_topology import DLOPlan, ParallelConfig, resolve_transfer, _resolve_group  # noqa: F401
from .layout import BlockLayout, TensorSpec

# Request arguments that change what the transformer computes per step (shapes,
# CFG on/off, batch), compared across a DP wave by validate_wave.
DEFAULT_PATH_KEYS = (
    "height", "width", "num_frames", "num_images_per_prompt", "guidance_scale", "true_cfg_scale",
    "max_sequence_length", "negative_prompt", "negative_prompt_embeds",
)
# Keys whose presence, not value, changes the path (a negative prompt turns CFG on).
_PRESENCE_KEYS = frozenset({"negative_prompt", "negative_prompt_embeds", "negative_pooled_prompt_embeds"})



# --------------------------------------------------------------------------- bounded collectives
class DLOCollectiveError(RuntimeError):
    """A DLO collective failed, or did not complete within ``dlo_timeout_s``."""


def bounded_wait(work, timeout_s: float, what: str, *, poll: bool = False) -> None:
    """Wait for ``work`` at most ``timeout_s`` seconds; DLOCollectiveError otherwise.

    ``poll``: NCCL work, whose plain ``wait()`` only makes the current stream
    wait: poll ``is_completed()`` (a query of the collective's CUDA event) on
    the host until the deadline, then ``wait()`` for its error, if any. Gloo
    work: ``wait(timeout=...)``.
    """
    try:
        if poll:
            # fine-grained: an eager step's agreement waits here once per step, and a
            # coarse pause would add up to the pause to every step
            deadline, pause = time.monotonic() + timeout_s, 1e-5
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError("the collective did not complete")
                time.sleep(pause)
                pause = min(2 * pause, 2e-4)
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        raise DLOCollectiveError(
            f"{what} failed or did not complete within dlo_timeout_s={timeout_s:g}: {type(e).__name__}: {e} "
            "(a peer failed, is out of step, or runs different code)"
        ) from e


_CONTROL_CAP = 1 << 16  # bytes per rank of a setup digest
_AGREE_MAGIC = 0x57534C4F  # marks an agreement row
_STATUS_BYTES = 1000  # bytes per rank of an agreement row
_STATUS_INTS = 6


class _Control:
    """Small bounded control collectives of one DLO backend over the sharding group."""

    def __init__(self, group, world: int, device: torch.device, timeout_s: float, nccl: bool):
        self.group, self.world, self.device, self.timeout_s, self.nccl = group, world, device, timeout_s, nccl
        self._stream = None  # CUDA: the control tensors' own stream, made at first use

    def gather(self, row: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's ``row`` (same shape everywhere), stacked rank-major, on the CPU."""
        if self.world == 1:  # a group of one agrees with itself: no collective
            return row.cpu().unsqueeze(0).clone()
        if self.device.type != "cuda":
            return self._gather(row, what)
        # On a stream of its own: the compute stream may wait on a gather a failed peer
        # never joins, and a copy queued behind it would block the host without bound.
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            return self._gather(row, what)

    def _gather(self, row: torch.Tensor, what: str) -> torch.Tensor:
        row = row.to(self.device)
        out = torch.empty((self.world, *row.shape), dtype=row.dtype, device=self.device)
        work = dist.all_gather(list(out.unbind(0)), row, group=self.group, async_op=True)
        bounded_wait(work, self.timeout_s, what, poll=self.nccl)
        return out.cpu()

    def status(self, ints: list[int], note: str, what: str) -> list[tuple[list[int], str]]:
        """Every rank's few ints and a short note, in one fixed-size row
        (_STATUS_BYTES: never the size of a gather, which is a multiple of 512)."""
        raw = note.encode()[: _STATUS_BYTES - 8 * (2 + _STATUS_INTS)]
        head = torch.zeros(2 + _STATUS_INTS, dtype=torch.int64)
        head[0], head[1] = _AGREE_MAGIC, len(raw)
        head[2 : 2 + len(ints)] = torch.tensor(ints, dtype=torch.int64)
        row = torch.zeros(_STATUS_BYTES, dtype=torch.uint8)
        row[: head.numel() * 8] = head.view(torch.uint8)
        row[head.numel() * 8 : head.numel() * 8 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        rows = self.gather(row, what)
        out = []
        for r in range(self.world):
            h = rows[r, : head.numel() * 8].view(torch.int64)
            if int(h[0]) != _AGREE_MAGIC:
                raise DLOCollectiveError(f"{what}: rank {r} sent something else (the ranks are out of step)")
            start = head.numel() * 8
            text = bytes(rows[r, start : start + int(h[1])].tolist()).decode(errors="replace")
            out.append((h[2 : 2 + len(ints)].tolist(), text))
        return out

    def gather_json(self, obj, what: str) -> list:
        raw = json.dumps(obj, sort_keys=True).encode()
        if len(raw) + 8 > _CONTROL_CAP:
            raise ValueError(f"{what}: the digest is {len(raw)} bytes, over {_CONTROL_CAP - 8}")
        buf = torch.zeros(_CONTROL_CAP, dtype=torch.uint8)
        buf[:8] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
        buf[8 : 8 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        rows = self.gather(buf, what)
        out = []
        for r in range(self.world):
            n = int(rows[r, :8].view(torch.int64)[0])
            out.append(json.loads(bytes(rows[r, 8 : 8 + n].tolist()).decode()))
        return out


def _control_for(parallel: ParallelConfig, dlo: "DLOPlan", config: OffloadConfig,
                 device: torch.device) -> _Control | None:
    """The control channel of a DLO backend, or None where no rank shares its weights
    (rank-local without an initialised group of more than one rank)."""
    if dlo.transfer == "allgather":
        group, size, backend = dlo.group, dlo.group_size, dlo.backend
    else:
        dim = parallel.shard_dim
        if dim is None or not (dist.is_available() and dist.is_initialized()):
            return None
        group, size = getattr(parallel, f"{dim}_group"), getattr(parallel, dim)
        if dist.get_world_size(group) != size or dist.get_rank(group) < 0:
            return None  # rank-local never needed this group; it does not check against it either
        backend = str(dist.get_backend(group))
    nccl = backend == "nccl"
    return _Control(group, size, device if nccl else torch.device("cpu"), config.dlo_timeout_s, nccl)


# --------------------------------------------------------------------------- setup digest
_DIGEST_SAMPLE_BYTES = 4096  # bytes sampled per block for dlo_verify_weights


def _short(h) -> str:
    return h.hexdigest()[:16]


def _layout_digest(lay: BlockLayout) -> str:
    h = hashlib.sha1()
    for sp in lay.tensors:
        h.update(repr((sp.name, sp.kind, str(sp.dtype), sp.shape, sp.stride, sp.offset, sp.nbytes)).encode())
    h.update(repr(lay.nbytes).encode())
    return _short(h)


def _weight_digest(tensors: list[torch.Tensor]) -> str:
    """A digest of a few KB sampled evenly from every tensor of a block (first and last element included)."""
    h = hashlib.sha1()
    per = max(1, _DIGEST_SAMPLE_BYTES // max(1, len(tensors)))
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().reshape(-1)
            n = flat.numel()
            if n == 0:
                continue
            m = max(1, min(n, per // max(1, flat.element_size())))
            # integer arithmetic: a float32 linspace rounds past n - 1 for tensors of tens of
            # millions of elements (an out-of-range index, a device-side assert on CUDA)
            idx = torch.arange(m, dtype=torch.int64, device=flat.device) * (n - 1) // max(m - 1, 1)
            sample = flat.index_select(0, idx).contiguous().cpu()
            h.update(sample.view(torch.uint8).numpy().tobytes())
    return _short(h)


def setup_digest(config: OffloadConfig, dlo: "DLOPlan", layouts: list[BlockLayout], tensors,
                 num_blocks: int) -> dict:
    """What every rank of a DLO group must agree on before its first collective."""
    dtypes = sorted({str(sp.dtype) for lay in layouts for sp in lay.tensors})
    d = {
        "weight_transfer": dlo.transfer, "num_slots": config.num_slots,
        "resident_layers": config.resident_layers, "cuda_graphs": config.cuda_graphs,
        "graph_boundary_loads": config.graph_boundary_loads, "dlo_verify_weights": config.dlo_verify_weights,
        "weight_codec": getattr(config, "weight_codec", "none"),
        "blocks": num_blocks, "streamed_blocks": len(layouts), "dtypes": dtypes,
        "block_names": [lay.name for lay in layouts],
        "block_layouts": [_layout_digest(lay) for lay in layouts],
    }
    if config.dlo_verify_weights:
        d["block_weights"] = [_weight_digest([t for _, _, t in ts]) for ts in tensors]
    return d


_PER_BLOCK = ("block_layouts", "block_weights")


def fit_digest(d: dict, cap: int = _CONTROL_CAP // 2) -> dict:
    """``d`` with its per-block lists folded into one hash each when it is too long to send."""
    if len(json.dumps(d)) <= cap:
        return d
    d = dict(d)
    for key in ("block_names", *_PER_BLOCK):
        if key in d:
            d[key] = _short(hashlib.sha1(json.dumps(d[key]).encode()))
    return d


def digest_mismatches(digests: list[dict]) -> list[str]:
    """Human-readable differences of every rank's setup digest from rank 0's."""
    errors = []
    base = digests[0]
    for key in sorted(set().union(*digests)):
        for r, d in enumerate(digests[1:], start=1):
            a, b = d.get(key), base.get(key)
            if a == b:
                continue
            if key in _PER_BLOCK and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
                names = base.get("block_names") or [str(i) for i in range(len(b))]
                bad = [i for i in range(len(b)) if a[i] != b[i]]
                what = "layout" if key == "block_layouts" else "weights (sampled digest)"
                errors.append(f"block {names[bad[0]]!r} {what} differ: rank {r} {a[bad[0]]}, rank 0 {b[bad[0]]}"
                              + (f" (and {len(bad) - 1} more blocks)" if len(bad) > 1 else ""))
            elif key in _PER_BLOCK:
                continue  # a block-count difference is reported by "blocks" / "block_names"
            else:
                errors.append(f"rank {r} {key}={_show_digest(a)}, rank 0 {key}={_show_digest(b)}")
            break
    return errors


def _show_digest(v) -> str:
    if isinstance(v, list) and len(v) > 6:
        return f"[{len(v)} entries: {', '.join(map(repr, v[:3]))}, ...]"
    return repr(v)


# --------------------------------------------------------------------------- rank-local reads
@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """The part of a streamed tensor one AllGather rank holds (see ``local_state_dict``).

    ``spec``: the tensor's dtype, shape and stride (offset 0, ``nbytes`` its byte
    span); ``start``: offset of ``data`` (uint8, on the CPU) in those bytes.
    :func:`merge_shards` joins the pieces of every rank into the tensor.
    """

    name: str
    spec: TensorSpec
    start: int
    data: torch.Tensor

    def __repr__(self) -> str:
        return (f"ShardPiece({self.name!r}, bytes [{self.start}, {self.start + self.data.numel()}) of "
                f"{self.spec.nbytes}: the rest is held by other ranks)")


def merge_shards(local_state_dicts: list[Mapping]) -> dict[str, torch.Tensor]:
    """The full state dict from every rank's ``local_state_dict()`` (any order; no collective)."""
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[ShardPiece]] = {}
    for sd in local_state_dicts:
        for name, v in sd.items():
            if isinstance(v, ShardPiece):
                pieces.setdefault(name, []).append(v)
            else:
                out.setdefault(name, v)
    for name, ps in pieces.items():
        if name in out:
            continue
        spec = ps[0].spec
        buf = torch.zeros(spec.nbytes, dtype=torch.uint8)
        have = torch.zeros(spec.nbytes, dtype=torch.bool)
        for p in ps:
            buf[p.start : p.start + p.data.numel()] = p.data
            have[p.start : p.start + p.data.numel()] = True
        if not bool(have.all()):
            miss = int((~have).nonzero()[0])
            raise ValueError(f"merge_shards: {name!r} misses bytes from {miss} of {spec.nbytes}: "
                             "pass the local_state_dict() of every rank of the sharding group")
        out[name] = spec.view_of(buf).clone()
    return out

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


def _json_safe(v):
    """Tuples as lists, anything else JSON cannot carry as its repr (compared as such on every rank)."""
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if v == v and abs(v) != float("inf") else repr(v)
    return repr(v)


def _show(v) -> str:
    return "missing" if v is None else repr(v)


def validate_wave(request: Mapping, parallel: ParallelConfig, *, transfer: str | None = None,
                  path_keys=DEFAULT_PATH_KEYS, timeout_s: float = 60.0) -> int | None:
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
    ``timeout_s``: bound of the wait for the other ranks (DLOCollectiveError after it).
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
    nccl = str(dist.get_backend(group)) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    control = _Control(group, size, device, timeout_s, nccl)
    gathered = control.gather_json(_json_safe(_wave_summary(request, path_keys)), "the request-wave check")
    errors = []
    broken = [(r, s["error"]) for r, s in enumerate(gathered) if "error" in s]
    for r, msg in broken:
        errors.append(f"dp rank {r}: {msg}")
    good = [(r, s) for r, s in enumerate(gathered) if "error" not in s]
    missing = [r for r, s in good if s["steps"] is None]
    invalid = [(r, s["steps"][1]) for r, s in good if isinstance(s["steps"], (tuple, list))]
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

