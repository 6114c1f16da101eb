"""Quantized versions of a model, the way each backend builds them (docs/quantized.md): GGUF
linears as diffusers' GGUF loader makes them (from a GGUF file written with the ``gguf``
package, or from random valid blocks for the benchmarks), torchao weight-only, layerwise casting.

Used by the tests and the quantized benchmark modes (perf/quantized.py). No downloads.
"""
from __future__ import annotations

import torch
from torch import nn

# bytes per GGUF block and the values it holds (gguf.GGML_QUANT_SIZES), for the types made here
GGUF_BLOCKS = {"Q8_0": (34, 32), "Q4_K": (144, 256)}


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` inside the model's streamed block containers, by dotted name."""
    from weightstream.offload.discovery import discover_blocks  # noqa: PLC0415

    out = {}
    for b in discover_blocks(model, None):
        for name, m in b.module.named_modules():
            if type(m) is nn.Linear:
                out[f"{b.name}.{name}"] = m
    return out


def gguf_type(name: str):
    import gguf  # noqa: PLC0415

    return gguf.GGMLQuantizationType[name]


def random_gguf_bytes(rows: int, cols: int, quant: str, generator: torch.Generator) -> torch.Tensor:
    """uint8 ``(rows, cols / values per block * block bytes)``: valid GGUF blocks of ``quant``
    (Q8_0: an f16 scale and 32 int8; Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins,
    128 bytes of 4-bit values), scales small and finite, the rest random bits."""
    nbytes, values = GGUF_BLOCKS[quant]
    if cols % values:
        raise ValueError(f"{quant} needs rows of a multiple of {values} values; got {cols}")
    n = rows * cols // values * nbytes
    # random bits drawn 8 bytes at a time (4x faster than a byte at a time: a Flux-sized model's
    # 12.6 GB of Q8_0 blocks took about 100 s that way)
    words = torch.randint(-(2**63), 2**63 - 1, (-(-n // 8),), dtype=torch.int64, generator=generator)
    blocks = words.view(torch.uint8)[:n].reshape(rows * cols // values, nbytes)
    heads = 1 if quant == "Q8_0" else 2  # f16 fields at the block start
    scale = (torch.rand(blocks.shape[0], heads, generator=generator) * 0.02 + 1e-3).to(torch.float16)
    blocks[:, : 2 * heads] = scale.view(torch.uint8).reshape(blocks.shape[0], 2 * heads)
    return blocks.reshape(rows, cols // values * nbytes)


def write_gguf(model: nn.Module, path, quant: str, *, seed: int = 0) -> list[str]:
    """Write ``model``'s state dict to a GGUF file at ``path``: the block linears' weights
    whose rows fit ``quant``'s block as ``quant`` (Q8_0 quantized from the weights with
    ``gguf.quants``; Q4_K, which gguf-py cannot quantize, as random valid blocks), every other
    tensor as F32. Returns the keys written quantized."""
    import gguf  # noqa: PLC0415

    qt = gguf_type(quant)
    linears = {f"{n}.weight" for n, m in block_linears(model).items()}
    g = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), "weightstream-test")
    quantized = []
    for key, t in model.state_dict().items():
        a = t.detach().float().cpu()
        if key in linears and a.shape[-1] % GGUF_BLOCKS[quant][1] == 0:
            raw = (gguf.quants.quantize(a.numpy(), qt) if quant == "Q8_0"
                   else random_gguf_bytes(a.shape[0], a.shape[1], quant, g).numpy())
            writer.add_tensor(key, raw, raw_dtype=qt)
            quantized.append(key)
        else:
            writer.add_tensor(key, a.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


def load_gguf(model: nn.Module, path, compute_dtype=torch.bfloat16) -> nn.Module:
    """``model`` (built from its config) with the GGUF file's tensors, the way diffusers'
    GGUF quantizer loads them: linears whose weight is a ``GGUFParameter`` become
    ``GGUFLinear`` (dequantized per forward), every other tensor is cast to ``compute_dtype``."""
    from diffusers.models.model_loading_utils import load_gguf_checkpoint  # noqa: PLC0415

    sd = load_gguf_checkpoint(str(path))
    return _assign_gguf(model, sd, compute_dtype)


def _assign_gguf(model: nn.Module, sd: dict, compute_dtype) -> nn.Module:
    """As diffusers' GGUF quantizer: every ``nn.Linear`` whose weight in ``sd`` is a ``GGUFParameter``
    becomes a ``GGUFLinear`` (built on meta, then given ``sd``'s tensors), the rest is cast."""
    from diffusers.quantizers.gguf.utils import GGUFParameter  # noqa: PLC0415

    from weightstream.offload.host.checkpoint import gguf_linear  # noqa: PLC0415

    for key, v in sd.items():
        owner = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and isinstance(v, GGUFParameter) and type(model.get_submodule(owner)) is nn.Linear:
            gguf_linear(model, owner, compute_dtype, bias_given=f"{owner}.bias" in sd)
    for key, v in sd.items():
        owner, name = key.rsplit(".", 1)
        mod = model.get_submodule(owner)
        if isinstance(v, GGUFParameter):
            mod._parameters[name] = v
        elif name in mod._parameters:
            mod._parameters[name] = nn.Parameter(v.to(compute_dtype), requires_grad=False)
        else:
            mod._buffers[name] = v.to(compute_dtype)
    return model.eval()


def gguf_random(model: nn.Module, quant: str = "Q8_0", *, seed: int = 0, compute_dtype=torch.bfloat16) -> nn.Module:
    """``model`` with every block linear whose rows fit ``quant`` replaced by a diffusers
    ``GGUFLinear`` holding random valid ``quant`` blocks (benchmarks: no file, no quantization
    pass over billions of weights). Built one linear at a time (the bf16 weight is dropped)."""
    from diffusers.quantizers.gguf.utils import GGUFParameter  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    qt = gguf_type(quant)
    sd = {}
    for name, lin in block_linears(model).items():
        if lin.in_features % GGUF_BLOCKS[quant][1] == 0:
            sd[f"{name}.weight"] = GGUFParameter(random_gguf_bytes(lin.out_features, lin.in_features, quant, g),
                                                 quant_type=qt)
            lin.weight = None  # the bf16 weight goes now (the bias stays, cast to compute_dtype)
    return _assign_gguf(model, sd, compute_dtype)


def torchao_weight_only(model: nn.Module, kind: str = "int8") -> nn.Module:
    """``model`` with torchao weight-only quantization of its block linears: ``kind`` "int8"
    (``Int8WeightOnlyConfig``: ``Int8Tensor``) or "float8" (``Float8WeightOnlyConfig``: ``Float8Tensor``)."""
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_  # noqa: PLC0415

    configs = {"int8": Int8WeightOnlyConfig, "float8": Float8WeightOnlyConfig}
    if kind not in configs:
        raise ValueError(f"kind={kind!r} is not allowed; choose from: {', '.join(configs)}")
    names = set(block_linears(model))
    # version 2 (Int8Tensor / Float8Tensor) named: torchao 0.17's Int8WeightOnlyConfig still defaults to
    # version 1 (a nested AffineQuantizedTensor, refused by name), 0.18's to version 2
    quantize_(model, configs[kind](version=2), filter_fn=lambda m, fqn: fqn in names)
    return model


def layerwise_fp8(model: nn.Module, storage=torch.float8_e4m3fn, compute=torch.bfloat16) -> nn.Module:
    """diffusers' ``enable_layerwise_casting``: float8 storage, ``compute`` per forward."""
    model.enable_layerwise_casting(storage_dtype=storage, compute_dtype=compute)
    return model


BNB_KINDS = ("nf4", "fp4", "int8")


def bnb_quantize(model: nn.Module, kind: str = "nf4", *, compute_dtype=torch.bfloat16, double_quant: bool = True,
                 int8_threshold: float = 6.0, skip: tuple[str, ...] = (), device="cpu", quantize_on=None,
                 portable_cpu: bool = True) -> nn.Module:
    """``model`` quantized with bitsandbytes the way diffusers' ``BitsAndBytesConfig`` loader does
    (``replace_with_bnb_linear``, then each weight as a ``Params4bit`` / ``Int8Params`` moved to
    the device, which quantizes it): ``kind`` "nf4" / "fp4" (``load_in_4bit``, ``compute_dtype``,
    ``double_quant``: ``bnb_4bit_use_double_quant``) or "int8" (``load_in_8bit``,
    ``int8_threshold``: ``llm_int8_threshold``, diffusers' 6.0 by default; 0 turns off the outlier
    decomposition, whose data-dependent outlier columns a CUDA graph cannot capture). Every
    ``nn.Linear`` but the names in ``skip`` (``llm_int8_skip_modules``). Quantized on
    ``quantize_on`` (default ``device``), then held on ``device``. ``portable_cpu``: 4-bit linears
    take bitsandbytes' portable CPU path (``support_avx512bf16_for_cpu=False``: no repack of the
    weight at its first CPU forward, docs/quantized.md)."""
    import bitsandbytes as bnb  # noqa: PLC0415
    from diffusers import BitsAndBytesConfig  # noqa: PLC0415
    from diffusers.quantizers.bitsandbytes.utils import replace_with_bnb_linear  # noqa: PLC0415

    if kind not in BNB_KINDS:
        raise ValueError(f"kind={kind!r} is not allowed; choose from: {', '.join(BNB_KINDS)}")
    if kind == "int8":
        cfg = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=int8_threshold)
    else:
        cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=compute_dtype,
                                 bnb_4bit_use_double_quant=double_quant)
    device = torch.device(device)
    where = torch.device(quantize_on) if quantize_on is not None else device
    sd = model.to(device).state_dict()  # what stays unquantized is on ``device`` too
    model = replace_with_bnb_linear(model, modules_to_not_convert=list(skip), quantization_config=cfg)
    for name, m in model.named_modules():
        four = isinstance(m, bnb.nn.Linear4bit)
        if not (four or isinstance(m, bnb.nn.Linear8bitLt)):
            continue
        cls = bnb.nn.Params4bit if four else bnb.nn.Int8Params
        w = sd.pop(f"{name}.weight")
        m._parameters["weight"] = cls(w.to("cpu"), requires_grad=False, **m.weight.__dict__).to(where).to(device)
        if m.bias is not None:
            m._parameters["bias"] = nn.Parameter(sd.pop(f"{name}.bias").to(device), requires_grad=False)
        if four and portable_cpu:
            m.support_avx512bf16_for_cpu = False
        del w
    return model.eval()
