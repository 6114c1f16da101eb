"""The mmap source with weight_codec='exp-k' / 'exp-k2' and its coded sidecar, on the CPU.

Every output is compared with the unwrapped model bit for bit; sidecar reuse is
checked by the encoder's own call count; stale, foreign and corrupt sidecars by
rewriting real files.
"""
import os
import shutil
import warnings

import pytest
import torch

import weightstream.offload.sources.coded_encode as coded_mod
from weightstream import OffloadConfig
from weightstream.offload.mmap_source import (
    CheckpointChangedError, CodedSidecarError, meta_from_pretrained, offload_from_safetensors, on_meta,
)
from weightstream.offload.sources.mmap_coded import SIDECAR_DIR

from test_mmap_source import (
    _GQA, _diffusers_case, _gqa_ckpt, _meta, _save, _toy, _transposed_ckpt, _Transposed, _x, first,
)

DEV = "cpu"
CODED = OffloadConfig.layerwise(weight_codec="exp-k", progress=False)
CODED2 = OffloadConfig.layerwise(weight_codec="exp-k2", progress=False)
CODEDP = OffloadConfig.layerwise(weight_codec="exp-kp", progress=False)


@pytest.fixture
def encodes(monkeypatch):
    """Counts calls of the real encoder (kernels.codec.encode as the coded source calls it)."""
    calls = [0]
    real = coded_mod.encode

    def counting(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(coded_mod, "encode", counting)
    return calls


def _flux(tmp_path, dtype=torch.bfloat16, **save_kw):
    model, x, cls, folder = _diffusers_case("flux", tmp_path, dtype=dtype, **save_kw)
    with torch.no_grad():
        want = first(model(**x))
    return model, x, cls, folder, want


def _wrap(cls, folder, cfg=CODED, **kw):
    return offload_from_safetensors(meta_from_pretrained(cls, folder), folder, cfg, device=DEV, **kw)


def _steps(wrapped, x, want, n=3):
    with torch.no_grad():
        outs = [first(wrapped(**x)) for _ in range(n)]
    for i, out in enumerate(outs):
        assert torch.equal(out, want), f"step {i}: max diff {(out.float() - want.float()).abs().max()}"


def _sidecars(folder):
    d = folder / SIDECAR_DIR
    return sorted(d.iterdir()) if d.exists() else []


# ----------------------------------------------------------------- bit-exact


def _versions(wrapped) -> set[int]:
    return {seg.header.version for t in wrapped.executor.source.tables for seg in t.segments}


@pytest.mark.parametrize("name", ["flux", "wan"])
@pytest.mark.parametrize("dtype,resident,sharded,codec", [
    (torch.bfloat16, 0, False, "exp-k"), (torch.bfloat16, 1, True, "exp-k"), (torch.float32, 0, False, "exp-k"),
    (torch.bfloat16, 1, True, "exp-k2"), (torch.bfloat16, 0, True, "exp-kp")],
    ids=["bf16", "bf16-r1-sharded", "fp32", "k2-bf16-r1-sharded", "kp-bf16-sharded"])
def test_coded_mmap_bit_exact(name, dtype, resident, sharded, codec, tmp_path):
    model, x, cls, folder = _diffusers_case(name, tmp_path, dtype=dtype,
                                            **({"max_shard_size": "20KB"} if sharded else {}))
    with torch.no_grad():
        want = first(model(**x))
    cfg = OffloadConfig.layerwise(weight_codec=codec, resident_layers=resident, progress=False)
    wrapped = _wrap(cls, folder, cfg)
    _steps(wrapped, x, want)
    s = wrapped.stats()
    assert s["source"] == f"coded-{codec}-mmap" and s["blocks_resident"] == resident
    assert (2 in _versions(wrapped)) == (codec == "exp-k2") and (3 in _versions(wrapped)) == (codec == "exp-kp")
    assert s["blocks_encoded"] == s["blocks_streamed"] > 0 and s["encode_s"] > 0
    assert s["coded_bytes"] > 0 and s["raw_bytes"] == s["streamed_bytes_per_step"]
    if dtype == torch.bfloat16:
        assert s["bits_per_weight"] > 0
    assert _sidecars(folder) == [] and s["sidecar_path"] is None  # coded_sidecar='off' writes nothing
    sd, ref = wrapped.state_dict(), model.state_dict()
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], v) for k, v in ref.items())


