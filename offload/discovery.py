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
"""
from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

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
# An `if` whose test names this is diffusers' training path; the else branch is
# what runs in inference (and both run the blocks in the same order).
_CKPT_MARK = "gradient_checkpointing"


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


def resolve_path(root: nn.Module, dotted: str, *, what: str = "attribute") -> object:
    obj: object = root
    walked = []
    for part in dotted.split("."):
        walked.append(part)
        if not hasattr(obj, part):
            raise ValueError(
                f"{what} {dotted!r} not found on {type(root).__name__}: "
                f"{type(obj).__name__} has no attribute {part!r} (at {'.'.join(walked)!r})"
            )
        obj = getattr(obj, part)
    return obj


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


# --------------------------------------------------------------------------- forward source
@dataclass(frozen=True)
class _Cond:
    """The test of an enclosing ``if`` (``negate``: in its else branch), or with
    ``loop`` an enclosing loop over something other than a block list (its body
    runs zero or more times)."""

    test: ast.AST
    negate: bool = False
    loop: bool = False

    def __str__(self) -> str:
        if self.loop:
            node = self.test
            head = (f"while {ast.unparse(node.test)}" if isinstance(node, ast.While)
                    else f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}")
            return f"inside `{head}` (zero or more times)"
        src = ast.unparse(self.test)
        return f"not ({src})" if self.negate else src


@dataclass(frozen=True)
class _Use:
    """One reference to ``self.<path>`` in a forward, in source order."""

    path: tuple[str, ...]
    pos: int
    kind: str  # "loop" (iterated in order), "zip" (iterated with others), "call", "other"
    conds: tuple[_Cond, ...]  # tests of the enclosing ifs (training-path ifs excluded)
    loops: tuple[tuple[str, ...], ...]  # paths iterated by the enclosing for statements
    rank: int = 0  # zip: order of this list's first block call in the loop body
    src: str = ""
    part: ast.Slice | None = None  # loop over a slice of the list
    env: tuple[tuple[str, tuple[str, ...]], ...] = ()  # local aliases of self chains (for the slice bounds)


def _self_chain(node: ast.AST) -> tuple[str, ...] | None:
    """``self.a.b["k"]`` -> ("a", "b", "k"); None when not such a chain."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and isinstance(node.slice.value, str)):
            parts.append(node.slice.value)
            node = node.value
        else:
            break
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return tuple(reversed(parts))
    return None


