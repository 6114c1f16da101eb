"""Module offload with coded weights (weight_codec="exp-k" / "exp-k2") on the CPU, and one GPU test.

Each unit's image is kept losslessly coded (offload/host/images.py); an arrival decodes
it into the unit's buffer. Compared with the same pipeline without offload: outputs bit for
bit, state_dict() / disable() round trips, an in-place edit reaching the next forward,
special values, and a failed build that gives every weight back.

On a machine without CUDA, tests/conftest.py sets TRITON_INTERPRET=1, under which the
CPU arrival runs the Triton decode kernel interpreted; ``decoder`` parametrises it off to
cover the plain-torch reference decode too.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from weightstream.demo_module import ToyPipeline, ToyTextEncoder, ToyVAE, toy_pipeline_inputs
from weightstream.fills import fill
from weightstream.models import flux_inputs, tiny_flux
from weightstream.offload.config import OffloadConfig
from weightstream.offload.pipeline import offload_pipeline

ALL = ["dit", "text_encoder", "vae"]
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, -1e-40, 9.2e-41]


def cfg(components=ALL, codec="exp-k", **kw):
    return OffloadConfig.module(components, progress=False, weight_codec=codec, **kw)


def _versions(handle) -> set[int]:
    """Coded tensor format versions held (2: two-level tensors of "exp-k2")."""
    return {seg.header.version for t in handle.coded.tables for seg in t.segments}


@pytest.fixture(params=["torch"])
def decoder(request):
    """The CPU decode (decode_torch: sources decode with the Triton kernel on CUDA only; the
    kernel is tested against the reference in tests/kernels)."""
    return request.param


@pytest.fixture
def torch_decode(monkeypatch):
    """decode_torch on the CPU (the interpreted kernel is slow; ``decoder`` covers it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _trained_like(module: nn.Module, seed: int) -> nn.Module:
    """Student-t (df=4) weights scaled per tensor, as trained checkpoints look to the codec."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.copy_(fill("student-t", p.shape, dtype=p.dtype, generator=g))
    return module


class FluxLike:
    """A pipeline object: a bf16 diffusers Flux DiT, a bf16 encoder (wide enough for its
    weights to code below their raw bytes: tiny tensors carry a tile of overhead each) and
    an fp32 VAE."""

    def __init__(self):
        self.transformer = _trained_like(tiny_flux(dtype=torch.bfloat16), 1)
        self.text_encoder = _trained_like(ToyTextEncoder(width=256, dtype=torch.bfloat16), 2)
        self.vae = ToyVAE(8)

    def run(self, ids, kw):
        return self.text_encoder(ids), self.transformer(**kw)[0], self.vae.decode(kw["hidden_states"][..., :8].float())


def _flux_case(device="cpu"):
    pipe = FluxLike()
    kw = flux_inputs(pipe.transformer, device=device)
    ids = toy_pipeline_inputs()["ids"].to(device)
    ref = copy.deepcopy(pipe)
    if device != "cpu":
        for m in (ref.transformer, ref.text_encoder, ref.vae):
            m.to(device)
    with torch.no_grad():
        expected = ref.run(ids, kw)
    return pipe, ids, kw, ref, expected


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of ``t`` on the CPU (NaN payloads and -0 compare exactly)."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _states(*modules) -> list[dict[str, torch.Tensor]]:
    return [{k: _bits(v).clone() for k, v in m.state_dict().items()} for m in modules]


def _same_states(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        bad = [k for k in w if not torch.equal(g[k], w[k])]
        assert not bad, f"tensors differ from the originals: {bad}"


# -------------------------------------------------------------------- config
def test_config_allows_codec_in_module_mode():
    c = cfg()
    assert c.mode == "module" and c.weight_codec == "exp-k"
    assert OffloadConfig.from_json(c.to_json()) == c
    compat = OffloadConfig.from_dict({"enable_cpu_offload": True, "weight_codec": "exp-k"})
    assert compat.mode == "module" and compat.weight_codec == "exp-k"
    assert OffloadConfig.from_dict({"enable_cpu_offload": True, "weight_codec": "exp-k2"}).weight_codec == "exp-k2"
    with pytest.raises(ValueError, match=r"weight_codec='zstd' is not allowed; choose from: none, exp-k, exp-k2"):
        OffloadConfig.module(weight_codec="zstd")
    with pytest.raises(TypeError, match="weight_codec"):
        OffloadConfig.module(weight_codec=1)
    with pytest.raises(ValueError, match=r"cuda_graphs='on' is not allowed.*mode='layer'"):
        OffloadConfig.module(weight_codec="exp-k", cuda_graphs="on")  # still: graphs need layer mode


# ------------------------------------------------------------------ equality
@pytest.mark.parametrize("run_bytes", [None, 0, 8192])
def test_toy_pipeline_bit_exact_over_calls(decoder, run_bytes):
    pipe, inputs = ToyPipeline(), toy_pipeline_inputs()
    expected = copy.deepcopy(pipe)(**inputs)
    handle = offload_pipeline(pipe, cfg(), device="cpu")
    if run_bytes is not None:  # None: the default (one run per unit at these sizes)
        handle.coded_run_bytes = run_bytes
    with pytest.raises(TypeError, match="coded_run_bytes=1.5 is not allowed"):
        handle.coded_run_bytes = 1.5
    k = handle.units["transformer"].index
    runs = handle.coded.runs(k, handle.coded_run_bytes)
    assert (len(runs) > 3) == (run_bytes == 8192), [r[:2] for r in runs]
    assert runs[0][0] == 0 and runs[-1][1] == handle.coded.coded[k]
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))  # back to back, every tensor once
    assert sum(r[2].num_segments for r in runs) == handle.coded.tables[k].num_segments
    for _ in range(3):
        assert torch.equal(pipe(**inputs), expected)
    s = handle.stats()
    assert s["weight_codec"] == "exp-k"
    assert s["components"]["transformer"]["arrivals"] == 3
    assert s["components"]["vae"]["arrivals"] == 1 and s["components"]["vae"]["departures"] == 0
    handle.disable()
    assert torch.equal(pipe(**inputs), expected)


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2", "exp-kp"])
def test_flux_pipeline_bit_exact_and_host_saving(torch_decode, codec):
    pipe, ids, kw, _, expected = _flux_case()
    handle = offload_pipeline(pipe, cfg(codec=codec), device="cpu")
    assert (2 in _versions(handle)) == (codec == "exp-k2") and (3 in _versions(handle)) == (codec == "exp-kp")
    handle.coded_run_bytes = 1 << 16  # several runs per unit
    with torch.no_grad():
        for _ in range(2):
            got = pipe.run(ids, kw)
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert handle.on_device() == ("transformer", "vae")
    s = handle.stats()
    enc = s["components"]["text_encoder"]
    assert enc["raw_bytes"] == enc["bytes"]
    # student-t bf16 weights: well below the raw bytes; the fp32 VAE stays raw (k = 8, larger)
    assert enc["coded_bytes"] < 0.8 * enc["raw_bytes"], enc
    assert 10.0 < enc["bits_per_weight"] < (11.5 if codec == "exp-k2" else 12.5), enc
    assert enc["host_bytes"] >= enc["coded_bytes"]
    assert s["components"]["vae"]["bits_per_weight"] == 0.0
    assert s["coded_bytes"] == sum(c["coded_bytes"] for c in s["components"].values())
    assert s["raw_bytes"] == sum(c["raw_bytes"] for c in s["components"].values())
    assert s["host_bytes"] == sum(c["host_bytes"] for c in s["components"].values())
    assert s["host_bytes"] < s["raw_bytes"]
    # each arrival moved the coded bytes of its unit (its copy size), not the raw image
    arrivals = [e for e in handle.events if e.action == "arrive"]
    assert [e.unit for e in arrivals].count("text_encoder") == 2
    assert all(e.nbytes < 0.8 * handle.units[e.unit].nbytes for e in arrivals if e.unit == "text_encoder")
    assert f"coded {codec}," in repr(handle) and s["weight_codec"] == codec


# ------------------------------------------------------------ state / disable
@pytest.mark.parametrize("codec", ["exp-k", "exp-k2"])
def test_state_dict_and_disable_round_trip(torch_decode, codec):
    pipe, ids, kw, ref, expected = _flux_case()
    want = _states(ref.transformer, ref.text_encoder, ref.vae)
    handle = offload_pipeline(pipe, cfg(codec=codec), device="cpu")
    mods = (pipe.transformer, pipe.text_encoder, pipe.vae)
    _same_states(_states(*mods), want)  # before any forward (placeholders stand in)
    with torch.no_grad():
        pipe.run(ids, kw)
    _same_states(_states(*mods), want)  # between forwards, transformer on the device
    with handle.using("text_encoder"):
        _same_states(_states(*mods), want)
    arena = handle.coded.arena
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    assert handle.disable() is pipe and handle.coded is None
    for m in mods:
        assert not m._forward_pre_hooks and not m._state_dict_hooks
        for t in list(m.parameters()) + list(m.buffers()):
            assert t.numel() > 0 and not (lo <= t.data_ptr() < hi)
    _same_states(_states(*mods), want)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(pipe.run(ids, kw), expected))


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2"])
def test_inplace_edit_reaches_next_forward(torch_decode, codec):
    pipe, ids, kw, ref, _ = _flux_case()
    handle = offload_pipeline(pipe, cfg(codec=codec), device="cpu")
    handle.coded_run_bytes = 1 << 16  # runs are cut again from the re-encoded tables
    with torch.no_grad():
        pipe.run(ids, kw)  # transformer on the device, text_encoder on the host
        for model in (pipe, ref):  # the same edits on the offloaded and the plain pipeline
            sd = model.transformer.state_dict()
            sd["transformer_blocks.0.attn.to_q.weight"].mul_(-2.0)
            sd["proj_out.bias"][:3] = torch.tensor([1.5, float("nan"), -0.0], dtype=torch.bfloat16)
            model.text_encoder.state_dict()["layers.0.up.weight"].add_(0.25)
        del sd
        want = ref.run(ids, kw)
        got = pipe.run(ids, kw)  # text_encoder arrives, transformer leaves and arrives again
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want))
    assert handle.units["transformer"].arrivals == 2
    _same_states(_states(pipe.transformer, pipe.text_encoder), _states(ref.transformer, ref.text_encoder))
    handle.disable()
    _same_states(_states(pipe.transformer, pipe.text_encoder), _states(ref.transformer, ref.text_encoder))


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2"])
def test_special_values_survive(decoder, codec):
    pipe, ids, kw, ref, _ = _flux_case()
    specials = torch.tensor(SPECIALS, dtype=torch.bfloat16)
    nan_payload = torch.tensor([0x7FC3, -0x0041], dtype=torch.int16).view(torch.bfloat16)  # 0x7FC3, 0xFFBF
    with torch.no_grad():
        for model in (pipe, ref):
            for w in (model.transformer.transformer_blocks[0].attn.to_q.weight, model.text_encoder.layers[1].down.weight):
                w.view(-1)[: specials.numel()] = specials
                w.view(-1)[20:22] = nan_payload
            model.vae.post_quant.weight.view(-1)[:3] = torch.tensor([float("nan"), -0.0, 1e-45])  # fp32, raw
    want = _states(ref.transformer, ref.text_encoder, ref.vae)
    handle = offload_pipeline(pipe, cfg(codec=codec), device="cpu")
    assert (2 in _versions(handle)) == (codec == "exp-k2")
    _same_states(_states(pipe.transformer, pipe.text_encoder, pipe.vae), want)
    with handle.using("transformer"):  # the decoded device (here: CPU buffer) copy, tensor by tensor
        got = {k: _bits(v) for k, v in pipe.transformer.state_dict(keep_vars=True).items()}
        assert all(torch.equal(got[k], want[0][k]) for k in want[0])
    with handle.using("text_encoder"):
        got = {k: _bits(v) for k, v in pipe.text_encoder.state_dict(keep_vars=True).items()}
        assert all(torch.equal(got[k], want[1][k]) for k in want[1])
    handle.disable()
    _same_states(_states(pipe.transformer, pipe.text_encoder, pipe.vae), want)


# ------------------------------------------------------------------ failures
class _Unreadable(torch.Tensor):
    """A buffer whose bytes cannot be read (as a tensor over a failing storage): reading it
    as raw bytes, what any encoder or packer does, raises OSError."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.view and len(args) > 1 and isinstance(args[1], torch.dtype):
            raise OSError("simulated read failure of a weight's storage")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_failed_build_gives_weights_back(torch_decode):
    pipe, inputs = ToyPipeline(), toy_pipeline_inputs()
    expected = copy.deepcopy(pipe)(**inputs)
    pipe.text_encoder.register_buffer("broken", torch.arange(6, dtype=torch.bfloat16).as_subclass(_Unreadable))
    names = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "vae")
    want = {n: {k: _bits(v).clone() for k, v in getattr(pipe, n).state_dict().items() if k != "broken"} for n in names}
    # held: the original storages stay alive, so a tensor given back cannot land at their address
    held = {n: getattr(pipe, n).proj_in.weight.detach() for n in ("transformer", "transformer_2")}
    with pytest.raises(OSError, match="simulated read failure"):
        offload_pipeline(pipe, cfg(), device="cpu")
    for n, old in held.items():  # coded and dropped before the failure, so given back in new storage
        assert getattr(pipe, n).proj_in.weight.data_ptr() != old.data_ptr(), n
    for n in names:  # the units coded before the failure (both DiTs) were dropped: back, bit for bit
        m = getattr(pipe, n)
        assert not m._forward_pre_hooks and not getattr(m, "_weightstream_module_offload", None)
        got = {k: _bits(v) for k, v in m.state_dict().items() if k != "broken"}
        assert got.keys() == want[n].keys()
        assert all(torch.equal(got[k], want[n][k]) for k in want[n]), n
    assert torch.equal(pipe(**inputs), expected)
    del pipe.text_encoder.broken
    handle = offload_pipeline(pipe, cfg(), device="cpu")  # and it can be offloaded again
    assert torch.equal(pipe(**inputs), expected)
    handle.disable()


