"""The coded sidecar: a checkpoint's coded block images in a file of their own, verified.

``offload_from_safetensors(..., config with weight_codec='exp-k' or 'exp-k2')`` streams a
:class:`~weightstream.offload.sources.mmap.MmapCodedSource` whose blocks come from the
checkpoint mapping, encoded (:mod:`weightstream.offload.checkpoint_offload`), or from this
sidecar, its regions used where they lie as :class:`~.images.CodedRegion` s.

The coded sidecar (``coded_sidecar``): ``'off'`` encodes at every start;
``'write'`` encodes and writes ``<checkpoint dir>/.weightstream-coded/<name>.wsc``;
``'auto'`` loads a valid sidecar, else encodes and writes one; ``'read'`` must
load one (:class:`CodedSidecarError` otherwise). The file name hashes what
never changes for one checkpoint path (resolved file paths, runtime layout,
codec name, transforms: a sidecar written with one codec is never loaded for
another); its header binds the whole identity: each file's device, inode, size,
``mtime_ns`` and ``ctime_ns`` as mapped (a checkpoint rewritten in place with its
mtime put back still moves its ctime), every block's runtime layout, the codec
version and tile, every tensor's transform (kernel transform spec, the code of
an ``mmap_weight_transform`` (its bytecode, constants and plain closure values:
state it reads from elsewhere is not seen), the bytes of unbound buffers). A stale or foreign
sidecar is never used: a named error for ``'read'``, a re-encode (and rewrite)
for ``'auto'``. It is written to a temporary file and renamed (``os.replace``).

File format: ``WSCSIDE1`` (8 bytes), the header length (u64 LE), the sha256 of
the header (32 bytes), the header (JSON), zero bytes up to the first page-aligned
block region, then the block regions back to back up to the end of the file
(coded tensors as :func:`~weightstream.kernels.codec_encode.encode` writes them, then
zero slack up to the bytes every load copies). Each block record names what it
describes (position, block index and name, a digest of its runtime layout) and
holds a sha256 over those fields and the sha256 of every 16 MiB piece of its
region: a record moved to another block, a region swapped with another, a byte
flipped anywhere in the file is refused. Loading maps the file read-only,
checks the header's hash, the identity, the records against the layout, the file
size and every coded tensor's header, then uses the mapped regions as the
blocks' coded bytes (registered read-only with CUDA; no copy: on this 2-core CPU
host, mapping and touching a warm file took 0.047 s/GB, copying it into a fresh
anonymous arena 0.44 s/GB). The payload checksums are computed at load on
:func:`verify_threads` daemon threads, piece by piece in block order (sha256 with
SHA-NI, warm page cache, on this 2-core EPYC host: 1.70 GB/s on one thread, 3.35 GB/s
on two; 0.4-0.5 GB/s while other work holds both cores); ``'read'`` returns at once and a block's first load (or
any decode of it: ``state_dict()``, ``disable()``, ``image()``) waits for its own
checksum, so the steady step pays nothing (one list read per load); ``'auto'``
waits for all of them at load, so that a sidecar that does not match is
re-encoded and rewritten (one warning naming the block) instead of failing later.
A block re-encoded later (update_weights, an edited state_dict() copy) moves to
the source's private arena. Paths that read the mapped regions off the hot path
(decodes for ``state_dict()``, ``disable()``, ``image()``) ``fstat`` the sidecar
first: a sidecar truncated or written in place is a :class:`CheckpointChangedError`
naming it and the blocks still held in private memory, never a SIGBUS.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from weightstream.kernels.codec_format import DEFAULT_TILE, PATCHED, VERSION, VERSION2, VERSION3, DecodeTable
from weightstream.offload.codecs import CODECS, codec_levels
from weightstream.offload.host.arena import PAGE
from weightstream.offload.host.binding import TensorBinding
from weightstream.offload.host.checkpoint import Checkpoint, CheckpointChangedError, FileWatch, changed_message
from weightstream.offload.host.encode import _capacity, decode_paths, has_fp8
from weightstream.offload.host.images import BlockImages, CodedRegion
from weightstream.offload.host.packing import usable_cpus
from weightstream.offload.layout import BlockLayout, align_up

SIDECAR_MODES = ("off", "write", "auto", "read")
SIDECAR_DIR = ".weightstream-coded"
_MAGIC = b"WSCSIDE1"
_FORMAT = 2  # 2: block records bound to their block, payload checksums, ctime in the identity
_PREFIX = struct.Struct("<8sQ32s")
PIECE = 16 << 20  # bytes of a block region hashed at once (the sidecar's fstat before each)
VERIFY_THREADS_MAX = 8
_BOUND = ("position", "index", "name", "layout", "copy_bytes", "coded", "segments")  # what a block digest covers


class CodedSidecarError(RuntimeError):
    """A coded sidecar is missing, stale (the checkpoint or the model changed), foreign or corrupt."""


def check_sidecar_mode(mode, codec_name: str) -> str:
    if not isinstance(mode, str) or mode not in SIDECAR_MODES:
        raise ValueError(f"coded_sidecar={mode!r} is not allowed; choose from: {', '.join(SIDECAR_MODES)}")
    if mode != "off" and codec_name == "none":
        raise ValueError(f"coded_sidecar={mode!r} needs weight_codec in {list(CODECS)} (got weight_codec='none'); "
                         "choose from: off")
    return mode


def verify_threads() -> int:
    """Threads that hash a loaded sidecar: the CPUs this process may run on, at most 8."""
    return max(1, min(VERIFY_THREADS_MAX, usable_cpus()))


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
    version = {1: VERSION, 2: VERSION2, PATCHED: VERSION3}[codec_levels(codec_name)]
    return [codec_name, version, DEFAULT_TILE]


_FILE_KEYS = ("dev", "ino", "size", "mtime_ns", "ctime_ns")  # a checkpoint file's identity, in _identity's order


def identity(ckpt: Checkpoint, layouts: list[BlockLayout], tensors, bindings, codec_name: str = "exp-k") -> dict:
    """What a sidecar is bound to: ``stable`` (names the file) and ``files`` (checked in the header)."""
    blocks = []
    for lay, ts in zip(layouts, tensors):
        specs = [[s.name, str(s.dtype), list(s.shape), list(s.stride), s.offset, _transform_id(t, bindings.get(id(t)))]
                 for s, t in zip(lay.tensors, ts)]
        blocks.append({"name": lay.name, "nbytes": lay.nbytes, "tensors": specs})
    stable = {"format": _FORMAT, "codec": _codec_id(codec_name),
              "paths": [os.path.abspath(f.path) for f in ckpt.files], "blocks": blocks}
    files = [dict(zip(_FILE_KEYS, f.identity)) for f in ckpt.files]
    return json.loads(json.dumps({"stable": stable, "files": files}))  # as a header reads back


def sidecar_path(ckpt: Checkpoint, ident: dict) -> Path:
    digest = hashlib.sha256(json.dumps(ident["stable"], sort_keys=True).encode()).hexdigest()[:32]
    # beside the path as given (a Hugging Face snapshot's symlinks are not followed into its blobs)
    return Path(os.path.abspath(ckpt.files[0].path)).parent / SIDECAR_DIR / f"{digest}.wsc"


def _layout_digest(block: dict) -> str:
    """The digest of one block's entry of the stable identity (its name, size, tensors, transforms)."""
    return hashlib.sha256(json.dumps(block, sort_keys=True).encode()).hexdigest()


