"""Offloading a whole pipeline: :func:`offload_pipeline`, the one entry of both modes.

Module mode (:class:`~weightstream.offload.module.ModuleOffload`) swaps whole
components. Layer mode (:class:`LayerwisePipelineOffload`, here): each selected
DiT (and text encoder) streams its blocks in place
(:func:`~weightstream.offload.transformer.apply_layerwise_offload`); every other
component moves to the device and stays there.

The pipeline keeps its original module objects, also with ``cuda_graphs="on"``
(the handle then sets the instance's ``forward`` to the graph runner's entry):
streaming runs from hooks on the module itself, and a state_dict hook on it
serves the host weights, so ``pipe.save_pretrained`` and ``model_index.json``
see the real components.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .components import Components, discover_components
from .config import OffloadConfig
from .config_schema import CONFIG_FIELDS_HINT, unknown_keyword
from .discovery import OffloadPlan
from .misuse import AlreadyOffloadedError
from .module import ModuleOffload
from .streamed import resolve_device
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


def check_no_foreign_offload(components: Components) -> None:
    """Raise AlreadyOffloadedError when a component carries accelerate hooks (diffusers'
    ``enable_model_cpu_offload`` / ``enable_sequential_cpu_offload``, a ``device_map``):
    they move the weights on every call and would fight the offload for them. Reads only."""
    for c in components.items:
        for sub_name, m in c.module.named_modules():
            hook = getattr(m, "_hf_hook", None)
            if hook is not None:
                where = f"{components.pipeline}.{c.name}" + (f".{sub_name}" if sub_name else "")
                raise AlreadyOffloadedError(
                    f"{where} is under accelerate offload hooks ({type(hook).__name__}: the pipeline's "
                    "enable_model_cpu_offload / enable_sequential_cpu_offload, or a device_map); offload_pipeline "
                    "refuses it, the two would move the same weights. Call pipe.remove_all_hooks() first (the "
                    "weights stay where they are), then offload_pipeline(pipe, ...)")


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
                else:  # an encoder streams with its own layer options (not the planned default)
                    cfg = config.encoder_config()
                    plan = _encoder_plan(c.module)
                self.wrapped[c.name] = LayerwiseOffloadHandle(c.module, cfg, device=device, plan=plan,
                                                              who="offload_pipeline")
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


OFFLOAD_PIPELINE_KEYWORDS = ("config", "device")


def offload_pipeline(pipe: Any, config: Any = None, *, device=None,
                     **unknown: Any) -> ModuleOffload | LayerwisePipelineOffload:
    """Offload a pipeline's components; returns the handle (:class:`ModuleOffload` in
    module mode, :class:`LayerwisePipelineOffload` in layer mode).

    ``pipe``: any object holding its components as attributes (a diffusers
    pipeline, an ``nn.Module`` pipeline, a plain object). ``config``: an
    :class:`OffloadConfig`, a dict or JSON string in the
    ``diffusion_offload_config`` schema, or None (module mode over dit and
    text_encoder). ``{"enable_cpu_offload": True}`` is the compatibility
    spelling of that. ``device``: where components run (default CUDA if
    available, else CPU; CPU runs the same mechanism).

    ``mode="layer"`` streams the blocks of each selected DiT (and text
    encoder) in place: the pipeline keeps its module objects, so
    ``pipe.save_pretrained`` writes the real weights.

    A pipeline under diffusers' ``enable_model_cpu_offload`` (or any accelerate
    hooks) is refused with :class:`AlreadyOffloadedError`: call
    ``pipe.remove_all_hooks()`` first.
    """
    if unknown:
        key = next(iter(unknown))
        raise unknown_keyword("offload_pipeline()", key, OFFLOAD_PIPELINE_KEYWORDS, tail=CONFIG_FIELDS_HINT)
    cfg = OffloadConfig.module() if config is None else OffloadConfig.coerce(config)
    dev = resolve_device(device)
    components = discover_components(pipe)
    check_no_foreign_offload(components)
    if cfg.mode == "layer":
        return LayerwisePipelineOffload(pipe, cfg, dev, components)
    return ModuleOffload(pipe, cfg, dev, components)
