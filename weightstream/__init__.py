"""weightstream: stream DiT blocks from host memory through one or many GPUs.

Public surface::

    from weightstream import OffloadConfig, OffloadedTransformer
    model = OffloadedTransformer(transformer, OffloadConfig.layerwise(), device="cuda")
"""
from weightstream.offload.config import LayerOptions, OffloadConfig
from weightstream.offload.discovery import OffloadPlan
from weightstream.offload.transformer import OffloadedTransformer

__all__ = ["OffloadConfig", "LayerOptions", "OffloadPlan", "OffloadedTransformer"]
__version__ = "0.1.0"
