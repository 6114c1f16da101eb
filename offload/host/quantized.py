"""Quantized weights streamed as they are: the one table of quantized formats.

A quantized block is one more kind of host image, not a new source: its image holds the
quantized bytes (and scales) once, a slot holds them, and the block's modules compute with
them exactly as they do resident. Every place that must know about a quantized format asks
this module (one table, :data:`FORMATS`).
"""
from __future__ import annotations

import torch
from torch import nn

from ..misuse import WeightUpdateError

# diffusers hooks that keep streaming exact (layerwise casting: fp8 storage, upcast per forward
# on the device from the bound slot view; docs/quantized.md)
STREAMABLE_DIFFUSERS_HOOKS = frozenset({"layerwise_casting", "peft_autocast_disable"})


def foreign_hooks(registry) -> list[str]:
    """Names of the hooks of a diffusers ``HookRegistry`` that streaming cannot compose with
    (group offload, caches, ...): every hook but layerwise casting's."""
    return [name for name in registry.hooks if name not in STREAMABLE_DIFFUSERS_HOOKS]


def _hook_names(module) -> set[str]:
    registry = module.__dict__.get("_diffusers_hook")  # a diffusers HookRegistry, set by its hooks
    return set(registry.hooks) if registry is not None else set()


def tensor_format(t) -> str:
    """The quantized format of one tensor object by its class (:data:`FORMATS` order), else "none"."""
    for cls in type(t).__mro__:
        mod, name = cls.__module__, cls.__name__
        if mod.startswith("bitsandbytes."):
            return "bitsandbytes"
        if mod.startswith("torchao."):
            return "torchao"
        if name == "GGUFParameter" and mod.startswith("diffusers."):
            return "gguf"
    data = t.data if isinstance(t, torch.nn.Parameter) else None
    if data is not None and type(data) is not torch.Tensor:
        return tensor_format(data)
    return "none"


def quantized_format(module: nn.Module) -> str:
    """The one quantized format of ``module``'s tensors: "layerwise-casting" (diffusers'
    ``enable_layerwise_casting``), "gguf", "torchao", "bitsandbytes", or "none". Reads only."""
    found = set()
    for m in module.modules():
        if "layerwise_casting" in _hook_names(m):
            found.add("layerwise-casting")
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                f = tensor_format(t)
                if f != "none":
                    found.add(f)
    if len(found) > 1:
        raise ValueError(f"{type(module).__name__} mixes quantized formats {sorted(found)}; one format per "
                         "model streams: quantize the model with one backend")
    return found.pop() if found else "none"


def _gguf_class(t) -> type | None:
    return next((c for c in type(t).__mro__ if c.__name__ == "GGUFParameter" and c.__module__.startswith("diffusers.")),
                None)


def held_form(t, host_view):
    """What ``state_dict()`` gives for the streamed tensor ``t`` whose bytes are ``host_view``:
    the model's own quantized form (a GGUF weight: a ``GGUFParameter`` with its ``quant_type``
    over the host bytes, zero-copy), the view itself for plain and float8 tensors."""
    cls = _gguf_class(t)
    if cls is not None and host_view is not None:
        return cls(host_view, quant_type=t.quant_type)
    return host_view


def check_update(key: str, obj, new) -> None:
    """Refuse an update of a quantized tensor by one its bytes would not mean the same in:
    a GGUF weight takes a ``GGUFParameter`` of its own ``quant_type`` (same byte shape)."""
    if _gguf_class(obj) is None:
        return
    want = obj.quant_type
    got = new.quant_type if _gguf_class(new) is not None else None
    if got != want:
        raise WeightUpdateError(
            f"update_weights: {key!r} is a GGUF weight of quant_type {want!r}; the new value is "
            f"{'a ' + type(new).__name__ if got is None else f'of quant_type {got!r}'}; nothing was written. Pass a "
            f"GGUFParameter of quant_type {want!r} (its bytes as the GGUF file holds them)")
