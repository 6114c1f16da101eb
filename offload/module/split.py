"""Split-model components: one module made of mutually exclusive parts (a reasoner, then a
generator), each swapped as its own unit ``"<component>:<part>"``.

A selected DiT / encoder whose module has a callable ``enable_omni_model_cpu_offload`` is
delegated to: it receives a :class:`SplitMovers` and returns its parts; the model wraps each
phase in ``with self._offload_context("reasoner"):``, implemented as
``movers.context("reasoner")`` (the same movers and hooks the pipeline-level path uses).
Tensors of the model outside every part stay on the device.
``disable_omni_model_cpu_offload()`` is called on ``disable()``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from torch import nn

from ..discovery_forward import resolve_path

if TYPE_CHECKING:
    from . import ModuleOffload


@runtime_checkable
class SupportsSplitOffload(Protocol):
    """A component made of mutually exclusive parts that run in different phases.

    ``enable_omni_model_cpu_offload(movers)`` keeps ``movers`` (for
    ``_offload_context``) and returns the parts, ``{part name: submodule}``.
    Each part is swapped as its own unit and excludes its sibling parts.
    ``disable_omni_model_cpu_offload()`` forgets the movers (contexts become
    no-ops). Both must be idempotent. :class:`SplitOffloadMixin` implements
    the protocol from a class attribute ``_offload_parts``.
    """

    def enable_omni_model_cpu_offload(self, movers: "SplitMovers") -> Mapping[str, nn.Module]: ...

    def disable_omni_model_cpu_offload(self) -> None: ...


class SplitOffloadMixin:
    """Implements :class:`SupportsSplitOffload` from ``_offload_parts``
    (part name -> dotted path inside the model)::

        class Cosmos3Like(SplitOffloadMixin, nn.Module):
            _offload_parts = {"reasoner": "reasoner", "generator": "generator"}

            def forward(self, x):
                with self._offload_context("reasoner"):
                    ctx = self.reasoner(x)
                with self._offload_context("generator"):
                    return self.generator(x, ctx)
    """

    _offload_parts: ClassVar[Mapping[str, str]] = {}

    def enable_omni_model_cpu_offload(self, movers: "SplitMovers") -> Mapping[str, nn.Module]:
        object.__setattr__(self, "_omni_movers", movers)
        return {name: resolve_path(self, path, what=f"offload part {name!r}") for name, path in self._offload_parts.items()}

    def disable_omni_model_cpu_offload(self) -> None:
        object.__setattr__(self, "_omni_movers", None)

    def _offload_context(self, part: str):
        movers = self.__dict__.get("_omni_movers")
        return contextlib.nullcontext() if movers is None else movers.context(part)


class SplitMovers:
    """What a split model receives: contexts that make one of its parts resident.

    ``context(part)`` is ``handle.using("<component>:<part>")``: the part
    arrives (its siblings, other DiTs or encoders leave as the exclusion rules
    say) and stays until the block exits. The movers are the controller's own
    arrival / departure, the same ones the pipeline-level hooks use.
    """

    def __init__(self, controller: "ModuleOffload", component: str):
        self._controller = controller
        self.component = component
        self.parts: tuple[str, ...] = ()

    def unit_name(self, part: str) -> str:
        return f"{self.component}:{part}"

    def context(self, part: str):
        if part not in self.parts:
            raise ValueError(
                f"offload part {part!r} is not a part of {self.component!r}; choose from: {', '.join(self.parts)}"
            )
        return self._controller.using(self.unit_name(part))

    def on_device(self) -> tuple[str, ...]:
        """Parts of this model currently on the device."""
        prefix = self.component + ":"
        return tuple(n[len(prefix):] for n in self._controller.on_device() if n.startswith(prefix))

    def __repr__(self) -> str:
        return f"SplitMovers({self.component!r}, parts={list(self.parts)})"


def check_parts(component: str, module: nn.Module, parts) -> None:
    """``parts`` (what ``enable_omni_model_cpu_offload`` returned for ``component``) is a
    non-empty mapping of names without ':' to proper submodules of ``module``."""
    if not isinstance(parts, Mapping) or not parts:
        raise ValueError(
            f"{type(module).__name__}.enable_omni_model_cpu_offload (component {component!r}) returned "
            f"{parts!r}; expected a non-empty mapping of part name -> submodule"
        )
    inside = {id(m) for m in module.modules()}
    for part, sub in parts.items():
        if not isinstance(part, str) or not part or ":" in part:
            raise ValueError(f"split part name {part!r} of {component!r} is not allowed; use a non-empty name without ':'")
        if not isinstance(sub, nn.Module) or id(sub) not in inside or sub is module:
            raise ValueError(
                f"split part {part!r} of {component!r} is {type(sub).__name__}; expected a proper "
                f"submodule of {type(module).__name__}"
            )


def undo_split(split: list[tuple[nn.Module, SplitMovers]]) -> None:
    """Each split model forgets its movers (its contexts become no-ops); ``split`` is emptied."""
    for module, _ in split:
        off = getattr(module, "disable_omni_model_cpu_offload", None)
        if callable(off):
            off()
    split.clear()
