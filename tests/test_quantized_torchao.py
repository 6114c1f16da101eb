"""torchao weight-only quantization (tensor subclasses: ``Int8Tensor``, ``Float8Tensor``) streamed
as it is: the block image holds the inner tensors' bytes (qdata, scale, ...), the slot their
views, and the subclass object reads them as its attributes; bit-exact against the same
quantized model unwrapped (docs/quantized.md)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchao")

from quantized_cases import DEV, cfg, check_auto_placement_and_coding, run  # noqa: E402
from weightstream import OffloadedTransformer, apply_layerwise_offload, offload_pipeline  # noqa: E402
from weightstream.models import flux_inputs, tiny_flux  # noqa: E402
from weightstream.offload.misuse import WeightUpdateError  # noqa: E402
from weightstream.quant_models import block_linears, torchao_weight_only  # noqa: E402

KEY = "single_transformer_blocks.1.proj_out.weight"


@pytest.fixture(scope="module", params=["int8", "float8"])
def ao_case(request):
    kind = request.param

    def make():
        return torchao_weight_only(tiny_flux(dtype=torch.bfloat16), kind)

    ref = make()
    x = flux_inputs(ref, dtype=torch.bfloat16)
    return make, x, run(ref, x)[0], kind


def _quantized(model):
    return {k: v for k, v in model.state_dict().items() if type(v).__module__.startswith("torchao.")}


def _bytes(t) -> int:
    return sum(v.nbytes for v in (getattr(t, n) for n in t.__tensor_flatten__()[0]))


def test_wrapper_streams_the_quantized_bytes(ao_case):
    make, x, want, kind = ao_case
    model, ref = make(), make()
    q = _quantized(ref)
    assert len(q) == len(block_linears(tiny_flux())) and all(type(v).__name__ in ("Int8Tensor", "Float8Tensor")
                                                             for v in q.values())
    wrapped = OffloadedTransformer(model, cfg(), device=DEV)
    assert all(torch.equal(o, want) for o in run(wrapped, x, 3))
    s = wrapped.stats()
    assert s["quantized_format"] == "torchao"
    specs = {spec.name: spec for lay in wrapped.executor.source.layouts for spec in lay.tensors}
    qdata = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    assert specs["attn.to_q.weight[qdata]"].dtype == qdata  # the image holds the quantized bytes
    assert not any(n.endswith("to_q.weight") for n in specs)  # and no bf16 weight
    sd = wrapped.state_dict()
    for k, v in q.items():  # the quantized tensors, rebuilt over the host bytes
        assert type(sd[k]) is type(v) and sd[k].__tensor_flatten__()[1] == v.__tensor_flatten__()[1], k
        assert all(torch.equal(getattr(sd[k], n), getattr(v, n)) for n in v.__tensor_flatten__()[0]), k
    plain = wrapped.disable()
    assert type(plain.transformer_blocks[0].attn.to_q.weight).__name__ in ("Int8Tensor", "Float8Tensor")
    assert torch.equal(run(plain, x)[0], want)


def test_in_place_resident_and_layer_pipeline(ao_case):
    make, x, want, _ = ao_case
    model = make()
    handle = apply_layerwise_offload(model, cfg(resident_layers=[0, 3]), device=DEV)
    assert all(torch.equal(o, want) for o in run(model, x, 2))
    assert handle.remove() is model
    assert torch.equal(run(model, x)[0], want)

    class Pipe:
        def __init__(self, transformer):
            self.transformer = transformer

    pipe = Pipe(make())
    h = offload_pipeline(pipe, {"mode": "layer", "components": ["dit"], "progress": False}, device=DEV)
    assert all(torch.equal(o, want) for o in run(pipe.transformer, x, 2))
    h.disable()
    pipe = Pipe(make())
    h = offload_pipeline(pipe, {"mode": "module", "components": ["dit"], "progress": False}, device=DEV)
    assert all(torch.equal(o, want) for o in run(pipe.transformer, x, 2))
    sd = pipe.transformer.state_dict()
    assert type(sd["transformer_blocks.0.attn.to_q.weight"]).__name__ in ("Int8Tensor", "Float8Tensor")
    h.disable()
    assert torch.equal(run(pipe.transformer, x)[0], want)


def test_auto_placement_and_coding(ao_case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch decode on the CPU
    make, x, want, _ = ao_case
    check_auto_placement_and_coding(make, x, want)  # int8 bytes stay raw, fp8 qdata and bf16 scales may code


def test_update_weights_of_quantized_tensors(ao_case):
    make, x, _, kind = ao_case
    model, other = make(), make()
    source = torchao_weight_only(tiny_flux(seed=5, dtype=torch.bfloat16), kind)
    new = _quantized(source)[KEY]
    wrapped = OffloadedTransformer(model, cfg(), device=DEV)
    run(wrapped, x)
    assert wrapped.update_weights({KEY: new}) == [KEY]
    owner = other.get_submodule(KEY.rsplit(".", 1)[0])
    owner.weight = torch.nn.Parameter(copy.deepcopy(new), requires_grad=False)
    assert torch.equal(run(wrapped, x)[0], run(other, x)[0])
    got = wrapped.state_dict()[KEY]
    assert all(torch.equal(getattr(got, n), getattr(new, n)) for n in new.__tensor_flatten__()[0])
    with pytest.raises(WeightUpdateError, match="quantized with the same config"):
        wrapped.update_weights({KEY: torch.zeros(new.shape, dtype=torch.bfloat16)})


def test_rehome_keeps_the_inner_tensor_objects():
    """The wrapper-side half of streaming a subclass: its outer tensor moves to the compute device
    (meta here: the CPU has no second device) and keeps the inner tensor objects the ring binds."""
    from weightstream.offload.host.quantized import inner_tensors, rehome, unhome

    model = torchao_weight_only(tiny_flux(dtype=torch.bfloat16), "int8")
    w = model.transformer_blocks[0].attn.to_q.weight
    before = [(n, v, v.clone()) for n, v in inner_tensors(w)]
    shape, stride, ident = w.shape, w.stride(), id(w)
    moved = rehome(model, torch.device("meta"))
    assert len(moved) == len(block_linears(model))
    w = model.transformer_blocks[0].attn.to_q.weight
    assert id(w) == ident and w.device.type == "meta" and w.shape == shape and w.stride() == stride
    assert isinstance(w, torch.nn.Parameter) and type(w).__name__ == "Int8Tensor"
    for (n, v, copy_), (m, u) in zip(before, inner_tensors(w)):
        assert n == m and u is v and torch.equal(u, copy_)
    unhome(moved)  # a setup that failed after it: back on the CPU, the same objects
    w = model.transformer_blocks[0].attn.to_q.weight
    assert id(w) == ident and w.device.type == "cpu" and all(u is v for (_, v, _), (_, u) in zip(before, inner_tensors(w)))


def test_reading_a_streamed_subclass_between_forwards_is_a_named_error(ao_case):
    from weightstream.offload.misuse import StreamedModuleAccessError

    make, x, _, _ = ao_case
    wrapped = OffloadedTransformer(make(), cfg(), device=DEV)
    run(wrapped, x)
    w = wrapped.module.transformer_blocks[0].attn.to_q.weight
    with pytest.raises(StreamedModuleAccessError, match=r"transformer_blocks\.0\.attn\.to_q\.weight\[qdata\]"):
        w.dequantize()
    with pytest.raises(StreamedModuleAccessError, match="outside"):
        torch.nn.functional.linear(torch.ones(1, w.shape[1], dtype=torch.bfloat16), w)
