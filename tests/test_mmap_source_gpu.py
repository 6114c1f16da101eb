"""The mmap checkpoint source on CUDA (run on the device machine: pytest -m gpu)."""
import warnings

import pytest
import torch

from weightstream import OffloadConfig
from weightstream.offload.host.registration import HOST_REGISTER_READ_ONLY
from weightstream.offload.host.checkpoint import meta_from_pretrained
from weightstream.offload.checkpoint_offload import offload_from_safetensors

from test_mmap_source import (
    _GQA, _diffusers_case, _gqa_ckpt, _meta, _source, _toy, _transposed_ckpt, _Transposed, _x, first,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _run(name, tmp_path, *, dtype=torch.bfloat16, steps=3, **kw):
    """(wrapped, warnings) after checking `steps` streamed outputs against the resident model."""
    model, x, cls, folder = _diffusers_case(name, tmp_path, dtype=dtype, **kw.pop("save", {}))
    x = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    ref = model.to(DEV)
    with torch.no_grad():
        want = first(ref(**x))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = offload_from_safetensors(meta_from_pretrained(cls, folder), folder, device=DEV, **kw)
            outs = [first(wrapped(**x)) for _ in range(steps)]
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert out.device.type == "cuda"
        assert torch.equal(out, want), f"step {i}: max diff {(out.float() - want.float()).abs().max()}"
    ours = [w for w in caught if "weightstream" in str(w.message)]
    return wrapped, ours


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_direct_dma_from_registered_pages(name, tmp_path):
    wrapped, warned = _run(name, tmp_path)
    s = wrapped.stats()
    assert not warned
    assert s["direct_blocks"] == s["blocks_streamed"] and s["staged_blocks"] == 0
    assert s["pinned"] is True and s["registered_bytes"] > 0 and s["registration_chunks"] >= 1
    assert s["register_flags"] in (HOST_REGISTER_READ_ONLY, 0)
    assert s["staging_buffers"] == 0 and _source(wrapped).stager is None
    assert s["copies_per_step"] < sum(len(lay.tensors) for lay in _source(wrapped).layouts)


def test_direct_dma_sharded_checkpoint_fp32(tmp_path):
    wrapped, warned = _run("flux", tmp_path, dtype=torch.float32, save={"max_shard_size": "20KB"})
    assert not warned and wrapped.stats()["checkpoint_files"] > 3 and wrapped.stats()["pinned"]


def test_staging_fallback_under_a_tiny_budget_warns_once(tmp_path):
    cfg = OffloadConfig.layerwise(pinned_memory_budget_gb=1e-9)
    wrapped, warned = _run("flux", tmp_path, config=cfg, steps=4)
    s = wrapped.stats()
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert "pinned_memory_budget_gb=1e-09" in str(warned[0].message)
    assert s["staged_blocks"] == s["blocks_streamed"] and s["registered_bytes"] == 0
    assert s["staging_buffers"] == 2 and s["staging_kind"] in ("registered", "pin_memory")
    assert s["staging_max_ready"] <= 2 and s["pinned"] is False
    names = _source(wrapped).pack_threads  # the packer thread and its copy pool, never the forward thread
    assert "weightstream-stager" in names and all(n.startswith("weightstream-stager") for n in names)


def test_partial_budget_mixes_direct_and_staged_blocks(tmp_path):
    model, _, cls, folder = _diffusers_case("flux", tmp_path, dtype=torch.bfloat16)
    probe = offload_from_safetensors(meta_from_pretrained(cls, folder), folder, device=DEV)
    full = probe.stats()["registered_bytes"]
    probe.disable()
    cfg = OffloadConfig.layerwise(pinned_memory_budget_gb=full / 2 / 1e9)
    wrapped, warned = _run("flux", tmp_path / "again", config=cfg)
    s = wrapped.stats()
    assert len(warned) == 1
    assert s["direct_blocks"] >= 1 and s["staged_blocks"] >= 1
    assert s["registered_bytes"] <= full / 2


def test_forced_staging_does_not_warn(tmp_path):
    wrapped, warned = _run("wan", tmp_path, copy_path="staging")
    s = wrapped.stats()
    assert not warned and s["staged_blocks"] == s["blocks_streamed"] and s["registered_bytes"] == 0


def test_kernel_transform_on_the_copy_stream(tmp_path):
    model = _toy(_GQA)
    path = _gqa_ckpt(model, tmp_path / "gqa.safetensors")
    ref = model.to(DEV)
    x = _x().to(DEV)
    with torch.no_grad():
        want = ref(x)
        wrapped = offload_from_safetensors(_meta(_GQA), path, device=DEV)
        outs = [wrapped(x) for _ in range(3)]
    assert all(torch.equal(o, want) for o in outs)
    s = wrapped.stats()
    assert s["direct_blocks"] == 3 and s["materialise_launches_per_step"] == 3 and s["wire_bytes"] > 0


def test_python_transform_stages_on_cuda(tmp_path):
    model = _toy()
    path = _transposed_ckpt(model, tmp_path / "t.safetensors")
    ref = model.to(DEV)
    x = _x().to(DEV)
    with torch.no_grad():
        want = ref(x)
        wrapped = offload_from_safetensors(_meta(_Transposed), path, device=DEV)
        assert all(torch.equal(wrapped(x), want) for _ in range(3))
    assert wrapped.stats()["staged_blocks"] == 3


def test_device_weight_memory_is_resident_plus_slots(tmp_path):
    model, x, cls, folder = _diffusers_case("flux", tmp_path, dtype=torch.bfloat16)
    x = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    wrapped = offload_from_safetensors(meta_from_pretrained(cls, folder), folder, device=DEV)
    torch.cuda.synchronize()
    s = wrapped.stats()
    held = torch.cuda.memory_allocated() - base
    assert held <= s["resident_bytes"] + s["slot_bytes"] + s["wire_bytes"] + (1 << 20)
    plain = wrapped.disable()
    with torch.no_grad():
        assert torch.equal(first(plain(**x)), first(model.to(DEV)(**x)))


# ----------------------------------------------------------------- trust: reload and changed files


def _trust_case(tmp_path, **cfg):
    from test_trust_mmap import _pair, _wrap

    path, other, a, b = _pair(tmp_path)
    wrapped = _wrap(path, "auto", DEV, **cfg)
    return path, other, a.to(DEV), b.to(DEV), wrapped


def test_mmap_direct_copies_refuse_cuda_graphs_up_front(tmp_path):
    """torch does not count registered file pages as pinned and refuses such copies
    inside a capture: a named error at construction, never a silent eager fallback."""
    from test_trust_mmap import _pair, _wrap

    from weightstream import UnsupportedCombinationError

    path, _, _, _ = _pair(tmp_path)
    with pytest.raises(UnsupportedCombinationError, match="direct copies"):
        _wrap(path, "direct", DEV, cuda_graphs="on")

@pytest.mark.parametrize("graphs", ["off"])  # "on": direct copies cannot be captured (test above)
def test_mmap_file_changed_in_place_is_an_error_on_cuda(graphs, tmp_path):
    import shutil

    from weightstream.models import toy_inputs
    from weightstream.offload.host.checkpoint import CheckpointChangedError

    path, other, a, _, w = _trust_case(tmp_path, cuda_graphs=graphs)
    x = toy_inputs(device=DEV)
    with torch.no_grad():
        want = a(**x)
        assert all(torch.equal(w(**x), want) for _ in range(5))
        if graphs == "on":
            assert w.graphs.counts["replay"] >= 2
        torch.cuda.synchronize()
        shutil.copyfile(other, path)
        for _ in range(2):
            with pytest.raises(CheckpointChangedError, match="atomically"):
                w(**x)
        with pytest.raises(CheckpointChangedError):
            w.state_dict()


def test_mmap_truncation_on_cuda_is_a_named_error_not_sigbus(tmp_path):
    from test_trust_mmap import test_truncation_is_a_named_error_not_sigbus

    test_truncation_is_a_named_error_not_sigbus("auto", tmp_path, device=DEV)


@pytest.mark.parametrize("budget", [None, 1e-9])  # None: direct copies; 1e-9: every block stages
def test_explicit_resident_set_on_cuda(budget, tmp_path):
    """Resident blocks anywhere (blocks 1 and 3 of 7): direct or staged loads of the
    other five on the copy stream, bit-exact over several steps; image() (disable)
    reads registered pages without spanning two registrations."""
    from test_trust_mmap import _pair, _wrap

    from weightstream.models import toy_inputs

    path, _, a, _ = _pair(tmp_path)
    x = toy_inputs(device=DEV)
    ref = a.to(DEV)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny budget warns once (tested above)
        want = ref(**x)
        wrapped = _wrap(path, "auto", DEV, resident_layers=[1, 3], pinned_memory_budget_gb=budget)
        outs = [wrapped(**x) for _ in range(4)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, want) for o in outs)
    s = wrapped.stats()
    assert s["resident_blocks"] == [1, 3] and s["blocks_streamed"] == 5
    assert (s["direct_blocks"], s["staged_blocks"]) == ((5, 0) if budget is None else (0, 5))
    with torch.no_grad():
        plain = wrapped.disable()
        assert torch.equal(plain(**x), want)
