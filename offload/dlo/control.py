"""DLO control: bounded collectives, setup digests, rank-local reads, request waves.

Every wait here is bounded by ``dlo_timeout_s`` (:func:`bounded_wait`), so a
failure anywhere becomes an error everywhere within it; the small control
rows travel on a stream of their own. The setup digest (config, block layout,
an exact digest of every byte of the weights) is compared in one collective;
``local_state_dict`` pieces, raw or coded, merge back into full weights without
any collective (:func:`merge_shards`);
:func:`validate_wave` checks a DP request wave before any weight collective.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from weightstream.offload.config import OffloadConfig
from weightstream.offload.dlo.topology import DLOPlan, ParallelConfig, _resolve_group
from weightstream.kernels.codec import decode_tensor
from weightstream.offload.host.packing import usable_cpus
from weightstream.offload.layout import BlockLayout, TensorSpec

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
_HASH_CHUNK = 32 << 20  # bytes per hashing task: a tensor's digest joins its chunks' digests
_HASH_WORKERS = 16  # hashlib releases the GIL on large buffers: one chunk per worker thread


def _short(h) -> str:
    return h.hexdigest()[:16]


def _layout_digest(lay: BlockLayout) -> str:
    h = hashlib.sha1()
    for sp in lay.tensors:
        h.update(repr((sp.name, sp.kind, str(sp.dtype), sp.shape, sp.stride, sp.offset, sp.nbytes)).encode())
    h.update(repr(lay.nbytes).encode())
    return _short(h)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in row-major order as uint8 (on ``t``'s device; a copy only when it is not contiguous)."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _hash_chunk(raw: torch.Tensor, a: int, b: int) -> bytes:
    return hashlib.sha1(raw[a:b].cpu().numpy()).digest()  # a CUDA tensor: one chunk at a time to the host


def tensor_digests(tensors: list[torch.Tensor]) -> list[str]:
    """An exact digest (hex) of every byte of each tensor, with its dtype and shape: SHA-1 of the
    SHA-1s of its 32 MiB chunks, the chunks hashed on worker threads (hashlib releases the GIL)."""
    flats = [_flat_bytes(t) for t in tensors]
    tasks = [(i, a, min(a + _HASH_CHUNK, raw.numel())) for i, raw in enumerate(flats)
             for a in range(0, raw.numel(), _HASH_CHUNK)]
    workers = max(1, min(_HASH_WORKERS, usable_cpus(), len(tasks)))
    with torch.no_grad(), ThreadPoolExecutor(workers, thread_name_prefix="weightstream-digest") as pool:
        chunks = list(pool.map(lambda task: _hash_chunk(flats[task[0]], task[1], task[2]), tasks))
    per: list[list[bytes]] = [[] for _ in tensors]
    for (i, _, _), d in zip(tasks, chunks):
        per[i].append(d)
    return [hashlib.sha1(repr((str(t.dtype), tuple(t.shape))).encode() + b"".join(ds)).hexdigest()
            for t, ds in zip(tensors, per)]


@dataclasses.dataclass(frozen=True)
class WeightDigest:
    """One rank's weights, every byte (``dlo_verify_weights``): a digest per streamed tensor
    (per block, layout order) and per resident tensor (sorted by name). Only short summaries
    travel at setup (:meth:`summary`); :func:`weight_mismatches` asks for the rest where
    the ranks differ."""

    block_names: list[str]
    tensor_names: list[list[str]]
    blocks: list[list[str]]
    resident_names: list[str]
    resident: list[str]

    @classmethod
    def of(cls, layouts: list[BlockLayout], tensors, resident: Mapping[str, torch.Tensor]) -> "WeightDigest":
        """``tensors``: per streamed block, its (name, kind, tensor) in layout order (a SourceRequest's)."""
        names = sorted(resident)
        flat = [t for ts in tensors for _, _, t in ts] + [resident[n] for n in names]
        digests = iter(tensor_digests(flat))
        blocks = [[next(digests) for _ in ts] for ts in tensors]
        return cls([lay.name for lay in layouts], [[f"{lay.name}.{sp.name}" for sp in lay.tensors] for lay in layouts],
                   blocks, names, list(digests))

    def block(self, k: int) -> str:
        return _short(hashlib.sha1("".join(self.blocks[k]).encode()))

    def summary(self) -> dict:
        """The setup digest's weight entries: one exact digest of everything, one per block, one of
        the resident tensors."""
        resident = _short(hashlib.sha1(json.dumps([self.resident_names, self.resident]).encode()))
        blocks = [self.block(k) for k in range(len(self.blocks))]
        total = hashlib.sha1(json.dumps([self.blocks, self.resident_names, self.resident]).encode()).hexdigest()
        return {"weights": total, "block_weights": blocks, "resident_weights": resident}


def setup_digest(config: OffloadConfig, dlo: "DLOPlan", layouts: list[BlockLayout], num_blocks: int,
                 resident: Mapping[str, torch.Tensor], weights: WeightDigest | None, codec: str) -> dict:
    """What every rank of a DLO group must agree on before its first collective; ``weights``
    (``dlo_verify_weights``): the digests of every byte of the weights; ``codec``: the weight codec
    the builder selected for this rank (:attr:`~..sources.pinned.SourceRequest.codec`)."""
    dtypes = sorted({str(sp.dtype) for lay in layouts for sp in lay.tensors})
    d = {
        "weight_transfer": dlo.transfer, "num_slots": config.num_slots,
        "resident_layers": config.resident_layers, "cuda_graphs": config.cuda_graphs,
        "graph_boundary_loads": config.graph_boundary_loads, "dlo_verify_weights": config.dlo_verify_weights,
        "weight_codec": codec,
        "blocks": num_blocks, "streamed_blocks": len(layouts), "dtypes": dtypes,
        "block_names": [lay.name for lay in layouts],
        "block_layouts": [_layout_digest(lay) for lay in layouts],
        "resident_tensors": _short(hashlib.sha1(repr(sorted(
            (n, str(t.dtype), tuple(t.shape)) for n, t in resident.items())).encode())),
    }
    if weights is not None:
        d.update(weights.summary())
    return d


_PER_BLOCK = ("block_layouts", "block_weights")
_WEIGHTS = ("weights", "block_weights", "resident_weights")  # compared by weight_mismatches


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
    """Human-readable differences of every rank's setup digest from rank 0's (the weights
    apart: :func:`weight_mismatches`)."""
    errors = []
    base = digests[0]
    for key in sorted(set().union(*digests) - set(_WEIGHTS)):
        for r, d in enumerate(digests[1:], start=1):
            a, b = d.get(key), base.get(key)
            if a == b:
                continue
            if key in _PER_BLOCK and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
                names = base.get("block_names") or [str(i) for i in range(len(b))]
                bad = [i for i in range(len(b)) if a[i] != b[i]]
                errors.append(f"block {names[bad[0]]!r} layout differ: rank {r} {a[bad[0]]}, rank 0 {b[bad[0]]}"
                              + (f" (and {len(bad) - 1} more blocks)" if len(bad) > 1 else ""))
            elif key in _PER_BLOCK:
                continue  # a block-count difference is reported by "blocks" / "block_names"
            else:
                errors.append(f"rank {r} {key}={_show_digest(a)}, rank 0 {key}={_show_digest(b)}")
            break
    return errors


def weight_mismatches(control: "_Control", mine: WeightDigest, digests: list[dict]) -> list[str]:
    """Where the ranks' weights differ from rank 0's, named to the first differing block and
    tensor (or resident tensor) per rank. Called on every rank with the same ``digests``, so
    every rank runs the same collectives: none when the weights agree, else at most two
    small ones (the per-block digests when the setup digest folded them, then the per-tensor
    digests of the first differing blocks)."""
    base = digests[0]
    bad = [r for r, d in enumerate(digests) if d.get("weights") != base.get("weights")]
    if not bad:
        return []
    lists = [d.get("block_weights") for d in digests]
    if not all(isinstance(x, list) for x in lists):  # folded to fit: ask for them
        lists = [row["blocks"] for row in control.gather_json(
            {"blocks": [mine.block(k) for k in range(len(mine.blocks))]}, "the DLO weight check")]
    first = {r: next((k for k, (a, b) in enumerate(zip(lists[r], lists[0])) if a != b), None) for r in bad}
    blocks = sorted({k for k in first.values() if k is not None})
    resident = any(digests[r].get("resident_weights") != base.get("resident_weights") for r in bad)
    rows = control.gather_json({"tensors": [mine.blocks[k] for k in blocks],
                                "resident": mine.resident if resident else []}, "the DLO weight check")
    return [_weight_difference(r, first[r], blocks, rows, mine, lists) for r in bad]


def _weight_difference(r: int, k: int | None, blocks: list[int], rows: list[dict], mine: WeightDigest,
                       lists: list[list[str]]) -> str:
    """Rank ``r``'s first difference from rank 0 (``rows``: every rank's per-tensor digests)."""
    if k is not None:
        a, b = rows[r]["tensors"][blocks.index(k)], rows[0]["tensors"][blocks.index(k)]
        names, where = mine.tensor_names[k], f"block {mine.block_names[k]!r} weights differ at tensor "
    else:
        a, b, names, where = rows[r]["resident"], rows[0]["resident"], mine.resident_names, "resident tensor "
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:  # only the joined digests differ (a block or tensor count): no one tensor to name
        return f"weights differ: rank {r} digest {rows[r].get('weights', '?')}, rank 0 {rows[0].get('weights', '?')}"
    more = sum(x != y for x, y in zip(lists[r], lists[0])) - 1 if k is not None else 0
    return (where + f"{names[i]!r}" + (" differs" if k is None else "") + f": rank {r} {a[i][:16]}, rank 0 "
            f"{b[i][:16]}" + (f" (and {more} more blocks)" if more > 0 else ""))


def _show_digest(v) -> str:
    if isinstance(v, list) and len(v) > 6:
        return f"[{len(v)} entries: {', '.join(map(repr, v[:3]))}, ...]"
    return repr(v)


# --------------------------------------------------------------------------- rank-local reads
class ShardMergeError(ValueError):
    """:func:`merge_shards` cannot join the pieces it was given into a tensor (missing bytes,
    pieces of different codecs or layouts, bytes that disagree or do not decode)."""


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

    def tensor(self, joined: torch.Tensor) -> torch.Tensor:
        """The tensor from ``joined``, every rank's bytes of ``spec`` put together."""
        return self.spec.view_of(joined).clone()

    def kind(self) -> tuple:
        """What two pieces of one tensor must share to be joined."""
        return (type(self).__name__, self.spec)

    def __repr__(self) -> str:
        return (f"ShardPiece({self.name!r}, bytes [{self.start}, {self.start + self.data.numel()}) of "
                f"{self.spec.nbytes}: the rest is held by other ranks)")


@dataclasses.dataclass(frozen=True)
class CodedPiece(ShardPiece):
    """A :class:`ShardPiece` of a tensor's coded bytes (``spec``: the coded blob, uint8);
    ``target``: the decoded tensor's spec (offset 0). :func:`merge_shards` decodes the joined blob
    on the CPU (the codec's torch reference decoder)."""

    target: TensorSpec | None = None

    def tensor(self, joined: torch.Tensor) -> torch.Tensor:
        try:
            raw = decode_tensor(joined).view(torch.uint8)
        except (ValueError, RuntimeError, IndexError) as e:
            raise ShardMergeError(
                f"merge_shards: the coded bytes of {self.name!r} do not decode ({type(e).__name__}: {e}); "
                "the local_state_dict()s come from different backends or were changed: pass the unchanged "
                "local_state_dict() of every rank of one sharding group") from e
        if raw.numel() < self.target.nbytes:
            raise ShardMergeError(
                f"merge_shards: the coded bytes of {self.name!r} decode to {raw.numel()} bytes, the tensor "
                f"({self.target.dtype} {self.target.shape}) has {self.target.nbytes}: pass the unchanged "
                "local_state_dict() of every rank of one sharding group")
        return self.target.view_of(raw[: self.target.nbytes]).clone()

    def kind(self) -> tuple:
        return (type(self).__name__, self.spec, self.target)

    def __repr__(self) -> str:
        return (f"CodedPiece({self.name!r}, coded bytes [{self.start}, {self.start + self.data.numel()}) of "
                f"{self.spec.nbytes}: join every rank's with merge_shards)")


def merge_shards(local_state_dicts: list[Mapping]) -> dict[str, torch.Tensor]:
    """The full state dict from every rank's ``local_state_dict()`` (any order; no collective).

    Any codec: raw pieces (:class:`ShardPiece`) are joined, coded ones (:class:`CodedPiece`:
    ``weight_codec`` 'exp-k', 'exp-k2', 'exp-kp', or the coded blocks of 'auto') joined and
    decoded on the CPU, bit for bit. Pieces it cannot join into one tensor (of different
    codecs or layouts, bytes that disagree, missing bytes) raise :class:`ShardMergeError`,
    naming the tensor; so do whole tensors that differ between the dicts."""
    whole: dict[str, list[torch.Tensor]] = {}
    pieces: dict[str, list[ShardPiece]] = {}
    for i, sd in enumerate(local_state_dicts):
        if not isinstance(sd, Mapping):
            raise TypeError(f"merge_shards: entry {i} is a {type(sd).__name__}; pass a list of local_state_dict()s")
        for name, v in sd.items():
            if isinstance(v, ShardPiece):
                pieces.setdefault(name, []).append(v)
            elif isinstance(v, torch.Tensor):
                whole.setdefault(name, []).append(v)
            else:
                raise TypeError(f"merge_shards: {name!r} in entry {i} is a {type(v).__name__}, not a tensor or "
                                "ShardPiece; pass local_state_dict()s as they are")
    out = {}
    for name in dict.fromkeys([*whole, *pieces]):
        out[name] = _merge_one(name, whole.get(name, []), pieces.get(name, []))
    return out


def _merge_one(name: str, whole: list[torch.Tensor], ps: list[ShardPiece]) -> torch.Tensor:
    kinds = {p.kind() for p in ps}
    if len(kinds) > 1:
        what = sorted({f"{type(p).__name__} of {p.spec.nbytes} bytes" for p in ps})
        raise ShardMergeError(
            f"merge_shards: {name!r} comes as pieces that do not belong to one tensor ({', '.join(what)}): the "
            "local_state_dict()s come from backends with different codecs or layouts; pass the local_state_dict() "
            "of every rank of one sharding group")
    if whole:
        return _merge_whole(name, whole, ps)
    nbytes = ps[0].spec.nbytes
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    have = torch.zeros(nbytes, dtype=torch.bool)
    for p in ps:
        a, b = p.start, p.start + p.data.numel()
        if a == b:
            continue  # none of the tensor's bytes in that rank's share
        if b > nbytes:
            raise ShardMergeError(f"merge_shards: a piece of {name!r} holds bytes [{a}, {b}) of a {nbytes}-byte "
                                  "tensor; pass local_state_dict()s as they are")
        seen = have[a:b]
        if bool(seen.any()) and not torch.equal(buf[a:b][seen], p.data[seen]):
            raise ShardMergeError(f"merge_shards: two pieces of {name!r} disagree on bytes in [{a}, {b}): the "
                                  "local_state_dict()s come from ranks with different weights")
        buf[a:b] = p.data
        have[a:b] = True
    if not bool(have.all()):
        miss = int((~have).nonzero()[0])
        raise ShardMergeError(f"merge_shards: {name!r} misses bytes from {miss} of {nbytes}: "
                              "pass the local_state_dict() of every rank of the sharding group")
    return ps[0].tensor(buf)


def _merge_whole(name: str, whole: list[torch.Tensor], ps: list[ShardPiece]) -> torch.Tensor:
    """A tensor some dict holds whole (resident, or wholly in one rank's share): every whole copy and
    every raw piece of it must agree with it."""
    t = whole[0].detach().cpu()
    for other in whole[1:]:
        if other.dtype != t.dtype or other.shape != t.shape or not torch.equal(other.detach().cpu(), t):
            raise ShardMergeError(f"merge_shards: {name!r} differs between the local_state_dict()s (the ranks "
                                  "hold different weights); pass the local_state_dict() of every rank of one "
                                  "sharding group")
    if not ps:
        return t.clone()
    p = ps[0]
    if type(p) is not ShardPiece or (t.dtype, tuple(t.shape)) != (p.spec.dtype, p.spec.shape):
        raise ShardMergeError(
            f"merge_shards: {name!r} is a whole {t.dtype} {tuple(t.shape)} tensor in one local_state_dict() and a "
            f"{type(p).__name__} of {p.spec.dtype} {p.spec.shape} in another: the local_state_dict()s come from "
            "backends with different codecs or layouts")
    raw = torch.zeros(p.spec.nbytes, dtype=torch.uint8)
    p.spec.view_of(raw).copy_(t)
    for q in ps:
        a, b = q.start, q.start + q.data.numel()
        if a < b and (b > raw.numel() or not torch.equal(raw[a:b], q.data)):
            raise ShardMergeError(f"merge_shards: a piece of {name!r} disagrees with the whole tensor another "
                                  "local_state_dict() holds: the ranks hold different weights")
    return t.clone()


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

