"""Packing a model's streamed blocks into a host store, block by block.

The store becomes the one host copy of each block as soon as it is packed:
the block's original tensors are dropped right after, and the memory they
held goes back to the operating system before the next packs start. The
setup's host peak is therefore the model plus the bytes packed ahead of the
drop (at most ``max(largest block, AHEAD_FRACTION x the store)``), not two
models. A failure part-way gives the dropped tensors their weights back from
the store before it is closed, so nothing is lost.

Where the peak came from (issue 15): every block was submitted to the packers
at once, so while the drop and pin thread lagged (pinning is the slow step on
a GPU host) the packers filled the store far ahead of it (H200, Flux: 35.8 GB
peak RSS for 23.8 GB); and tensors below glibc's mmap threshold (a few MB)
live in malloc's heap, which keeps freed chunks mapped until trimmed.
tests/test_pack_rss.py, setup peak over the interpreter less the CPU slots:
1.77x / 1.97x the model before (Flux- / Wan-shaped, ~400 MB), 1.02x / 1.05x
with both fixed.
"""
from __future__ import annotations

import ctypes
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from weightstream.offload.progress import Progress

# bytes packed but not yet dropped, as a fraction of the store (at least one block)
AHEAD_FRACTION = 0.05
MAX_WORKERS = 8


def usable_cpus() -> int:
    """The CPUs this process may run on (``os.sched_getaffinity``; elsewhere ``os.cpu_count()``), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def malloc_trim() -> Callable[[], None]:
    """A function that hands malloc's free heap pages back to the OS
    (glibc ``malloc_trim(0)``); a no-op where the C library has none."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS, Windows)
        return lambda: None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


def ahead_bytes(sizes: list[int]) -> int:
    """How many bytes may be packed ahead of the in-order drop."""
    return max(max(sizes, default=0), int(AHEAD_FRACTION * sum(sizes)))


def pack_blocks(store, objs: list[list[torch.Tensor]], drop, *, progress: bool | None, what: str) -> None:
    """Pack block ``k``'s tensors ``objs[k]`` (layout order) into ``store``, then
    ``drop(objs[k])`` and ``store.pin(k)``, in block order.

    Packing is page-fault and memcpy bound: blocks are packed on worker threads
    (torch copies release the GIL), at most :func:`ahead_bytes` of them ahead
    of the drop; dropping, pinning and progress stay on this thread, in block
    order. Each drop is followed by a trim of malloc's heap on a worker.
    """
    sizes = [lay.nbytes for lay in store.layouts]
    bar = Progress(what, sum(sizes), progress)
    workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1, len(sizes)))
    window = _Window(store, objs, sizes, workers)
    trim = malloc_trim()
    dropped = 0
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightstream-pack") as pool:
        try:
            for k in range(len(sizes)):
                window.fill(pool)
                window.take(k)
                drop(objs[k])  # the store is now the one host copy
                dropped = k + 1
                pool.submit(trim)  # off this thread (pinning waits on it otherwise), before the next packs
                window.fill(pool)  # the next packs run while this block pins
                store.pin(k)
                bar.update(sizes[k])
        except BaseException:
            window.cancel()
            _give_back(store, objs, dropped)
            raise


class _Window:
    """The packs submitted and not yet taken, in block order, bounded in bytes."""

    def __init__(self, store, objs, sizes: list[int], workers: int):
        self.store, self.objs, self.sizes, self.workers = store, objs, sizes, workers
        self.limit = ahead_bytes(sizes)
        self.pending: deque[Future] = deque()
        self.next = 0
        self.bytes = 0

    def fill(self, pool: ThreadPoolExecutor) -> None:
        while self.next < len(self.sizes) and len(self.pending) < self.workers and (
                not self.pending or self.bytes + self.sizes[self.next] <= self.limit):
            self.pending.append(pool.submit(self.store.pack, self.next, self.objs[self.next]))
            self.bytes += self.sizes[self.next]
            self.next += 1

    def take(self, k: int) -> None:
        self.pending.popleft().result()
        self.bytes -= self.sizes[k]

    def cancel(self) -> None:
        for f in self.pending:
            f.cancel()


def _give_back(store, objs, dropped: int) -> None:
    """Nothing lost: dropped tensors get their weights back, then the store closes."""
    with torch.no_grad():
        for k in range(dropped):
            for t, hv in zip(objs[k], store.views(k)):
                t.data = hv.clone()
    store.close()
