"""Quantized weights streamed as they are (docs/quantized.md): diffusers' layerwise casting
(float8 storage, bf16 compute) on the CPU, every front end, bit-exact against the same casted
model unwrapped. GGUF: tests/test_quantized_gguf.py; torchao: tests/test_quantized_torchao.py.

The casting model is built twice from one seed (a deep copy of a casted model shares its
diffusers hooks with the original, which then cast the wrong module)."""
from __future__ import annotations

import pytest
import torch

from weightstream import (
    OffloadConfig, OffloadedTransformer, apply_layerwise_offload, offload_pipeline,
)
from weightstream.models import flux_inputs, tiny_flux
from weightstream.offload.discovery import discover_blocks
from weightstream.offload.host.quantized import quantized_format
from weightstream.offload.layout import block_tensors, build_layout
from weightstream.offload.misuse import AlreadyOffloadedError

DEV = "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def casted(storage=torch.float8_e4m3fn, **overrides):
    model = tiny_flux(dtype=torch.bfloat16, **overrides)
    model.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.bfloat16)
    return model


def _cfg(**kw):
    return OffloadConfig.layerwise(progress=False, **kw)


def _run(model, x, steps=1):
    with torch.no_grad():
        return [model(**x)[0] for _ in range(steps)]


def image_bytes(model) -> int:
    """The block images' bytes of ``model`` as it is (quantized tensors at their own size)."""
    return sum(build_layout(b.index, b.name, block_tensors(b.module)).nbytes for b in discover_blocks(model, None))


def _tensor_bytes(model) -> int:
    return sum(t.nbytes for b in discover_blocks(model, None) for _, _, t in block_tensors(b.module))


@pytest.fixture(scope="module")
def case():
    ref = casted()
    x = flux_inputs(ref, dtype=torch.bfloat16)
    return ref, x, _run(ref, x)[0]


@pytest.mark.parametrize("storage", FP8)
def test_wrapper_streams_the_fp8_bytes_bit_exact(storage):
    model, ref = casted(storage), casted(storage)
    x = flux_inputs(ref, dtype=torch.bfloat16)
    want = _run(ref, x)[0]
    fp8_bytes, bf16_bytes = image_bytes(ref), image_bytes(tiny_flux(dtype=torch.bfloat16))
    assert quantized_format(model) == "layerwise-casting"
    wrapped = OffloadedTransformer(model, _cfg(), device=DEV)
    assert all(torch.equal(o, want) for o in _run(wrapped, x, 3))
    s = wrapped.stats()
    assert s["streamed_bytes_per_step"] == fp8_bytes < bf16_bytes  # the fp8 bytes, no bf16 copy
    # norm layers stay bf16 (diffusers skips "norm" modules by default); tiny tensors pad to 512 bytes
    assert _tensor_bytes(ref) < 0.7 * _tensor_bytes(tiny_flux(dtype=torch.bfloat16))
    assert s["quantized_format"] == "layerwise-casting"
    assert s["host_bytes"] < fp8_bytes + 4096 * s["blocks_streamed"]  # each image page-aligned
    sd, rsd = wrapped.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys()
    assert all(sd[k].dtype == rsd[k].dtype and torch.equal(sd[k].view(torch.uint8), rsd[k].view(torch.uint8))
               for k in rsd)
    assert sd["transformer_blocks.0.attn.to_q.weight"].dtype == storage
    plain = wrapped.disable()
    assert plain.transformer_blocks[0].attn.to_q.weight.dtype == storage  # still casted, on its own
    assert torch.equal(_run(plain, x)[0], want)


def test_in_place_and_remove(case):
    ref, x, want = case
    model = casted()
    handle = apply_layerwise_offload(model, _cfg(), device=DEV)
    assert all(torch.equal(o, want) for o in _run(model, x, 2))
    assert handle.remove() is model
    assert torch.equal(_run(model, x)[0], want)


@pytest.mark.parametrize("resident", [2, [1, 3]])
def test_resident_layers(case, resident):
    ref, x, want = case
    wrapped = OffloadedTransformer(casted(), _cfg(resident_layers=resident), device=DEV)
    assert all(torch.equal(o, want) for o in _run(wrapped, x, 2))


def test_auto_placement_counts_the_fp8_bytes(case):
    ref, x, want = case
    probe = OffloadedTransformer(casted(), _cfg(), device=DEV)
    sizes, fixed = [lay.nbytes for lay in probe.executor.source.layouts], probe.stats()["resident_bytes"]
    probe.disable()
    budget = fixed + 2 * max(sizes) + sum(sizes) // 2  # two slots and about half the fp8 blocks
    wrapped = OffloadedTransformer(casted(), _cfg(resident_layers="auto", device_memory_budget_gb=budget / 1e9),
                                   device=DEV)
    wrapped._streamed.placement.h2d_gbps = 1e-6  # transfer-bound (the CPU's measured rate is noise)
    assert all(torch.equal(o, want) for o in _run(wrapped, x, 4))
    s = wrapped.stats()
    assert 0 < s["blocks_resident"] < len(sizes), s  # the planner fit blocks by their fp8 bytes
    assert s["placement"]["device_bytes"] <= budget
    assert torch.equal(_run(wrapped.disable(), x)[0], want)


