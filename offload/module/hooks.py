"""The module offload hooks: named, removable pre-forward hooks that make a unit resident.

Hooks sit on each swapped component and on its direct child modules, so
``vae.decode``-style methods that call a child (``self.decoder(z)``) and
``encode_prompt`` calling ``text_encoder(...)`` work unchanged.
"""
from __future__ import annotations

import sys
from typing import Callable

from torch import nn

from ..host.quantized import casting_leaves
from ..hooks import RemovableHooks
from ..layout import block_tensors
from ..tracing import not_traced
from .units import Unit

# what a hook calls to bring its unit in: enter(unit, cause=..., log=...)
Enter = Callable[..., None]


class ModuleHook(RemovableHooks):
    """Named, removable pre-forward hook that makes a unit resident.

    ``root`` hooks sit on the component's own module: they also count running
    forwards (a post-forward hook, always called) and log an "enter" record.
    Entry hooks sit on its direct children, for methods such as
    ``vae.decode`` that call a child rather than ``forward``.
    """

    def __init__(self, enter: Enter, unit: Unit, module: nn.Module, entry: str | None):
        self.enter, self.unit, self.entry = enter, unit, entry
        self.name = f"weightstream.module[{unit.name}]" + (f".entry[{entry}]" if entry else "")
        self._handles = [module.register_forward_pre_hook(self.pre_forward)]
        if entry is None:
            self._handles.append(module.register_forward_hook(self.post_forward, always_call=True))

    @not_traced  # swaps rebind parameters and wait on stream events; not traceable
    def pre_forward(self, module, args):
        unit = self.unit
        if self.entry is None:
            unit.active += 1  # first: post_forward runs (and decrements) even if the swap raises
            self.enter(unit, cause=unit.name, log=True)
        elif not unit.on_device:
            self.enter(unit, cause=f"{unit.name}.{self.entry}", log=False)

    @not_traced  # bookkeeping only, but must not be traced into the graph
    def post_forward(self, module, args, output):
        self.unit.active -= 1

    def __repr__(self) -> str:
        u = self.unit
        where = "on device" if u.on_device else "on host"
        return f"ModuleHook({self.name}, {u.kind}, {where}, {self.state})"


def unit_hooks(enter: Enter, unit: Unit) -> list[ModuleHook]:
    """The root hook of ``unit``'s module, and an entry hook on each direct child holding
    some of its tensors (a resident child, or one without weights, has nothing to bring in)."""
    hooks = [ModuleHook(enter, unit, unit.module, entry=None)]
    unit_ids = {id(t) for t in unit.tensors}
    for cname, child in unit.module.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            continue
        if any(id(t) in unit_ids for _, _, t in block_tensors(child)):
            hooks.append(ModuleHook(enter, unit, child, entry=cname))
    return hooks


class LoadArrival(RemovableHooks):
    """Named, removable ``load_state_dict`` pre-hook on a swapped unit's module: a load that holds
    some of the unit's keys brings the unit to the device first (as its forward would), so torch
    copies into its device tensors instead of the empty placeholders; the unit's write-back
    (offload/adapters.py UnitEdits: the copies move the tensors' version counters) then carries the
    loaded weights into its host master, before it leaves and before any ``state_dict()``."""

    def __init__(self, enter: Enter, unit: Unit):
        self.enter, self.unit = enter, unit
        self.name = f"weightstream.module[{unit.name}].load_state_dict"
        self._handles = [unit.module.register_load_state_dict_pre_hook(self.pre_load)]

    def pre_load(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if self.unit.on_device:
            return
        mine = {id(t) for t in self.unit.tensors}  # the unit's keys: per load (peft renames them)
        keys = {k for k, t in module.state_dict(keep_vars=True).items() if id(t) in mine}
        if any(k[len(prefix):] in keys for k in state_dict if k.startswith(prefix)):
            self.enter(self.unit, cause=f"{self.unit.name}.load_state_dict", log=True)

    def __repr__(self) -> str:
        return f"LoadArrival({self.name}, {self.state})"


class CastingRebind:
    """Named, removable forward hook on a leaf of a swapped unit that diffusers' layerwise casting
    hooks: the casting hook's ``module.to(storage_dtype)`` after the leaf's forward leaves its
    tensors on fresh float8 copies of the same values; this hook, which runs after it, binds them
    back to their views of the unit's buffer, so the copies are freed at once and the unit's
    write-back (offload/adapters.py UnitEdits) sees no edit (docs/quantized.md)."""

    def __init__(self, unit: Unit, leaf: nn.Module, index: list[int]):
        self.unit, self.index = unit, index  # positions of the leaf's tensors in unit.tensors
        self.name = f"weightstream.module[{unit.name}].casting"
        self._handle = leaf.register_forward_hook(self.post_forward)

    @not_traced  # rebinds parameters
    def post_forward(self, module, args, output):
        u = self.unit
        if u.buffer is not None:
            for i in self.index:
                u.tensors[i].data = u.layout.tensors[i].view_of(u.buffer)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __repr__(self) -> str:
        return f"CastingRebind({self.name}, {len(self.index)} tensors, {'active' if self._handle else 'removed'})"


def casting_rebinds(unit: Unit) -> list[CastingRebind]:
    """A :class:`CastingRebind` on every leaf of ``unit`` under layerwise casting."""
    index = {id(t): i for i, t in enumerate(unit.tensors)}
    out = []
    for leaf in casting_leaves(unit.module):
        mine = [index[id(t)] for _, _, t in block_tensors(leaf) if id(t) in index]
        if mine:
            out.append(CastingRebind(unit, leaf, mine))
    return out


def forward_running(module: nn.Module) -> bool:
    """Whether a call of ``module`` (its ``nn.Module._call_impl`` frame) is on some thread's stack."""
    code = nn.Module._call_impl.__code__
    for top in sys._current_frames().values():
        f = top
        while f is not None:
            if f.f_code is code and f.f_locals.get("self") is module:
                return True
            f = f.f_back
    return False
