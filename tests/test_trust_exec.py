"""Executor-level misuse never gives a silent wrong result (CPU: the same executor, no streams).

Each test compares against the real resident model (tests/layerwise_cases.py)."""
import copy
import json
import pickle
import threading
import time
import warnings

import pytest
import torch
from torch import nn

from weightstream import OffloadConfig, OffloadedTransformer, OffloadPlan
from weightstream import (
    AlreadyOffloadedError, ConcurrentUseError, DuplicateKeyError, InferenceOnlyError, OffloadMisuseError,
    SharedStorageError, StreamedModuleAccessError, StreamedWriteError, UnsupportedOperationError,
    WeightUpdateError,
)
from weightstream.models import ToyDiT
from weightstream.offload.transformer import StreamedBlocks

from layerwise_cases import build, first

DEV = "cpu"

# (model, config keys, via StreamedBlocks: the graph schedules run eagerly on the CPU)
SCHEDULES = [
    ("toy", {}, False),                                   # plain ring, 7 blocks (odd), 2 slots
    ("toy", {"num_slots": 3}, False),
    ("flux", {"resident_layers": 1}, False),              # 4 streamed
    ("flux", {"resident_layers": 2, "num_slots": 3}, False),
    ("wan", {}, False),                                   # 3 blocks
    ("toy", {"cuda_graphs": "on"}, True),                 # defer_last (next-step)
    ("flux", {"cuda_graphs": "on", "num_slots": 3}, True),
    ("toy", {"cuda_graphs": "on", "resident_layers": 2}, True),   # step_local
    ("flux", {"cuda_graphs": "on", "resident_layers": 1, "num_slots": 3}, True),
]
IDS = [f"{m}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'plain'}" for m, c, _ in SCHEDULES]


class Runner:
    """One offloaded model on the CPU: the wrapper, or StreamedBlocks for the graph schedules."""

    def __init__(self, name, cfg, direct):
        self.model, self.ref, self.x = build(name, DEV)
        config = OffloadConfig.layerwise(**cfg)
        if direct:
            self.sb = StreamedBlocks(self.model, config, torch.device(DEV), None)
            assert self.sb.schedule.has_step_start
            self.call = lambda: first(self.model(**self.x))
            self.update = self.sb.update_weights
            self.host = lambda key: self.sb.host_views[id(self.model.state_dict(keep_vars=True)[key])]
        else:
            self.wrapped = OffloadedTransformer(self.model, config, device=DEV)
            self.sb = self.wrapped._streamed
            self.call = lambda: first(self.wrapped(**self.x))
            self.update = self.wrapped.update_weights
            self.host = lambda key: self.wrapped.state_dict()[key]

    def expected(self):
        with torch.no_grad():
            return first(self.ref(**self.x))

    def out(self):
        with torch.no_grad():
            return self.call()

    def streamed_keys(self):
        sd = self.model.state_dict(keep_vars=True)
        return [k for k, t in sd.items() if id(t) in self.sb.host_views and t.is_floating_point()]


def scaled(sd, keys, f):
    return {k: (sd[k] * f).to(sd[k].dtype) for k in keys}


# ----------------------------------------------------------------------------- 1. update_weights
@pytest.mark.parametrize("name, cfg, direct", SCHEDULES, ids=IDS)
def test_failed_update_writes_nothing(name, cfg, direct):
    r = Runner(name, cfg, direct)
    keys = r.streamed_keys()
    for _ in range(2):
        assert torch.equal(r.out(), r.expected())  # slots prefetched for the next step
    good = scaled(r.ref.state_dict(), keys[:3], 0.5)
    bad_shape = dict(good, **{keys[3]: torch.zeros(1)})
    bad_dtype = dict(good, **{keys[3]: r.ref.state_dict()[keys[3]].double()})
    bad_name = dict(good, **{"no.such.key": torch.zeros(1)})
    for bad, what in ((bad_shape, keys[3]), (bad_dtype, keys[3]), (bad_name, "no.such.key")):
        with pytest.raises(WeightUpdateError, match=what.replace(".", r"\.")):
            r.update(bad)
        for _ in range(2):  # neither the next forward nor the one after sees a half update
            assert torch.equal(r.out(), r.expected())
    with pytest.raises(WeightUpdateError, match="a Tensor"):
        r.update({keys[0]: [1.0, 2.0]})
    assert torch.equal(r.out(), r.expected())


@pytest.mark.parametrize("name, cfg, direct", SCHEDULES, ids=IDS)
def test_update_takes_effect_at_the_very_next_forward(name, cfg, direct):
    r = Runner(name, cfg, direct)
    keys = r.streamed_keys()
    for round_ in range(3):
        r.out()
        new = scaled(r.ref.state_dict(), keys, 0.9)
        r.ref.load_state_dict(new, strict=False)
        assert r.update(new) == list(new)
        assert torch.equal(r.out(), r.expected()), f"round {round_}: the next forward used old weights"
        assert torch.equal(r.out(), r.expected())


@pytest.mark.parametrize("name, cfg, direct", SCHEDULES, ids=IDS)
def test_in_place_edit_of_state_dict_tensor_takes_effect(name, cfg, direct):
    """state_dict() tensors are views of the host store: an in-place edit through
    torch is picked up at the next step start (prefetched slots are reloaded)."""
    r = Runner(name, cfg, direct)
    keys = r.streamed_keys()
    for round_ in range(3):
        r.out()
        with torch.no_grad():
            for k in keys:  # every streamed block, so a prefetched slot is affected
                r.host(k).mul_(0.75)
                r.ref.state_dict()[k].mul_(0.75)
        assert torch.equal(r.out(), r.expected()), f"round {round_}: in-place edit not seen by the next forward"
    with torch.inference_mode():
        r.host(keys[-1]).add_(0.25)
    with torch.no_grad():
        r.ref.state_dict()[keys[-1]].add_(0.25)
    assert torch.equal(r.out(), r.expected())