@pytest.mark.parametrize("sidecar", ["off", "auto"])
def test_kernel_transform_is_applied_before_encoding(sidecar, tmp_path):
    model = _toy(_GQA).to(torch.bfloat16)
    path = _gqa_ckpt(model, tmp_path / "gqa.safetensors")
    with torch.no_grad():
        want = model(_x().to(torch.bfloat16))
    for start in range(2):  # the second start loads the sidecar ('auto')
        meta = _meta(_GQA)
        for b in meta.blocks:  # the non-persistent rope buffer (no checkpoint holds it) as the model has it
            b.rope = b.rope.to(torch.bfloat16)
        wrapped = offload_from_safetensors(meta, path, CODED, device=DEV, coded_sidecar=sidecar)
        with torch.no_grad():
            assert all(torch.equal(wrapped(_x().to(torch.bfloat16)), want) for _ in range(3))
        s = wrapped.stats()
        assert s["sidecar_loaded"] == (sidecar == "auto" and start == 1)
        sd = wrapped.state_dict()  # runtime (fused) rows
        assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_python_transform_is_applied_before_encoding(tmp_path):
    model = _toy()
    path = _transposed_ckpt(model, tmp_path / "t.safetensors")
    with torch.no_grad():
        want = model(_x())
        for _ in range(2):
            wrapped = offload_from_safetensors(_meta(_Transposed), path, CODED, device=DEV, coded_sidecar="auto")
            assert all(torch.equal(wrapped(_x()), want) for _ in range(2))
    assert wrapped.stats()["sidecar_loaded"]


def test_a_changed_transform_is_a_foreign_sidecar(tmp_path, encodes):
    model = _toy()
    path = _transposed_ckpt(model, tmp_path / "t.safetensors")
    offload_from_safetensors(_meta(_Transposed), path, CODED, device=DEV, coded_sidecar="write")
    meta = _meta(_Transposed, transform=lambda t: t.t().contiguous().neg())  # other code, same parameter
    with pytest.raises(CodedSidecarError):
        offload_from_safetensors(meta, path, CODED, device=DEV, coded_sidecar="read")


# ----------------------------------------------------------------- sidecar reuse


def test_sidecar_written_then_reused_without_encoding(tmp_path, encodes):
    model, x, cls, folder, want = _flux(tmp_path)
    first_start = _wrap(cls, folder, coded_sidecar="auto")
    _steps(first_start, x, want)
    s1 = first_start.stats()
    assert encodes[0] > 0 and s1["blocks_encoded"] == s1["blocks_streamed"] and not s1["sidecar_loaded"]
    files = _sidecars(folder)
    assert len(files) == 1 and files[0].suffix == ".wsc" and str(files[0]) == s1["sidecar_path"]
    assert os.path.getsize(files[0]) == s1["sidecar_bytes"] >= s1["coded_bytes"]
    mtime = files[0].stat().st_mtime_ns
    encodes[0] = 0
    for mode in ("auto", "read"):
        again = _wrap(cls, folder, coded_sidecar=mode)
        _steps(again, x, want)
        s2 = again.stats()
        assert encodes[0] == 0, f"{mode}: the second start encoded {encodes[0]} tensors"
        assert s2["sidecar_loaded"] and s2["encode_s"] == 0 and s2["blocks_encoded"] == 0
        assert s2["sidecar_load_s"] > 0 and s2["sidecar_bytes"] == s1["sidecar_bytes"]
        assert s2["coded_bytes"] == s1["coded_bytes"]
    assert _sidecars(folder) == files and files[0].stat().st_mtime_ns == mtime  # read, never rewritten


