"""Checkpoint parsing for the mmap source, and meta construction.

safetensors files mapped read-only (headers parsed here, never a private copy
of the data), checkpoint identity checks (a file changed in place is a named
error, see :mod:`..sources.mmap`), and building models on meta. The model opt-in
and the binding of every expected tensor of a meta-built model to a (file, key)
are in :mod:`.binding`. Pure host code: nothing here touches CUDA.

A malformed file or index (header not a JSON object, an unknown dtype, offsets
outside the file or overlapping, a shape that does not fit its bytes, a
``weight_map`` that is not a mapping of keys to shard file names) is a
:class:`CheckpointFormatError` naming the file, the key and the value.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import gguf_file

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
    quant_type: int | None = None  # a quantized GGUF tensor's ggml type (dtype uint8, diffusers' byte shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class CheckpointChangedError(RuntimeError):
    """A mapped checkpoint file (or coded sidecar) changed in place (size, mtime, ctime or
    identity): its mapping can no longer be trusted (mixed weights, or SIGBUS past a new end)."""


class CheckpointFormatError(ValueError):
    """A checkpoint file or index is malformed, or a checkpoint tensor does not fit the
    model's tensor; the message names the file, the key and the value."""


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What an in-place rewrite cannot hide: a write moves ``st_ctime_ns`` even when the
    writer puts the size and the mtime back (``os.utime``, ``cp -p``)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


_IDENTITY_FIELDS = ("st_dev", "st_ino", "size", "mtime_ns", "ctime_ns")


def changed_message(path, was: tuple, now: tuple, what: str = "checkpoint file", after: str | None = None) -> str:
    diffs = ", ".join(f"{k} {a} -> {b}" for k, a, b in zip(_IDENTITY_FIELDS, was, now) if a != b)
    ctime_only = [k for k, a, b in zip(_IDENTITY_FIELDS, was, now) if a != b] == ["ctime_ns"]
    why = (" (only its ctime moved: it was written with its size and mtime put back, or its metadata changed: "
           "chmod, touch, a hard link, a rename of the file itself)" if ctime_only else "")
    return (
        f"{what} {str(path)!r} changed while this process streams from its mapping ({diffs}){why}: "
        "its bytes may now mix old and new weights, and reads past a truncated end would kill the process "
        "(SIGBUS). Replace checkpoint files atomically: write the new file elsewhere on the same filesystem, "
        "then rename it over the old path (os.replace); a process that mapped the old file keeps streaming "
        "it. " + (after if after is not None else "Build a new wrapper to load the new weights.")
    )


class FileWatch:
    """The identity of an open, mapped file as opened, and its check (one ``fstat``).

    A rename over the file's path (the documented atomic replace) or its deletion
    drops its last name: its ctime moves but no byte changes, so a change of the
    ctime alone with the link count gone to 0 is accepted (once: later changes are
    errors again). Any other difference raises :class:`CheckpointChangedError`.
    """

    def __init__(self, path, fd: int, what: str = "checkpoint file"):
        st = os.fstat(fd)
        self.path, self.what = Path(path), what
        self.opened = self.identity = _identity(st)
        self._linked = st.st_nlink > 0

    def changed(self, fd: int) -> tuple | None:
        """The identity now where it differs from the one recorded (None: unchanged)."""
        st = os.fstat(fd)
        now = _identity(st)
        if now == self.identity:
            return None
        if now[:4] == self.identity[:4] and self._linked and st.st_nlink == 0:
            self.identity, self._linked = now, False  # its last name went away: same bytes
            return None
        return now

    def check(self, fd: int, after: str | None = None) -> None:
        now = self.changed(fd)
        if now is not None:
            raise CheckpointChangedError(changed_message(self.path, self.identity, now, self.what, after))


