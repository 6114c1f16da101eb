"""Discovery: which modules of a DiT are streamed blocks, in execution order.

Pure: nothing here moves, copies or changes a tensor.

Precedence:

1. an explicit :class:`OffloadPlan` (containers, or single blocks, in execution
   order; :func:`trace_plan` records one from a real forward);
2. the DiT class attribute ``_layerwise_offload_blocks_attrs`` (dotted
   container names, in execution order);
3. automatic: candidate blocks are, at any depth, the outermost modules whose
   class is named in diffusers' ``_repeated_blocks``, or in
   ``_no_split_modules`` (classes with two or more instances), or the
   block-like items of a ``ModuleList`` named like a known block container
   (:data:`KNOWN_BLOCK_CONTAINERS`). Candidates are grouped by the list they
   are items of (blocks run in index order inside a list). With several lists
   their order is read from the ``forward`` source (see
   :func:`order_groups`); where it cannot be read exactly, discovery raises
   :class:`BlockOrderError`, naming the lists and pointing to
   :func:`trace_plan` and :class:`OffloadPlan`. A list that runs only under
   a condition on the inputs (or in a loop over data) may run zero or several
   times in a step: it is not streamed and stays resident, with one warning
   that says so and how to stream it. Nothing is skipped silently.

Reading the forward sources (where each list runs, under which conditions) is
:mod:`.discovery_forward`; the order and the errors are decided here.
"""
from __future__ import annotations

import functools
import itertools
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .discovery_forward import Never, Where, indexed_items, locate, resolve_path

# Container names diffusers DiTs use for their repeated blocks; found at any
# depth (``token_refiner.refiner_blocks``), as the name of the list that holds
# the blocks.
KNOWN_BLOCK_CONTAINERS = (
    "transformer_blocks",
    "single_transformer_blocks",
    "joint_transformer_blocks",
    "temporal_transformer_blocks",
    "blocks",
    "layers",
    "double_blocks",
    "single_blocks",
    "joint_blocks",
    "transformer_layers",
    "double_stream_blocks",
    "single_stream_blocks",
    "noise_refiner",
    "context_refiner",
    "siglip_refiner",
    "refiner_blocks",
    "vace_blocks",
    "text_transformer_blocks",
    "visual_transformer_blocks",
    "txt_mode_blocks",
    "perceiver_cross_attention",
)

MIN_STREAMED_BLOCKS = 2
_LISTS = (nn.ModuleList, nn.Sequential)


@dataclass(frozen=True)
class OffloadPlan:
    """Explicit block containers or single blocks (dotted paths) in execution order.

    ``OffloadPlan(["transformer_blocks", "single_transformer_blocks"])`` streams
    two lists one after the other; ``OffloadPlan(["blocks.0", "vace_blocks.0",
    "blocks.1"])`` gives an explicit block order (a path to a single module is
    one block). ``not_run`` is informational: candidate blocks a
    :func:`trace_plan` forward did not run (they are not streamed).
    """

    block_containers: tuple[str, ...] = field(default=())
    not_run: tuple[str, ...] = field(default=())

    def __post_init__(self):
        for key in ("block_containers", "not_run"):
            value = getattr(self, key)
            if isinstance(value, str):
                raise TypeError(f"OffloadPlan.{key}={value!r} must be a list of dotted names, not one string")
            names = tuple(value)
            for name in names:
                if not isinstance(name, str) or not name:
                    raise TypeError(f"OffloadPlan.{key} item {name!r} must be a non-empty string")
            object.__setattr__(self, key, names)
        if not self.block_containers:
            raise ValueError("OffloadPlan.block_containers=() is empty; name at least one container")


@dataclass(frozen=True)
class Block:
    """One streamable block: its dotted name, index in execution order and module."""

    index: int
    name: str
    module: nn.Module


class BlockOrderError(ValueError):
    """Discovery found blocks whose execution order (or whether they run) it cannot know."""


# --------------------------------------------------------------------------- explicit containers
def _declared_containers(module: nn.Module, plan: OffloadPlan | None) -> tuple[tuple[str, ...], str] | None:
    if plan is not None:
        if not isinstance(plan, OffloadPlan):
            raise TypeError(f"plan={plan!r} must be an OffloadPlan or None")
        return plan.block_containers, "OffloadPlan"
    declared = getattr(type(module), "_layerwise_offload_blocks_attrs", None)
    if declared is None:
        return None
    if isinstance(declared, str) or not declared:
        raise ValueError(
            f"{type(module).__name__}._layerwise_offload_blocks_attrs={declared!r} must be a "
            "non-empty list of dotted container names"
        )
    return tuple(declared), "_layerwise_offload_blocks_attrs"


