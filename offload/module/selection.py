"""Which components become units, which tensors each unit owns, what stays on the device.

Pure setup bookkeeping: nothing here copies a tensor (the caller moves the
tensors that stay, and packs the units' tensors into their host masters).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..components import Component, Components
from ..misuse import AlreadyOffloadedError
from ..wrap_checks import check_wrappable
from ..layout import block_tensors, build_layout
from ..progress import format_bytes
from .split import SplitMovers, check_parts
from .units import SWAPPED_KINDS, Unit

if TYPE_CHECKING:
    from . import ModuleOffload

# set on every module a handle offloads (to that handle), so a second offload is refused
MARK = "_weightstream_module_offload"


def select_units(controller: "ModuleOffload", components: Components, selected: set[str],
                 split: list[tuple[nn.Module, SplitMovers]]):
    """Units of the selected components (split models: one per part, their movers appended
    to ``split`` as soon as enabled, for the caller to undo on failure), with their exclusion
    lists; returns (units by name, components left resident by name, modules to mark)."""
    units: dict[str, Unit] = {}
    resident_only: dict[str, Component] = {}
    marked: list[nn.Module] = []
    for c in components.items:
        if getattr(c.module, MARK, None) is not None:
            raise AlreadyOffloadedError(
                f"component {c.name!r} of {components.pipeline} is already under module offload; "
                "call disable() on the first handle before offloading again"
            )
        if c.kind == "resident" or c.kind not in selected:
            resident_only[c.name] = c
            continue
        check_wrappable(c.module, allow_meta=True)  # streamed in layer mode, or another library's hooks
        marked.append(c.module)
        enable = getattr(c.module, "enable_omni_model_cpu_offload", None)
        if c.kind in SWAPPED_KINDS and callable(enable):
            units.update(_split_units(controller, c, enable, split))
        else:
            units[c.name] = Unit(c.name, c.kind, c.module, group=None)
    for kind in selected:
        if not components.of_kind(kind):
            warnings.warn(
                f"weightstream: components selects {kind!r}, but {components.pipeline} has no "
                f"{kind} component ({components.source}); nothing of that kind is offloaded",
                stacklevel=4,
            )
    swapped = [u for u in units.values() if u.swapped]
    for u in swapped:
        u.excludes = [
            v for v in swapped
            if v is not u and ((u.group is not None and u.group == v.group) or "dit" in (u.kind, v.kind))
        ]
    return units, resident_only, marked


def _split_units(controller, c: Component, enable, split) -> dict[str, Unit]:
    movers = SplitMovers(controller, c.name)
    parts = enable(movers)
    split.append((c.module, movers))
    check_parts(c.name, c.module, parts)
    movers.parts = tuple(parts)
    return {movers.unit_name(p): Unit(movers.unit_name(p), c.kind, m, group=c.name) for p, m in parts.items()}


def tensors_of(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, _, t in block_tensors(module)]


def assign_tensors(units: Iterable[Unit], components: Components) -> list[torch.Tensor]:
    """Each unit's tensors and layout (layout index = unit order); returns every other tensor
    of the components, once each: those go to the device and stay. Tensors of resident
    modules stay, also inside a unit; a tensor of two units, or of a unit and another
    component, is refused (it would have two host masters)."""
    units = list(units)
    keep: set[int] = set()
    for c in components.of_kind("resident"):
        keep.update(id(t) for t in tensors_of(c.module))
    owner: dict[int, str] = {}
    for index, u in enumerate(units):
        objs = []
        for tname, kind, t in block_tensors(u.module):
            if id(t) in keep:
                continue
            if id(t) in owner:
                raise ValueError(
                    f"tensor {u.name}.{tname} is shared with component {owner[id(t)]!r}; a tensor can have "
                    "one host master only: untie the weights or keep one of the components resident"
                )
            owner[id(t)] = u.name
            objs.append((tname, kind, t))
        u.tensors = [t for _, _, t in objs]
        u.layout = build_layout(index, u.name, objs)
        u.index = u.layout.index
    return _rest(units, components, owner)


def _rest(units: list[Unit], components: Components, owner: dict[int, str]) -> list[torch.Tensor]:
    by_name = {u.name: u for u in units}
    rest: list[torch.Tensor] = []
    seen: set[int] = set(owner)
    for c in components.items:
        for tname, _, t in block_tensors(c.module):
            unit = by_name.get(owner.get(id(t), ""))
            if unit is not None and unit.module is not c.module and unit.group != c.name:
                raise ValueError(
                    f"tensor {c.name}.{tname} is shared with component {unit.name!r}, which is offloaded; "
                    "a swapped tensor cannot also belong to another component: untie the weights"
                )
            if id(t) not in seen:
                seen.add(id(t))
                rest.append(t)
    return rest


def device_peak(units: Iterable[Unit], resident_bytes: int, budget_gb: float | None) -> int:
    """Upper bound of the device bytes: what stays (resident tensors, VAEs) plus the largest
    group that may share the device; ``ValueError`` when it exceeds ``budget_gb``."""
    units = list(units)
    swapped = [u for u in units if u.swapped]
    stay = sum(u.nbytes for u in units if not u.swapped)
    worst = 0
    for u in swapped:  # upper bound of what can share the device with u
        excl = {id(v) for v in u.excludes}
        worst = max(worst, u.nbytes + sum(v.nbytes for v in swapped if v is not u and id(v) not in excl))
    peak = resident_bytes + stay + worst
    if budget_gb is not None and peak > budget_gb * 1e9:
        raise ValueError(
            f"device_memory_budget_gb={budget_gb} is too small for module offload: resident modules and "
            f"VAEs need {format_bytes(resident_bytes + stay)} and the largest co-resident "
            f"component group {format_bytes(worst)}; raise the budget or use mode='layer'"
        )
    return peak
