"""``python -m weightstream plan --model M --budget-gb X``: the planner's placement
for a model and a device budget, without a GPU.

Per-block bytes are the block images the executor would stream (real layouts;
the large models are built on the ``meta`` device, so nothing is allocated).
Per-block compute is either given (``--compute-ms``: measured figures, e.g. a
run's event log) or estimated from FLOPs counted by torch's ``FlopCounterMode``
over one forward of the model on meta tensors (linear layers and attention),
divided by an effective rate (``--tflops``). The estimate is a stated
assumption, printed as such; on a GPU, ``resident_layers="auto"`` measures.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

# Sized like the perf scenarios (perf/scenarios.py): Flux.1-dev and Wan2.1-T2V-14B, bf16.
FLUX_12B = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
    guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
# The effective bf16 rate of one H200 on these models: the FLOPs counted here
# over the measured eager resident step (README / DESIGN.md section 8):
# flux-12b-1024 74.4 TFLOP in 173 ms; flux-12b-512 21.5 TFLOP in 64.6 ms (launch
# bound); wan-14b-480p 1678 TFLOP in 3168 ms. Other models: DEFAULT_TFLOPS.
CALIBRATED_TFLOPS = {"flux-12b-1024": 430.0, "flux-12b-512": 330.0, "wan-14b-480p": 530.0}
DEFAULT_TFLOPS = 430.0
DEFAULT_H2D_GBPS = 55.0  # pinned H2D of one H200 (PCIe Gen5 x16), DESIGN.md section 8

MODELS = {
    "tiny-flux": "diffusers Flux, 2 double + 3 single blocks (weightstream.models.tiny_flux), 16 image tokens",
    "tiny-wan": "diffusers Wan, 3 blocks (weightstream.models.tiny_wan), 2x8x8 latent",
    "toy": "ToyDiT (weightstream.models)",
    "flux-12b-1024": "Flux.1-dev sized (11.9 B, bf16), 1024x1024: 4096 image + 512 text tokens",
    "flux-12b-512": "Flux.1-dev sized (11.9 B, bf16), 512x512: 1024 image + 512 text tokens",
    "wan-14b-480p": "Wan2.1-14B sized (14.3 B, bf16), 480x832, 81 frames: 32760 video + 512 text tokens",
}
ALIASES = {"flux": "tiny-flux", "wan": "tiny-wan", "flux-12b": "flux-12b-1024", "wan-14b": "wan-14b-480p"}


@dataclass(frozen=True)
class ModelFigures:
    """What the planner needs from a model: block names, image bytes, non-block bytes, FLOPs."""

    name: str
    class_name: str
    block_names: tuple[str, ...]
    block_bytes: tuple[int, ...]
    fixed_bytes: int
    block_flops: tuple[int, ...]


def is_factory(name: str) -> bool:
    """``--model package.module:attr``: the user's own model from a factory."""
    return ":" in name


def load_factory(name: str):
    """(model, keyword inputs or None) from ``module:attr``: ``attr`` is a callable taking no
    arguments that returns the model, or ``(model, inputs)`` with the keyword inputs of one forward
    (tensors, on ``meta`` for a model built there) so that the planner can count its FLOPs."""
    import importlib
    import os
    import sys

    from torch import nn

    from weightstream.checkout import root_last

    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {name!r} is not allowed; give a factory as package.module:attr")
    if os.getcwd() not in sys.path:  # the console script does not put the current folder on the path
        sys.path.insert(0, os.getcwd())
        root_last()  # unless it is the checkout (weightstream/checkout.py)
    try:
        factory = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model {name!r}: cannot load the factory ({e}); give package.module:attr "
                         "importable from the current folder") from None
    out = factory()
    model, inputs = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(model, nn.Module) or not (inputs is None or isinstance(inputs, dict)):
        raise ValueError(f"--model {name!r}: the factory returned {type(out).__name__}; return an nn.Module or "
                         "(nn.Module, dict of keyword inputs)")
    return model.eval().requires_grad_(False), inputs


def resolve_name(name: str) -> str:
    if is_factory(name):
        return name
    name = ALIASES.get(name, name)
    if name not in MODELS:
        known = ", ".join(list(MODELS) + [f"{a} (= {b})" for a, b in ALIASES.items()])
        raise ValueError(f"--model {name!r} is not allowed; choose from: {known}")
    return name