def _pieces(n: int) -> list[tuple[int, int]]:
    """The [start, end) pieces a block region of ``n`` bytes is hashed in."""
    return [(a, min(a + PIECE, n)) for a in range(0, n, PIECE)] or [(0, 0)]


def _block_digest(rec: dict, pieces: list[bytes]) -> str:
    """A block's checksum: sha256 over what its record describes and its pieces' sha256s."""
    h = hashlib.sha256(json.dumps({f: rec[f] for f in _BOUND}, sort_keys=True).encode())
    for d in pieces:
        h.update(d)
    return h.hexdigest()


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
    try:
        head = json.loads(raw)
    except ValueError as e:
        raise _corrupt(path, f"its header is not JSON ({e})") from None
    if not isinstance(head, dict):
        raise _corrupt(path, f"its header is a JSON {type(head).__name__}, not an object")
    return head, _PREFIX.size + n


def _stale_reason(head: dict, ident: dict) -> str | None:
    if head.get("stable") != ident["stable"]:
        return "it was written for another runtime layout, codec version or transforms (a foreign sidecar)"
    for i, (was, now) in enumerate(zip(head.get("files", []), ident["files"])):
        if was != now:
            moved = [k for k, v in now.items() if was.get(k) != v]
            diffs = ", ".join(f"{k} {was.get(k)} -> {now[k]}" for k in moved)
            hint = (" (only its ctime moved: it was written in place with its size and mtime put back, or its "
                    "metadata changed: chmod, touch, a hard link, a rename)" if moved == ["ctime_ns"] else "")
            return f"checkpoint file {ident['stable']['paths'][i]!r} changed since it was written ({diffs}){hint}"
    if len(head.get("files", [])) != len(ident["files"]):
        return "it was written for another set of checkpoint files"
    return None