def _is_call_of(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _is_ckpt_if(node: ast.AST) -> bool:
    return isinstance(node, (ast.If, ast.IfExp)) and _CKPT_MARK in ast.unparse(node.test)


def _function_ast(cls: type, name: str) -> ast.FunctionDef | None:
    fn = inspect.getattr_static(cls, name, None) if isinstance(cls, type) else None
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    if not inspect.isfunction(fn):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


class _UseCollector:
    """Walks a class's ``forward`` (inlining ``self.<method>()`` helpers) and
    records every ``self.<chain>`` reference with its conditions and loops."""

    MAX_INLINE = 4

    def __init__(self, cls: type):
        self.cls = cls
        self.uses: list[_Use] = []
        self._inlining: list[str] = []
        self.aliases: dict[str, tuple[str, ...]] = {}  # `blocks = self.blocks`

    def run(self, method: str = "forward") -> list[_Use]:
        fn = _function_ast(self.cls, method)
        if fn is not None:
            self._inlining.append(method)
            self._body(fn.body, (), ())
        return self.uses

    def _add(self, path, kind, conds, loops, rank=0, node=None, pos=None, part=None):
        src = ast.unparse(node) if node is not None else ".".join(path)
        pos = len(self.uses) if pos is None else pos
        env = tuple(self.aliases.items()) if part is not None else ()
        self.uses.append(_Use(path, pos, kind, conds, loops, rank, src, part, env))

    def _chain(self, node) -> tuple[str, ...] | None:
        """A ``self`` chain, or a local name bound to one."""
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return self.aliases[node.id]
        return _self_chain(node)

    def _body(self, stmts, conds, loops):
        for s in stmts:
            self._stmt(s, conds, loops)

    def _stmt(self, node, conds, loops):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return  # nested definitions: not executed here
        if _is_ckpt_if(node):
            self._body(node.orelse, conds, loops)
        elif isinstance(node, ast.If):
            self._expr(node.test, conds, loops)
            self._body(node.body, conds + (_Cond(node.test),), loops)
            self._body(node.orelse, conds + (_Cond(node.test, True),), loops)
        elif isinstance(node, ast.While):
            self._expr(node.test, conds, loops)
            self._body(node.body + node.orelse, conds + (_Cond(node, loop=True),), loops)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._for(node, conds, loops)
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and _self_chain(node.value) is not None):
            self.aliases[node.targets[0].id] = _self_chain(node.value)  # runs nothing by itself
        elif isinstance(node, ast.Try):
            self._body(node.body, conds, loops)
            for h in node.handlers:
                self._body(h.body, conds + (_Cond(ast.Name("an exception is raised")),), loops)
            self._body(node.orelse + node.finalbody, conds, loops)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    self._stmt(child, conds, loops)
                else:
                    self._expr(child, conds, loops)

    def _expr(self, node, conds, loops):
        if node is None:
            return
        if _is_ckpt_if(node):
            return self._expr(node.orelse, conds, loops)
        if isinstance(node, ast.IfExp):
            self._expr(node.test, conds, loops)
            self._expr(node.body, conds + (_Cond(node.test),), loops)
            return self._expr(node.orelse, conds + (_Cond(node.test, True),), loops)
        if isinstance(node, ast.Call):
            return self._call(node, conds, loops)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return self._comprehension(node, conds, loops)
        chain = _self_chain(node)
        if chain is None and isinstance(node, ast.Subscript):  # self.blocks[i]: name the whole expression
            chain = _self_chain(node.value)
            if chain is not None:
                self._add(chain, "other", conds, loops, node=node)
                return self._expr(node.slice, conds, loops)
        if chain is not None:
            return self._add(chain, "other", conds, loops, node=node)
        for child in ast.iter_child_nodes(node):
            self._expr(child, conds, loops)

    def _comprehension(self, node, conds, loops):
        inner = conds
        for gen in node.generators:
            self._expr(gen.iter, inner, loops)
            inner = inner + (_Cond(gen, loop=True),)
            for test in gen.ifs:
                self._expr(test, inner, loops)
        for part in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
            self._expr(part, inner, loops)

    def _call(self, node, conds, loops):
        if isinstance(node.func, ast.Name) and node.func.id == "len":
            return  # len(self.blocks) runs no block
        chain = _self_chain(node.func)
        if chain is not None and len(chain) == 1 and self._inline(chain[0], conds, loops):
            pass
        elif chain is not None:
            self._add(chain, "call", conds, loops, node=node.func)
        else:
            self._expr(node.func, conds, loops)
        for a in node.args:
            self._expr(a, conds, loops)
        for k in node.keywords:
            self._expr(k.value, conds, loops)

    def _inline(self, name, conds, loops) -> bool:
        if name in self._inlining or len(self._inlining) > self.MAX_INLINE:
            return False
        fn = _function_ast(self.cls, name)
        if fn is None:
            return False
        self._inlining.append(name)
        try:
            self._body(fn.body, conds, loops)
        finally:
            self._inlining.pop()
        return True

    def _for(self, node, conds, loops):
        it, target = node.iter, node.target
        if _is_call_of(it, "enumerate") and len(it.args) == 1:
            it = it.args[0]
            target = target.elts[1] if isinstance(target, ast.Tuple) and len(target.elts) == 2 else None
        chain = self._chain(it)
        sliced = isinstance(it, ast.Subscript) and isinstance(it.slice, ast.Slice) and self._chain(it.value)
        iterated: tuple[tuple[str, ...], ...] = ()
        if chain is not None:
            self._add(chain, "loop", conds, loops, node=it)
            iterated = (chain,)
        elif sliced:  # `for b in self.blocks[a:b]`: the bounds are evaluated against the model
            self._add(sliced, "loop", conds, loops, node=it, part=it.slice)
            iterated = (sliced,)
        else:
            iterated = self._zip(it, target, node.body, conds, loops)
        body_conds = conds
        if not iterated:  # a loop over data: what it calls may run zero or several times
            self._expr(node.iter, conds, loops)
            body_conds = conds + (_Cond(node, loop=True),)
        self._body(node.body, body_conds, loops + iterated)
        self._body(node.orelse, conds, loops)

    def _zip(self, it, target, body, conds, loops) -> tuple[tuple[str, ...], ...]:
        """``for a, b in zip(self.x, self.y)``: lists interleaved in the order their
        loop variables are first used in the body."""
        if not (_is_call_of(it, "zip") and isinstance(target, ast.Tuple) and len(target.elts) == len(it.args) >= 2):
            return ()
        chains = [_self_chain(a) for a in it.args]
        names = [t.id if isinstance(t, ast.Name) else None for t in target.elts]
        if None in chains or None in names:
            return ()
        first = _first_uses(body, set(names))
        if set(first) != set(names):
            return ()
        order = sorted(names, key=lambda n: first[n][0])
        pos = len(self.uses)
        for chain, name in zip(chains, names):
            # a loop variable called under an `if` may skip its block: a condition of that list
            self._add(chain, "zip", conds + first[name][1], loops, rank=order.index(name), node=it, pos=pos)
        return tuple(chains)


