"""The coded source over a safetensors checkpoint, and its coded sidecar file.

``offload_from_safetensors(..., config with weight_codec='exp-k' or 'exp-k2')`` streams a
:class:`~.coded.CodedSource` whose blocks come from the checkpoint mapping:
each streamed block's runtime tensors are read from the mapping (views; kernel
transforms and ``mmap_weight_transform`` applied into fresh tensors, as
:func:`..checkpoint.host_tensor` does), encoded and stored coded, a few blocks at
a time on worker threads (at most ``IN_FLIGHT_BYTES`` of raw blocks in flight;
never the whole model in RAM). Once built, the source no longer reads the
checkpoint (the coded bytes are its own copy), so the checkpoint is closed.

The coded sidecar (``coded_sidecar``): ``'off'`` encodes at every start;
``'write'`` encodes and writes ``<checkpoint dir>/.weightstream-coded/<name>.wsc``;
``'auto'`` loads a valid sidecar, else encodes and writes one; ``'read'`` must
load one (:class:`CodedSidecarError` otherwise). The file name hashes what
never changes for one checkpoint path (resolved file paths, runtime layout,
codec name, transforms: a sidecar written with one codec is never loaded for
another); its header binds the whole identity: each file's size,
inode and ``mtime_ns`` as mapped, every block's runtime layout, the codec
version and tile, every tensor's transform (kernel transform spec, the code of
an ``mmap_weight_transform`` (its bytecode, constants and plain closure values:
state it reads from elsewhere is not seen), the bytes of unbound buffers). A stale or foreign
sidecar is never used: a named error for ``'read'``, a re-encode (and rewrite)
for ``'auto'``. It is written to a temporary file and renamed (``os.replace``).

File format: ``WSCSIDE1`` (8 bytes), the header length (u64 LE), the sha256 of
the header (32 bytes), the header (JSON), then page-aligned block regions
(coded tensors as :func:`~weightstream.kernels.codec.encode` writes them, then
zero slack up to the bytes every load copies). Loading maps the file read-only,
checks the header's hash, the identity, the file size and every coded tensor's
header against the layout, then uses the mapped regions as the blocks' coded
bytes (registered read-only with CUDA; no copy: on this 2-core CPU host, mapping
and touching a warm file took 0.047 s/GB, copying it into a fresh anonymous arena
0.44 s/GB). A block re-encoded later (update_weights, an edited state_dict()
copy) moves to the source's private arena. Payload bytes are not checksummed
(that would read every byte at load); a bit flipped inside a coded stream is
not detected.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch

from weightstream.kernels import codec

from ..checkpoint import (
    Checkpoint, CheckpointChangedError, TensorBinding, _give_data, _identity, changed_message, host_tensor,
)
from ..host_store import PAGE
from ..layout import BlockLayout, align_up
from .coded import CODECS, CodedRegion, CodedSource, codec_levels, decode_placement
from .coded_encode import _capacity, decode_paths, encode_image, in_order
from .mmap_plans import build_plan, file_keys, file_ordered_layout

SIDECAR_MODES = ("off", "write", "auto", "read")
SIDECAR_DIR = ".weightstream-coded"
_MAGIC = b"WSCSIDE1"
_FORMAT = 1
_PREFIX = struct.Struct("<8sQ32s")


class CodedSidecarError(RuntimeError):
    """A coded sidecar is missing, stale (the checkpoint or the model changed), foreign or corrupt."""


def check_sidecar_mode(mode, codec_name: str) -> str:
    if not isinstance(mode, str) or mode not in SIDECAR_MODES:
        raise ValueError(f"coded_sidecar={mode!r} is not allowed; choose from: {', '.join(SIDECAR_MODES)}")
    if mode != "off" and codec_name == "none":
        raise ValueError(f"coded_sidecar={mode!r} needs weight_codec in {list(CODECS)} (got weight_codec='none'); "
                         "choose from: off")
    return mode


# -- identity ---------------------------------------------------------------------------


def _transform_id(t: torch.Tensor, b: TensorBinding | None):
    if b is None:  # an unbound real buffer (non-persistent): its bytes are part of the image
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ["local", hashlib.sha256(data).hexdigest()]
    if b.kernel is not None:
        return ["kernel", b.src.key, *b.kernel]
    if b.transform is not None:
        fn = b.transform
        code = getattr(fn, "__code__", None)
        cells = [_cell(c) for c in getattr(fn, "__closure__", None) or ()]
        body = repr((code.co_code, code.co_consts, cells)) if code is not None else repr(fn)
        return ["callable", f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}",
                hashlib.sha256(body.encode()).hexdigest()]
    return ["ckpt", b.src.key]


def _cell(c) -> str:
    """A closure value as the identity sees it (numbers, strings, small containers; else its type)."""
    try:
        v = c.cell_contents
    except ValueError:  # an empty cell
        return "<empty>"
    return repr(v) if isinstance(v, (int, float, str, bool, tuple, type(None))) else type(v).__qualname__


def _codec_id(codec_name: str) -> list:
    """The codec part of a sidecar's identity: its name, the format version it writes, the tile
    ("exp-k" keeps the identity sidecars were first written with)."""
    version = {1: codec.VERSION, 2: codec.VERSION2, codec.PATCHED: codec.VERSION3}[codec_levels(codec_name)]
    return [codec_name, version, codec.DEFAULT_TILE]


def identity(ckpt: Checkpoint, layouts: list[BlockLayout], tensors, bindings, codec_name: str = "exp-k") -> dict:
    """What a sidecar is bound to: ``stable`` (names the file) and ``files`` (checked in the header)."""
    blocks = []
    for lay, ts in zip(layouts, tensors):
        specs = [[s.name, str(s.dtype), list(s.shape), list(s.stride), s.offset, _transform_id(t, bindings.get(id(t)))]
                 for s, t in zip(lay.tensors, ts)]
        blocks.append({"name": lay.name, "nbytes": lay.nbytes, "tensors": specs})
    stable = {"format": _FORMAT, "codec": _codec_id(codec_name),
              "paths": [os.path.abspath(f.path) for f in ckpt.files], "blocks": blocks}
    files = [{"size": f.identity[2], "ino": f.identity[1], "mtime_ns": f.identity[3]} for f in ckpt.files]
    return json.loads(json.dumps({"stable": stable, "files": files}))  # as a header reads back


def sidecar_path(ckpt: Checkpoint, ident: dict) -> Path:
    digest = hashlib.sha256(json.dumps(ident["stable"], sort_keys=True).encode()).hexdigest()[:32]
    # beside the path as given (a Hugging Face snapshot's symlinks are not followed into its blobs)
    return Path(os.path.abspath(ckpt.files[0].path)).parent / SIDECAR_DIR / f"{digest}.wsc"


# -- reading -------------------------------------------------------------------------------


def _corrupt(path: Path, why: str) -> CodedSidecarError:
    return CodedSidecarError(f"coded sidecar {str(path)!r} is not usable: {why}")


def _read_header(path: Path, m) -> tuple[dict, int]:
    if len(m) < _PREFIX.size:
        raise _corrupt(path, f"truncated ({len(m)} bytes, no header)")
    magic, n, digest = _PREFIX.unpack(m[: _PREFIX.size])
    if magic != _MAGIC:
        raise _corrupt(path, f"magic {magic!r}, expected {_MAGIC!r} (not a weightstream coded sidecar)")
    raw = m[_PREFIX.size : _PREFIX.size + n]
    if len(raw) != n or hashlib.sha256(raw).digest() != digest:
        raise _corrupt(path, "its header does not match its checksum (corrupt or truncated)")
    return json.loads(raw), _PREFIX.size + n


def _stale_reason(head: dict, ident: dict) -> str | None:
    if head.get("stable") != ident["stable"]:
        return "it was written for another runtime layout, codec version or transforms (a foreign sidecar)"
    for i, (was, now) in enumerate(zip(head.get("files", []), ident["files"])):
        if was != now:
            diffs = ", ".join(f"{k} {was.get(k)} -> {v}" for k, v in now.items() if was.get(k) != v)
            return f"checkpoint file {ident['stable']['paths'][i]!r} changed since it was written ({diffs})"
    if len(head.get("files", [])) != len(ident["files"]):
        return "it was written for another set of checkpoint files"
    return None


def _region(path: Path, u8: torch.Tensor, lay: BlockLayout, rec: dict, paths: dict) -> CodedRegion:
    off, n, coded = rec["offset"], rec["copy_bytes"], rec["coded"]
    if off % PAGE or off + n > u8.numel() or not coded <= n <= _capacity(lay):
        raise _corrupt(path, f"block {lay.name!r} lies at [{off}, {off + n}) of a {u8.numel()}-byte file (truncated?)")
    data = u8[off : off + n]
    try:
        table = codec.DecodeTable.from_buffer(data, [s for s, _ in rec["segments"]], [d for _, d in rec["segments"]],
                                              **paths)
    except ValueError as e:
        raise _corrupt(path, f"block {lay.name!r}: {e}") from None
    want = sorted((s.offset, s.nbytes) for s in lay.tensors if s.nbytes)
    got = sorted((g.dst_offset, g.header.decoded_bytes) for g in table.segments)
    if len(want) != len(got) or any(d != wd or not wn <= gn <= wn + 1 for (wd, wn), (d, gn) in zip(want, got)) \
            or table.src_nbytes > coded:
        raise _corrupt(path, f"block {lay.name!r}: its coded tensors do not match the runtime layout")
    return CodedRegion(data, table, coded)


def load_sidecar(path: Path, ident: dict, layouts: list[BlockLayout]) -> tuple[list[CodedRegion], "_Watched"]:
    """The mapped coded regions of a valid sidecar and its open file (identity checks);
    CodedSidecarError otherwise."""
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            watch = _Watched(path, f.fileno())
    except (OSError, ValueError) as e:
        raise CodedSidecarError(f"coded sidecar {str(path)!r} cannot be read: {e}") from None
    head, _ = _read_header(path, m)
    why = _stale_reason(head, ident)
    if why is not None:
        raise CodedSidecarError(f"coded sidecar {str(path)!r} is stale: {why}")
    recs = head.get("blocks", [])
    if len(recs) != len(layouts) or head.get("size") != len(m):
        raise _corrupt(path, f"{len(m)} bytes and {len(recs)} blocks, its header says {head.get('size')} bytes "
                             f"and the model streams {len(layouts)} blocks (truncated?)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only by design: nothing writes through it
        u8 = torch.frombuffer(m, dtype=torch.uint8)
    paths = decode_paths(codec_levels(ident["stable"]["codec"][0]))  # as the tables it re-encodes will
    return [_region(path, u8, lay, r, paths) for lay, r in zip(layouts, recs)], watch


class _Watched:
    """The mapped sidecar's inode, size and mtime as mapped (``check``: one fstat; the
    sidecar is only ever replaced atomically, so a change means someone wrote it in place)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, os.dup(fd)
        self.size = os.fstat(self.fd).st_size
        self.identity = _identity(os.fstat(self.fd))
        self._closer = weakref.finalize(self, os.close, self.fd)

    def check(self) -> None:
        now = _identity(os.fstat(self.fd))
        if now != self.identity:
            raise CheckpointChangedError(changed_message(self.path, self.identity, now))

    def close(self) -> None:
        self._closer()