def test_a_sidecar_of_one_codec_is_never_loaded_for_the_other(tmp_path, encodes):
    """The sidecar's name and header bind the codec: an exp-k2 sidecar is another file than the
    exp-k one; copied over it, it is foreign (and the other way round); each loads for its own."""
    from weightstream.offload.sources.mmap_coded import _codec_id

    assert _codec_id("exp-k") == ["exp-k", 1, 4096]  # the identity exp-k sidecars were written with
    model, x, cls, folder, want = _flux(tmp_path)
    _wrap(cls, folder, CODED2, coded_sidecar="write")
    (k2,) = _sidecars(folder)
    with pytest.raises(CodedSidecarError, match="cannot be read"):  # no exp-k sidecar yet
        _wrap(cls, folder, CODED, coded_sidecar="read")
    one = _wrap(cls, folder, CODED, coded_sidecar="auto")  # encodes and writes its own
    assert not one.stats()["sidecar_loaded"] and _versions(one) == {1}
    (k1,) = [p for p in _sidecars(folder) if p != k2]
    for codec, path, other in (("exp-k2", k2, k1), ("exp-k", k1, k2)):
        cfg = CODED2 if codec == "exp-k2" else CODED
        encodes[0] = 0
        wrapped = _wrap(cls, folder, cfg, coded_sidecar="read")
        s = wrapped.stats()
        assert s["sidecar_loaded"] and encodes[0] == 0 and s["source"] == f"coded-{codec}-mmap"
        assert (2 in _versions(wrapped)) == (codec == "exp-k2")
        _steps(wrapped, x, want, n=1)
        saved = path.read_bytes()
        shutil.copyfile(other, path)  # the other codec's sidecar where this codec looks
        with pytest.raises(CodedSidecarError, match="foreign"):
            _wrap(cls, folder, cfg, coded_sidecar="read")
        path.write_bytes(saved)


def test_write_rewrites_atomically_and_leaves_no_temp_files(tmp_path, encodes):
    model, x, cls, folder, want = _flux(tmp_path)
    _wrap(cls, folder, coded_sidecar="write")
    (path,) = _sidecars(folder)
    inode = path.stat().st_ino
    n = encodes[0]
    wrapped = _wrap(cls, folder, coded_sidecar="write")  # always encodes and writes
    assert encodes[0] == 2 * n and _sidecars(folder) == [path]
    assert path.stat().st_ino != inode  # a new file renamed over the old one
    _steps(wrapped, x, want)


def test_an_unwritable_sidecar_folder_warns_with_auto_and_raises_with_write(tmp_path):
    model, x, cls, folder, want = _flux(tmp_path)
    (folder / SIDECAR_DIR).write_text("not a folder")
    with pytest.warns(UserWarning, match="not written"):
        wrapped = _wrap(cls, folder, coded_sidecar="auto")
    _steps(wrapped, x, want, n=1)
    assert wrapped.stats()["sidecar_bytes"] == 0
    with pytest.raises(CodedSidecarError, match="coded_sidecar='write' cannot write"):
        _wrap(cls, folder, coded_sidecar="write")


def test_read_without_a_sidecar_is_a_named_error(tmp_path):
    model, x, cls, folder, want = _flux(tmp_path)
    with pytest.raises(CodedSidecarError, match="cannot be read"):
        _wrap(cls, folder, coded_sidecar="read")


def test_stale_sidecar_after_an_atomic_replace(tmp_path, encodes):
    model, x, cls, folder, want = _flux(tmp_path)
    _wrap(cls, folder, coded_sidecar="auto")
    (path,) = _sidecars(folder)
    other = type(model).from_config(model.config).to(torch.bfloat16)  # other random weights
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
        want_new = first(other(**x))
    assert not torch.equal(want_new, want)
    other.save_pretrained(str(tmp_path / "new"), safe_serialization=True)
    ckpt = "diffusion_pytorch_model.safetensors"
    os.replace(tmp_path / "new" / ckpt, folder / ckpt)
    with pytest.raises(CodedSidecarError, match=r"stale: checkpoint file .* changed since it was written"):
        _wrap(cls, folder, coded_sidecar="read")
    encodes[0] = 0
    with pytest.warns(UserWarning, match="stale.*encoding the checkpoint again"):
        wrapped = _wrap(cls, folder, coded_sidecar="auto")
    assert encodes[0] > 0 and not wrapped.stats()["sidecar_loaded"]
    _steps(wrapped, x, want_new)
    assert _sidecars(folder) == [path]  # rewritten in place of the stale one
    _steps(_wrap(cls, folder, coded_sidecar="read"), x, want_new)


