"""Coding block images on the GPU: the Triton encoder behind a staging pair (weight_codec on CUDA).

:class:`DeviceEncoder` codes blocks with :func:`weightstream.kernels.codec_encode_gpu.encode_jobs`:
each block is cut into pieces of whole tensors (at most :data:`PIECE_BYTES` of image bytes, or one
larger tensor); a piece's raw image bytes go up into one of ``depth`` (:data:`DEPTH`) device staging
buffers on a copy stream, are coded there on a stream of their own into one of ``depth`` coded
staging buffers, and its
coded bytes come back on a third stream into the block's host region, so that the upload of piece
i + 1, the encode of piece i and the download of piece i - 1 overlap, each issued from a thread of
its own (:meth:`DeviceEncoder.run`). The coded bytes are the CPU encoder's (:func:`.encode.encode_image`, the reference and the encoder of CPU devices): the same
rule per tensor (:func:`tensor_jobs`), the same table (:func:`.encode.decode_paths`). Host memory:
the regions the coded bytes go to (no second host copy of a block) and four pinned buffers of
:data:`HOST_CHUNK_BYTES`; device memory: the 2 x ``depth`` staging buffers, allocated per
:class:`DeviceEncoder` and freed with it.

Pieces of one block are coded back to back in its region; when the region is also the raw source
(weight_codec="auto" codes raw blocks where they lie), a block is one piece (:func:`pieces`
``whole``), so that its coded bytes are written only after all of its raw bytes went up.

Pageable host memory goes through two pinned host buffers each way (:class:`HostStaging`, made on
first use, on CUDA): measured on the H200 machine, a copy from pageable memory runs 6.5 GB/s and one
into freshly mapped pageable memory 1.3 GB/s (it faults every page on the copy's path), where a
host copy and a copy from or into registered memory run 15-50 GB/s. A piece's pageable tensors are
copied into its slot's pinned buffer, then up; its coded bytes come down into a pinned buffer and
are copied from it into the block's region.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from dataclasses import dataclass

import torch

from weightstream.kernels.codec_encode_gpu import EncodeJob, encode_jobs
from weightstream.kernels.codec_format import CodecSegment, DecodeTable
from weightstream.offload.host.encode import CODED_DTYPES, _raw_bound, decode_paths, has_fp8
from weightstream.offload.host.staging import PinnedBuffer
from weightstream.offload.layout import BlockLayout, TensorSpec
from weightstream.offload.streams import CudaStreams, RecordingStreams

__all__ = ["DEPTH", "DeviceEncoder", "HOST_CHUNK_BYTES", "HostStaging", "PIECE_BYTES", "by_offset", "code_on_device", "fill_from_tensors", "piece_bytes_for", "pieces", "tensor_jobs"]

PIECE_BYTES = 256 << 20  # image bytes a piece holds at most (one tensor larger than this is a piece alone)
HOST_CHUNK_BYTES = 64 << 20  # each of the four pinned host buffers (two up, two down)
# device staging buffers of each kind (raw, coded): the stages run DEPTH - 1 pieces apart at most,
# so that pieces of unequal sizes (whole tensors) do not hold the next stage at every step
DEPTH = 3


def tensor_jobs(specs, base: int = 0) -> list[EncodeJob]:
    """The encode jobs of ``specs`` (non-empty tensors of one block) in an image that starts at
    byte ``base`` of the block's: :func:`.encode._encode_tensor`'s rule (16-bit and float8
    floats coded, raw at k = 8 past their raw bound; every other dtype raw at k = 8, its bytes as int16)."""
    jobs = []
    for s in specs:
        if s.dtype in CODED_DTYPES:
            jobs.append(EncodeJob(s.offset - base, s.nbytes, s.dtype, None, _raw_bound(s)))
        else:
            jobs.append(EncodeJob(s.offset - base, s.nbytes, torch.int16, 8))
    return jobs


def piece_bytes_for(device, free_bytes: int | None = None) -> int:
    """The piece size the setup's encoder cuts blocks into on ``device``: :data:`PIECE_BYTES`, less
    where the 2 x :data:`DEPTH` staging buffers would take more than a quarter of the device's free
    memory (``free_bytes``; None: asked of CUDA; 16 MB at least)."""
    device = torch.device(device)
    if free_bytes is None:
        if device.type != "cuda":
            return PIECE_BYTES
        free_bytes = torch.cuda.mem_get_info(device)[0]
    return max(16 << 20, min(PIECE_BYTES, free_bytes // (8 * DEPTH)))


@dataclass(frozen=True)
class Piece:
    """Tensors ``specs`` of block ``k``: image bytes [base, base + span); ``last`` of the block."""

    k: int
    base: int
    span: int
    specs: tuple[TensorSpec, ...]
    last: bool

    @property
    def coded_bound(self) -> int:
        return sum(_raw_bound(s) for s in self.specs)


def pieces(k: int, layout: BlockLayout, piece_bytes: int = PIECE_BYTES, *, whole: bool = False) -> list[Piece]:
    """Block ``k``'s non-empty tensors in pieces of whole tensors, in layout order (the order the
    CPU encoder lays their coded bytes out in; ``whole``: one piece)."""
    runs: list[list[TensorSpec]] = []
    lo = hi = 0  # the image bytes the last run spans
    for s in (s for s in layout.tensors if s.nbytes):
        if runs and (whole or max(hi, s.offset + s.nbytes) - min(lo, s.offset) <= piece_bytes):
            runs[-1].append(s)
            lo, hi = min(lo, s.offset), max(hi, s.offset + s.nbytes)
        else:
            runs.append([s])
            lo, hi = s.offset, s.offset + s.nbytes
    out = []
    for i, run in enumerate(runs):
        base = min(s.offset for s in run)
        out.append(Piece(k, base, max(s.offset + s.nbytes for s in run) - base, tuple(run), i == len(runs) - 1))
    if not out:  # a block with no bytes: one empty piece, so that it is done like the others
        out.append(Piece(k, 0, 0, (), True))
    return out


class HostStaging:
    """Pageable host bytes to and from the device through two pinned host buffers of ``nbytes``
    (registered where ``pin``: :class:`~.staging.PinnedBuffer`, made on first use), a chunk at a
    time: a chunk's host copy into one buffer overlaps the other's DMA. The buffers bound the
    host memory staging takes (the setup's peak RSS), whatever a piece's size. Host copies are
    torch copies: the GIL released for each and the bytes split over torch's threads (a pool of
    Python threads copying slices ran 4.6-6.7 GB/s on the H200 machine, each slice waiting for the
    GIL the encoder's other stages hold). ``streams``: the backend whose events order the reuse."""

    def __init__(self, nbytes: int, *, pin: bool, streams):
        self.nbytes, self.pin = max(int(nbytes), 16), pin
        self._buffers: list[PinnedBuffer] = []
        self._events = [streams.new_event() for _ in range(2)]
        self._issued = [False, False]  # a copy was issued on the buffer (its event recorded)
        self._next = 0

    def _take(self) -> tuple[int, torch.Tensor]:
        """The next buffer, once the last copy that read or wrote it is done."""
        if not self._buffers:
            self._buffers = [PinnedBuffer(self.nbytes, pin=self.pin) for _ in range(2)]
        b, self._next = self._next, 1 - self._next
        if self._issued[b]:
            self._events[b].synchronize()
        return b, self._buffers[b].tensor

    def _issued_on(self, b: int, stream) -> None:
        self._events[b].record(stream)
        self._issued[b] = True

    def upload(self, runs: list[tuple[torch.Tensor, torch.Tensor]], stream) -> None:
        """(device destination, host source) uint8 runs of equal length: each source packed into
        the buffers, chunk by chunk, and copied up on ``stream`` (the current one)."""
        todo: list[tuple[torch.Tensor, torch.Tensor]] = []
        b, buf, used = None, None, 0
        with torch.no_grad():
            for dst, src in runs:
                at, n = 0, src.numel()
                while at < n:
                    if buf is None or used == self.nbytes:
                        if todo:
                            self._up(b, todo, stream)
                        (b, buf), used, todo = self._take(), 0, []
                    m = min(self.nbytes - used, n - at)
                    buf[used : used + m].copy_(src[at : at + m])
                    todo.append((dst[at : at + m], buf[used : used + m]))
                    used, at = used + m, at + m
            if todo:
                self._up(b, todo, stream)

    def _up(self, b: int, todo, stream) -> None:
        for dst, host in todo:
            dst.copy_(host, non_blocking=True)
        self._issued_on(b, stream)

    def download(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """Device uint8 ``src`` into host ``dst`` (as long), chunk by chunk on ``stream`` (the
        current one): the copy out of one buffer overlaps the DMA into the other. Returns once
        ``dst`` holds the bytes."""
        prev = None
        with torch.no_grad():
            for at in range(0, src.numel(), self.nbytes):
                m = min(self.nbytes, src.numel() - at)
                b, buf = self._take()
                buf[:m].copy_(src[at : at + m], non_blocking=True)
                self._issued_on(b, stream)
                if prev is not None:
                    self._drain(*prev)
                prev = (b, dst[at : at + m])
            if prev is not None:
                self._drain(*prev)

    def _drain(self, b: int, dst: torch.Tensor) -> None:
        self._events[b].synchronize()
        dst.copy_(self._buffers[b].tensor[: dst.numel()])

    def close(self) -> None:
        for buf in self._buffers:
            buf.release()
        self._buffers = []


class DeviceEncoder:
    """Blocks coded on ``device`` (see the module docstring); ``streams``: a backend of
    :mod:`weightstream.offload.streams` (CUDA streams on CUDA; RecordingStreams on the CPU, where
    the encoder runs under TRITON_INTERPRET=1 and nothing is asynchronous). ``host_staging``: copy
    pageable host memory through pinned buffers (:class:`HostStaging`, two each way of ``host_chunk``
    bytes; None: on a CUDA device). ``depth``: device staging buffers of each kind (raw, coded)."""

    def __init__(self, device, streams, items: list[Piece], levels: int, *, host_staging: bool | None = None,
                 host_chunk: int = HOST_CHUNK_BYTES, depth: int = DEPTH):
        if not isinstance(depth, int) or depth < 2:
            raise ValueError(f"depth={depth!r} is not allowed: staging buffers of each kind, an int >= 2")
        self.device, self.streams, self.levels, self.items = torch.device(device), streams, levels, list(items)
        self.depth = depth
        raw = max((p.span for p in self.items), default=0)
        coded = max((p.coded_bound for p in self.items), default=0)
        # 16 bytes more: a tensor of an odd byte count loads one byte past its span (its value unused)
        self.raw = [torch.empty(raw + 16, dtype=torch.uint8, device=self.device) for _ in range(depth)]
        self.coded = [torch.empty(max(coded, 16), dtype=torch.uint8, device=self.device) for _ in range(depth)]
        self.up, self.enc, self.down = (streams.new_stream(self.device) for _ in range(3))
        self.up_done = [streams.new_event() for _ in range(depth)]
        self.enc_done = [streams.new_event() for _ in range(depth)]
        self.down_done = [streams.new_event() for _ in range(depth)]
        self.staging_bytes = depth * (self.raw[0].numel() + self.coded[0].numel())
        stage = self.device.type == "cuda" if host_staging is None else bool(host_staging)
        pin, chunk = self.device.type == "cuda", min(raw + 16, host_chunk)
        self.host_up = HostStaging(chunk, pin=pin, streams=streams) if stage else None
        self.host_down = HostStaging(chunk, pin=pin, streams=streams) if stage else None

    def close(self) -> None:
        for h in (self.host_up, self.host_down):
            if h is not None:
                h.close()

    def run(self, fill, dest, done) -> None:
        """Code every piece. ``fill(piece, staging, host)``: issue the copy of the piece's image bytes
        into ``staging[:piece.span]`` on the current stream (tensor i at ``spec.offset -
        piece.base``), pageable ones through ``host`` (``host.upload(runs)``: the uploads'
        :class:`HostStaging`, or None: :func:`fill_from_tensors`). ``dest(k, at, n)``: (host uint8 view of block ``k``'s coded bytes [at, at +
        n), its memory: "pinned" (copied into without blocking), "pageable" (a blocking copy) or
        "mixed" (partly registered: through a fresh host tensor)). ``done(k, nbytes, table)``:
        once block ``k``'s coded bytes are all on the host, in block order.

        Four threads, each a stage of the pipeline (:class:`_Lanes`): uploads (``fill``, which
        holds its thread while it copies pageable memory), encodes (the calling thread: the
        encoder's one host sync, its histograms), downloads, and ``done`` (such as dropping the
        originals and pinning the region), so that no stage waits for another's host work."""
        self.up.wait_stream(self.streams.current_stream(self.device))  # tensors on the device may be written there
        lanes = _Lanes()
        raw_free, coded_free = threading.Semaphore(self.depth), threading.Semaphore(self.depth)  # free to overwrite
        uploaded: queue.Queue = queue.Queue()

        def upload(i: int) -> None:
            lanes.acquire(raw_free)  # the encode of piece i - depth was issued: its buffer may be refilled
            self._upload(i, fill)
            uploaded.put(i)

        finish = lanes.lane("weightstream-encode-done", lambda item: done(*item), drain=True)
        down = lanes.lane("weightstream-encode-down", self._downloader(dest, coded_free, finish))
        ups = lanes.lane("weightstream-encode-up", upload)
        try:
            for i in range(len(self.items)):
                ups.put(i)
            for i, piece in enumerate(self.items):
                s = i % self.depth
                lanes.get(uploaded)
                lanes.acquire(coded_free)  # the download of piece i - depth was issued
                self.enc.wait_event(self.up_done[s])
                self.enc.wait_event(self.down_done[s])  # ... before this encode overwrites its buffer
                with self.streams.stream(self.enc):
                    coded, heads, offs = encode_jobs(self.raw[s], tensor_jobs(piece.specs, piece.base),
                                                     self.coded[s], levels=self.levels)
                    self.enc_done[s].record(self.enc)
                raw_free.release()
                down.put((i, piece, coded, heads, offs))
        except _Stopped:
            pass  # a stage failed: its failure is raised below
        except BaseException:
            lanes.stop.set()
            raise
        finally:
            for lane in (ups, down, finish):  # in pipeline order: each ends after the one feeding it
                lane.end()
        lanes.raise_failure()

    def _downloader(self, dest, coded_free: threading.Semaphore, finish: "_Lane"):
        """The download stage: each coded piece back to its block's host bytes, in order; the
        block to ``finish`` once its bytes arrived."""
        state = {"segs": [], "at": 0, "fp8": False}

        def download(item) -> None:
            i, piece, coded, heads, offs = item
            s, at = i % self.depth, state["at"]
            view, memory = dest(piece.k, at, coded.numel())
            self.down.wait_event(self.enc_done[s])
            with self.streams.stream(self.down):
                if memory == "pinned":
                    view.copy_(coded, non_blocking=True)
                elif self.host_down is not None:  # through the pinned buffers, chunk by chunk
                    self.host_down.download(view, coded, self.down)
                elif memory == "pageable":
                    view.copy_(coded)
                else:  # "mixed": partly registered host memory, through a fresh host tensor
                    view.copy_(coded.cpu())
                self.down_done[s].record(self.down)
            coded_free.release()
            state["segs"] += [CodecSegment(at + o, spec.offset, h) for o, spec, h in zip(offs, piece.specs, heads)]
            state["at"] = at + coded.numel()
            state["fp8"] = state["fp8"] or has_fp8(piece.specs)
            if piece.last:
                self.down_done[s].synchronize()
                finish.put((piece.k, state["at"], DecodeTable(state["segs"], **decode_paths(self.levels, state["fp8"]))))
                state.update(segs=[], at=0, fp8=False)

        return download

    def _upload(self, i: int, fill) -> None:
        s = i % self.depth
        self.up.wait_event(self.enc_done[s])  # the staging buffer's last encode is done
        host = None if self.host_up is None else _Upload(self.host_up, self.up)
        with self.streams.stream(self.up):
            fill(self.items[i], self.raw[s], host)
            self.up_done[s].record(self.up)


class _Lane:
    """A thread running ``step(item)`` for each item :meth:`put`, in order, until :meth:`end`;
    after a failure anywhere (``lanes.stop``) it skips what is left, unless ``drain``: then it runs
    every item it is given (the done stage: each item is a block whose coded bytes already lie in
    its host region, which must be committed as coded, or the region would be read as raw)."""

    def __init__(self, lanes: "_Lanes", name: str, step, drain: bool = False):
        self.lanes, self.step, self.items, self.drain = lanes, step, queue.Queue(), drain
        self.thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self.thread.start()

    def put(self, item) -> None:
        self.items.put(item)

    def end(self) -> None:
        self.items.put(None)
        self.thread.join()

    def _loop(self) -> None:
        while (item := self.items.get()) is not None:
            if self.lanes.stop.is_set() and not self.drain:
                continue
            try:
                self.step(item)
            except BaseException as e:  # handed to the calling thread
                self.lanes.failed.append(e)
                self.lanes.stop.set()


class _Lanes:
    """The stages of one :meth:`DeviceEncoder.run`: their threads, the first failure, a stop flag
    every wait polls (a stage never waits for good on one that failed)."""

    POLL_S = 0.05

    def __init__(self):
        self.failed: list[BaseException] = []
        self.stop = threading.Event()

    def lane(self, name: str, step, drain: bool = False) -> _Lane:
        return _Lane(self, name, step, drain)

    def _check(self) -> None:
        if self.stop.is_set():
            raise _Stopped("weightstream: a stage of the GPU encoder stopped")

    def acquire(self, sem: threading.Semaphore) -> None:
        while not sem.acquire(timeout=self.POLL_S):
            self._check()

    def get(self, q: queue.Queue):
        while True:
            try:
                return q.get(timeout=self.POLL_S)
            except queue.Empty:
                self._check()

    def raise_failure(self) -> None:
        real = [e for e in self.failed if not isinstance(e, _Stopped)]
        if real:
            raise real[0]


class _Stopped(RuntimeError):
    """A stage gave up waiting: another one failed (that failure is what is raised)."""


@dataclass(frozen=True)
class _Upload:
    """What a ``fill`` stages pageable tensors through: the uploads' :class:`HostStaging` on ``stream``."""

    staging: HostStaging
    stream: object

    def upload(self, runs) -> None:
        self.staging.upload(runs, self.stream)


def fill_from_tensors(tensors_of):
    """A ``fill`` copying block tensors (``tensors_of(k)``: block ``k``'s tensors in layout order,
    any device) into the staging buffer, the gaps between and inside strided tensors zeroed (the
    CPU encoder reads a strided tensor's span with zeros between its elements)."""

    def fill(piece: Piece, staging: torch.Tensor, host=None) -> None:
        ts = tensors_of(piece.k, piece.specs)
        staging[: piece.span].zero_()
        staged = {i for i, (spec, t) in enumerate(zip(piece.specs, ts)) if host is not None and _stageable(spec, t)}
        if staged:  # pageable and contiguous: through the pinned buffers
            host.upload([(staging[piece.specs[i].offset - piece.base :][: piece.specs[i].nbytes], _bytes_of(ts[i]))
                         for i in sorted(staged)])
        with torch.no_grad():
            for i, (spec, t) in enumerate(zip(piece.specs, ts)):
                if i not in staged:
                    at = spec.offset - piece.base
                    dataclasses.replace(spec, offset=at).view_of(staging).copy_(t.detach(), non_blocking=True)

    return fill


def _stageable(spec: TensorSpec, t: torch.Tensor) -> bool:
    """A tensor copied up through the pinned buffer: on the host, not pinned, its bytes one run."""
    return (t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() == spec.nbytes
            and spec.nbytes > 0 and not (torch.cuda.is_available() and t.is_pinned()))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor's bytes, as a flat uint8 view."""
    return t.detach().reshape(-1).view(torch.uint8)


def by_offset(layout: BlockLayout, tensors, specs) -> list[torch.Tensor]:
    """The tensors of ``specs`` (non-empty tensors of ``layout``) from ``tensors`` (in layout order)."""
    at = {spec.offset: t for spec, t in zip(layout.tensors, tensors) if spec.nbytes}
    return [at[spec.offset] for spec in specs]


def code_on_device(device, block_pieces, levels: int, fill, dest, done, streams=None, *,
                   release: bool = False, host_staging: bool | None = None, host_chunk: int = HOST_CHUNK_BYTES,
                   depth: int = DEPTH) -> int:
    """Code the blocks of ``block_pieces`` (per block, :func:`pieces`) on ``device`` (see
    :meth:`DeviceEncoder.run` for ``fill``, ``dest``, ``done``); ``streams``: CUDA streams on CUDA,
    RecordingStreams on the CPU by default. ``release``: give the staging buffers' memory back to
    the driver afterwards (``torch.cuda.empty_cache``: at setup, so that the device's used memory
    does not keep them). ``host_staging``, ``host_chunk`` (bytes of each pinned host buffer),
    ``depth``: see :class:`DeviceEncoder`. Returns the device bytes the
    staging buffers took."""
    device = torch.device(device)
    if streams is None:
        streams = CudaStreams() if device.type == "cuda" else RecordingStreams()
    encoder = DeviceEncoder(device, streams, [p for ps in block_pieces for p in ps], levels,
                            host_staging=host_staging, host_chunk=host_chunk, depth=depth)
    try:
        encoder.run(fill, dest, done)
    finally:
        staging = encoder.staging_bytes
        encoder.close()
        del encoder
        if release and device.type == "cuda":
            torch.cuda.empty_cache()
    return staging
