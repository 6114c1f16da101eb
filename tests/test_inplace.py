"""In-place layerwise offload: ``apply_layerwise_offload`` streams a model's
blocks without wrapping it (the class and the object stay), ``handle.remove()``
gives back the plain module. Compared with the unmodified tiny diffusers models.
With ``cuda_graphs='on'`` (a forward override on the instance): tests/test_inplace_gpu.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

from weightstream.offload.misuse import OffloadDisabledError
from weightstream.offload.placeholders import holds_placeholder
from diffusers import DiffusionPipeline, FluxTransformer2DModel, SD3Transformer2DModel

import weightstream
from weightstream import (
    AlreadyOffloadedError, LayerwiseOffloadHandle, OffloadConfig, OffloadedTransformer, apply_layerwise_offload,
    offload_pipeline,
)
from weightstream.models import flux_inputs, sd3_inputs, tiny_flux, tiny_sd3

DEV = "cpu"


def _cfg(**kw):
    return OffloadConfig.layerwise(progress=False, **kw)


def _flux():
    model = tiny_flux()
    ref = copy.deepcopy(model)
    x = flux_inputs(model)
    with torch.no_grad():
        expected = ref(**x)[0]
    return model, ref, x, expected


def _out(model, x):
    with torch.no_grad():
        return model(**x)[0]


def _weightstream_hooks(module) -> list:
    return [h for m in module.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
            if type(getattr(h, "__self__", None)).__module__.startswith("weightstream.")]


def test_exported_lazily():
    from weightstream.offload import transformer

    assert weightstream.apply_layerwise_offload is transformer.apply_layerwise_offload
    assert "apply_layerwise_offload" in weightstream.__all__ and "LayerwiseOffloadHandle" in dir(weightstream)


@pytest.mark.parametrize("resident", [0, 2])
def test_keeps_class_and_is_bit_exact(resident):
    model, ref, x, expected = _flux()
    handle = apply_layerwise_offload(model, _cfg(resident_layers=resident), device=DEV)
    assert isinstance(handle, LayerwiseOffloadHandle)
    assert type(model) is FluxTransformer2DModel and isinstance(model, FluxTransformer2DModel)
    assert "forward" not in model.__dict__  # no override without CUDA graphs
    assert handle.stats()["blocks_resident"] == resident and handle.stats()["blocks_streamed"] > 0
    streamed = handle.executor.blocks[-1].module
    assert all(holds_placeholder(p) for p in streamed.parameters())  # between forwards: placeholders
    for _ in range(3):
        assert torch.equal(_out(model, x), expected)
    r = repr(handle)
    assert "FluxTransformer2DModel" in r and "HostStateDictHook" in r and "forward=" not in r


def test_state_dict_gives_the_real_weights():
    model, ref, x, expected = _flux()
    apply_layerwise_offload(model, _cfg(), device=DEV)
    _out(model, x)
    sd, want = model.state_dict(), ref.state_dict()
    assert sd.keys() == want.keys()
    bad = [k for k in want if not torch.equal(sd[k], want[k])]
    assert not bad, bad[:5]


def test_save_pretrained_round_trips(tmp_path):
    model, _, x, expected = _flux()
    apply_layerwise_offload(model, _cfg(), device=DEV)
    assert torch.equal(_out(model, x), expected)
    model.save_pretrained(str(tmp_path / "saved"))  # the model's own method: it is still that class
    back = FluxTransformer2DModel.from_pretrained(str(tmp_path / "saved")).eval()
    assert torch.equal(_out(back, x), expected)
    assert torch.equal(_out(model, x), expected)  # saving changed nothing


def test_remove_gives_back_the_plain_module():
    model, _, x, expected = _flux()
    handle = apply_layerwise_offload(model, _cfg(num_slots=3), device=DEV)
    _out(model, x)
    assert _weightstream_hooks(model)
    assert handle.remove() is model
    assert not _weightstream_hooks(model) and "forward" not in model.__dict__
    assert all(t.numel() > 0 for t in model.state_dict().values())
    assert torch.equal(_out(model, x), expected)
    assert "removed" in repr(handle)
    with pytest.raises(OffloadDisabledError, match="removed"):
        handle.remove()
    with pytest.raises(OffloadDisabledError, match="removed"):
        handle.stats()
    again = apply_layerwise_offload(model, _cfg(), device=DEV)  # can be applied again
    assert torch.equal(_out(model, x), expected)
    again.remove()


def test_applying_twice_or_wrapping_is_refused():
    model, _, x, expected = _flux()
    apply_layerwise_offload(model, _cfg(), device=DEV)
    with pytest.raises(AlreadyOffloadedError, match="already streamed or offloaded by weightstream"):
        apply_layerwise_offload(model, _cfg(), device=DEV)
    with pytest.raises(AlreadyOffloadedError):
        OffloadedTransformer(model, _cfg(), device=DEV)
    assert torch.equal(_out(model, x), expected)  # the refusals changed nothing


@pytest.mark.parametrize("config, exc, match", [
    ({"mode": "module", "components": ["dit"]}, ValueError, "mode='module' is not allowed for apply_layerwise_offload"),
    ({"mode": "layer", "components": ["text_encoder"]}, ValueError, "does not select 'dit'"),
])
def test_config_errors_name_the_entry_point(config, exc, match):
    model, _, x, expected = _flux()
    with pytest.raises(exc, match=match):
        apply_layerwise_offload(model, config, device=DEV)
    assert not _weightstream_hooks(model) and torch.equal(_out(model, x), expected)


@pytest.mark.parametrize("entry, kw, match", [
    ("wrapper", {"devcie": DEV}, r"OffloadedTransformer\(\) got unknown keyword 'devcie', which is not allowed; "
                                 r"choose from: device, .*parallel, streamed \(did you mean 'device'\?\)"),
    ("in place", {"pln": None}, r"apply_layerwise_offload\(\) got unknown keyword 'pln', which is not allowed; "
                                r"choose from: plan, .*\(did you mean 'plan'\?\)"),
    ("wrapper", {"num_slots": 3}, r"got unknown keyword 'num_slots'.*config fields such as num_slots go in the "
                                  r"config: OffloadConfig.layerwise\(num_slots=3\)"),
])
def test_a_typo_keyword_names_the_allowed_ones_and_the_closest(entry, kw, match):
    from weightstream.offload.config import ConfigTypeError

    model, _, x, expected = _flux()
    make = OffloadedTransformer if entry == "wrapper" else apply_layerwise_offload
    with pytest.raises(ConfigTypeError, match=match) as e:
        make(model, _cfg(), **kw)
    assert isinstance(e.value, TypeError)  # as Python's own
    assert not _weightstream_hooks(model) and torch.equal(_out(model, x), expected)


def test_casts_and_moves_in_place_are_refused_by_name_and_a_no_op_move_works():
    from weightstream import UnsupportedOperationError

    model, _, x, expected = _flux()
    handle = apply_layerwise_offload(model, _cfg(), device=DEV)
    assert model.to("cpu") is model and model.to(torch.float32) is model
    assert torch.equal(_out(model, x), expected)
    for call, what in ((lambda: model.to(torch.bfloat16), r"\.to\(torch.bfloat16\)"),
                       (lambda: model.to("cuda"), r"\.to\(cuda\)"), (lambda: model.half(), r"\.half\(\)"),
                       (lambda: torch.nn.Sequential(model).double(), r"\.double\(\)")):
        with pytest.raises(UnsupportedOperationError, match=what + r".* on FluxTransformer2DModel streamed by "
                                                                   r"apply_layerwise_offload.*handle.remove\(\)"):
            call()
    assert torch.equal(_out(model, x), expected)
    assert "CastGuard" in repr(handle.cast_guard)
    handle.remove()
    assert "to" not in model.__dict__ and "_apply" not in model.__dict__


def test_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="must be a torch.nn.Module, got dict"):
        apply_layerwise_offload({}, _cfg(), device=DEV)


def test_update_weights_through_the_handle():
    model, ref, x, _ = _flux()
    handle = apply_layerwise_offload(model, _cfg(), device=DEV)
    new = {k: v * 0.5 for k, v in ref.state_dict().items() if k.startswith("single_transformer_blocks.0.")}
    assert sorted(handle.update_weights(new)) == sorted(new)
    ref.load_state_dict(new, strict=False)
    assert torch.equal(_out(model, x), _out(ref, x))


def test_sd3_skip_layers_in_place():
    model = tiny_sd3(num_layers=4)
    ref = copy.deepcopy(model)
    x = sd3_inputs(model)
    apply_layerwise_offload(model, _cfg(), device=DEV)
    assert isinstance(model, SD3Transformer2DModel)
    with torch.no_grad():
        for skip in (None, [3], [1, 2], None, [0]):
            kw = dict(x) if skip is None else {**x, "skip_layers": skip}
            assert torch.equal(model(**kw)[0], ref(**kw)[0]), skip


# ----------------------------------------------------------------- pipelines
class TinyPipe(DiffusionPipeline):
    """A diffusers pipeline holding only a transformer (save_pretrained writes it)."""

    def __init__(self, transformer):
        super().__init__()
        self.register_modules(transformer=transformer)

    def __call__(self, x):
        return self.transformer(**x)[0]


def test_pipeline_layer_mode_keeps_the_module_and_saves_it(tmp_path):
    model, _, x, expected = _flux()
    pipe = TinyPipe(model)
    handle = offload_pipeline(pipe, _cfg(), device=DEV)
    assert pipe.transformer is model and isinstance(handle.wrapped["transformer"], LayerwiseOffloadHandle)
    with torch.no_grad():
        assert torch.equal(pipe(x), expected)
    pipe.save_pretrained(str(tmp_path / "pipe"))
    back = FluxTransformer2DModel.from_pretrained(str(tmp_path / "pipe"), subfolder="transformer").eval()
    assert torch.equal(_out(back, x), expected)
    assert handle.disable() is pipe and pipe.transformer is model
    with torch.no_grad():
        assert torch.equal(pipe(x), expected)


def test_wrapper_local_state_dict_merges_into_the_weights():
    """OffloadedTransformer.local_state_dict(): the DLO AllGather executor over the
    fake world-of-1 group (test_happens_before) gives this rank's share, which
    merge_shards turns into the full weights; without DLO it is state_dict()."""
    from test_happens_before import _traced, fake_dlo
    from weightstream.offload.dlo.control import merge_shards
    from weightstream.offload.streamed import StreamedBlocks
    from weightstream.offload.streams import RecordingStreams

    model, ref, x, expected = _flux()
    streamed = fake_dlo(model, _cfg(), _traced(StreamedBlocks, RecordingStreams(), 2, "ring"))
    wrapped = OffloadedTransformer(model, _cfg(), device=DEV, streamed=streamed)
    assert torch.equal(_out(wrapped, x), expected)
    full, want = merge_shards([wrapped.local_state_dict()]), ref.state_dict()
    assert full.keys() == want.keys() and all(torch.equal(full[k], want[k]) for k in want)
    plain, _, _, _ = _flux()
    w2 = OffloadedTransformer(plain, _cfg(), device=DEV)
    assert w2.local_state_dict().keys() == want.keys()
