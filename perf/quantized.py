"""Quantized benchmark modes (issue 37, docs/quantized.md): a mode name ending in a quantization
variant runs the scenario's model quantized that way, every kind of mode alike.

- `-qfp8`: diffusers' `enable_layerwise_casting` (float8_e4m3fn storage, bf16 compute);
- `-qgguf8`: GGUF Q8_0 linears in the blocks (diffusers' `GGUFLinear`, random valid blocks:
  no file, no quantization pass over the weights; needs the `gguf` package);
- `-qint8`: torchao int8 weight-only of the block linears (`Int8WeightOnlyConfig`; needs torchao);
- `-qnf4`: bitsandbytes nf4 of every linear, as diffusers' `BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)` loads it (`Linear4bit`;
  quantized on the GPU where there is one, held on the host; needs bitsandbytes).

`resident-q<x>` is the yardstick of every `*-q<x>` mode (the same quantized model resident):
their outputs must equal its bit for bit, and their floor is max(its step, the quantized bytes
streamed / the best H2D of the run). The variant comes last: `layerwise-r4-qfp8`,
`graphs-qgguf8`, `diffusers-block-qint8`, `default-qnf4` (the planned default over the quantized
model). Torch-free until a model is quantized.
"""
from __future__ import annotations

QUANT_VARIANTS = {
    "qfp8": "layerwise casting, float8_e4m3fn storage, bf16 compute",
    "qgguf8": "GGUF Q8_0 block linears (diffusers GGUFLinear)",
    "qint8": "torchao int8 weight-only block linears",
    "qnf4": "bitsandbytes nf4 linears (diffusers BitsAndBytesConfig load_in_4bit, bf16 compute)",
}


def split_quant(name: str) -> tuple[str, str | None]:
    """(the mode without its quantization variant, the variant or None)."""
    head, _, last = name.rpartition("-")
    if head and last in QUANT_VARIANTS:
        return head, last
    return name, None


def quant_yardstick(name: str) -> str | None:
    """``resident-q<x>`` for a ``*-q<x>`` mode, else None."""
    _, q = split_quant(name)
    return None if q is None else f"resident-{q}"


def quantize(model, variant: str):
    """``model`` (bf16, on the CPU or the device) quantized as ``variant``."""
    from weightstream.quant_models import gguf_random, layerwise_fp8, torchao_weight_only  # noqa: PLC0415

    if variant == "qfp8":
        return layerwise_fp8(model)
    if variant == "qgguf8":
        return gguf_random(model, "Q8_0")
    if variant == "qint8":
        return torchao_weight_only(model, "int8")
    if variant == "qnf4":
        import torch  # noqa: PLC0415

        from weightstream.quant_models import bnb_quantize  # noqa: PLC0415

        on = "cuda" if torch.cuda.is_available() else None  # bitsandbytes' CUDA kernels quantize fast
        device = next(model.parameters()).device
        return bnb_quantize(model, "nf4", double_quant=False, device=device, quantize_on=on)
    raise ValueError(f"quantization variant {variant!r} is not allowed; choose from: {', '.join(QUANT_VARIANTS)}")


def reset_peak_rss() -> bool:
    """After quantizing (the bf16 build's memory given back): start this process's peak RSS
    (VmHWM) again from what it holds now, so the setup peak of a quantized mode is measured over
    the quantized model, not the bf16 build before it. False where Linux's clear_refs is absent."""
    import gc  # noqa: PLC0415

    from weightstream.offload.host.packing import malloc_trim  # noqa: PLC0415

    gc.collect()
    malloc_trim()()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
