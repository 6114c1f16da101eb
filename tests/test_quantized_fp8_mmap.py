"""Layerwise-cast (float8 storage) models streamed straight from a checkpoint saved from the cast
model (offload_from_safetensors over a diffusers folder whose linears ``save_pretrained`` wrote as
F8_E4M3 / F8_E5M2, the skipped modules as BF16; docs/checkpoints.md, docs/quantized.md): tiny
Flux models cast with diffusers' ``enable_layerwise_casting``, every path bit-exact against the
very cast model that was saved, run unwrapped; a checkpoint in another dtype than the model's
float8 storage is a CheckpointFormatError at binding, never a cast."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from quantized_cases import DEV, cfg, run
from diffusers import FluxTransformer2DModel
from weightstream import CheckpointFormatError, meta_from_pretrained, offload_from_safetensors
from weightstream.models import flux_inputs, tiny_flux
from weightstream.offload.host.checkpoint import on_meta
from weightstream.offload.host.quantized import casting_leaves
from weightstream.quant_models import layerwise_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
Q = "transformer_blocks.0.attn.to_q.weight"
NORM = "transformer_blocks.0.attn.norm_q.weight"  # a module diffusers' default skip patterns keep in bf16


def _meta(storage=E4M3):
    with on_meta():
        model = tiny_flux(dtype=torch.bfloat16)
    return layerwise_fp8(model, storage)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Checkpoint folders: "bf16" (the original), and per float8 dtype the cast model's
    save_pretrained with that model, its inputs and its output (run after saving)."""
    d = tmp_path_factory.mktemp("fp8-mmap")
    tiny_flux(dtype=torch.bfloat16).save_pretrained(str(d / "bf16"))
    out = {"bf16": str(d / "bf16")}
    for storage in (E4M3, E5M2):
        ref = layerwise_fp8(tiny_flux(dtype=torch.bfloat16), storage)
        ref.save_pretrained(str(d / str(storage)))
        x = flux_inputs(ref, dtype=torch.bfloat16)
        out[storage] = (str(d / str(storage)), ref, x, run(ref, x)[0])
    return out


def _stream(folder, storage=E4M3, copy_path="direct", meta=None, **kw):
    meta = _meta(storage) if meta is None else meta
    return offload_from_safetensors(meta, folder, cfg(**kw), device=DEV, copy_path=copy_path)


@pytest.mark.parametrize("storage", [E4M3, E5M2])
def test_the_saved_checkpoint_holds_the_float8_tensors(folders, storage):
    folder, ref, _, _ = folders[storage]
    with safe_open(f"{folder}/diffusion_pytorch_model.safetensors", "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    f8 = "F8_E4M3" if storage == E4M3 else "F8_E5M2"
    assert dtypes[Q] == f8 and dtypes[NORM] == "BF16"
    assert set(dtypes.values()) == {f8, "BF16"}
    assert {k for k, v in dtypes.items() if v == f8} == {k for k, v in ref.state_dict().items() if v.dtype == storage}


@pytest.mark.parametrize("storage", [E4M3, E5M2])
def test_streams_bit_exact_from_the_folder(folders, storage):
    folder, ref, x, want = folders[storage]
    wrapped = _stream(folder, storage)
    assert all(torch.equal(o, want) for o in run(wrapped, x, 3))
    s = wrapped.stats()
    assert s["quantized_format"] == "layerwise-casting" and s["source"] == "mmap"
    assert s["direct_blocks"] == len(wrapped.executor.source.layouts) == 5
    assert any(spec.dtype == storage for lay in wrapped.executor.source.layouts for spec in lay.tensors)
    sd, rsd = wrapped.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd)
    for k, v in rsd.items():  # float8 (and the skipped bf16) tensors back, byte for byte
        assert sd[k].dtype == v.dtype and torch.equal(sd[k].view(torch.uint8), v.view(torch.uint8)), k
    assert sd[Q].dtype == storage and sd[NORM].dtype == torch.bfloat16


def test_resident_leaves_keep_their_float8_storage_and_hooks(folders):
    """The embedders and a resident block are loaded from the mapping in float8; their casting
    hooks upcast per forward, and CastingKeep gives each leaf its own storage back after it."""
    folder, _, x, want = folders[E4M3]
    model = _meta()
    wrapped = _stream(folder, meta=model, resident_layers=1)
    keys = {"x_embedder.weight": E4M3, Q: E4M3, "proj_out.weight": torch.bfloat16}  # block 0 stays resident;
    params = dict(model.named_parameters())  # proj_out: diffusers' default skip patterns keep it in bf16
    assert all(params[k].dtype == dt and params[k].device.type == "cpu" and params[k].numel() for k, dt in keys.items())
    before = [params[k].data_ptr() for k in keys]
    assert all(torch.equal(o, want) for o in run(wrapped, x, 3))
    assert [params[k].data_ptr() for k in keys] == before and all(params[k].dtype == dt for k, dt in keys.items())
    assert wrapped.stats()["blocks_resident"] == 1
    assert {model.x_embedder, model.transformer_blocks[0].attn.to_q} <= set(casting_leaves(model))
    assert any("CastingKeep" in repr(h) and "x_embedder" in repr(h) for h in wrapped.executor.hooks)


def test_staging_and_meta_from_pretrained(folders):
    folder, _, x, want = folders[E4M3]
    meta = layerwise_fp8(meta_from_pretrained(FluxTransformer2DModel, folder))  # float32 on meta: norms take bf16
    wrapped = _stream(folder, copy_path="staging", meta=meta)
    assert all(torch.equal(o, want) for o in run(wrapped, x, 3))
    assert wrapped.stats()["staged_blocks"] == 5
    assert wrapped.state_dict()[Q].dtype == E4M3


def test_coded_from_the_mapping(folders, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch decode on the CPU
    folder, _, x, want = folders[E4M3]
    coded = _stream(folder, copy_path="auto", weight_codec="exp-k")
    assert all(torch.equal(o, want) for o in run(coded, x, 2))
    assert coded.stats()["source"].startswith("coded-exp-k")
    tables = coded.executor.source.images.tables  # float8 tensors on the codec's 8-bit path
    assert any(g.header.dtype == E4M3 for t in tables for g in t.segments)
    assert coded.state_dict()[Q].dtype == E4M3


def test_a_checkpoint_not_in_the_storage_dtype_is_named(folders):
    with pytest.raises(CheckpointFormatError, match=r"checkpoint key '[\w.]+' \(.*bf16.*\) is torch.bfloat16; "
                       r"FluxTransformer2DModel's tensor '[\w.]+' is stored in torch.float8_e4m3fn .*94 keys so.*"
                       r"save_pretrained.*OffloadedTransformer"):
        _stream(folders["bf16"])  # the uncast original: never cast to float8 on the way
    with pytest.raises(CheckpointFormatError, match=r"is torch.float8_e5m2; .* is stored in torch.float8_e4m3fn "
                       r"\(the model is layerwise cast\)"):
        _stream(folders[E5M2][0], E4M3)
    with on_meta():
        plain = tiny_flux(dtype=torch.bfloat16)
    with pytest.raises(CheckpointFormatError, match=r"is torch.float8_e4m3fn; .* is torch.bfloat16 \(the model is "
                       r"not layerwise cast\).*enable_layerwise_casting\(storage_dtype=torch.float8_e4m3fn"):
        _stream(folders[E4M3][0], meta=plain)  # a model not cast: its linears would become float8 with no hook
