"""Asynchronous staging: pack streamed blocks into two host buffers on a thread.

Used by the mmap source (:mod:`..sources.mmap`) for blocks whose checkpoint
pages cannot be copied to the device directly (no registration, budget
exhausted, a Python ``mmap_weight_transform``, or a CPU device). A
background *packer* thread walks the streaming schedule ahead of the
forward pass and packs each staged block into one of exactly two host
buffers (pinned on CUDA). The forward thread never copies weights on the
host: its ``_issue`` only waits until the block it needs is packed
(:meth:`Stager.acquire`), issues the H2D copy from that buffer and hands the
buffer back (:meth:`Stager.release`) together with a CUDA event recorded
after the copy. Before the packer overwrites a buffer it synchronises that
event on its own thread, so a buffer is never written while a copy still
reads it.

Packing itself can be split over a small pool of copy threads
(:class:`CopyPool`, ``threads`` > 1): one thread's ``memcpy`` reaches a
fraction of the host's memory bandwidth, and the packer must keep up with the
H2D engine for the fallback to stay near the pinned-store step time.

Ordering: staged positions are packed in schedule order, buffer ``j % 2``
for the ``j``-th staged position of a *generation*. A generation starts when
the executor asks for a position other than the next expected one (an
executor re-prime after an exception or a failed graph capture); packed
buffers of the old generation are dropped, never handed out.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from weightstream.offload.host.registration import _Registration
from weightstream.offload.host.arena import PAGE
from weightstream.offload.host.packing import usable_cpus
from weightstream.offload.layout import align_up

NUM_BUFFERS = 2
# Default packing threads: the CPUs this process may run on, less two (the
# forward thread and the packer's own), at most 16. On the H200 machine (16
# CPUs) one memcpy thread moves ~6 GB/s and 12-16 threads reach the host's
# memory bandwidth (perf/results/hostcopy-*.json).
MAX_DEFAULT_THREADS = 16
PIECE_MIN = 1 << 20
PIECE_MAX = 64 << 20


def default_threads() -> int:
    return max(1, min(MAX_DEFAULT_THREADS, usable_cpus() - 2))


def check_threads(threads) -> int:
    """Validate a ``staging_threads`` value (None: :func:`default_threads`)."""
    if threads is None:
        return default_threads()
    if not isinstance(threads, int) or isinstance(threads, bool):
        raise TypeError(f"staging_threads={threads!r} must be an int >= 1 (or None for the default)")
    if threads < 1:
        raise ValueError(f"staging_threads={threads} is not allowed; choose an int >= 1 (1: pack on the packer thread alone)")
    return threads


class CopyPool:
    """Host ``memcpy`` split over ``threads`` threads (``ctypes.memmove`` drops the GIL).

    :meth:`copy` takes (destination address, source address, bytes) runs, cuts
    them into pieces of 1 to 64 MiB so that every thread gets several, and
    returns when all are copied (re-raising the first failure).
    """

    def __init__(self, threads: int, name: str = "weightstream-stager-copy"):
        self.threads = check_threads(threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=name)
        self.thread_names: set[str] = set()
        self.bytes = 0

    def _run(self, dst: int, src: int, n: int) -> None:
        self.thread_names.add(threading.current_thread().name)
        ctypes.memmove(dst, src, n)

    def pieces(self, runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Cut ``runs`` into the pieces the threads copy (pure; tested on its own)."""
        total = sum(n for _, _, n in runs)
        if total == 0:
            return []
        size = min(PIECE_MAX, max(PIECE_MIN, -(-total // (4 * self.threads))))
        out = []
        for dst, src, n in runs:
            at = 0
            while at < n:
                k = min(size, n - at)
                out.append((dst + at, src + at, k))
                at += k
        return out

    def copy(self, runs: list[tuple[int, int, int]]) -> None:
        futures = [self._pool.submit(self._run, *piece) for piece in self.pieces(runs)]
        for f in futures:
            f.result()
        self.bytes += sum(n for _, _, n in runs)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"CopyPool({self.threads} threads)"


class StagingError(RuntimeError):
    """Packing a staged block failed on the packer thread (the cause is chained)."""


class PinnedBuffer:
    """A host byte buffer: registered anonymous mapping, else ``pin_memory=True``, else pageable."""

    def __init__(self, nbytes: int, *, pin: bool):
        self.nbytes = max(int(nbytes), 1)
        self.kind = "pageable"
        self.failure: str | None = None
        self._reg = _Registration()
        self._map = None
        self._finalizer = weakref.finalize(self, self._reg.release)
        if not pin:
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8)
            return
        size = align_up(self.nbytes, PAGE)
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arena = torch.frombuffer(self._map, dtype=torch.uint8)
        self.failure = self._reg.register(arena.data_ptr(), size)
        if self.failure is None:
            self.tensor, self.kind = arena[: self.nbytes], "registered"
            return
        self._reg.release()
        del arena
        self._map = None
        try:
            self.tensor, self.kind = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True), "pin_memory"
        except RuntimeError as e:  # pragma: no cover - no pinned memory at all
            self.failure += f"; pin_memory=True failed too ({e})"
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8)

    def release(self) -> None:
        """Unregister (callers make sure no copy still reads the buffer)."""
        self._finalizer()


