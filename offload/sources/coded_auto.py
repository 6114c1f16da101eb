"""weight_codec="auto" on the coded source: raw blocks coded in place, at once or in the background.

:class:`AutoCoding` is a mixin of :class:`~.coded.CodedSource` (the planner's side of it: sample a
block, code a set of raw blocks, store a background job's blocks at a step start, give the raw
pages back). The raw blocks' loads live with the other load paths in :mod:`.coded`; the policy
in :mod:`weightstream.offload.codec_plan`, the hooks in :mod:`weightstream.offload.auto_codec`.
"""
from __future__ import annotations

import contextlib
import mmap
import sys
import warnings

import torch

from ...kernels.codec import DecodeTable
from ..host_store import PAGE
from ..layout import align_up
from ..progress import Progress
from .codec_names import CodedCaptureStaleError, codec_levels
from .coded_background import STORE_PER_STEP, BackgroundCoding
from .coded_encode import encode_tensors_into, encoded_in_order

__all__ = ["AutoCoding"]


class AutoCoding:
    """Raw blocks of a :class:`~.coded.CodedSource` (``self.raw[k]``) becoming coded."""

    def sample(self, k: int, codec: str) -> tuple[int, torch.Tensor, DecodeTable]:
        """Raw block ``k`` encoded with ``codec`` aside (nothing stored): its coded bytes, the
        coded tensor (one buffer) and its table; the codec planner's sample of a layout."""
        if not self.raw[k]:
            raise ValueError(f"block {self.layouts[k].name!r} is coded already; sample() reads raw blocks")
        (blob,), table = self._encode_now(k, codec_levels(codec))
        return blob.numel(), blob, table

    def code_blocks(self, ks, codec: str, *, progress: bool = False, background: bool = False) -> None:
        """weight_codec="auto": code the raw blocks ``ks`` with ``codec`` where they lie (each
        region then holds its coded bytes, re-pinned at their size, its table on the device, the
        raw tail's pages given back). Between steps only: waits for the device first. Slots
        already loaded are re-copied at the next step start (``host_version`` moves). Host copies
        handed out (``state_dict()``) stay what they are: edits made in them are kept.
        ``background``: encode on a thread and return at once; each step start stores the blocks
        finished by then (:meth:`check`), the others keep streaming raw (eager only: graphs
        captured over raw loads would go stale)."""
        ks = sorted(set(ks))
        if not ks:
            return
        bad = [k for k in ks if not 0 <= k < len(self.layouts) or not self.raw[k]]
        if bad:
            raise ValueError(f"code_blocks: blocks {bad} are not raw blocks of this source; allowed: indices of "
                             f"raw blocks ({[k for k, r in enumerate(self.raw) if r]})")
        levels = codec_levels(codec)
        if self.levels is not None and levels != self.levels:
            raise ValueError(f"code_blocks: codec={codec!r}, but this source codes with {self.codec!r}; one codec "
                             "per source")
        if self._captured:
            raise CodedCaptureStaleError("code_blocks: CUDA graphs were captured over the raw blocks' loads; "
                                         "disable() the model and wrap it again")
        if self._coding is not None:
            raise ValueError("code_blocks: a background coding job is still running; let the steps finish it")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # in-flight copies may read the regions
        if self._decoded:
            self._sweep()  # edits of handed-out host copies reach the regions before they are coded
        if self._dirty:
            self._fold()
        self.levels, self.codec = levels, codec
        self.name = f"coded-auto({codec}){self.name_suffix}"
        images = [[s.view_of(self.region(k)) for s in self.layouts[k].tensors] for k in ks]
        if background:
            self._coding_progress = progress
            self._coding = BackgroundCoding(ks, [self.layouts[k] for k in ks], images,
                                            [self._raw_version[k] for k in ks], levels=levels, codec=codec)
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

    @property
    def coding_active(self) -> bool:
        """A background coding job (``code_blocks(background=True)``) has blocks left to store."""
        return self._coding is not None

    def _apply_coded(self, k: int, blobs, table: DecodeTable) -> None:
        """Raw block ``k`` becomes coded: ``blobs`` (encoded apart from its region) stored there."""
        self._store(k, blobs, table, grow=True)
        self.raw[k] = False
        self._pin(k)
        self._release_tail(k)
        if self._dev_tables:
            self._dev_tables[k] = table.upload(self.device) if table.num_tiles else None

    def _coded_since(self) -> None:
        """After blocks became coded: coded buffers large enough; the slots loaded raw re-copied."""
        if self._slots and self._buffer_bytes() > (self._buffers[0].numel() if self._buffers else 0):
            self._alloc_buffers()
        self._host_edits += 1

    def _take_coded(self) -> None:
        """Step start: store up to ``STORE_PER_STEP`` blocks the background job finished (after
        the copy stream's raw copies, which read the regions); a block written since the job
        started is encoded again here. A failed job leaves its blocks raw, with a warning."""
        job = self._coding
        finished = not job.running  # before take(): a finished thread appends nothing more
        try:
            done = job.take(STORE_PER_STEP)
        except RuntimeError as e:
            self._coding = None
            warnings.warn(f"{e}: {e.__cause__!r}", stacklevel=3)
            return
        if done:
            if self._copy_stream is not None:
                self._copy_stream.synchronize()
            for k, version, blobs, table in done:
                if version != self._raw_version[k]:  # written after the job read it
                    blobs, table = self._encode_now(k)
                self._apply_coded(k, blobs, table)
            self._coded_since()
        if finished and not any(self.raw[k] for k in job.ks):
            self._coding = None
            if self._coding_progress:
                print(f"weightstream auto codec: coded {len(job.ks)} blocks with {job.codec} in the background "
                      f"({job.elapsed_s:.1f} s)", file=sys.stderr)

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