def _first_uses(body: list[ast.stmt], names: set[str]) -> dict[str, tuple[tuple[int, int], tuple[_Cond, ...]]]:
    """Source position of the first reference to each of ``names``, and the ``if``
    tests it sits under (training-path ifs skipped)."""
    seen: dict[str, tuple[tuple[int, int], tuple[_Cond, ...]]] = {}
    stack: list[tuple[ast.AST, tuple[_Cond, ...]]] = [(n, ()) for n in reversed(body)]
    while stack:
        node, conds = stack.pop()
        if _is_ckpt_if(node):
            rest = node.orelse if isinstance(node.orelse, list) else [node.orelse]
            stack.extend((n, conds) for n in reversed(rest))
            continue
        if isinstance(node, ast.Name) and node.id in names:
            pos = (node.lineno, node.col_offset)
            if node.id not in seen or pos < seen[node.id][0]:
                seen[node.id] = (pos, conds)
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, (ast.If, ast.IfExp)):
            branch = {id(c): _Cond(node.test) for c in _as_list(node.body)}
            branch.update({id(c): _Cond(node.test, True) for c in _as_list(node.orelse)})
            stack.extend((c, conds + ((branch[id(c)],) if id(c) in branch else ())) for c in reversed(children))
        else:
            stack.extend((c, conds) for c in reversed(children))
    return seen


def _as_list(x) -> list:
    return x if isinstance(x, list) else [x]


def _class_uses(cls: type, cache: dict) -> tuple[_Use, ...]:
    """The ``self`` references of ``cls.forward``, read once per discovery (``cache``)."""
    if cls not in cache:
        cache[cls] = tuple(_UseCollector(cls).run())
    return cache[cls]


# --------------------------------------------------------------------------- ordering
@dataclass(frozen=True)
class _Where:
    """Where a group runs, read from the forward sources down the module path."""

    key: tuple[tuple[int, int], ...]
    conds: tuple[str, ...]
    loops: tuple[tuple[str, ...], ...]  # absolute dotted paths of enclosing loops
    kind: str
    segments: tuple[tuple[tuple, tuple[int, ...]], ...] = ()  # (key, list indices) of sliced loops


_UNKNOWN = object()
_COMPARE = {
    ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}


_ARITH = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
          ast.FloorDiv: lambda a, b: a // b}


def _static(node: ast.AST, module: nn.Module, env: dict | None = None):
    """Value of an expression that reads only ``self`` and local aliases of its
    attributes (``env``): attributes, config, constant keys, ``len``, integer
    arithmetic, comparisons, and/or/not; ``_UNKNOWN`` for anything else (inputs,
    other calls). Reads attributes, runs no model code of its own."""
    try:
        return _static_value(node, module, env or {})
    except Exception:  # an expression this model cannot evaluate statically: treat as unknown
        return _UNKNOWN


