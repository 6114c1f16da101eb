"""The mmap source with weight_codec='exp-k' / 'exp-k2' and its coded sidecar, on the CPU.

Every output is compared with the unwrapped model bit for bit; sidecar reuse is
checked by the encoder's own call count; stale, foreign and corrupt sidecars by
rewriting real files.
"""
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import weightstream.offload.host.encode as coded_mod
from weightstream import OffloadConfig
from weightstream.kernels.codec_format import HEADER_BYTES
from weightstream.offload.host.checkpoint import CheckpointChangedError, meta_from_pretrained, on_meta
from weightstream.offload.host.sidecar import CodedSidecarError
from weightstream.offload.checkpoint_offload import offload_from_safetensors
from weightstream.offload.host.sidecar import SIDECAR_DIR

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
    from weightstream.offload.host.sidecar import _codec_id

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
    from weightstream.offload.host.sidecar import _codec_id

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


# ----------------------------------------------------------------- bytes at rest (a small bf16 model)

_W = 64  # width of the _Blocks model these tests stream: three blocks of identical layout


def _blocks_ckpt(tmp_path, scale=1.0, name="b.safetensors"):
    """(model, checkpoint path, input, its output): _Blocks in bf16, weights times ``scale``."""
    model = _toy(width=_W).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    path = _save(model.state_dict(), tmp_path / name)
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
    return model, path, x, want


def _bwrap(path, sidecar):
    return offload_from_safetensors(_meta(width=_W), path, CODED, device=DEV, coded_sidecar=sidecar)


def _out(wrapped, x):
    with torch.no_grad():
        return wrapped(x)


def _header(path):
    """(file bytes, header, where the header ends) of a sidecar."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[8:16])
    return data, json.loads(data[48 : 48 + n]), 48 + n


def _rewrite_header(path, head, data=None):
    """The sidecar with ``head`` as its header (its checksum recomputed, as a forger would)."""
    data = path.read_bytes() if data is None else data
    raw = json.dumps(head).encode()
    first = min(b["offset"] for b in head["blocks"])
    assert 48 + len(raw) <= first
    prefix = b"WSCSIDE1" + struct.pack("<Q", len(raw)) + hashlib.sha256(raw).digest() + raw
    path.write_bytes(prefix + bytes(first - len(prefix)) + data[first:])


def _inside_a_tensor(rec):
    """A byte of block ``rec``'s first coded tensor past its header (no structural check reads it)."""
    starts = sorted(src for src, _ in rec["segments"]) + [rec["coded"]]
    at = starts[0] + HEADER_BYTES + 64
    assert at < starts[1]
    return rec["offset"] + at


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