def _container_items(module: nn.Module, names: tuple[str, ...], source: str) -> list[tuple[str, object]]:
    items: list[tuple[str, object]] = []
    for cname in names:
        container = resolve_path(module, cname, what=f"block container (from {source})")
        if isinstance(container, nn.Module) and not isinstance(container, _LISTS):
            items.append((cname, container))
        elif isinstance(container, (*_LISTS, list, tuple)):
            items.extend((f"{cname}.{i}", m) for i, m in enumerate(container))
        else:
            raise ValueError(
                f"block container {cname!r} (from {source}) is a {type(container).__name__}; "
                "expected an nn.ModuleList, nn.Sequential, list of modules or a single nn.Module"
            )
    return items


# --------------------------------------------------------------------------- automatic candidates
def _declared_names(cls: type, attr: str) -> set[str]:
    names = getattr(cls, attr, None) or ()
    return {n for n in names if isinstance(n, str)}


def _block_like(m: nn.Module) -> bool:
    """A model's own block class with weights (not a bare torch.nn layer or list)."""
    return not type(m).__module__.startswith("torch.") and next(m.parameters(), None) is not None


@dataclass(frozen=True)
class Candidate:
    """A module automatic discovery would stream, and why."""

    name: str
    module: nn.Module
    reason: str


def _tier(m: nn.Module, parent_path: str, parent: nn.Module, decl: tuple) -> int | None:
    """0: a ``_repeated_blocks`` class; 1: a repeated ``_no_split_modules`` class;
    2: a block-like item of a list with a known container name; None: not a candidate."""
    repeated, no_split, counts = decl
    kind = type(m).__name__
    if kind in repeated:
        return 0
    if kind in no_split and counts[kind] >= 2:
        return 1
    if isinstance(parent, _LISTS) and parent_path.rpartition(".")[2] in KNOWN_BLOCK_CONTAINERS and _block_like(m):
        return 2
    return None


_REASONS = ("_repeated_blocks", "_no_split_modules", "container name")


def _overlaps(path: str, taken: list[str]) -> bool:
    return any(path == t or path.startswith(t + ".") or t.startswith(path + ".") for t in taken)


def find_candidates(root: nn.Module) -> list[Candidate]:
    """Candidate blocks of ``root`` at any depth, in registration order (pure).

    diffusers' declarations win over names: ``_repeated_blocks`` modules first
    (the outermost where they nest), then repeated ``_no_split_modules``
    modules, then items of known container lists, each taken only where it
    neither contains nor lies inside a module already taken.
    """
    cls = type(root)
    modules = dict(root.named_modules())
    decl = (_declared_names(cls, "_repeated_blocks"), _declared_names(cls, "_no_split_modules"),
            Counter(type(m).__name__ for m in modules.values()))
    tiers: list[list[str]] = [[], [], []]
    for path, m in modules.items():
        if path:
            parent_path = path.rpartition(".")[0]
            tier = _tier(m, parent_path, modules[parent_path], decl)
            if tier is not None:
                tiers[tier].append(path)
    taken: list[str] = []
    reason: dict[str, str] = {}
    for tier, paths in enumerate(tiers):
        chosen = [p for p in paths if not _overlaps(p, taken)]
        chosen = [p for p in chosen if not any(p.startswith(q + ".") for q in chosen)]  # outermost of a tier
        taken.extend(chosen)
        reason.update((p, _REASONS[tier]) for p in chosen)
    return [Candidate(p, modules[p], reason[p]) for p in modules if p in reason]


@dataclass(frozen=True)
class Group:
    """Candidates that are items of one list (or one lone candidate), in index order."""

    path: str
    blocks: tuple[Candidate, ...]
    indices: tuple[int, ...] = ()  # their positions in the list