def _check_records(path: Path, head: dict, ident: dict, layouts: list[BlockLayout], m, data_start: int) -> list:
    """The block records, each bound to the block it describes, tiling the file from its
    first region to its end with only zero bytes between the header and that region."""
    recs = head.get("blocks")
    if not isinstance(recs, list) or len(recs) != len(layouts) or head.get("size") != len(m):
        raise _corrupt(path, f"{len(m)} bytes and {len(recs) if isinstance(recs, list) else 'no'} blocks, its header "
                             f"says {head.get('size')} bytes and the model streams {len(layouts)} blocks (truncated?)")
    at = None
    for k, (lay, rec) in enumerate(zip(layouts, recs)):
        if not isinstance(rec, dict) or any(f not in rec for f in _BOUND + ("offset", "sha256")) \
                or not all(isinstance(rec[f], int) and rec[f] >= 0 for f in ("offset", "copy_bytes", "coded")):
            raise _corrupt(path, f"block record {k} is not a complete record ({str(rec)[:80]})")
        want = {"position": k, "index": lay.index, "name": lay.name,
                "layout": _layout_digest(ident["stable"]["blocks"][k])}
        got = {f: rec[f] for f in want}
        if got != want:
            raise _corrupt(path, f"block record {k} describes block {got['name']!r} (position {got['position']}, "
                                 f"index {got['index']}), but the model streams {lay.name!r} (index {lay.index}) there "
                                 "with its layout: its records were swapped or edited")
        if at is not None and rec["offset"] != at:
            raise _corrupt(path, f"block {lay.name!r} starts at byte {rec['offset']}, the block before it ends at {at}")
        at = rec["offset"] + rec["copy_bytes"]
    first = recs[0]["offset"] if recs else len(m)
    if at not in (None, len(m)) or first < data_start or m[data_start:first] != bytes(first - data_start):
        raise _corrupt(path, f"its block regions do not tile [{data_start}, {len(m)}) after zero padding (the last "
                             f"ends at {at}, the first starts at {first}): corrupt")
    return recs


def _region(path: Path, u8: torch.Tensor, lay: BlockLayout, rec: dict, paths: dict) -> CodedRegion:
    off, n, coded = rec["offset"], rec["copy_bytes"], rec["coded"]
    if off % PAGE or off + n > u8.numel() or not coded <= n <= _capacity(lay):
        raise _corrupt(path, f"block {lay.name!r} lies at [{off}, {off + n}) of a {u8.numel()}-byte file (truncated?)")
    data = u8[off : off + n]
    try:
        table = DecodeTable.from_buffer(data, [s for s, _ in rec["segments"]], [d for _, d in rec["segments"]],
                                              **{**paths, "bytes8": has_fp8(lay.tensors)})
    except (ValueError, TypeError) as e:
        raise _corrupt(path, f"block {lay.name!r}: {e}") from None
    want = sorted((s.offset, s.nbytes) for s in lay.tensors if s.nbytes)
    got = sorted((g.dst_offset, g.header.decoded_bytes) for g in table.segments)
    if len(want) != len(got) or any(d != wd or not wn <= gn <= wn + 1 for (wd, wn), (d, gn) in zip(want, got)) \
            or table.src_nbytes > coded:
        raise _corrupt(path, f"block {lay.name!r}: its coded tensors do not match the runtime layout")
    return CodedRegion(data, table, coded)


def load_sidecar(path: Path, ident: dict, layouts: list[BlockLayout],
                 threads: int | None = None) -> tuple[list[CodedRegion], "_Watched", "_Verifier"]:
    """The mapped coded regions of a valid sidecar, its open file (identity checks) and the
    verifier hashing its block regions (started here); CodedSidecarError otherwise."""
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            watch = _Watched(path, f.fileno())
    except (OSError, ValueError) as e:
        raise CodedSidecarError(f"coded sidecar {str(path)!r} cannot be read: {e}") from None
    try:
        head, data_start = _read_header(path, m)
        why = _stale_reason(head, ident)
        if why is not None:
            raise CodedSidecarError(f"coded sidecar {str(path)!r} is stale: {why}")
        recs = _check_records(path, head, ident, layouts, m, data_start)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only by design: nothing writes through it
            u8 = torch.frombuffer(m, dtype=torch.uint8)
        paths = decode_paths(codec_levels(ident["stable"]["codec"][0]))  # as the tables it re-encodes will
        regions = [_region(path, u8, lay, r, paths) for lay, r in zip(layouts, recs)]
    except BaseException:
        watch.close()
        raise
    return regions, watch, _Verifier(path, memoryview(m), recs, layouts, watch, threads or verify_threads())


