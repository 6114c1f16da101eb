"""Capture/replay policy: pure, CPU-tested, no CUDA.

Keys: one graph per *input signature* (the structure of args/kwargs, each
tensor's shape, dtype, device, requires_grad and strides, each other leaf's
value, and the thread's modes: grad mode, inference mode, autocast enabled
and dtype per device type, and autocast's cache flag, all of which change the
kernels a step records) and
*phase* (which step of the slot pattern: with an odd block count and two
slots, even and odd steps use the slots the other way round, so they need
different graphs).

What a capture must show before its graph is kept (checked by the runner,
named here): the step ran exactly the streamed blocks of one step
(:func:`step_problem`; an early exit by a Python flag would replay with
other weights), and its output is made of containers torch's pytree knows
(:func:`output_problem`; the runner clones every output tensor after a
replay, and cannot reach tensors inside an unknown container, which the next
replay would overwrite). Under autocast with its cast cache nothing is
captured (:func:`autocast_problem`).

Decisions per call: a new signature runs eager once (warm-up: lazy
initialisation, library autotuning, allocator growth); the next call with it
captures; later calls replay. A signature whose capture failed runs eager from
then on (one warning, naming the cause, is the mechanism's job). The number of
live graphs is bounded; the least recently used is evicted.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch.utils import _pytree as pytree


class Action(Enum):
    EAGER_WARMUP = "eager-warmup"
    CAPTURE = "capture"
    REPLAY = "replay"
    EAGER_FALLBACK = "eager-fallback"
    EAGER_SETTLING = "eager-settling"  # warmed up, but the weights are still being re-laid out: capture later


class UnsupportedInput(ValueError):
    """An argument leaf that cannot be part of a graph signature."""


def _leaf_key(leaf):
    if isinstance(leaf, torch.Tensor):
        return ("T", tuple(leaf.shape), leaf.dtype, str(leaf.device), leaf.requires_grad, tuple(leaf.stride()))
    if leaf is None or isinstance(leaf, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return ("V", type(leaf).__name__, leaf)
    try:
        hash(leaf)
    except TypeError as e:
        raise UnsupportedInput(
            f"argument leaf of type {type(leaf).__name__} is neither a tensor nor a hashable value"
        ) from e
    return ("V", type(leaf).__name__, leaf)


AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
# output leaves that are values, not containers (anything else is a container pytree does not know)
_VALUE_LEAVES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type(None))


def mode_key() -> tuple:
    """The thread's modes that change what a step records: grad mode, inference
    mode, autocast (enabled, and its dtype when enabled) per device type."""
    autocast = tuple(
        (dt, True, torch.get_autocast_dtype(dt)) if torch.is_autocast_enabled(dt) else (dt, False)
        for dt in AUTOCAST_DEVICE_TYPES
    )
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, torch.is_autocast_cache_enabled())


def autocast_problem(device_type: str) -> str | None:
    """Why a step cannot be captured in the current autocast state (None: it can).
    Autocast's weight-cast cache keeps, until the autocast region ends, casts
    made by earlier (eager) steps; a capture would read them as constants, stale
    copies of streamed weights that are freed when the region ends (torch's
    make_graphed_callables refuses this too)."""
    if torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled():
        return (
            f"autocast is enabled on {device_type} with its weight-cast cache, which a graph would read as "
            f"constants (stale, freed at the region's end); use torch.autocast({device_type!r}, ..., "
            "cache_enabled=False) to capture"
        )
    return None


def signature(args: tuple, kwargs: dict):
    """Hashable key of a call: argument structure plus per-leaf metadata/values,
    and the modes of :func:`mode_key`."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (str(spec), tuple(_leaf_key(x) for x in leaves), mode_key())


def output_problem(out) -> str | None:
    """Why a step's output cannot be returned from a graph (None: it can): a leaf
    that is neither a tensor nor a plain value is a container torch's pytree
    does not know, so the tensors inside it could not be cloned after a replay."""
    for leaf in pytree.tree_leaves(out):
        if not isinstance(leaf, (torch.Tensor, *_VALUE_LEAVES)):
            return (
                f"the output holds a {type(leaf).__module__}.{type(leaf).__qualname__}, a container torch's pytree "
                "does not know, so its tensors could not be copied out of the graph's static output; return a "
                "tuple/dict/diffusers BaseOutput, or register the class with torch.utils._pytree.register_pytree_node"
            )
    return None


def step_problem(ran: int, n: int) -> str | None:
    """Why a captured step cannot be kept (None: it can): it ran ``ran`` streamed
    blocks where one step has ``n`` (an early exit, or a block list run twice)."""
    if ran == n:
        return None
    return (
        f"the captured step ran {ran} of the {n} streamed blocks of one step (an early exit or a repeated pass "
        "in the model's forward?); its graph would replay with other weights, so it is discarded"
    )


def tensor_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    leaves, _ = pytree.tree_flatten((args, kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


@dataclass
class GraphPolicy:
    max_graphs: int = 8
    warmed: set = field(default_factory=set)
    failed: dict = field(default_factory=dict)  # signature -> cause
    live: OrderedDict = field(default_factory=OrderedDict)  # (signature, phase) -> None (LRU order)
    # the peft adapter state the live graphs bake in (offload/adapters.py AdapterWatch.key); None: not seen yet
    adapter_state: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.max_graphs, int) or self.max_graphs < 1:
            raise ValueError(f"max_graphs={self.max_graphs!r} must be an int >= 1")

    def decide(self, sig, phase: int, settling: str | None = None) -> Action:
        """What to do with a step of ``sig`` at ``phase``; ``settling`` (why the source's loads are
        about to change, e.g. blocks coded in the background) holds back a capture, not a replay."""
        if sig in self.failed:
            return Action.EAGER_FALLBACK
        key = (sig, phase)
        if key in self.live:
            self.live.move_to_end(key)
            return Action.REPLAY
        if sig not in self.warmed:
            return Action.EAGER_WARMUP
        return Action.EAGER_SETTLING if settling else Action.CAPTURE

    def warmed_up(self, sig) -> None:
        self.warmed.add(sig)

    def captured(self, sig, phase: int) -> list:
        """Record a new graph; return the keys to evict (LRU beyond max_graphs)."""
        self.live[(sig, phase)] = None
        evict = []
        while len(self.live) > self.max_graphs:
            k, _ = self.live.popitem(last=False)
            evict.append(k)
        return evict

    def capture_failed(self, sig, cause: str) -> bool:
        """Mark a signature eager-only; True the first time any capture failed (warn once)."""
        first = not self.failed
        self.failed[sig] = cause
        return first

    def adapters_changed(self, state: tuple) -> bool:
        """Note the adapters' state before a step; True when it differs from the one the live
        graphs were captured under and there are graphs to drop (the caller drops them, which
        :meth:`clear` s this policy, and tells the source its captures are gone: a coded block
        that outgrew the captured copies is then no longer stale, the next steps warm up and
        capture again)."""
        changed = self.adapter_state is not None and state != self.adapter_state
        self.adapter_state = state
        return changed and bool(self.live or self.warmed)

    def clear(self) -> None:
        self.warmed.clear()
        self.failed.clear()
        self.live.clear()
