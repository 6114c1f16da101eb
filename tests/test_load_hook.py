"""``load_state_dict`` on streamed models (offload/load_hook.py, module/hooks.py LoadArrival): the
in-place handle's model, a parent of the wrapper, a module-offloaded component. Before: torch's load
copied into the empty placeholders and raised half way, the resident tensors written, the streamed
ones not (the in-place handle, layer-mode pipelines, module mode), and a parent of the wrapper could
not load the keys its own state_dict() wrote."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from weightstream import OffloadConfig, OffloadedTransformer, apply_layerwise_offload, offload_pipeline
from weightstream.models import flux_inputs, tiny_flux
from weightstream.offload.misuse import UnsupportedOperationError, WeightUpdateError


def _cfg(**kw):
    return OffloadConfig.layerwise(progress=False, resident_layers=kw.pop("resident_layers", [1]), **kw)


def _case(scale=1.5):
    model = tiny_flux(dtype=torch.bfloat16)
    x = flux_inputs(model)
    new = {k: v * scale for k, v in model.state_dict().items()}
    ref = copy.deepcopy(model)
    ref.load_state_dict(new)
    with torch.no_grad():
        want, old = ref(**x)[0], model(**x)[0]
    return model, x, new, want, old


def _out(model, x):
    with torch.no_grad():
        return model(**x)[0]


class _Pipe:
    pass


def _in_place(model, entry, **kw):
    if entry == "handle":
        return apply_layerwise_offload(model, _cfg(**kw), device="cpu")
    pipe = _Pipe()
    pipe.transformer = model
    return offload_pipeline(pipe, {"mode": entry, "components": ["dit"], "progress": False}, device="cpu")


@pytest.mark.parametrize("codec", ["none", "exp-k"])
@pytest.mark.parametrize("entry", ["handle", "layer", "module"])
def test_load_state_dict_in_place_loads_every_key(entry, codec):
    model, x, new, want, _ = _case()
    handle = _in_place(model, entry, weight_codec=codec) if entry == "handle" else _in_place(model, entry)
    assert _out(model, x) is not None
    result = model.load_state_dict(new)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_out(model, x), want)
    if entry == "module":
        handle.offload_all()  # the host master holds the loaded weights: the next arrival brings them
        assert torch.equal(_out(model, x), want)
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in new.items())
    plain = handle.remove() if entry == "handle" else (handle.disable(), model)[1]
    assert torch.equal(_out(plain, x), want)


def test_a_partial_non_strict_load_reports_what_torch_reports():
    model, x, new, _, old = _case()
    apply_layerwise_offload(model, _cfg(), device="cpu")
    some = {k: v for k, v in new.items() if k.startswith("transformer_blocks.0.")}
    some["not.a.key"] = torch.zeros(1)
    result = model.load_state_dict(some, strict=False)
    assert result.unexpected_keys == ["not.a.key"]
    assert sorted(result.missing_keys) == sorted(k for k in new if k not in some)
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in some.items() if k in new)
    assert not torch.equal(_out(model, x), old)
    with pytest.raises(RuntimeError, match="Missing key"):  # strict: torch's own report
        model.load_state_dict({k: v for k, v in new.items() if k.startswith("transformer_blocks.0.")})


def test_a_bad_shape_writes_nothing_and_assign_is_refused_by_name():
    model, x, new, _, old = _case()
    handle = apply_layerwise_offload(model, _cfg(), device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = dict(new)
    resident = "time_text_embed.timestep_embedder.linear_1.weight"  # not a block tensor: torch would copy it
    bad[resident] = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(WeightUpdateError, match="linear_1.weight.*shape.*nothing was written"):
        model.load_state_dict(bad)
    streamed = "transformer_blocks.0.attn.to_q.weight"
    bad = dict(new)
    bad[streamed] = new[streamed].float()  # a dtype the host store does not hold
    with pytest.raises(WeightUpdateError, match="to_q.weight"):
        model.load_state_dict(bad)
    with pytest.raises(UnsupportedOperationError, match="assign=True"):
        model.load_state_dict(new, assign=True)
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in before.items())
    assert torch.equal(_out(model, x), old)
    handle.remove()
    assert not model._load_state_dict_pre_hooks and not model._load_state_dict_post_hooks


def test_a_parent_of_the_wrapper_loads_its_own_state_dict():
    model, x, new, want, old = _case()
    wrapped = OffloadedTransformer(model, _cfg(), device="cpu")
    parent = nn.Module()
    parent.transformer = wrapped
    saved = {k: v.clone() for k, v in parent.state_dict().items()}
    assert all(k.startswith("transformer.") and ".module." not in k for k in saved)
    result = parent.load_state_dict({f"transformer.{k}": v for k, v in new.items()})
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_out(wrapped, x), want)
    parent.load_state_dict(saved)  # the round trip
    assert torch.equal(_out(wrapped, x), old)
    result = parent.load_state_dict({"transformer.x": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["transformer.x"]
    assert "transformer.transformer_blocks.0.attn.to_q.weight" in result.missing_keys
    assert not any(".module." in k for k in result.missing_keys)
    plain = wrapped.disable()
    assert not wrapped._load_state_dict_pre_hooks and not plain._load_state_dict_pre_hooks
