"""Pinned host images: every streamed block as one contiguous image in a host arena.

The default source. Blocks are packed block by block into a :class:`HostStore`
(registered with CUDA under ``pinned_memory_budget_gb``); a load is one H2D
copy of the image into the slot on the copy stream. ``state_dict()`` values are
views of the arena (zero-copy), and an in-place edit of one is picked up at the
next step start through the arena's version counter (:meth:`host_version`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..discovery import Block
from ..host_store import HostStore, copy_from_image
from ..layout import BlockLayout
from ..packing import pack_blocks
from ..schedule import Schedule


@dataclass
class SourceRequest:
    """What a source factory gets from :class:`StreamedBlocks` (before anything is packed)."""

    config: object  # OffloadConfig
    device: torch.device
    blocks: list[Block]  # the streamed blocks, in discovery order
    tensors: list[list[tuple[str, str, torch.Tensor]]]  # per streamed block: (name, kind, tensor) in layout order
    layouts: list[BlockLayout]  # runtime layouts (build_layout)
    schedule: Schedule

    def objects(self, k: int) -> list[torch.Tensor]:
        return [t for _, _, t in self.tensors[k]]

    def pin_budget(self) -> int | None:
        gb = self.config.pinned_memory_budget_gb
        return None if gb is None else int(gb * 1e9)

    @property
    def pin(self) -> bool:
        return bool(self.config.pin_memory) and self.device.type == "cuda"


def drop_storage(tensors, device: torch.device) -> None:
    """Point tensors at shared empty placeholders (identity kept, storage released)."""
    empties: dict[torch.dtype, torch.Tensor] = {}
    for t in tensors:
        t.data = empties.setdefault(t.dtype, torch.empty(0, dtype=t.dtype, device=device))


class PinnedSource:
    """Block images in one (pinned) host arena; one H2D copy per load."""

    name = "pinned"
    collective = False
    waits_for_free = False

    def __init__(self, req: SourceRequest):
        self.layouts = list(req.layouts)
        self.device = req.device
        self.slot_bytes = max(lay.nbytes for lay in self.layouts)
        self.store = HostStore(self.layouts, pin=req.pin, budget_bytes=req.pin_budget())
        pack_blocks(self.store, [req.objects(k) for k in range(len(self.layouts))],
                    lambda ts: drop_storage(ts, req.device), progress=req.config.progress,
                    what=f"packing {len(self.layouts)} blocks into host memory")
        self._views = {id(t): hv for k in range(len(self.layouts))
                       for t, hv in zip(req.objects(k), self.store.views(k))}
        self.slots: list[torch.Tensor] = []

    def slot_bytes_of(self, ks) -> int:
        """Bytes of a slot that holds any of blocks ``ks`` (auto placement streams a subset)."""
        return max(self.layouts[k].nbytes for k in ks)

    # -- the executor's side --------------------------------------------------------
    def attach(self, slots, streams, device) -> None:
        self.slots = slots

    def side_streams(self) -> list:
        return []

    def load(self, k: int, slot: int, *, position: int, after, tag):
        src = self.store.image(k)
        copy_from_image(self.slots[slot][: src.numel()], src)  # chunk-safe: one registration per copy
        return None if self.device.type != "cuda" else torch.cuda.current_stream(self.device)

    def host_version(self) -> int:
        """Moves when any host view is written in place through torch (one integer read)."""
        return self.store.arena._version

    # -- host side -----------------------------------------------------------------------
    def host_views(self) -> dict[int, torch.Tensor]:
        return self._views

    def write(self, k: int, index: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            self.layouts[k].tensors[index].view_of(self.store.image(k)).copy_(value)

    def image(self, k: int) -> torch.Tensor:
        out = torch.empty(self.layouts[k].nbytes, dtype=torch.uint8, device=self.device)
        copy_from_image(out, self.store.image(k))
        return out

    def stats(self) -> dict:
        s = self.store
        return {"source": self.name, "host_bytes": s.nbytes, "pinned_bytes": s.pinned_bytes, "pinned": s.pinned,
                "pin_failure": s.pin_failure, "h2d_bytes_per_step": sum(lay.nbytes for lay in self.layouts),
                "slot_bytes": self.slot_bytes}

    def close(self) -> None:
        self.store.close()
        self._views.clear()

    def __repr__(self) -> str:
        return f"PinnedSource({self.store!r})"


def pinned_source(req: SourceRequest) -> PinnedSource:
    return PinnedSource(req)
