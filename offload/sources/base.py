"""The weight-source protocol: the one interface between the executor and a block's bytes.

The executor (:mod:`offload.executor`) owns the ring: the device slots, the copy
stream, one "loaded" and one "freed" event per slot, the schedule and the
bindings. A source owns everything between a block's host bytes and its slot:
host images, pinning, side buffers and side streams, gathers, decodes.

``load(k, slot, ...)`` is called on the executor's copy stream (the current
stream; ``None`` streams on the CPU). The copy stream has already waited for
``freed[slot]`` unless the source set ``waits_for_free`` (then ``after`` is that
event and the source orders its slot writes after it itself, e.g. the DLO
source copies its shard ahead and makes only the gather wait). It returns the
stream on which the slot is complete (the executor records ``loaded[slot]``
there), or ``None`` on the CPU.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ..layout import BlockLayout

# Optional hooks (looked up once with getattr; a source defines those it needs):
#   check()             raise a named error when loads cannot be served (a changed checkpoint);
#                       called at every step start and before every graph replay
#   reload()            before the pending slots are re-copied (a ring reset)
#   host_version()      an int that moves when the host views are edited in place (one read per step)
#   uncapturable()      why a CUDA graph cannot hold its loads (None: it can)
#   capture_deferred()  why a capture should wait: the loads are about to change (None: capture now)
#   check_write(k, i)   refuse an update of tensor i of block k before anything is written
#   slot_bytes_of(ks)   slot bytes for a ring that streams only blocks ks (auto placement)
#   link_bytes(k)       bytes block k moves over the link when not its image size (coded images)
#   remove()            executor teardown: stop threads (close() releases host memory)
#   local_piece(name, k, i), ready_to_gather(what)   DLO shards: local_state_dict / gather checks
OPTIONAL_HOOKS = ("check", "reload", "host_version", "uncapturable", "capture_deferred", "check_write",
                  "slot_bytes_of", "link_bytes", "remove", "local_piece", "ready_to_gather")

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


@runtime_checkable
class WeightSource(Protocol):
    name: str
    layouts: list[BlockLayout]  # runtime layout of streamed block k (slot views come from it)
    slot_bytes: int  # bytes one device slot needs (a gathered image, a decoded image)
    collective: bool  # loads are collectives: every rank issues the same loads in the same order
    waits_for_free: bool  # load() orders its slot writes after ``after`` itself
    # optional: waits_for_free_of(k) -> bool, the same per block (the executor prefers it)

    def attach(self, slots: list[torch.Tensor], streams, device: torch.device) -> None:
        """Allocate per-slot side buffers and side streams (called once by the executor,
        with its copy stream current; ``streams`` is None on the CPU)."""

    def side_streams(self) -> list:
        """Streams besides the executor's copy stream that loads issue work on."""

    def load(self, k: int, slot: int, *, position: int, after, tag) -> Any:
        """Issue the writes of block ``k``'s bytes into ``slots[slot]``; returns the
        stream on which they complete (None: synchronous, CPU). ``tag``: the capture
        the load belongs to (None: eager)."""

    def before_use(self, k: int, slot: int, stream, tag=None) -> None:
        """Called by the executor just before block ``k`` computes from ``slots[slot]``, with
        ``stream`` (the compute stream) current and ordered after the load: a source that
        finishes a load there (a decode issued at use) does it now; others do nothing."""

    def check(self) -> None:
        """Raise a named error when the source cannot serve loads (a changed checkpoint)."""

    def host_views(self) -> Mapping[int, torch.Tensor]:
        """id(streamed tensor object) -> host tensor with its current weights (state_dict)."""

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        """Write tensor ``index`` of block ``k`` (update_weights; callers synchronised first)."""

    def image(self, k: int) -> torch.Tensor:
        """Block ``k``'s runtime image in a fresh device tensor (restore, state_dict of coded sources)."""

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
