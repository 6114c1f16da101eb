"""Quantized weights streamed as they are: the one table of quantized formats.

A quantized block is one more kind of host image, not a new source: its image holds the
quantized bytes (and scales) once, a slot holds them, and the block's modules compute with
them exactly as they do resident. Every place that must know about a quantized format asks
this module (one table, :data:`FORMATS`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..misuse import UnsupportedCombinationError, UnsupportedOperationError, WeightUpdateError
from . import bnb


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One quantized tensor format: which classes are its own, and what it adds to streaming
    (each None where the format needs nothing more than a plain tensor or tensor subclass)."""
    name: str
    owns: Callable[[type], bool]  # a class of a tensor's MRO is the format's
    parts: Callable | None = None  # (name, kind, t) -> [(name, kind, tensor)] the image holds for t, or None
    prepare: Callable | None = None  # (module, device): before the layouts are built (may refuse)
    rehome: Callable | None = None  # (module, device) -> undo callables: resident state onto the device
    check_update: Callable | None = None  # (key, obj, new): refuse an update its bytes would not mean


# the quantized tensor formats, in detection order (layerwise casting is a diffusers hook, not a tensor class)
FORMATS = (
    QuantFormat("bitsandbytes", bnb.owns, parts=bnb.parts, prepare=bnb.prepare, rehome=bnb.rehome,
                check_update=bnb.check_update),
    QuantFormat("torchao", lambda c: c.__module__.startswith("torchao.")),
    QuantFormat("gguf", lambda c: c.__name__ == "GGUFParameter" and c.__module__.startswith("diffusers.")),
)

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


