"""Named errors for misuse of an offloaded model (each says what happened and what to do).

Every class derives from :class:`OffloadMisuseError` and from the builtin
exception a caller would catch for the same mistake (``ValueError`` for bad
arguments, ``TypeError`` for unsupported operations, ``RuntimeError`` for a
state the call cannot run in), so existing ``except ValueError`` code keeps
working.
"""
from __future__ import annotations

__all__ = [
    "OffloadMisuseError", "WeightUpdateError", "ConcurrentUseError", "StreamedWriteError", "SharedStorageError",
    "UnsupportedOperationError", "AlreadyOffloadedError", "StreamedModuleAccessError", "InferenceOnlyError",
    "DuplicateKeyError", "HostMemoryError", "UnsupportedCombinationError",
]


class OffloadMisuseError(Exception):
    """Base of weightstream's misuse errors."""


class WeightUpdateError(OffloadMisuseError, ValueError):
    """``update_weights`` / ``load_state_dict`` got a key, shape or dtype the model
    does not have; nothing was written."""


class ConcurrentUseError(OffloadMisuseError, RuntimeError):
    """One offloaded model was entered from two threads at once."""


class StreamedWriteError(OffloadMisuseError, RuntimeError):
    """A streamed (host-backed) tensor was written outside ``update_weights``."""


class SharedStorageError(OffloadMisuseError, ValueError):
    """A streamed tensor shares its storage with another block or with the rest of the model."""


class UnsupportedOperationError(OffloadMisuseError, TypeError):
    """An operation on the wrapper that would break streaming (cast, copy, pickle)."""


class OffloadDisabledError(OffloadMisuseError, RuntimeError):
    """A wrapper, handle or module offload used after ``disable()`` / ``remove()``."""


class AlreadyOffloadedError(OffloadMisuseError, ValueError):
    """The model is already wrapped, streamed, or carries another library's offload hooks."""


class StreamedModuleAccessError(OffloadMisuseError, RuntimeError):
    """A submodule of a streamed block ran outside its block's forward (its weights were not loaded)."""


class AdapterMergeUnsupportedError(StreamedModuleAccessError):
    """A peft DoRA merge read an offloaded base weight's values (DoRA's magnitude is computed from
    them); plain LoRA merges go through ``.data`` and work, unfused DoRA runs."""


class ShardedWeightError(OffloadMisuseError, RuntimeError):
    """A rank of DLO AllGather was asked for a whole streamed tensor (its host view, ``.data``) while
    it holds only its share: a gather is a collective, so no single rank's read can be one."""


class InferenceOnlyError(OffloadMisuseError, RuntimeError):
    """Backward through streamed blocks: streaming is inference only."""


class DuplicateKeyError(OffloadMisuseError, ValueError):
    """A JSON config names one key twice in the same object."""


class HostMemoryError(OffloadMisuseError, MemoryError):
    """A host buffer (the block arena, a staging buffer) could not be allocated; the message
    names the bytes asked for, what the process already held, and how to need less."""


class UnsupportedCombinationError(OffloadMisuseError, ValueError):
    """A combination of transport, codec, residency and graph mode that the support matrix
    (offload/sources/select.py SUPPORT) refuses; the message names the key, the cell, why,
    and what to use instead."""