# ------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("pin,run_bytes,codec", [(True, None, "exp-k"), (True, 1 << 14, "exp-k"), (False, 0, "exp-k"),
                                                 (True, 1 << 14, "exp-k2"), (True, 1 << 14, "exp-kp")])
def test_gpu_bit_exact_with_triton_decode(pin, run_bytes, codec):
    pipe, ids, kw, ref, expected = _flux_case("cuda")
    want = _states(ref.transformer, ref.text_encoder, ref.vae)
    handle = offload_pipeline(pipe, cfg(pin_memory=pin, codec=codec), device="cuda")
    assert (2 in _versions(handle)) == (codec == "exp-k2") and (3 in _versions(handle)) == (codec == "exp-kp")
    if run_bytes is not None:  # 1 << 14: many runs, copies overlapping decodes on two streams
        handle.coded_run_bytes = run_bytes
    s = handle.stats()
    assert s["pinned_bytes"] == (s["host_bytes"] if pin else 0), s
    with torch.no_grad():
        for _ in range(3):
            got = pipe.run(ids, kw)
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, expected))
    assert handle.units["transformer"].arrivals == 3
    enc = handle.stats()["components"]["text_encoder"]
    assert enc["coded_bytes"] < 0.8 * enc["raw_bytes"] and enc["pinned"] is pin
    _same_states(_states(pipe.transformer, pipe.text_encoder, pipe.vae), want)
    with torch.no_grad():  # an edit reaches the next arrival on the device too
        for model in (pipe, ref):
            model.transformer.state_dict()["transformer_blocks.1.ff.net.0.proj.weight"].mul_(3.0)
        want_out = ref.run(ids, kw)
        got = pipe.run(ids, kw)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want_out))
    handle.disable()
    for m in (pipe.transformer, pipe.text_encoder, pipe.vae):
        assert all(t.device.type == "cuda" and t.numel() > 0 for t in m.parameters())
    _same_states(_states(pipe.transformer, pipe.text_encoder, pipe.vae),
                 _states(ref.transformer, ref.text_encoder, ref.vae))