def test_foreign_sidecar_is_refused(tmp_path):
    model, x, cls, folder, want = _flux(tmp_path)
    _wrap(cls, folder, OffloadConfig.layerwise(weight_codec="exp-k", resident_layers=1), coded_sidecar="write")
    (one,) = _sidecars(folder)
    _wrap(cls, folder, coded_sidecar="write")  # all blocks streamed: another layout, another file
    (two,) = [p for p in _sidecars(folder) if p != one]
    shutil.copyfile(one, two)
    with pytest.raises(CodedSidecarError, match="foreign"):
        _wrap(cls, folder, coded_sidecar="read")
    with pytest.warns(UserWarning, match="foreign"):
        _steps(_wrap(cls, folder, coded_sidecar="auto"), x, want)


def _corrupt_truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4096)


def _corrupt_header_byte(path):
    data = bytearray(path.read_bytes())
    at = data.index(b'"blocks"') + 3
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _corrupt_magic(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_coded_header(path):
    """The first coded tensor's magic (WSC1) inside the data: a structural check catches it."""
    data = bytearray(path.read_bytes())
    at = data.index(b"WSC1", 64)
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt,match", [
    (_corrupt_truncate, "truncated"),
    (_corrupt_header_byte, "checksum"),
    (_corrupt_magic, "not a weightstream coded sidecar"),
    (_corrupt_coded_header, "no coded tensor"),
], ids=["truncated", "header-byte", "magic", "coded-tensor-header"])
def test_corrupt_sidecar_is_a_named_error_or_re_encoded(corrupt, match, tmp_path, encodes):
    model, x, cls, folder, want = _flux(tmp_path)
    _wrap(cls, folder, coded_sidecar="auto")
    (path,) = _sidecars(folder)
    corrupt(path)
    with pytest.raises(CodedSidecarError, match=match):
        _wrap(cls, folder, coded_sidecar="read")
    encodes[0] = 0
    with pytest.warns(UserWarning, match=match):
        wrapped = _wrap(cls, folder, coded_sidecar="auto")
    assert encodes[0] > 0
    _steps(wrapped, x, want)
    _steps(_wrap(cls, folder, coded_sidecar="read"), x, want)  # the rewritten sidecar is good


# ----------------------------------------------------------------- weights semantics


@pytest.mark.parametrize("sidecar,cfg", [("off", CODED), ("read", CODED), ("read", CODED2)],
                         ids=["off", "read", "k2-read"])
