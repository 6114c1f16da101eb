"""Component discovery for module (model-level) offload.

Which modules of a pipeline are DiTs, encoders, VAEs and small resident
modules. Pure: nothing here moves, copies or changes a tensor.

Precedence:

1. The pipeline declares its components (it subclasses
   :class:`SupportsComponentDiscovery`, or its class carries any of the four
   attributes below). Entries are dotted attribute paths from the pipeline::

       class MyPipeline(SupportsComponentDiscovery):
           _dit_modules = ["transformer"]
           _encoder_modules = ["text_encoder", "vision.model"]
           _vae_modules = ["vae"]
           _resident_modules = ["transformer.rope"]

   ``_dit_modules`` and ``_encoder_modules`` are both required (mutual
   exclusion needs both sides; an empty list is a valid declaration).
   ``_vae_modules`` and ``_resident_modules`` default to empty.
2. Else diffusers pipeline conventions (:data:`DIFFUSERS_CONVENTIONS`).

An entry whose attribute exists but is ``None`` (an optional component that
is not loaded, e.g. Wan2.2's ``transformer_2`` in a 5B checkpoint) is
skipped. An entry that does not exist, or is neither ``None`` nor an
``nn.Module``, raises ``ValueError`` naming the path and the pipeline class.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from .discovery_forward import resolve_path

__all__ = [
    "Component",
    "Components",
    "SupportsComponentDiscovery",
    "DIFFUSERS_CONVENTIONS",
    "DECLARED_ATTRS",
    "discover_components",
]

# component kind -> pipeline class attribute that declares it
DECLARED_ATTRS = {
    "dit": "_dit_modules",
    "text_encoder": "_encoder_modules",
    "vae": "_vae_modules",
    "resident": "_resident_modules",
}
REQUIRED_KINDS = ("dit", "text_encoder")

# component kind -> attribute names diffusers pipelines use for it
DIFFUSERS_CONVENTIONS = {
    "dit": ("transformer", "transformer_2", "unet", "prior"),
    "text_encoder": ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4", "image_encoder"),
    "vae": ("vae",),
    "resident": (),
}


class SupportsComponentDiscovery:
    """Marker base for pipelines that declare their components.

    Subclass it and set the class attributes (lists of dotted attribute paths
    from the pipeline). ``_dit_modules`` and ``_encoder_modules`` are
    required; leaving either at ``None`` is an error at offload time.
    ``_resident_modules`` are small modules that always stay on the device,
    even when they live inside an offloaded component (their tensors are left
    out of that component's host image).
    """

    _dit_modules: ClassVar[Sequence[str] | None] = None
    _encoder_modules: ClassVar[Sequence[str] | None] = None
    _vae_modules: ClassVar[Sequence[str] | None] = None
    _resident_modules: ClassVar[Sequence[str] | None] = None


@dataclass(frozen=True)
class Component:
    """One discovered component: its dotted path on the pipeline, kind and module."""

    name: str
    kind: str  # "dit" | "text_encoder" | "vae" | "resident"
    module: nn.Module


@dataclass(frozen=True)
class Components:
    """Every component of a pipeline, in kind order (dit, text_encoder, vae, resident)."""

    pipeline: str  # class name, for messages
    source: str  # "SupportsComponentDiscovery" | "diffusers conventions"
    items: tuple[Component, ...]

    def of_kind(self, kind: str) -> list[Component]:
        return [c for c in self.items if c.kind == kind]

    def names(self) -> list[str]:
        return [c.name for c in self.items]


def declares_components(pipe: Any) -> bool:
    """True when the pipeline opts into declared discovery."""
    if isinstance(pipe, SupportsComponentDiscovery):
        return True
    cls = type(pipe)
    return any(getattr(cls, attr, None) is not None for attr in DECLARED_ATTRS.values())


def _declared_paths(pipe: Any) -> dict[str, tuple[str, ...]]:
    cls = type(pipe).__name__
    out: dict[str, tuple[str, ...]] = {}
    for kind, attr in DECLARED_ATTRS.items():
        raw = getattr(type(pipe), attr, None)
        if raw is None:
            if kind in REQUIRED_KINDS:
                other = DECLARED_ATTRS[REQUIRED_KINDS[1] if kind == REQUIRED_KINDS[0] else REQUIRED_KINDS[0]]
                raise ValueError(
                    f"{cls}.{attr} is missing: a pipeline that declares its components "
                    f"(SupportsComponentDiscovery) must set both {attr} and {other}, since module "
                    "offload keeps DiTs and encoders mutually exclusive; use [] for a pipeline "
                    "without that kind"
                )
            raw = ()
        if isinstance(raw, str) or not isinstance(raw, (list, tuple)):
            raise ValueError(f"{cls}.{attr}={raw!r} is not allowed; expected a list of dotted attribute paths")
        for i, path in enumerate(raw):
            if not isinstance(path, str) or not path or path.startswith(".") or path.endswith(".") or ".." in path:
                raise ValueError(f"{cls}.{attr}[{i}]={path!r} is not allowed; expected a dotted attribute path")
        out[kind] = tuple(raw)
    return out


def _resolve(pipe: Any, kind: str, path: str, source: str) -> nn.Module | None:
    cls = type(pipe).__name__
    where = f"{cls}.{DECLARED_ATTRS[kind]}" if source != "diffusers conventions" else f"{cls} ({source})"
    obj = resolve_path(pipe, path, what=f"component {path!r} listed in {where}:")
    if obj is None:
        return None
    if not isinstance(obj, nn.Module):
        raise ValueError(
            f"component {path!r} listed in {where} is a {type(obj).__name__}, not a torch.nn.Module; "
            "every listed component must be a module (or None when not loaded)"
        )
    return obj


def discover_components(pipe: Any) -> Components:
    """Return every component of ``pipe`` (see the module docstring for the rules).

    Raises ``ValueError`` for a missing declaration, a path that does not
    resolve, a non-module entry, the same module listed twice, a component
    inside another component (resident modules may lie inside others), or a
    pipeline where neither a DiT nor an encoder is found.
    """
    cls = type(pipe).__name__
    if declares_components(pipe):
        source = "SupportsComponentDiscovery"
        paths = _declared_paths(pipe)
    else:
        source = "diffusers conventions"
        paths = {k: tuple(n for n in names if hasattr(pipe, n)) for k, names in DIFFUSERS_CONVENTIONS.items()}
    items: list[Component] = []
    seen: dict[int, str] = {}
    for kind, names in paths.items():
        for path in names:
            module = _resolve(pipe, kind, path, source)
            if module is None:
                continue
            if id(module) in seen:
                raise ValueError(
                    f"component {path!r} of {cls} is the same module as {seen[id(module)]!r}; "
                    "list each module once"
                )
            seen[id(module)] = path
            items.append(Component(path, kind, module))
    _check_nesting(cls, items)
    if not any(c.kind in ("dit", "text_encoder") for c in items):
        hint = (
            f"names tried: {', '.join(DIFFUSERS_CONVENTIONS['dit'] + DIFFUSERS_CONVENTIONS['text_encoder'])}; "
            "declare the components with SupportsComponentDiscovery"
            if source == "diffusers conventions"
            else "the declared lists resolve to no module"
        )
        raise ValueError(f"no DiT or encoder component found on {cls} ({source}); {hint}")
    return Components(cls, source, tuple(items))


def _check_nesting(cls: str, items: list[Component]) -> None:
    inside: dict[int, list[str]] = {}
    for c in items:
        for sub_name, sub in c.module.named_modules():
            if sub is not c.module:
                inside.setdefault(id(sub), []).append(c.name)
    for c in items:
        owners = inside.get(id(c.module), [])
        if not owners:
            continue
        if c.kind == "resident":
            continue  # a resident module inside a component stays on the device
        raise ValueError(
            f"component {c.name!r} of {cls} lies inside component {owners[0]!r}; components must be "
            "disjoint (only _resident_modules may lie inside another component)"
        )