class _Watched:
    """The mapped sidecar's identity as mapped (``check``: one fstat, :class:`~.checkpoint.FileWatch`;
    the sidecar is only ever replaced atomically, so a change means someone wrote it in place)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, os.dup(fd)
        self.size = os.fstat(self.fd).st_size
        self.watch = FileWatch(path, self.fd, what="coded sidecar")
        self._closer = weakref.finalize(self, os.close, self.fd)

    def check(self, left=None) -> None:
        """CheckpointChangedError if the sidecar changed; ``left()``: what the user still has
        (built only then)."""
        now = self.watch.changed(self.fd) if self._closer.alive else None
        if now is not None:
            raise CheckpointChangedError(changed_message(self.path, self.watch.identity, now, "coded sidecar",
                                                         left() if left is not None else None))

    def close(self) -> None:
        self._closer()


class _Verifier:
    """The payload checksums of a mapped sidecar's blocks, hashed on ``threads`` daemon threads
    from load on, piece by piece in block order (the sidecar's fstat before each piece: a file
    truncated meanwhile is a named error, not a SIGBUS). :meth:`wait` blocks until one block's
    own pieces are hashed and compares them with its record (CodedSidecarError naming it)."""

    def __init__(self, path: Path, mv: memoryview, recs: list, layouts: list[BlockLayout], watch: _Watched,
                 threads: int):
        self.path, self._mv, self._recs, self._watch = path, mv, recs, watch
        self._names = [lay.name for lay in layouts]
        self._jobs = [(k, j, r["offset"] + a, r["offset"] + b) for k, r in enumerate(recs)
                      for j, (a, b) in enumerate(_pieces(r["copy_bytes"]))]
        self._digests: list[list[bytes | None]] = [[None] * len(_pieces(r["copy_bytes"])) for r in recs]
        self.ok = [False] * len(recs)  # block k matched its record (read by the forward thread only)
        self._bad: dict[int, str] = {}
        self._next, self._done, self._error, self._stop = 0, 0, None, False
        self._cv = threading.Condition()
        self.threads, self.bytes, self.hash_s, self.wait_s = threads, sum(r["copy_bytes"] for r in recs), 0.0, 0.0
        self._t0 = time.perf_counter()
        self._workers = [threading.Thread(target=self._run, name=f"weightstream-sidecar-verify-{i}", daemon=True)
                         for i in range(threads)]
        for w in self._workers:
            w.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._stop or self._error is not None or self._next == len(self._jobs):
                    return
                k, j, a, b = self._jobs[self._next]
                self._next += 1
            try:
                self._watch.check()
                d = hashlib.sha256(self._mv[a:b]).digest()  # releases the GIL
            except BaseException as e:  # handed to the thread that waits
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                return
            with self._cv:
                self._digests[k][j] = d
                self._done += 1
                if self._done == len(self._jobs):
                    self.hash_s = time.perf_counter() - self._t0
                self._cv.notify_all()

    def wait(self, k: int) -> None:
        """Block ``k``'s checksum, compared (once; a mismatch is raised again at every call)."""
        if self.ok[k]:
            return
        if k in self._bad:
            raise CodedSidecarError(self._bad[k])
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or self._stop or None not in self._digests[k])
            pieces, error = list(self._digests[k]), self._error
        self.wait_s += time.perf_counter() - t0
        if None in pieces:
            if isinstance(error, CheckpointChangedError):
                raise CheckpointChangedError(str(error)) from error
            raise CodedSidecarError(f"coded sidecar {str(self.path)!r}: block {self._names[k]!r} was not verified "
                                    f"({'the source was closed' if error is None else repr(error)})") from error
        if _block_digest(self._recs[k], pieces) != self._recs[k]["sha256"]:
            self._bad[k] = (
                f"coded sidecar {str(self.path)!r}: the bytes of block {self._names[k]!r} (position {k}) do not match "
                "the checksum its header records (corrupt on disk, or written in place); nothing decoded from them "
                "was used. Delete the sidecar, or start with coded_sidecar='auto' (re-encodes from the checkpoint "
                "and rewrites it) or coded_sidecar='write'")
            raise CodedSidecarError(self._bad[k])
        self.ok[k] = True

    def wait_all(self) -> None:
        for k in range(len(self.ok)):
            self.wait(k)

    def stop(self, join: bool = True) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if join:
            for w in self._workers:
                if w is not threading.current_thread():
                    w.join()
            self._mv.release()  # no thread reads the mapping through it any more

    def stats(self) -> dict:
        return {"sidecar_verify_threads": self.threads, "sidecar_verified_blocks": sum(self.ok),
                "sidecar_hash_s": round(self.hash_s, 6), "sidecar_verify_wait_s": round(self.wait_s, 6)}


