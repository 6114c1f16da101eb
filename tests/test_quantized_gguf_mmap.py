"""GGUF files streamed straight from their mapping (offload_from_safetensors over a .gguf file,
the model built on meta with gguf_on_meta): tiny Flux models written to GGUF with the ``gguf``
package (Q8_0 quantized from the weights, Q4_K as valid random blocks), every path bit-exact
against the same GGUF model loaded the way diffusers' loader does and run unwrapped; the header
parser against diffusers' own ``load_gguf_checkpoint`` (docs/checkpoints.md, docs/quantized.md)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

gguf = pytest.importorskip("gguf")

from quantized_cases import DEV, cfg, run  # noqa: E402
from diffusers.models.model_loading_utils import load_gguf_checkpoint  # noqa: E402
from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter  # noqa: E402
from weightstream import CheckpointFormatError, gguf_on_meta, offload_from_safetensors  # noqa: E402
from weightstream.models import flux_inputs, tiny_flux  # noqa: E402
from weightstream.offload.host.checkpoint import Checkpoint, CheckpointChangedError, on_meta  # noqa: E402
from weightstream.offload.host.gguf_file import GGML_TYPES  # noqa: E402
from weightstream.quant_models import load_gguf, write_gguf  # noqa: E402

# Q4_K blocks hold 256 values: rows of 256 (heads x head_dim) and 1024 (the MLP), as tests/test_quantized_gguf.py
WIDE = dict(attention_head_dim=64, num_attention_heads=4, axes_dims_rope=(16, 24, 24), joint_attention_dim=256)
Q = "transformer_blocks.0.attn.to_q.weight"


def _meta():
    with on_meta():
        return tiny_flux(dtype=torch.bfloat16, **WIDE)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-mmap")
    out = {}
    for quant in ("Q8_0", "Q4_K"):
        path = d / f"flux-{quant}.gguf"
        assert write_gguf(tiny_flux(dtype=torch.bfloat16, **WIDE), path, quant)
        out[quant] = str(path)
    return out


@pytest.fixture(scope="module", params=["Q8_0", "Q4_K"])
def case(request, files):
    """(path, inputs, the unwrapped GGUF model's output, that model) of one quant type."""
    path = files[request.param]
    ref = load_gguf(tiny_flux(dtype=torch.bfloat16, **WIDE), path)
    x = flux_inputs(ref, dtype=torch.bfloat16)
    return path, x, run(ref, x)[0], ref


def _stream(path, copy_path="auto", **kw):
    return offload_from_safetensors(gguf_on_meta(_meta(), path), path, cfg(**kw), device=DEV, copy_path=copy_path)


def test_parser_matches_diffusers_loader(files):
    assert {n: (b, s) for n, b, s in (v for v in GGML_TYPES.values())} == {
        t.name: gguf.GGML_QUANT_SIZES[t] for t in gguf.GGMLQuantizationType if int(t) in GGML_TYPES}
    for quant, path in files.items():
        want = load_gguf_checkpoint(path)
        ckpt = Checkpoint(path)
        try:
            assert list(ckpt.entries) == list(want)
            n_quant = 0
            for key, v in want.items():
                e = ckpt.entries[key]
                assert e.shape == tuple(v.shape), key
                if isinstance(v, GGUFParameter):
                    n_quant += 1
                    assert e.quant_type == int(v.quant_type) and e.dtype == torch.uint8, key
                    assert torch.equal(ckpt.tensor(e), v.as_tensor()), key
                else:
                    assert e.quant_type is None and e.dtype == v.dtype, key
                    assert torch.equal(ckpt.tensor(e), v), key
            assert n_quant >= 5, quant
        finally:
            ckpt.close()


def test_gguf_on_meta_builds_what_diffusers_loader_builds(case):
    path, _, _, ref = case
    meta = gguf_on_meta(_meta(), path)
    got = dict(meta.named_parameters())
    assert list(got) == [n for n, _ in ref.named_parameters()]
    for name, p in ref.named_parameters():
        g = got[name]
        assert g.device.type == "meta" and type(g) is type(p) and g.dtype == p.dtype and g.shape == p.shape, name
        if isinstance(p, GGUFParameter):
            assert g.quant_type == p.quant_type and g.quant_shape == p.quant_shape, name
    mods = dict(meta.named_modules())
    for name, m in ref.named_modules():
        assert type(mods[name]) is type(m), name
        if isinstance(m, GGUFLinear):
            assert mods[name].compute_dtype == m.compute_dtype and mods[name].source_cls is m.source_cls


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
def test_streams_bit_exact_from_the_file(case, copy_path):
    path, x, want, ref = case
    wrapped = _stream(path, copy_path)
    assert all(torch.equal(o, want) for o in run(wrapped, x, 3))
    s = wrapped.stats()
    assert s["quantized_format"] == "gguf" and s["source"] == "mmap"
    assert s["staged_blocks" if copy_path == "staging" else "direct_blocks"] == len(wrapped.executor.source.layouts)
    assert any(spec.dtype == torch.uint8 for lay in wrapped.executor.source.layouts for spec in lay.tensors)
    sd, rsd = wrapped.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd)
    for k, v in rsd.items():
        assert type(sd[k]) is type(v) and sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
        if isinstance(v, GGUFParameter):
            assert sd[k].quant_type == v.quant_type, k
    assert isinstance(wrapped.module.transformer_blocks[0].attn.to_q.weight, GGUFParameter)  # its placeholder form
    plain = wrapped.disable()
    assert isinstance(plain.transformer_blocks[0].attn.to_q.weight, GGUFParameter)
    assert torch.equal(run(plain, x)[0], want)


