"""offload/codecs.py: the codec registry agrees with the coded tensor format (kernels/codec_format.py)."""
from __future__ import annotations

import torch

from weightstream.kernels.codec_encode import encode
from weightstream.kernels.codec_format import LEVELS, PATCHED, VERSIONS, read_header
from weightstream.offload.codecs import AUTO_CODECS, CODECS, REGISTRY, WEIGHT_CODECS


def test_every_codec_writes_the_version_the_registry_names():
    assert {c.levels for c in REGISTRY.values()} == set(LEVELS) and PATCHED in LEVELS
    assert {c.version for c in REGISTRY.values()} <= set(VERSIONS)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3 * 4096, generator=g) * 0.02).to(torch.bfloat16)  # escapes at every level
    for c in REGISTRY.values():
        assert read_header(encode(x, levels=c.levels)).version == c.version, c.name


def test_the_registry_lists_every_value_of_weight_codec():
    assert WEIGHT_CODECS == ("none", *CODECS, "auto") and set(AUTO_CODECS) <= set(CODECS)
