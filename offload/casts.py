"""Casts and moves of a streamed module: a no-op where they change nothing, else a named refusal.

A cast (``.to(dtype)``, ``.half()``) or a move (``.to("cuda")``, ``.cuda()``) of a module whose
weights live in a host store would reach only the tensors on the device, not the host images the
next forward loads from: the forward would then fail or mix dtypes. The wrapper
(:class:`~.transformer.OffloadedTransformer`) overrides ``to`` and ``_apply``; a module streamed
in place (``apply_layerwise_offload``, ``offload_pipeline`` in layer or module mode) keeps its
class, so a :class:`CastGuard` is set on the instance instead (``to`` and ``_apply`` in its
``__dict__``, never on the class, as the in-place handle sets ``forward`` under CUDA graphs) and
taken off by the handle's ``remove()`` / ``disable()``. Pipelines call ``.to(device)`` on every
component (``pipe.to("cuda")``): to the device the module runs on, or to the dtype it has, that is
a no-op.
"""
from __future__ import annotations

import torch
from torch import nn

from .misuse import UnsupportedOperationError

__all__ = ["CastGuard", "check_to"]

APPLY_CALLS = ".half() / .float() / .bfloat16() / .double() / .type() / .cuda() / .cpu()"


def check_to(args, kwargs, device: torch.device, dtypes, refuse) -> None:
    """Nothing when ``.to(*args, **kwargs)`` changes nothing for a module on ``device`` whose
    floating tensors have ``dtypes`` (a callable giving them); else ``refuse(what)``, raised."""
    to_device, dtype, _, fmt = torch._C._nn._parse_to(*args, **kwargs)
    if to_device is not None and (to_device.type != device.type or to_device.index not in (None, device.index)):
        raise refuse(f".to({to_device})")
    if fmt is not None:
        raise refuse(f".to(memory_format={fmt})")
    if dtype is not None and set(dtypes()) - {dtype}:
        raise refuse(f".to({dtype})")


class CastGuard:
    """``to`` and ``_apply`` of one streamed module, set on its instance (module doc). ``who``: the
    entry point that streams it; ``undo``: how to get the plain module back."""

    def __init__(self, module: nn.Module, device: torch.device, who: str, undo: str):
        self.module, self.device, self.who, self.undo = module, device, who, undo
        self.name = f"weightstream.cast_guard[{type(module).__name__}]"
        module.__dict__["to"] = self.to
        module.__dict__["_apply"] = self.apply

    def dtypes(self) -> set:
        """The dtypes of the module's floating tensors (its state dict: the host weights)."""
        return {t.dtype for t in self.module.state_dict(keep_vars=True).values() if t.is_floating_point()}

    def to(self, *args, **kwargs) -> nn.Module:
        check_to(args, kwargs, self.device, self.dtypes, self.refusal)
        return self.module

    def apply(self, fn, recurse: bool = True):
        raise self.refusal(APPLY_CALLS)

    def refusal(self, what: str) -> UnsupportedOperationError:
        return UnsupportedOperationError(
            f"{what} on {type(self.module).__name__} streamed by {self.who} is not supported: it would cast or "
            "move only the tensors on the device, not the host store of the streamed weights, and the next "
            f"forward would fail or mix dtypes. Cast or move the model before offloading it ({self.undo} gives "
            "the plain module back: change it, offload it again); a .to() to the device it runs on, or to the "
            "dtype it has, is a no-op")

    def remove(self) -> None:
        for key, mine in (("to", self.to), ("_apply", self.apply)):
            if self.module.__dict__.get(key) == mine:
                del self.module.__dict__[key]

    def __repr__(self) -> str:
        return f"CastGuard({self.name}, device={self.device})"
