"""Module (model-level) offload on CPU: discovery, exclusion, equality, lifecycle, errors.

The device is "cpu": the same mechanism as on CUDA (host image -> private
device buffer on arrival, placeholders on departure), without streams.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from weightstream.demo_module import (
    DeclaredToyPipeline,
    ToyDenoiser,
    ToyPipeline,
    ToyTextEncoder,
    toy_pipeline_inputs,
)
from weightstream.offload.components import SupportsComponentDiscovery, discover_components
from weightstream.offload.config import OffloadConfig
from weightstream.offload.module import ModuleOffload
from weightstream.offload.pipeline import offload_pipeline
from weightstream.offload.misuse import AlreadyOffloadedError, OffloadDisabledError
from weightstream.offload.placeholders import holds_placeholder

ALL = ["dit", "text_encoder", "vae"]
DITS = {"transformer", "transformer_2"}
ENCODERS = {"text_encoder", "text_encoder_2"}


def cfg(components=ALL, **kw):
    return OffloadConfig.module(components, progress=False, **kw)


@pytest.fixture
def toy():
    pipe = ToyPipeline()
    inputs = toy_pipeline_inputs()
    expected = copy.deepcopy(pipe)(**inputs)
    return pipe, inputs, expected


def swapped_on_device(handle: ModuleOffload) -> set[str]:
    return {n for n in handle.on_device() if handle.units[n].swapped}


def check_exclusive(on: set[str]) -> None:
    """Exactly one DiT, or only encoders (any number), or nothing."""
    dits, encs = on & DITS, on & ENCODERS
    assert len(dits) <= 1, on
    assert not (dits and encs), on


# ------------------------------------------------------------------ equality
def test_outputs_equal_resident_over_several_calls(toy):
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    for _ in range(3):
        assert torch.equal(pipe(**inputs), expected)
    s = handle.stats()
    # per call: 2 encoders arrive, then 2 DiTs one after the other
    assert s["components"]["transformer"]["arrivals"] == 3
    assert s["components"]["text_encoder"]["arrivals"] == 3
    assert s["components"]["vae"]["arrivals"] == 1  # arrives once at setup, never swapped
    assert s["components"]["vae"]["departures"] == 0


def test_declared_pipeline_equal_and_resident_inside_component():
    pipe = DeclaredToyPipeline()
    inputs = toy_pipeline_inputs()
    expected = copy.deepcopy(pipe)(**inputs)
    text_proj_w = pipe.transformer.text_proj.weight
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    assert handle.components.source == "SupportsComponentDiscovery"
    assert torch.equal(pipe(**inputs), expected)
    # transformer is off the device now, its resident submodule is not
    assert "transformer" not in handle.on_device()
    assert holds_placeholder(pipe.transformer.proj_in.weight)  # shape kept, no storage (offload/placeholders.py)
    assert pipe.transformer.text_proj.weight is text_proj_w and not holds_placeholder(text_proj_w)
    assert torch.equal(pipe(**inputs), expected)
    assert handle.stats()["components"]["transformer.text_proj"]["where"] == "device"


def test_diffusers_flux_transformer_as_dit():
    from weightstream.models import flux_inputs, tiny_flux

    class FluxLike:
        def __init__(self):
            self.transformer = tiny_flux()
            self.text_encoder = ToyTextEncoder()

    pipe = FluxLike()
    kw = flux_inputs(pipe.transformer)
    ids = toy_pipeline_inputs()["ids"]
    ref = copy.deepcopy(pipe)
    expected = (ref.text_encoder(ids), ref.transformer(**kw)[0])
    handle = offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device="cpu")
    for _ in range(2):
        assert torch.equal(pipe.text_encoder(ids), expected[0])
        assert handle.on_device() == ("text_encoder",)
        assert torch.equal(pipe.transformer(**kw)[0], expected[1])
        assert handle.on_device() == ("transformer",)


# ----------------------------------------------------------------- residency
def test_exclusion_observed_at_every_hook(toy):
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    seen = []

    def observer(name):
        def hook(module, args):  # registered after ours: sees the state the forward runs in
            on = swapped_on_device(handle)
            seen.append((name, on))
            assert name in handle.on_device(), (name, on)
            check_exclusive(on)
        return hook

    names = ["text_encoder", "text_encoder_2", "transformer", "transformer_2", "vae"]
    handles = [getattr(pipe, n).register_forward_pre_hook(observer(n)) for n in names]
    handles.append(pipe.vae.decoder.register_forward_pre_hook(observer("vae")))
    for _ in range(2):
        assert torch.equal(pipe(**inputs), expected)
    for h in handles:
        h.remove()
    order = [n for n, _ in seen]
    call = ["text_encoder", "text_encoder_2"] + ["transformer"] * 2 + ["transformer_2"] * 2 + ["vae"]
    assert order == call * 2
    assert seen[1] == ("text_encoder_2", {"text_encoder", "text_encoder_2"})  # encoders share the device
    assert seen[2] == ("transformer", {"transformer"})
    assert seen[4] == ("transformer_2", {"transformer_2"})  # two DiTs exclude each other
    assert seen[7] == ("text_encoder", {"text_encoder"})  # next call: the DiT left first


def test_event_log_records_state_at_every_hook(toy):
    pipe, inputs, _ = toy
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    pipe(**inputs)
    enters = [e for e in handle.events if e.action == "enter"]
    assert [e.unit for e in enters] == ["text_encoder", "text_encoder_2", "transformer", "transformer",
                                        "transformer_2", "transformer_2"]
    for e in enters:
        assert e.unit in e.on_device
        check_exclusive(set(e.on_device) - {"vae"})
    moves = [(e.action, e.unit) for e in handle.events if e.action != "enter"]
    assert moves == [
        ("arrive", "vae"),
        ("arrive", "text_encoder"), ("arrive", "text_encoder_2"),
        ("depart", "text_encoder"), ("depart", "text_encoder_2"), ("arrive", "transformer"),
        ("depart", "transformer"), ("arrive", "transformer_2"),
    ]
    seqs = [e.seq for e in handle.events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    s = handle.stats()
    assert s["transitions"] == len(moves)
    assert s["h2d_bytes"] == sum(e.nbytes for e in handle.events if e.action == "arrive")


def test_unselected_components_stay_resident(toy):
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, cfg(["dit"]), device="cpu")
    assert set(handle.units) == DITS
    for _ in range(2):
        assert torch.equal(pipe(**inputs), expected)
    s = handle.stats()
    for name in ("text_encoder", "text_encoder_2", "vae"):
        assert s["components"][name]["where"] == "device" and not s["components"][name]["swapped"]
    assert pipe.text_encoder.embed.weight.numel() > 0


def test_vae_unselected_is_not_packed(toy):
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device="cpu")
    assert "vae" not in handle.units
    assert torch.equal(pipe(**inputs), expected)


def test_views_are_aligned_and_placeholders_empty(toy):
    pipe, inputs, _ = toy
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    assert holds_placeholder(pipe.transformer.proj_in.weight)  # off: placeholder
    pipe(**inputs)
    assert "transformer_2" in handle.on_device()
    for p in list(pipe.transformer_2.parameters()):
        assert p.data_ptr() % 512 == 0
    w = pipe.transformer_2.proj_in.weight
    assert w.shape == (32, 8) and w.dtype == torch.float32


# -------------------------------------------------------------- identity etc.
def test_parameter_identity_kept(toy):
    pipe, inputs, expected = toy
    mods = {n: getattr(pipe, n) for n in ("text_encoder", "text_encoder_2", "transformer", "transformer_2", "vae")}
    before = {n: [(k, id(p)) for k, p in m.named_parameters()] for n, m in mods.items()}
    bufs = {n: [(k, id(b)) for k, b in m.named_buffers()] for n, m in mods.items()}
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    pipe(**inputs)
    for n, m in mods.items():
        assert getattr(pipe, n) is m
        assert [(k, id(p)) for k, p in m.named_parameters()] == before[n]
        assert [(k, id(b)) for k, b in m.named_buffers()] == bufs[n]
        assert all(isinstance(p, nn.Parameter) for p in m.parameters())
    handle.disable()
    for n, m in mods.items():
        assert [(k, id(p)) for k, p in m.named_parameters()] == before[n]
    assert torch.equal(pipe(**inputs), expected)


def test_disable_round_trip(toy):
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    pipe(**inputs)
    arena = handle.store.arena
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    assert handle.disable() is pipe
    assert handle.disabled and "disabled" in repr(handle)
    assert handle.disable() is pipe  # idempotent
    for m in (pipe.text_encoder, pipe.transformer, pipe.transformer_2, pipe.vae):
        assert not m._forward_pre_hooks and not m._forward_hooks
        for t in list(m.parameters()) + list(m.buffers()):
            assert t.numel() > 0
            assert not (lo <= t.data_ptr() < hi)  # own storage, not a view of the host store
    assert not pipe.vae.decoder._forward_pre_hooks
    assert torch.equal(pipe(**inputs), expected)
    with pytest.raises(OffloadDisabledError, match="disabled"):
        handle.stats()
    with pytest.raises(OffloadDisabledError, match="disabled"):
        with handle.using("text_encoder"):
            pass
    # offloading again after disable works
    handle2 = offload_pipeline(pipe, cfg(), device="cpu")
    assert torch.equal(pipe(**inputs), expected)
    handle2.disable()


def test_offload_all_frees_every_swapped_unit(toy):
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    pipe(**inputs)
    handle.offload_all()
    assert handle.on_device() == ("vae",)
    assert torch.equal(pipe(**inputs), expected)


# ------------------------------------------------------------- entry points
def test_using_context_for_direct_submodule_calls(toy):
    pipe, inputs, _ = toy
    ref = copy.deepcopy(pipe)
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    pipe(**inputs)  # leaves transformer_2 on the device
    ids = inputs["ids"]
    h_ref = ref.text_encoder.embed(ids)
    want = ref.text_encoder.layers[1](ref.text_encoder.layers[0](h_ref))
    with handle.using("text_encoder"):
        assert swapped_on_device(handle) == {"text_encoder"}
        h = pipe.text_encoder.embed.weight[ids]  # parameters read directly, no module call at all
        got = pipe.text_encoder.layers[1](pipe.text_encoder.layers[0](h))
        with pytest.raises(RuntimeError, match="using"):
            pipe.transformer(inputs["latents"], torch.zeros(2, 3, 32), torch.zeros(2, 32))
        assert swapped_on_device(handle) == {"text_encoder"}
    assert torch.equal(got, want)
    assert handle.units["text_encoder"].pins == 0
    with handle.resident("vae"):  # alias; never-swapped components: no-op
        pass
    with pytest.raises(ValueError, match="not known.*text_encoder"):
        with handle.using("nope"):
            pass


def test_entry_hooks_on_direct_children(toy):
    pipe, inputs, _ = toy
    ref = copy.deepcopy(pipe)
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    pipe(**inputs)
    assert "text_encoder" not in handle.on_device()
    # a method-style entry point calling a child, not forward
    got = pipe.text_encoder.embed(inputs["ids"])
    assert torch.equal(got, ref.text_encoder.embed(inputs["ids"]))
    assert swapped_on_device(handle) == {"text_encoder"}
    assert "weightstream.module[text_encoder].entry[embed]" in repr(handle)


def test_exception_inside_forward_keeps_state_consistent(toy):
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    with pytest.raises(RuntimeError):
        pipe.transformer(torch.zeros(2, 5, 7), torch.zeros(2, 3, 32), torch.zeros(2, 32))  # bad width
    assert handle.units["transformer"].active == 0
    assert torch.equal(pipe(**inputs), expected)


# ---------------------------------------------------------------- config
def test_enable_cpu_offload_compat(toy):
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, {"enable_cpu_offload": True, "progress": False}, device="cpu")
    assert handle.config.mode == "module" and set(handle.config.components) == {"dit", "text_encoder"}
    assert "vae" not in handle.units
    assert torch.equal(pipe(**inputs), expected)
    handle.disable()
    handle = offload_pipeline(pipe, OffloadConfig(enable_cpu_offload=True, progress=False), device="cpu")
    assert set(handle.units) == DITS | ENCODERS
    assert torch.equal(pipe(**inputs), expected)


def test_default_config_is_module_dit_text_encoder(toy):
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, device="cpu")
    assert handle.config.components == ("dit", "text_encoder")
    assert torch.equal(pipe(**inputs), expected)


def test_layer_mode_streams_dits_and_encoders(toy):
    from weightstream import LayerwiseOffloadHandle

    pipe, inputs, expected = toy
    originals = {n: getattr(pipe, n) for n in ("transformer", "transformer_2", "text_encoder", "text_encoder_2")}
    config = {"mode": "layer", "components": ["dit", "text_encoder"],
              "layer_options": {"dit": {"resident_layers": 1}}, "progress": False}
    handle = offload_pipeline(pipe, config, device="cpu")
    assert all(isinstance(handle.wrapped[n], LayerwiseOffloadHandle) for n in originals)
    assert all(getattr(pipe, n) is m for n, m in originals.items())  # the pipeline keeps its modules
    for _ in range(2):
        assert torch.equal(pipe(**inputs), expected)
    s = handle.stats()
    assert s["transformer"]["blocks_resident"] == 1 and s["text_encoder"]["blocks_resident"] == 0
    assert handle.disable() is pipe
    assert all(getattr(pipe, n) is m for n, m in originals.items())
    assert torch.equal(pipe(**inputs), expected)


def test_layer_mode_dit_only_leaves_encoders_resident(toy):
    from weightstream import LayerwiseOffloadHandle, OffloadedTransformer

    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, OffloadConfig.layerwise(progress=False), device="cpu")
    assert set(handle.wrapped) == {"transformer", "transformer_2"}
    assert isinstance(handle.wrapped["transformer"], LayerwiseOffloadHandle)
    assert not isinstance(pipe.transformer, OffloadedTransformer)  # the pipeline keeps its modules
    assert torch.equal(pipe(**inputs), expected)
    assert "transformer" in repr(handle)


def test_layer_mode_encoder_without_blocks_is_a_clear_error():
    from weightstream.offload.pipeline import _encoder_plan

    with pytest.raises(ValueError, match="no known block container"):
        _encoder_plan(torch.nn.Linear(2, 2))


def test_layer_options_rejected_in_module_mode(toy):
    pipe, _, _ = toy
    bad = {"mode": "module", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 1}}}
    with pytest.raises(ValueError, match="layer_options"):
        offload_pipeline(pipe, bad, device="cpu")
    assert pipe.transformer.proj_in.weight.numel() > 0  # untouched


def test_device_budget_checked(toy):
    pipe, _, _ = toy
    with pytest.raises(ValueError, match="device_memory_budget_gb"):
        offload_pipeline(pipe, cfg(device_memory_budget_gb=1e-6), device="cpu")
    assert pipe.transformer.proj_in.weight.numel() > 0


# ---------------------------------------------------------------- discovery errors
class _Base(SupportsComponentDiscovery):
    def __init__(self):
        torch.manual_seed(0)
        self.transformer = ToyDenoiser()
        self.text_encoder = ToyTextEncoder()
        self.holder = nn.Module()
        self.holder.inner = ToyTextEncoder()
        self.not_a_module = torch.zeros(3)
        self.optional = None


def _declared(**attrs):
    return type("P", (_Base,), attrs)()


def test_discovery_declared_dotted_paths_and_none_skipped():
    pipe = _declared(_dit_modules=["transformer"], _encoder_modules=["text_encoder", "holder.inner", "optional"])
    comps = discover_components(pipe)
    assert [(c.name, c.kind) for c in comps.items] == [
        ("transformer", "dit"), ("text_encoder", "text_encoder"), ("holder.inner", "text_encoder")]
    handle = offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device="cpu")
    assert set(handle.units) == {"transformer", "text_encoder", "holder.inner"}


@pytest.mark.parametrize("attrs, match", [
    (dict(_dit_modules=["transformer"], _encoder_modules=["nope.x"]), r"'nope\.x'.*P\._encoder_modules.*no attribute 'nope'"),
    (dict(_dit_modules=["transformer"], _encoder_modules=["holder.missing"]), r"'holder\.missing'.*P"),
    (dict(_dit_modules=["not_a_module"], _encoder_modules=[]), r"'not_a_module'.*P\._dit_modules.*Tensor, not a torch\.nn\.Module"),
    (dict(_dit_modules=["transformer"]), r"P\._encoder_modules is missing.*_dit_modules"),
    (dict(_encoder_modules=["text_encoder"]), r"P\._dit_modules is missing.*_encoder_modules"),
    (dict(_vae_modules=["transformer"]), r"P\._dit_modules is missing"),
    (dict(_dit_modules="transformer", _encoder_modules=[]), r"P\._dit_modules='transformer' is not allowed"),
    (dict(_dit_modules=["transformer"], _encoder_modules=["transformer"]), r"same module as 'transformer'"),
    (dict(_dit_modules=["transformer"], _encoder_modules=["transformer.proj_in"]), r"'transformer\.proj_in'.*lies inside.*'transformer'"),
    (dict(_dit_modules=[], _encoder_modules=["optional"]), r"no DiT or encoder component found on P"),
])
def test_discovery_errors(attrs, match):
    pipe = _declared(**attrs)
    with pytest.raises(ValueError, match=match):
        offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device="cpu")
    assert pipe.transformer.proj_in.weight.numel() > 0  # nothing touched


def test_discovery_conventions_skip_none_and_error_without_components():
    class Conv:
        def __init__(self):
            self.transformer = ToyDenoiser()
            self.transformer_2 = None
            self.text_encoder = ToyTextEncoder()
            self.tokenizer = object()

    comps = discover_components(Conv())
    assert comps.source == "diffusers conventions"
    assert comps.names() == ["transformer", "text_encoder"]

    class Empty:
        unet_like = ToyDenoiser()

    with pytest.raises(ValueError, match="no DiT or encoder component found on Empty.*SupportsComponentDiscovery"):
        offload_pipeline(Empty(), cfg(), device="cpu")


def test_shared_tensor_between_components_rejected():
    class Tied:
        def __init__(self):
            self.transformer = ToyDenoiser()
            self.text_encoder = ToyTextEncoder()
            self.text_encoder.norm.weight = self.transformer.blocks[0].norm.weight

    with pytest.raises(ValueError, match="shared with component 'transformer'"):
        offload_pipeline(Tied(), cfg(["dit", "text_encoder"]), device="cpu")


def test_offloading_twice_rejected(toy):
    pipe, _, _ = toy
    offload_pipeline(pipe, cfg(), device="cpu")
    with pytest.raises(AlreadyOffloadedError, match="already under module offload"):
        offload_pipeline(pipe, cfg(), device="cpu")


def test_missing_selected_kind_warns():
    class NoVae:
        def __init__(self):
            self.transformer = ToyDenoiser()
            self.text_encoder = ToyTextEncoder()

    with pytest.warns(UserWarning, match="selects 'vae'.*no vae component"):
        offload_pipeline(NoVae(), cfg(), device="cpu")


# ---------------------------------------------------------------- stats / repr
def test_stats_and_repr(toy):
    pipe, inputs, _ = toy
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    pipe(**inputs)
    s = handle.stats()
    comps = s["components"]
    assert set(comps) == DITS | ENCODERS | {"vae"}
    for name in DITS | ENCODERS:
        c = comps[name]
        assert c["bytes"] >= sum(t.numel() * t.element_size() for t in getattr(pipe, name).parameters())
        assert c["bytes"] % 512 == 0 and c["pinned"] is False and c["swapped"]
    assert comps["transformer_2"]["where"] == "device" and comps["transformer"]["where"] == "host"
    assert s["on_device"] == ["transformer_2", "vae"]
    assert s["transitions"] == 8 and s["device"] == "cpu"
    r = repr(handle)
    for name in ("weightstream.module[transformer]", "weightstream.module[transformer_2]",
                 "weightstream.module[text_encoder]", "weightstream.module[text_encoder_2]"):
        assert name in r
    assert "weightstream.module[vae]" not in r  # vae is never swapped: no hook
    assert "ModuleHook(weightstream.module[transformer_2], dit, on device, active)" in r
    hook = handle.hooks[0]
    hook.remove()
    assert "removed" in repr(hook)


def test_shared_tensor_with_unselected_component_rejected():
    class Tied:
        def __init__(self):
            self.transformer = ToyDenoiser()
            self.text_encoder = ToyTextEncoder()
            self.text_encoder.norm.weight = self.transformer.blocks[0].norm.weight

    with pytest.raises(ValueError, match="text_encoder.norm.weight is shared with component 'transformer'"):
        offload_pipeline(Tied(), cfg(["dit"]), device="cpu")


def test_parallel_packing_path_equal(monkeypatch, toy):
    import weightstream.offload.module.units as module_mod

    monkeypatch.setattr(module_mod, "PARALLEL_PACK_BYTES", 0)  # force the worker pool on small weights
    pipe, inputs, expected = toy
    offload_pipeline(pipe, cfg(), device="cpu")
    assert torch.equal(pipe(**inputs), expected)


def test_failed_packing_gives_weights_back(monkeypatch, toy):
    import weightstream.offload.module.units as module_mod

    pipe, inputs, expected = toy
    calls = {"n": 0}
    real_pin = module_mod.HostStore.pin

    def failing_pin(self, i):
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("simulated")
        return real_pin(self, i)

    monkeypatch.setattr(module_mod.HostStore, "pin", failing_pin)
    with pytest.raises(MemoryError):
        offload_pipeline(pipe, cfg(), device="cpu")
    for name in ("text_encoder", "transformer", "transformer_2", "vae"):
        for t in getattr(pipe, name).parameters():
            assert t.numel() > 0 and not t._backward_hooks
        assert not getattr(pipe, name)._forward_pre_hooks
    assert torch.equal(pipe(**inputs), expected)


def test_copies_split_at_registration_chunks(monkeypatch, toy):
    """Copies from the host image are split at REGISTER_CHUNK boundaries (CUDA
    rejects a copy spanning two registrations); with a tiny chunk every
    arrival and disable() goes through the split path."""
    from weightstream.offload.host import arena

    monkeypatch.setattr(arena, "REGISTER_CHUNK", 1000)  # not a multiple of 512 on purpose
    pipe, inputs, expected = toy
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    for _ in range(2):
        assert torch.equal(pipe(**inputs), expected)
    handle.disable()
    assert torch.equal(pipe(**inputs), expected)


def test_module_mode_over_a_component_streamed_in_layer_mode_is_refused_by_name():
    """offload_pipeline(mode='layer') then mode='module' on the same pipeline: AlreadyOffloadedError
    naming the component (it was a StreamedWriteError from packing the streamed placeholders)."""
    from weightstream.models import flux_inputs, tiny_flux

    class Pipe:
        pass

    pipe = Pipe()
    pipe.transformer = tiny_flux(dtype=torch.bfloat16)
    x = flux_inputs(pipe.transformer)
    with torch.no_grad():
        want = pipe.transformer(**x)[0]
    handle = offload_pipeline(pipe, {"mode": "layer", "components": ["dit"], "progress": False}, device="cpu")
    with pytest.raises(AlreadyOffloadedError, match="FluxTransformer2DModel is already streamed"):
        offload_pipeline(pipe, {"mode": "module", "components": ["dit"], "progress": False}, device="cpu")
    with torch.no_grad():
        assert torch.equal(pipe.transformer(**x)[0], want)
    handle.disable()
