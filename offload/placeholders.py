"""What a streamed tensor is between its block's forwards: a placeholder that speaks.

Between forwards a streamed parameter or buffer holds an empty device tensor
(its bytes live in the host store). So that nothing can read or write it
silently, the executor gives it, while unbound, a subclass of its own class
(:meth:`Placeholders.unbind`; the object, its identity and ``isinstance`` stay)
whose ``__torch_function__``:

- answers metadata as the bound tensor would: ``shape``, ``size()``,
  ``numel()``, ``dtype``, ``stride()``, ``device`` ... (from a ``meta`` twin of
  its runtime layout; ``device`` is the compute device);
- makes ``.data`` a device copy of its current weights; an in-place edit of that
  copy, or an assignment ``t.data = value``, takes effect at the next forward
  exactly like :meth:`~.streamed.StreamedBlocks.update_weights` (what peft's
  ``merge()`` / diffusers' ``fuse_lora`` do to a weight);
- refuses anything else with a named error: a read of its values
  (:class:`StreamedModuleAccessError`: a submodule called outside its block's
  forward), an in-place op (``add_``, ``copy_``: :class:`StreamedWriteError`),
  a deep copy or pickle (:class:`UnsupportedOperationError`).

The subclass is set and taken off at every unbind / bind (a ``__class__``
assignment, ~0.5 us per tensor on the host); while a block computes its
tensors have their own class, so compute pays nothing.
"""
from __future__ import annotations

import sys
import weakref

import torch

from .misuse import StreamedModuleAccessError, StreamedWriteError, UnsupportedOperationError

# answered by the meta twin (shape-dependent metadata of the bound tensor)
_META = frozenset({
    "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "stride", "dtype", "element_size",
    "itemsize", "nbytes", "is_floating_point", "is_complex", "is_signed", "is_contiguous", "layout", "names",
    "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "__len__", "storage_offset", "is_inference",
})
# answered by the placeholder itself (no values read)
_OWN = frozenset({
    "device", "is_cuda", "is_cpu", "is_meta", "get_device", "requires_grad", "requires_grad_", "is_leaf", "grad",
    "grad_fn", "_version", "_base", "_is_view", "__hash__", "data_ptr", "detach", "output_nr", "_cdata",
    "retains_grad", "_backward_hooks", "_post_accumulate_grad_hooks",
})


# Python's in-place operators (their torch names end with "__", not "_")
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})
# sys.getrefcount of a handed copy that only its entry in Placeholders._handed refers to
# (the entry, the call's argument)
_ONLY_OURS = 2