def _list_position(modules: dict, path: str) -> tuple[str, int]:
    """(deepest list the module is an item of, or itself; index there)."""
    parts = path.split(".")
    for k in range(len(parts) - 1, 0, -1):
        if isinstance(modules[".".join(parts[:k])], _LISTS) and parts[k].isdigit():
            return ".".join(parts[:k]), int(parts[k])
    return path, 0


def group_candidates(root: nn.Module, candidates: list[Candidate]) -> list[Group]:
    modules = dict(root.named_modules())
    slots: dict[str, dict[int, Candidate]] = {}
    for c in candidates:
        gpath, index = _list_position(modules, c.name)
        items = slots.setdefault(gpath, {})
        if index in items:
            raise BlockOrderError(
                f"blocks {items[index].name!r} and {c.name!r} of {type(root).__name__} lie in the same item of "
                f"{gpath!r}; their order cannot be known. Call weightstream.trace_plan(model, *inputs) once "
                "or pass an OffloadPlan naming the blocks in execution order"
            )
        items[index] = c
    return [Group(g, tuple(items[i] for i in sorted(items)), tuple(sorted(items))) for g, items in slots.items()]


# --------------------------------------------------------------------------- ordering
def _blocks(n: int) -> str:
    return f"{n} block{'' if n == 1 else 's'}"


def _split_segments(groups: list[Group], where: dict) -> list[Group]:
    """A list run as several sliced loops becomes one group per slice, each with its place."""
    out = []
    for g in groups:
        w = where[g.path]
        if not (isinstance(w, Where) and w.segments):
            out.append(g)
            continue
        at = dict(zip(g.indices, g.blocks))
        for key, idx in w.segments:
            sub = Group(f"{g.path}[{idx[0]}:{idx[-1] + 1}]" if idx else f"{g.path}[]",
                        tuple(at[i] for i in idx if i in at), tuple(i for i in idx if i in at))
            where[sub.path] = Where(key, w.conds, w.loops, "loop")
            if sub.blocks:
                out.append(sub)
    return out


def _describe(groups: list[Group]) -> str:
    return ", ".join(f"{g.path!r} ({_blocks(len(g.blocks))})" for g in groups)


def _hint(root: nn.Module) -> str:
    return (f"Call weightstream.trace_plan(model, *inputs, **kwargs) once with the inputs you will run "
            f"(it records the real order from one forward), or pass OffloadPlan([...]) naming the "
            f"containers or blocks of {type(root).__name__} in execution order")


def _drop_conditional(root: nn.Module, groups: list[Group], where: dict) -> list[Group]:
    """Lists that run only under a condition on the inputs (or inside a loop over
    data) are left resident, with one warning that says why and how to stream
    them; when nothing unconditional is left, that explanation is an error."""
    cond = [g for g in groups if isinstance(where[g.path], Where) and where[g.path].conds]
    if not cond:
        return groups
    what = "; ".join(f"{g.path!r} ({_blocks(len(g.blocks))}) only when {' and '.join(where[g.path].conds)}"
                     for g in cond)
    why = (f"{type(root).__name__} runs {what}. A step where the condition is false runs those blocks zero times "
           f"(a loop over data: zero or several times), and layerwise offload needs every streamed block to run "
           f"once per step, in discovery order")
    rest = [g for g in groups if g not in cond]
    if not rest:
        raise BlockOrderError(f"{why}. {_hint(root)}; trace_plan streams the blocks that ran and leaves the others "
                              "resident")
    warnings.warn(f"{why}: they are not streamed and stay resident on the device. To stream them too, call "
                  f"weightstream.trace_plan(model, *inputs, **kwargs) with inputs that run them, or pass an "
                  f"OffloadPlan naming them in execution order (every later call must then run them once)",
                  stacklevel=5)
    return rest


def _drop_indexed(root: nn.Module, groups: list[Group], cache: dict) -> list[Group]:
    """Items a forward reads by a constant index outside the loop (DiTTransformer2DModel reads
    ``self.transformer_blocks[0].norm1.emb`` after it) would be read while their weights are in
    the host store: they are not streamed and stay resident (one warning). Pure."""
    out = []
    for g in groups:
        read = indexed_items(root, g.path, cache) if g.indices else {}
        n = len(g.indices)
        keep = [(c, i) for c, i in zip(g.blocks, g.indices) if i not in read and i - n not in read]
        if len(keep) < len(g.blocks):
            left = [(c.name, read.get(i, read.get(i - n))) for c, i in zip(g.blocks, g.indices) if (c, i) not in keep]
            srcs = sorted({src for _, src in left})
            warnings.warn(f"{type(root).__name__}.forward reads {', '.join(srcs)} outside the loop over "
                          f"{g.path!r}: {', '.join(name for name, _ in left)} stay resident on the device (not streamed)",
                          stacklevel=5)
            g = Group(g.path, tuple(c for c, _ in keep), tuple(i for _, i in keep))
        if g.blocks:
            out.append(g)
    return out


