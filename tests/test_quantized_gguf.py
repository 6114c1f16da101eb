"""GGUF weights (diffusers' GGUFParameter / GGUFLinear) streamed as they are: tiny Flux models
written to GGUF files with the ``gguf`` package (Q8_0 quantized from the weights, Q4_K as valid
random blocks) and loaded the way diffusers' GGUF quantizer does; every front end bit-exact
against the same GGUF model unwrapped (docs/quantized.md)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from quantized_cases import DEV, cfg, check_auto_placement_and_coding, run  # noqa: E402
from weightstream import OffloadedTransformer, apply_layerwise_offload, offload_pipeline  # noqa: E402
from weightstream.models import flux_inputs, tiny_flux  # noqa: E402
from weightstream.offload.misuse import WeightUpdateError  # noqa: E402
from weightstream.quant_models import load_gguf, write_gguf  # noqa: E402
from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter  # noqa: E402

# Q4_K blocks hold 256 values: rows of 256 (heads x head_dim) and 1024 (the MLP)
WIDE = dict(attention_head_dim=64, num_attention_heads=4, axes_dims_rope=(16, 24, 24), joint_attention_dim=256)


@pytest.fixture(scope="module", params=["Q8_0", "Q4_K"])
def gguf_case(request, tmp_path_factory):
    """(a fresh GGUF model maker, inputs, the unwrapped model's output, the quant type)."""
    quant = request.param
    path = tmp_path_factory.mktemp("gguf") / f"flux-{quant}.gguf"
    keys = write_gguf(tiny_flux(dtype=torch.bfloat16, **WIDE), path, quant)
    assert keys

    def make():
        return load_gguf(tiny_flux(dtype=torch.bfloat16, **WIDE), path)

    ref = make()
    x = flux_inputs(ref, dtype=torch.bfloat16)
    return make, x, run(ref, x)[0], quant


def _gguf_weights(model):
    return {k: v for k, v in model.state_dict().items() if isinstance(v, GGUFParameter)}


def test_wrapper_streams_the_gguf_bytes(gguf_case):
    make, x, want, quant = gguf_case
    model = make()
    ref = make()
    n_gguf = sum(isinstance(m, GGUFLinear) for m in model.modules())
    assert n_gguf >= 5
    wrapped = OffloadedTransformer(model, cfg(), device=DEV)
    assert all(torch.equal(o, want) for o in run(wrapped, x, 3))
    s = wrapped.stats()
    assert s["quantized_format"] == "gguf"
    layouts = wrapped.executor.source.layouts
    assert any(spec.dtype == torch.uint8 for lay in layouts for spec in lay.tensors)  # the GGUF bytes
    sd, rsd = wrapped.state_dict(), _gguf_weights(ref)
    for k, v in rsd.items():  # the quantized tensors, as the model has them
        assert type(sd[k]) is GGUFParameter and sd[k].quant_type == v.quant_type and torch.equal(sd[k], v), k
    w = wrapped.module.transformer_blocks[0].attn.to_q.weight  # between forwards: .data is a device copy
    data = w.data
    assert type(data) is GGUFParameter and data.quant_type == w.quant_type and torch.equal(data, rsd[
        "transformer_blocks.0.attn.to_q.weight"])
    plain = wrapped.disable()
    assert isinstance(plain.transformer_blocks[0].attn.to_q.weight, GGUFParameter)
    assert torch.equal(run(plain, x)[0], want)


def test_in_place_resident_and_pipelines(gguf_case):
    make, x, want, _ = gguf_case
    model = make()
    handle = apply_layerwise_offload(model, cfg(resident_layers=2), device=DEV)
    assert all(torch.equal(o, want) for o in run(model, x, 2))
    handle.remove()

    class Pipe:
        def __init__(self, transformer):
            self.transformer = transformer

    for pipe_cfg in ({"mode": "layer", "components": ["dit"], "progress": False},
                     {"mode": "module", "components": ["dit"], "progress": False}):
        pipe = Pipe(make())
        h = offload_pipeline(pipe, pipe_cfg, device=DEV)
        assert all(torch.equal(o, want) for o in run(pipe.transformer, x, 2)), pipe_cfg["mode"]
        assert any(isinstance(v, GGUFParameter) for v in pipe.transformer.state_dict().values())
        h.disable()


def test_auto_placement_and_coding(gguf_case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch decode on the CPU
    make, x, want, _ = gguf_case
    check_auto_placement_and_coding(make, x, want)  # uint8 GGUF bytes stay raw


def test_update_weights_of_gguf_tensors(gguf_case):
    make, x, _, quant = gguf_case
    model, other = make(), make()
    key = "single_transformer_blocks.0.proj_out.weight"
    old = _gguf_weights(other)[key]
    new = GGUFParameter(torch.flip(old.as_tensor(), dims=[0]).contiguous(), quant_type=old.quant_type)
    wrapped = OffloadedTransformer(model, cfg(), device=DEV)
    run(wrapped, x)
    assert wrapped.update_weights({key: new}) == [key]
    other.get_submodule(key.rsplit(".", 1)[0]).weight.data.copy_(new.as_tensor())
    assert torch.equal(run(wrapped, x)[0], run(other, x)[0])
    with pytest.raises(WeightUpdateError, match="quant_type"):
        wrapped.update_weights({key: new.as_tensor()})  # plain bytes: their quant type is not known


def test_mmap_of_a_gguf_model_from_a_safetensors_file_is_named(gguf_case, tmp_path):
    """A GGUF model streams from its .gguf file (tests/test_quantized_gguf_mmap.py); a safetensors file of
    plain weights does not hold its quantized bytes: a CheckpointFormatError naming the key and both forms."""
    from safetensors.torch import save_file

    from weightstream import CheckpointFormatError, offload_from_safetensors

    make, _, _, quant = gguf_case
    path = tmp_path / "model.safetensors"
    save_file(tiny_flux(dtype=torch.bfloat16, **WIDE).state_dict(), str(path))
    with pytest.raises(CheckpointFormatError, match=rf"\.weight': the model's tensor is a GGUF weight of quant_type "
                       rf"{quant} .*plain torch.bfloat16 tensor of a safetensors file"):
        offload_from_safetensors(make(), str(path), cfg())
