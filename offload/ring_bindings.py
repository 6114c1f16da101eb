"""What the tensors of streamed blocks hold: a view into a device slot while their
block computes, an empty placeholder otherwise (the ring's step 2 and step 5,
:mod:`.executor`), and the write guards read at each swap.

One owner, :class:`BlockBindings`, per executor. It keeps, per block the source
holds (source index ``k``): the tensor objects in layout order (``targets``),
their views into every slot (``views``, for streamed blocks only), their empty
stand-ins (``placeholders``) and the version counters seen while unbound. A
change of a version counter between forwards, or a non-empty tensor where a
placeholder should be, is a write that streaming would lose:
:class:`~.misuse.StreamedWriteError`, naming the tensors.
"""
from __future__ import annotations

import torch

from .adapters import streamable_tensors
from .misuse import StreamedWriteError
from .placeholders import Placeholders, empty_like_dtype


def _plain_tensors():
    """The bookkeeping of a swap (``.data``, ``_version``, ``numel``) without the tensors' own
    ``__torch_function__``: a tensor subclass's override (a GGUF weight's, a placeholder's) makes
    each of these calls ~3 us instead of ~0.2 us, ~50 of them per block and step on the thread
    that issues the compute; none of them computes anything the override would change."""
    return torch._C.DisableTorchFunctionSubclass()


class BlockBindings:
    """Binds block ``k``'s tensors to views into a slot and back to placeholders.

    ``layouts``: the source's block layouts; ``modules[k]``: block ``k``'s module;
    ``streamed(k)``: whether block ``k`` streams (a resident block under
    ``resident_layers="auto"`` gets no slot views); ``placeholders``: the
    :class:`~.placeholders.Placeholders` that refuse reads and writes of unbound
    tensors (None: plain empty tensors).
    """

    def __init__(self, layouts, modules, slots: list[torch.Tensor], device: torch.device, streamed,
                 placeholders: Placeholders | None = None):
        self.layouts = layouts
        self.targets: list[list[torch.Tensor]] = []
        self.views: list = []
        self.placeholders: list[list[torch.Tensor]] = []
        empties: dict[torch.dtype, torch.Tensor] = {}
        for k, lay in enumerate(layouts):
            objs = [t for _, _, t in streamable_tensors(modules[k])]
            self.targets.append(objs)
            specs = lay.tensors
            self.views.append([[spec.view_of(slot) for spec in specs] for slot in slots] if streamed(k) else None)
            self.placeholders.append([empty_like_dtype(s.dtype, device, empties) for s in specs])
        self.bound: int | None = None  # source index currently bound
        # versions[k]: the version counters of block k's tensors while unbound; a change
        # means a write that streaming would lose
        self.versions = [[t._version for t in objs] for objs in self.targets]
        # placeholders that refuse reads/writes between forwards (placeholders.py); per block
        # (own class, placeholder class) of each target, swapped at bind / unbind
        self.ph = placeholders
        self.classes = [[(type(t), placeholders.placeholder_class(type(t))) for t in objs]
                        if placeholders is not None else None for objs in self.targets]

    def bind(self, k: int, slot: int) -> None:
        """Block ``k``'s tensors onto their views into ``slot`` (identity kept); refuses an
        edit made while they held placeholders."""
        with _plain_tensors():
            self._bind(k, slot)

    def _bind(self, k: int, slot: int) -> None:
        ts = self.targets[k]
        classes = self.classes[k]
        if classes is not None:
            for t, (own, _) in zip(ts, classes):
                t.__class__ = own
        if [t._version for t in ts] != self.versions[k] or any(map(torch.Tensor.numel, ts)):
            self._refuse_placeholder_edit(k)
        for t, v in zip(ts, self.views[k][slot]):
            t.data = v
        self.bound = k

    def unbind(self, k: int) -> list[int]:
        """Back to placeholders; returns the indices of tensors written while bound."""
        with _plain_tensors():
            return self._unbind(k)

    def _unbind(self, k: int) -> list[int]:
        ts = self.targets[k]
        classes = self.classes[k]
        if classes and type(ts[0]) is not classes[0][0]:  # unbound already: own classes first
            for t, (own, _) in zip(ts, classes):
                t.__class__ = own
        for t, ph in zip(ts, self.placeholders[k]):
            t.data = ph
        if self.bound == k:
            self.bound = None
        seen = [t._version for t in ts]
        if classes is not None:
            for t, (_, sub) in zip(ts, classes):
                t.__class__ = sub
        if seen == self.versions[k]:
            return []
        written = [i for i, (a, b) in enumerate(zip(seen, self.versions[k])) if a != b]
        self.versions[k] = seen
        return written

    def unbind_current(self) -> None:
        """Unbind whatever a forward that raised inside a block left bound."""
        if self.bound is not None:
            self.unbind(self.bound)

    def release(self) -> None:
        """Teardown: every tensor back to its own class (placeholders stay until restored);
        the slot views are dropped."""
        if self.ph is not None:
            self.ph.release_all(t for ts in self.targets for t in ts)
        self.views = []

    def _names(self, k: int, idx) -> list[str]:
        name = self.layouts[k].name
        specs = self.layouts[k].tensors
        return [f"{name}.{specs[i].name}" for i in idx]

    def _refuse_placeholder_edit(self, k: int) -> None:
        """A streamed tensor was edited between forwards (in place, or ``.data``
        replaced) while it held its empty placeholder: undo, raise."""
        ts = self.targets[k]
        idx = [i for i, t in enumerate(ts) if t._version != self.versions[k][i] or t.numel()]
        for t, ph in zip(ts, self.placeholders[k]):
            t.data = ph
        self.versions[k] = [t._version for t in ts]
        if self.classes[k] is not None:
            for t, (_, sub) in zip(ts, self.classes[k]):
                t.__class__ = sub
        raise StreamedWriteError(
            f"streamed tensor(s) {self._names(k, idx)[:5]} were changed between forwards (in place, or "
            "`.data` replaced) while holding their empty placeholder; the change was NOT applied: the "
            "host store keeps the previous weights (the change is now discarded). Change streamed weights "
            "with update_weights() / load_state_dict(), or in place on the tensors state_dict() returns; "
            "or keep the block resident (layer_options.dit.resident_layers or an OffloadPlan)"
        )

    def written_in_forward(self, k: int, idx: list[int]) -> StreamedWriteError:
        """The error for block ``k``'s tensors ``idx`` written during its forward."""
        return StreamedWriteError(
            f"block {self.layouts[k].name!r} wrote to its streamed tensor(s) "
            f"{self._names(k, idx)[:5]} during its forward (in place: e.g. BatchNorm running statistics in "
            "train mode, a counter or a cache buffer); streamed tensors are reloaded from the host store "
            "every step, so the write is lost. Call eval() on the model, keep this block resident "
            "(layer_options.dit.resident_layers or an OffloadPlan without it), or keep such state outside "
            "the block's parameters and buffers"
        )
