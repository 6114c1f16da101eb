"""What a module's ``forward`` does with ``self.<path>``, read from its source.

The reading half of automatic block ordering (:mod:`.discovery` holds the
policy): :func:`locate` says where a list of blocks (or a lone block) is
reached, down the module path, as a :class:`Where` (its place in source order,
the conditions on the inputs it runs under, the loops around it), a
:class:`Never` (only under tests that are false for this model) or a string
that says why it cannot be read. Pure: it parses source and reads attributes;
it runs no model code and moves no tensor.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from torch import nn


# An `if` whose test names this is diffusers' training path; the else branch is
# what runs in inference (and both run the blocks in the same order).
_CKPT_MARK = "gradient_checkpointing"


def resolve_path(root: nn.Module, dotted: str, *, what: str = "attribute") -> object:
    """``root.<dotted>`` (plans, class declarations, ``self`` chains of a forward); a missing
    part is a ``ValueError`` naming the path, where it broke and (``what``) where it came from."""
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


def _indexed_base(node: ast.AST) -> ast.Subscript | None:
    """``x[<int>].a.b`` -> the ``x[<int>]`` node (a constant index, negative too); else None."""
    while isinstance(node, ast.Attribute):
        node = node.value
    if not isinstance(node, ast.Subscript):
        return None
    index = node.slice
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
        index = index.operand
    ok = isinstance(index, ast.Constant) and isinstance(index.value, int) and not isinstance(index.value, bool)
    return node if ok else None


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

    def _add(self, path, kind, conds, loops, rank=0, node=None, pos=None, part=None, called=False):
        src = (ast.unparse(node) if node is not None else ".".join(path)) + ("(...)" if called else "")
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
        elif (indexed := _indexed_base(node.func)) is not None and self._chain(indexed.value) is not None:
            # self.blocks[0].norm1.emb(...): a call into one item of a list (its weights are read)
            self._add(self._chain(indexed.value), "other", conds, loops, node=node.func, called=True)
            self._expr(indexed.slice, conds, loops)
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


def indexed_items(root: nn.Module, path: str, cache: dict) -> dict[int, str]:
    """Items of the list ``path`` whose submodules its owner's ``forward`` calls by a constant
    index, outside any loop over the list (``self.transformer_blocks[0].norm1.emb(...)`` after
    the loop: diffusers' DiTTransformer2DModel; reading an attribute, such as
    ``self.layers[0].self_attn.processor``, runs nothing): index -> the source that calls it."""
    owner_path, _, name = path.rpartition(".")
    owner = resolve_path(root, owner_path) if owner_path else root
    out: dict[int, str] = {}
    for u in _class_uses(type(owner), cache):
        if u.path == (name,) and u.kind == "other" and (name,) not in u.loops and u.src.endswith("(...)"):
            index = u.src[len(f"self.{name}["):].partition("]")[0]
            if u.src.startswith(f"self.{name}[") and index.lstrip("-").isdigit():
                out.setdefault(int(index), u.src)
    return out


# --------------------------------------------------------------------------- where a path runs
@dataclass(frozen=True)
class Where:
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
class Never:
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


def locate(root: nn.Module, path: str, cache: dict) -> Where | Never | str:
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
            return Never(f"{cls.__name__}.forward uses self.{'.'.join(parts)} only when {false}, "
                          "which is false for this model")
        longest = max(len(u.path) for u, _ in live)
        live = [(u, c) for u, c in live if len(u.path) == longest]
        if longest == len(parts) and all(u.kind == "loop" for u, _ in live) and (
                len(live) > 1 or live[0][0].part is not None):
            return _segments(module, parts, live, Where(key, conds, tuple(loops), "loop"), prefix)
        if len(live) > 1:
            srcs = "; ".join(sorted({u.src for u, _ in live}))
            return f"{cls.__name__}.forward uses self.{'.'.join(parts[:longest])} {len(live)} times ({srcs})"
        u, unknown = live[0]
        key += ((u.pos, u.rank),)
        conds += tuple(f"{cls.__name__}: {c}" for c in unknown)
        loops += tuple(".".join(prefix + lp) for lp in u.loops)
        if longest == len(parts):
            if u.kind != "other" or conds:  # under a condition on the inputs: left resident whatever the use
                return Where(key, conds, loops, u.kind)
            inside = f" inside the loop over {loops[-1]!r}" if loops else ""
            return f"{cls.__name__}.forward uses self.{'.'.join(parts)} as `{u.src}`{inside}, not in a plain for loop"
        if u.kind != "call":
            return f"{cls.__name__}.forward uses self.{'.'.join(parts[:longest])} as `{u.src}`, not as a call"
        module = resolve_path(module, ".".join(parts[:longest]))
        prefix, parts = prefix + parts[:longest], parts[longest:]


def _segments(module: nn.Module, parts: tuple, live: list, above: Where, prefix: tuple) -> Where | str:
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
    return Where(above.key, tuple(conds), tuple(loops), "loop", tuple(segs))


def _static_slice(node: ast.Slice, module: nn.Module, env: tuple) -> slice | None:
    scope = {name: resolve_path(module, ".".join(chain)) for name, chain in env}
    bounds = [None if b is None else _static(b, module, scope) for b in (node.lower, node.upper, node.step)]
    if any(b is _UNKNOWN or not (b is None or isinstance(b, int)) for b in bounds):
        return None
    return slice(*bounds)
