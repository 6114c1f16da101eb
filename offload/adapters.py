"""peft / diffusers LoRA adapters on a model whose blocks stream.

peft injects an adapter by replacing an ``nn.Linear`` child with a tuner layer
(``lora.Linear(base_layer=<the original Linear>)``): the base layer's tensor
objects are kept (only their state-dict keys change, ``to_q.weight`` ->
``to_q.base_layer.weight``), and the adapter's own tensors (``lora_A``,
``lora_B``, DoRA's magnitude, embedding adapters) appear beside them. What
weightstream does with each, on every entry point (wrapper, in place, layer mode):

- **Adapter tensors are resident on the compute device**, never streamed (they
  are small, and a step reads them every time): :func:`streamable_tensors`
  leaves them out of the block images of a model that carries adapters when it is
  offloaded, and :class:`AdapterWatch`, a named step hook, places the tensors of
  adapters added after offloading on the device at the next step start
  (``stats()["adapters_placed"]`` counts the tensors it moved; peft usually puts
  them on the base layer's device already, which a streamed tensor reports as the
  compute device).
- **Fusing** (diffusers ``fuse_lora``, peft ``merge`` / ``merge_adapter``) writes
  ``base_layer.weight.data`` (``+=`` a delta, or an assignment): the streamed
  tensor's placeholder turns that into a write of the host image (re-encoded when
  coded; :mod:`.placeholders`), computed on the device from the same operands peft
  uses on a resident model, so the fused weight is the resident model's bit for
  bit. Unfusing subtracts the same delta the same way.
- **CUDA graphs**: a captured step bakes in each adapter's Python state (merged or
  not, active adapters, enabled or not, scaling). :meth:`AdapterWatch.key` is part
  of the graph runner's key (``graphs/runner.py``), so any change of that state
  (``set_adapters``, ``disable_lora``, ``fuse_lora``, loading or unloading) runs
  eager once and captures again; hotswapped adapter values (copied in place into
  the same tensors) are read at replay time.

Nothing here reads or patches peft internals beyond its public tuner-layer
surface (``BaseTunerLayer``: ``get_base_layer``, ``merged_adapters``,
``active_adapters``, ``disable_adapters``; ``LoraLayer.scaling``).
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from .hooks import RemovableHooks
from .layout import block_tensors, tensor_bytes
from .misuse import AdapterMergeUnsupportedError, OffloadMisuseError

# peft's tuner module: when it was never imported, no model can hold a tuner layer
_PEFT_TUNERS = "peft.tuners.tuners_utils"
_PEFT_LORA = "peft.tuners.lora.layer"


def tuner_layers(module: nn.Module) -> list[nn.Module]:
    """Every peft tuner layer (``BaseTunerLayer``) inside ``module``, outermost first."""
    tuners = sys.modules.get(_PEFT_TUNERS)
    if tuners is None:
        return []
    # every step (AdapterWatch), on every diffusers model once peft is imported (importing a
    # diffusers transformer imports it): a walk of the children dicts, not modules(), which
    # builds every module's dotted name (Flux's 1,279 modules: 0.6 ms against 1.5 ms)
    out, seen, stack = [], set(), [module]
    while stack:
        m = stack.pop()
        if isinstance(m, tuners.BaseTunerLayer) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return out


def adapter_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """The tensors a tuner layer adds beside its base layer (lora_A, lora_B, ...)."""
    base = {id(t) for t in layer.get_base_layer().parameters()} | {
        id(t) for t in layer.get_base_layer().buffers()}
    out, seen = [], set()
    for t in list(layer.parameters()) + list(layer.buffers()):
        if id(t) not in base and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def adapter_tensor_ids(module: nn.Module) -> set[int]:
    return {id(t) for layer in tuner_layers(module) for t in adapter_tensors(layer)}


def streamable_tensors(block: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """:func:`~.layout.block_tensors` of a streamed block less its adapters' tensors (resident)."""
    skip = adapter_tensor_ids(block)
    tensors = block_tensors(block)
    return [entry for entry in tensors if id(entry[2]) not in skip] if skip else tensors


def merge_state(module: nn.Module) -> tuple:
    """The merged adapters of every tuner layer in ``module``: a peft merge writes
    ``base_layer.weight.data`` (which moves no version counter of the weight), this moves."""
    return tuple((id(layer), tuple(layer.merged_adapters)) for layer in tuner_layers(module))


def adapter_state(layer: nn.Module) -> tuple:
    """What a captured step bakes in of one tuner layer: merged adapters, active ones,
    enabled or not, LoRA scaling, and each adapter tensor's identity and address."""
    lora = sys.modules.get(_PEFT_LORA)
    scaling = ()
    if lora is not None and isinstance(layer, lora.LoraLayer):
        scaling = tuple(sorted((k, v if isinstance(v, (int, float)) else ("T", id(v)))
                               for k, v in layer.scaling.items()))
    return (id(layer), tuple(layer.merged_adapters), tuple(layer.active_adapters), bool(layer.disable_adapters),
            scaling, tuple((id(t), t.data_ptr()) for t in adapter_tensors(layer)))


def merge_stopped(root: nn.Module, t: torch.Tensor) -> str:
    """What to tell a user whose peft merge (``fuse_lora``, ``merge``) was refused at the base
    weight ``t``: peft merges layer by layer, so the layers it merged before this one (resident
    ones) stay merged; "" when ``t`` is no tuner layer's base weight or nothing is merged."""
    layers = tuner_layers(root)
    if not any(getattr(layer.get_base_layer(), "weight", None) is t for layer in layers):
        return ""
    merged = [layer for layer in layers if layer.merged_adapters]
    if not merged:
        return ""
    names = ", ".join(sorted({name for name, m in root.named_modules() if any(m is layer for layer in merged)})[:4])
    return (f" The merge stopped at this layer: the {len(merged)} adapter layer(s) merged before it ({names}; "
            "resident weights) keep the merge, and diffusers' unfuse_lora() does not know of it. For the exact "
            "weights load the originals back (load_state_dict / update_weights); peft's unmerge() on those layers "
            "subtracts the delta again, with rounding")


