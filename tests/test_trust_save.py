"""Nothing lost through state_dict / save_pretrained; module-mode interrupt recovery.

Every path that reads a module's ``state_dict()`` (diffusers ``save_pretrained``
through the wrapper or on the wrapped model, ``torch.save``, a parent module)
must see the real weights, also between forwards, for the in-memory and the
mmap source and for module-offloaded components. Checked by saving, loading
back with ``from_pretrained`` and comparing outputs with ``torch.equal``.
"""
from __future__ import annotations

import copy
import json
import threading

import pytest
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from weightstream import OffloadConfig, OffloadedTransformer, offload_pipeline
from layerwise_cases import stream_config
from weightstream.offload.module import SplitOffloadMixin
from weightstream.models import flux_inputs, tiny_flux, tiny_wan, wan_inputs
from weightstream.offload.host.checkpoint import meta_from_pretrained
from weightstream.offload.checkpoint_offload import offload_from_safetensors
from weightstream.offload.streamed import HostStateDictHook

DEV = "cpu"


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)


def tiny_sd3(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=8,
    )
    return model.to(dtype).eval()


def sd3_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 6, seed: int = 1) -> dict:
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g),
        encoder_hidden_states=torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
        timestep=torch.full((batch,), 500, dtype=torch.long),
        return_dict=False,
    )


MODELS = {"flux": (tiny_flux, flux_inputs), "wan": (tiny_wan, wan_inputs), "sd3": (tiny_sd3, sd3_inputs)}


def layer_cfg(**kw):
    """Every block streamed raw (on CUDA a config without resident_layers / weight_codec is the
    planned default, which may keep a tiny model resident: no host views to check)."""
    return stream_config(progress=False, **kw)


def module_cfg(components=("dit", "text_encoder")):
    return OffloadConfig.module(list(components), progress=False)


def _case(name):
    """(model to offload, resident reference, inputs, expected output)."""
    make, inputs = MODELS[name]
    model = make()
    ref = copy.deepcopy(model)
    x = inputs(model)
    with torch.no_grad():
        expected = first(ref(**x))
    return model, ref, x, expected


def _loadable(model_cls):
    """``model_cls`` for ``from_pretrained`` here: without accelerate, diffusers refuses classes
    with ``_keep_in_fp32_modules`` (Wan); these fp32 models need no fp32 exceptions anyway."""
    if getattr(model_cls, "_keep_in_fp32_modules", None) is None:
        return model_cls
    return type(model_cls.__name__, (model_cls,), {"_keep_in_fp32_modules": None})