def test_update_weights_and_edits_as_the_coded_source(sidecar, cfg, tmp_path):
    model, x, cls, folder, want = _flux(tmp_path)
    if sidecar == "read":
        _wrap(cls, folder, cfg, coded_sidecar="write")
        (path,) = _sidecars(folder)
        before = path.read_bytes()
    wrapped = _wrap(cls, folder, cfg, coded_sidecar=sidecar)
    _steps(wrapped, x, want, n=1)
    new = {k: (v * 0.5 if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    with torch.no_grad():
        wrapped.update_weights(new)  # re-encoded (out of the read-only sidecar mapping into private memory)
        _steps(wrapped, x, first(model(**x)), n=2)
        key = "transformer_blocks.0.attn.to_q.weight"
        wrapped.state_dict()[key].mul_(0.75)  # an in-place edit of a host copy reaches the next forward
        model.state_dict()[key].mul_(0.75)
        _steps(wrapped, x, first(model(**x)), n=2)
    if sidecar == "read":
        assert path.read_bytes() == before  # nothing wrote through the mapping
    plain = wrapped.disable()
    for (k, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_sidecar_written_in_place_is_a_named_error_not_sigbus(tmp_path):
    model, x, cls, folder, want = _flux(tmp_path)
    _wrap(cls, folder, coded_sidecar="write")
    wrapped = _wrap(cls, folder, coded_sidecar="read")
    _steps(wrapped, x, want, n=1)
    (path,) = _sidecars(folder)
    _corrupt_truncate(path)  # in place: its pages go away under the mapping
    with pytest.raises(CheckpointChangedError, match=r"\.wsc' changed while this process streams"):
        with torch.no_grad():
            wrapped(**x)


def test_disable_from_a_sidecar_gives_private_weights(tmp_path):
    model, x, cls, folder, want = _flux(tmp_path)
    _wrap(cls, folder, coded_sidecar="write")
    wrapped = _wrap(cls, folder, coded_sidecar="read")
    _steps(wrapped, x, want, n=1)
    plain = wrapped.disable()
    with torch.no_grad():
        assert torch.equal(first(plain(**x)), want)
        for p in plain.parameters():
            p.mul_(1)  # writable private copies


# ----------------------------------------------------------------- options


@pytest.mark.parametrize("kw,match", [
    ({"coded_sidecar": "yes"}, r"coded_sidecar='yes' is not allowed; choose from: off, write, auto, read"),
    ({"coded_sidecar": None}, r"coded_sidecar=None is not allowed"),
    ({"coded_sidecar": "auto", "config": OffloadConfig.layerwise()}, r"coded_sidecar='auto' needs weight_codec"),
    ({"copy_path": "direct"}, r"copy_path='direct' is not allowed with weight_codec='exp-k'"),
    ({"staging_threads": 2}, r"staging_threads=2 is not allowed with weight_codec='exp-k'"),
])
def test_option_rejections(kw, match, tmp_path):
    model = _toy()
    path = _save(model.state_dict(), tmp_path / "toy.safetensors")
    cfg = kw.pop("config", CODED)
    with pytest.raises(ValueError, match=match):
        offload_from_safetensors(_meta(), path, cfg, device=DEV, **kw)
    assert not (tmp_path / SIDECAR_DIR).exists()


def test_codec_keeps_the_mmap_source_rules(tmp_path):
    model = _toy()
    path = _save(model.state_dict(), tmp_path / "toy.safetensors")
    cfg = OffloadConfig.layerwise(weight_codec="exp-k", resident_layers="auto", device_memory_budget_gb=1)
    with pytest.raises(ValueError, match="resident_layers='auto' is not allowed for the mmap source"):
        offload_from_safetensors(_meta(), path, cfg, device=DEV)


def test_unused_meta_model_is_refused_before_any_encode(tmp_path, encodes):
    with on_meta():
        m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="does not declare mmap loading support"):
        offload_from_safetensors(m, tmp_path, CODED, device=DEV)
    assert encodes[0] == 0


def test_exp_kp_sidecar_round_trip_and_is_its_own(tmp_path, encodes):
    """An exp-kp sidecar (version-3 tensors) loads without encoding, streams bit-exact, and is
    another file than the exp-k one (the identity names the codec and its format version)."""
    from weightstream.offload.sources.mmap_coded import _codec_id

    assert _codec_id("exp-kp") == ["exp-kp", 3, 4096]
    model, x, cls, folder, want = _flux(tmp_path)
    first_ = _wrap(cls, folder, CODEDP, coded_sidecar="write")
    assert 3 in _versions(first_) and not first_.stats()["sidecar_loaded"]
    (path,) = _sidecars(folder)
    encodes[0] = 0
    again = _wrap(cls, folder, CODEDP, coded_sidecar="read")
    s = again.stats()
    assert s["sidecar_loaded"] and encodes[0] == 0 and s["source"] == "coded-exp-kp-mmap"
    tables = [t for t in again.executor.source.tables if t is not None]
    assert 3 in _versions(again) and all(t.patched and not t.ranked for t in tables)  # as its re-encodes will be
    _steps(again, x, want, n=2)
    with pytest.raises(CodedSidecarError, match="cannot be read"):  # no exp-k sidecar: another name
        _wrap(cls, folder, CODED, coded_sidecar="read")
    assert _sidecars(folder) == [path]