def build(name: str):
    """(model, keyword inputs): real tiny models on the CPU, large ones on ``meta``."""
    import torch

    from weightstream import models

    if is_factory(name):
        return load_factory(name)
    if name == "tiny-flux":
        m = models.tiny_flux()
        return m, models.flux_inputs(m)
    if name == "tiny-wan":
        m = models.tiny_wan()
        return m, models.wan_inputs(m)
    if name == "toy":
        return models.ToyDiT(), models.toy_inputs()
    if name.startswith("flux-12b"):
        from diffusers import FluxTransformer2DModel

        side = 64 if name.endswith("1024") else 32
        model = _meta_bf16(FluxTransformer2DModel, FLUX_12B)
        return model, _flux_meta_inputs(side, 512)
    from diffusers import WanTransformer3DModel

    model = _meta_bf16(WanTransformer3DModel, WAN_14B)
    meta = torch.device("meta")
    return model, dict(
        hidden_states=torch.empty(1, 16, 21, 60, 104, dtype=torch.bfloat16, device=meta),
        timestep=torch.empty(1, device=meta),
        encoder_hidden_states=torch.empty(1, 512, 4096, dtype=torch.bfloat16, device=meta),
        return_dict=False,
    )


def _meta_bf16(cls, config: dict):
    """The model on ``meta``, bf16 except the modules its class keeps in fp32 (as
    the perf scenarios build it)."""
    import torch

    with torch.device("meta"):
        model = cls(**config)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not keep.intersection(name.split(".")):
            t.data = t.data.to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def _flux_meta_inputs(side: int, text_tokens: int) -> dict:
    import torch

    meta, bf16 = torch.device("meta"), torch.bfloat16
    return dict(
        hidden_states=torch.empty(1, side * side, 64, dtype=bf16, device=meta),
        encoder_hidden_states=torch.empty(1, text_tokens, 4096, dtype=bf16, device=meta),
        pooled_projections=torch.empty(1, 768, dtype=bf16, device=meta),
        timestep=torch.empty(1, dtype=bf16, device=meta),
        img_ids=torch.empty(side * side, 3, device=meta),
        txt_ids=torch.empty(text_tokens, 3, device=meta),
        guidance=torch.empty(1, device=meta),
        return_dict=False,
    )


def figures(name: str, *, count_flops: bool = True) -> ModelFigures:
    """Block image bytes (the executor's layouts), non-block bytes and, unless
    ``count_flops=False``, per-block FLOPs of one forward."""
    import torch

    from weightstream.offload.discovery import discover_blocks
    from weightstream.offload.layout import block_tensors, build_layout

    model, inputs = build(name)
    blocks = discover_blocks(model)
    in_blocks = {id(t) for b in blocks for _, _, t in block_tensors(b.module)}
    seen, fixed = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in in_blocks and id(t) not in seen:
            seen.add(id(t))
            fixed += t.numel() * t.element_size()
    sizes = tuple(build_layout(b.index, b.name, block_tensors(b.module)).nbytes for b in blocks)
    flops = (0,) * len(blocks)
    if count_flops and inputs is None:
        raise ValueError(f"--model {name}: the factory returns no example inputs, so the FLOPs cannot be counted; "
                         "return (model, inputs) from it or pass --compute-ms")
    if count_flops:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(**inputs)
        counts = counter.get_flop_counts()
        root = type(model).__name__
        flops = tuple(int(sum(counts.get(f"{root}.{b.name}", {}).values())) for b in blocks)
    return ModelFigures(name, type(model).__name__, tuple(b.name for b in blocks), sizes, fixed, flops)


def parse_compute_ms(text: str, num_blocks: int) -> tuple[float, ...]:
    """``--compute-ms``: one number (every block) or one per block, comma-separated."""
    import math

    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--compute-ms {text!r} is not allowed; give numbers (ms), one or one per block "
                         f"({num_blocks}), comma-separated") from None
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"--compute-ms {text!r} is not allowed; every value must be a finite number >= 0")
    if len(values) == 1:
        return tuple(values) * num_blocks
    if len(values) != num_blocks:
        raise ValueError(f"--compute-ms has {len(values)} values, which is not allowed; give 1 or one per block "
                         f"({num_blocks})")
    return tuple(values)


