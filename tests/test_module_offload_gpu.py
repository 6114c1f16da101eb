"""Module offload on a CUDA device: real residency, pinned masters, equality, no sync.

Run on the device machine: ``python3 -m pytest -q -m gpu tests/test_module_offload_gpu.py``.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from weightstream.demo_module import (
    DeclaredToyPipeline,
    ToyDenoiser,
    ToyTextEncoder,
    ToyVAE,
    toy_pipeline_inputs,
)
from weightstream.offload.config import OffloadConfig
from weightstream.offload.pipeline import offload_pipeline

pytestmark = pytest.mark.gpu

DEV = "cuda"


def cfg(components=("dit", "text_encoder", "vae")):
    return OffloadConfig.module(list(components), progress=False)


def mib(n: int) -> float:
    return n / 2**20


class BigPipe:
    """Components large enough that their bytes dominate device memory readings."""

    def __init__(self):
        torch.manual_seed(0)
        self.text_encoder = ToyTextEncoder(width=1024, layers=2)  # ~34 MiB
        self.transformer = ToyDenoiser(channels=8, width=1024, text_width=1024, blocks=4, hidden=4096)  # ~128 MiB
        self.transformer_2 = ToyDenoiser(channels=8, width=1024, text_width=1024, blocks=3, hidden=4096)  # ~96 MiB
        self.vae = ToyVAE(8)


def _bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


def test_cuda_outputs_equal_resident_and_masters_pinned():
    pipe = DeclaredToyPipeline(width=256, hidden=1024, blocks=3)
    inputs = toy_pipeline_inputs()
    ref = copy.deepcopy(pipe).to(DEV)
    expected = ref(**inputs)
    del ref
    handle = offload_pipeline(pipe, cfg(), device=DEV)
    s = handle.stats()
    assert s["pin_failure"] is None
    assert all(c["pinned"] for c in s["components"].values() if c["kind"] != "resident")
    assert s["pinned_bytes"] >= sum(c["bytes"] for c in s["components"].values() if c["kind"] != "resident")
    for _ in range(3):
        assert torch.equal(pipe(**inputs), expected)
    for p in pipe.transformer_2.parameters():
        assert p.is_cuda and p.data_ptr() % 512 == 0
    handle.disable()
    assert torch.equal(pipe(**inputs), expected)
    assert all(p.is_cuda and p.numel() > 0 for p in pipe.transformer.parameters())


def test_device_memory_follows_residency():
    pipe = BigPipe()
    enc_b, dit_b, dit2_b = (_bytes(pipe.text_encoder), _bytes(pipe.transformer), _bytes(pipe.transformer_2))
    gc.collect()  # an earlier test's tensors freed during this one would skew every reading
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    handle = offload_pipeline(pipe, cfg(), device=DEV)
    vae_b = _bytes(pipe.vae)
    after_setup = torch.cuda.memory_allocated() - base
    assert after_setup < enc_b / 2  # only the (tiny) VAE and placeholders are on the device

    ids = torch.randint(0, 97, (1, 6), device=DEV)
    lat = torch.randn(1, 4, 8, device=DEV)
    temb = torch.zeros(1, 1024, device=DEV)
    with torch.no_grad():
        text = pipe.text_encoder(ids)
        torch.cuda.synchronize()
        m_enc = torch.cuda.memory_allocated() - base
        pipe.transformer(lat, text, temb)
        torch.cuda.synchronize()
        m_dit = torch.cuda.memory_allocated() - base
        pipe.transformer_2(lat, text, temb)
        torch.cuda.synchronize()
        m_dit2 = torch.cuda.memory_allocated() - base
    slack = 8 << 20  # activations, placeholders, the vae
    assert enc_b <= m_enc < enc_b + slack, (mib(m_enc), mib(enc_b))
    assert dit_b <= m_dit < dit_b + slack, (mib(m_dit), mib(dit_b))  # the encoder left: memory dropped by enc_b
    assert dit2_b <= m_dit2 < dit2_b + slack, (mib(m_dit2), mib(dit2_b))  # DiTs exclude each other
    assert m_dit2 < m_dit  # the bigger DiT left, the smaller arrived: allocated fell
    handle.offload_all()
    torch.cuda.synchronize()
    m_off = torch.cuda.memory_allocated() - base
    assert m_off < vae_b + slack, mib(m_off)  # only the vae (never swapped) and activations remain
    s = handle.stats()
    assert s["h2d_bytes"] == sum(e.nbytes for e in handle.events if e.action == "arrive")


def test_swaps_do_not_synchronize():
    pipe = BigPipe()
    handle = offload_pipeline(pipe, cfg(), device=DEV)
    ids = torch.randint(0, 97, (1, 6), device=DEV)
    lat = torch.randn(1, 4, 8, device=DEV)
    temb = torch.zeros(1, 1024, device=DEV)
    with torch.no_grad():  # warm the allocator (first cudaMalloc of each size)
        text = pipe.text_encoder(ids)
        pipe.transformer(lat, text, temb)
    torch.cuda.synchronize()
    n0 = handle.stats()["transitions"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            for _ in range(2):
                text = pipe.text_encoder(ids)
                out = pipe.transformer(lat, text, temb)
                out = pipe.transformer_2(lat, text, temb)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert handle.stats()["transitions"] - n0 == 12  # per round: 3 departures + 3 arrivals
    assert torch.isfinite(out).all()


def test_using_context_on_cuda():
    pipe = BigPipe()
    ref = copy.deepcopy(pipe)
    for m in (ref.text_encoder, ref.transformer):
        m.to(DEV)
    handle = offload_pipeline(pipe, cfg(), device=DEV)
    ids = torch.randint(0, 97, (2, 6), device=DEV)
    with torch.no_grad():
        pipe.transformer(torch.randn(2, 4, 8, device=DEV), torch.randn(2, 6, 1024, device=DEV),
                         torch.zeros(2, 1024, device=DEV))
        with handle.using("text_encoder"):
            h = pipe.text_encoder.embed.weight[ids]  # direct parameter use, no module call
            got = pipe.text_encoder.layers[0](h)
        want = ref.text_encoder.layers[0](ref.text_encoder.embed.weight[ids])
    assert torch.equal(got, want)


def test_transformers_t5_encoder_with_toy_dit():
    transformers = pytest.importorskip("transformers")
    tcfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                 decoder_start_token_id=0)

    class T5Pipe:
        def __init__(self):
            torch.manual_seed(0)
            self.text_encoder = transformers.T5EncoderModel(tcfg).eval()
            self.transformer = ToyDenoiser(channels=8, width=64, text_width=64, blocks=2)

        @torch.no_grad()
        def __call__(self, ids, lat):
            text = self.text_encoder(input_ids=ids).last_hidden_state
            return self.transformer(lat, text, torch.zeros(lat.shape[0], 64, device=lat.device))

    pipe = T5Pipe()
    ids = torch.randint(0, 128, (2, 7), device=DEV)
    lat = torch.randn(2, 4, 8, device=DEV)
    ref = copy.deepcopy(pipe)
    ref.text_encoder.to(DEV)
    ref.transformer.to(DEV)
    expected = ref(ids, lat)
    del ref
    handle = offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device=DEV)
    # T5 ties shared / encoder.embed_tokens: deduplicated, one tensor, one host master
    for _ in range(2):
        assert torch.equal(pipe(ids, lat), expected)
        assert handle.on_device() == ("transformer",)


def test_diffusers_flux_transformer_on_cuda():
    pytest.importorskip("diffusers")
    from weightstream.models import flux_inputs, tiny_flux

    class FluxPipe:
        def __init__(self):
            self.transformer = tiny_flux(dtype=torch.bfloat16)
            self.text_encoder = ToyTextEncoder(width=32)

    pipe = FluxPipe()
    kw = flux_inputs(pipe.transformer, device=DEV)
    ids = torch.randint(0, 97, (1, 8), device=DEV)
    ref = copy.deepcopy(pipe)
    ref.transformer.to(DEV)
    ref.text_encoder.to(DEV)
    with torch.no_grad():
        want = (ref.text_encoder(ids), ref.transformer(**kw)[0])
    handle = offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device=DEV)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(pipe.text_encoder(ids), want[0])
            assert torch.equal(pipe.transformer(**kw)[0], want[1])
    assert handle.stats()["components"]["transformer"]["pinned"]


def test_component_larger_than_a_registration_chunk():
    """A 1.2 GB component: its image is registered in several 1 GiB ranges, and
    tensors straddle range boundaries; arrival and disable() copy around them."""
    width = 8192

    class Wide(nn.Module):
        def __init__(self, n):
            super().__init__()
            with torch.device("meta"):
                self.layers = nn.ModuleList([nn.Linear(width, width, dtype=torch.bfloat16) for _ in range(n)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    class P:
        def __init__(self):
            self.transformer = Wide(9)  # 9 x 128 MiB: boundaries fall inside tensors
            self.text_encoder = Wide(1)

    pipe = P()
    gen = torch.Generator(device=DEV).manual_seed(0)
    for m in (pipe.transformer, pipe.text_encoder):
        for layer in m.layers:
            for name in ("weight", "bias"):
                meta = getattr(layer, name)
                dev = torch.empty(meta.shape, dtype=meta.dtype, device=DEV).normal_(0, 0.01, generator=gen)
                setattr(layer, name, nn.Parameter(dev.cpu(), requires_grad=False))
    x = torch.randn(4, width, device=DEV, dtype=torch.bfloat16)
    ref = copy.deepcopy(pipe.transformer).to(DEV)
    want = ref(x)
    del ref
    handle = offload_pipeline(pipe, cfg(["dit", "text_encoder"]), device=DEV)
    assert handle.stats()["components"]["transformer"]["bytes"] > 1 << 30
    assert handle.stats()["components"]["transformer"]["pinned"]
    with torch.no_grad():
        pipe.text_encoder(x)
        assert torch.equal(pipe.transformer(x), want)
    handle.disable()
    with torch.no_grad():
        assert torch.equal(pipe.transformer(x), want)
