"""Regional compile (diffusers' compile_repeated_blocks) over streamed blocks.

The block hooks that rebind parameters to slot views run eagerly, as graph
breaks (weightstream.offload.tracing.not_traced): traced, the rebinding was an
input mutation on views of another dtype that aot_autograd refuses. The CPU
tests use the aot_eager backend; the GPU test in test_compile_gpu.py inductor.
"""
import copy

import pytest
import torch

from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import flux_inputs, tiny_flux, tiny_wan, wan_inputs

MODELS = {"flux": (tiny_flux, flux_inputs), "wan": (tiny_wan, wan_inputs)}


def compiled_pair(name, device, backend, **cfg):
    make, inputs = MODELS[name]
    model = make()
    ref = copy.deepcopy(model).to(device)
    x = inputs(model, device=device)
    ref.compile_repeated_blocks(backend=backend)
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(**{"resident_layers": 0, "weight_codec": "none", **cfg}),
                                   device=device)
    model.compile_repeated_blocks(backend=backend)
    return ref, wrapped, x


@pytest.mark.parametrize("name", ["flux", "wan"])
@pytest.mark.parametrize("resident", [0, 2])
def test_regional_compile_bit_exact(name, resident):
    torch._dynamo.reset()
    ref, wrapped, x = compiled_pair(name, "cpu", "aot_eager", resident_layers=resident)
    with torch.no_grad():
        expected = ref(**x)[0]
        for step in range(3):
            out = wrapped(**x)[0]
            assert torch.equal(out, expected), f"{name} step {step}: {(out - expected).abs().max()}"


def test_regional_compile_sees_updated_weights():
    torch._dynamo.reset()
    ref, wrapped, x = compiled_pair("flux", "cpu", "aot_eager")
    with torch.no_grad():
        wrapped(**x)
        new = {k: v * 0.5 for k, v in ref.state_dict().items() if k.startswith("transformer_blocks.1.")}
        wrapped.update_weights(new)
        ref.load_state_dict(new, strict=False)
        assert torch.equal(wrapped(**x)[0], ref(**x)[0])
