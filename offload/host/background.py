"""Encoding blocks on a background thread while the model keeps stepping (weight_codec="auto").

Used where the blocks are coded on the CPU (a store with ``encode_on="cpu"``); a store that codes
on the GPU codes the planned blocks at once instead (:meth:`.recode.AutoCoding.code_blocks`).

:class:`BackgroundCoding` encodes raw block images (views of the coded source's
regions) on worker threads (:func:`coded_encode.encoded_in_order`), fed by one
daemon thread, which also prepares each finished block where the source will
read it: ``prepare(k, blobs, table)`` (the source's: a buffer of the block's own,
its coded bytes written there and pinned), so that a step start only swaps a
block's host bytes (:meth:`CodedSource.check`). At most :data:`MAX_WAITING`
prepared blocks wait for a step start (host memory stays bounded when no step
comes). Each result carries the region's write version seen when the job
started: a block written since (an edit of a ``state_dict()`` tensor, an
``update_weights``) is stale and the source encodes it again itself. Nothing here
writes a region. While the job runs torch's intra-op threads are set to one
(:func:`coded_encode.in_order`: the encoders' small ops), which slows a model
stepping on the CPU meanwhile; on CUDA the step's host work is launches.
"""
from __future__ import annotations

import contextlib
import threading
import time

from weightstream.offload.host.encode import encode_workers, encoded_in_order

__all__ = ["BackgroundCoding", "background_workers", "MAX_WAITING"]

MAX_WAITING = 4  # prepared blocks waiting for a step start, at most (the job pauses meanwhile)


def background_workers() -> int:
    """Encode threads of a background job: half the cores, the other half left to the thread that
    steps the model (launches, the driver). With every core encoding, Flux-1024's raw steps took
    1.2-1.9 s instead of 0.43 during the job, and 57 blocks were stored in 18 steps over 27.6 s
    (docs/performance.md)."""
    return max(1, encode_workers() // 2)


class BackgroundCoding:
    """Blocks ``ks`` encoded with ``levels`` on a thread; :meth:`take` hands over the finished ones."""

    def __init__(self, ks, layouts, images, versions, *, levels: int, codec: str, prepare=None):
        """``prepare(k, blobs, table)``: run on the job's thread for each finished block, its
        result handed over by :meth:`take` in place of ``(blobs, table)`` (default: those)."""
        self.ks, self.codec, self.levels = list(ks), codec, levels
        self.prepare = prepare or (lambda k, blobs, table: (blobs, table))
        self.versions = dict(zip(self.ks, versions))  # region write version when the job started
        self.t0 = time.perf_counter()
        self.elapsed_s: float | None = None
        self.error: BaseException | None = None
        self._done: list = []
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(layouts, images), daemon=True,
                                        name="weightstream-auto-codec")
        self._thread.start()

    def _run(self, layouts, images) -> None:
        try:
            with contextlib.closing(encoded_in_order(layouts, images, levels=self.levels,
                                                     workers=background_workers())) as coded:
                for k, (blobs, table) in zip(self.ks, coded):
                    with self._lock:  # bounded: wait for a step start to take some
                        self._lock.wait_for(lambda: self._stop.is_set() or len(self._done) < MAX_WAITING)
                    if self._stop.is_set():
                        return
                    item = self.prepare(k, blobs, table)
                    with self._lock:
                        self._done.append((k, self.versions[k], item))
        except BaseException as e:  # handed to the stepping thread at its next take()
            self.error = e
        finally:
            self.elapsed_s = time.perf_counter() - self.t0

    def take(self, limit: int | None = None) -> list:
        """The blocks finished since the last call, at most ``limit`` (oldest first):
        ``(k, version, prepared)`` each; raises the worker's error, if any, once everything
        before it was taken."""
        with self._lock:
            n = len(self._done) if limit is None else limit
            out, self._done = self._done[:n], self._done[n:]
            self._lock.notify_all()
        if not out and self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError("weightstream: background coding of weight_codec='auto' failed; the blocks not "
                               "coded stay raw (same outputs)") from err
        return out

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> list:
        """Stop after the block being encoded (waits for it); returns the finished results not
        taken (their owner releases what ``prepare`` made)."""
        with self._lock:
            self._stop.set()
            self._lock.notify_all()
        self._thread.join()
        with self._lock:
            left, self._done = self._done, []
        return left
