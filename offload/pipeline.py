"""Layer mode over a whole pipeline: each selected DiT (and text encoder)
streams its blocks in place (:func:`~weightstream.offload.transformer.apply_layerwise_offload`);
every other component moves to the device and stays there.

The pipeline keeps its original module objects, also with ``cuda_graphs="on"``
(the handle then sets the instance's ``forward`` to the graph runner's entry):
streaming runs from hooks on the module itself, and a state_dict hook on it
serves the host weights, so ``pipe.save_pretrained`` and ``model_index.json``
see the real components.

Reached through ``offload_pipeline(pipe, {"mode": "layer", ...})``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .components import Components
from .config import OffloadConfig
from .discovery import OffloadPlan
from .transformer import LayerwiseOffloadHandle

# Block containers of common text encoders (transformers' T5/UMT5 and CLIP
# text models), tried in order when an encoder declares none of its own.
ENCODER_BLOCK_CONTAINERS = ("encoder.block", "text_model.encoder.layers", "encoder.layers", "layers")


def _encoder_plan(module: nn.Module) -> OffloadPlan | None:
    if getattr(type(module), "_layerwise_offload_blocks_attrs", None) is not None:
        return None
    for path in ENCODER_BLOCK_CONTAINERS:
        obj = module
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, (nn.ModuleList, nn.Sequential)):
            return OffloadPlan([path])
    raise ValueError(
        f"text encoder {type(module).__name__} has no known block container (tried "
        f"{', '.join(ENCODER_BLOCK_CONTAINERS)}); declare _layerwise_offload_blocks_attrs on its class"
    )


class LayerwisePipelineOffload:
    """Handle of layer mode over a pipeline: ``wrapped`` maps component paths to
    their :class:`LayerwiseOffloadHandle` (the pipeline keeps the modules);
    ``disable()`` leaves plain modules."""

    def __init__(self, pipe: Any, config: OffloadConfig, device: torch.device, components: Components):
        self.pipe, self.config, self.device = pipe, config, device
        self.wrapped: dict[str, LayerwiseOffloadHandle] = {}
        selected = [c for c in components.items if c.kind in config.components and c.kind in ("dit", "text_encoder")]
        try:
            for c in selected:
                if c.kind == "dit":
                    cfg, plan = config, None
                else:  # an encoder streams with its own layer options
                    opts = config.layer_option("text_encoder")
                    cfg = config.replace(components=("dit",), layer_options={"dit": opts})
                    plan = _encoder_plan(c.module)
                self.wrapped[c.name] = LayerwiseOffloadHandle(c.module, cfg, device=device, plan=plan)
            with torch.no_grad():
                for c in components.items:
                    if c.name not in self.wrapped:
                        for t in list(c.module.parameters()) + list(c.module.buffers()):
                            if t.device != device:
                                t.data = t.data.to(device)
        except BaseException:
            self.disable()
            raise

    def stats(self) -> dict:
        return {name: w.stats() for name, w in self.wrapped.items() if not w.removed}

    def disable(self) -> Any:
        """Every streamed component back as an ordinary resident module on the pipeline."""
        for name, w in list(self.wrapped.items()):
            w.remove()
            del self.wrapped[name]
        return self.pipe

    def __repr__(self) -> str:
        return f"LayerwisePipelineOffload({', '.join(self.wrapped) or 'disabled'} streamed on {self.device})"
