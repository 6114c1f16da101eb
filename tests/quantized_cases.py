"""Shared by the quantized-format test files (GGUF, torchao, bitsandbytes): the config, the run, and
the one check that "auto" placement plans by the quantized bytes and coding never changes an output."""
from __future__ import annotations

import torch

from weightstream import OffloadConfig, OffloadedTransformer

DEV = "cpu"


def cfg(**kw):
    return OffloadConfig.layerwise(progress=False, **kw)


def run(model, x, steps=1):
    with torch.no_grad():
        return [model(**x)[0] for _ in range(steps)]


def check_auto_placement_and_coding(make, x, want) -> list:
    """A transfer-bound budget of the fixed part + two slots + half the blocks: the planner keeps
    some but not all blocks resident (by their quantized bytes), bit-exact, and disable() gives the
    model back; exp-k and auto coding stay bit-exact. Returns the coded wrappers' tensor specs."""
    probe = OffloadedTransformer(make(), cfg(), device=DEV)
    sizes, fixed = [lay.nbytes for lay in probe.executor.source.layouts], probe.stats()["resident_bytes"]
    probe.disable()
    budget = fixed + 2 * max(sizes) + sum(sizes) // 2
    wrapped = OffloadedTransformer(make(), cfg(resident_layers="auto", device_memory_budget_gb=budget / 1e9),
                                   device=DEV)
    wrapped._streamed.placement.h2d_gbps = 1e-6  # transfer-bound
    assert all(torch.equal(o, want) for o in run(wrapped, x, 4))
    assert 0 < wrapped.stats()["blocks_resident"] < len(sizes)  # planned by the quantized bytes
    assert torch.equal(run(wrapped.disable(), x)[0], want)
    specs = []
    for codec in ("exp-k", "auto"):  # never a wrong output, whatever codes
        coded = OffloadedTransformer(make(), cfg(weight_codec=codec), device=DEV)
        assert all(torch.equal(o, want) for o in run(coded, x, 3)), codec
        specs += [spec for lay in coded.executor.source.layouts for spec in lay.tensors]
    return specs