@pytest.mark.parametrize("codec", ["exp-k", "auto"])
def test_coded_images_of_fp8_tensors_exact(case, codec, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch decode on the CPU
    ref, x, want = case
    wrapped = OffloadedTransformer(casted(), _cfg(weight_codec=codec), device=DEV)
    assert all(torch.equal(o, want) for o in _run(wrapped, x, 3))
    sd = wrapped.state_dict()
    assert sd["single_transformer_blocks.2.proj_mlp.weight"].dtype == torch.float8_e4m3fn


WIDE = dict(attention_head_dim=32, num_attention_heads=4, axes_dims_rope=(8, 12, 12))  # tensors of 16-256 Ki


@pytest.mark.parametrize("storage,codec", [(torch.float8_e4m3fn, "exp-k"), (torch.float8_e5m2, "auto")])
def test_fp8_tensors_code_below_their_bytes_bit_exact(storage, codec, monkeypatch):
    """The codec codes the float8 bytes (kernels/codec_format.py: the byte is the symbol): coded
    images below the fp8 bytes, outputs bit-exact; "auto" on a transfer-bound link codes them too."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch decode on the CPU
    import time

    ref = casted(storage, **WIDE)
    x = flux_inputs(ref, dtype=torch.bfloat16)
    want = _run(ref, x)[0]
    wrapped = OffloadedTransformer(casted(storage, **WIDE), _cfg(weight_codec=codec, resident_layers=0), device=DEV)
    if codec == "auto":  # what a slow link would measure (the CPU's rates are noise)
        planner = wrapped._streamed.codec_planner
        planner.h2d_gbps, planner.decode_gbps = 1e-6, {"exp-k": 1e3, "exp-k2": 1e3}
    outs = _run(wrapped, x, 2)
    t0 = time.monotonic()
    while wrapped.stats().get("coding_in_background") is not None:  # "auto": coded on a thread
        assert time.monotonic() - t0 < 60
        time.sleep(0.02)
        outs += _run(wrapped, x)
    outs += _run(wrapped, x)
    assert all(torch.equal(o, want) for o in outs)
    s = wrapped.stats()
    assert s["raw_bytes"] == image_bytes(ref) and s["coded_blocks"] == 5, s
    assert s["coded_bytes"] < 0.8 * s["raw_bytes"], s  # ~0.72 (exp-k) / ~0.70 (exp-k2) of the fp8 bytes
    tables = wrapped.executor.source.images.tables  # the coded images: float8 tensors coded, not raw
    assert any(g.header.dtype == storage and g.header.k < 8 for t in tables for g in t.segments)
    if codec == "exp-k":  # an update of an fp8 tensor re-encodes its block: exact
        key = "single_transformer_blocks.1.proj_out.weight"
        new = (torch.randn(ref.state_dict()[key].shape, generator=torch.Generator().manual_seed(3)) * 0.05
               ).to(storage)
        assert wrapped.update_weights({key: new}) == [key]
        ref.load_state_dict({key: new}, strict=False)
        assert torch.equal(_run(wrapped, x)[0], _run(ref, x)[0])
        assert torch.equal(wrapped.state_dict()[key].view(torch.uint8), new.view(torch.uint8))


def test_update_weights_of_fp8_tensors(case):
    ref, x, _ = case
    model, other = casted(), casted()
    key = "single_transformer_blocks.1.proj_out.weight"
    new = (torch.randn(other.state_dict()[key].shape, generator=torch.Generator().manual_seed(3)) * 0.05
           ).to(torch.float8_e4m3fn)
    wrapped = OffloadedTransformer(model, _cfg(), device=DEV)
    _run(wrapped, x)
    assert wrapped.update_weights({key: new}) == [key]
    other.load_state_dict({key: new}, strict=False)
    assert torch.equal(_run(wrapped, x)[0], _run(other, x)[0])
    assert torch.equal(wrapped.state_dict()[key].view(torch.uint8), new.view(torch.uint8))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        wrapped.update_weights({key: new.to(torch.bfloat16)})


class _Pipe:
    """A pipeline object holding a casted transformer (module offload discovers ``transformer``)."""

    def __init__(self, transformer):
        self.transformer = transformer


def test_pipeline_layer_and_module_mode(case):
    ref, x, want = case
    for cfg in ({"mode": "layer", "components": ["dit"], "progress": False},
                {"mode": "module", "components": ["dit"], "progress": False}):
        pipe = _Pipe(casted())
        handle = offload_pipeline(pipe, cfg, device=DEV)
        assert all(torch.equal(o, want) for o in _run(pipe.transformer, x, 2)), cfg["mode"]
        sd = pipe.transformer.state_dict()
        assert sd["transformer_blocks.1.ff.net.2.weight"].dtype == torch.float8_e4m3fn
        handle.disable()
        assert torch.equal(_run(pipe.transformer, x)[0], want)


def test_other_diffusers_hooks_are_still_refused():
    from diffusers.hooks import HookRegistry, ModelHook

    model = casted()
    HookRegistry.check_if_exists_or_initialize(model.transformer_blocks[1].attn.to_k).register_hook(
        ModelHook(), "probe")
    with pytest.raises(AlreadyOffloadedError, match=r"to_k carries diffusers hooks \(probe"):
        OffloadedTransformer(model, _cfg(), device=DEV)


def test_perf_quantized_modes_compare_with_their_resident_quantized_model():
    """perf/quantized.py: `*-q<x>` modes run the model quantized, compare with `resident-q<x>`
    bit for bit, and their floor is max(that step, quantized bytes / best H2D)."""
    from perf.harness import _yardstick
    from perf.modes import parse_mode
    from perf.results import summarise

    spec = parse_mode("graphs-r2-qgguf8")
    assert (spec.kind, spec.quantize, spec.config_kw) == ("weightstream", "qgguf8",
                                                          {"cuda_graphs": "on", "resident_layers": 2})
    assert parse_mode("layerwise-coded-qfp8").weight_fill == "normal"  # the yardstick's weights
    assert _yardstick("layerwise-qint8") == "resident-qint8" and _yardstick("resident-qint8") is None
    assert parse_mode("diffusers-block-qfp8").kind == "diffusers-group"
    with pytest.raises(ValueError, match="not -mmap"):
        parse_mode("layerwise-mmap-qfp8")
    out = summarise({"resident": {"step_ms": 100.0}, "resident-qfp8": {"step_ms": 110.0},
                     "layerwise-qfp8": {"step_ms": 121.0, "streamed_gb": 5.5}}, h2d_gbps=55.0)
    assert out["layerwise-qfp8"]["floor_ms"] == 110.0 and out["layerwise-qfp8"]["ratio_to_resident"] == 1.1
    assert "floor_ms" not in out["resident-qfp8"]


def test_save_pretrained_writes_the_fp8_tensors(case, tmp_path):
    from safetensors.torch import load_file

    ref, x, want = case
    wrapped = OffloadedTransformer(casted(), _cfg(), device=DEV)
    _run(wrapped, x)
    wrapped.module.save_pretrained(str(tmp_path / "streamed"))
    ref.save_pretrained(str(tmp_path / "resident"))
    got = load_file(str(tmp_path / "streamed" / "diffusion_pytorch_model.safetensors"))
    exp = load_file(str(tmp_path / "resident" / "diffusion_pytorch_model.safetensors"))
    assert got.keys() == exp.keys()
    assert all(got[k].dtype == exp[k].dtype and torch.equal(got[k].view(torch.uint8), exp[k].view(torch.uint8))
               for k in exp)
    assert got["transformer_blocks.0.attn.to_q.weight"].dtype == torch.float8_e4m3fn


def test_module_mode_keeps_casted_tensors_on_the_unit_buffer(case):
    """Module offload: after a forward the casting hook leaves float8 copies; CastingRebind binds
    them back to the unit's buffer, so nothing is written back and no copy stays on the device."""
    ref, x, want = case
    pipe = _Pipe(casted())
    handle = offload_pipeline(pipe, {"mode": "module", "components": ["dit"], "progress": False}, device=DEV)
    assert all(torch.equal(o, want) for o in _run(pipe.transformer, x, 2))
    (unit,) = handle.units.values()
    lo = unit.buffer.data_ptr()
    hi = lo + unit.buffer.numel()
    w = pipe.transformer.transformer_blocks[0].attn.to_q.weight
    assert lo <= w.data_ptr() < hi  # on the unit's buffer, not on the casting hook's copy
    assert handle.edits.write_back(unit) == 0
    assert any("CastingRebind" in repr(h) for h in handle.hooks)
    handle.disable()
    assert torch.equal(_run(pipe.transformer, x)[0], want)


def test_resident_cast_leaves_keep_their_storage(case):
    """Layerwise casting re-creates each leaf's tensors after its forward (``module.to(storage)``);
    outside the streamed blocks (embedders, resident blocks) the leaf gets its own storage back:
    what a CUDA graph captured its reads from, what an update writes (a resident block here)."""
    ref, x, _ = case
    model, other = casted(), casted()
    wrapped = OffloadedTransformer(model, _cfg(resident_layers=[1]), device=DEV)
    keys = ["x_embedder.weight", "transformer_blocks.1.attn.to_q.weight", "proj_out.weight"]
    params = dict(model.named_parameters())
    before = [params[k].data_ptr() for k in keys]
    _run(wrapped, x, 2)
    assert [params[k].data_ptr() for k in keys] == before
    assert all(h.removed is False for h in wrapped.executor.hooks)
    key = "transformer_blocks.1.attn.to_q.weight"
    new = (torch.randn(params[key].shape, generator=torch.Generator().manual_seed(5)) * 0.05).to(torch.float8_e4m3fn)
    assert wrapped.update_weights({key: new}) == [key]
    other.load_state_dict({key: new}, strict=False)
    assert all(torch.equal(o, _run(other, x)[0]) for o in _run(wrapped, x, 2))