def _aligned(model: nn.Module) -> nn.Module:
    """Private, allocator-aligned copies of tensors loaded from safetensors: the
    loaded ones sit at unaligned offsets of the file mapping, which changes
    CPU kernels' summation order (Wan differs by ~5e-7 without this)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()
    return model


def _reloaded_output(model_cls, folder, x):
    with torch.no_grad():
        return first(_aligned(_loadable(model_cls).from_pretrained(str(folder)).eval())(**x))


def _no_empty_tensors(sd):
    empty = [k for k, v in sd.items() if v.numel() == 0]
    assert not empty, f"state_dict holds empty placeholders: {empty[:5]}"


class TinyTextEncoder(ModelMixin, ConfigMixin):
    """A small diffusers-saveable text encoder (transformers is not installed here)."""

    @register_to_config
    def __init__(self, vocab: int = 64, dim: int = 32, num_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(num_layers)])

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return h


class Holder:
    """A pipeline-like object for module mode over one DiT (found by diffusers conventions)."""

    def __init__(self, transformer):
        torch.manual_seed(5)
        self.transformer = transformer
        self.text_encoder = TinyTextEncoder()


# ------------------------------------------------------------ single transformers


@pytest.mark.parametrize("name", ["flux", "wan", "sd3"])
def test_save_pretrained_through_wrapper_layer_mode(name, tmp_path):
    model, _, x, expected = _case(name)
    wrapped = OffloadedTransformer(model, layer_cfg(), device=DEV)
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), expected)  # between forwards from here on
    _no_empty_tensors(model.state_dict())
    wrapped.save_pretrained(str(tmp_path / "saved"))  # __getattr__ passes it to the wrapped model
    assert torch.equal(_reloaded_output(type(model), tmp_path / "saved", x), expected)
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), expected)  # saving changed nothing


@pytest.mark.parametrize("name", ["flux", "wan", "sd3"])
def test_save_pretrained_mmap_source(name, tmp_path):
    model, ref, x, expected = _case(name)
    ref.save_pretrained(str(tmp_path / "ckpt"), safe_serialization=True)
    wrapped = offload_from_safetensors(meta_from_pretrained(type(ref), tmp_path / "ckpt"), tmp_path / "ckpt",
                                       layer_cfg(), device=DEV)
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), expected)
    _no_empty_tensors(wrapped.module.state_dict())
    wrapped.save_pretrained(str(tmp_path / "saved"))
    assert torch.equal(_reloaded_output(type(ref), tmp_path / "saved", x), expected)


@pytest.mark.parametrize("name", ["flux", "wan", "sd3"])
def test_save_pretrained_module_mode_component_off_device(name, tmp_path):
    model, _, x, expected = _case(name)
    holder = Holder(model)
    ids = torch.arange(8).unsqueeze(0)
    handle = offload_pipeline(holder, module_cfg(), device=DEV)
    with torch.no_grad():
        assert torch.equal(first(holder.transformer(**x)), expected)
        holder.text_encoder(ids)  # the DiT leaves: its tensors are placeholders now
    assert "transformer" not in handle.on_device()
    _no_empty_tensors(holder.transformer.state_dict())
    holder.transformer.save_pretrained(str(tmp_path / "saved"))
    assert torch.equal(_reloaded_output(type(model), tmp_path / "saved", x), expected)
    with torch.no_grad():
        assert torch.equal(first(holder.transformer(**x)), expected)


def test_torch_save_and_parent_state_dict_between_forwards(tmp_path):
    model, ref, x, expected = _case("flux")
    wrapped = OffloadedTransformer(model, layer_cfg(), device=DEV)
    with torch.no_grad():
        wrapped(**x)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    fresh = tiny_flux(seed=123)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt"), strict=True)
    with torch.no_grad():
        assert torch.equal(first(fresh(**x)), expected)
    want = ref.state_dict()
    # a parent holding the plain DiT, and one holding the wrapper
    for parent, pre in ((nn.ModuleDict({"dit": model, "head": nn.Linear(2, 2)}), "dit."),
                        (nn.ModuleDict({"w": wrapped}), "w.")):
        got = {k[len(pre):]: v for k, v in parent.state_dict().items() if k.startswith(pre)}
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), k


def test_state_dict_values_are_host_views_and_keep_vars_keeps_objects():
    model, ref, x, _ = _case("wan")
    wrapped = OffloadedTransformer(model, layer_cfg(), device=DEV)
    views = wrapped._streamed.host_views
    live = dict(model.named_parameters())
    sd, kv = model.state_dict(), model.state_dict(keep_vars=True)
    streamed = [k for k in live if id(live[k]) in views]
    assert streamed and len(streamed) < len(live)
    for k in streamed:
        assert sd[k] is views[id(live[k])]  # zero-copy: the host store's own view
        assert kv[k] is live[k]  # keep_vars: the live parameter (placeholder between forwards)
    sd2 = wrapped.state_dict()
    assert all(sd2[k] is sd[k] for k in streamed)
    ref_sd = ref.state_dict()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_hook_named_repr_and_removed_by_disable():
    model, ref, x, expected = _case("flux")
    wrapped = OffloadedTransformer(model, layer_cfg(), device=DEV)
    hooks = [h for h in model._state_dict_hooks.values() if isinstance(h, HostStateDictHook)]
    assert hooks == [wrapped.state_dict_hook]
    assert "weightstream.state_dict[FluxTransformer2DModel]" in repr(hooks[0]) and "active" in repr(hooks[0])
    plain = wrapped.disable()
    assert not any(isinstance(h, HostStateDictHook) for h in plain._state_dict_hooks.values())
    assert "removed" in repr(hooks[0])
    ref_sd = ref.state_dict()
    for k, v in plain.state_dict().items():
        assert not isinstance(v, nn.Parameter) and torch.equal(v, ref_sd[k]), k


def test_update_weights_then_save(tmp_path):
    model, ref, x, _ = _case("flux")
    wrapped = OffloadedTransformer(model, layer_cfg(), device=DEV)
    g = torch.Generator().manual_seed(9)
    new = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in ref.state_dict().items()}
    wrapped.update_weights(new)
    ref.load_state_dict(new)
    with torch.no_grad():
        want = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), want)
    wrapped.save_pretrained(str(tmp_path / "saved"))
    assert torch.equal(_reloaded_output(type(model), tmp_path / "saved", x), want)


# ------------------------------------------------------------ whole pipelines


def _pipeline():
    from diffusers import AutoencoderKL, DiffusionPipeline

    class TinyPipe(DiffusionPipeline):
        def __init__(self, transformer, text_encoder, vae):
            super().__init__()
            self.register_modules(transformer=transformer, text_encoder=text_encoder, vae=vae)

        @torch.no_grad()
        def __call__(self, ids, flux_kw):
            text = self.text_encoder(ids)
            out = self.transformer(**dict(flux_kw, encoder_hidden_states=text))[0]
            b, n, c = out.shape
            side = int(n ** 0.5)
            return self.vae.decode(out.transpose(1, 2).reshape(b, c, side, side)).sample

    torch.manual_seed(3)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8,),
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                        norm_num_groups=8, layers_per_block=1, sample_size=8).eval()
    pipe = TinyPipe(tiny_flux(), TinyTextEncoder(), vae)
    kw = flux_inputs(pipe.transformer)
    kw.pop("encoder_hidden_states")
    ids = torch.arange(8).unsqueeze(0)
    return pipe, ids, kw


PIPE_CONFIGS = {
    "module": {"mode": "module", "components": ["dit", "text_encoder", "vae"], "progress": False},
    "layer": {"mode": "layer", "components": ["dit", "text_encoder"], "progress": False},
    "layer-resident": {"mode": "layer", "components": ["dit"], "progress": False,
                       "layer_options": {"dit": {"resident_layers": 1}}},
}


@pytest.mark.parametrize("mode", list(PIPE_CONFIGS))
def test_pipeline_save_pretrained_round_trip(mode, tmp_path):
    pipe, ids, kw = _pipeline()
    expected = copy.deepcopy(pipe)(ids, kw)
    originals = {n: getattr(pipe, n) for n in ("transformer", "text_encoder", "vae")}
    handle = offload_pipeline(pipe, PIPE_CONFIGS[mode], device=DEV)
    assert torch.equal(pipe(ids, kw), expected)
    if mode == "module":
        handle.offload_all()  # every swapped component off the device: placeholders only
    assert all(getattr(pipe, n) is m for n, m in originals.items())  # the pipeline keeps its modules
    pipe.save_pretrained(str(tmp_path / "saved"))
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    assert index["text_encoder"][1] == "TinyTextEncoder" and index["vae"] == ["diffusers", "AutoencoderKL"]
    loaded = type(pipe).from_pretrained(str(tmp_path / "saved"))
    for n in originals:
        _aligned(getattr(loaded, n))
    assert torch.equal(loaded(ids, kw), expected)
    assert torch.equal(pipe(ids, kw), expected)
    assert handle.disable() is pipe
    assert all(getattr(pipe, n) is m for n, m in originals.items())
    assert torch.equal(pipe(ids, kw), expected)


# ------------------------------------------------------------ module mode: interrupts


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupt_inside_dit_forward_recovers(exc):
    from weightstream.demo_module import ToyPipeline, toy_pipeline_inputs

    pipe = ToyPipeline()
    inputs = toy_pipeline_inputs()
    expected = copy.deepcopy(pipe)(**inputs)
    block = pipe.transformer.blocks[1]

    def boom(module, args, output):
        raise exc()

    handle = offload_pipeline(pipe, module_cfg(["dit", "text_encoder"]), device=DEV)
    h = block.register_forward_hook(boom)
    with pytest.raises(exc):
        pipe(**inputs)
    h.remove()
    ids = inputs["ids"]
    with torch.no_grad():
        pipe.text_encoder(ids)  # refused before: "its forward is running"
    assert "text_encoder" in handle.on_device() and "transformer" not in handle.on_device()
    assert torch.equal(pipe(**inputs), expected)
    assert handle.units["transformer"].active == 0
    plain = handle.disable()
    assert torch.equal(plain(**inputs), expected)


def test_nested_call_still_refused_while_dit_forward_runs():
    """Recovery must not weaken exclusion: an encoder called from inside the DiT's forward is refused."""
    from weightstream.demo_module import ToyPipeline, toy_pipeline_inputs

    pipe = ToyPipeline()
    inputs = toy_pipeline_inputs()
    ids = inputs["ids"]

    def nested(module, args, output):
        pipe.text_encoder(ids)

    handle = offload_pipeline(pipe, module_cfg(["dit", "text_encoder"]), device=DEV)
    h = pipe.transformer.blocks[0].register_forward_hook(nested)
    with pytest.raises(RuntimeError, match="its forward is running"):
        pipe(**inputs)
    h.remove()
    assert handle.units["transformer"].active == 0