class Stager:
    """Two staging buffers filled by one packer thread, ahead of the forward pass.

    ``positions(start)`` yields the staged schedule positions from ``start``
    on, in order; ``block_of(position)`` names the block to pack there and
    ``pack(block, buffer, pool)`` writes its runtime image into a uint8
    buffer, splitting its copies over ``pool`` (a :class:`CopyPool`, or None
    with ``threads=1``).
    ``nbytes``: the largest staged image. ``device``: where the H2D copies go
    (events and pinned buffers on CUDA; pageable buffers and no events on CPU).
    """

    def __init__(
        self,
        pack: Callable[[int, torch.Tensor], None],
        positions: Callable[[int], Iterator[int]],
        block_of: Callable[[int], int],
        nbytes: int,
        device: torch.device,
        *,
        pin: bool = True,
        threads: int | None = 1,
        new_event: Callable[[], object] | None = None,
    ):
        self._pack, self._positions, self._block_of = pack, positions, block_of
        # threads > 1: pack() receives a CopyPool to split its copies over
        self.pool = CopyPool(threads) if check_threads(threads) > 1 else None
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.buffers = [PinnedBuffer(nbytes, pin=pin and self.cuda) for _ in range(NUM_BUFFERS)]
        # new_event: the stream backend's event factory (offload/streams.py), so that a
        # RecordingStreams run on the CPU traces h2d_done too; default torch.cuda.Event on CUDA
        if new_event is None and self.cuda:
            new_event = torch.cuda.Event
        self.h2d_done = [new_event() for _ in self.buffers] if new_event is not None else []
        self._recorded = [False] * NUM_BUFFERS
        self._cv = threading.Condition()
        self._ready: list[int | None] = [None] * NUM_BUFFERS  # position packed in buffer b (current generation)
        self._gen = 0
        self._start = self._expect = next(positions(0))
        self._error: BaseException | None = None
        self._stop = False
        # counters (read by tests and stats; written under the lock)
        self.packs = 0
        self.max_ready = 0  # most buffers packed and not yet handed out at once
        self.restarts = 0
        self.wait_s = 0.0  # time the forward thread waited for packing
        self.pack_s = 0.0
        self._start_thread()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="weightstream-stager", daemon=True)
        self._thread.start()

    # -- packer thread ---------------------------------------------------------
    def _run(self) -> None:
        if self.cuda and self.device.index is not None:  # set_device needs an index
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                if self._stop:
                    return
                gen, start = self._gen, self._start
            for j, q in enumerate(self._positions(start)):
                b = j % NUM_BUFFERS
                with self._cv:
                    while not self._stop and self._gen == gen and self._ready[b] is not None:
                        self._cv.wait()
                    if self._stop:
                        return
                    if self._gen != gen:
                        break
                if self.h2d_done and self._recorded[b]:
                    self.h2d_done[b].synchronize()  # the last H2D that read buffer b has finished
                t0 = time.perf_counter()
                try:
                    self._pack(self._block_of(q), self.buffers[b].tensor, self.pool)
                except BaseException as e:  # handed to the forward thread by acquire()
                    with self._cv:
                        self._error = e
                        self._cv.notify_all()
                    return
                with self._cv:
                    self.packs += 1
                    self.pack_s += time.perf_counter() - t0
                    if self._gen == gen:
                        self._ready[b] = q
                        self.max_ready = max(self.max_ready, sum(r is not None for r in self._ready))
                    self._cv.notify_all()

    # -- forward thread ----------------------------------------------------------
    def acquire(self, position: int) -> int:
        """Wait until ``position``'s block is packed; return its buffer index."""
        t0 = time.perf_counter()
        with self._cv:
            if position != self._expect:
                self._restart(position)
            while True:
                if self._error is not None:  # handed out once: the packer starts again (a transient failure)
                    error, self._error, self._expect = self._error, None, None
                    self._start_thread()
                    raise StagingError(
                        f"weightstream: packing a staged block failed on the packer thread: {error!r}; this step "
                        "was stopped, the next one packs again") from error
                if self._stop:
                    raise RuntimeError("weightstream: the stager was stopped")
                for b, q in enumerate(self._ready):
                    if q == position:
                        self.wait_s += time.perf_counter() - t0
                        return b
                self._cv.wait()

    def release(self, b: int, position: int) -> None:
        """The copy out of buffer ``b`` was issued (and, with events, ``h2d_done[b]`` recorded after it)."""
        with self._cv:
            self._recorded[b] = bool(self.h2d_done)
            self._ready[b] = None
            it = self._positions(position + 1)
            self._expect = next(it)
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the packer reads nothing: every buffer is packed ahead (or
        it failed, or was stopped). True if so within ``timeout`` seconds. Not on
        the hot path (tests; before touching checkpoint files)."""
        with self._cv:
            return self._cv.wait_for(
                lambda: self._stop or self._error is not None or all(r is not None for r in self._ready), timeout
            )

    def invalidate(self) -> None:
        """Drop what is packed ahead (the host images changed): the next
        :meth:`acquire` starts a new generation at the position it asks for."""
        with self._cv:
            self._expect = None

    def _restart(self, position: int) -> None:
        self._gen += 1
        self._start = self._expect = position
        self._ready = [None] * NUM_BUFFERS
        self.restarts += 1
        self._cv.notify_all()

    # -- lifecycle -------------------------------------------------------------
    def stop(self) -> None:
        """Stop the packer (waits for a pack in progress) and unregister the buffers."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        for ev, rec in zip(self.h2d_done, self._recorded):
            if rec:
                ev.synchronize()
        for buf in self.buffers:
            buf.release()
        if self.pool is not None:
            self.pool.close()

    @property
    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def stats(self) -> dict:
        with self._cv:
            return {
                "staging_buffers": len(self.buffers),
                "staging_bytes": self.buffer_bytes,
                "staging_kind": self.buffers[0].kind,
                "staging_threads": 1 if self.pool is None else self.pool.threads,
                "staging_packs": self.packs,
                "staging_max_ready": self.max_ready,
                "staging_restarts": self.restarts,
                "staging_wait_s": round(self.wait_s, 6),
                "staging_pack_s": round(self.pack_s, 6),
            }

    def __repr__(self) -> str:
        return (
            f"Stager({len(self.buffers)} x {self.buffers[0].nbytes / 2**20:.1f} MiB {self.buffers[0].kind}, "
            f"{1 if self.pool is None else self.pool.threads} packing thread(s), {self.packs} packs)"
        )