_FLIPS = {  # where a byte flips -> what the refusal names
    "block0-payload": (lambda head, end: head["blocks"][0]["offset"] + head["blocks"][0]["coded"] // 2, "'blocks.0'"),
    "block1-payload": (lambda head, end: head["blocks"][1]["offset"] + head["blocks"][1]["coded"] - 3, "'blocks.1'"),
    "last-slack-byte": (lambda head, end: head["blocks"][-1]["offset"] + head["blocks"][-1]["copy_bytes"] - 1,
                        "'blocks.2'"),
    "zero-padding": (lambda head, end: end + 5, "do not tile"),
}


@pytest.mark.parametrize("where", list(_FLIPS))
def test_a_flipped_byte_is_refused_by_read_and_re_encoded_by_auto(where, tmp_path, encodes):
    """Every byte of a sidecar is checked before an output uses it: 'read' raises naming the
    block (at load or at its first use, never an output), 'auto' warns once and re-encodes."""
    model, path, x, want = _blocks_ckpt(tmp_path)
    _bwrap(path, "write")
    (side,) = _sidecars(tmp_path)
    _, head, end = _header(side)
    at, names = _FLIPS[where]
    _flip(side, at(head, end))
    with pytest.raises(CodedSidecarError, match=names) as e:
        _out(_bwrap(path, "read"), x)
    assert "coded_sidecar='auto'" in str(e.value) or "not usable" in str(e.value)
    encodes[0] = 0
    with pytest.warns(UserWarning, match=names) as w:
        wrapped = _bwrap(path, "auto")
    assert encodes[0] > 0 and not wrapped.stats()["sidecar_loaded"]
    assert [str(r.message).count("\n") for r in w if names in str(r.message)] == [0]  # one line
    assert torch.equal(_out(wrapped, x), want)
    again = _bwrap(path, "read")  # the rewritten sidecar is good and checked
    assert torch.equal(_out(again, x), want)
    s = again.stats()
    assert s["sidecar_loaded"] and s["sidecar_verified_blocks"] == 3 and s["sidecar_verify_threads"] >= 1


def test_read_checks_a_block_before_its_first_use_and_every_recovery_path(tmp_path):
    """'read' does not wait for every checksum at load (the ring's first slots, blocks 0 and 1, are
    loaded and checked at setup); block 2, whose bytes do not match, is refused at its first load,
    and state_dict() / disable() refuse it too (no decoder error, no weights)."""
    model, path, x, want = _blocks_ckpt(tmp_path)
    _bwrap(path, "write")
    (side,) = _sidecars(tmp_path)
    _, head, _ = _header(side)
    _flip(side, _inside_a_tensor(head["blocks"][2]))  # past every coded header: only its checksum can tell
    wrapped = _bwrap(path, "read")
    for call in (lambda: _out(wrapped, x), lambda: _out(wrapped, x), wrapped.state_dict, wrapped.disable):
        with pytest.raises(CodedSidecarError, match=r"block 'blocks.2' \(position 2\) do not match the checksum"):
            call()


@pytest.mark.parametrize("swap", ["records", "fields", "regions"])
def test_swapped_block_records_or_regions_are_refused(swap, tmp_path):
    """Blocks 0 and 1 have the same layout: swapping their records (the header's checksum
    recomputed), the records' data fields, or the regions with their records' coded fields,
    would stream one block's weights in place of the other's."""
    model, path, x, want = _blocks_ckpt(tmp_path)
    _bwrap(path, "write")
    (side,) = _sidecars(tmp_path)
    data, head, _ = _header(side)
    b0, b1 = head["blocks"][0], head["blocks"][1]
    assert b0["copy_bytes"] == b1["copy_bytes"]  # the regions can trade places
    if swap == "records":
        head["blocks"][0], head["blocks"][1] = b1, b0
    else:
        moved = ["coded", "segments", "sha256"] + (["offset"] if swap == "fields" else [])
        for f in moved:
            if f in b0:
                b0[f], b1[f] = b1[f], b0[f]
        if swap == "regions":
            n, a, b = b0["copy_bytes"], b0["offset"], b1["offset"]
            data = data[:a] + data[b : b + n] + data[a + n : b] + data[a : a + n] + data[b + n :]
    _rewrite_header(side, head, data)
    with pytest.raises(CodedSidecarError, match="blocks.[01]"):
        _out(_bwrap(path, "read"), x)
    with pytest.warns(UserWarning, match="blocks.[01]"):
        wrapped = _bwrap(path, "auto")
    assert torch.equal(_out(wrapped, x), want)


def _rewrite_in_place(path, new: bytes):
    """``new`` written over ``path`` in place (same inode, same size), its mtime put back."""
    st = os.stat(path)
    assert len(new) == st.st_size
    with open(path, "r+b") as f:
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert now.st_ctime_ns != st.st_ctime_ns  # what no writer can put back


def test_a_checkpoint_rewritten_in_place_with_its_mtime_put_back_makes_the_sidecar_stale(tmp_path, encodes):
    model, path, x, want = _blocks_ckpt(tmp_path)
    _bwrap(path, "write")
    _, other, _, want_new = _blocks_ckpt(tmp_path, scale=-0.5, name="other.safetensors")
    assert not torch.equal(want, want_new)
    _rewrite_in_place(path, other.read_bytes())
    with pytest.raises(CodedSidecarError, match=r"stale: checkpoint file .* changed since it was written \(ctime_ns"):
        _bwrap(path, "read")
    encodes[0] = 0
    with pytest.warns(UserWarning, match="ctime_ns"):
        wrapped = _bwrap(path, "auto")
    assert encodes[0] > 0 and torch.equal(_out(wrapped, x), want_new)
    assert torch.equal(_out(_bwrap(path, "read"), x), want_new)


def test_a_mapped_sidecar_written_in_place_with_its_mtime_put_back_is_an_error(tmp_path):
    """A sidecar replaced atomically under a reader leaves the reader's mapping whole (it keeps
    streaming); one written in place, its mtime put back, is a named error at the next step."""
    model, path, x, want = _blocks_ckpt(tmp_path)
    _bwrap(path, "write")
    (side,) = _sidecars(tmp_path)
    first = _bwrap(path, "read")
    assert torch.equal(_out(first, x), want)
    inode = side.stat().st_ino
    _bwrap(path, "write")  # another start rewrites it: a new file renamed over the mapped one
    assert side.stat().st_ino != inode
    assert torch.equal(_out(first, x), want)
    second = _bwrap(path, "read")
    assert torch.equal(_out(second, x), want)
    data, head, _ = _header(side)
    at = _inside_a_tensor(head["blocks"][0])
    _rewrite_in_place(side, data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :])
    with pytest.raises(CheckpointChangedError, match=r"\.wsc' changed while this process streams .*ctime_ns"):
        _out(second, x)
    assert torch.equal(_out(first, x), want)  # its own (replaced) file is untouched