def run(args) -> int:
    from weightstream.offload.plan.placement import PlanInputs, _ms, _size, evaluate, plan

    name = resolve_name(args.model)
    given = args.compute_ms is not None
    fig = figures(name, count_flops=not given)
    n = len(fig.block_bytes)
    if given:
        compute = parse_compute_ms(args.compute_ms, n)
        source = "given (--compute-ms)"
    else:
        tflops = args.tflops or CALIBRATED_TFLOPS.get(name, DEFAULT_TFLOPS)
        compute = tuple(f / (tflops * 1e12) * 1e3 for f in fig.block_flops)
        rate = "given" if args.tflops else ("one H200's, calibrated on this model" if name in CALIBRATED_TFLOPS
                                            else "an H200's, calibrated on flux-12b-1024")
        source = (f"ESTIMATED from FLOPs ({sum(fig.block_flops) / 1e12:.4g} TFLOP per step) at {tflops:g} "
                  f"TFLOP/s ({rate}); no GPU measured here: pass --compute-ms with measured figures")
    ratio = args.codec_ratio if args.codec_ratio is not None else 1.0
    if ratio > 1:
        raise ValueError(f"--codec-ratio {ratio:g} is not allowed; give the coded / raw bytes, a number in (0, 1]")
    link = tuple(max(1, math.ceil(b * ratio)) for b in fig.block_bytes)
    inputs = PlanInputs(link_bytes=link, device_bytes=fig.block_bytes, compute_ms=compute, decode_gbps=args.decode_gbps,
                        h2d_gbps=args.h2d_gbps, budget_bytes=int(args.budget_gb * 1e9),
                        fixed_device_bytes=fig.fixed_bytes, slot_counts=args.slots,
                        step_local=args.cuda_graphs)
    placement = plan(inputs)
    first_n = min((evaluate(inputs, range(k), s) for s in inputs.slot_counts for k in range(n)),
                  key=lambda p: (not p.fits, p.predicted_ms, p.device_bytes))
    if args.json:
        print(json.dumps(_as_json(fig, inputs, placement, first_n, source)))
        return 0
    print(f"{name}: {fig.class_name}, {n} blocks ({_size(sum(fig.block_bytes))} of block images), fixed "
          f"modules {_size(fig.fixed_bytes)}; budget {args.budget_gb:g} GB; H2D {args.h2d_gbps:g} GB/s")
    print(f"model: {MODELS.get(name, 'your factory ' + name)}")
    print(f"per-block compute: {source}")
    if args.codec_ratio is not None or args.decode_gbps is not None:
        decode = f"decoded at {args.decode_gbps:g} GB/s on the copy stream" if args.decode_gbps else "no decode time"
        print(f"codec: {ratio:g} of the raw bytes cross the link, {decode}")
    if args.cuda_graphs:
        print("schedule: CUDA graphs (with resident blocks every load stays inside its step)")
    print(f"plan: {placement.describe()}")
    print(f"resident blocks: {', '.join(fig.block_names[i] for i in placement.resident) or 'none'}")
    if first_n.fits:
        print(f"best first-N under the same budget: resident_layers={len(first_n.resident)}, "
              f"num_slots={first_n.num_slots}, predicted {_ms(first_n.predicted_ms)} ms "
              f"({first_n.predicted_ms / max(placement.predicted_ms, 1e-12):.3f}x the plan)")
    else:
        print("best first-N under the same budget: none fits (the plan keeps large blocks resident to shrink "
              "the slots)")
    return 0


def _as_json(fig: ModelFigures, inputs, placement, first_n, source: str) -> dict:
    return {
        "model": fig.name, "blocks": list(fig.block_names), "block_bytes": list(fig.block_bytes),
        "fixed_bytes": fig.fixed_bytes, "compute_ms": list(inputs.compute_ms), "compute_source": source,
        "link_bytes": list(inputs.link_bytes), "decode_gbps": inputs.decode_gbps,
        "h2d_gbps": inputs.h2d_gbps, "budget_bytes": inputs.budget_bytes, "cuda_graphs": inputs.step_local,
        "resident_blocks": list(placement.resident), "num_slots": placement.num_slots,
        "predicted_ms": placement.predicted_ms, "floor_ms": placement.floor_ms,
        "device_bytes": placement.device_bytes, "describe": placement.describe(),
        "first_n": {"resident_layers": len(first_n.resident), "num_slots": first_n.num_slots,
                    "predicted_ms": first_n.predicted_ms, "fits": first_n.fits},
    }