# -- writing ---------------------------------------------------------------------------------


def write_sidecar(path: Path, ident: dict, src: CodedSource) -> int:
    """Write ``src``'s coded blocks to ``path`` atomically (temp file + os.replace); its size."""
    recs, at = [], 0
    for k in range(len(src.layouts)):
        segs = [[s.src_offset, s.dst_offset] for s in src.tables[k].segments]
        recs.append({"offset": at, "copy_bytes": align_up(src.copy_bytes[k], PAGE), "coded": src.coded[k],
                     "segments": segs})
        at += align_up(src.copy_bytes[k], PAGE)
    head = {**ident, "blocks": recs}
    for _ in range(2):  # the header's own length moves the data start; twice settles it
        raw = json.dumps({**head, "size": 0}).encode()
        start = align_up(_PREFIX.size + len(raw) + 64, PAGE)
        size = start + at
        head["blocks"] = [{**r, "offset": start + sum(x["copy_bytes"] for x in recs[:i])} for i, r in enumerate(recs)]
        raw = json.dumps({**head, "size": size}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_PREFIX.pack(_MAGIC, len(raw), hashlib.sha256(raw).digest()) + raw)
            for k, r in enumerate(head["blocks"]):
                f.seek(r["offset"])
                data = src.region(k)[: min(r["copy_bytes"], src.region(k).numel())]
                f.write(data.numpy().tobytes())
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return size


