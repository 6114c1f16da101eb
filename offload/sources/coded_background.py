"""Encoding blocks on a background thread while the model keeps stepping (weight_codec="auto").

:class:`BackgroundCoding` encodes raw block images (views of the coded source's
regions) on worker threads (:func:`coded_encode.encoded_in_order`), fed by one
daemon thread; finished blocks wait in a list until the source takes them at a
step start (:meth:`CodedSource.check`), where it stores them over the raw images
between steps. Each result carries the region's write version seen when the job
started: a block written since (an edit of a ``state_dict()`` tensor, an
``update_weights``) is stale and the source encodes it again itself. Nothing here
writes a region.
"""
from __future__ import annotations

import contextlib
import threading
import time

from .coded_encode import encoded_in_order

__all__ = ["BackgroundCoding"]


class BackgroundCoding:
    """Blocks ``ks`` encoded with ``levels`` on a thread; :meth:`take` hands over the finished ones."""

    def __init__(self, ks, layouts, images, versions, *, levels: int, codec: str):
        self.ks, self.codec, self.levels = list(ks), codec, levels
        self.versions = dict(zip(self.ks, versions))  # region write version when the job started
        self.t0 = time.perf_counter()
        self.elapsed_s: float | None = None
        self.error: BaseException | None = None
        self._done: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(layouts, images), daemon=True,
                                        name="weightstream-auto-codec")
        self._thread.start()

    def _run(self, layouts, images) -> None:
        try:
            with contextlib.closing(encoded_in_order(layouts, images, levels=self.levels)) as coded:
                for k, (blobs, table) in zip(self.ks, coded):
                    if self._stop.is_set():
                        return
                    with self._lock:
                        self._done.append((k, self.versions[k], blobs, table))
        except BaseException as e:  # handed to the stepping thread at its next take()
            self.error = e
        finally:
            self.elapsed_s = time.perf_counter() - self.t0

    def take(self) -> list:
        """The blocks finished since the last call: ``(k, version, blobs, table)`` each; raises
        the worker's error, if any, once everything before it was taken."""
        with self._lock:
            out, self._done = self._done, []
        if not out and self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError("weightstream: background coding of weight_codec='auto' failed; the blocks not "
                               "coded stay raw (same outputs)") from err
        return out

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the block being encoded (waits for it); finished results are dropped."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._done = []
