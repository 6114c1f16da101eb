"""weight_codec="auto" on the block image store: raw blocks coded, at once or in the background.

:class:`AutoCoding` is a mixin of :class:`~.images.BlockImages` (the planner's side of it: sample a
block, code a set of raw blocks, swap in a background job's blocks at a step start, give the raw
pages back). On a store that codes on the GPU (``encode_on="device"``, a CUDA device's default),
the blocks are coded at once, background or not: each goes up from its pinned region, is coded by
the Triton encoder and comes back into its region (:meth:`AutoCoding._code_on_device`,
:mod:`.encode_device`), at about the link's speed, so the step after the plan already streams
them coded. Else, at once (CUDA graphs come next), each block is coded in its region; in the
background, the job's thread writes each coded block into a buffer of its own and pins it
(:meth:`AutoCoding._prepare_coded`); a step start then only points the block at that buffer
(:meth:`AutoCoding._swap_in`), and a thread of its own unpins the raw region and gives its pages
back once the copies issued before the swap are done (:meth:`AutoCoding._retire`). What that
means on the device (tables, buffers, copies in flight) goes to the store's ``side``; the raw
blocks' loads live with the transports (:mod:`weightstream.offload.sources.pinned`); the policy in
:mod:`weightstream.offload.plan.codec`, the hooks in :mod:`weightstream.offload.plan.auto`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import mmap
import sys
import threading
import warnings

import torch

from weightstream.kernels.codec_format import DecodeTable
from weightstream.offload.host.registration import BlockRegistration
from weightstream.offload.host.arena import PAGE
from weightstream.offload.layout import TENSOR_ALIGN, BlockLayout, TensorSpec, align_up
from weightstream.offload.progress import Progress
from weightstream.offload.codecs import CodedCaptureStaleError, codec_levels
from weightstream.offload.host.background import MAX_WAITING, BackgroundCoding
from weightstream.offload.host.encode import _ALIGN, _capacity, _slack, _write, encode_tensors_into, encoded_in_order
from weightstream.offload.host.encode_device import code_on_device, fill_from_tensors, pieces

__all__ = ["AutoCoding", "SAMPLE_BYTES", "checked_blocks", "sample_coded"]

SAMPLE_BYTES = 64 << 20  # a sampled block (the codec planner's) is about this large at most
SAMPLE_RUN = 1 << 16  # elements per sampled run (a whole number of codec tiles)
WHOLE_ON_DEVICE = 2 << 30  # a raw block coded on the GPU goes up whole (four staging buffers of about its size)


def _sampled(lay: BlockLayout, region: torch.Tensor, every: int):
    """Every ``every``-th run of :data:`SAMPLE_RUN` elements of each tensor of block image
    ``region`` (a tensor of fewer than 2 x ``every`` runs whole, flat): the sample's layout, its
    tensors and, per tensor's offset in the sample, how many elements each sampled one stands for."""
    specs, tensors, scale, at = [], [], {}, 0
    for spec in lay.tensors:
        if not spec.nbytes:
            continue
        flat = spec.view_of(region).reshape(-1)
        runs = flat.numel() // SAMPLE_RUN
        part = flat[: runs * SAMPLE_RUN].view(runs, SAMPLE_RUN)[::every].reshape(-1) if runs >= 2 * every else flat
        nbytes = part.numel() * part.element_size()
        specs.append(TensorSpec(spec.name, spec.kind, spec.dtype, (part.numel(),), (1,), at, nbytes))
        tensors.append(part)
        scale[at] = flat.numel() / part.numel()
        at = align_up(at + nbytes, TENSOR_ALIGN)
    return BlockLayout(lay.index, f"{lay.name}[sample]", tuple(specs), max(at, TENSOR_ALIGN)), tensors, scale