def casting_leaves(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` that diffusers' layerwise casting hooks (its leaves)."""
    return [m for m in module.modules() if "layerwise_casting" in _hook_names(m)]


def tensor_format(t) -> str:
    """The quantized format of one tensor object by its class (:data:`FORMATS` order), else "none"."""
    for cls in type(t).__mro__:
        for f in FORMATS:
            if f.owns(cls):
                return f.name
    data = t.data if isinstance(t, torch.nn.Parameter) else None
    if data is not None and type(data) is not torch.Tensor:
        return tensor_format(data)
    return "none"


def quantized_format(module: nn.Module) -> str:
    """The one quantized format of ``module``'s tensors: "layerwise-casting" (diffusers'
    ``enable_layerwise_casting``), "gguf", "torchao", "bitsandbytes", or "none". Reads only."""
    found: dict[str, str] = {}  # format -> the first module name or tensor key in that format
    for name, m in module.named_modules():
        if "layerwise_casting" in _hook_names(m):
            found.setdefault("layerwise-casting", name or type(module).__name__)
        for key, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is not None:
                f = tensor_format(t)
                if f != "none":
                    found.setdefault(f, f"{name}.{key}" if name else key)
    if len(found) > 1:
        raise UnsupportedCombinationError(
            f"{type(module).__name__} mixes quantized formats: "
            f"{', '.join(f'{f} ({where!r})' for f, where in sorted(found.items()))}; one format per model streams: "
            "quantize the model with one backend (allowed: one of gguf, torchao, bitsandbytes, layerwise-casting)")
    return next(iter(found)) if found else "none"


def _gguf_class(t) -> type | None:
    return next((c for c in type(t).__mro__ if c.__name__ == "GGUFParameter" and c.__module__.startswith("diffusers.")),
                None)


def inner_tensors(t) -> list[tuple[str, torch.Tensor]] | None:
    """The plain inner tensors of a tensor subclass that flattens (torchao's ``Int8Tensor`` /
    ``Float8Tensor``: ``qdata``, ``scale``, ...), by attribute name, in ``__tensor_flatten__``
    order; None for a plain tensor (GGUF and float8 storage are plain). These stream: the image
    holds their bytes, a slot their views, and the subclass object reads them as its attributes."""
    if not is_traceable_wrapper_subclass(t):
        return None
    out = []
    for name in t.__tensor_flatten__()[0]:
        v = getattr(t, name)
        if is_traceable_wrapper_subclass(v):
            raise UnsupportedOperationError(
                f"a {type(t).__name__} holds a {type(v).__name__} as {name!r} (a nested tensor subclass); only one "
                "level of inner tensors streams: quantize with torchao's current configs (Int8WeightOnlyConfig, "
                "Float8WeightOnlyConfig: Int8Tensor / Float8Tensor), or keep the module resident")
        out.append((name, v))
    return out


def parts_of(t) -> list[tuple[str, torch.Tensor]]:
    """``[("", t)]`` for a plain tensor; ``[("[qdata]", inner), ...]`` for a tensor subclass."""
    inner = inner_tensors(t)
    return [("", t)] if inner is None else [(f"[{n}]", v) for n, v in inner]


def expand(name: str, kind: str, t: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    """``(name, kind, t)`` of a block's tensor as the image holds it: itself, or its inner
    tensors as ``name[inner]`` for a tensor subclass (:func:`inner_tensors`)."""
    inner = inner_tensors(t)
    if inner is not None:
        return [(f"{name}[{n}]", kind, v) for n, v in inner]
    for f in FORMATS:
        got = f.parts(name, kind, t) if f.parts is not None else None
        if got is not None:  # a weight with tensors beside it (bitsandbytes' quant state)
            return got
    return [(name, kind, t)]


def _entry(fmt: str) -> QuantFormat | None:
    return next((f for f in FORMATS if f.name == fmt), None)


def prepare(module: nn.Module, fmt: str, device: torch.device) -> None:
    """Before the layouts of ``module`` (quantized as ``fmt``) are built: its format's own
    preparation (bitsandbytes: offload/host/bnb.py), which may refuse by name."""
    f = _entry(fmt)
    if f is not None and f.prepare is not None:
        f.prepare(module, device)


def rehome(module: nn.Module, device: torch.device) -> list[Callable[[], None]]:
    """What of ``module``'s quantized state does not stream moves to ``device``, once, before the
    source is built. Every tensor subclass claims ``device`` (its inner tensors, streamed or made
    resident, live there from now on; the object, its identity and its inner tensor objects stay):
    a wrapper of the same class and metadata built on ``device`` is swapped in, then given back
    the very inner tensor objects the block images bind. Then each format's own resident state
    (:attr:`QuantFormat.rehome`: bitsandbytes' quant maps and nested offset). Returns the undo
    callables, for :func:`unhome` after a failed setup."""
    undo: list[Callable[[], None]] = []
    for m in module.modules():
        for t in list(m._parameters.values()):
            if t is not None and inner_tensors(t) is not None and t.device != device:
                undo.append(lambda t=t, was=t.device: _claim(t, was))
                _claim(t, device)
    for f in FORMATS:
        if f.rehome is not None:
            undo += f.rehome(module, device)
    return undo


def unhome(undo: list[Callable[[], None]]) -> None:
    """Undo :func:`rehome` (a setup failed after it: the inner tensors hold their weights again)."""
    for step in reversed(undo):
        step()


def _claim(t: torch.Tensor, device: torch.device) -> None:
    inner = inner_tensors(t)
    names, ctx = t.__tensor_flatten__()
    stand = {n: torch.empty(1, dtype=v.dtype, device=device).expand(v.shape) for n, v in inner}
    new = type(t).__tensor_unflatten__(stand, ctx, t.shape, t.stride())
    torch.utils.swap_tensors(t, nn.Parameter(new, requires_grad=t.requires_grad))
    for n, v in inner:
        setattr(t, n, v)


def _own_class(t) -> type:
    """``t``'s class without a weightstream placeholder subclass (placeholders.py)."""
    cls = type(t)
    return cls.__mro__[1] if cls.__module__ == "weightstream.offload.placeholders" else cls


def host_form(t, views):
    """What ``state_dict()`` gives for the streamed tensor ``t`` (``views``: id -> host view):
    the model's own quantized form over the host bytes, zero-copy (a GGUF weight: a
    ``GGUFParameter`` with its ``quant_type``; a torchao subclass rebuilt from its inner
    tensors' host views), the host view itself for plain and float8 tensors; None where ``t``
    does not stream."""
    inner = inner_tensors(t)
    if inner is not None:
        hvs = [views.get(id(v)) for _, v in inner]
        if any(h is None for h in hvs):
            return None
        names, ctx = t.__tensor_flatten__()
        return _own_class(t).__tensor_unflatten__(dict(zip(names, hvs)), ctx, t.shape, t.stride())
    hv = views.get(id(t))
    cls = _gguf_class(t)
    if cls is not None and hv is not None:
        return cls(hv, quant_type=t.quant_type)
    return hv


def streams(t, views) -> bool:
    """Whether ``t`` (a plain tensor, or a tensor subclass by its inner tensors) is in ``views``."""
    inner = inner_tensors(t)
    return id(t) in views if inner is None else all(id(v) in views for _, v in inner)


def split_update(key: str, obj, new) -> list[tuple[str, torch.Tensor, torch.Tensor]] | None:
    """An update of the tensor subclass ``obj`` as updates of its inner tensors
    ``(key[inner], inner object, new inner)``; None for a plain ``obj``. ``new`` must be of
    ``obj``'s class with the same metadata (block size, dtype, ...)."""
    inner = inner_tensors(obj)
    if inner is None:
        return None
    names, ctx = obj.__tensor_flatten__()
    if _own_class(new) is not _own_class(obj) or new.__tensor_flatten__() != (names, ctx):
        raise WeightUpdateError(
            f"update_weights: {key!r} is a {_own_class(obj).__name__} ({ctx}); the new value is a "
            f"{type(new).__name__}{' with other metadata' if type(new) is _own_class(obj) else ''}; nothing was "
            f"written. Pass a {_own_class(obj).__name__} quantized with the same config")
    return [(f"{key}[{n}]", v, getattr(new, n)) for n, v in inner]


def check_update(key: str, obj, new) -> None:
    """Refuse an update of a quantized tensor by one its bytes would not mean the same in:
    a GGUF weight takes a ``GGUFParameter`` of its own ``quant_type`` (same byte shape); a
    format's own rule (bitsandbytes' serialised quant state) first."""
    for f in FORMATS:
        if f.check_update is not None:
            f.check_update(key, obj, new)
    if _gguf_class(obj) is None:
        return
    want = obj.quant_type
    got = new.quant_type if _gguf_class(new) is not None else None
    if got != want:
        raise WeightUpdateError(
            f"update_weights: {key!r} is a GGUF weight of quant_type {want!r}; the new value is "
            f"{'a ' + type(new).__name__ if got is None else f'of quant_type {got!r}'}; nothing was written. Pass a "
            f"GGUFParameter of quant_type {want!r} (its bytes as the GGUF file holds them)")
