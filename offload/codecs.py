"""The codec registry: every value of ``weight_codec`` in one table.

Read by the config (allowed values), the encoders (``levels``), the planner
(``auto_candidate``), module offload (``MODULE_AUTO``) and the coded sidecar
(``version``). A new codec is one :class:`Codec` entry here and its format in
``kernels/codec_format.py`` (the ints below are that file's ``VERSION*`` and
``PATCHED``; tests/test_codecs.py checks they agree). Imports no torch: the
config reads this table.
"""
from __future__ import annotations

import dataclasses

from .misuse import OffloadMisuseError

NONE = "none"  # raw host images
AUTO = "auto"  # planned from a measured step: which blocks to code, and with which codec


@dataclasses.dataclass(frozen=True)
class Codec:
    name: str
    levels: int  # kernels.codec_encode.encode(levels=...)
    version: int  # the coded tensor format version it writes (kernels/codec_format.py)
    auto_candidate: bool  # weight_codec="auto" plans among these
    about: str


REGISTRY: dict[str, Codec] = {c.name: c for c in (
    Codec("exp-k", 1, 1, True,
          "sign/mantissa byte raw, the exponent a k-bit table code with escapes (~0.70 of bf16 bytes)"),
    Codec("exp-k2", 2, 2, True,
          "exp-k with the escapes coded again at a second level (~0.69 of the bytes, decode ~half as fast)"),
    # not an "auto" candidate: its decode is the fastest, but a plan only codes where the link binds,
    # and there the smaller bytes of exp-k2 win (each candidate costs the planning step a sampled
    # encode and a timed decode)
    Codec("exp-kp", 3, 3, False,
          "one level, the escapes a per-tile patch list (~0.74 of the bytes, the fastest decode)"),
)}
CODECS = tuple(REGISTRY)  # the lossless codecs
WEIGHT_CODECS = (NONE, *CODECS, AUTO)  # every allowed value of weight_codec
AUTO_CODECS = tuple(c.name for c in REGISTRY.values() if c.auto_candidate)
# weight_codec="auto" in mode='module': an arrival is a bare transfer (nothing computes beside it), so
# the smallest bytes win: arrivals 0.694-0.698x the uncoded floor with exp-k2, 0.716-0.718x with exp-k
# on the H200 (docs/performance.md)
MODULE_AUTO = "exp-k2"


class CodedCaptureStaleError(OffloadMisuseError, RuntimeError):
    """A re-encoded block outgrew the bytes CUDA graphs captured before copy for it."""


def codec(name: str) -> Codec:
    """The registry entry of ``name`` (ValueError naming the codecs for anything else)."""
    if name == AUTO:
        raise ValueError(
            "weight_codec='auto' is not allowed here: it plans which blocks to code from a measured step "
            "(pinned host images of layer mode, DLO included, and mode='module'); "
            f"here choose from: {', '.join(CODECS)}")
    if name not in REGISTRY:
        raise ValueError(f"weight_codec={name!r} is not allowed here; choose from: {', '.join(CODECS)}")
    return REGISTRY[name]


def codec_levels(name: str) -> int:
    """``encode``'s ``levels`` for the codec named ``name`` (ValueError naming the codecs otherwise)."""
    return codec(name).levels


def module_codec(name: str) -> str:
    """The codec mode='module' stores with: ``name``, or for "auto" :data:`MODULE_AUTO`."""
    return MODULE_AUTO if name == AUTO else name
