"""Module offload of split models (SupportsSplitOffload / SplitOffloadMixin) on CPU:
each part is its own unit, parts exclude each other, contexts move them, bad parts are refused."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from weightstream.demo_module import ToyDenoiser
from weightstream.offload.config import OffloadConfig
from weightstream.offload.module import ModuleOffload, SplitMovers, SplitOffloadMixin, SupportsSplitOffload
from weightstream.offload.pipeline import offload_pipeline


def cfg(components):
    return OffloadConfig.module(components, progress=False)


def swapped_on_device(handle: ModuleOffload) -> set[str]:
    return {n for n in handle.on_device() if handle.units[n].swapped}


class Reasoner(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.b(torch.relu(self.a(x))))


class SplitTransformer(nn.Module):
    """Implements SupportsSplitOffload by hand: a reasoner pass, then a generator
    pass, each under a model-local offload context."""

    def __init__(self, width=16):
        super().__init__()
        self.shared = nn.Linear(width, width)  # outside every part: stays on the device
        self.reasoner = Reasoner(width)
        self.generator = Reasoner(width)
        self._movers = None
        self.observed = []

    def enable_omni_model_cpu_offload(self, movers):
        self._movers = movers
        return {"reasoner": self.reasoner, "generator": self.generator}

    def disable_omni_model_cpu_offload(self):
        self._movers = None

    def _offload_context(self, part):
        return contextlib.nullcontext() if self._movers is None else self._movers.context(part)

    def forward(self, x):
        h = self.shared(x)
        with self._offload_context("reasoner"):
            if self._movers is not None:
                self.observed.append(self._movers.on_device())
            ctx = self.reasoner(h)
        with self._offload_context("generator"):
            if self._movers is not None:
                self.observed.append(self._movers.on_device())
            return self.generator(h + ctx)


class MixinSplit(SplitOffloadMixin, nn.Module):
    _offload_parts = {"reasoner": "inner.reasoner", "generator": "generator"}

    def __init__(self, width=16):
        super().__init__()
        self.inner = nn.Module()
        self.inner.reasoner = Reasoner(width)
        self.generator = Reasoner(width)

    def forward(self, x):
        with self._offload_context("reasoner"):
            ctx = self.inner.reasoner(x)
        with self._offload_context("generator"):
            return self.generator(x + ctx)


class SplitPipeline:
    def __init__(self, transformer):
        torch.manual_seed(0)
        self.text_encoder = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.transformer = transformer

    def __call__(self, x):
        return self.transformer(self.text_encoder(x))


@pytest.mark.parametrize("model_cls", [SplitTransformer, MixinSplit])
def test_split_model_contexts(model_cls):
    torch.manual_seed(3)
    pipe = SplitPipeline(model_cls())
    x = torch.randn(4, 16)
    expected = copy.deepcopy(pipe)(x)
    handle = offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device="cpu")
    assert set(handle.units) == {"text_encoder", "transformer:reasoner", "transformer:generator"}
    assert isinstance(pipe.transformer, SupportsSplitOffload)
    parts_seen = []

    def observer(part):
        def hook(module, args):
            on = swapped_on_device(handle)
            parts_seen.append((part, on))
            assert on == {f"transformer:{part}"}, on  # exactly one part, encoder gone
        return hook

    reasoner = "inner.reasoner" if model_cls is MixinSplit else "reasoner"
    observers = [pipe.transformer.get_submodule(reasoner).register_forward_pre_hook(observer("reasoner")),
                 pipe.transformer.generator.register_forward_pre_hook(observer("generator"))]
    for _ in range(3):
        assert torch.equal(pipe(x), expected)
    for o in observers:
        o.remove()
    assert [p for p, _ in parts_seen] == ["reasoner", "generator"] * 3
    if model_cls is SplitTransformer:
        assert pipe.transformer.observed == [("reasoner",), ("generator",)] * 3
    s = handle.stats()
    assert s["components"]["transformer:reasoner"]["arrivals"] == 3
    assert pipe.transformer.__dict__.get("_omni_movers", pipe.transformer.__dict__.get("_movers")) is not None
    handle.disable()
    assert pipe.transformer.__dict__.get("_omni_movers") is None and getattr(pipe.transformer, "_movers", None) is None
    assert torch.equal(pipe(x), expected)


def test_split_parts_exclude_each_other_even_as_encoder():
    class P:
        def __init__(self):
            self.text_encoder = SplitTransformer()  # split encoder: parts still exclusive
            self.transformer = ToyDenoiser(channels=16, width=16, text_width=16)

    pipe = P()
    handle = offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device="cpu")
    pipe.text_encoder(torch.randn(2, 16))
    assert pipe.text_encoder.observed == [("reasoner",), ("generator",)]
    assert swapped_on_device(handle) == {"text_encoder:generator"}


def test_split_context_rejects_unknown_part():
    pipe = SplitPipeline(SplitTransformer())
    offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device="cpu")
    movers = pipe.transformer._movers
    assert isinstance(movers, SplitMovers) and movers.parts == ("reasoner", "generator")
    with pytest.raises(ValueError, match="not a part.*reasoner, generator"):
        movers.context("decoder")


def test_split_model_bad_parts_rejected_and_undone():
    class Bad(SplitTransformer):
        def enable_omni_model_cpu_offload(self, movers):
            self._movers = movers
            return [self.reasoner]

    pipe = SplitPipeline(Bad())
    with pytest.raises(ValueError, match="expected a non-empty mapping"):
        offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device="cpu")
    assert pipe.transformer._movers is None  # delegated enable was undone
    assert pipe.transformer.reasoner.a.weight.numel() > 0  # nothing was touched

    class Foreign(SplitTransformer):
        def enable_omni_model_cpu_offload(self, movers):
            return {"reasoner": nn.Linear(2, 2)}

    with pytest.raises(ValueError, match="proper submodule"):
        offload_pipeline(SplitPipeline(Foreign()), cfg(["dit", "text_encoder"]), device="cpu")