def sample_coded(lay: BlockLayout, region: torch.Tensor, levels: int,
                 max_bytes: int | None = SAMPLE_BYTES) -> tuple[int, torch.Tensor, DecodeTable, int]:
    """Block image ``region`` (layout ``lay``) encoded aside, whole or, past ``max_bytes``, a sample
    of it (:func:`_sampled`): the whole block's coded bytes (a sample's scaled per tensor), the coded
    bytes encoded, their table and the bytes they decode to (:meth:`AutoCoding.sample`)."""
    if max_bytes is None or lay.nbytes <= max_bytes:
        sub, tensors, scale = lay, [s.view_of(region) for s in lay.tensors], None
    else:
        sub, tensors, scale = _sampled(lay, region, -(-lay.nbytes // max_bytes))
    scratch = torch.empty(_capacity(sub), dtype=torch.uint8)
    n, table = encode_tensors_into(scratch, sub, tensors, levels=levels)
    if scale is None:
        return n, scratch[:n], table, lay.nbytes
    ends = [seg.src_offset for seg in table.segments[1:]] + [n]
    coded = sum(round((end - seg.src_offset) * scale[seg.dst_offset])
                for seg, end in zip(table.segments, ends))
    return coded, scratch[:n], table, sub.nbytes


def checked_blocks(src, ks, codec: str, loads: str) -> tuple[list[int], int]:
    """``code_blocks``' checks, for a source with ``layouts``, ``raw``, ``levels``, ``codec`` and
    ``_captured``: ``ks`` sorted (each a raw block's index) and ``codec``'s levels (the source's one
    codec); ``loads`` names what captured graphs replay over the raw blocks."""
    ks = sorted(set(ks))
    bad = [k for k in ks if not isinstance(k, int) or not 0 <= k < len(src.layouts) or not src.raw[k]]
    if bad:
        raise ValueError(f"code_blocks: blocks {bad} are not raw blocks of this source; allowed: indices of "
                         f"raw blocks ({[k for k, r in enumerate(src.raw) if r]})")
    levels = codec_levels(codec)
    if src.levels is not None and levels != src.levels:
        raise ValueError(f"code_blocks: codec={codec!r}, but this source codes with {src.codec!r}; one codec "
                         "per source")
    if src._captured:
        raise CodedCaptureStaleError(f"code_blocks: CUDA graphs were captured over the raw blocks' {loads}; "
                                     "disable() the model and wrap it again")
    return ks, levels


@dataclasses.dataclass
class _Prepared:
    """A block coded in the background, in a buffer of its own (``data``, page-aligned, pinned
    by ``reg`` unless pinning was off or failed: ``pin_error``), ready to be swapped in."""

    data: torch.Tensor
    coded: int
    copy_bytes: int
    table: DecodeTable
    reg: BlockRegistration
    pin_error: str | None = None


def _anonymous(nbytes: int) -> torch.Tensor:
    """``nbytes`` (whole pages) of fresh anonymous memory as a uint8 tensor (it keeps the map)."""
    m = mmap.mmap(-1, max(align_up(nbytes, PAGE), PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about writable buffers
        return torch.frombuffer(m, dtype=torch.uint8)


class AutoCoding:
    """Raw blocks of a :class:`~.images.BlockImages` (``self.raw[k]``) becoming coded."""

    @property
    def _captured(self) -> bool:  # read by checked_blocks
        return self.side.captured

    def sample(self, k: int, codec: str, max_bytes: int | None = SAMPLE_BYTES) -> tuple[int, torch.Tensor, DecodeTable, int]:
        """Raw block ``k`` encoded with ``codec`` aside (nothing stored), or of a larger block a
        sample of about ``max_bytes`` (every m-th run of :data:`SAMPLE_RUN` elements of each
        tensor; tensors of fewer runs whole): the codec planner's sample of a layout. Returns the
        whole block's coded bytes (the sample's, each tensor's scaled by how much of it was
        taken), the coded sample (one buffer), its table and the bytes it decodes to."""
        if not self.raw[k]:
            raise ValueError(f"block {self.layouts[k].name!r} is coded already; sample() reads raw blocks")
        lay, levels = self.layouts[k], codec_levels(codec)
        if max_bytes is None or lay.nbytes <= max_bytes:
            (blob,), table = self._encode_now(k, levels)
            return blob.numel(), blob, table, lay.nbytes
        return sample_coded(lay, self.region(k), levels, max_bytes)

    def code_blocks(self, ks, codec: str, *, progress: bool = False, background: bool = False) -> None:
        """weight_codec="auto": code the raw blocks ``ks`` with ``codec`` where they lie (each
        region then holds its coded bytes, re-pinned at their size, its table on the device, the
        raw tail's pages given back). Between steps only: waits for the device first. Slots
        already loaded are re-copied at the next step start (``host_version`` moves). Host copies
        handed out (``state_dict()``) stay what they are: edits made in them are kept.
        ``background``: encode on a thread and return at once; each step start swaps in the
        blocks finished by then (:meth:`check`), the others keep streaming raw; CUDA graphs wait
        for the job (:meth:`capture_deferred`): none may be captured over raw loads before."""
        ks, levels = checked_blocks(self, ks, codec, "loads")
        if not ks:
            return
        if self._coding is not None:
            raise ValueError("code_blocks: a background coding job is still running; let the steps finish it")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # in-flight copies may read the regions
        if self._decoded:
            self._sweep()  # edits of handed-out host copies reach the regions before they are coded
        if self._dirty:
            self._fold()
        self.levels, self.codec = levels, codec
        if self.encode_on == "device":  # on the GPU: at once, as fast as the blocks go up and down
            on_gpu = [k for k in ks if self.layouts[k].nbytes <= WHOLE_ON_DEVICE]
            self._code_on_device(on_gpu, progress)
            ks = [k for k in ks if k not in set(on_gpu)]  # too large for the staging pair: on the CPU, below
            if not ks:
                return
        images = [[s.view_of(self.region(k)) for s in self.layouts[k].tensors] for k in ks]
        if background:
            self._coding_progress = progress
            pin = self.want_pin and self.pin_failure is None
            self._coding = BackgroundCoding(ks, [self.layouts[k] for k in ks], images,
                                            [self._raw_version[k] for k in ks], levels=levels, codec=codec,
                                            prepare=lambda k, blobs, table: self._prepare_coded(k, blobs, table, pin))
            return
        bar = Progress(f"coding {len(ks)} blocks in host memory", sum(self.layouts[k].nbytes for k in ks), progress)
        try:
            with contextlib.closing(encoded_in_order([self.layouts[k] for k in ks], images, levels=levels)) as coded:
                for k, (blobs, table) in zip(ks, coded):
                    self._apply_coded(k, blobs, table)
                    bar.update(self.layouts[k].nbytes)
        finally:
            bar.close()
            self._coded_since()

    def _code_on_device(self, ks: list[int], progress: bool, *, keep: bool = False) -> None:
        """Raw blocks ``ks`` coded on the GPU where they lie (:mod:`.encode_device`, a block one
        piece: its coded bytes land in its region after all its raw bytes went up), each then
        stored as :meth:`_apply_coded` stores a block coded apart; ``keep``: its raw registration
        and pages kept (at setup: nothing reads the region yet, and re-registering costs more)."""
        if not ks:
            return
        bar = Progress(f"coding {len(ks)} blocks on the GPU", sum(self.layouts[k].nbytes for k in ks), progress)

        def dest(k: int, at: int, n: int):
            pinned = self._regs[k].bytes  # registered from the region's start
            memory = "pinned" if at + n <= pinned else ("mixed" if pinned else "pageable")
            return self.region(k)[at : at + n], memory

        def done(k: int, at: int, table: DecodeTable) -> None:
            self._commit(k, at, table, grow=True)
            self.raw[k] = False
            if not keep or self.copy_bytes[k] > self._regs[k].bytes:  # a copy reads one registration only
                self._pin(k)
            if not keep:
                self._release_tail(k)
            self.side.recoded(k)
            bar.update(self.layouts[k].nbytes)

        try:
            # two buffers of each kind: whole blocks, coded during a step, beside the planned residency
            code_on_device(self.device, [pieces(k, self.layouts[k], whole=True) for k in ks], self.levels,
                           fill_from_tensors(lambda k, specs: [s.view_of(self.region(k)) for s in specs]), dest, done,
                           depth=2)
        finally:
            bar.close()
            self._coded_since()

    @property
    def coding_active(self) -> bool:
        """A background coding job (``code_blocks(background=True)``) has blocks left to store."""
        return self._coding is not None

    def capture_deferred(self) -> str | None:
        """While a background job runs, CUDA graphs wait (their loads would read the raw blocks)."""
        if self._coding is None:
            return None
        return f"{sum(self.raw[k] for k in self._coding.ks)} blocks are being coded in the background"

    def _apply_coded(self, k: int, blobs, table: DecodeTable) -> None:
        """Raw block ``k`` becomes coded: ``blobs`` (encoded apart from its region) stored there."""
        self._store(k, blobs, table, grow=True)
        self.raw[k] = False
        self._pin(k)
        self._release_tail(k)
        self.side.recoded(k)

    def _coded_since(self) -> None:
        """After blocks became coded: coded buffers large enough; the slots loaded raw re-copied."""
        self.side.fit_buffers()
        self.edits += 1

    def _take_coded(self) -> None:
        """Step start: swap in the blocks the background job finished (:meth:`_swap_in`); a block
        written since the job started is encoded again here and stored in its region. A failed
        job leaves its blocks raw, with a warning."""
        job = self._coding
        finished = not job.running  # before take(): a finished thread appends nothing more
        try:
            done = job.take(MAX_WAITING)
        except RuntimeError as e:
            self._end_job()
            warnings.warn(f"{e}: {e.__cause__!r}", stacklevel=3)
            return
        if done:
            swapped = []
            try:
                for k, version, item in done:
                    if version == self._raw_version[k]:
                        swapped.append((k, self._swap_in(k, item)))
                        continue
                    item.reg.release()  # written after the job read it: never read by a copy
                    self.side.sync_copies()  # raw copies read the region rewritten now
                    self._apply_coded(k, *self._encode_now(k))
            finally:  # the blocks swapped in before an error give their raw regions back all the same
                if swapped:
                    self._retire(swapped)
                self._coded_since()
        if finished and not any(self.raw[k] for k in job.ks):
            self._end_job()
            if self._coding_progress:
                print(f"weightstream auto codec: coded {len(job.ks)} blocks with {job.codec} in the background "
                      f"({job.elapsed_s:.1f} s)", file=sys.stderr)

    def _prepare_coded(self, k: int, blobs, table: DecodeTable, pin: bool) -> _Prepared:
        """On the job's thread: block ``k``'s coded tensors written into a buffer of its own, as
        many bytes as a load copies (its slack too), pinned when ``pin``."""
        coded = sum(b.numel() for b in blobs)
        copy_bytes = min(self.capacity[k], align_up(coded + _slack(self.layouts[k]), _ALIGN))
        data = _anonymous(copy_bytes)
        _write(data, blobs)
        reg, err = BlockRegistration(), None
        if pin:
            err = reg.register(data.data_ptr(), data.numel())
        return _Prepared(data, coded, copy_bytes, table, reg, err)

    def _swap_in(self, k: int, item: _Prepared) -> BlockRegistration:
        """Block ``k`` reads its coded bytes from ``item`` from now on (loads issued before keep
        reading the raw region: retire it after them); returns the raw region's registration."""
        old = self._regs[k]
        self._backing[k] = item.data
        self.coded[k], self.tables[k], self.copy_bytes[k] = item.coded, item.table, item.copy_bytes
        self.raw[k] = False
        total = sum(r.bytes for r in self._regs) - old.bytes
        if item.pin_error is not None and self.pin_failure is None:
            self.pin_failure = f"{item.pin_error} for block {self.layouts[k].name!r}; its coded bytes stay pageable"
            warnings.warn(f"weightstream: {self.pin_failure}", stacklevel=4)
        elif self.budget is not None and total + item.reg.bytes > self.budget:
            item.reg.release()  # a block that was not pinned raw (budget) stays pageable coded
        self._regs[k] = item.reg
        self.side.recoded(k)
        return old

    def _retire(self, swapped) -> None:
        """The raw regions of the blocks swapped in: unpinned and their pages given back on a
        thread of their own, once the copies issued before now (which may read them) are done."""
        event = self.side.copies_event()
        ranges = [(k, old, self.offsets[k], self.capacity[k]) for k, old in swapped]
        job = _Retiring(event, ranges, self._map)
        for k, *_ in ranges:
            self._retiring[k] = job

    def _settle(self, k: int | None = None) -> None:
        """Wait until block ``k``'s raw region (every block's: ``k`` None) is retired: before its
        region is written again, and at teardown. A retirement that failed is named in a warning:
        the region then stays mapped (and maybe pinned), which costs memory, never a weight."""
        jobs = {self._retiring.pop(k, None)} if k is not None else set(self._retiring.values())
        if k is None:
            self._retiring.clear()
        for job in jobs - {None}:
            err = job.join()
            if err is not None:
                warnings.warn(f"weightstream: giving a raw block region back after coding failed ({err!r}); "
                              "its host memory stays in use, the weights are unchanged", stacklevel=3)

    def _end_job(self) -> None:
        """The background job is over (done, failed or stopped): what it prepared and nobody
        took is unpinned; the retirements it started are waited for."""
        for _, _, item in self._coding.stop():
            if hasattr(item, "reg"):
                item.reg.release()
        self._coding = None
        self._settle()

    def _encode_now(self, k: int, levels: int | None = None) -> tuple[list, DecodeTable]:
        """Raw block ``k`` encoded apart from its region (its tensors on worker threads): one blob."""
        lay = self.layouts[k]
        scratch = torch.empty(self.capacity[k], dtype=torch.uint8)
        n, table = encode_tensors_into(scratch, lay, [s.view_of(self.region(k)) for s in lay.tensors],
                                       levels=self.levels if levels is None else levels)
        return [scratch[:n]], table

    def _release_tail(self, k: int) -> None:
        """Give the pages of block ``k``'s region past its copied bytes back to the OS (the raw
        image written there before it was coded); they read as zeros if touched again."""
        if self._backing[k] is not None:
            return
        start = self.offsets[k] + align_up(self.copy_bytes[k], PAGE)
        end = self.offsets[k] + self.capacity[k]
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)  # Linux (as the arena)


class _Retiring:
    """A thread that waits for ``event`` (copies that may read the regions), then unpins each
    raw region (``reg``) and gives its pages back to the OS (``MADV_DONTNEED`` on ``arena``)."""

    def __init__(self, event, ranges, arena: mmap.mmap):
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(event, ranges, arena), daemon=True,
                                        name="weightstream-retire")
        self._thread.start()

    def _run(self, event, ranges, arena) -> None:
        try:
            if event is not None:
                event.synchronize()
            for _, reg, start, size in ranges:
                reg.release()
                arena.madvise(mmap.MADV_DONTNEED, start, size)  # Linux (as the arena)
        except BaseException as e:  # handed to the stepping thread by join()
            self.error = e

    def join(self) -> BaseException | None:
        """Wait for the thread; the error it met, once (None: the regions were given back)."""
        self._thread.join()
        err, self.error = self.error, None
        return err
