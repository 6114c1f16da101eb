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


# --------------------------------------------------------------------------- more diffusers DiTs
# Tiny builders and inputs for the discovery tests (tests/test_discovery_diffusers.py):
# models whose blocks sit in several lists, at depth, or run in an order that
# differs from registration order.
def _tiny(cls_name: str, cfg: dict, seed: int, dtype: torch.dtype, overrides: dict) -> nn.Module:
    import diffusers

    cfg = {**cfg, **overrides}
    torch.manual_seed(seed)
    return _cast(getattr(diffusers, cls_name)(**cfg), dtype).eval()


def _randn(g: torch.Generator, *shape, device="cpu", dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device, dtype)


def tiny_sd3(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """SD3Transformer2DModel, 3 joint blocks."""
    cfg = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
               joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
               pos_embed_max_size=16)
    return _tiny("SD3Transformer2DModel", cfg, seed, dtype, overrides)


def sd3_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1) -> dict:
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    return dict(hidden_states=_randn(g, 1, cfg.in_channels, 8, 8, device=device, dtype=dtype),
                encoder_hidden_states=_randn(g, 1, 6, cfg.joint_attention_dim, device=device, dtype=dtype),
                pooled_projections=_randn(g, 1, cfg.pooled_projection_dim, device=device, dtype=dtype),
                timestep=torch.full((1,), 500.0, device=device), return_dict=False)


def tiny_auraflow(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """AuraFlowTransformer2DModel: 2 joint (``joint_transformer_blocks``) + 3 single blocks."""
    cfg = dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=3,
               attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
               out_channels=4, pos_embed_max_size=64)
    return _tiny("AuraFlowTransformer2DModel", cfg, seed, dtype, overrides)


def auraflow_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1) -> dict:
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    return dict(hidden_states=_randn(g, 1, cfg.in_channels, 8, 8, device=device, dtype=dtype),
                encoder_hidden_states=_randn(g, 1, 6, cfg.joint_attention_dim, device=device, dtype=dtype),
                timestep=torch.full((1,), 0.5, device=device), return_dict=False)


def tiny_latte(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """LatteTransformer3DModel: spatial and temporal blocks run interleaved (zip)."""
    cfg = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
               cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=16, video_length=2,
               norm_type="ada_norm_single", num_embeds_ada_norm=1000)
    return _tiny("LatteTransformer3DModel", cfg, seed, dtype, overrides)


def latte_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1) -> dict:
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    return dict(hidden_states=_randn(g, 1, cfg.in_channels, cfg.video_length, 8, 8, device=device, dtype=dtype),
                encoder_hidden_states=_randn(g, 1, 6, cfg.caption_channels, device=device, dtype=dtype),
                timestep=torch.full((1,), 500, dtype=torch.long, device=device), return_dict=False)


def tiny_lumina2(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """Lumina2Transformer2DModel: context and noise refiners (registered after each other) run before ``layers``."""
    cfg = dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=2,
               num_attention_heads=2, num_kv_heads=2, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32),
               cap_feat_dim=16)
    return _tiny("Lumina2Transformer2DModel", cfg, seed, dtype, overrides)


def lumina2_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1) -> dict:
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    return dict(hidden_states=_randn(g, 1, cfg.in_channels, 8, 8, device=device, dtype=dtype),
                encoder_hidden_states=_randn(g, 1, 6, cfg.cap_feat_dim, device=device, dtype=dtype),
                encoder_attention_mask=torch.ones(1, 6, dtype=torch.bool, device=device),
                timestep=torch.full((1,), 0.5, device=device), return_dict=False)


def tiny_z_image(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """ZImageTransformer2DModel: noise and context refiners, then ``layers``."""
    cfg = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=2,
               n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[64, 16, 16])
    return _tiny("ZImageTransformer2DModel", cfg, seed, dtype, overrides)


def z_image_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1) -> dict:
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    return dict(x=[_randn(g, cfg.in_channels, 1, 8, 8, device=device, dtype=dtype)],
                cap_feats=[_randn(g, 6, cfg.cap_feat_dim, device=device, dtype=dtype)],
                t=torch.full((1,), 0.5, device=device), return_dict=False)


def tiny_wan_vace(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """WanVACETransformer3DModel: all ``vace_blocks`` run before the main ``blocks``."""
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
               text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3, rope_max_seq_len=32, vace_layers=[0, 2],
               vace_in_channels=8)
    return _tiny("WanVACETransformer3DModel", cfg, seed, dtype, overrides)


def wan_vace_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1) -> dict:
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    kw = wan_inputs(model, device=device, dtype=dtype, seed=seed)
    dtype = dtype or next(model.parameters()).dtype
    kw["control_hidden_states"] = _randn(g, 1, cfg.vace_in_channels, 2, 8, 8, device=device, dtype=dtype)
    return kw


def tiny_hidream(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """HiDreamImageTransformer2DModel: blocks wrapped one level deep (``double_stream_blocks.N.block``)."""
    cfg = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=8,
               num_attention_heads=2, caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2,
               num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(16, 16), llama_layers=(0, 1, 0, 1, 0),
               force_inference_output=True)
    return _tiny("HiDreamImageTransformer2DModel", cfg, seed, dtype, overrides)