def test_coded_and_resident_layers(case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch decode on the CPU
    path, x, want, _ = case
    coded = _stream(path, weight_codec="exp-k")
    assert all(torch.equal(o, want) for o in run(coded, x, 2))
    assert coded.stats()["source"].startswith("coded-exp-k")
    assert type(coded.state_dict()[Q]) is GGUFParameter
    resident = _stream(path, copy_path="direct", resident_layers=1)
    assert all(torch.equal(o, want) for o in run(resident, x, 2))
    assert resident.stats()["blocks_resident"] == 1
    w = resident.module.transformer_blocks[0].attn.to_q.weight  # block 0 stays resident
    assert type(w) is GGUFParameter and w.device.type == "cpu" and w.numel() > 0


def test_a_quant_type_the_model_was_not_built_for_is_named(files):
    with pytest.raises(CheckpointFormatError, match=r"checkpoint '[\w.]+\.weight' \(.*flux-Q4_K.gguf\) is Q4_K of "
                       r"shape .*; the model's '[\w.]+\.weight' is a GGUF weight of quant_type Q8_0"):
        offload_from_safetensors(gguf_on_meta(_meta(), files["Q8_0"]), files["Q4_K"], cfg(), device=DEV)
    with pytest.raises(CheckpointFormatError, match=r"checkpoint '([\w.]+\.weight)' .* is Q8_0 \(uint8 bytes .*"
                       r"the model's '\1' is a plain torch.bfloat16 tensor .*gguf_on_meta"):
        offload_from_safetensors(_meta(), files["Q8_0"], cfg(), device=DEV)  # a model not built for GGUF


def test_a_safetensors_file_for_a_gguf_model_is_named(files, tmp_path):
    from safetensors.torch import save_file

    st = tmp_path / "model.safetensors"
    save_file(tiny_flux(dtype=torch.bfloat16, **WIDE).state_dict(), str(st))
    with pytest.raises(CheckpointFormatError, match=r"GGUF weight of quant_type Q8_0.*plain torch.bfloat16"):
        offload_from_safetensors(gguf_on_meta(_meta(), files["Q8_0"]), str(st), cfg(), device=DEV)


def test_a_missing_key_is_named(files, tmp_path):
    path = tmp_path / "missing.gguf"
    sd = load_gguf_checkpoint(files["Q8_0"])
    writer = gguf.GGUFWriter(str(path), "weightstream-test")
    for key, v in sd.items():
        if key != Q:
            if isinstance(v, GGUFParameter):
                writer.add_tensor(key, v.as_tensor().numpy(), raw_dtype=v.quant_type)
            else:
                writer.add_tensor(key, v.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=rf"meta device.*'{Q}'"):
        offload_from_safetensors(gguf_on_meta(_meta(), files["Q8_0"]), str(path), cfg(), device=DEV)


def test_a_truncated_or_foreign_file_is_named(files, tmp_path):
    path = tmp_path / "cut.gguf"
    shutil.copy(files["Q8_0"], path)
    last = max(Checkpoint(files["Q8_0"]).entries.values(), key=lambda e: e.offset)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(CheckpointFormatError, match=rf"tensor '{last.key}': offset \d+ \+ {last.nbytes} bytes"):
        Checkpoint(str(path))
    with open(path, "r+b") as f:
        f.write(b"GGUF\x07\x00\x00\x00")
    with pytest.raises(CheckpointFormatError, match="GGUF version 7 is not read here"):
        Checkpoint(str(path))
    with open(path, "r+b") as f:
        f.write(b"GGML")
    with pytest.raises(CheckpointFormatError, match="not a GGUF file"):
        Checkpoint(str(path))


def test_version_2_reads_as_version_3(files, tmp_path):
    path = tmp_path / "v2.gguf"
    shutil.copy(files["Q8_0"], path)
    with open(path, "r+b") as f:
        f.seek(4)
        f.write((2).to_bytes(4, "little"))
    a, b = Checkpoint(files["Q8_0"]), Checkpoint(str(path))
    assert [(e.key, e.shape, e.offset, e.nbytes, e.quant_type) for e in a.entries.values()] == [
        (e.key, e.shape, e.offset, e.nbytes, e.quant_type) for e in b.entries.values()]


def test_a_file_changed_in_place_is_named(case, tmp_path):
    path, x, want, _ = case
    copy = tmp_path / "flux.gguf"
    shutil.copy(path, copy)
    wrapped = _stream(str(copy), "direct")
    assert torch.equal(run(wrapped, x)[0], want)
    with open(copy, "r+b") as f:  # the same bytes written back: its ctime moves
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(b)
    with pytest.raises(CheckpointChangedError, match="flux.gguf"):
        run(wrapped, x)


def test_bf16_and_f32_tensors_read_as_diffusers_reads_them(tmp_path):
    """diffusers' loader keeps F32 / F16 tensors plain and makes a BF16 one a GGUFParameter (uint8
    bytes, quant_type BF16): the parser's entries say the same, byte for byte."""
    import numpy as np

    path = str(tmp_path / "bf16.gguf")
    w = gguf.GGUFWriter(path, "flux")
    weight = (torch.randn(8, 32, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    w.add_tensor("x.weight", weight.view(torch.int16).numpy().view(np.uint16).copy(),
                 raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.add_tensor("x.bias", np.linspace(-1, 1, 8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = load_gguf_checkpoint(path)
    ckpt = Checkpoint(path)
    try:
        q, b = ckpt.entries["x.weight"], ckpt.entries["x.bias"]
        assert isinstance(want["x.weight"], GGUFParameter) and q.quant_type == int(want["x.weight"].quant_type)
        assert q.dtype == torch.uint8 and q.shape == tuple(want["x.weight"].shape) == (8, 64)
        assert torch.equal(ckpt.tensor(q), want["x.weight"].as_tensor())
        assert torch.equal(ckpt.tensor(q).view(torch.bfloat16), weight)
        assert b.quant_type is None and b.dtype == torch.float32 and torch.equal(ckpt.tensor(b), want["x.bias"])
    finally:
        ckpt.close()