def test_dit_forward_running_in_another_thread_is_not_evicted():
    from weightstream.demo_module import ToyPipeline, toy_pipeline_inputs

    pipe = ToyPipeline()
    inputs = toy_pipeline_inputs()
    entered, release = threading.Event(), threading.Event()

    def wait(module, args, output):
        entered.set()
        release.wait(30)

    handle = offload_pipeline(pipe, module_cfg(["dit", "text_encoder"]), device=DEV)
    with torch.no_grad():
        pipe.text_encoder(inputs["ids"])
    h = pipe.transformer.blocks[0].register_forward_hook(wait)
    errors = []
    t = threading.Thread(target=lambda: errors.append(_try(pipe, inputs)))
    t.start()
    try:
        assert entered.wait(30)
        with pytest.raises(RuntimeError, match="its forward is running"):
            pipe.text_encoder(inputs["ids"])
    finally:
        release.set()
        t.join(30)
        h.remove()
    assert errors == [None]
    assert handle.units["transformer"].active == 0


def _try(pipe, inputs):
    try:
        pipe(**inputs)
    except BaseException as e:  # reported to the test thread
        return e
    return None


# ------------------------------------------------------------ DLO (2 ranks over gloo)


def dlo_scenario(rank, world):
    """Inside each rank: state_dict of the wrapped module (and of a parent) under DLO."""
    from test_distributed import Checks

    from weightstream import ParallelConfig
    from weightstream.models import ToyDiT, toy_inputs

    def check(transfer):
        model, x = ToyDiT(), toy_inputs(seed=1 + rank)
        want = copy.deepcopy(model).state_dict()
        om = OffloadedTransformer(model, layer_cfg(weight_transfer=transfer), device=DEV,
                                  parallel=ParallelConfig(dp=world))
        with torch.no_grad():
            om(**x)
        rep = {}
        for what, fn in (("module", model.state_dict), ("parent", nn.ModuleDict({"m": model}).state_dict)):
            try:
                sd = fn()
                sd = {k[2:] if what == "parent" else k: v for k, v in sd.items()}
                rep[what] = all(torch.equal(sd[k], v) for k, v in want.items())
            except RuntimeError as e:
                rep[what] = str(e)
        plain = om.disable()  # a collective under AllGather
        rep["after_disable"] = all(torch.equal(plain.state_dict()[k], v) for k, v in want.items())
        return rep

    c = Checks()
    c.run("allgather", check, "allgather")
    c.run("rank-local", check, "rank-local")
    return c.report


