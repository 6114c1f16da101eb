"""Quantized blocks on CUDA (pytest -m gpu): layerwise casting (fp8), GGUF Q8_0 / Q4_K, torchao
int8 / float8 weight-only and bitsandbytes nf4 / fp4 / int8, streamed eager and under CUDA graphs (the graph captures the copies
into the quantized slots and the modules' own dequantizing compute), resident layers, pinned
bytes = quantized bytes; each bit-exact against the same quantized model resident on the GPU.
The graph cases run in a fresh process each (as tests/test_graphs_gpu.py)."""
import os

import pytest

from isolated import run_in_process

pytestmark = pytest.mark.gpu
FORMATS = ["fp8-e4m3fn", "fp8-e5m2", "gguf-Q8_0", "gguf-Q4_K", "torchao-int8", "torchao-float8", "bnb-nf4", "bnb-fp4",
           "bnb-int8"]
# under CUDA graphs bitsandbytes int8 without its outlier decomposition (llm_int8_threshold=0): the outlier
# columns of the default threshold are data-dependent (argwhere), which no graph (resident either) captures
GRAPH_FORMATS = [f if f != "bnb-int8" else "bnb-int8t0" for f in FORMATS]
# diffusers' GGUF K-quant dequantization makes a tensor from a Python list on the device per call
# (torch.tensor([0, 4], device=...)): a pageable host-to-device copy, which no capture allows
EAGER_UNDER_GRAPHS = ("gguf-Q4_K",)
WIDE = dict(attention_head_dim=64, num_attention_heads=4, axes_dims_rope=(16, 24, 24), joint_attention_dim=256)


def make(fmt: str, folder: str, device: str = "cpu"):
    """A fresh tiny Flux quantized as ``fmt`` (the same weights every call), on ``device``."""
    import torch

    from weightstream.models import tiny_flux
    from weightstream.quant_models import layerwise_fp8, load_gguf, torchao_weight_only, write_gguf

    kind, _, arg = fmt.partition("-")
    base = tiny_flux(dtype=torch.bfloat16, **WIDE)
    if kind == "bnb":  # quantized on the GPU (bitsandbytes' CUDA kernels), held on ``device``
        from weightstream.quant_models import bnb_quantize

        threshold = 0.0 if arg == "int8t0" else 6.0
        return bnb_quantize(base, arg.removesuffix("t0"), double_quant=arg == "nf4", int8_threshold=threshold,
                            quantize_on="cuda", device=device)
    if kind == "fp8":
        return layerwise_fp8(base, getattr(torch, f"float8_{arg}")).to(device)
    if kind == "torchao":
        return torchao_weight_only(base, arg).to(device)
    path = os.path.join(folder, f"flux-{arg}.gguf")
    if not os.path.exists(path):
        write_gguf(tiny_flux(dtype=torch.bfloat16, **WIDE), path, arg)
    return load_gguf(base, path).to(device)


