"""The executor's hooks: named, removable pre/post forward hooks on each streamed block
and on the DiT, and the guard that makes a backward through a streamed block raise.

They only call the executor (:class:`~.executor.LayerwiseExecutor`): its
``before_block`` / ``after_block`` per block, ``acquire`` / ``begin_step`` /
``release`` per step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .discovery import Block
from .host.quantized import casting_leaves
from .misuse import InferenceOnlyError
from .tracing import not_traced

if TYPE_CHECKING:  # pragma: no cover
    from .executor import LayerwiseExecutor


class RemovableHooks:
    """The torch hook handles of a named hook set (``self._handles``): ``remove()`` takes them
    all out, ``state`` says whether they are still in."""

    _handles: list

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def removed(self) -> bool:
        return not self._handles

    @property
    def state(self) -> str:
        return "removed" if self.removed else "active"


class BlockHook(RemovableHooks):
    """Named, removable pre/post forward hook of one streamed block."""

    def __init__(self, executor: "LayerwiseExecutor", block: Block):
        self.executor = executor
        self.block = block
        self.name = f"weightstream.stream[{block.name}]"
        self._handles = [
            block.module.register_forward_pre_hook(self.pre_forward),
            block.module.register_forward_hook(self.post_forward),
        ]

    # not traced: under regional compile (nn.Module.compile compiles _call_impl,
    # hooks included) the rebinding of parameters to slot views must run eagerly,
    # as a graph break, not as a traced input mutation
    @not_traced
    def pre_forward(self, module, args):
        self.executor.before_block(self.block.index)

    @not_traced
    def post_forward(self, module, args, output):
        self.executor.after_block(self.block.index)
        if torch.is_grad_enabled():  # one call per block; the guard itself only with grad on
            guard_backward(output, self.block.name)

    def __repr__(self) -> str:
        return f"BlockHook({self.name}, {self.state})"


class StepHook(RemovableHooks):
    """Named, removable hooks on the DiT itself: its forward holds the model for
    the calling thread (see :meth:`LayerwiseExecutor.acquire`), and starts a step
    of a schedule with step-start loads (the step's first loads, behind the
    resident blocks)."""

    def __init__(self, executor: "LayerwiseExecutor", root: nn.Module):
        self.executor = executor
        self.name = f"weightstream.step[{type(root).__name__}]"
        # a GraphForward (in-place mode with CUDA graphs): the outer call of the module
        # only holds it; the graph runner's own call of the module starts the step
        self.entry = None
        self._handles = [
            root.register_forward_pre_hook(self.pre_forward),
            root.register_forward_hook(self.post_forward, always_call=True),
        ]

    def pre_forward(self, module, args):
        ex = self.executor
        ex.acquire()
        if self.entry is not None and not self.entry.inner:
            return
        if ex.schedule.has_step_start:
            ex.begin_step()
        elif ex.position % ex.schedule.n and not ex.block_bound:
            ex.finish_step()  # the previous step's last blocks were skipped (SD3 skip_layers)

    def post_forward(self, module, args, output):
        self.executor.release()

    def __repr__(self) -> str:
        return f"StepHook({self.name}, {self.state})"


class CastingKeep(RemovableHooks):
    """Named, removable hooks on a leaf outside the streamed blocks that diffusers' layerwise
    casting hooks (an embedder, a resident block's linear): the casting hook's
    ``module.to(storage_dtype)`` after the forward gives each tensor a new one; this puts back
    the one the forward started from, so the leaf keeps its own storage (the bytes a CUDA graph
    captured its reads from, the device image an update writes). A streamed block's leaves need
    none: their tensors are bound to a slot view before each forward."""

    def __init__(self, leaf: nn.Module, name: str):
        self.name = f"weightstream.casting[{name}]"
        self._kept: list | None = None
        self._handles = [
            leaf.register_forward_pre_hook(self.pre_forward),
            leaf.register_forward_hook(self.post_forward, always_call=True),
        ]

    @not_traced
    def pre_forward(self, module, args):
        self._kept = [(m, [(p, p.data) for p in m._parameters.values() if p is not None], dict(m._buffers))
                      for m in module.modules()]

    @not_traced
    def post_forward(self, module, args, output):
        for m, params, buffers in self._kept or ():
            for p, data in params:
                p.data = data  # the Parameter object stayed; its .data was replaced
            m._buffers.update(buffers)  # module.to replaces buffer objects
        self._kept = None

    def __repr__(self) -> str:
        return f"CastingKeep({self.name}, {self.state})"


def casting_keeps(root: nn.Module, streamed: set[int]) -> list[CastingKeep]:
    """A :class:`CastingKeep` on every layerwise-cast leaf of ``root`` outside the modules whose
    ids are in ``streamed`` (the streamed blocks)."""
    inside = {id(m) for b in root.modules() if id(b) in streamed for m in b.modules()}
    leaves = {id(m) for m in casting_leaves(root)}
    return [CastingKeep(m, name) for name, m in root.named_modules() if id(m) in leaves and id(m) not in inside]


def guard_backward(output, block: str) -> None:
    """Make a backward that reaches a streamed block's output raise InferenceOnlyError.

    Checked at the first backward rather than at forward: a forward with grad
    enabled computes correct outputs (only the backward needs the block's
    weights again, which are gone once the block is unbound), and raising at
    forward would break every caller that merely forgot ``torch.no_grad()``.
    """
    tensors = output if isinstance(output, (tuple, list)) else (
        output.values() if isinstance(output, dict) else (output,))
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(_InferenceOnly(block))


class _InferenceOnly:
    def __init__(self, block: str):
        self.block = block

    def __call__(self, grad):
        raise InferenceOnlyError(
            f"backward reached the streamed block {self.block!r}: weightstream streams weights for "
            "inference only (a block's weights leave the device after its forward, so its gradients "
            "cannot be computed). Run the model under torch.no_grad() or torch.inference_mode(), or "
            "call requires_grad_(False) on the inputs and parameters; to train, use the plain model "
            "(OffloadedTransformer.disable())"
        )