# -- the source ------------------------------------------------------------------------------


class MmapCodedSource(CodedSource):
    """A CodedSource built from a checkpoint mapping (or its coded sidecar); see the module docstring."""

    name_suffix = "-mmap"  # "coded-<codec>-mmap"
    sidecar = None  # the mapped sidecar (_Watched), when blocks were loaded from one

    def check(self) -> None:
        """Step start: the coded checks, and the mapped sidecar unchanged (CheckpointChangedError)."""
        super().check()
        if self.sidecar is not None:
            self.sidecar.check()

    def uncapturable(self) -> str | None:
        why = super().uncapturable()
        if why is None and self.device.type == "cuda":
            for b in self._backing:
                if b is not None and not b.is_pinned():
                    return ("cuda_graphs='on' cannot capture copies from the mapped coded sidecar: torch does not "
                            "count registered file pages as pinned; use coded_sidecar='off' (or cuda_graphs='off')")
        return why

    def stats(self) -> dict:
        return {**super().stats(), **self.sidecar_stats, "checkpoint_files": self.checkpoint_files}

    def close(self) -> None:
        super().close()
        self._backing = [None] * len(self._backing)
        if self.sidecar is not None:
            self.sidecar.close()


def _write(path: Path, ident: dict, src: CodedSource, must: bool) -> int:
    """write_sidecar; with ``must`` False (coded_sidecar='auto') a failure only warns."""
    try:
        return write_sidecar(path, ident, src)
    except OSError as e:
        if must:
            raise CodedSidecarError(f"coded_sidecar='write' cannot write {str(path)!r}: {e}") from e
        warnings.warn(f"weightstream: coded sidecar {str(path)!r} not written ({e}); the next start encodes "
                      "again", stacklevel=5)
        return 0


