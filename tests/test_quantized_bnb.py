"""bitsandbytes streamed as it is (docs/quantized.md): ``Linear4bit`` nf4 (double quantization,
bf16 compute) and fp4 (diffusers' defaults: no double quantization, fp32 compute), and
``Linear8bitLt`` int8, on the CPU (bitsandbytes' portable CPU kernels). The block image holds the
packed weight and its quant-state tensors (absmax, nested absmax, SCB), the ring binds those very
tensor objects; bit-exact against the same bitsandbytes model unwrapped. The model is built the
way diffusers' ``BitsAndBytesConfig`` loader builds it (``weightstream.quant_models.bnb_quantize``)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("bitsandbytes")

from quantized_cases import DEV, cfg, check_auto_placement_and_coding, run  # noqa: E402
from weightstream import OffloadedTransformer, apply_layerwise_offload, offload_pipeline  # noqa: E402
from weightstream.models import flux_inputs, tiny_flux  # noqa: E402
from weightstream.offload.misuse import (  # noqa: E402
    StreamedModuleAccessError, UnsupportedCombinationError, UnsupportedOperationError, WeightUpdateError,
)
from weightstream.quant_models import bnb_quantize  # noqa: E402

LIN = "transformer_blocks.0.attn.to_q"
KINDS = {"nf4": dict(double_quant=True), "fp4": dict(double_quant=False, compute_dtype=torch.float32),
         "int8": {}}


def _quantize(kind, seed=0):
    return bnb_quantize(tiny_flux(seed=seed, dtype=torch.bfloat16), kind, **KINDS[kind])


@pytest.fixture(scope="module", params=list(KINDS))
def case(request):
    kind = request.param
    base = _quantize(kind)

    def make():
        return copy.deepcopy(base)

    ref = make()
    x = flux_inputs(ref, dtype=torch.bfloat16)
    return make, x, run(ref, x)[0], kind, ref


def _same_sd(got, want) -> bool:
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k].detach(), want[k].detach()) for k in want)


def test_wrapper_streams_the_packed_bytes(case, tmp_path):
    make, x, want, kind, ref = case
    wrapped = OffloadedTransformer(make(), cfg(), device=DEV)
    assert all(torch.equal(o, want) for o in run(wrapped, x, 3))
    s = wrapped.stats()
    assert s["quantized_format"] == "bitsandbytes"
    specs = {spec.name: spec for lay in wrapped.executor.source.layouts for spec in lay.tensors}
    w, lin = specs["attn.to_q.weight"], ref.get_submodule(LIN)
    if kind == "int8":
        assert w.dtype == torch.int8 and w.shape == (lin.out_features, lin.in_features) and specs["attn.to_q.SCB"].dtype == torch.float32
    else:  # two 4-bit values a byte, and the quant state beside them
        assert w.dtype == torch.uint8 and w.shape == (lin.out_features * lin.in_features // 2, 1)
        assert ("attn.to_q.weight.nested_absmax" in specs) == (kind == "nf4")
        assert specs["attn.to_q.weight.absmax"].dtype == (torch.uint8 if kind == "nf4" else torch.float32)
    linears = {f"{n}.weight" for blk in (ref.transformer_blocks[0], ref.single_transformer_blocks[0])
               for n, m in blk.named_modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt")}
    assert linears and all(specs[n].dtype in (torch.uint8, torch.int8) for n in linears)  # no bf16 copy
    sd = wrapped.state_dict()  # bitsandbytes' serialised form, as the model unwrapped gives it
    assert _same_sd(sd, ref.state_dict())
    suffix = {"nf4": ".weight.quant_state.bitsandbytes__nf4", "fp4": ".weight.quant_state.bitsandbytes__fp4",
              "int8": ".SCB"}[kind]
    assert LIN + suffix in sd
    wrapped.module.save_pretrained(str(tmp_path / "streamed"))  # what save_pretrained writes
    from safetensors.torch import load_file

    ref.save_pretrained(str(tmp_path / "resident"))
    got, exp = (load_file(str(tmp_path / d / "diffusion_pytorch_model.safetensors")) for d in ("streamed", "resident"))
    assert _same_sd(got, exp) and LIN + suffix in got
    plain = wrapped.disable()
    assert type(plain.get_submodule(LIN).weight).__name__ in ("Params4bit", "Int8Params")
    assert torch.equal(run(plain, x)[0], want)


@pytest.mark.parametrize("case", ["nf4", "int8"], indirect=True)  # fp4 binds as nf4 does (one case keeps it fast)
def test_in_place_resident_layers_and_pipelines(case):
    make, x, want, _, ref = case
    model = make()
    handle = apply_layerwise_offload(model, cfg(resident_layers=[0, 3]), device=DEV)
    assert all(torch.equal(o, want) for o in run(model, x, 2))
    assert handle.remove() is model
    assert torch.equal(run(model, x)[0], want)

    class Pipe:
        def __init__(self, transformer):
            self.transformer = transformer

    for mode in ("layer", "module"):
        pipe = Pipe(make())
        h = offload_pipeline(pipe, {"mode": mode, "components": ["dit"], "progress": False}, device=DEV)
        assert all(torch.equal(o, want) for o in run(pipe.transformer, x, 2)), mode
        assert _same_sd(pipe.transformer.state_dict(), ref.state_dict()), mode  # bnb's form, from the host
        h.disable()
        assert torch.equal(run(pipe.transformer, x)[0], want), mode


@pytest.mark.parametrize("case", ["nf4"], indirect=True)
def test_auto_placement_and_coding(case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch decode on the CPU
    make, x, want, _, _ = case
    specs = check_auto_placement_and_coding(make, x, want)  # packed 4-bit / int8 bytes stay raw
    assert any(spec.dtype in (torch.uint8, torch.int8) for spec in specs)


@pytest.mark.parametrize("case", ["nf4"], indirect=True)
def test_lora_on_a_bnb_model_streams(case):
    """peft LoRA on the bitsandbytes linears: the adapters stay resident, the packed bytes stream."""
    from peft import LoraConfig, inject_adapter_in_model

    make, x, _, _, _ = case
    lora = LoraConfig(r=4, target_modules=["to_q", "to_k"], init_lora_weights=False)
    ref = inject_adapter_in_model(lora, make())
    model = copy.deepcopy(ref)
    want = run(ref, x)[0]
    wrapped = OffloadedTransformer(model, cfg(), device=DEV)
    assert all(torch.equal(o, want) for o in run(wrapped, x, 2))


def test_update_weights_in_bnb_form(case):
    make, x, _, kind, ref = case
    wrapped = OffloadedTransformer(make(), cfg(), device=DEV)
    run(wrapped, x)
    n = ref.get_submodule(LIN).in_features
    other = _quantize(kind, seed=5)
    run(other, x)  # its state after a forward, as the wrapped model's
    new = other.state_dict()
    mine = {k: v for k, v in new.items() if k.startswith(LIN + ".")}
    blob = LIN + f".weight.quant_state.bitsandbytes__{kind}"
    if kind == "nf4":  # double quantization: the nested offset (in the blob) differs per weight
        with pytest.raises(WeightUpdateError, match="serialised quant state"):
            wrapped.update_weights(mine)
        mine.pop(blob)
        mine.pop(LIN + ".weight.nested_absmax")
        mine.pop(LIN + ".weight.absmax")
        mine.pop(LIN + ".weight")
    written = wrapped.update_weights(mine)
    assert set(written) == set(mine)
    got = wrapped.state_dict()
    assert all(torch.equal(got[k], v) for k, v in mine.items())
    if kind != "nf4":  # the whole model's bytes from another seed: its outputs, bit for bit
        wrapped.update_weights(new, strict=True)
        assert torch.equal(run(wrapped, x)[0], run(other, x)[0])
        assert _same_sd(wrapped.state_dict(), other.state_dict())
    key = LIN + (".SCB" if kind == "int8" else ".weight")
    with pytest.raises(WeightUpdateError):  # a bf16 weight is not this model's bytes
        wrapped.update_weights({LIN + ".weight": torch.zeros(n, n, dtype=torch.bfloat16)})
    if kind != "int8":
        fake = torch.zeros_like(got[blob]) if kind == "fp4" else got[blob]
        bad = {blob: fake} if kind == "fp4" else {LIN + ".weight.nested_quant_map": got[
            LIN + ".weight.nested_quant_map"] + 1}
        with pytest.raises(WeightUpdateError, match="nothing was written"):
            wrapped.update_weights(bad)
    assert torch.equal(wrapped.state_dict()[key], got[key])


def test_streamed_weight_between_forwards_is_a_named_error(case):
    make, x, _, _, _ = case
    wrapped = OffloadedTransformer(make(), cfg(), device=DEV)
    run(wrapped, x)
    lin = wrapped.module.get_submodule(LIN)
    with pytest.raises(StreamedModuleAccessError, match=LIN.replace(".", r"\.")):
        lin(torch.ones(1, lin.in_features, dtype=torch.bfloat16))


def test_cpu_repack_and_mmap_are_refused_by_name(tmp_path):
    model = _quantize("fp4")
    model.get_submodule(LIN).support_avx512bf16_for_cpu = True  # bitsandbytes on an AVX512-BF16 CPU
    with pytest.raises(UnsupportedOperationError, match="AVX512-BF16"):
        OffloadedTransformer(model, cfg(), device=DEV)
    from weightstream import offload_from_safetensors

    model.get_submodule(LIN).support_avx512bf16_for_cpu = False
    model.save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedCombinationError, match="format=bitsandbytes, transport=mmap"):
        offload_from_safetensors(model, str(tmp_path / "diffusion_pytorch_model.safetensors"), cfg(), device=DEV)


def test_perf_nf4_and_default_quantized_modes():
    """perf: `-qnf4` runs the model bitsandbytes nf4 (its yardstick `resident-qnf4`); the planned
    default takes a quantization variant (`default-qfp8`, `default-8gb-qnf4`)."""
    from perf.harness import _yardstick
    from perf.modes import parse_mode
    from perf.quantized import quantize
    from perf.results import summarise, validate_mode_name

    for name in ("layerwise-qnf4", "resident-qnf4", "default-qnf4", "default-8gb-qfp8", "graphs-qnf4"):
        validate_mode_name(name)
    spec = parse_mode("default-8gb-qnf4")
    assert spec.default and spec.quantize == "qnf4" and spec.weight_fill == "normal"
    assert spec.config_kw == {"device_memory_budget_gb": 8.0}
    assert parse_mode("default-qfp8").quantize == "qfp8"
    assert _yardstick("default-qnf4") == "resident-qnf4" and _yardstick("resident-qnf4") is None
    out = summarise({"resident-qnf4": {"step_ms": 100.0}, "layerwise-qnf4": {"step_ms": 105.0, "streamed_gb": 5.5},
                     "default-qnf4": {"step_ms": 101.0, "streamed_gb": 1.0}}, h2d_gbps=55.0)
    assert out["layerwise-qnf4"]["floor_ms"] == 100.0 and out["default-qnf4"]["ratio_to_resident"] == 1.01
    model = quantize(tiny_flux(dtype=torch.bfloat16), "qnf4")
    assert type(model.get_submodule(LIN)).__name__ == "Linear4bit"


def test_rehome_moves_the_resident_quant_state():
    """What of a bitsandbytes quant state does not stream (the quant maps, the nested map and
    offset) moves to the compute device at wrap time, for resident and streamed linears alike (meta
    here: the CPU has no second device; on CUDA a nested map left on the host was an illegal memory
    access in the first resident nf4 linear); unhome gives them back."""
    from weightstream.offload.host.quantized import rehome, unhome

    model = _quantize("nf4")
    states = [m.weight.quant_state for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert states and all(qs.state2 is not None for qs in states)
    undo = rehome(model, torch.device("meta"))
    assert all(t.device.type == "meta" for qs in states for t in (qs.code, qs.offset, qs.state2.code))
    assert all(qs.absmax.device.type == "cpu" for qs in states)  # streamed with its weight (a part)
    unhome(undo)
    assert all(t.device.type == "cpu" for qs in states for t in (qs.code, qs.offset, qs.state2.code))