def hidream_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    return dict(hidden_states=_randn(g, 1, 4, 8, 8, device=device, dtype=dtype),
                encoder_hidden_states_t5=_randn(g, 1, 6, 8, device=device, dtype=dtype),
                encoder_hidden_states_llama3=_randn(g, 2, 1, 6, 4, device=device, dtype=dtype),
                pooled_embeds=_randn(g, 1, 8, device=device, dtype=dtype),
                timesteps=torch.full((1,), 500, dtype=torch.long, device=device), return_dict=False)


def tiny_kandinsky5(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """Kandinsky5Transformer3DModel: text then visual transformer blocks."""
    cfg = dict(in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2),
               model_dim=32, ff_dim=64, num_text_blocks=2, num_visual_blocks=3, axes_dims=(4, 6, 6))
    return _tiny("Kandinsky5Transformer3DModel", cfg, seed, dtype, overrides)


def kandinsky5_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1) -> dict:
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    frames, h, w = 2, 8, 8
    p = cfg.patch_size
    return dict(hidden_states=_randn(g, 1, frames, h, w, cfg.in_visual_dim, device=device, dtype=dtype),
                encoder_hidden_states=_randn(g, 6, cfg.in_text_dim, device=device, dtype=dtype),
                pooled_projections=_randn(g, 1, cfg.in_text_dim2, device=device, dtype=dtype),
                timestep=torch.full((1,), 500.0, device=device),
                visual_rope_pos=[torch.arange(frames // p[0], device=device), torch.arange(h // p[1], device=device),
                                 torch.arange(w // p[2], device=device)],
                text_rope_pos=torch.arange(6, device=device), return_dict=False)


def tiny_minimax_h3(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """MiniMaxH3Transformer3DModel: token refiner blocks (``token_refiner.refiner_blocks``) before the main blocks."""
    cfg = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=2,
               ffn_dim=32, in_channels=4, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=8, freq_dim=8,
               time_embed_hidden_dim=24, time_embed_dim=16, rope_freq_dim=2)
    return _tiny("MiniMaxH3Transformer3DModel", cfg, seed, dtype, overrides)


def minimax_h3_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1) -> dict:
    """A packed sequence: 4 text rows, 6 audio rows, 8 video rows."""
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    n_text, n_audio, n_video = 4, 6, 8
    total = n_text + n_audio + n_video
    text = torch.arange(n_text)
    audio = torch.arange(n_text, n_text + n_audio)
    video = torch.arange(n_text + n_audio, total)
    tags = torch.zeros(total, dtype=torch.long)
    tags[text], tags[audio] = 1, 2
    t_idx = torch.zeros(total, dtype=torch.long)
    t_idx[audio] = 1
    pos = torch.zeros(total, 3)
    pos[:, 0] = torch.arange(total, dtype=torch.float32)
    pos[video, 1] = torch.arange(n_video, dtype=torch.float32) % 4
    pos[video, 2] = torch.arange(n_video, dtype=torch.float32) % 2
    patch = cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    kw = dict(hidden_states=_randn(g, 1, n_video, patch, device=device, dtype=dtype),
              audio_hidden_states=_randn(g, 1, n_audio, cfg.audio_in_channels, device=device, dtype=dtype),
              encoder_hidden_states=_randn(g, 1, n_text, cfg.text_dim, device=device, dtype=dtype),
              timestep=torch.tensor([0.7, 0.3]), timestep_indices=t_idx, token_tags=tags, position_ids=pos,
              video_indices=video, audio_indices=audio, text_indices=text)
    out = {k: v.to(device) for k, v in kw.items()}
    out["return_dict"] = False
    return out


def tiny_flux3(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """Flux3Transformer2DModel: per-mode blocks (``txt_mode_blocks``, ``mode_blocks[mode]``), then single blocks."""
    cfg = dict(in_channels=8, cond_in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=16, timestep_channels=16, axes_dims_rope=(4, 4, 4, 4))
    return _tiny("Flux3Transformer2DModel", cfg, seed, dtype, overrides)


def flux3_inputs(model: nn.Module, *, device="cpu", dtype=None, seed: int = 1, image_cond: bool = False) -> dict:
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    dtype = dtype or next(model.parameters()).dtype
    side, text = 4, 6
    grid = torch.stack(torch.meshgrid(torch.zeros(1), torch.zeros(1), torch.arange(side).float(),
                                      torch.arange(side).float(), indexing="ij"), -1).reshape(-1, 4)
    kw = dict(hidden_states=_randn(g, 1, side * side, cfg.in_channels, device=device, dtype=dtype),
              encoder_hidden_states=_randn(g, 1, text, cfg.joint_attention_dim, device=device, dtype=dtype),
              timestep=torch.full((1,), 0.5, device=device), img_ids=grid.to(device),
              txt_ids=torch.zeros(text, 4, device=device), return_dict=False)
    if image_cond:
        kw["image_cond_hidden_states"] = _randn(g, 1, side * side, cfg.cond_in_channels, device=device, dtype=dtype)
        kw["image_cond_ids"] = (grid + torch.tensor([1.0, 0, 0, 0])).to(device)
    return kw