def _op_name(func) -> tuple[str, str | None]:
    """(name, 'get' | 'set' | None) of a ``__torch_function__`` ``func``: a property's getter
    or setter arrives as a ``method-wrapper`` of its descriptor."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__") and hasattr(func, "__self__"):
        return getattr(func.__self__, "__name__", ""), name[2:5]
    return name, None


class Placeholders:
    """The executor's stand-ins for its streamed tensors while they are unbound.

    ``read(t)`` -> a tensor on the device with ``t``'s current weights; ``write(t, value)``
    writes them (both from :class:`~.streamed.StreamedBlocks`). ``names[id(t)]`` names a
    tensor in messages."""

    def __init__(self, device: torch.device, read, write, *, access_hint: str | None = None, explain=None):
        self.device = device
        self._read, self._write = read, write
        # the StreamedModuleAccessError's advice (None: a streamed block's, layer mode)
        self.access_hint = access_hint
        # explain(t, what) -> an error to raise instead of StreamedModuleAccessError, or None (the slow
        # path of a refused read; offload/adapters.py names a peft DoRA layer's reads)
        self.explain = explain
        self._origin: dict[int, torch.Tensor] = {}  # id(detached alias) -> the streamed tensor
        self.names: dict[int, str] = {}
        self.blocks: dict[int, str] = {}
        self._meta: dict[int, torch.Tensor] = {}
        self._base: dict[int, type] = {}  # id(t) -> its own class
        self._classes: dict[type, type] = {}  # own class -> its placeholder subclass
        self._flushing = False
        self._handed: list[list] = []  # .data copies handed out: [copy, tensor, its version then]

    def register(self, t: torch.Tensor, block: str, name: str, shape, stride, dtype) -> None:
        """``t`` (tensor ``name`` of streamed block ``block``) streams."""
        self.names[id(t)] = f"{block}.{name}"
        self.blocks[id(t)] = block
        self._meta[id(t)] = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device="meta")
        self._base[id(t)] = type(t)

    def placeholder_class(self, cls: type) -> type:
        sub = self._classes.get(cls)
        if sub is None:
            sub = type(f"Streamed{cls.__name__}", (cls,), {
                "__torch_function__": classmethod(_torch_function), "_ws_placeholders": self,
                "__deepcopy__": _refuse_copy, "__reduce_ex__": _refuse_copy, "__repr__": _repr,
                "__format__": _repr,
                "__module__": __name__,
            })
            self._classes[cls] = sub
        return sub

    # -- the executor's bind (the tensor is about to get its view) -----------------------------------
    def unbound(self, t: torch.Tensor) -> None:
        """``t`` no longer holds its weights (module mode: its component left the device)."""
        t.__class__ = self.placeholder_class(self._base[id(t)])

    def bound(self, t: torch.Tensor) -> None:
        t.__class__ = self._base[id(t)]

    def detached(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``t.detach()`` between forwards: ``out`` (a plain alias of the empty stand-in) speaks for ``t``
        too (shape, dtype, named errors on a read of its values), so no caller computes with an empty
        tensor; torch's ``state_dict()`` detaches every tensor, and its hook replaces these entries."""
        t = self.origin(t)
        key = id(out)
        self._origin[key] = t
        for table in (self.names, self.blocks, self._meta):
            table[key] = table[id(t)]
        self._base[key] = type(out)
        weakref.finalize(out, self._forget, key)
        out.__class__ = self.placeholder_class(type(out))
        return out

    def _forget(self, key: int) -> None:
        for table in (self._origin, self.names, self.blocks, self._meta, self._base):
            table.pop(key, None)

    def origin(self, t: torch.Tensor) -> torch.Tensor:
        """The streamed tensor ``t`` speaks for (itself, or the tensor a detached alias came from)."""
        return self._origin.get(id(t), t)

    def release_all(self, tensors) -> None:
        """Every tensor back to its own class (teardown, or a block made resident)."""
        for t in tensors:
            base = self._base.get(id(t))
            if base is not None and type(t) is not base:
                t.__class__ = base

    # -- .data between forwards --------------------------------------------------------------
    # A handed-out copy is held until it was written (if edited) and nobody else holds it: so
    # ``t.data.add_(x)``, whose copy the caller drops at once, still takes effect.
    def data_of(self, t: torch.Tensor) -> torch.Tensor:
        self.flush()  # copies handed out before: written, and let go of once only we hold them
        t = self.origin(t)
        copy = self._read(t)
        self._handed.append([copy, t, copy._version])
        return copy

    def set_data(self, t: torch.Tensor, value) -> None:
        self._handed = [h for h in self._handed if h[0] is not value]
        self._write(self.origin(t), value)

    @property
    def handed(self) -> bool:
        """Whether any ``.data`` copy is out (one list check per step)."""
        return bool(self._handed)

    def flush(self) -> int:
        """Write every ``.data`` copy edited in place since it was handed out (step start,
        state_dict(), restore, the next ``.data``); let go of the copies only we hold.
        Returns how many were written."""
        if self._flushing:  # a write below reads the state dict, which flushes: once is enough
            return 0
        self._flushing = True
        try:
            written, keep = 0, []
            for entry in self._handed:
                copy, t, version = entry
                if copy._version != version:
                    entry[2] = copy._version
                    self._write(t, copy)
                    written += 1
                del copy
                if sys.getrefcount(entry[0]) > _ONLY_OURS:
                    keep.append(entry)
            self._handed = keep
            return written
        finally:
            self._flushing = False

    def meta(self, t: torch.Tensor) -> torch.Tensor:
        return self._meta[id(t)]

    def name(self, t: torch.Tensor) -> str:
        return self.names.get(id(t), "<streamed tensor>")


