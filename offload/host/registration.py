"""Host memory registration: one owner for ``cudaHostRegister`` ranges.

``Registration`` owns the ranges it registered and unregisters them (on
``release`` or when its owner is collected), after in-flight copies finished.
The pure planners decide which page ranges of mapped checkpoint files a
budget allows and whether a block may be copied straight from them. Every
source registers through here: the pinned host store (anonymous arena), the
DLO shards and the mmap source (read-only file mappings).

Host buffers are allocated through :func:`map_anonymous` / :func:`empty_host`, so that a
failed allocation is a :class:`~..misuse.HostMemoryError` naming the bytes asked for, what
the process already held, and how to need less, instead of a bare ENOMEM.
"""
from __future__ import annotations

import mmap
from collections.abc import Iterable

import torch

from weightstream.offload.layout import align_up
from weightstream.offload.misuse import HostMemoryError
from weightstream.offload.progress import format_bytes

REGISTER_CHUNK = 1 << 30  # at most this many bytes per registration (a copy may not span two)
HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly
# what a HostMemoryError tells the caller to do
HOST_MEMORY_ADVICE = (
    "free host memory, or make weightstream need less of it: keep more blocks on the device "
    "(layer_options.dit.resident_layers), store them coded (weight_codec='exp-k'), stream from the "
    "checkpoint file (offload_from_safetensors maps it instead of copying it), lower "
    "pinned_memory_budget_gb (pinned buffers), or use a smaller model"
)


def _cuda_register(ptr: int, size: int, flags: int = 0) -> str | None:
    """Register a host range; return None on success or the reason it failed (with the size
    and CUDA's name of the error)."""
    try:
        rt = torch.cuda.cudart()
        code = rt.cudaHostRegister(ptr, size, flags)
    except Exception as e:  # binding missing in this torch build
        return f"cudaHostRegister unavailable ({e})"
    if int(code) != 0:
        # the runtime also keeps the code as its last error, which torch's next kernel-launch
        # check would raise as that kernel's failure: take it out (the caller handles the code)
        _clear_last_error()
        return (f"cudaHostRegister of {format_bytes(size)} returned CUDA error {int(code)} "
                f"({_cuda_error_name(rt, code)})")
    return None


def _loaded_cudart() -> str | None:
    """The path of the CUDA runtime library this process loaded (torch's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return None
    return min(paths) if paths else None


def _clear_last_error() -> None:
    """``cudaGetLastError()`` in the runtime torch uses (torch does not bind it); nothing where
    that library cannot be found (a runtime linked statically keeps no separate last error to
    clear here)."""
    import ctypes  # noqa: PLC0415

    path = _loaded_cudart()
    if path is None:
        return
    try:
        ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):  # pragma: no cover - a library without the symbol
        pass


def _cuda_error_name(rt, code) -> str:
    try:
        return str(rt.cudaGetErrorString(rt.cudaError(int(code))))
    except Exception as e:  # pragma: no cover - a binding without the name lookup
        return f"no description: {type(e).__name__}"


def host_memory_state() -> str:
    """What this process and the machine hold now, for an allocation failure's message
    (Linux ``/proc``; elsewhere it says it does not know). Read only on failure paths."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * mmap.PAGESIZE
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line)
        avail = int(info["MemAvailable"].split()[0]) * 1024  # /proc/meminfo's "kB" are KiB
    except (OSError, KeyError, ValueError, IndexError):
        return "what this process already holds is unknown here (no /proc)"
    return (f"this process already holds {format_bytes(rss)} resident; the machine has "
            f"{format_bytes(avail)} available")


def _host_memory_error(nbytes: int, what: str, e: BaseException) -> HostMemoryError:
    return HostMemoryError(
        f"could not allocate {what}: {format_bytes(nbytes)} ({nbytes} bytes) of host memory "
        f"({type(e).__name__}: {e}); {host_memory_state()}. To fix: {HOST_MEMORY_ADVICE}")


def map_anonymous(nbytes: int, what: str, *, huge: bool = False) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (a host arena); HostMemoryError (naming
    ``what``, e.g. "the host store of 24 blocks") when the OS refuses it. ``huge``: advise
    transparent huge pages (MADV_HUGEPAGE, where the kernel has them): the first touch and the
    registration of the arena's pages cost less per byte."""
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError, MemoryError) as e:  # ENOMEM; a size over ssize_t
        raise _host_memory_error(nbytes, what, e) from e
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # pragma: no cover - kernel without THP
            pass
    return m


def empty_host(nbytes: int, what: str, *, pin: bool = False) -> torch.Tensor:
    """``torch.empty(nbytes, dtype=uint8, pin_memory=pin)``; HostMemoryError (naming ``what``)
    when torch cannot allocate it (its CPU and pinned allocators raise RuntimeError)."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    except (RuntimeError, MemoryError) as e:
        if pin and not torch.cuda.is_available():
            raise  # no pinned allocator at all (torch says so): not a shortage of memory
        raise _host_memory_error(nbytes, f"{what} ({'pinned' if pin else 'pageable'})", e) from e


def _cuda_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # pragma: no cover - best effort at teardown
        pass


class _Registration:
    """Owns registered host ranges (the one caller of ``cudaHostRegister``); unregisters them
    when the owner goes away. Ranges are registered in chunks of at most ``REGISTER_CHUNK``
    bytes from their start (a copy may not span two, see ``arena.copy_from_image``)."""

    def __init__(self):
        self.ptrs: list[int] = []
        self.bytes = 0
        self.flag: int | None = None  # the flag the last range registered with

    def register(self, base: int, size: int, flags=(0,)) -> str | None:
        """Register ``[base, base + size)``; None, or the reason a chunk failed (the chunks
        before it stay registered: the caller releases or keeps them). ``flags`` are tried
        in order per chunk (read-only mappings need cudaHostRegisterReadOnly), the first that
        works is kept for the rest."""
        done, flags = 0, list(flags)
        while done < size:
            n = min(REGISTER_CHUNK, size - done)
            err = None
            for f in flags:
                err = _cuda_register(base + done, n, f)
                if err is None:
                    flags, self.flag = [f], f
                    break
            if err is not None:
                return err
            self.ptrs.append(base + done)
            self.bytes += n
            done += n
        return None

    def release(self, *, wait: bool = True) -> None:
        """Unregister every range; with ``wait`` first let in-flight copies finish (a prefetch
        may still read these pages when the owner is dropped without disable())."""
        if wait and self.ptrs and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for p in self.ptrs:
            _cuda_unregister(p)
        self.ptrs.clear()
        self.bytes = 0


class BlockRegistration(_Registration):
    """The ranges of one coded block's host bytes: all or nothing, and ``release`` does not wait
    for copies (its caller makes sure none reads the bytes; :func:`release_all` waits, at teardown)."""

    def register(self, base: int, size: int, flags=(0,)) -> str | None:
        err = super().register(base, size, flags)
        if err is not None:
            self.release()
        return err

    def release(self, *, wait: bool = False) -> None:
        super().release(wait=wait)


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


