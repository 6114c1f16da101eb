"""The weight-source protocol: the one interface between the executor and a block's bytes.

The executor (:mod:`offload.executor`) owns the ring: the device slots, the copy
stream, one "loaded" and one "freed" event per slot, the schedule and the
bindings. A source is a transport: it moves a block's host bytes (from a store
in :mod:`offload.host`) into its slot, with its side buffers and side streams
(gathers, the decode stage).

Every source subclasses :class:`WeightSource` and says what differs between
sources in one frozen :class:`SourceCaps`; the executor, the planners and the
front ends call the members below and never probe a source for attributes.
The members with a body are the defaults a source overrides where it differs.

``load(k, slot, ...)`` is called on the executor's copy stream (the current
stream; ``None`` streams on the CPU). The copy stream has already waited for
``freed[slot]`` unless ``waits_for_free_of(k)`` (then ``after`` is that event
and the source orders its slot writes after it itself, e.g. the DLO source
copies its shard ahead and makes only the gather wait). It returns the stream
on which the slot is complete (the executor records ``loaded[slot]`` there), or
``None`` on the CPU.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ..host.recode import SAMPLE_BYTES
from ..layout import BlockLayout

# Every source's stats() carries these keys (perf/ and the dashboards read them; no guessing).
STATS_KEYS = (
    "source",  # the source's name
    "host_bytes",  # host bytes the source holds for the streamed blocks (images, shards, coded bytes)
    "pinned_bytes",  # of those, page-locked (or registered) bytes
    "pinned",  # every block copies from page-locked memory
    "pin_failure",  # why some blocks are not pinned (None: all are, or pinning is off)
    "h2d_bytes_per_step",  # bytes one step moves host -> device on this rank
    "slot_bytes",  # bytes of one device slot
)


@dataclasses.dataclass(frozen=True)
class SourceCaps:
    """What a transport can do, declared once (read by the executor, the planners and the
    front ends instead of probing the source)."""

    collective: bool = False  # loads are collectives: every rank issues the same loads in the same order
    sharded: bool = False  # this rank holds a 1/N share of each block (local_piece, gather_state_dict)
    read_only: bool = False  # host bytes cannot be written (check_write refuses every update)
    codes_blocks: bool = False  # code_blocks() can code raw blocks in place (weight_codec='auto')
    writes_at_use: bool = False  # the slot is written in before_use (a decode issued at use), not by load


@runtime_checkable
class WeightSource(Protocol):
    name: str
    layouts: list[BlockLayout]  # runtime layout of streamed block k (slot views come from it)
    slot_bytes: int  # bytes one device slot needs (a gathered image, a decoded image)
    caps: SourceCaps
    device: torch.device  # the device the slots live on
    # the executor's EventLog while it records (None otherwise) and its step_of(position):
    # sources with stages of their own (a gather, a decode) log them as lanes of it
    event_log: Any = None
    step_of: Any = None

    # -- the ring -----------------------------------------------------------------------
    def attach(self, slots: list[torch.Tensor], streams, device: torch.device) -> None:
        """Allocate per-slot side buffers and side streams (called once by the executor,
        with its copy stream current; ``streams`` is None on the CPU)."""

    def side_streams(self) -> list:
        """Streams besides the executor's copy stream that loads issue work on."""
        return []

    def load(self, k: int, slot: int, *, position: int, after, tag) -> Any:
        """Issue the writes of block ``k``'s bytes into ``slots[slot]``; returns the
        stream on which they complete (None: synchronous, CPU). ``tag``: the capture
        the load belongs to (None: eager)."""

    def before_use(self, k: int, slot: int, stream, tag=None) -> None:
        """Called by the executor just before block ``k`` computes from ``slots[slot]``, with
        ``stream`` (the compute stream) current and ordered after the load: a source that
        finishes a load there (a decode issued at use) does it now; others do nothing."""

    def waits_for_free_of(self, k: int) -> bool:
        """Whether ``load(k)`` orders its slot writes after ``after`` itself (False: the
        executor makes the copy stream wait for the slot's release first)."""
        return False

    def slot_bytes_of(self, ks) -> int:
        """Bytes of a slot that holds any of blocks ``ks`` (the blocks a ring streams, in ring
        order; called right before :meth:`attach`). Default: :attr:`slot_bytes` (every block)."""
        return self.slot_bytes

    def link_bytes(self, k: int) -> int:
        """Bytes one load of block ``k`` moves over the host link (the planners' transfer term)."""
        return self.layouts[k].nbytes

    def check(self) -> None:
        """Raise a named error when loads cannot be served (a changed checkpoint); called at
        every step start and before every graph replay."""

    def reload(self) -> None:
        """Before the pending slots are re-copied (a ring reset, an update)."""

    def host_version(self) -> int:
        """An int that moves when the host views are edited in place (one read per step)."""
        return 0

    def uncapturable(self) -> str | None:
        """Why a CUDA graph cannot hold this source's loads (None: it can)."""
        return None

    def capture_deferred(self) -> str | None:
        """Why a capture should wait: the loads are about to change (None: capture now)."""
        return None

    def check_replay(self) -> None:
        """Raise a named error when the captured CUDA graphs cannot be replayed any more (their
        copies are too small for blocks re-encoded since: CodedCaptureStaleError); before every
        replay. Eager steps are served (the loads copy the current sizes)."""

    def captures_dropped(self) -> None:
        """Every CUDA graph captured over this source's loads was dropped: forget what was kept for
        them (a decode stage's stale flag); the next capture starts afresh."""

    def remove(self) -> None:
        """Executor teardown: stop threads (close() releases host memory)."""

    # -- host side ----------------------------------------------------------------------
    def host_views(self) -> Mapping[int, torch.Tensor]:
        """id(streamed tensor object) -> host tensor with its current weights (state_dict)."""

    def check_write(self, k: int, index: int) -> None:
        """Refuse an update of tensor ``index`` of block ``k`` before anything is written."""

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        """Write tensor ``index`` of block ``k`` (update_weights; callers synchronised first)."""

    def image(self, k: int) -> torch.Tensor:
        """Block ``k``'s runtime image in a fresh device tensor (restore, state_dict of coded sources)."""

    # -- weight_codec="auto" (plan/coding.py reads these; sources with caps.codes_blocks) ----
    # the codec the coded blocks use (None: nothing coded yet, or a source that does not code)
    codec: str | None = None
    # a background coding job is running (code_blocks(background=True) not finished yet)
    coding_active: bool = False
    # where and how the decode stage decodes a coded block (:class:`~.decode.DecodeStage`):
    # "load" or "use", and on a side stream (True) or the stream it is issued on (False)
    decode_at: str = "load"
    decode_stream: bool = True
    # caps.collective sources: control collectives this rank issued eagerly on the group; the
    # DLO guard and the gathered codec plan count theirs here (the guard compares the counts)
    ncoll: int = 0

    @property
    def raw(self) -> list[bool]:
        """Per block: its host image is raw (True) or coded (False). Default: every block raw."""
        return [True] * len(self.layouts)

    @property
    def capacity(self) -> list[int]:
        """Per block: the most bytes its coded image may take in the store. Default: its raw bytes."""
        return [lay.nbytes for lay in self.layouts]

    def sample(self, k: int, codecs, max_bytes: int | None = SAMPLE_BYTES) -> dict:
        """Raw block ``k`` encoded aside with each codec of ``codecs``, nothing stored (a sample of
        about ``max_bytes`` of it; None: whole): codec -> (the whole block's coded bytes, the coded
        sample, its DecodeTable, the bytes it decodes to) (:func:`~..host.recode.sample_coded`).
        A collective on ``caps.collective`` sources (every rank samples the same blocks in order)."""
        raise NotImplementedError(f"{type(self).__name__} cannot code its blocks (caps.codes_blocks is False)")

    def coded_shard_bytes(self, k: int, coded: int) -> int:
        """``caps.sharded`` sources: this rank's link bytes for block ``k`` coded in ``coded`` bytes."""
        raise NotImplementedError(f"{type(self).__name__} holds whole blocks (caps.sharded is False)")

    def code_blocks(self, ks, codec: str, *, progress: bool = False, background: bool = False) -> None:
        """Code raw blocks ``ks`` with ``codec`` in place, on a thread with ``background``
        (sources with ``caps.codes_blocks``; the auto mechanism, plan/auto.py, calls it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot code its blocks (caps.codes_blocks is False)")

    # -- sharded sources (caps.sharded: streamed.py's local_state_dict / gather_state_dict) --
    def ready_to_gather(self, what: str) -> None:
        """Raise a named error when ``what`` (a gather outside the ring) cannot run now."""
        raise NotImplementedError(f"{type(self).__name__} holds whole blocks (caps.sharded is False)")

    def local_piece(self, name: str, k: int, index: int):
        """This rank's piece of tensor ``index`` of block ``k`` (state-dict key ``name``)."""
        raise NotImplementedError(f"{type(self).__name__} holds whole blocks (caps.sharded is False)")

    def stats(self) -> dict:
        """At least :data:`STATS_KEYS`; source-specific keys beside them."""

    def close(self) -> None:
        """Release host memory registrations, threads and mappings."""


def check_stats(stats: Mapping) -> Mapping:
    """``stats`` unchanged; ValueError naming the keys a source left out."""
    missing = [k for k in STATS_KEYS if k not in stats]
    if missing:
        raise ValueError(f"weight source stats() lack {missing}; every source reports {list(STATS_KEYS)}")
    return stats