def _drop_never(root: nn.Module, groups: list[Group], where: dict) -> list[Group]:
    never = [g for g in groups if isinstance(where[g.path], Never)]
    if never:
        warnings.warn(
            f"{type(root).__name__}: {_describe(never)} never run with this configuration "
            f"({'; '.join(where[g.path].why for g in never)}); they are not streamed and stay resident",
            stacklevel=5,
        )
    return [g for g in groups if g not in never]


def order_groups(root: nn.Module, groups: list[Group]) -> list[Candidate]:
    """Blocks of ``groups`` in execution order, read from the forward sources.

    Exact for what it accepts: every list is iterated by exactly one plain
    ``for`` (or ``enumerate``) over ``self.<path>`` (or a local alias of it),
    or by loops over slices of it whose bounds evaluate against the model and
    that together run each block once, or is reached through exactly one call
    of the submodule above it; lists iterated together by one
    ``zip`` are interleaved in the order the body first names their loop
    variables. ``if`` tests that read only ``self`` (config, attributes,
    ``len``) are evaluated: a list reached only under a false one never runs
    and is left resident (one warning). A list reached only under a test of
    an input, or inside a loop over data, may run zero or several times in a
    step: it is left resident with one warning that explains it (an error
    when no other list is left). Anything else (a list indexed inside
    another list's loop, used twice) raises :class:`BlockOrderError`.
    """
    cache: dict[type, tuple] = {}  # each class's forward is read once (see locate)
    where = {g.path: locate(root, g.path, cache) for g in groups}
    several = len(groups) > 1  # one list alone runs in index order, however forward reaches it
    groups = _drop_conditional(root, _split_segments(_drop_never(root, groups, where), where), where)
    groups = _drop_indexed(root, groups, cache)
    known = {p: w for p, w in where.items() if isinstance(w, Where)}
    if not several:
        return list(groups[0].blocks) if groups else []
    unknown = [f"{g.path!r}: {where[g.path]}" for g in groups if isinstance(where[g.path], str)]
    for p, w in ((g.path, known[g.path]) for g in groups if g.path in known):
        inside = [q for q in w.loops
                  if any(q == g.path or g.path.startswith((q + ".", q + "[")) for g in groups if g.path != p)]
        if inside:
            unknown.append(f"{p!r} runs inside the loop over {inside[0]!r} (interleaved)")
    if unknown:
        raise BlockOrderError(
            f"cannot tell the execution order of the blocks of {type(root).__name__} (found {_describe(groups)}): "
            f"{'; '.join(unknown)}. {_hint(root)}"
        )
    ordered = sorted(groups, key=lambda g: known[g.path].key)
    # lists of one zip share their key but for the last rank: interleave them
    same_loop = itertools.groupby(ordered, key=lambda g: known[g.path].key[:-1] + (known[g.path].key[-1][0],))
    return [c for _, zipped in same_loop for c in _interleave(root, list(zipped))]


def _interleave(root: nn.Module, zipped: list[Group]) -> list[Candidate]:
    if len(zipped) == 1:
        return list(zipped[0].blocks)
    lengths = {len(g.blocks) for g in zipped}
    if len(lengths) != 1:
        raise BlockOrderError(
            f"{type(root).__name__} zips {_describe(zipped)} of different lengths: zip stops at the shortest, "
            f"so some blocks never run. {_hint(root)}"
        )
    return [c for row in zip(*(g.blocks for g in zipped)) for c in row]


# --------------------------------------------------------------------------- public
def _auto_items(module: nn.Module) -> list[tuple[str, nn.Module]]:
    candidates = find_candidates(module)
    if not candidates:
        raise ValueError(
            f"no block containers found on {type(module).__name__}: no module of its _repeated_blocks / "
            f"_no_split_modules classes and no list named {', '.join(KNOWN_BLOCK_CONTAINERS)} holds blocks; "
            "declare _layerwise_offload_blocks_attrs on the class or pass an OffloadPlan"
        )
    blocks = order_groups(module, group_candidates(module, candidates))
    return [(c.name, c.module) for c in blocks]