def _static_value(node, module, env):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return module if node.id == "self" else env.get(node.id, _UNKNOWN)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        a, b = _static_value(node.left, module, env), _static_value(node.right, module, env)
        return _UNKNOWN if _UNKNOWN in (a, b) else _ARITH[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _static_value(node.operand, module, env)
        return _UNKNOWN if v is _UNKNOWN else -v
    if isinstance(node, (ast.Attribute, ast.Subscript)):
        base = _static_value(node.value, module, env)
        if base is _UNKNOWN:
            return _UNKNOWN
        if isinstance(node, ast.Attribute):
            return getattr(base, node.attr)
        key = _static_value(node.slice, module, env) if isinstance(node.slice, ast.Constant) else _UNKNOWN
        return _UNKNOWN if key is _UNKNOWN else base[key]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len" and len(node.args) == 1:
        arg = _static_value(node.args[0], module, env)
        return _UNKNOWN if arg is _UNKNOWN else len(arg)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        v = _static_value(node.operand, module, env)
        return _UNKNOWN if v is _UNKNOWN else not v
    if isinstance(node, ast.BoolOp):
        return _static_boolop(node, module, env)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        a, b = _static_value(node.left, module, env), _static_value(node.comparators[0], module, env)
        return _UNKNOWN if _UNKNOWN in (a, b) else _COMPARE[type(node.ops[0])](a, b)
    return _UNKNOWN


def _static_boolop(node: ast.BoolOp, module, env):
    values = [_static_value(v, module, env) for v in node.values]
    decisive = isinstance(node.op, ast.Or)  # Or: any true decides; And: any false decides
    if any(v is not _UNKNOWN and bool(v) is decisive for v in values):
        return decisive
    return _UNKNOWN if any(v is _UNKNOWN for v in values) else not decisive


def _truth(cond: _Cond, module: nn.Module) -> bool | None:
    if cond.loop:
        return None
    v = _static(cond.test, module)
    return None if v is _UNKNOWN else bool(v) != cond.negate


@dataclass(frozen=True)
class _Never:
    """A group the forward reaches only under conditions false for this model."""

    why: str


def _reachable(uses: list[_Use], module: nn.Module) -> list[tuple[_Use, tuple[_Cond, ...]]]:
    """Uses whose conditions are not statically false, with the conditions left unknown."""
    out = []
    for u in uses:
        truth = [_truth(c, module) for c in u.conds]
        if False not in truth:
            out.append((u, tuple(c for c, t in zip(u.conds, truth) if t is None)))
    return out


def _locate(root: nn.Module, path: str, cache: dict) -> _Where | _Never | str:
    """Where the list ``path`` is iterated (or the lone block called); a str says why unknown."""
    parts, module, prefix = tuple(path.split(".")), root, ()
    key, conds, loops = (), (), ()
    while True:
        cls = type(module)
        uses = [u for u in _class_uses(cls, cache) if u.path == parts[: len(u.path)]]
        if not uses:
            return f"{cls.__name__}.forward does not use self.{'.'.join(parts)} (or a module above it)"
        live = _reachable(uses, module)
        if not live:
            false = "; ".join(sorted({" and ".join(map(str, u.conds)) for u in uses}))
            return _Never(f"{cls.__name__}.forward uses self.{'.'.join(parts)} only when {false}, "
                          "which is false for this model")
        longest = max(len(u.path) for u, _ in live)
        live = [(u, c) for u, c in live if len(u.path) == longest]
        if longest == len(parts) and all(u.kind == "loop" for u, _ in live) and (
                len(live) > 1 or live[0][0].part is not None):
            return _segments(module, parts, live, _Where(key, conds, tuple(loops), "loop"), prefix)
        if len(live) > 1:
            srcs = "; ".join(sorted({u.src for u, _ in live}))
            return f"{cls.__name__}.forward uses self.{'.'.join(parts[:longest])} {len(live)} times ({srcs})"
        u, unknown = live[0]
        key += ((u.pos, u.rank),)
        conds += tuple(f"{cls.__name__}: {c}" for c in unknown)
        loops += tuple(".".join(prefix + lp) for lp in u.loops)
        if longest == len(parts):
            if u.kind != "other" or conds:  # under a condition on the inputs: left resident whatever the use
                return _Where(key, conds, loops, u.kind)
            inside = f" inside the loop over {loops[-1]!r}" if loops else ""
            return f"{cls.__name__}.forward uses self.{'.'.join(parts)} as `{u.src}`{inside}, not in a plain for loop"
        if u.kind != "call":
            return f"{cls.__name__}.forward uses self.{'.'.join(parts[:longest])} as `{u.src}`, not as a call"
        module = resolve_path(module, ".".join(parts[:longest]))
        prefix, parts = prefix + parts[:longest], parts[longest:]


def _blocks(n: int) -> str:
    return f"{n} block{'' if n == 1 else 's'}"


def _segments(module: nn.Module, parts: tuple, live: list, above: _Where, prefix: tuple) -> _Where | str:
    """Loops over slices of one list (``blocks[:k]``, then ``blocks[k:]``): each
    slice is evaluated against the model; together they must run every block
    exactly once, each slice in index order."""
    cls, path = type(module).__name__, ".".join(parts)
    n = len(resolve_path(module, path))
    segs, conds, loops = [], list(above.conds), list(above.loops)
    for u, unknown in live:
        part = slice(None) if u.part is None else _static_slice(u.part, module, u.env)
        if part is None or part.step not in (None, 1):
            return f"{cls}.forward iterates self.{path} as `{u.src}`, a slice it cannot evaluate in index order"
        segs.append((above.key + ((u.pos, 0),), tuple(range(n)[part])))
        conds += [f"{cls}: {c}" for c in unknown]
        loops += [".".join(prefix + lp) for lp in u.loops]
    if sorted(i for _, idx in segs for i in idx) != list(range(n)):
        srcs = ", ".join(f"`{u.src}`" for u, _ in live)
        return f"{cls}.forward iterates self.{path} as {srcs}, which runs some of its blocks zero or several times"
    return _Where(above.key, tuple(conds), tuple(loops), "loop", tuple(segs))


def _static_slice(node: ast.Slice, module: nn.Module, env: tuple) -> slice | None:
    scope = {name: resolve_path(module, ".".join(chain)) for name, chain in env}
    bounds = [None if b is None else _static(b, module, scope) for b in (node.lower, node.upper, node.step)]
    if any(b is _UNKNOWN or not (b is None or isinstance(b, int)) for b in bounds):
        return None
    return slice(*bounds)


def _split_segments(groups: list[Group], where: dict) -> list[Group]:
    """A list run as several sliced loops becomes one group per slice, each with its place."""
    out = []
    for g in groups:
        w = where[g.path]
        if not (isinstance(w, _Where) and w.segments):
            out.append(g)
            continue
        at = dict(zip(g.indices, g.blocks))
        for key, idx in w.segments:
            sub = Group(f"{g.path}[{idx[0]}:{idx[-1] + 1}]" if idx else f"{g.path}[]",
                        tuple(at[i] for i in idx if i in at), tuple(i for i in idx if i in at))
            where[sub.path] = _Where(key, w.conds, w.loops, "loop")
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
    cond = [g for g in groups if isinstance(where[g.path], _Where) and where[g.path].conds]
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


def _drop_never(root: nn.Module, groups: list[Group], where: dict) -> list[Group]:
    never = [g for g in groups if isinstance(where[g.path], _Never)]
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
    cache: dict[type, tuple[_Use, ...]] = {}
    where = {g.path: _locate(root, g.path, cache) for g in groups}
    several = len(groups) > 1  # one list alone runs in index order, however forward reaches it
    groups = _drop_conditional(root, _split_segments(_drop_never(root, groups, where), where), where)
    known = {p: w for p, w in where.items() if isinstance(w, _Where)}
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
