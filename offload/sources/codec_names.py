"""Codec names of weight_codec, their encode levels, and the error of a stale capture of coded loads."""
from __future__ import annotations

from ...kernels.codec_format import PATCHED
from ..misuse import OffloadMisuseError

__all__ = ["CODECS", "CODEC_LEVELS", "AUTO", "AUTO_CODECS", "MODULE_AUTO", "codec_levels", "module_codec", "CodedCaptureStaleError"]

CODECS = ("exp-k", "exp-k2", "exp-kp")
CODEC_LEVELS = {"exp-k": 1, "exp-k2": 2, "exp-kp": PATCHED}  # weight_codec -> encode(levels=...)
AUTO = "auto"  # weight_codec planned from a measured step (offload/auto_codec.py)
# The codecs "auto" plans among. Not "exp-kp": its decode is the fastest, but a plan only codes
# where the link binds, and there the smaller bytes of "exp-k2" win (each candidate costs the
# planning step a sampled encode and a timed decode).
AUTO_CODECS = ("exp-k", "exp-k2")


class CodedCaptureStaleError(OffloadMisuseError, RuntimeError):
    """A re-encoded block outgrew the bytes CUDA graphs captured before copy for it."""


MODULE_AUTO = "exp-k2"  # weight_codec="auto" in mode='module' (see module_codec)


def module_codec(codec: str) -> str:
    """The codec mode='module' stores with: ``codec``, or for "auto" :data:`MODULE_AUTO`. An
    arrival is a bare transfer (nothing computes beside it), so coding pays whenever a decode
    outruns the link by more than the bytes saved: measured on the H200, arrivals took 0.694-0.698x
    the uncoded floor with exp-k2, 0.716-0.718x with exp-k (bench_module: call23 for exp-k2, call12 for exp-k)."""
    return MODULE_AUTO if codec == AUTO else codec


def codec_levels(codec: str) -> int:
    """``encode``'s ``levels`` for the codec named ``codec`` (ValueError naming the codecs)."""
    if codec == AUTO:
        raise ValueError(
            "weight_codec='auto' is not allowed here: it plans which blocks to code from a measured step, "
            "for the pinned host images of layer mode (OffloadedTransformer, DLO included) and for mode='module'; "
            f"with this source (the mmap source) choose from: {', '.join(CODECS)}")
    if codec not in CODEC_LEVELS:
        raise ValueError(f"weight_codec={codec!r} is not allowed here; choose from: {', '.join(CODECS)}")
    return CODEC_LEVELS[codec]
