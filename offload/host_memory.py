"""Host memory registration: one owner for ``cudaHostRegister`` ranges.

``Registration`` owns the ranges it registered and unregisters them (on
``release`` or when its owner is collected), after in-flight copies finished.
The pure planners decide which page ranges of mapped checkpoint files a
budget allows and whether a block may be copied straight from them. Every
source registers through here: the pinned host store (anonymous arena), the
DLO shards and the mmap source (read-only file mappings).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .layout import align_up

REGISTER_CHUNK = 1 << 30  # at most this many bytes per registration (a copy may not span two)
HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly


def _cuda_register(ptr: int, size: int, flags: int = 0) -> str | None:
    """Register a host range; return None on success or the reason it failed."""
    try:
        rt = torch.cuda.cudart()
        code = rt.cudaHostRegister(ptr, size, flags)
    except Exception as e:  # binding missing in this torch build
        return f"cudaHostRegister unavailable ({e})"
    code = int(code)  # torch's binding returns the enum with the error already cleared
    if code != 0:
        return f"cudaHostRegister returned CUDA error {code}"
    return None


def _cuda_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # pragma: no cover - best effort at teardown
        pass


class _Registration:
    """Owns registered ranges; unregisters them when the store goes away."""

    def __init__(self):
        self.ptrs: list[int] = []
        self.bytes = 0

    def release(self):
        if self.ptrs and torch.cuda.is_initialized():
            # a prefetch may still read these pages (the store dropped without
            # disable()): let in-flight copies finish before unpinning
            torch.cuda.synchronize()
        for p in self.ptrs:
            _cuda_unregister(p)
        self.ptrs.clear()
        self.bytes = 0


class BlockRegistration:
    """The cudaHostRegister ranges of one coded block's host bytes (chunks from its start; a copy
    may not span two, see host_store.copy_from_image). ``release`` does not wait for copies:
    its caller makes sure none reads the bytes (:func:`release_all` waits, at teardown)."""

    def __init__(self):
        self.ptrs: list[int] = []
        self.bytes = 0

    def register(self, base: int, size: int, flags=(0,)) -> str | None:
        done = 0
        while done < size:
            n = min(REGISTER_CHUNK, size - done)
            for f in flags:  # read-only mappings need cudaHostRegisterReadOnly; keep the first that works
                err = _cuda_register(base + done, n, f)
                if err is None:
                    break
            if err is not None:
                self.release()
                return err
            self.ptrs.append(base + done)
            self.bytes += n
            done += n
        return None

    def release(self) -> None:
        for p in self.ptrs:
            _cuda_unregister(p)
        self.ptrs.clear()
        self.bytes = 0


def release_all(regs: list[BlockRegistration]) -> None:
    if any(r.ptrs for r in regs) and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # teardown only: copies may still read the pages
    for r in regs:
        r.release()


# -- registration planning (pure) ----------------------------------------------


def _merge_intervals(iv: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for f, s, e in sorted(iv):
        if out and out[-1][0] == f and s <= out[-1][2]:
            out[-1] = (f, out[-1][1], max(out[-1][2], e))
        else:
            out.append((f, s, e))
    return out


def _pages(ranges: Iterable[tuple[int, int, int]], bases: list[int], page: int) -> list[tuple[int, int, int]]:
    """Absolute, page-aligned (file, start, end) address ranges of file byte ranges."""
    return _merge_intervals(
        (f, (bases[f] + s) // page * page, align_up(bases[f] + e, page)) for f, s, e in ranges if e > s
    )


def _size(iv: list[tuple[int, int, int]]) -> int:
    return sum(e - s for _, s, e in iv)


def plan_registration(
    block_pages: list[list[tuple[int, int, int]]], budget: int | None, *, chunk: int = REGISTER_CHUNK
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Which blocks get registered, and the registration chunks.

    block_pages[i]: page-aligned (file, start address, end address) ranges
    block i reads. Blocks are taken in order while the union of their pages
    fits ``budget`` bytes (None: no cap); a block that does not fit is
    skipped (it stages). Returns (accepted block indices, chunks as
    (file, start address, size)), chunks at most ``chunk`` bytes, disjoint,
    so no page is registered twice even where two blocks share one.
    """
    accepted: list[int] = []
    union: list[tuple[int, int, int]] = []
    for i, pages in enumerate(block_pages):
        trial = _merge_intervals(union + list(pages))
        if budget is not None and _size(trial) > budget:
            continue
        union = trial
        accepted.append(i)
    chunks = [(f, s + o, min(chunk, e - s - o)) for f, s, e in union for o in range(0, e - s, chunk)]
    return accepted, chunks


def _covered(pages: list[tuple[int, int, int]], merged: list[tuple[int, int, int]]) -> bool:
    return all(any(mf == f and ms <= s and e <= me for mf, ms, me in merged) for f, s, e in pages)


def direct_after_registration(
    block_pages: list[list[tuple[int, int, int]]], accepted: list[int], registered: list[tuple[int, int, int]]
) -> list[bool]:
    """Which blocks copy directly: accepted by :func:`plan_registration` and every
    page range they read lies inside the chunks actually registered
    (``registered``: (file, start address, size), e.g. cut short by a failed
    registration). A block with any page outside stages."""
    merged = _merge_intervals((f, s, s + n) for f, s, n in registered)
    ok = set(accepted)
    return [i in ok and _covered(pages, merged) for i, pages in enumerate(block_pages)]


