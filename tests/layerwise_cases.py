"""Checks shared by the CPU and GPU layerwise tests (device is a parameter)."""
import copy

import torch
from torch import nn

from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import ToyDiT, flux_inputs, tiny_flux, tiny_wan, toy_inputs, wan_inputs

MODELS = {
    "flux": (tiny_flux, flux_inputs),
    "wan": (tiny_wan, wan_inputs),
    "toy": (lambda dtype=torch.float32: ToyDiT(), lambda m, device="cpu", **kw: toy_inputs(device=device)),
}


def stream_config(**cfg) -> OffloadConfig:
    """``OffloadConfig.layerwise(**cfg)`` streaming every block raw unless ``cfg`` names
    ``resident_layers`` / ``weight_codec``: tests of the stream's own mechanics (on CUDA a config
    without them is the planned default, docs/configuration.md "The default"; on the CPU the same)."""
    kw = dict(cfg)
    kw.setdefault("weight_codec", "none")
    if "layer_options" not in kw:
        kw.setdefault("resident_layers", 0)
    return OffloadConfig.layerwise(**kw)


class ResidualBlocks(nn.Module):
    """Residual MLP blocks (non-diffusers); checkpoint keys equal runtime names (mmap opt-in)."""

    _supports_mmap_loading = True
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, width=16, n=3):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                    for _ in range(n))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)


def build(name, device, dtype=torch.float32):
    """(offloadable model on CPU, resident reference on device, inputs on device)."""
    make, inputs = MODELS[name]
    model = make(dtype=dtype) if name != "toy" else make()
    ref = copy.deepcopy(model).to(device)
    return model, ref, inputs(model, device=device)


def check_equal_outputs(name, device, *, dtype=torch.float32, steps=3, **cfg):
    model, ref, x = build(name, device, dtype)
    with torch.no_grad():
        expected = first(ref(**x))
        wrapped = OffloadedTransformer(model, stream_config(**cfg), device=device)
        outs = [first(wrapped(**x)) for _ in range(steps)]
    for i, out in enumerate(outs):
        assert out.device == expected.device
        assert torch.equal(out, expected), f"{name} step {i}: max diff {(out.float() - expected.float()).abs().max()}"
    return wrapped, ref, x
