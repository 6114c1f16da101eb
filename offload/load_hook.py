"""``load_state_dict`` on a streamed model: named, removable load hooks.

Between forwards a streamed tensor is an empty placeholder, so torch's own
``load_state_dict`` (the model's, a parent module's) would copy into nothing:
it raised half way, after writing the resident tensors. :class:`HostLoadHook`
(a load_state_dict pre-hook and post-hook on the streamed model, installed by
the in-place handle and so also under the wrapper) writes the streamed tensors'
keys through ``update_weights`` instead, atomically: every key, shape and dtype
is checked first (the resident keys' shapes too), and a bad one raises :class:`WeightUpdateError` with
nothing written. The keys it wrote leave the state dict before torch copies the
rest, and leave the missing keys after. Resident tensors load as torch loads
them. :class:`WrapperKeys` lets a parent of an :class:`OffloadedTransformer`
load the keys its ``state_dict()`` wrote (``transformer.<key>``, not
``transformer.module.<key>``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .misuse import UnsupportedOperationError, WeightUpdateError

__all__ = ["HostLoadHook", "WrapperKeys"]


def _listed(keys: list[str]) -> str:
    return f"{keys[:5]}{'...' if len(keys) > 5 else ''}"


class _LoadHooks:
    """A pre-hook and a post-hook of ``load_state_dict`` on one module, named and removable."""

    name: str

    def _install(self, module: nn.Module) -> None:
        self._handles = [module.register_load_state_dict_pre_hook(self.pre),
                         module.register_load_state_dict_post_hook(self.post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def removed(self) -> bool:
        return not self._handles

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {'removed' if self.removed else 'active'})"


class HostLoadHook(_LoadHooks):
    """The streamed keys of ``module.load_state_dict(...)`` (or a parent's) written into the host
    store by ``update(state_dict)`` (``StreamedBlocks.update_weights``); ``offloaded(tensor)``: whether
    a tensor of the module streams."""

    def __init__(self, name: str, module: nn.Module, update: Callable, offloaded: Callable):
        self.name, self._update, self._offloaded = name, update, offloaded
        self._written: set[str] = set()
        self._install(module)

    def pre(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        self._written = set()
        current = module.state_dict(keep_vars=True)
        mine = {k[len(prefix):]: k for k in state_dict if k.startswith(prefix)}
        streamed = {k: state_dict[full] for k, full in mine.items() if k in current and self._offloaded(current[k])}
        if not streamed:
            return
        if local_metadata.get("assign_to_params_buffers"):
            raise UnsupportedOperationError(
                f"load_state_dict(assign=True) of {type(module).__name__}: {len(streamed)} of its tensors stream "
                "from the host store, which assign=True would replace by the given tensors; use assign=False "
                "(the default), or update_weights")
        self._check(module, current, mine, state_dict)
        self._update(streamed)  # atomic: raises WeightUpdateError with nothing written
        for k in streamed:
            del state_dict[mine[k]]  # torch copies the rest (resident tensors)
        self._written = {mine[k] for k in streamed}

    @staticmethod
    def _check(module, current: dict, mine: dict, state_dict) -> None:
        """A resident key of the wrong shape, which torch would refuse after the streamed keys were
        written: refused first. (Missing and unexpected keys are torch's to report: its hooks are
        not told ``strict``; a plain module's load writes every key it can, then raises.)"""
        bad = [f"{mine[k]!r}: shape {tuple(v.shape)}, the model's {tuple(current[k].shape)}"
               for k, v in ((k, state_dict[full]) for k, full in mine.items())
               if k in current and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(current[k].shape)]
        if bad:
            raise WeightUpdateError(f"load_state_dict of {type(module).__name__} (streamed): {'; '.join(bad[:5])}"
                                    f"{' ...' if len(bad) > 5 else ''}; nothing was written. Fix the state dict")

    def post(self, module, incompatible_keys) -> None:
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if k not in self._written]
        self._written.clear()


class WrapperKeys(_LoadHooks):
    """On an OffloadedTransformer: a parent's ``load_state_dict`` reaches the wrapped model with the
    keys the wrapper's ``state_dict()`` gives (``<prefix><key>``, the wrapped model's keys)."""

    def __init__(self, name: str, wrapper: nn.Module, inner: str = "module"):
        self.name, self._inner = name, inner
        self._renamed = ("", f"{inner}.")  # (prefix, prefix + inner) of the load under way
        self._install(wrapper)

    def pre(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        inside = f"{prefix}{self._inner}."
        keys = set(module.get_submodule(self._inner).state_dict(keep_vars=True))
        for full in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inside)]:
            if full[len(prefix):] in keys:
                state_dict[inside + full[len(prefix):]] = state_dict.pop(full)
        self._renamed = (prefix, inside)

    def post(self, module, incompatible_keys) -> None:
        prefix, inside = self._renamed
        for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
            keys[:] = [prefix + k[len(inside):] if k.startswith(inside) else k for k in keys]