@pytest.fixture(scope="module")
def dlo_two(tmp_path_factory):
    from test_distributed import run_ranks

    return run_ranks(2, tmp_path_factory.mktemp("save_dlo"), "test_trust_save:dlo_scenario")


def test_dlo_state_dict_of_wrapped_module(dlo_two):
    from test_distributed import get

    for rep in get(dlo_two, "rank-local"):
        assert rep == {"module": True, "parent": True, "after_disable": True}
    for rep in get(dlo_two, "allgather"):
        # no rank holds a streamed tensor whole: a clear error, never placeholders or a silent shard
        for what in ("module", "parent"):
            assert isinstance(rep[what], str) and "gather_state_dict" in rep[what], rep
        assert rep["after_disable"] is True


# ------------------------------------------------------------ module mode: split parts, hook lifecycle


class _Part(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.b(torch.relu(self.a(x))))


class _SplitDiT(SplitOffloadMixin, nn.Module):
    _offload_parts = {"reasoner": "inner.reasoner", "generator": "generator"}

    def __init__(self, width=16):
        super().__init__()
        self.shared = nn.Linear(width, width)  # outside every part: stays on the device
        self.inner = nn.Module()
        self.inner.reasoner = _Part(width)
        self.generator = _Part(width)

    def forward(self, x):
        h = self.shared(x)
        with self._offload_context("reasoner"):
            ctx = self.inner.reasoner(h)
        with self._offload_context("generator"):
            return self.generator(h + ctx)


