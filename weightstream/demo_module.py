"""Module-offload demo and the toy pipeline the tests share.

``python -m weightstream demo --mode module`` calls :func:`run_module_demo`:
a small pipeline with random weights (two text encoders, two DiTs like Wan2.2
A14B, a VAE, a resident time embedding) runs resident and under module
offload; the demo prints whether the outputs match bit for bit, the times,
every residency transition, and device / host memory.
"""
from __future__ import annotations

import copy
import math
import sys
import time

import torch
from torch import nn

from weightstream.models import ToyBlock
from weightstream.offload.components import SupportsComponentDiscovery

__all__ = [
    "ToyTextEncoder", "ToyDenoiser", "ToyVAE", "ToyTimeEmbed", "ToyPipeline", "DeclaredToyPipeline",
    "toy_pipeline_inputs", "run_module_demo",
]


class ToyTextEncoder(nn.Module):
    """Embedding + residual MLP layers + norm; carries a buffer."""

    def __init__(self, vocab: int = 97, width: int = 32, layers: int = 2, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, dtype=dtype)
        self.layers = nn.ModuleList([ToyBlock(width, 2 * width, dtype) for _ in range(layers)])
        self.norm = nn.LayerNorm(width, dtype=dtype)
        self.register_buffer("position", torch.randn(64, width).to(dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.position[: ids.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class ToyDenoiser(nn.Module):
    """A small DiT: latents + pooled text + time embedding through residual blocks."""

    def __init__(self, channels: int = 8, width: int = 32, text_width: int = 32, blocks: int = 3,
                 hidden: int | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        hidden = hidden or 2 * width
        self.proj_in = nn.Linear(channels, width, dtype=dtype)
        self.text_proj = nn.Linear(text_width, width, dtype=dtype)
        self.blocks = nn.ModuleList([ToyBlock(width, hidden, dtype) for _ in range(blocks)])
        self.proj_out = nn.Linear(width, channels, dtype=dtype)

    def forward(self, latents: torch.Tensor, text: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        dtype = self.proj_in.weight.dtype
        h = self.proj_in(latents.to(dtype))
        h = h + self.text_proj(text.to(dtype)).mean(1, keepdim=True) + temb.to(dtype)[:, None]
        for block in self.blocks:
            h = block(h)
        return self.proj_out(h).to(latents.dtype)


class ToyVAE(nn.Module):
    """``decode`` is the entry point (not ``forward``); it calls two children."""

    def __init__(self, channels: int = 8, out: int = 3, width: int = 16):
        super().__init__()
        self.post_quant = nn.Linear(channels, channels)
        self.decoder = nn.Sequential(nn.Linear(channels, width), nn.GELU(), nn.Linear(width, out))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant(z))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.decode(z)


class ToyTimeEmbed(nn.Module):
    """Sinusoidal features -> Linear; small, meant to stay resident."""

    def __init__(self, width: int = 32, freqs: int = 8):
        super().__init__()
        self.freqs = freqs
        self.linear = nn.Linear(2 * freqs, width)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        k = torch.arange(self.freqs, device=t.device, dtype=torch.float32)
        ang = t.float()[:, None] * torch.exp(-math.log(1000.0) * k / self.freqs)[None]
        return self.linear(torch.cat([ang.sin(), ang.cos()], -1).to(self.linear.weight.dtype))


class ToyPipeline:
    """A diffusers-style pipeline object (not an nn.Module), found by conventions.

    Two text encoders (the second bf16), two DiTs (``transformer`` for the
    high-noise steps, ``transformer_2`` for the rest, as Wan2.2 A14B), a VAE
    decoded through ``vae.decode``, and a time embedding.
    """

    def __init__(self, *, width: int = 32, hidden: int | None = None, blocks: int = 3, enc_layers: int = 2,
                 channels: int = 8, seed: int = 0):
        torch.manual_seed(seed)
        self.text_encoder = ToyTextEncoder(width=width, layers=enc_layers)
        self.text_encoder_2 = ToyTextEncoder(width=width, layers=enc_layers, dtype=torch.bfloat16)
        self.transformer = ToyDenoiser(channels, width, width, blocks, hidden)
        self.transformer_2 = ToyDenoiser(channels, width, width, blocks, hidden)
        self.vae = ToyVAE(channels)
        self.time_embed = ToyTimeEmbed(width)
        self.tokenizer = None  # pipelines hold non-module attributes too

    @property
    def _execution_device(self) -> torch.device:
        return self.time_embed.linear.weight.device

    def to(self, device) -> "ToyPipeline":
        for m in (self.text_encoder, self.text_encoder_2, self.transformer, self.transformer_2, self.vae,
                  self.time_embed):
            m.to(device)
        return self

    def encode_prompt(self, ids: torch.Tensor) -> torch.Tensor:
        a = self.text_encoder(ids)
        b = self.text_encoder_2(ids).float()
        return torch.cat([a, b], dim=1)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, latents: torch.Tensor, num_steps: int = 4, boundary: float = 0.5):
        dev = self._execution_device
        ids, latents = ids.to(dev), latents.to(dev)
        text = self.encode_prompt(ids)
        for i in range(num_steps):
            t = torch.full((latents.shape[0],), 1000.0 * (1 - i / num_steps), device=dev)
            dit = self.transformer if i < num_steps * boundary else self.transformer_2
            latents = latents - 0.1 * dit(latents, text, self.time_embed(t))
        return self.vae.decode(latents)


class DeclaredToyPipeline(ToyPipeline, SupportsComponentDiscovery):
    """The same pipeline declaring its components (dotted paths, a resident
    module inside a DiT)."""

    _dit_modules = ["transformer", "transformer_2"]
    _encoder_modules = ["text_encoder", "text_encoder_2"]
    _vae_modules = ["vae"]
    _resident_modules = ["time_embed", "transformer.text_proj"]


def toy_pipeline_inputs(batch: int = 2, tokens: int = 6, latent_tokens: int = 5, channels: int = 8,
                        vocab: int = 97, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, vocab, (batch, tokens), generator=g),
        "latents": torch.randn(batch, latent_tokens, channels, generator=g),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def run_module_demo(device: str | None = None) -> int:
    """Run the toy pipeline resident and under module offload; 0 when outputs match bit for bit."""
    from weightstream.offload.config import OffloadConfig
    from weightstream.offload.pipeline import offload_pipeline
    from weightstream.offload.streamed import resolve_device

    dev = resolve_device(device)
    big = dev.type == "cuda"
    sizes = dict(width=1024, hidden=4096, blocks=8, enc_layers=4) if big else dict(width=64, blocks=3)
    print(f"weightstream module-offload demo on {dev} ({'large' if big else 'small'} toy pipeline)")
    pipe = DeclaredToyPipeline(**sizes)
    inputs = toy_pipeline_inputs()

    ref = copy.deepcopy(pipe).to(dev)
    ref(**inputs)  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    expected = ref(**inputs)
    _sync(dev)
    t_res = time.perf_counter() - t0
    expected = expected.cpu()
    del ref
    if big:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)

    handle = offload_pipeline(pipe, OffloadConfig.module(["dit", "text_encoder", "vae"], progress=False), device=dev)
    print(repr(handle))
    if big:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    out1 = pipe(**inputs)
    _sync(dev)
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out2 = pipe(**inputs)
    _sync(dev)
    t_second = time.perf_counter() - t0
    same = torch.equal(out1.cpu(), expected) and torch.equal(out2.cpu(), expected)

    print("\nresidency transitions (two calls):")
    for e in list(handle.events):
        if e.action == "enter":
            continue
        print(f"  #{e.seq:<3} {e.action:<6} {e.unit:<15} {_mb(e.nbytes):>10}  (by {e.cause}; "
              f"host {e.host_ms:.2f} ms) on device now: {', '.join(e.on_device)}")
    s = handle.stats()
    print("\ncomponents:")
    for name, c in s["components"].items():
        print(f"  {name:<22} {c['kind']:<12} {_mb(c['bytes']):>10}  pinned={c['pinned']!s:<5} "
              f"where={c['where']:<6} arrivals={c['arrivals']}")
    print(f"\noutputs match the resident pipeline bit for bit: {'YES' if same else 'NO'}")
    print(f"time: resident {t_res * 1e3:.1f} ms; module offload first call {t_first * 1e3:.1f} ms, "
          f"second {t_second * 1e3:.1f} ms")
    print(f"transitions: {s['transitions']}, H2D {s['h2d_bytes'] / 1e6:.1f} MB")
    print(f"host store: {s['host_bytes'] / 1e6:.1f} MB, pinned {s['pinned_bytes'] / 1e6:.1f} MB"
          + (f" ({s['pin_failure']})" if s["pin_failure"] else ""))
    if big:
        peak = torch.cuda.max_memory_allocated(dev) - base
        now = torch.cuda.memory_allocated(dev) - base
        total = sum(c["bytes"] for c in s["components"].values())
        print(f"device memory: weights of all components {_mb(total)}, peak while running {_mb(peak)} "
              f"(incl. activations), now {_mb(now)}; bound {_mb(s['peak_device_bytes'])}")
    handle.disable()
    out3 = pipe(**inputs)
    same_after = torch.equal(out3.cpu(), expected)
    print(f"after disable(): resident again, outputs match: {'YES' if same_after else 'NO'}")
    sys.stdout.flush()
    return 0 if same and same_after else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(run_module_demo(sys.argv[1] if len(sys.argv) > 1 else None))