def case(fmt: str, folder: str, graphs: str = "off", resident: int = 0, steps: int = 5, codec: str = "none") -> None:
    import torch

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import flux_inputs

    ref = make(fmt, folder, "cuda")
    x = flux_inputs(ref, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = ref(**x)[0]
        cfg = OffloadConfig.layerwise(cuda_graphs=graphs, resident_layers=resident, progress=False, weight_codec=codec)
        w = OffloadedTransformer(make(fmt, folder), cfg, device="cuda")
        outs = [w(**x)[0] for _ in range(steps)]
    bad = [float((o.float() - want.float()).abs().max()) for o in outs if not torch.equal(o, want)]
    assert not bad, (fmt, graphs, bad)
    s = w.stats()
    assert s["pinned"] is True and s["quantized_format"] == {"fp8": "layerwise-casting", "bnb": "bitsandbytes"}.get(
        fmt.partition("-")[0], fmt.partition("-")[0])
    images = sum(lay.nbytes for lay in w._streamed.layouts)
    if codec == "none":
        assert s["pinned_bytes"] == s["host_bytes"] < images + 4096 * s["blocks_streamed"]  # the quantized bytes
    else:  # fp8 bytes coded (on the GPU encoder), decoded by the Triton kernel into the slots
        assert s["coded_bytes"] < 0.85 * s["raw_bytes"] and s["h2d_bytes_per_step"] < s["raw_bytes"], s
    if graphs == "on":
        c = w.graphs.counts
        if fmt in EAGER_UNDER_GRAPHS:  # refused by the capture itself, resident too (docs/quantized.md)
            assert c["capture"] == 0 and c["eager-fallback"] >= 1 and c["replay"] == 0, c
        else:
            assert c["capture"] >= 1 and c["replay"] >= 1, c
    back = w.disable()
    with torch.no_grad():
        assert torch.equal(back(**x)[0], want)


def run_isolated(fmt, folder, **kw):
    return run_in_process("test_quantized_gpu", f"case({fmt!r}, {str(folder)!r}, **{kw!r})", what=f"{fmt} {kw}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_eager_on_cuda(fmt, tmp_path):
    case(fmt, str(tmp_path), steps=3)
    case(fmt, str(tmp_path), resident=2, steps=2)


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2", "exp-kp"])
@pytest.mark.parametrize("fmt", ["fp8-e4m3fn", "fp8-e5m2"])
def test_coded_fp8_images_on_cuda(fmt, codec, tmp_path):
    """The codec's 8-bit path on the device: fp8 tensors coded, decoded into the slots, eager and
    captured in CUDA graphs (the decode inside the step's graph), bit-exact."""
    case(fmt, str(tmp_path), steps=3, codec=codec)
    run_isolated(fmt, tmp_path, graphs="on", codec=codec)


@pytest.mark.parametrize("fmt", GRAPH_FORMATS)
def test_cuda_graphs_capture_the_quantized_slots(fmt, tmp_path):
    run_isolated(fmt, tmp_path, graphs="on")
    run_isolated(fmt, tmp_path, graphs="on", resident=2)


def test_bitsandbytes_from_pretrained_streams(tmp_path):
    """A tiny Flux loaded the diffusers way, ``from_pretrained(folder, quantization_config=
    BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))`` (its weights land on the GPU),
    streamed bit-exact against itself resident; its state_dict() is bitsandbytes' serialised form,
    and a save_pretrained of the streamed model loads back to the same outputs."""
    import torch
    from diffusers import BitsAndBytesConfig, FluxTransformer2DModel

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import flux_inputs, tiny_flux

    tiny_flux(dtype=torch.bfloat16, **WIDE).save_pretrained(str(tmp_path / "bf16"))
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)

    def load(folder):
        return FluxTransformer2DModel.from_pretrained(str(folder), quantization_config=q, torch_dtype=torch.bfloat16)

    ref = load(tmp_path / "bf16")
    x = flux_inputs(ref, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = ref(**x)[0]
        w = OffloadedTransformer(load(tmp_path / "bf16"), OffloadConfig.layerwise(progress=False), device="cuda")
        assert all(torch.equal(w(**x)[0], want) for _ in range(3))
    assert w.stats()["quantized_format"] == "bitsandbytes"
    sd, rsd = w.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys() and all(torch.equal(sd[k].cpu(), rsd[k].cpu()) for k in rsd)
    assert "transformer_blocks.0.attn.to_q.weight.quant_state.bitsandbytes__nf4" in sd
    w.module.save_pretrained(str(tmp_path / "nf4"))  # pre-quantized: loads back without quantizing again
    again = FluxTransformer2DModel.from_pretrained(str(tmp_path / "nf4"), torch_dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(again(**x)[0], want)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
def test_gguf_streams_from_its_file_on_cuda(quant, tmp_path):
    """A .gguf file streamed straight from its read-only mapping (offload_from_safetensors over the
    file, the model built by gguf_on_meta; on CUDA the quantized bytes go up by DMA from the
    registered file pages), bit-exact against the same GGUF model resident; resident layers too."""
    import torch

    from weightstream import OffloadConfig, gguf_on_meta, offload_from_safetensors
    from weightstream.models import flux_inputs, tiny_flux
    from weightstream.offload.host.checkpoint import on_meta

    ref = make(f"gguf-{quant}", str(tmp_path), "cuda")
    path = os.path.join(str(tmp_path), f"flux-{quant}.gguf")
    x = flux_inputs(ref, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = ref(**x)[0]
        for resident in (0, 1):
            with on_meta():
                meta = tiny_flux(dtype=torch.bfloat16, **WIDE)
            cfg = OffloadConfig.layerwise(resident_layers=resident, progress=False)
            w = offload_from_safetensors(gguf_on_meta(meta, path), path, cfg, device="cuda")
            assert all(torch.equal(w(**x)[0], want) for _ in range(3)), (quant, resident)
            s = w.stats()
            assert s["source"] == "mmap" and s["quantized_format"] == "gguf", s
            assert s["direct_blocks"] == s["blocks_streamed"], s  # straight from the registered file pages
            w.disable()


@pytest.mark.parametrize("storage", ["e4m3fn", "e5m2"])
def test_fp8_cast_model_streams_from_its_checkpoint_on_cuda(storage, tmp_path):
    """A layerwise-cast model's save_pretrained (float8 tensors) streamed straight from the mapping
    on CUDA (direct DMA from the registered file pages), bit-exact against the cast model resident;
    resident layers too."""
    import torch

    from weightstream import OffloadConfig, offload_from_safetensors
    from weightstream.models import flux_inputs, tiny_flux
    from weightstream.offload.host.checkpoint import on_meta
    from weightstream.quant_models import layerwise_fp8

    dtype = getattr(torch, f"float8_{storage}")
    layerwise_fp8(tiny_flux(dtype=torch.bfloat16, **WIDE), dtype).save_pretrained(str(tmp_path))
    ref = make(f"fp8-{storage}", str(tmp_path), "cuda")  # the same weights, cast, on the GPU
    x = flux_inputs(ref, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = ref(**x)[0]
        for resident in (0, 1):
            with on_meta():
                meta = layerwise_fp8(tiny_flux(dtype=torch.bfloat16, **WIDE), dtype)
            cfg = OffloadConfig.layerwise(resident_layers=resident, progress=False)
            w = offload_from_safetensors(meta, str(tmp_path), cfg, device="cuda")
            assert all(torch.equal(w(**x)[0], want) for _ in range(3)), (storage, resident)
            s = w.stats()
            assert s["source"] == "mmap" and s["quantized_format"] == "layerwise-casting", s
            assert s["direct_blocks"] == s["blocks_streamed"], s
            w.disable()
