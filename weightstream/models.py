"""Small real-architecture DiTs with random weights (no downloads), and their inputs.

Used by the tests, the demo and the CPU variants of the benchmarks.
"""
from __future__ import annotations

import torch
from torch import nn


def _cast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    if dtype == torch.float32:
        return model
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            t.data = t.data.to(dtype)
    return model


def tiny_flux(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """A diffusers FluxTransformer2DModel with 2 double + 3 single blocks (odd total)."""
    from diffusers import FluxTransformer2DModel

    cfg = dict(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    return _cast(FluxTransformer2DModel(**cfg), dtype).eval()


def flux_inputs(model: nn.Module, *, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8,
                device="cpu", dtype=None, seed: int = 1) -> dict:
    cfg = model.config
    dtype = dtype or next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5)
    if side * side != image_tokens:
        raise ValueError(f"image_tokens={image_tokens} must be a square number")
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(), indexing="ij"), -1)
    kw = dict(
        hidden_states=torch.randn(batch, image_tokens, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
        timestep=torch.full((batch,), 0.5),
        img_ids=img_ids.reshape(-1, 3).float(),
        txt_ids=torch.zeros(text_tokens, 3),
    )
    if cfg.guidance_embeds:
        kw["guidance"] = torch.full((batch,), 3.5)
    out = {}
    for k, v in kw.items():
        v = v.to(device)
        if k in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
            v = v.to(dtype)
        out[k] = v
    out["return_dict"] = False
    return out


def tiny_wan(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """A diffusers WanTransformer3DModel with 3 blocks."""
    from diffusers import WanTransformer3DModel

    cfg = dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3, rope_max_seq_len=32,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    return _cast(WanTransformer3DModel(**cfg), dtype).eval()


def wan_inputs(model: nn.Module, *, batch: int = 1, frames: int = 2, height: int = 8, width: int = 8,
               text_tokens: int = 8, device="cpu", dtype=None, seed: int = 1) -> dict:
    cfg = model.config
    dtype = dtype or next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, height, width, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(batch, text_tokens, cfg.text_dim, generator=g).to(device, dtype),
        timestep=torch.full((batch,), 500, dtype=torch.long).to(device),
        return_dict=False,
    )


class ToyBlock(nn.Module):
    """A residual MLP block; ``dtype`` may differ between blocks (computed in that dtype)."""

    def __init__(self, width: int, hidden: int, dtype: torch.dtype, *, with_buffer: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(width, dtype=dtype)
        self.up = nn.Linear(width, hidden, dtype=dtype)
        self.down = nn.Linear(hidden, width, dtype=dtype)
        if with_buffer:
            self.register_buffer("gate", torch.rand(width, dtype=dtype))
        else:
            self.gate = None

    def forward(self, x):
        h = x.to(self.up.weight.dtype)
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(h))))
        if self.gate is not None:
            h = h * self.gate
        return x + h.to(x.dtype)


class ToyDiT(nn.Module):
    """Heterogeneous toy DiT: two containers, odd block count, mixed widths and dtypes.

    ``double_blocks`` run at ``width``; ``single_blocks`` widen the hidden size
    and alternate float32 / bfloat16 weights; one block carries a buffer.
    """

    _layerwise_offload_blocks_attrs = ["double_blocks", "single_blocks"]

    def __init__(self, width: int = 32, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(8, width)
        self.double_blocks = nn.ModuleList([ToyBlock(width, 2 * width, torch.float32) for _ in range(2)])
        self.single_blocks = nn.ModuleList(
            [
                ToyBlock(width, (3 + i) * width, torch.bfloat16 if i % 2 else torch.float32, with_buffer=(i == 1))
                for i in range(5)
            ]
        )
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        h = self.embed(x)
        for b in self.double_blocks:
            h = b(h)
        for b in self.single_blocks:
            h = b(h)
        return self.head(h)


def toy_inputs(batch: int = 2, tokens: int = 5, device="cpu", seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(batch, tokens, 8, generator=g).to(device)}
