"""Layer mode over a whole pipeline: each selected DiT (and text encoder)
streams its blocks through an :class:`OffloadedTransformer` built over it;
every other component moves to the device and stays there.

The pipeline keeps its original module objects: streaming runs from hooks on
the module itself, and a state_dict hook on it serves the host weights, so
``pipe.save_pretrained`` and ``model_index.json`` see the real components.
Only with ``cuda_graphs="on"`` is the component replaced by its wrapper (the
graph runner must intercept the call); such a pipeline's ``save_pretrained``
cannot save that component (diffusers does not know the wrapper class): call
``disable()`` first, or save the component itself (``handle.wrapped[name].save_pretrained``).

Reached through ``offload_pipeline(pipe, {"mode": "layer", ...})``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .components import Components
from .config import OffloadConfig
from .discovery import OffloadPlan, resolve_path
from .transformer import OffloadedTransformer

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


def _set_path(root: Any, dotted: str, value: Any) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(resolve_path(root, parent) if parent else root, leaf, value)


class LayerwisePipelineOffload:
    """Handle of layer mode over a pipeline: ``wrapped`` maps component paths to
    their :class:`OffloadedTransformer`; ``replaced`` names those the pipeline
    calls through the wrapper (CUDA graphs); ``disable()`` leaves plain modules."""

    def __init__(self, pipe: Any, config: OffloadConfig, device: torch.device, components: Components):
        self.pipe, self.config, self.device = pipe, config, device
        self.wrapped: dict[str, OffloadedTransformer] = {}
        self.replaced: set[str] = set()
        selected = [c for c in components.items if c.kind in config.components and c.kind in ("dit", "text_encoder")]
        try:
            for c in selected:
                if c.kind == "dit":
                    cfg, plan = config, None
                else:  # an encoder streams with its own layer options
                    opts = config.layer_option("text_encoder")
                    cfg = config.replace(components=("dit",), layer_options={"dit": opts})
                    plan = _encoder_plan(c.module)
                self.wrapped[c.name] = OffloadedTransformer(c.module, cfg, device=device, plan=plan)
                if cfg.cuda_graphs == "on":  # the graph runner replaces the module's call
                    _set_path(pipe, c.name, self.wrapped[c.name])
                    self.replaced.add(c.name)
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
        return {name: w.stats() for name, w in self.wrapped.items() if not w._disabled}

    def disable(self) -> Any:
        """Every streamed component back as an ordinary resident module on the pipeline."""
        for name, w in list(self.wrapped.items()):
            plain = w.disable()
            if name in self.replaced:
                _set_path(self.pipe, name, plain)
                self.replaced.discard(name)
            del self.wrapped[name]
        return self.pipe

    def __repr__(self) -> str:
        return f"LayerwisePipelineOffload({', '.join(self.wrapped) or 'disabled'} streamed on {self.device})"