class _SplitPipe:
    def __init__(self):
        torch.manual_seed(0)
        self.text_encoder = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.transformer = _SplitDiT()


def test_split_parts_state_dict_through_component_and_torch_save(tmp_path):
    pipe = _SplitPipe()
    x = torch.randn(2, 16)
    ref = copy.deepcopy(pipe)
    with torch.no_grad():
        expected = ref.transformer(ref.text_encoder(x))
    handle = offload_pipeline(pipe, module_cfg(), device=DEV)
    with torch.no_grad():
        assert torch.equal(pipe.transformer(pipe.text_encoder(x)), expected)
    handle.offload_all()
    assert handle.on_device() == ()
    # the component's state_dict reaches its parts' hooks (nested), and the encoder's own
    torch.save({"transformer": pipe.transformer.state_dict(), "text_encoder": pipe.text_encoder.state_dict()},
               tmp_path / "sd.pt")
    saved = torch.load(tmp_path / "sd.pt")
    fresh = _SplitPipe()
    with torch.no_grad():
        for p in list(fresh.transformer.parameters()) + list(fresh.text_encoder.parameters()):
            p.zero_()
    fresh.transformer.load_state_dict(saved["transformer"], strict=True)
    fresh.text_encoder.load_state_dict(saved["text_encoder"], strict=True)
    with torch.no_grad():
        assert torch.equal(fresh.transformer(fresh.text_encoder(x)), expected)


def test_module_mode_hooks_listed_and_removed_by_disable():
    pipe, ids, kw = _pipeline()
    handle = offload_pipeline(pipe, PIPE_CONFIGS["module"], device=DEV)
    modules = {n: getattr(pipe, n) for n in ("transformer", "text_encoder", "vae")}
    for n, m in modules.items():
        hooks = [h for h in m._state_dict_hooks.values() if isinstance(h, HostStateDictHook)]
        assert len(hooks) == 1 and f"weightstream.state_dict[{n}]" in repr(hooks[0]), n
        assert repr(hooks[0]) in repr(handle)
    handle.offload_all()
    host = dict(pipe.transformer.state_dict())
    handle.disable()
    for n, m in modules.items():
        assert not any(isinstance(h, HostStateDictHook) for h in m._state_dict_hooks.values()), n
    after = pipe.transformer.state_dict()
    assert all(torch.equal(after[k], v) and after[k].data_ptr() != v.data_ptr() for k, v in host.items())
