"""The one builder of :class:`~.streamed.StreamedBlocks`: from a :class:`~.sources.select.Selection`
(one supported cell of the support matrix, ``sources/select.py``) and the source factory of its
transport. The wrapper and the in-place handle (:mod:`.transformer`), DLO (:mod:`.distributed`),
the mmap source (:mod:`.checkpoint_offload`) and the pipelines all build through it; module offload
(:mod:`.module`) asks :func:`~.sources.select.select` for its cell and builds no StreamedBlocks.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import OffloadConfig
from .discovery import OffloadPlan
from .sources.pinned import coded_source, pinned_source
from .sources.select import Selection, Topology, select
from .streamed import StreamedBlocks


def default_source(selection: Selection):
    """The source factory of the pinned transports (pinned, DLO rank-local): raw host images, or
    coded ones (a codec, or "auto": raw until the plan codes them)."""
    return coded_source if selection.coded else pinned_source


def streamed_blocks(module: nn.Module, config: OffloadConfig, device: torch.device, plan: OffloadPlan | None,
                    selection: Selection | None = None, *, source=None, guard=None, prime: str = "now",
                    next_step: bool = True, cls: type = StreamedBlocks) -> StreamedBlocks:
    """``cls`` (a StreamedBlocks) over ``module`` for ``selection`` (None: :func:`select` of
    ``config`` on ``device``, no DLO, no checkpoint). ``source``: the transport's factory
    ``SourceRequest -> WeightSource`` (None: :func:`default_source`); it receives the codec
    as ``SourceRequest.codec``."""
    if selection is None:
        selection = select(config, Topology(device_type=device.type))
    if source is None:
        source = default_source(selection)
    return cls(module, config, device, plan, selection=selection, source=source, guard=guard, prime=prime,
               next_step=next_step)