@contextlib.contextmanager
def merge_note(root: nn.Module, t: torch.Tensor):
    """A refused read or write of ``t``'s ``.data`` (a named error) inside a peft merge: raised
    again with :func:`merge_stopped`'s note of what the merge left merged."""
    try:
        yield
    except OffloadMisuseError as e:
        note = merge_stopped(root, t)
        if not note:
            raise
        raise type(e)(f"{e}.{note}") from e


def dora_read_error(root: nn.Module, t: torch.Tensor, what: str, name: str):
    """The named error for a read of offloaded base weight ``t`` (``name``) that a peft DoRA layer of
    ``root`` makes outside its forward (its merge computes the magnitude from the base weight's
    values), None when no DoRA layer holds ``t`` (the caller raises its own error)."""
    lora = sys.modules.get(_PEFT_LORA)
    for layer in tuner_layers(root) if lora is not None else ():
        if isinstance(layer, lora.LoraLayer) and layer.get_base_layer().weight is t and any(layer.use_dora.values()):
            return AdapterMergeUnsupportedError(
                f"{what} read the offloaded base weight {name!r} of a peft DoRA layer outside its forward: a DoRA "
                "merge (merge(), fuse_lora()) computes the magnitude from the base weight's values, which are in "
                "the host store between forwards, so DoRA merges are not supported on offloaded weights (a plain "
                "LoRA merge is). Run the DoRA adapter unfused, or merge it before offloading." + merge_stopped(root, t))
    return None


class AdapterWatch(RemovableHooks):
    """Named, removable step hook on the DiT: at every step start, the tensors of peft
    adapters anywhere in it are placed on the compute device (adapters loaded after
    offloading). ``key()``: the adapter state a CUDA graph bakes in (the graph runner's
    key; a change captures again)."""

    def __init__(self, root: nn.Module, device: torch.device):
        self.root, self.device = root, device
        self.name = f"weightstream.adapters[{type(root).__name__}]"
        self.placed = 0  # adapter tensors this hook moved to the device
        self._handles = [root.register_forward_pre_hook(self.pre_forward)]

    def pre_forward(self, module, args) -> None:
        self.place()

    def place(self) -> list[nn.Module]:
        """Move adapter tensors that are not on the compute device onto it; returns the layers."""
        layers = tuner_layers(self.root)
        with torch.no_grad():
            for layer in layers:
                for t in adapter_tensors(layer):
                    if t.device != self.device:
                        t.data = t.data.to(self.device)
                        self.placed += 1
        return layers

    def key(self) -> tuple:
        """The adapters' state (after placing them): equal keys, equal captured steps."""
        return tuple(adapter_state(layer) for layer in self.place())

    def stats(self) -> dict:
        layers = tuner_layers(self.root)
        tensors = {id(t): t for layer in layers for t in adapter_tensors(layer)}
        return {"adapter_layers": len(layers), "adapter_bytes": sum(map(tensor_bytes, tensors.values())),
                "adapters_placed": self.placed}

    def __repr__(self) -> str:
        return f"AdapterWatch({self.name}, {self.state})"


class UnitEdits:
    """Module mode: a swapped unit's base weights changed on the device while it is there by a
    peft merge (diffusers' ``fuse_lora``, peft's ``merge`` / ``unmerge``: ``base_layer.weight.data
    += delta``, which moves no version counter of the weight) or by an in-place edit or assignment
    that moves its version counter or its address, are written back into the unit's host master
    before it leaves, before any ``state_dict()`` and before ``disable()``: the next arrival brings
    the fused weights (re-encoded when coded). ``images``: the :class:`~.module.units.UnitImages`."""

    def __init__(self, images):
        self.images = images
        self._seen: dict[int, list[tuple[int, int]]] = {}  # id(unit) -> (version, data_ptr) per tensor
        self._merged: dict[int, dict[int, tuple]] = {}  # id(unit) -> id(tuner layer) -> merged adapters

    def arrived(self, u) -> None:
        self._seen[id(u)] = [(t._version, t.data_ptr()) for t in u.tensors]
        # the layer objects too: one unloaded since (unload_lora_weights) may have been fused first
        self._merged[id(u)] = {id(layer): (layer, tuple(layer.merged_adapters)) for layer in tuner_layers(u.module)}

    def write_back(self, u) -> int:
        """Write ``u``'s tensors changed on the device since it arrived; returns how many."""
        seen = self._seen.get(id(u))
        if seen is None or not u.on_device:
            return 0
        changed = {i for i, (t, (v, p)) in enumerate(zip(u.tensors, seen)) if t._version != v or t.data_ptr() != p}
        merged = self._merged[id(u)]
        layers = {id(layer): (layer, ()) for layer in tuner_layers(u.module)}
        layers.update(merged)
        index = None
        for layer, was in layers.values():
            if was != tuple(layer.merged_adapters):
                index = index or {id(t): i for i, t in enumerate(u.tensors)}
                base = layer.get_base_layer()
                changed.update(index[id(t)] for t in list(base.parameters()) + list(base.buffers()) if id(t) in index)
        if changed:
            with torch.no_grad():
                for i in sorted(changed):
                    self.images.write(u, i, u.tensors[i].detach())
        if changed or index is not None:
            self.arrived(u)
        return len(changed)