IN_FLIGHT_BYTES = 4 << 30  # raw block bytes encoded at once (bounds the coded blobs waiting in order)


def _runtime_tensors(ckpt: Checkpoint, plan, layout: BlockLayout, tensors, bindings) -> list[torch.Tensor]:
    """Block ``plan.k``'s runtime host tensors: views of the mapping (no transform), fresh
    tensors (kernel transforms, ``mmap_weight_transform``), the private bytes of unbound buffers."""
    local = iter(plan.local)
    out = []
    for spec, t in zip(layout.tensors, tensors):
        b = bindings.get(id(t))
        out.append(host_tensor(ckpt, b) if b is not None else next(local)[0].view(spec.dtype).view(spec.shape))
    return out


def _encode_blocks(ckpt: Checkpoint, layouts, plans, tensors, bindings, counter: list, levels: int = 1):
    """(blobs, table) of every block in order, encoded on workers from the mapping (the files
    checked before and after each block: never a truncated read, never a mixed block)."""

    def work(k: int):
        ckpt.check_unchanged()
        blobs_table = encode_image(layouts[k], _runtime_tensors(ckpt, plans[k], layouts[k], tensors[k], bindings),
                                   levels=levels)
        ckpt.check_unchanged()
        return blobs_table

    for done in in_order(len(layouts), work, ahead=max(1, IN_FLIGHT_BYTES // max(lay.nbytes for lay in layouts))):
        counter[0] += 1  # counted here, on the consuming thread
        yield done


def mmap_coded_source(req, ckpt: Checkpoint, bindings: dict, sidecar: str = "off", timings: dict | None = None):
    """A :class:`MmapCodedSource` for the streamed blocks of ``req`` from ``ckpt`` (closed once built)."""
    cfg, device = req.config, req.device
    tensors = [[t for _, _, t in ts] for ts in req.tensors]
    layouts = [file_ordered_layout(lay, file_keys(ts, bindings, len(ckpt.files))) for lay, ts in zip(req.layouts, tensors)]
    ident = identity(ckpt, layouts, tensors, bindings, cfg.weight_codec)
    path = sidecar_path(ckpt, ident)
    t0 = time.perf_counter()
    regions, size, watch = None, 0, None
    if sidecar in ("auto", "read"):
        try:
            regions, watch = load_sidecar(path, ident, layouts)
            size = watch.size
        except CodedSidecarError as e:
            if sidecar == "read":
                raise
            if path.exists():
                warnings.warn(f"weightstream: {e}; encoding the checkpoint again and rewriting it", stacklevel=4)
    plans = [build_plan(k, lay, ts, bindings) for k, (lay, ts) in enumerate(zip(layouts, tensors))]
    with torch.no_grad():  # streamed tensors leave meta: the source drops them to placeholders
        for ts in tensors:
            for t in ts:
                if t.device.type == "meta":
                    _give_data(t, torch.empty(0, dtype=t.dtype, device=device))
    counter = [0]
    levels = codec_levels(cfg.weight_codec)
    encoded = regions if regions is not None else _encode_blocks(ckpt, layouts, plans, tensors, bindings, counter,
                                                                 levels)
    budget = cfg.pinned_memory_budget_gb
    src = MmapCodedSource(layouts, tensors, device=device, pin=cfg.pin_memory, progress=cfg.progress,
                          budget_bytes=None if budget is None else int(budget * 1e9), encoded=encoded,
                          codec=cfg.weight_codec, **decode_placement(cfg))
    load_s = time.perf_counter() - t0
    try:
        ckpt.check_unchanged()  # resident weights and packed blocks were read from the mapping
        write_s = 0.0
        if sidecar == "write" or (sidecar == "auto" and regions is None):
            t1 = time.perf_counter()
            size = _write(path, ident, src, must=sidecar == "write")
            write_s = time.perf_counter() - t1
    except BaseException:
        src.close()
        raise
    if regions is not None:
        src.encode_s, src.sidecar = 0.0, watch
    src.checkpoint_files = len(ckpt.files)
    src.sidecar_stats = {
        "coded_sidecar": sidecar, "sidecar_path": str(path) if sidecar != "off" else None,
        "sidecar_loaded": regions is not None, "sidecar_load_s": load_s if regions is not None else 0.0,
        "sidecar_bytes": size, "sidecar_write_s": write_s, "blocks_encoded": counter[0],
        "sidecar_s_per_gb": load_s / (size / 1e9) if regions is not None and size else None,
        **(timings or {}),
    }
    ckpt.close()  # the coded bytes are the source's own now (its arena, or the sidecar mapping)
    return src
