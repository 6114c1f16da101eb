"""weightstream: stream DiT blocks from host memory through one or many GPUs.

Public surface::

    from weightstream import OffloadConfig, OffloadedTransformer
    model = OffloadedTransformer(transformer, OffloadConfig.layerwise(), device="cuda")

Names are imported on first use (PEP 562), so ``import weightstream`` and the
command line's ``--help`` do not pay for torch and the controller up front.
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# the package's logger; a library adds no handler beyond this one (silent unless configured)
logging.getLogger("weightstream").addHandler(logging.NullHandler())

_EXPORTS = {
    "OffloadConfig": "weightstream.offload.config",
    "LayerOptions": "weightstream.offload.config",
    "OffloadPlan": "weightstream.offload.discovery",
    "trace_plan": "weightstream.offload.discovery",
    "BlockOrderError": "weightstream.offload.discovery",
    "OffloadedTransformer": "weightstream.offload.transformer",
    "apply_layerwise_offload": "weightstream.offload.transformer",
    "LayerwiseOffloadHandle": "weightstream.offload.transformer",
    "offload_pipeline": "weightstream.offload.pipeline",
    "ParallelConfig": "weightstream.offload.dlo.topology",
    "validate_wave": "weightstream.offload.dlo.control",
    "offload_from_safetensors": "weightstream.offload.checkpoint_offload",
    "meta_from_pretrained": "weightstream.offload.host.checkpoint",
    "gguf_on_meta": "weightstream.offload.host.checkpoint",
    "CheckpointFormatError": "weightstream.offload.host.checkpoint",
    # named misuse errors
    "OffloadMisuseError": "weightstream.offload.misuse",
    "WeightUpdateError": "weightstream.offload.misuse",
    "ConcurrentUseError": "weightstream.offload.misuse",
    "StreamedWriteError": "weightstream.offload.misuse",
    "SharedStorageError": "weightstream.offload.misuse",
    "UnsupportedOperationError": "weightstream.offload.misuse",
    "AlreadyOffloadedError": "weightstream.offload.misuse",
    "StreamedModuleAccessError": "weightstream.offload.misuse",
    "InferenceOnlyError": "weightstream.offload.misuse",
    "DuplicateKeyError": "weightstream.offload.misuse",
    "HostMemoryError": "weightstream.offload.misuse",
    "UnsupportedCombinationError": "weightstream.offload.misuse",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # static type checkers see the real names
    from weightstream.offload.config import LayerOptions, OffloadConfig
    from weightstream.offload.discovery import BlockOrderError, OffloadPlan, trace_plan
    from weightstream.offload.dlo.control import validate_wave
    from weightstream.offload.dlo.topology import ParallelConfig
    from weightstream.offload.host.checkpoint import gguf_on_meta, meta_from_pretrained
    from weightstream.offload.misuse import (
        AlreadyOffloadedError, ConcurrentUseError, DuplicateKeyError, HostMemoryError, InferenceOnlyError,
        OffloadMisuseError, SharedStorageError, StreamedModuleAccessError, StreamedWriteError,
        UnsupportedCombinationError, UnsupportedOperationError, WeightUpdateError,
    )
    from weightstream.offload.checkpoint_offload import offload_from_safetensors
    from weightstream.offload.pipeline import offload_pipeline
    from weightstream.offload.transformer import LayerwiseOffloadHandle, OffloadedTransformer, apply_layerwise_offload


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weightstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
