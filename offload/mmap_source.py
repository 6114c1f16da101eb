"""The mmap checkpoint source's public names (the source itself: :mod:`.sources.mmap`).

Kept so that ``from weightstream.offload.mmap_source import offload_from_safetensors, ...``
keeps working: the entry point, the checkpoint helpers (:mod:`.checkpoint`), the
registration planners (:mod:`.host_memory`) and the copy plans (:mod:`.sources.mmap_plans`).
"""
from __future__ import annotations

from weightstream.offload.host.checkpoint import DIFFUSERS_WEIGHTS, KERNEL_TRANSFORMS, Checkpoint, CheckpointChangedError, CheckpointFormatError, CkptTensor, FileWatch, SafetensorsFile, TensorBinding, WeightsSource, apply_transform, as_sources, bind_checkpoint, changed_message, check_opt_in, host_tensor, meta_from_pretrained, on_meta
from weightstream.offload.host.registration import HOST_REGISTER_READ_ONLY, REGISTER_CHUNK, direct_after_registration, plan_registration
from .sources.mmap import CheckpointPages, MmapSource, mmap_streamed_blocks, offload_from_safetensors  # noqa: F401
from .sources.mmap_coded import SIDECAR_MODES, CodedSidecarError, MmapCodedSource  # noqa: F401
from weightstream.offload.host.copy_plans import COPY_PATHS, BlockPlan, Run, build_plan, file_ordered_layout, merge_runs, split_run

__all__ = [
    "WeightsSource",
    "Checkpoint",
    "as_sources",
    "offload_from_safetensors",
    "on_meta",
    "meta_from_pretrained",
    "bind_checkpoint",
    "plan_registration",
    "direct_after_registration",
    "CheckpointChangedError",
    "CheckpointFormatError",
    "COPY_PATHS",
    "MmapSource",
    "MmapCodedSource",
    "CodedSidecarError",
    "SIDECAR_MODES",
]