_TRUNCATE_SIDECAR = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {here!r})
    from pathlib import Path
    import test_mmap_coded as t
    from weightstream.offload.host.checkpoint import CheckpointChangedError
    tmp = Path({tmp!r})
    model, path, x, want = t._blocks_ckpt(tmp)
    t._bwrap(path, "write")
    (side,) = t._sidecars(tmp)
    every, one = t._bwrap(path, "read"), t._bwrap(path, "read")
    assert torch.equal(t._out(every, x), want) and torch.equal(t._out(one, x), want)
    key = "blocks.1.0.weight"
    with torch.no_grad():
        one.update_weights({{key: model.state_dict()[key] * 0.5}})  # block 1: re-encoded into private memory
    os.truncate(side, 4096)
    for name, w in (("every", every), ("one", one)):
        for what, call in (("forward", lambda: t._out(w, x)), ("state_dict", w.state_dict), ("disable", w.disable)):
            try:
                call()
            except CheckpointChangedError as e:
                m = str(e)
                print("NAMED", name, what, ".wsc" in m and "size" in m, "build a new wrapper" in m,
                      "(blocks.1)" in m, flush=True)
            else:
                print("NO ERROR", name, what, flush=True)
""")


def test_a_sidecar_truncated_while_mapped_is_a_named_error_on_every_recovery_path(tmp_path):
    """The forward, state_dict() and disable() stat the sidecar before they read its pages:
    the named error (naming the blocks still in private memory), never SIGBUS or a decoder error."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = _TRUNCATE_SIDECAR.format(here=here, tmp=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"rc={r.returncode} (-7 is SIGBUS)\n{r.stdout}\n{r.stderr[-4000:]}"
    assert r.stdout.split("\n")[:6] == [f"NAMED {n} {w} True True {n == 'one'}" for n in ("every", "one")
                                        for w in ("forward", "state_dict", "disable")], r.stdout


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_encoded_blocks_leave_the_resident_set(tmp_path):
    """Blocks encoded from the mapping are read once: drop_pages gives their mapped pages back
    (setup peak RSS near the model, not the model twice: 1.76 x on the H200 before), and the
    bytes read again afterwards are the file's."""
    from safetensors.torch import save_file

    from weightstream.offload.host.checkpoint import Checkpoint

    gen = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(1024, 2048, generator=gen).bfloat16() for i in range(8)}  # 32 MB
    save_file(tensors, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint(tmp_path / "m.safetensors")
    try:
        before = _rss_file()
        total = sum(int(ckpt.tensor(t).view(torch.int16).sum()) for t in ckpt.entries.values())
        read = _rss_file()
        ckpt.drop_pages(list(ckpt.entries.values()))
        dropped = _rss_file()
        assert read - before > 24e6 and read - dropped > 24e6, (before, read, dropped)
        for key, t in ckpt.entries.items():
            assert torch.equal(ckpt.tensor(t), tensors[key])
        assert total == sum(int(v.view(torch.int16).sum()) for v in tensors.values())
    finally:
        ckpt.close()
