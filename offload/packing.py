"""Packing a model's streamed blocks into a host store, block by block.

The store becomes the one host copy of each block as soon as it is packed:
the block's original tensors are dropped right after (the peak is the model
plus the blocks in flight, not two models). A failure part-way gives the
dropped tensors their weights back from the store before it is closed, so
nothing is lost.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .progress import Progress


def pack_blocks(store, objs: list[list[torch.Tensor]], drop, *, progress: bool | None, what: str) -> None:
    """Pack block ``k``'s tensors ``objs[k]`` (layout order) into ``store``, then
    ``drop(objs[k])`` and ``store.pin(k)``, in block order.

    Packing is page-fault and memcpy bound: blocks are packed on worker threads
    (torch copies release the GIL); dropping, pinning and progress stay on this
    thread, in block order.
    """
    layouts = store.layouts
    bar = Progress(what, sum(lay.nbytes for lay in layouts), progress)
    workers = max(1, min(8, os.cpu_count() or 1, len(layouts)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightstream-pack") as pool:
        packed = [pool.submit(store.pack, k, objs[k]) for k in range(len(layouts))]
        dropped = 0
        try:
            for k, fut in enumerate(packed):
                fut.result()
                drop(objs[k])  # the store is now the one host copy
                dropped = k + 1
                store.pin(k)
                bar.update(layouts[k].nbytes)
        except BaseException:
            for f in packed:
                f.cancel()
            with torch.no_grad():  # nothing lost: give dropped tensors their weights back
                for k in range(dropped):
                    for t, hv in zip(objs[k], store.views(k)):
                        t.data = hv.clone()
            store.close()
            raise