def _streamed_arg(cls, args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, cls):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, cls):
                    return b
    return None


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    ph: Placeholders = cls._ws_placeholders
    name, prop = _op_name(func)
    t = _streamed_arg(cls, args, kwargs)
    if t is None or (not isinstance(args[0], cls) and name in _META | _OWN):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if name == "data" and prop == "get":
        return ph.data_of(t)
    if name == "data" and prop == "set":
        return ph.set_data(t, args[1])
    if name == "detach" and args[0] is t:
        with torch._C.DisableTorchFunctionSubclass():
            return ph.detached(t, func(*args, **kwargs))
    if name in _OWN:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if name in _META:
        swapped = tuple(ph.meta(a) if a is t else a for a in args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*swapped, **kwargs)
    what = f"{name}()" if prop is None else f".{name}"
    if (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS:
        raise StreamedWriteError(
            f"{what} on the streamed tensor {ph.name(t)!r} between forwards: it holds an empty placeholder "
            "(its weights are in the host store), so an in-place op would change nothing. Change it with "
            "update_weights({key: value}) / load_state_dict, in place on the tensor state_dict() returns, "
            "or on its .data (a device copy whose edits take effect at the next forward)")
    block = ph.blocks.get(id(t), "?")
    named = ph.explain(ph.origin(t), what) if ph.explain is not None else None
    if named is not None:
        raise named
    if ph.access_hint is not None:
        raise StreamedModuleAccessError(f"{what} read the offloaded tensor {ph.name(t)!r} of {block!r} while its "
                                        f"weights are not on the device: {ph.access_hint}")
    raise StreamedModuleAccessError(
        f"{what} read the streamed tensor {ph.name(t)!r} (part of the streamed block {block!r}) outside "
        f"{block!r}'s own forward, when its weights are not on the device: a submodule of the block called on "
        "its own, or the model reading the block's weights outside the block loop (e.g. a DiT that calls "
        "transformer_blocks[0].norm1.emb after the loop). Read the weights with state_dict() or .data (a "
        f"device copy); to call the submodule there, keep {block!r} resident: layer_options.dit."
        "resident_layers (it must then be among the first blocks) or an OffloadPlan whose containers leave it out")


def _refuse_copy(self, *args):
    ph = type(self)._ws_placeholders
    raise UnsupportedOperationError(
        f"the streamed tensor {ph.name(self)!r} cannot be deep-copied or pickled between forwards: its weights "
        "live in the host store, not in the tensor. Copy the weights with state_dict() (torch.save("
        "model.state_dict()), save_pretrained), or disable() the offload first and copy the plain module")


def _repr(self, *args, **kwargs):
    ph = type(self)._ws_placeholders
    m = ph.meta(self)
    return (f"<streamed tensor {ph.name(self)!r}: {m.dtype} {tuple(m.shape)} on {ph.device}, weights in the "
            "host store between forwards>")


def holds_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is a streamed tensor between its block's forwards (it holds no bytes of its
    own: its weights are in the host store)."""
    return isinstance(type(t).__dict__.get("_ws_placeholders"), Placeholders)


def drop_storage(tensors, device) -> None:
    """Point every tensor of ``tensors`` at a shared empty tensor of its dtype on ``device``:
    identity and attributes kept, storage released (a host store or a slot holds the bytes).
    The one maker of these stand-ins; a ``meta`` tensor leaves ``meta`` this way too."""
    empties: dict = {}
    for t in tensors:
        give_data(t, empty_like_dtype(t.dtype, device, empties))


def empty_like_dtype(dtype, device, cache: dict) -> torch.Tensor:
    """The shared empty tensor of ``dtype`` on ``device`` held in ``cache`` (made once per dtype)."""
    if dtype not in cache:
        cache[dtype] = torch.empty((0,), dtype=dtype, device=device)
    return cache[dtype]


def give_data(t: torch.Tensor, data: torch.Tensor) -> None:
    """Make tensor object ``t`` hold ``data``, keeping its identity and attributes.

    ``t.data = data`` cannot move a tensor onto or off ``meta`` (incompatible tensor
    types), so that case swaps in a new tensor of ``t``'s class carrying ``t``'s
    attributes (``mmap_weight_transform``, a ``GGUFParameter``'s ``quant_type``, ...)."""
    if (t.device.type == "meta") == (data.device.type == "meta"):
        t.data = data
        return
    # a new tensor object aliasing ``data`` (swap_tensors swaps objects: ``data`` itself may be shared);
    # a Parameter keeps its class (GGUFParameter: what its GGUFLinear dequantizes by), built as
    # nn.Parameter builds one, without the subclass's own constructor
    if isinstance(t, torch.nn.Parameter):
        new = torch.Tensor._make_subclass(type(t), data.detach(), t.requires_grad)
    else:
        new = data.detach()
    new.__dict__.update(t.__dict__)
    torch.utils.swap_tensors(t, new)

