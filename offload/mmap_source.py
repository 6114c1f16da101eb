"""mmap checkpoint source: stream DiT blocks straight from safetensors files.

The DiT is built on the ``meta`` device; every expected tensor is bound to a
(file, key) of read-only mapped safetensors files (``mmap`` ACCESS_READ), so
no private full-model copy is ever made. Several processes on one node
streaming the same checkpoint share its page cache; only the two staging
buffers (and the device slots) are private.

Per streamed block one of two copy paths is chosen at setup:

direct (CUDA, primary)
    The file ranges the block reads are registered with ``cudaHostRegister``
    (flag cudaHostRegisterReadOnly, else 0; chunks of at most 1 GiB, page
    aligned, under ``pinned_memory_budget_gb``), and ``_issue`` copies the
    block's tensors straight from the mapping into the slot's runtime offsets
    on the copy stream, no host packing. Runtime offsets are assigned in file
    order, so tensors adjacent in the file whose sizes keep 512-byte
    alignment merge into one copy. Tensors whose checkpoint layout differs
    from the runtime layout by a declared kernel transform
    (``param.mmap_kernel_transform = ("qkv_reorder", num_heads, num_kv_heads)``)
    are copied into a per-slot wire buffer and written into the slot by ONE
    ``materialise`` launch per block (its segment table uploaded at setup).

staging (fallback)
    Blocks that cannot be copied directly (CPU device, no registration,
    budget exhausted, a Python ``mmap_weight_transform`` callable) are packed
    by a background thread into two host buffers (see :mod:`staging`); the
    forward thread only waits for a packed buffer and issues the H2D.

Model opt-in (as in vLLM-Omni's mmap loader): diffusers models load from a
diffusers-format folder without a mapping (checkpoint keys are runtime
names). Other models declare ``_supports_mmap_loading = True`` and/or
``_remap_ckpt_key(name) -> runtime name | None`` (None: intentionally
ignored key); sources come from the ``source`` argument or the model's
``weights_sources`` attribute. A parameter may carry
``mmap_weight_transform`` (a callable checkpoint tensor -> runtime tensor
that preserves dtype and element count; it must not modify its input, which
is a read-only view of the mapping) or ``mmap_kernel_transform``.

Checkpoint files must not change while they are mapped. Replace a checkpoint
atomically: write the new file elsewhere on the same filesystem, then rename
it over the old path (``os.replace``). A process that mapped the old file keeps
its mapping of the old inode and streams the old weights, whole and
consistent, until a new wrapper maps the new file. Writing a mapped file in
place (``cp new.safetensors old.safetensors``, ``open(path, "r+b")``) changes
the bytes under the mapping, so a step could mix old and new weights, and
truncating it makes any read past the new end kill the process with SIGBUS.
Each file's identity (``st_dev``, ``st_ino``), size and ``st_mtime_ns`` are
recorded when it is opened and checked (``fstat`` of the open file, a few
microseconds per file) at every step start, before the packer thread reads, before a
ring reload, and in the ``state_dict`` / ``disable`` paths; a difference
raises :class:`CheckpointChangedError` naming the file. A write during a
step is seen at the next check; a writer that keeps both the size and the
mtime (``cp -p`` of a same-size file) is not detected. ``state_dict()``
values are views of the mapping: read them before replacing anything in
place.

Entry point: :func:`offload_from_safetensors`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from weightstream.kernels.materialise import Segment, SegmentTable, materialise, materialise_torch

from .config import OffloadConfig
from .discovery import OffloadPlan, discover_blocks
from .executor import LayerwiseExecutor
from .host_store import PAGE, REGISTER_CHUNK, Progress, _cuda_register, _Registration, copy_from_image
from .layout import TENSOR_ALIGN, BlockLayout, align_up, block_tensors
from .schedule import Load, Schedule
from .staging import CopyPool, Stager, StagingError, check_threads
from .transformer import OffloadedTransformer, StreamedBlocks, resolve_device

__all__ = [
    "WeightsSource",
    "Checkpoint",
    "as_sources",
    "offload_from_safetensors",
    "on_meta",
    "meta_from_pretrained",
    "bind_checkpoint",
    "plan_registration",
    "direct_after_registration",
    "CheckpointChangedError",
    "COPY_PATHS",
]

HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly
COPY_PATHS = ("auto", "direct", "staging")
KERNEL_TRANSFORMS = {"qkv_reorder": Segment.qkv_reorder, "qkv_interleave": Segment.qkv_interleave}
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
_LIST = 12  # names listed in an error message

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_LIST])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _LIST else "")


# ----------------------------------------------------------------------------
# safetensors files, mapped read-only
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CkptTensor:
    """One tensor of a checkpoint: where its bytes lie in which file."""

    file: int  # index into Checkpoint.files
    key: str  # the key in the file (without source prefix)
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class CheckpointChangedError(RuntimeError):
    """A mapped checkpoint file changed in place (size, mtime or identity): its
    mapping can no longer be trusted (mixed weights, or SIGBUS past a new end)."""


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_IDENTITY_FIELDS = ("st_dev", "st_ino", "size", "mtime_ns")


def changed_message(path, was: tuple, now: tuple) -> str:
    diffs = ", ".join(f"{k} {a} -> {b}" for k, a, b in zip(_IDENTITY_FIELDS, was, now) if a != b)
    return (
        f"checkpoint file {str(path)!r} changed while this process streams from its mapping ({diffs}): "
        "its bytes may now mix old and new weights, and reads past a truncated end would kill the process "
        "(SIGBUS). Replace checkpoint files atomically: write the new file elsewhere on the same filesystem, "
        "then rename it over the old path (os.replace); a process that mapped the old file keeps streaming "
        "it. Build a new wrapper to load the new weights."
    )


class SafetensorsFile:
    """A safetensors file: header parsed here, data mapped read-only (ACCESS_READ).

    The file stays open (one descriptor) so that :meth:`check_unchanged` can
    ``fstat`` the inode that is mapped, whatever the path now names.
    """

    def __init__(self, path: str | os.PathLike, index: int):
        self.path = Path(path)
        self.index = index
        self._fd: int | None = None
        self._fd_closer = None
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                self.identity = _identity(st)
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError(f"{self.path}: not a safetensors file ({size} bytes, no header length)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise ValueError(f"{self.path}: header length {n} exceeds the file size {size}")
                try:
                    header = json.loads(f.read(n))
                except ValueError as e:
                    raise ValueError(f"{self.path}: header is not valid JSON ({e})") from None
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._fd = os.dup(f.fileno())
                self._fd_closer = weakref.finalize(self, os.close, self._fd)
        except OSError as e:
            raise ValueError(f"cannot open checkpoint file {str(path)!r}: {e}") from e
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: header must be a JSON object")
        self.size = size
        data = 8 + n
        self.entries: dict[str, CkptTensor] = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except KeyError as e:
                raise ValueError(f"{self.path}: tensor {key!r} has an unknown dtype or misses {e}") from None
            t = CkptTensor(index, key, dtype, shape, data + begin, end - begin)
            if end < begin or data + end > size or t.numel * dtype.itemsize != t.nbytes:
                raise ValueError(f"{self.path}: tensor {key!r} has inconsistent data_offsets {info['data_offsets']}")
            self.entries[key] = t
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mapping is read-only by design: nothing writes through it
            self.u8 = torch.frombuffer(self.map, dtype=torch.uint8)

    @property
    def base(self) -> int:
        return self.u8.data_ptr()

    def check_unchanged(self) -> None:
        """Raise CheckpointChangedError if the mapped inode changed since it was opened."""
        if self._fd is None:
            return
        now = _identity(os.fstat(self._fd))
        if now != self.identity:
            raise CheckpointChangedError(changed_message(self.path, self.identity, now))

    def close(self) -> None:
        """Drop this file's references; the mapping is unmapped once no tensor views it.

        Never ``self.map.close()``: torch.frombuffer keeps a reference to the
        mmap object but no buffer export, so closing it would unmap memory
        that live views (state_dict values, a transform's output) still read.
        """
        self.u8 = None
        self.map = None
        self._fd = None
        if self._fd_closer is not None:
            self._fd_closer()


@dataclass(frozen=True)
class WeightsSource:
    """Safetensors weights of one component.

    path: a folder (diffusers layout: ``diffusion_pytorch_model.safetensors``,
    or sharded with ``diffusion_pytorch_model.safetensors.index.json``; also
    ``model.safetensors[.index.json]``), one ``.safetensors`` file, or an
    ``*.index.json``. prefix: prepended to every checkpoint key (placing the
    keys in the model's namespace). subfolder: joined to a folder path.
    """

    path: str | os.PathLike
    prefix: str = ""
    subfolder: str | None = None

    def files(self) -> list[Path]:
        p = Path(self.path)
        if self.subfolder:
            p = p / self.subfolder
        if p.is_dir():
            for index in (p / (DIFFUSERS_WEIGHTS + ".index.json"), p / "model.safetensors.index.json"):
                if index.is_file():
                    return _index_files(index)
            for single in (p / DIFFUSERS_WEIGHTS, p / "model.safetensors"):
                if single.is_file():
                    return [single]
            found = sorted(x.name for x in p.iterdir())
            raise ValueError(
                f"weights source {str(p)!r} holds no {DIFFUSERS_WEIGHTS} (or its .index.json, or model.safetensors); "
                f"found: {found[:10]}"
            )
        if p.name.endswith(".index.json") and p.is_file():
            return _index_files(p)
        if p.suffix == ".safetensors" and p.is_file():
            return [p]
        raise ValueError(
            f"weights source {str(p)!r} is neither a folder, a .safetensors file nor a .safetensors.index.json file"
        )


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({e!r})") from None
    files = []
    for name in dict.fromkeys(weight_map.values()):
        f = index.parent / name
        if not f.is_file():
            raise ValueError(f"{index} names shard {name!r}, which does not exist in {index.parent}")
        files.append(f)
    return files


def as_sources(source, model: nn.Module | None = None) -> list[WeightsSource]:
    """Normalise a source argument (path, dict, WeightsSource or a list of them;
    None: ``model.weights_sources``) to a list of WeightsSource."""
    if source is None:
        source = getattr(model, "weights_sources", None)
        if source is None:
            owner = f"set {type(model).__name__}.weights_sources" if model is not None else "none was given"
            raise ValueError(
                f"no checkpoint given: pass source= (a folder, .safetensors file, index.json or WeightsSource "
                f"list) or {owner}"
            )
    items = [source] if isinstance(source, (str, os.PathLike, WeightsSource, dict)) else list(source)
    if not items:
        raise ValueError("source=[] names no checkpoint")
    out = []
    for it in items:
        if isinstance(it, WeightsSource):
            out.append(it)
        elif isinstance(it, (str, os.PathLike)):
            out.append(WeightsSource(it))
        elif isinstance(it, dict):
            unknown = set(it) - {"path", "prefix", "subfolder"}
            if unknown or "path" not in it:
                raise ValueError(f"weights source {it!r}: allowed keys are path (required), prefix, subfolder")
            out.append(WeightsSource(**it))
        else:
            raise TypeError(f"weights source {it!r} must be a path, a dict or a WeightsSource")
    return out


class Checkpoint:
    """Read-only mappings of the safetensors files of one or more sources
    (anything :func:`as_sources` accepts).

    ``entries``: prefixed key -> :class:`CkptTensor`. ``tensor(t)`` is a typed
    view of the mapping (read-only memory: never write to it).
    """

    def __init__(self, source):
        t0 = time.perf_counter()
        self.files: list[SafetensorsFile] = []
        self.entries: dict[str, CkptTensor] = {}
        self.sources = as_sources(source)
        try:
            for src in self.sources:
                for path in src.files():
                    f = SafetensorsFile(path, len(self.files))
                    self.files.append(f)
                    for key, t in f.entries.items():
                        name = src.prefix + key
                        if name in self.entries:
                            other = self.files[self.entries[name].file].path
                            raise ValueError(f"checkpoint key {name!r} appears twice: in {other} and in {path}")
                        self.entries[name] = t
        except BaseException:
            self.close()
            raise
        self.open_s = time.perf_counter() - t0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.entries.values())

    def bytes(self, t: CkptTensor) -> torch.Tensor:
        return self.files[t.file].u8[t.offset : t.offset + t.nbytes]

    def tensor(self, t: CkptTensor) -> torch.Tensor:
        return self.bytes(t).view(t.dtype).view(t.shape)

    def address(self, t: CkptTensor) -> int:
        return self.files[t.file].base + t.offset

    def check_unchanged(self) -> None:
        """Raise CheckpointChangedError naming the first file that changed in place
        (an ``fstat`` per file; atomically replaced paths keep their old mapping)."""
        for f in self.files:
            f.check_unchanged()

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __repr__(self) -> str:
        return f"Checkpoint({len(self.files)} files, {len(self.entries)} tensors, {self.nbytes / 1e9:.3f} GB)"


# ----------------------------------------------------------------------------
# model opt-in and binding
# ----------------------------------------------------------------------------


def _is_diffusers_model(model: nn.Module) -> bool:
    mod = sys.modules.get("diffusers")
    mixin = getattr(mod, "ModelMixin", None) if mod is not None else None
    return mixin is not None and isinstance(model, mixin)


def check_opt_in(model: nn.Module) -> str:
    """How ``model`` opted in to mmap loading (raises ValueError if it did not)."""
    cls = type(model).__name__
    flag = getattr(model, "_supports_mmap_loading", None)
    if flag is False:
        raise ValueError(f"{cls}._supports_mmap_loading is False: this model opted out of mmap loading")
    if flag is True:
        return "_supports_mmap_loading"
    if callable(getattr(model, "_remap_ckpt_key", None)):
        return "_remap_ckpt_key"
    if _is_diffusers_model(model):
        return "diffusers"
    raise ValueError(
        f"{cls} does not declare mmap loading support: set `_supports_mmap_loading = True` on the class when "
        "checkpoint keys (after the source prefix) equal its parameter names, or define "
        "`_remap_ckpt_key(name) -> runtime name | None`; diffusers models need neither"
    )


@dataclass(frozen=True)
class TensorBinding:
    """A runtime tensor bound to its checkpoint source."""

    name: str  # runtime name (the first one, for tied tensors)
    src: CkptTensor
    shape: tuple[int, ...]  # runtime shape
    transform: Callable | None = None  # mmap_weight_transform (host, staging only)
    kernel: tuple | None = None  # ("qkv_reorder"|"qkv_interleave", num_heads, num_kv_heads)

    @property
    def dtype(self) -> torch.dtype:
        return self.src.dtype

    def kernel_segment(self, src_offset: int, dst_offset: int) -> Segment:
        kind, heads, kv = self.kernel
        head_bytes = self.src.nbytes // (heads + 2 * kv)
        return KERNEL_TRANSFORMS[kind](src_offset, dst_offset, heads, kv, head_bytes)


def _transform_error(b: TensorBinding, out, what: str) -> ValueError:
    got = f"{out.dtype} with {out.numel()} elements {tuple(out.shape)}" if isinstance(out, torch.Tensor) else repr(type(out))
    return ValueError(
        f"mmap_weight_transform of parameter {b.name!r} must preserve dtype and element count ({what}): "
        f"checkpoint {b.src.key!r} is {b.src.dtype} with {b.src.numel} elements {b.src.shape}, "
        f"the transform returned {got}"
    )


def _check_transform_output(b: TensorBinding, out) -> None:
    if not isinstance(out, torch.Tensor):
        raise _transform_error(b, out, "it returned no tensor")
    if out.dtype != b.src.dtype:
        raise _transform_error(b, out, "dtype changed")
    if out.numel() != b.src.numel:
        raise _transform_error(b, out, "element count changed")


def apply_transform(b: TensorBinding, src: torch.Tensor) -> torch.Tensor:
    out = b.transform(src)
    _check_transform_output(b, out)
    return out.reshape(b.shape)


def _parse_kernel(name: str, spec, src: CkptTensor) -> tuple:
    ok = (
        isinstance(spec, (tuple, list)) and len(spec) == 3 and spec[0] in KERNEL_TRANSFORMS
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in spec[1:])
    )
    if not ok:
        raise ValueError(
            f"mmap_kernel_transform of {name!r} is {spec!r}; expected (kind, num_heads, num_kv_heads) with kind "
            f"one of {sorted(KERNEL_TRANSFORMS)} and positive ints"
        )
    kind, heads, kv = spec
    rows = heads + 2 * kv
    if heads % kv or not src.shape or src.shape[0] % rows:
        raise ValueError(
            f"mmap_kernel_transform {tuple(spec)!r} of {name!r} does not fit checkpoint {src.key!r} of shape "
            f"{src.shape}: num_heads must be a multiple of num_kv_heads and dim 0 a multiple of "
            f"num_heads + 2 * num_kv_heads = {rows}"
        )
    return (kind, heads, kv)


def bind_checkpoint(model: nn.Module, ckpt: Checkpoint) -> dict[int, TensorBinding]:
    """Bind every expected tensor of ``model`` to a checkpoint entry: id(tensor) -> binding.

    Expected: every parameter, and every buffer that is on ``meta`` or named
    in the checkpoint. Raises ValueError for unknown, duplicate or missing
    names, a shape or transform mismatch, and lists tensors left on meta.
    """
    cls = type(model).__name__
    objs: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        objs[name], kinds[name] = p, "parameter"
    for name, b in model.named_buffers(remove_duplicate=False):
        if b is not None and name not in objs:
            objs[name], kinds[name] = b, "buffer"
    remap = getattr(model, "_remap_ckpt_key", None)
    remap = remap if callable(remap) else None
    target_of: dict[str, str] = {}  # runtime name -> checkpoint name
    unknown = []
    for cname in ckpt.entries:
        rname = remap(cname) if remap is not None else cname
        if rname is None:
            continue
        if rname not in objs:
            unknown.append(cname if rname == cname else f"{cname} -> {rname}")
            continue
        if rname in target_of:
            raise ValueError(f"checkpoint keys {target_of[rname]!r} and {cname!r} both map to {rname!r}")
        target_of[rname] = cname
    if unknown:
        hint = "return None from _remap_ckpt_key to ignore a key" if remap else (
            "define _remap_ckpt_key(name) -> runtime name | None to rename or ignore keys"
        )
        raise ValueError(f"checkpoint keys that {cls} has no tensor for: {_listing(unknown)}; {hint}")

    out: dict[int, TensorBinding] = {}
    for rname, cname in target_of.items():
        t = objs[rname]
        if id(t) in out:
            continue  # a tied tensor, bound under its other name
        src = ckpt.entries[cname]
        out[id(t)] = _make_binding(rname, t, src, ckpt)
    stuck = [n for n, t in objs.items() if id(t) not in out and t.device.type == "meta"]
    if stuck:
        raise ValueError(
            f"{len(stuck)} expected tensor(s) of {cls} are still on the meta device after checkpoint mapping "
            f"(no checkpoint key maps to them): {_listing(stuck)}; checkpoint files: "
            f"{[str(f.path) for f in ckpt.files][:4]}"
        )
    missing = [n for n, t in objs.items() if id(t) not in out and kinds[n] == "parameter"]
    if missing:
        raise ValueError(f"parameters of {cls} missing from the checkpoint: {_listing(missing)}")
    return out


def _make_binding(name: str, t: torch.Tensor, src: CkptTensor, ckpt: Checkpoint) -> TensorBinding:
    shape = tuple(t.shape)
    if not t.is_contiguous():
        raise ValueError(f"{name!r} is not contiguous (stride {t.stride()}); mmap loading binds contiguous tensors")
    fn = getattr(t, "mmap_weight_transform", None)
    kernel = getattr(t, "mmap_kernel_transform", None)
    numel = t.numel()
    if numel != src.numel:
        raise ValueError(
            f"{name!r}: the model has {numel} elements {shape}, checkpoint {src.key!r} has {src.numel} "
            f"elements {src.shape}"
        )
    if fn is not None and kernel is not None:
        raise ValueError(f"{name!r} declares both mmap_weight_transform and mmap_kernel_transform; keep one")
    if fn is not None:
        if not callable(fn):
            raise ValueError(f"mmap_weight_transform of {name!r} must be callable, got {type(fn).__name__}")
        b = TensorBinding(name, src, shape, transform=fn)
        try:
            probe = fn(torch.empty(src.shape, dtype=src.dtype, device="meta"))
        except Exception:  # not meta-traceable: check on the real data once
            probe = fn(ckpt.tensor(src))
        _check_transform_output(b, probe)
        return b
    if shape != src.shape:
        raise ValueError(
            f"{name!r}: the model has shape {shape}, checkpoint {src.key!r} has {src.shape}; attach an "
            "mmap_weight_transform to the parameter if the layouts differ"
        )
    if kernel is not None:
        return TensorBinding(name, src, shape, kernel=_parse_kernel(name, kernel, src))
    return TensorBinding(name, src, shape)


def host_tensor(ckpt: Checkpoint, b: TensorBinding) -> torch.Tensor:
    """Runtime-layout host tensor of a binding: a read-only view of the mapping,
    or (transformed tensors) a fresh tensor."""
    if b.transform is not None:
        return apply_transform(b, ckpt.tensor(b.src))
    if b.kernel is not None:
        out = torch.empty(b.src.nbytes, dtype=torch.uint8)
        materialise_torch(ckpt.bytes(b.src), out, SegmentTable([b.kernel_segment(0, 0)]))
        return out.view(b.dtype).view(b.shape)
    return ckpt.tensor(b.src)


# ----------------------------------------------------------------------------
# block plans: layouts in file order, copy runs, kernel segments
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """Copy ``nbytes`` from byte ``src`` of checkpoint file ``file`` to ``dst`` of the slot (or wire buffer)."""

    file: int
    src: int
    dst: int
    nbytes: int


def merge_runs(items: list[Run]) -> list[Run]:
    """Merge copies adjacent in the file whose destinations keep the same relative placement."""
    out: list[Run] = []
    for r in sorted(items, key=lambda r: (r.file, r.src)):
        p = out[-1] if out else None
        if p is not None and p.file == r.file and p.src + p.nbytes == r.src and p.dst + p.nbytes == r.dst:
            out[-1] = Run(p.file, p.src, p.dst, p.nbytes + r.nbytes)
        elif r.nbytes:
            out.append(r)
    return out


def file_ordered_layout(layout: BlockLayout, keys: list[tuple]) -> BlockLayout:
    """The same tensors (same order, so the executor's views still pair up),
    with 512-aligned offsets assigned in checkpoint-file order."""
    order = sorted(range(len(layout.tensors)), key=lambda i: keys[i])
    offsets = [0] * len(order)
    off = 0
    for i in order:
        off = align_up(off, TENSOR_ALIGN)
        offsets[i] = off
        off += layout.tensors[i].nbytes
    specs = tuple(dataclasses.replace(s, offset=o) for s, o in zip(layout.tensors, offsets))
    return BlockLayout(layout.index, layout.name, specs, align_up(max(off, 1), TENSOR_ALIGN))


@dataclass
class BlockPlan:
    """How streamed block ``k`` gets into a slot."""

    k: int
    name: str
    runs: list[Run]  # identity tensors: mapping -> slot
    kernel: list[tuple[TensorBinding, int, SegmentTable]]  # (binding, slot offset, host table): QKV etc.
    wire_runs: list[Run]  # kernel tensors' wire bytes: mapping -> wire buffer
    wire_nbytes: int
    table: SegmentTable | None  # wire buffer -> slot, one launch
    callables: list[tuple[TensorBinding, object]]  # (binding, TensorSpec): host transform (staging only)
    local: list[tuple[torch.Tensor, int]]  # (host bytes, slot offset): unbound real buffers of the block
    direct: bool = False
    staged_because: str | None = None

    def ranges(self) -> list[tuple[int, int, int]]:
        """(file, start, end) byte ranges of the checkpoint this block reads on the direct path."""
        return [(r.file, r.src, r.src + r.nbytes) for r in self.runs + self.wire_runs]


def build_plan(k: int, layout: BlockLayout, tensors: list[torch.Tensor], bindings: dict[int, TensorBinding]) -> BlockPlan:
    runs, kernel, callables, local, wire_items = [], [], [], [], []
    wire = 0
    for spec, t in zip(layout.tensors, tensors):
        b = bindings.get(id(t))
        if b is None:  # a real buffer no checkpoint key names (non-persistent): a small private copy
            local.append((t.detach().reshape(-1).view(torch.uint8).clone(), spec.offset))
        elif b.transform is not None:
            callables.append((b, spec))
        elif b.kernel is not None:
            wire = align_up(wire, TENSOR_ALIGN)
            kernel.append((b, spec.offset, SegmentTable([b.kernel_segment(0, 0)])))
            wire_items.append((Run(b.src.file, b.src.offset, wire, b.src.nbytes), b.kernel_segment(wire, spec.offset)))
            wire += b.src.nbytes
        else:
            runs.append(Run(b.src.file, b.src.offset, spec.offset, spec.nbytes))
    table = SegmentTable([seg for _, seg in wire_items]) if wire_items else None
    return BlockPlan(
        k, layout.name, merge_runs(runs), kernel, merge_runs([r for r, _ in wire_items]), wire, table, callables,
        local,
    )


# ----------------------------------------------------------------------------
# registration planning (pure) and the store
# ----------------------------------------------------------------------------


def _merge_intervals(iv: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for f, s, e in sorted(iv):
        if out and out[-1][0] == f and s <= out[-1][2]:
            out[-1] = (f, out[-1][1], max(out[-1][2], e))
        else:
            out.append((f, s, e))
    return out


def _pages(ranges: Iterable[tuple[int, int, int]], bases: list[int], page: int) -> list[tuple[int, int, int]]:
    """Absolute, page-aligned (file, start, end) address ranges of file byte ranges."""
    return _merge_intervals(
        (f, (bases[f] + s) // page * page, align_up(bases[f] + e, page)) for f, s, e in ranges if e > s
    )


def _size(iv: list[tuple[int, int, int]]) -> int:
    return sum(e - s for _, s, e in iv)


def plan_registration(
    block_pages: list[list[tuple[int, int, int]]], budget: int | None, *, chunk: int = REGISTER_CHUNK
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Which blocks get registered, and the registration chunks.

    block_pages[i]: page-aligned (file, start address, end address) ranges
    block i reads. Blocks are taken in order while the union of their pages
    fits ``budget`` bytes (None: no cap); a block that does not fit is
    skipped (it stages). Returns (accepted block indices, chunks as
    (file, start address, size)), chunks at most ``chunk`` bytes, disjoint,
    so no page is registered twice even where two blocks share one.
    """
    accepted: list[int] = []
    union: list[tuple[int, int, int]] = []
    for i, pages in enumerate(block_pages):
        trial = _merge_intervals(union + list(pages))
        if budget is not None and _size(trial) > budget:
            continue
        union = trial
        accepted.append(i)
    chunks = [(f, s + o, min(chunk, e - s - o)) for f, s, e in union for o in range(0, e - s, chunk)]
    return accepted, chunks


def _covered(pages: list[tuple[int, int, int]], merged: list[tuple[int, int, int]]) -> bool:
    return all(any(mf == f and ms <= s and e <= me for mf, ms, me in merged) for f, s, e in pages)


def direct_after_registration(
    block_pages: list[list[tuple[int, int, int]]], accepted: list[int], registered: list[tuple[int, int, int]]
) -> list[bool]:
    """Which blocks copy directly: accepted by :func:`plan_registration` and every
    page range they read lies inside the chunks actually registered
    (``registered``: (file, start address, size), e.g. cut short by a failed
    registration). A block with any page outside stages."""
    merged = _merge_intervals((f, s, s + n) for f, s, n in registered)
    ok = set(accepted)
    return [i in ok and _covered(pages, merged) for i, pages in enumerate(block_pages)]


class MmapStore:
    """Host side of the mmap source: layouts, copy plans, registered checkpoint ranges.

    Duck-types the parts of :class:`HostStore` the rest of the controller reads
    (``layouts``, ``views``, ``pinned``, ``pinned_bytes``, ``pin_failure``,
    ``nbytes``, ``close``). There are no block images: ``image()`` raises.
    """

    def __init__(self, ckpt: Checkpoint, bindings: dict[int, TensorBinding], layouts: list[BlockLayout],
                 tensors: list[list[torch.Tensor]], device: torch.device, config: OffloadConfig, copy_path: str):
        t0 = time.perf_counter()
        self.ckpt, self.bindings, self.device = ckpt, bindings, device
        keys = []
        for lay, ts in zip(layouts, tensors):
            big = (len(ckpt.files), 0)
            keys.append([(bindings[id(t)].src.file, bindings[id(t)].src.offset) if id(t) in bindings else big
                         for t in ts])
        self.layouts = [file_ordered_layout(lay, kk) for lay, kk in zip(layouts, keys)]
        self.tensors = tensors
        self.plans = [build_plan(k, lay, ts, bindings) for k, (lay, ts) in enumerate(zip(self.layouts, tensors))]
        self.nbytes = sum(lay.nbytes for lay in self.layouts)
        self.pin_failure: str | None = None
        self._reg = _Registration()
        self._finalizer = weakref.finalize(self, self._reg.release)
        self.register_chunks = 0
        self.register_flags: int | None = None
        self.chunk_bounds: dict[int, set[int]] = {}  # file -> offsets where registrations start or end
        self.pack_threads: set[str] = set()  # names of the threads that ran pack() (staging)
        cuda = device.type == "cuda"
        for p in self.plans:
            if p.callables:
                p.staged_because = f"mmap_weight_transform on {p.callables[0][0].name!r}"
            elif copy_path == "staging":
                p.staged_because = "copy_path='staging'"
            elif cuda and not config.pin_memory:
                p.staged_because = "pin_memory=False"
            elif not cuda and copy_path == "auto":
                p.staged_because = "CPU device"
            else:
                p.direct = True
        if cuda:
            self._register([p for p in self.plans if p.direct], config)
        self.setup_s = time.perf_counter() - t0

    def _register(self, plans: list[BlockPlan], config: OffloadConfig) -> None:
        if not plans:
            return
        bases = [f.base for f in self.ckpt.files]
        pages = [_pages(p.ranges(), bases, PAGE) for p in plans]
        gb = config.pinned_memory_budget_gb
        budget = None if gb is None else int(gb * 1e9)
        accepted, chunks = plan_registration(pages, budget)
        reasons = []
        if len(accepted) < len(plans):
            reasons.append(
                f"pinned_memory_budget_gb={gb} covers the checkpoint pages of {len(accepted)} of {len(plans)} "
                "direct-copy blocks"
            )
        progress = Progress("registering checkpoint pages", sum(n for _, _, n in chunks), config.progress)
        flags = [HOST_REGISTER_READ_ONLY, 0]
        done = []
        for f, start, size in chunks:
            err = None
            for flag in flags:
                err = _cuda_register(start, size, flag)
                if err is None:
                    flags = [flag]  # keep what worked
                    self.register_flags = flag
                    break
            if err is not None:
                reasons.append(f"{err} for {size} bytes of {self.ckpt.files[f].path} (read-only flag, then flags 0)")
                break
            self._reg.ptrs.append(start)
            self._reg.bytes += size
            done.append((f, start, size))
            progress.update(size)
        self.register_chunks = len(done)
        for f, start, size in done:
            base = self.ckpt.files[f].base
            self.chunk_bounds.setdefault(f, set()).update((start - base, start + size - base))
        staged = 0
        for p, direct in zip(plans, direct_after_registration(pages, accepted, done)):
            if not direct:
                p.direct = False
                p.staged_because = "checkpoint pages not registered"
                staged += 1
        if reasons:
            self.pin_failure = "; ".join(reasons) + (
                f": {staged} block(s) stage through two pinned buffers instead (slower H2D, same results)"
            )
            warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=5)

    def split(self, r: Run) -> list[Run]:
        """``r`` cut where registrations meet: a copy whose source spans two
        registered ranges fails (CUDA invalid argument, seen on the H200)."""
        cuts = sorted(b for b in self.chunk_bounds.get(r.file, ()) if r.src < b < r.src + r.nbytes)
        out, at = [], r.src
        for b in cuts + [r.src + r.nbytes]:
            out.append(Run(r.file, at, r.dst + (at - r.src), b - at))
            at = b
        return out

    # -- packing (staging thread) ----------------------------------------------
    def pack(self, k: int, buf: torch.Tensor, pool: CopyPool | None = None) -> None:
        """Write streamed block ``k``'s runtime image into host bytes ``buf``
        (the checkpoint runs split over ``pool``'s threads when given)."""
        self.pack_threads.add(threading.current_thread().name)
        plan, files = self.plans[k], self.ckpt.files
        self.ckpt.check_unchanged()  # before reading: a truncated file would SIGBUS this thread
        with torch.no_grad():
            if pool is not None:  # raw addresses: check the bounds torch slicing would have
                base = buf.data_ptr()
                for r in plan.runs:
                    if r.dst + r.nbytes > buf.numel() or r.src + r.nbytes > files[r.file].u8.numel():
                        raise ValueError(f"pack: run {r} of block {k} is out of bounds of its buffer or file")
                pool.copy([(base + r.dst, files[r.file].u8.data_ptr() + r.src, r.nbytes) for r in plan.runs])
                self.pack_threads |= pool.thread_names
            else:
                for r in plan.runs:
                    buf[r.dst : r.dst + r.nbytes].copy_(files[r.file].u8[r.src : r.src + r.nbytes])
            for b, dst, table in plan.kernel:
                materialise_torch(self.ckpt.bytes(b.src), buf[dst : dst + b.src.nbytes], table)
            for b, spec in plan.callables:
                spec.view_of(buf).copy_(apply_transform(b, self.ckpt.tensor(b.src)))
            for host, dst in plan.local:
                buf[dst : dst + host.numel()].copy_(host)
        self.ckpt.check_unchanged()  # a write during the pack: never hand out a mixed image

    # -- HostStore surface -------------------------------------------------------
    def image(self, k: int) -> torch.Tensor:
        raise RuntimeError("the mmap store keeps no block images: blocks are copied from the checkpoint mapping")

    def views(self, k: int) -> list[torch.Tensor]:
        """Runtime-layout host tensors of block ``k`` (read-only mapping views where untransformed)."""
        out = []
        for spec, t in zip(self.layouts[k].tensors, self.tensors[k]):
            b = self.bindings.get(id(t))
            if b is None:
                host = next(h for h, d in self.plans[k].local if d == spec.offset)
                out.append(host.view(spec.dtype).view(spec.shape))
            else:
                out.append(host_tensor(self.ckpt, b))
        return out

    @property
    def pinned(self) -> bool:
        """True when every block copies directly from registered checkpoint pages."""
        return self.device.type == "cuda" and all(p.direct for p in self.plans)

    @property
    def pinned_bytes(self) -> int:
        return self._reg.bytes

    @property
    def direct_blocks(self) -> list[int]:
        return [p.k for p in self.plans if p.direct]

    @property
    def staged_blocks(self) -> list[int]:
        return [p.k for p in self.plans if not p.direct]

    def unregister(self) -> None:
        """Unregister the checkpoint pages. Callers make sure no copy still reads them."""
        self._finalizer()
        self.chunk_bounds.clear()
        for p in self.plans:
            p.direct = False

    def close(self) -> None:
        """Unregister the checkpoint pages and drop the mappings."""
        self.unregister()
        self.ckpt.close()

    def __repr__(self) -> str:
        return (
            f"MmapStore({len(self.layouts)} blocks, {self.nbytes / 1e9:.3f} GB from {len(self.ckpt.files)} file(s), "
            f"{len(self.direct_blocks)} direct, {len(self.staged_blocks)} staged, "
            f"registered {self.pinned_bytes / 1e9:.3f} GB)"
        )


# ----------------------------------------------------------------------------
# executor
# ----------------------------------------------------------------------------


class MmapExecutor(LayerwiseExecutor):
    """LayerwiseExecutor whose copies come from the checkpoint mapping (direct) or the stager."""

    def __init__(self, blocks, store: MmapStore, schedule: Schedule, device, *, record_events: bool = False,
                 staging_threads: int | None = None, streams=None):
        super().__init__(blocks, store, schedule, device, record_events=record_events, prime="first_forward",
                         streams=streams)
        plans = store.plans
        wire = max((p.wire_nbytes for p in plans if p.direct), default=0)
        self.wire = [torch.empty(wire, dtype=torch.uint8, device=self.device) for _ in self.slots] if wire else []
        for p in plans:
            if p.direct and p.table is not None:
                p.table.upload(self.device)
        use_kernel = self.cuda or os.environ.get("TRITON_INTERPRET") == "1"
        self._materialise = materialise if use_kernel else materialise_torch
        # _copies[k][s]: (destination view, source view) pairs of direct block k into slot s
        self._copies: list[list[list[tuple[torch.Tensor, torch.Tensor]]] | None] = []
        for p in plans:
            if not p.direct:
                self._copies.append(None)
                continue
            per_slot = []
            runs = [piece for r in p.runs for piece in store.split(r)]
            wire_runs = [piece for r in p.wire_runs for piece in store.split(r)]
            for s, slot in enumerate(self.slots):
                pairs = [(slot[r.dst : r.dst + r.nbytes], self._src(r)) for r in runs]
                pairs += [(self.wire[s][r.dst : r.dst + r.nbytes], self._src(r)) for r in wire_runs]
                pairs += [(slot[d : d + h.numel()], self._local(h)) for h, d in p.local]
                per_slot.append(pairs)
            self._copies.append(per_slot)
        self.stager: Stager | None = None
        staged = set(store.staged_blocks)
        if staged:
            n = schedule.n
            nbytes = max(store.layouts[k].nbytes for k in staged)

            def positions(start: int) -> Iterator[int]:
                p = start
                while True:
                    if (p % n) in staged:
                        yield p
                    p += 1

            self.stager = Stager(store.pack, positions, lambda p: p % n, nbytes, self.device, pin=self.cuda,
                                 threads=staging_threads)
            weakref.finalize(self, self.stager.stop)
        self._prime()

    def _src(self, r: Run) -> torch.Tensor:
        return self.store.ckpt.files[r.file].u8[r.src : r.src + r.nbytes]

    def _local(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory() if self.cuda else host

    def _copy(self, load: Load) -> None:
        """Direct blocks: copies straight from the mapping (plus one materialise
        launch for kernel transforms). Staged blocks: wait for the packer thread's
        buffer (this thread copies nothing on the host), H2D it, hand it back."""
        k = load.block - self.schedule.resident
        plan = self.store.plans[k]
        if plan.direct:
            self._copy_direct(k, load.slot, plan)
            return
        try:
            b = self.stager.acquire(load.position)
        except StagingError as e:  # a file changed under the packer: the named error, not a packing failure
            if isinstance(e.__cause__, CheckpointChangedError):
                raise CheckpointChangedError(str(e.__cause__)) from e
            raise
        n = self.store.layouts[k].nbytes
        src = self.stager.buffers[b].tensor
        slot = self.slots[load.slot]
        copy_from_image(slot[:n], src)  # one registration per copy
        if self.cuda:
            self.stager.h2d_done[b].record(self.streams.current_stream(self.device))
        self.stager.release(b, load.position)

    def uncapturable_copies(self) -> str | None:
        """Why a CUDA graph cannot hold this source's copies (None: it can). torch
        refuses, inside a capture, copies from host memory it does not count as
        pinned, and file pages registered with cudaHostRegister do not count (seen
        on the H200 with torch 2.11: ``is_pinned()`` False for every direct source)."""
        for per_slot in self._copies:
            for pairs in per_slot:
                for _, src in pairs:
                    if not src.is_pinned():
                        return ("cuda_graphs='on' cannot capture the mmap source's direct copies: torch refuses "
                                "copies from the registered checkpoint pages inside a CUDA graph (they do not count "
                                "as pinned); use cuda_graphs='off' with this source, or load the weights into memory "
                                "and use OffloadedTransformer (pinned host store) for CUDA graphs")
                    return None  # one source tells: every direct copy reads the same registered mapping
        return None

    def _copy_direct(self, k: int, s: int, plan: BlockPlan) -> None:
        for dst, src in self._copies[k][s]:
            dst.copy_(src, non_blocking=self.cuda)
        if plan.table is not None:
            self._materialise(self.wire[s], self.slots[s], plan.table)

    # -- checkpoint checks (a few fstat calls per step, never per block) -------
    def check_usable(self) -> None:
        """Raise CheckpointChangedError if a mapped file changed (the graph runner
        calls this before every step, replays included)."""
        self.store.ckpt.check_unchanged()

    def begin_step(self) -> None:
        self.store.ckpt.check_unchanged()
        super().begin_step()

    def before_block(self, block: int) -> None:
        if block == self.schedule.resident:  # a step's first streamed block: step start
            self.store.ckpt.check_unchanged()
        super().before_block(block)

    def reload_pending(self) -> None:
        """Re-copy the slots of the upcoming positions from the mapping (direct
        blocks) or through the stager, which restarts at those positions (staged
        blocks): after an interrupted step or a failed capture the slots hold
        other blocks' bytes."""
        self.store.ckpt.check_unchanged()
        super().reload_pending()

    def remove(self) -> None:
        super().remove()
        if self.stager is not None:
            self.stager.stop()
        self._copies = []
        self.wire = []

    def stats(self) -> dict:
        out = {"copies_per_step": sum(len(pairs[0]) for pairs in self._copies if pairs),
               "materialise_launches_per_step": sum(1 for p in self.store.plans if p.direct and p.table is not None),
               "wire_bytes": sum(w.numel() for w in self.wire)}
        if self.stager is not None:
            out.update(self.stager.stats())
        else:
            out.update({"staging_buffers": 0, "staging_bytes": 0})
        return out


# ----------------------------------------------------------------------------
# StreamedBlocks and the wrapper
# ----------------------------------------------------------------------------


class MmapStreamedBlocks(StreamedBlocks):
    """StreamedBlocks whose streamed tensors stay in the checkpoint mapping."""

    def __init__(self, module: nn.Module, config: OffloadConfig, device: torch.device, plan: OffloadPlan | None,
                 ckpt: Checkpoint, copy_path: str = "auto", staging_threads: int | None = None):
        t0 = time.perf_counter()
        self.ckpt, self.copy_path = ckpt, copy_path
        self.staging_threads = check_threads(staging_threads)
        blocks = discover_blocks(module, plan)
        if config.resident_layers >= len(blocks):  # same message as StreamedBlocks, before any loading
            raise ValueError(
                f"layer_options.dit.resident_layers={config.resident_layers} leaves no block to stream: "
                f"{type(module).__name__} has {len(blocks)} blocks; allowed: 0..{len(blocks) - 1}"
            )
        sched = Schedule(len(blocks), config.resident_layers, config.num_slots)
        streamed_ids = {id(t) for i in sched.streamed for _, _, t in block_tensors(blocks[i].module)}
        self.bindings = bind_checkpoint(module, ckpt)
        self.bind_s = time.perf_counter() - t0
        # streamed tensors: meta, checkpoint dtype, runtime shape (the layouts read these);
        # everything else: loaded to the device now, from the mapping
        t1 = time.perf_counter()
        with torch.no_grad():
            for name, t in _named_tensors(module):
                b = self.bindings.get(id(t))
                if b is None:
                    continue
                if id(t) in streamed_ids:
                    _give_data(t, torch.empty(b.shape, dtype=b.dtype, device="meta"))
                else:
                    _give_data(t, host_tensor(ckpt, b).to(device, copy=True))
        self.resident_load_s = time.perf_counter() - t1
        self.store = None
        try:
            super().__init__(module, config, device, plan)
        except BaseException:
            if self.store is not None:
                self.store.close()
            raise
        left = [n for n, t in _named_tensors(module) if t.device.type == "meta"]
        if left:  # pragma: no cover - bind_checkpoint guarantees this
            self.close()
            raise ValueError(f"tensors left on the meta device after setup: {_listing(left)}")
        try:
            ckpt.check_unchanged()  # resident weights were read from the mapping during setup
        except CheckpointChangedError:
            self.close()
            raise
        self.setup_s = ckpt.open_s + (time.perf_counter() - t0)

    @property
    def host_views(self) -> dict[int, torch.Tensor]:
        """id(tensor) -> host view (state_dict, update_weights); checks the files first."""
        self.ckpt.check_unchanged()
        return self._views

    @host_views.setter
    def host_views(self, views) -> None:
        self._views = views

    def _build_store(self, layouts, tensors) -> MmapStore:
        objs = [[t for _, _, t in ts] for ts in tensors]
        self.store = MmapStore(self.ckpt, self.bindings, layouts, objs, self.device, self.config, self.copy_path)
        self.layouts = self.store.layouts
        return self.store

    def _host_views(self) -> dict[int, torch.Tensor]:
        eager, lazy = {}, {}
        for k, ts in enumerate(self.tensors):
            specs = self.store.layouts[k].tensors
            for (_, _, t), spec in zip(ts, specs):
                b = self.bindings.get(id(t))
                if b is None:
                    host = next(h for h, d in self.store.plans[k].local if d == spec.offset)
                    eager[id(t)] = host.view(spec.dtype).view(spec.shape)
                elif b.transform is None and b.kernel is None:
                    eager[id(t)] = self.ckpt.tensor(b.src)
                else:
                    lazy[id(t)] = (lambda b=b: host_tensor(self.ckpt, b))
        return _HostViews(eager, lazy)

    def _build_executor(self) -> MmapExecutor:
        with torch.no_grad():  # streamed tensors leave meta: the executor binds placeholders and slot views
            for ts in self.tensors:
                for _, _, t in ts:
                    if t.device.type == "meta":
                        _give_data(t, torch.empty(0, dtype=t.dtype, device=self.device))
        return MmapExecutor(self.blocks, self.store, self.schedule, self.device,
                            record_events=self.config.record_events, staging_threads=self.staging_threads,
                            streams=self.streams)

    def restore(self) -> nn.Module:
        """Give every streamed tensor a private device copy of its weights; tear down.

        Raises CheckpointChangedError before anything is torn down if a file
        changed, and after the copies if one changed while they ran."""
        self.ckpt.check_unchanged()
        self.executor.remove()
        self.store.unregister()  # copies below come from pageable pages: no registration to span
        with torch.no_grad():
            for k, ts in enumerate(self.tensors):
                for (_, _, t), hv in zip(ts, self.store.views(k)):
                    t.data = hv.to(self.device, copy=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.ckpt.check_unchanged()
        self.store.close()
        self._views.clear()
        return self.module

    def update_weights(self, state_dict, *, strict: bool = False) -> list[str]:
        current = self.module.state_dict(keep_vars=True)
        streamed = [k for k in state_dict if k in current and id(current[k]) in self.host_views]
        if streamed:
            raise ValueError(
                f"update_weights: {_listing(streamed)} stream from the read-only checkpoint mapping, which is "
                "immutable; load the new weights through an in-memory OffloadedTransformer instead"
            )
        return super().update_weights(state_dict, strict=strict)

    def stats(self) -> dict:
        s = super().stats()
        st = self.store
        s.update({
            "source": "mmap",
            "checkpoint_files": len(self.ckpt.files),
            "checkpoint_bytes": self.ckpt.nbytes,
            "direct_blocks": len(st.direct_blocks),
            "staged_blocks": len(st.staged_blocks),
            "staged_because": sorted({p.staged_because for p in st.plans if not p.direct and p.staged_because}),
            "registered_bytes": st.pinned_bytes,
            "registration_chunks": st.register_chunks,
            "register_flags": st.register_flags,
            "open_s": self.ckpt.open_s,
            "bind_s": self.bind_s,
            "resident_load_s": self.resident_load_s,
            "store_s": st.setup_s,
        })
        s.update(self.executor.stats())
        return s

    def close(self) -> None:
        """Tear down without restoring weights (the model stays on placeholders)."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.remove()
        self.store.close()


class _HostViews(dict):
    """id(tensor) -> runtime host tensor; transformed ones are computed when read (no private copy kept)."""

    def __init__(self, eager: dict, lazy: dict):
        super().__init__(eager)
        self._lazy = lazy

    def get(self, key, default=None):
        if key in self._lazy:
            return self._lazy[key]()
        return super().get(key, default)

    def __getitem__(self, key):
        if key in self._lazy:
            return self._lazy[key]()
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        return key in self._lazy or super().__contains__(key)

    def clear(self) -> None:
        self._lazy.clear()
        super().clear()


def _give_data(t: torch.Tensor, data: torch.Tensor) -> None:
    """Make tensor object ``t`` hold ``data``, keeping its identity and attributes.

    ``t.data = data`` cannot move a tensor onto or off ``meta`` (incompatible
    tensor types), so that case swaps in a new tensor of ``t``'s class carrying
    ``t``'s attributes (``mmap_weight_transform``, ...).
    """
    if (t.device.type == "meta") == (data.device.type == "meta"):
        t.data = data
        return
    new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
    new.__dict__.update(t.__dict__)
    torch.utils.swap_tensors(t, new)


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen = set()
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    ):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            yield name, t


def offload_from_safetensors(
    model_on_meta: nn.Module,
    source=None,
    config=None,
    *,
    device=None,
    plan: OffloadPlan | None = None,
    copy_path: str = "auto",
    staging_threads: int | None = None,
) -> OffloadedTransformer:
    """Stream ``model_on_meta``'s blocks straight from safetensors files.

    model_on_meta: the DiT with its parameters on ``meta`` (see :func:`on_meta`,
    :func:`meta_from_pretrained`); it is bound in place and wrapped.
    source: a folder (diffusers layout), a .safetensors file, an index.json,
    a :class:`WeightsSource`, a dict with keys path/prefix/subfolder, or a list
    of these; None: the model's ``weights_sources``.
    config: as for :class:`OffloadedTransformer` (layer mode, rank-local).
    copy_path: "auto" (direct DMA from registered pages on CUDA, staging on
    CPU or where registration is not possible), "direct" (also on CPU:
    synchronous copies straight from the mapping, for tests), or "staging".
    staging_threads: threads that pack staged blocks (int >= 1; None: the
    CPUs available less two, at most 16). 1 packs on the packer thread alone
    (torch's multi-threaded copy).
    """
    if not isinstance(model_on_meta, nn.Module):
        raise TypeError(f"model_on_meta must be a torch.nn.Module, got {type(model_on_meta).__name__}")
    if copy_path not in COPY_PATHS:
        raise ValueError(f"copy_path={copy_path!r} is not allowed; choose from: {', '.join(COPY_PATHS)}")
    check_threads(staging_threads)
    cfg = OffloadConfig.coerce(config)
    if cfg.mode != "layer":
        raise ValueError(f"mode={cfg.mode!r} is not allowed for the mmap source; choose from: layer")
    if "dit" not in cfg.components:
        raise ValueError(f"components={list(cfg.components)!r} does not select 'dit'; the mmap source streams a DiT")
    if cfg.weight_transfer == "allgather":
        raise ValueError(
            "layer_options.dit.weight_transfer='allgather' is not allowed for the mmap source; choose from: "
            "rank-local (every process maps the same checkpoint and shares its page cache)"
        )
    dev = resolve_device(device)
    check_opt_in(model_on_meta)
    ckpt = Checkpoint(as_sources(source, model_on_meta))
    try:
        streamed = MmapStreamedBlocks(model_on_meta, cfg, dev, plan, ckpt, copy_path, staging_threads)
    except BaseException:
        ckpt.close()
        raise
    return OffloadedTransformer(model_on_meta, cfg, device=dev, streamed=streamed)


# ----------------------------------------------------------------------------
# building models on meta
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def on_meta():
    """Construct modules with every parameter on ``meta`` (buffers stay real,
    so computed tables such as rotary frequencies survive)."""

    def to_meta(module, name, param):
        if param is None or param.device.type == "meta":
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def meta_from_pretrained(cls, path, *, subfolder: str | None = None, **overrides) -> nn.Module:
    """A diffusers model class built on meta from the ``config.json`` of a diffusers folder."""
    config = cls.load_config(path, subfolder=subfolder) if subfolder else cls.load_config(path)
    config = {**config, **overrides}
    with on_meta():
        model = cls.from_config(config)
    return model.eval()