def discover_blocks(module: nn.Module, plan: OffloadPlan | None = None) -> list[Block]:
    """Return the streamable blocks of ``module`` in execution order.

    Raises ``ValueError`` for a named container that does not exist, an item
    that is not an ``nn.Module``, fewer than two blocks, a block claimed
    twice (the same module in two containers, or one block inside another),
    and :class:`BlockOrderError` (a ``ValueError``) where automatic discovery
    cannot know the order of the blocks it found, or whether they run.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    declared = _declared_containers(module, plan)
    if declared is not None:
        names, source = declared
        items = _container_items(module, names, source)
    else:
        items = _auto_items(module)
        names = tuple(dict.fromkeys(n.rpartition(".")[0] or n for n, _ in items))
    return _checked_blocks(items, names)


def _checked_blocks(items: list[tuple[str, object]], names: tuple[str, ...]) -> list[Block]:
    blocks: list[Block] = []
    owner: dict[int, str] = {}
    for name, item in items:
        if not isinstance(item, nn.Module):
            raise ValueError(
                f"block {name!r} is a {type(item).__name__}, not an nn.Module; every item of a "
                "block container must be an executable module"
            )
        if id(item) in owner:
            raise ValueError(f"block {name!r} is claimed twice: it is the same module as {owner[id(item)]!r}")
        owner[id(item)] = name
        blocks.append(Block(index=len(blocks), name=name, module=item))
    for b in blocks:
        for sub in b.module.modules():
            if sub is not b.module and id(sub) in owner:
                raise ValueError(f"block {owner[id(sub)]!r} is claimed twice: it lies inside block {b.name!r}")
    if len(blocks) < MIN_STREAMED_BLOCKS:
        raise ValueError(
            f"found {len(blocks)} streamable block(s) in {', '.join(names)}; layerwise offload needs "
            f"at least {MIN_STREAMED_BLOCKS}"
        )
    return blocks


def trace_plan(model: nn.Module, *args, **kwargs) -> OffloadPlan:
    """Run ONE forward of ``model(*args, **kwargs)`` (under ``torch.no_grad``)
    and return an :class:`OffloadPlan` of the candidate blocks in the order
    they ran.

    Forward-pre-hooks on the candidates (see :func:`find_candidates`) record
    the order; they are removed afterwards, whatever happens. Nothing is moved
    or changed. A candidate the forward did not run is left out of the plan
    (it is not streamed, so it works whichever branch runs later) and named in
    ``plan.not_run`` and in one warning. A candidate that runs more than once
    in the forward raises ``ValueError``: a streamed block runs once per step.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    candidates = find_candidates(model)
    if not candidates:
        raise ValueError(f"trace_plan found no candidate blocks on {type(model).__name__}; pass an OffloadPlan")
    ran: list[str] = []
    handles = [c.module.register_forward_pre_hook(functools.partial(_record, ran, c.name)) for c in candidates]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return _traced(model, candidates, ran)


def _record(ran: list[str], name: str, module, args) -> None:
    ran.append(name)


def _traced(model: nn.Module, candidates: list[Candidate], ran: list[str]) -> OffloadPlan:
    twice = [f"{n!r} ({c} times)" for n, c in Counter(ran).items() if c > 1]
    if twice:
        raise ValueError(
            f"trace_plan: blocks of {type(model).__name__} ran more than once in one forward: "
            f"{', '.join(twice)}; layerwise offload streams each block once per step. Pass an OffloadPlan "
            "naming only blocks that run once"
        )
    not_run = tuple(c.name for c in candidates if c.name not in set(ran))
    if not ran:
        raise ValueError(f"trace_plan: none of the {len(candidates)} candidate blocks of {type(model).__name__} ran")
    if not_run:
        warnings.warn(
            f"trace_plan: {len(not_run)} candidate block(s) of {type(model).__name__} did not run in the traced "
            f"forward and will not be streamed (they stay resident): {', '.join(not_run)}",
            stacklevel=3,
        )
    return OffloadPlan(tuple(ran), not_run=not_run)