def _parse_entries(path: Path, header, data: int, size: int, index: int) -> dict[str, "CkptTensor"]:
    """The tensor entries of a parsed safetensors header (``data``: where the data bytes
    start; ``size``: the file's size); CheckpointFormatError naming the key and value."""
    if not isinstance(header, dict):
        raise CheckpointFormatError(
            f"{path}: its safetensors header is a JSON {type(header).__name__} ({_short(header)}), not an object "
            "of tensor entries: not a safetensors checkpoint; re-save it with safetensors (save_file)")
    entries: dict[str, CkptTensor] = {}
    for key, info in header.items():
        if key != "__metadata__":
            entries[key] = _parse_entry(path, key, info, data, size, index)
    spans = sorted((t.offset, t.offset + t.nbytes, k) for k, t in entries.items() if t.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointFormatError(f"{path}: tensors {a!r} and {b!r} overlap (their data_offsets share bytes "
                                        f"[{begin - data}, {end - data})); the file is corrupt: re-save it")
    return entries


def _short(value, n: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= n else r[: n - 3] + "..."


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_entry(path: Path, key: str, info, data: int, size: int, index: int) -> "CkptTensor":
    where = f"{path}: tensor {key!r}"
    if not isinstance(info, dict):
        raise CheckpointFormatError(f"{where}: its header entry is {_short(info)}, not an object with dtype, shape "
                                    "and data_offsets; the file is corrupt: re-save it")
    missing = [f for f in ("dtype", "shape", "data_offsets") if f not in info]
    if missing:
        raise CheckpointFormatError(f"{where}: its header entry {_short(info)} has no {', '.join(missing)}")
    name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(name, str) or name not in _DTYPES:
        raise CheckpointFormatError(f"{where}: dtype {_short(name)} is not one this loader reads; known: "
                                    f"{', '.join(_DTYPES)} (convert the tensor to one of them)")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise CheckpointFormatError(f"{where}: shape {_short(shape)} is not a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)):
        raise CheckpointFormatError(f"{where}: data_offsets {_short(offsets)} is not [begin, end] of non-negative "
                                    "ints")
    begin, end = offsets
    dtype = _DTYPES[name]
    t = CkptTensor(index, key, dtype, tuple(shape), data + begin, end - begin)
    if end < begin or data + end > size:
        raise CheckpointFormatError(f"{where}: data_offsets {offsets} lie outside the file's {size - data} data "
                                    f"bytes (truncated or corrupt: re-download or re-save it)")
    if t.numel * dtype.itemsize != t.nbytes:
        raise CheckpointFormatError(f"{where}: shape {shape} of {name} needs {t.numel * dtype.itemsize} bytes, its "
                                    f"data_offsets {offsets} hold {t.nbytes}; the file is corrupt: re-save it")
    return t


class MappedFile:
    """A checkpoint file: header parsed by the subclass (:meth:`_read` from the open file,
    :meth:`_entries` after), data mapped read-only (ACCESS_READ), one mapping per file.

    The file stays open (one descriptor) so that :meth:`check_unchanged` can
    ``fstat`` the inode that is mapped, whatever the path now names.
    """

    kind = ""  # "safetensors" | "gguf"

    def __init__(self, path: str | os.PathLike, index: int):
        self.path = Path(path)
        self.index = index
        self._fd: int | None = None
        self._fd_closer = None
        self.handed: torch.Tensor | None = None  # see handed_bytes
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.watch = FileWatch(self.path, f.fileno())
                self.identity = self.watch.opened
                raw = self._read(f, size)
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._fd = os.dup(f.fileno())
                self._fd_closer = weakref.finalize(self, os.close, self._fd)
        except OSError as e:
            raise ValueError(f"cannot open checkpoint file {str(path)!r}: {e}") from e
        self.size = size
        self.entries: dict[str, CkptTensor] = self._entries(raw, size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mapping is read-only by design: nothing writes through it
            self.u8 = torch.frombuffer(self.map, dtype=torch.uint8)

    def _read(self, f, size: int):
        """The header, read from the open file ``f`` (CheckpointFormatError if malformed)."""
        raise NotImplementedError

    def _entries(self, raw, size: int) -> dict[str, CkptTensor]:
        """The tensor entries of the header ``raw`` that :meth:`_read` returned."""
        raise NotImplementedError

    @property
    def base(self) -> int:
        return self.u8.data_ptr()

    def handed_bytes(self) -> torch.Tensor:
        """The file's bytes as ``state_dict()`` hands them out: a private copy-on-write mapping
        (ACCESS_COPY), so that a write through torch lands in a private page, where the source
        sees it (the version counter these views share), instead of faulting on the read-only one."""
        if self.handed is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # frombuffer warns about writable buffers
                self.handed = torch.frombuffer(mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
        return self.handed

    def check_unchanged(self) -> None:
        """Raise CheckpointChangedError if the mapped inode changed since it was opened."""
        if self._fd is None:
            return
        self.watch.check(self._fd)

    def close(self) -> None:
        """Drop this file's references; the mapping is unmapped once no tensor views it.

        Never ``self.map.close()``: torch.frombuffer keeps a reference to the
        mmap object but no buffer export, so closing it would unmap memory
        that live views (state_dict values, a transform's output) still read.
        """
        self.u8 = self.map = self.handed = None
        self._fd = None
        if self._fd_closer is not None:
            self._fd_closer()


class SafetensorsFile(MappedFile):
    """A safetensors file: an 8-byte header length, a JSON header, the data."""

    kind = "safetensors"

    def _read(self, f, size: int):
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFormatError(f"{self.path}: not a safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointFormatError(f"{self.path}: header length {n} exceeds the file size {size} "
                                        "(truncated, or not a safetensors file)")
        try:
            return json.loads(f.read(n)), n
        except ValueError as e:
            raise CheckpointFormatError(f"{self.path}: header is not valid JSON ({e})") from None

    def _entries(self, raw, size: int) -> dict[str, CkptTensor]:
        header, n = raw
        return _parse_entries(self.path, header, 8 + n, size, self.index)


class GGUFFile(MappedFile):
    """A GGUF file (header: :mod:`.gguf_file`): quantized tensors are uint8 entries of diffusers'
    byte shape with their ggml ``quant_type``, F32 / F16 ones typed entries. ``metadata``: its
    key-value metadata."""

    kind = "gguf"

    def _read(self, f, size: int):
        try:
            return gguf_file.read_tensors(self.path, f, size)
        except gguf_file.Malformed as e:
            raise CheckpointFormatError(str(e)) from None

    def _entries(self, raw, size: int) -> dict[str, CkptTensor]:
        self.metadata, tensors = raw
        return {k: CkptTensor(self.index, k, *info) for k, info in tensors.items()}


def open_file(path: Path, index: int) -> MappedFile:
    """The mapped checkpoint file at ``path``: a GGUF file by its ``.gguf`` suffix, else safetensors."""
    return GGUFFile(path, index) if Path(path).suffix == ".gguf" else SafetensorsFile(path, index)


@dataclass(frozen=True)
class WeightsSource:
    """Safetensors (or GGUF) weights of one component.

    path: a folder (diffusers layout: ``diffusion_pytorch_model.safetensors``,
    or sharded with ``diffusion_pytorch_model.safetensors.index.json``; also
    ``model.safetensors[.index.json]``), one ``.safetensors`` or ``.gguf`` file,
    or an ``*.index.json``. prefix: prepended to every checkpoint key (placing the
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
        if p.suffix in (".safetensors", ".gguf") and p.is_file():
            return [p]
        raise ValueError(
            f"weights source {str(p)!r} is neither a folder, a .safetensors or .gguf file, nor a "
            ".safetensors.index.json file"
        )


def _index_files(index: Path) -> list[Path]:
    """The shard files an ``*.index.json`` names (each once, in first-named order)."""
    try:
        doc = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{index}: not a readable safetensors index ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        got = f"its 'weight_map' is a {type(weight_map).__name__} ({_short(weight_map)})" if isinstance(doc, dict) \
            and "weight_map" in doc else f"it is a JSON {type(doc).__name__} without a 'weight_map'"
        raise CheckpointFormatError(f"{index}: {got}; a safetensors index maps every tensor key to its shard file "
                                    "name: {\"weight_map\": {\"key\": \"model-00001-of-00002.safetensors\", ...}}")
    for key, name in weight_map.items():
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise CheckpointFormatError(f"{index}: weight_map[{key!r}] is {_short(name)}, not the file name of a "
                                        f"shard beside the index in {index.parent}")
    if not weight_map:
        raise CheckpointFormatError(f"{index}: its weight_map is empty (it names no shard file)")
    files = []
    for name in dict.fromkeys(weight_map.values()):
        f = index.parent / name
        if not f.is_file():
            raise CheckpointFormatError(f"{index} names shard {name!r}, which does not exist in {index.parent}")
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
                f"no checkpoint given: pass source= (a folder, .safetensors or .gguf file, index.json or WeightsSource "
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
    """Read-only mappings of the safetensors (or GGUF) files of one or more sources
    (anything :func:`as_sources` accepts).

    ``entries``: prefixed key -> :class:`CkptTensor`. ``tensor(t)`` is a typed
    view of the mapping (read-only memory: never write to it).
    """

    def __init__(self, source):
        t0 = time.perf_counter()
        self.files: list[MappedFile] = []
        self.entries: dict[str, CkptTensor] = {}
        self.sources = as_sources(source)
        try:
            for src in self.sources:
                for path in src.files():
                    f = open_file(path, len(self.files))
                    self.files.append(f)
                    for key, t in f.entries.items():
                        name = src.prefix + key
                        if name in self.entries:
                            other = self.files[self.entries[name].file].path
                            raise CheckpointFormatError(f"checkpoint key {name!r} appears twice: in {other} and in "
                                                        f"{path}; keep one (or give each source its own prefix)")
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

    def tensor(self, t: CkptTensor, *, handed: bool = False) -> torch.Tensor:
        """``t`` typed, a view of the read-only mapping, or with ``handed`` of the copy-on-write one."""
        data = self.files[t.file].handed_bytes() if handed else self.files[t.file].u8
        return data[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape)

    def drop_pages(self, tensors: list[CkptTensor]) -> None:
        """Give the mapped pages that hold ``tensors`` back (MADV_DONTNEED): read once (encoded
        at setup), they would otherwise stay in this process's resident set. Nothing is lost: the
        mapping is read-only and a later read faults the pages in again from the page cache or the
        file. Pages shared with a neighbouring tensor go too (they come back the same way)."""
        if not hasattr(mmap, "MADV_DONTNEED"):  # pragma: no cover - not Linux
            return
        for t in tensors:
            f = self.files[t.file]
            if f.map is None or t.nbytes == 0:
                continue
            lo = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
            hi = min(f.size, -(-(t.offset + t.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
            try:
                f.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):  # pragma: no cover - an advice refused only costs memory
                pass

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


def gguf_on_meta(model_on_meta: nn.Module, path, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``model_on_meta`` (parameters on meta) made the model diffusers' GGUF loader makes from the
    ``.gguf`` file at ``path``, still on meta: each ``nn.Linear`` whose ``<name>.weight`` is a
    quantized tensor of the file becomes a ``GGUFLinear`` (``compute_dtype``) with a meta
    ``GGUFParameter`` of the file's byte shape and ``quant_type``; every other tensor the file holds
    takes ``compute_dtype`` (the loader casts them so). Reads the header only; returns the model,
    changed in place, for :func:`~weightstream.offload_from_safetensors` with the same file."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES, GGUFParameter  # noqa: PLC0415
    from gguf import GGMLQuantizationType  # noqa: PLC0415

    type_name = gguf_file.type_name
    try:
        entries = {k: CkptTensor(0, k, *info) for k, info in gguf_file.read_file(path)[1].items()}
    except gguf_file.Malformed as e:
        raise CheckpointFormatError(str(e)) from None
    supported = {int(t) for t in SUPPORTED_GGUF_QUANT_TYPES}

    def owner_of(key: str):
        name, _, leaf = key.rpartition(".")
        try:
            return name, leaf, model_on_meta.get_submodule(name)
        except AttributeError:  # a key the model has no module for: bind_checkpoint names it
            return name, leaf, None

    for key, e in entries.items():
        if e.quant_type is not None and e.quant_type not in supported:
            raise CheckpointFormatError(
                f"{path}: tensor {key!r} is {type_name(e.quant_type)}, a ggml type diffusers' GGUF linears do not "
                f"dequantize; supported: {', '.join(type_name(int(t)) for t in SUPPORTED_GGUF_QUANT_TYPES)}")
        name, leaf, lin = owner_of(key)
        if e.quant_type is None or leaf != "weight" or type(lin) is not nn.Linear:
            continue
        _, block, nbytes = gguf_file.GGML_TYPES[e.quant_type]
        logical = e.shape[:-1] + (e.shape[-1] // nbytes * block,)
        if logical != (lin.out_features, lin.in_features):
            raise CheckpointFormatError(
                f"{path}: tensor {key!r} is {type_name(e.quant_type)} of shape {logical} (bytes {e.shape}); the "
                f"model's {name!r} is an nn.Linear of weight shape {(lin.out_features, lin.in_features)}")
        gguf_linear(model_on_meta, name, compute_dtype, bias_given=f"{name}.bias" in entries)
    for key, e in entries.items():
        _, leaf, mod = owner_of(key)
        if mod is None:
            continue
        if e.quant_type is not None:
            mod._parameters[leaf] = GGUFParameter(torch.empty(e.shape, dtype=torch.uint8, device="meta"),
                                                  quant_type=GGMLQuantizationType(e.quant_type))
        elif mod._parameters.get(leaf) is not None:  # the model's shape: bind_checkpoint checks the file's
            shape = mod._parameters[leaf].shape
            mod._parameters[leaf] = nn.Parameter(torch.empty(shape, dtype=compute_dtype, device="meta"),
                                                 requires_grad=False)
        elif mod._buffers.get(leaf) is not None:
            mod._buffers[leaf] = torch.empty(mod._buffers[leaf].shape, dtype=compute_dtype, device="meta")
    return model_on_meta.eval()


def gguf_linear(model: nn.Module, name: str, compute_dtype: torch.dtype, *, bias_given: bool) -> None:
    """Replace ``model``'s ``nn.Linear`` ``name`` by the ``GGUFLinear`` diffusers' GGUF quantizer
    makes of it (on meta, ``compute_dtype``; its own bias cast unless the weights give one:
    ``bias_given``)."""
    from diffusers.quantizers.gguf.utils import GGUFLinear  # noqa: PLC0415

    lin = model.get_submodule(name)
    new = GGUFLinear(lin.in_features, lin.out_features, lin.bias is not None, compute_dtype=compute_dtype,
                     device="meta")
    new.source_cls = type(lin)
    new.requires_grad_(False)
    if lin.bias is not None and not bias_given:
        new.bias = nn.Parameter(lin.bias.detach().to(compute_dtype), requires_grad=False)
    parent, _, child = name.rpartition(".")
    model.get_submodule(parent)._modules[child] = new
