"""A streamed tensor between forwards (offload/placeholders.py): metadata as bound, named
errors for reads, in-place ops, copies and pickles; ``.data`` a device copy whose edits take
effect (what peft's merge does). CPU, against the resident model."""
import copy
import pickle

import pytest
import torch
from torch import nn

from weightstream import (
    OffloadConfig, OffloadedTransformer, StreamedModuleAccessError, UnsupportedOperationError,
    WeightUpdateError, apply_layerwise_offload,
)
from weightstream.offload.placeholders import holds_placeholder

from layerwise_cases import build, first

DEV = "cpu"


def _wrapped(cfg=None):
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(**(cfg or {})), device=DEV)
    with torch.no_grad():
        wrapped(**x)
    return model, ref, x, wrapped


def test_metadata_is_that_of_the_bound_tensor():
    model, ref, _, _ = _wrapped()
    p, r = model.single_blocks[2].up.weight, ref.single_blocks[2].up.weight
    assert holds_placeholder(p) and isinstance(p, nn.Parameter)
    assert p.shape == r.shape and p.size() == r.size() and p.numel() == r.numel() and p.dim() == 2
    assert p.dtype == r.dtype and p.stride() == r.stride() and p.is_contiguous() and p.device == torch.device(DEV)
    assert p.requires_grad == r.requires_grad and p.element_size() == r.element_size()
    assert sum(t.numel() for t in model.parameters()) == sum(t.numel() for t in ref.parameters())
    assert "single_blocks.2.up.weight" in repr(p) and "host store" in f"{p}"


@pytest.mark.parametrize("read", ["sum", "linear", "matmul", "clone", "to", "index", "cat", "bool"])
def test_reading_values_between_forwards_is_a_named_error(read):
    model, _, _, _ = _wrapped()
    p = model.single_blocks[2].up.weight
    calls = {
        "sum": lambda: p.sum(), "linear": lambda: nn.functional.linear(torch.ones(1, 32), p),
        "matmul": lambda: torch.ones(1, p.shape[0]) @ p, "clone": lambda: p.clone(), "to": lambda: p.to(torch.float64),
        "index": lambda: p[0], "cat": lambda: torch.cat([p, p]), "bool": lambda: bool(p.any()),
    }
    with pytest.raises(StreamedModuleAccessError, match=r"single_blocks\.2\.up\.weight.*'single_blocks\.2'.*resident"):
        calls[read]()


def test_submodule_of_a_streamed_block_called_outside_its_forward():
    model, ref, x, wrapped = _wrapped()
    with torch.no_grad(), pytest.raises(StreamedModuleAccessError, match=r"single_blocks\.2\.up"):
        model.single_blocks[2].up(torch.ones(1, 32))
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))  # nothing changed


@pytest.mark.parametrize("how", ["deepcopy-inner", "deepcopy-block", "pickle-block"])
def test_copies_of_the_inner_module_are_named_errors(how):
    model, ref, x, wrapped = _wrapped()
    with pytest.raises(UnsupportedOperationError, match=r"state_dict\(\)|disable\(\)"):
        if how == "deepcopy-inner":
            copy.deepcopy(model)
        elif how == "deepcopy-block":
            copy.deepcopy(model.single_blocks[2])
        else:
            pickle.dumps(model.single_blocks[2].up.weight)
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))


def test_data_assignment_of_a_wrong_value_is_refused_and_writes_nothing():
    model, ref, x, wrapped = _wrapped()
    p = model.single_blocks[2].up.weight
    for bad in (torch.zeros(3, 3), torch.zeros(p.shape, dtype=torch.float64), torch.empty(p.shape, device="meta")):
        with pytest.raises(WeightUpdateError, match=r"single_blocks\.2\.up\.weight"):
            p.data = bad
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))


def test_data_write_on_a_read_only_source_is_refused(tmp_path):
    """The mmap source is read-only: a .data assignment says so (named), nothing changes."""
    from safetensors.torch import save_file
    from weightstream import offload_from_safetensors
    from weightstream.models import ToyDiT

    class OptIn(ToyDiT):
        _supports_mmap_loading = True

    src = OptIn()
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        meta = OptIn()
    wrapped = offload_from_safetensors(meta, tmp_path / "model.safetensors", device=DEV)
    p = meta.single_blocks[2].up.weight
    with pytest.raises(WeightUpdateError, match=r"read-only"):
        p.data = torch.zeros(p.shape)
    x = torch.randn(1, 6, 8)
    with torch.no_grad():
        assert torch.equal(wrapped(x), src(x))
    wrapped.disable()


@pytest.mark.parametrize("entry", ["wrapper", "inplace"])
@pytest.mark.parametrize("safe_merge", [False, True])
def test_peft_merge_and_unmerge_on_streamed_blocks(entry, safe_merge):
    """peft LoRA layers injected into streamed blocks after offloading: merge() writes each
    base weight through .data, and the next forward uses it, bit-exact against the same calls
    on the resident model; unmerge() gives the base weights back."""
    import peft
    model, ref, x = build("toy", DEV)
    if entry == "wrapper":
        call = OffloadedTransformer(model, None, device=DEV)
    else:
        apply_layerwise_offload(model, None, device=DEV)
        call = model
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up"], init_lora_weights=False)
    torch.manual_seed(1)
    peft.inject_adapter_in_model(cfg, model)
    torch.manual_seed(1)
    peft.inject_adapter_in_model(cfg, ref)
    layers = lambda m: [mod for mod in m.modules() if isinstance(mod, peft.tuners.lora.LoraLayer)]
    with torch.no_grad():
        for a, b in zip(layers(model), layers(ref)):
            for pa, pb in zip(a.lora_A.parameters(), b.lora_A.parameters()):
                pa.copy_(pb)
            for pa, pb in zip(a.lora_B.parameters(), b.lora_B.parameters()):
                pa.copy_(pb)
        base = first(ref(**x))
        assert torch.equal(first(call(**x)), base)  # unmerged adapters, resident beside the stream
        for m in (model, ref):
            for layer in layers(m):
                layer.merge(safe_merge=safe_merge)
        merged = first(ref(**x))
        assert not torch.equal(merged, base)
        assert torch.equal(first(call(**x)), merged)
        assert torch.equal(first(call(**x)), merged)
        for m in (model, ref):
            for layer in layers(m):
                layer.unmerge()
        assert torch.equal(first(call(**x)), first(ref(**x)))
