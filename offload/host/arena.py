"""HostStore: one host arena holding every streamed block as a contiguous image.

Each block image starts on a page boundary; each tensor inside it on a
512-byte boundary (see :mod:`layout`). The arena is an anonymous mapping
(transparent huge pages requested) filled block by block, and pinned by
registering each block's range with ``cudaHostRegister`` (chunks of at most
``REGISTER_CHUNK`` bytes), which costs about a tenth of allocating the same
bytes pinned (DESIGN.md section 8). A pinned-memory budget is honoured; what
lies beyond it stays pageable, with one warning. Nothing here allocates after
construction; an arena the OS refuses is a ``HostMemoryError`` naming its size
(:func:`~.registration.map_anonymous`).
"""
from __future__ import annotations

import mmap
import warnings
import weakref

import torch

from weightstream.offload.host.registration import REGISTER_CHUNK, _Registration, map_anonymous
from weightstream.offload.layout import BlockLayout, align_up
from weightstream.offload.progress import format_bytes

PAGE = mmap.PAGESIZE  # registrations and block images start on page boundaries


def copy_from_image(dst: torch.Tensor, image: torch.Tensor, offset: int = 0) -> None:
    """``dst[:] = image[offset : offset + dst.numel()]`` (uint8), non-blocking.

    Split at the image's ``REGISTER_CHUNK`` boundaries: an image is registered
    in chunks of that size from its start, and a copy whose source spans two
    registrations fails (CUDA "invalid argument", seen on the H200). Images of
    at most one chunk are one copy.
    """
    n = dst.numel()
    pos = 0
    while pos < n:
        src = offset + pos
        step = min(n - pos, REGISTER_CHUNK - src % REGISTER_CHUNK)
        dst[pos : pos + step].copy_(image[src : src + step], non_blocking=True)
        pos += step


def spread_pins(sizes: list[int], budget: int | None) -> frozenset[int]:
    """Blocks to pin under ``budget`` bytes (``sizes``: page-aligned, in streaming order).

    The pinned bytes are spread over the order (error diffusion: block i is pinned when
    that keeps the pinned bytes through i within half a block of the budget's share of
    the bytes through i, and within the budget), then leftover budget pins more in order.
    Pinning the first blocks only would leave the second part of every step to bounce
    staging alone (host memcpy, then H2D); spread, each staged block's memcpy runs while
    a pinned block's DMA holds the link (flux-12b-1024 at half the model, 3a79e14: 561 ms
    with the first half pinned vs 427 ms all pinned)."""
    if budget is None or budget >= sum(sizes):
        return frozenset(range(len(sizes)))
    share = budget / max(1, sum(sizes))
    pinned, done, chosen = 0, 0, set()
    for i, n in enumerate(sizes):
        done += n
        if pinned + n <= budget and pinned + n / 2 <= share * done:
            chosen.add(i)
            pinned += n
    for i, n in enumerate(sizes):
        if i not in chosen and pinned + n <= budget:
            chosen.add(i)
            pinned += n
    return frozenset(chosen)


class HostStore:
    """Pinned (or pageable) host arena of block images.

    ``pin``: register block ranges with CUDA (needs CUDA); ``budget_bytes``:
    at most this many bytes pinned, spread over the block order
    (:func:`spread_pins`), the rest pageable with one warning.
    """

    def __init__(self, layouts: list[BlockLayout], *, pin: bool, budget_bytes: int | None = None):
        self.layouts = list(layouts)
        self.offsets = []
        off = 0
        for lay in self.layouts:
            self.offsets.append(off)
            off = align_up(off + lay.nbytes, PAGE)
        self.nbytes = max(off, PAGE)
        self._map = map_anonymous(self.nbytes, f"the host store of {len(self.layouts)} blocks", huge=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about writable buffers
            self.arena = torch.frombuffer(self._map, dtype=torch.uint8)
        self.want_pin = bool(pin) and torch.cuda.is_available()
        self.budget = budget_bytes
        self.pin_plan = spread_pins([align_up(lay.nbytes, PAGE) for lay in self.layouts], budget_bytes)
        self.pin_failure: str | None = None
        self._register_failed = False  # a registration error: nothing more is pinned
        self._reg = _Registration()
        self._finalizer = weakref.finalize(self, self._reg.release)
        self._pinned_blocks: set[int] = set()

    # -- access --------------------------------------------------------------
    def image(self, i: int) -> torch.Tensor:
        off = self.offsets[i]
        return self.arena[off : off + self.layouts[i].nbytes]

    def views(self, i: int) -> list[torch.Tensor]:
        img = self.image(i)
        return [spec.view_of(img) for spec in self.layouts[i].tensors]

    @property
    def pinned_bytes(self) -> int:
        return self._reg.bytes

    @property
    def pinned(self) -> bool:
        """True when every block image is pinned."""
        return len(self._pinned_blocks) == len(self.layouts)

    def is_pinned(self, i: int) -> bool:
        return i in self._pinned_blocks

    # -- filling -------------------------------------------------------------
    def pack(self, i: int, tensors: list[torch.Tensor]) -> None:
        """Copy a block's tensors (in layout order) into its image."""
        specs = self.layouts[i].tensors
        if len(tensors) != len(specs):
            raise ValueError(f"block {self.layouts[i].name!r}: {len(tensors)} tensors given, layout has {len(specs)}")
        img = self.image(i)
        with torch.no_grad():
            for spec, t in zip(specs, tensors):
                if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                    raise ValueError(
                        f"block {self.layouts[i].name!r} tensor {spec.name!r}: got {t.dtype} "
                        f"{tuple(t.shape)}, layout says {spec.dtype} {spec.shape}"
                    )
                spec.view_of(img).copy_(t.detach())

    def pin(self, i: int) -> None:
        """Register block ``i``'s image (chunked) unless pinning is off, failed, or over budget."""
        if not self.want_pin or self._register_failed or i in self._pinned_blocks:
            return
        off, size = self.offsets[i], align_up(self.layouts[i].nbytes, PAGE)
        if i not in self.pin_plan or (self.budget is not None and self._reg.bytes + size > self.budget):
            if self.pin_failure is not None:
                return  # warned once
            left = [j for j in range(len(self.layouts)) if j not in self.pin_plan]
            self.pin_failure = (
                f"pinned-memory budget of {format_bytes(self.budget)} reached; {len(left)} of "
                f"{len(self.layouts)} blocks ({format_bytes(sum(self.layouts[j].nbytes for j in left))}, "
                f"from {self.layouts[i].name!r}, spread between pinned ones) stay in pageable memory "
                "(slower H2D, same results)"
            )
            warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=3)
            return
        before = self._reg.bytes
        err = self._reg.register(self.arena.data_ptr() + off, size)
        if err is not None:
            self._register_failed = True
            self.pin_failure = (f"{err}, at offset {self._reg.bytes - before} of block {self.layouts[i].name!r} "
                                f"({format_bytes(size)}); host memory stays pageable")
            warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=3)
            return
        self._pinned_blocks.add(i)

    def close(self) -> None:
        """Unregister pinned ranges. Callers make sure no copy still reads them."""
        self._finalizer()
        self._pinned_blocks.clear()

    def __repr__(self) -> str:
        return (
            f"HostStore({len(self.layouts)} blocks, {format_bytes(self.nbytes)}, "
            f"pinned {format_bytes(self.pinned_bytes)})"
        )
