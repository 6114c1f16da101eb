"""weightstream: stream DiT blocks from host memory through one or many GPUs.

Public surface::

    from weightstream import OffloadConfig, OffloadedTransformer
    model = OffloadedTransformer(transformer, OffloadConfig.layerwise(), device="cuda")
"""
from weightstream.offload.config import LayerOptions, OffloadConfig
from weightstream.offload.discovery import OffloadPlan
from weightstream.offload.distributed import ParallelConfig, validate_wave
from weightstream.offload.misuse import (
    AlreadyOffloadedError, ConcurrentUseError, DuplicateKeyError, InferenceOnlyError, OffloadMisuseError,
    SharedStorageError, StreamedModuleAccessError, StreamedWriteError, UnsupportedOperationError, WeightUpdateError,
)
from weightstream.offload.mmap_source import offload_from_safetensors
from weightstream.offload.module import offload_pipeline
from weightstream.offload.transformer import OffloadedTransformer

__all__ = [
    "OffloadConfig", "LayerOptions", "OffloadPlan", "OffloadedTransformer", "offload_pipeline",
    "ParallelConfig", "validate_wave", "offload_from_safetensors",
    # named misuse errors (weightstream.offload.misuse)
    "OffloadMisuseError", "WeightUpdateError", "ConcurrentUseError", "StreamedWriteError", "SharedStorageError",
    "UnsupportedOperationError", "AlreadyOffloadedError", "StreamedModuleAccessError", "InferenceOnlyError",
    "DuplicateKeyError",
]
__version__ = "0.1.0"