# -- writing ---------------------------------------------------------------------------------


def _payload(src: BlockImages, k: int, n: int) -> memoryview:
    """Exactly the ``n`` bytes block ``k``'s region is written as (its host bytes, then zeros)."""
    region = src.region(k)
    data = memoryview(region[: min(n, region.numel())].numpy())
    return data if len(data) == n else memoryview(bytes(data) + bytes(n - len(data)))


def _piece_digests(payloads: list[memoryview], threads: int) -> list[list[bytes]]:
    """The sha256 of every piece of every payload, on ``threads`` threads."""
    jobs = [(k, a, b) for k, p in enumerate(payloads) for a, b in _pieces(len(p))]
    with ThreadPoolExecutor(threads, thread_name_prefix="weightstream-sidecar-hash") as pool:
        digests = list(pool.map(lambda job: hashlib.sha256(payloads[job[0]][job[1] : job[2]]).digest(), jobs))
    out: list[list[bytes]] = [[] for _ in payloads]
    for (k, _, _), d in zip(jobs, digests):
        out[k].append(d)
    return out


def write_sidecar(path: Path, ident: dict, src: BlockImages, threads: int | None = None) -> int:
    """Write ``src``'s coded blocks to ``path`` atomically (temp file + os.replace); its size."""
    recs, payloads = [], []
    for k, lay in enumerate(src.layouts):
        n = align_up(src.copy_bytes[k], PAGE)
        payloads.append(_payload(src, k, n))
        recs.append({"position": k, "index": lay.index, "name": lay.name,
                     "layout": _layout_digest(ident["stable"]["blocks"][k]), "offset": 0, "copy_bytes": n,
                     "coded": src.coded[k], "segments": [[s.src_offset, s.dst_offset] for s in src.tables[k].segments]})
    for rec, pieces in zip(recs, _piece_digests(payloads, threads or verify_threads())):
        rec["sha256"] = _block_digest(rec, pieces)
    head = {**ident, "blocks": recs}
    for _ in range(2):  # the header's own length moves the data start; twice settles it
        raw = json.dumps({**head, "size": 0}).encode()
        start = align_up(_PREFIX.size + len(raw) + 64, PAGE)
        size = start + sum(r["copy_bytes"] for r in recs)
        head["blocks"] = [{**r, "offset": start + sum(x["copy_bytes"] for x in recs[:i])} for i, r in enumerate(recs)]
        raw = json.dumps({**head, "size": size}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_PREFIX.pack(_MAGIC, len(raw), hashlib.sha256(raw).digest()) + raw)
            f.seek(start)
            for data in payloads:
                f.write(data)
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return size


def write_or_warn(path: Path, ident: dict, src: BlockImages, must: bool) -> int:
    """write_sidecar; with ``must`` False (coded_sidecar='auto') a failure only warns."""
    try:
        return write_sidecar(path, ident, src)
    except OSError as e:
        if must:
            raise CodedSidecarError(f"coded_sidecar='write' cannot write {str(path)!r}: {e}") from e
        warnings.warn(f"weightstream: coded sidecar {str(path)!r} not written ({e}); the next start encodes "
                      "again", stacklevel=5)
        return 0


def try_sidecar(path: Path, ident: dict, layouts, mode: str):
    """(regions, watch, verifier) of a valid sidecar, or Nones (``'auto'``: a warning says why;
    ``'read'``: CodedSidecarError). ``'auto'`` waits for every checksum here, so that a sidecar
    that does not match is re-encoded instead of failing at its first use."""
    watch = verifier = None
    try:
        regions, watch, verifier = load_sidecar(path, ident, layouts)
        if mode == "auto":
            verifier.wait_all()
        return regions, watch, verifier
    except BaseException as e:
        if verifier is not None:
            verifier.stop()
        if watch is not None:
            watch.close()
        if mode == "read" or not isinstance(e, CodedSidecarError):
            raise
        if path.exists():
            warnings.warn(f"weightstream: {e}; encoding the checkpoint again and rewriting it", stacklevel=5)
        return None, None, None
