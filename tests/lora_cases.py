"""Shared by tests/test_lora.py (CPU) and tests/test_lora_gpu.py: tiny Flux / Wan pipelines built
from configs (only the transformer: LoRA loading needs no text encoder or VAE), LoRA files in
diffusers' format written to a folder, and the sequence of LoRA calls a user makes, run on a
resident twin and on an offloaded model side by side."""
from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

ENTRIES = ("wrapper", "inplace", "layer", "module")
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "ff.net.2", "proj_out")


def quiet() -> None:
    """diffusers warns that the test pipelines have no text encoder to load a LoRA into."""
    from diffusers.utils import logging as dlog

    dlog.set_verbosity_error()
    logging.getLogger("diffusers").setLevel(logging.ERROR)


def pipeline(kind: str, transformer):
    """A FluxPipeline / WanPipeline around ``transformer`` alone."""
    if kind == "flux":
        from diffusers import FluxPipeline

        return FluxPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                            tokenizer_2=None, transformer=transformer)
    from diffusers import WanPipeline

    return WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None, scheduler=None)


# the CPU tests' models: smaller still than weightstream.models' tiny ones (1 double + 2 single Flux
# blocks, 2 Wan blocks, head dim 8): seconds per cell on two shared cores
SMALL = {"flux": dict(num_layers=1, num_single_layers=2, attention_head_dim=8, axes_dims_rope=(2, 2, 4),
                      joint_attention_dim=16, pooled_projection_dim=8, in_channels=8),
         "wan": dict(num_layers=2, attention_head_dim=12, ffn_dim=32, text_dim=16, freq_dim=16)}


def model_and_inputs(kind: str, device="cpu", dtype=torch.float32, small: bool = False):
    from weightstream.models import flux_inputs, tiny_flux, tiny_wan, wan_inputs

    over = SMALL[kind] if small else {}
    if kind == "flux":
        model = tiny_flux(dtype=dtype, **over)
        return model, flux_inputs(model, device=device, image_tokens=4 if small else 16, text_tokens=4 if small else 8)
    model = tiny_wan(dtype=dtype, **over)
    return model, wan_inputs(model, device=device, height=4 if small else 8, width=4 if small else 8,
                             text_tokens=4 if small else 8)


def lora_layers(model, rank: int, seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """A peft-format LoRA state dict (``<module>.lora_A.weight`` / ``lora_B``) for the Linear layers
    of ``model`` whose names end in one of TARGETS; random A and B (B not zero: the LoRA matters)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name.endswith(t) for t in TARGETS) and "lora_" not in name:
            out[f"{name}.lora_A.weight"] = (torch.randn(rank, m.in_features, generator=g) * 0.2).to(dtype)
            out[f"{name}.lora_B.weight"] = (torch.randn(m.out_features, rank, generator=g) * 0.2).to(dtype)
    return out


def write_lora(kind: str, folder: Path, model, rank: int, seed: int, dtype=torch.float32) -> Path:
    """``pytorch_lora_weights.safetensors`` in ``folder``, written by the pipeline class's own
    ``save_lora_weights`` (diffusers' format: keys prefixed ``transformer.``)."""
    cls = type(pipeline(kind, None))
    folder.mkdir(parents=True, exist_ok=True)
    cls.save_lora_weights(str(folder), transformer_lora_layers=lora_layers(model, rank, seed, dtype))
    return folder / "pytorch_lora_weights.safetensors"


def offload(entry: str, pipe, codec: str = "none", device="cpu", graphs: str = "off", parallel=None, **extra):
    """Offload ``pipe.transformer`` through ``entry``; returns the handle (or the wrapper).
    ``extra``: more OffloadConfig.layerwise keys (resident_layers, ...); ``parallel``: DLO."""
    from weightstream import OffloadConfig, OffloadedTransformer, apply_layerwise_offload, offload_pipeline

    keys = dict(progress=False, weight_codec=codec, cuda_graphs=graphs)
    if entry in ("wrapper", "inplace"):  # every block streamed, as before the planned default
        keys["resident_layers"] = 0
    elif entry == "layer":
        keys["layer_options"] = {"dit": {"resident_layers": 0}}
    keys.update(extra)
    if entry == "wrapper":
        pipe.transformer = OffloadedTransformer(pipe.transformer, OffloadConfig.layerwise(**keys), device=device,
                                                parallel=parallel)
        return pipe.transformer
    if entry == "inplace":
        return apply_layerwise_offload(pipe.transformer, OffloadConfig.layerwise(**keys), device=device)
    keys.pop("cuda_graphs") if entry == "module" else None
    return offload_pipeline(pipe, {"mode": entry, "components": ["dit"], **keys}, device=device)


def same_weights(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ (or are missing) between two state dicts."""
    return [k for k in a if k not in b or not torch.equal(a[k].cpu(), b[k].cpu())] + [k for k in b if k not in a]


class Twins:
    """A resident pipeline and an offloaded one, driven by the same calls."""

    def __init__(self, kind: str, entry: str, codec: str, folder: Path, *, before: bool, device="cpu",
                 dtype=torch.float32, graphs: str = "off", small: bool = False, parallel=None, **extra):
        quiet()
        model, self.inputs = model_and_inputs(kind, device, dtype, small)
        self.files = [write_lora(kind, folder / f"lora{i}", model, rank=4 + 4 * i, seed=i + 1, dtype=dtype)
                      for i in range(2)]
        self.ref = pipeline(kind, copy.deepcopy(model).to(device))
        self.pipe = pipeline(kind, model)
        self.entry, self.before, self.parallel = entry, before, parallel
        if before:
            self.both("load_lora_weights", str(self.files[0]), adapter_name="a")
        self.handle = offload(entry, self.pipe, codec, device, graphs, parallel, **extra)
        if not before:  # module mode: while the component is offloaded (its tensors keep their shapes)
            self.both("load_lora_weights", str(self.files[0]), adapter_name="a")

    def both(self, method: str, *args, **kwargs) -> None:
        getattr(self.ref, method)(*args, **kwargs)
        getattr(self.pipe, method)(*args, **kwargs)

    def outputs(self, steps: int = 1):
        with torch.no_grad():
            want = self.ref.transformer(**self.inputs)[0]
            got = [self.pipe.transformer(**self.inputs)[0] for _ in range(steps)]
        return want, got

    def check(self, what: str, steps: int = 1) -> None:
        want, got = self.outputs(steps)
        for o in got:
            assert torch.equal(o, want), (what, float((o.float() - want.float()).abs().max()))
        # DLO AllGather: a rank holds a share of each streamed tensor; gathering them is a collective
        got = self.handle.gather_state_dict() if self.parallel is not None else self.pipe.transformer.state_dict()
        bad = same_weights(self.ref.transformer.state_dict(), got)
        assert not bad, (what, bad[:5])


HOST_KEYS = ("host_bytes", "pinned_bytes", "slot_bytes", "streamed_bytes_per_step")


def host_figures(t: Twins) -> dict:
    """What adapters must not change: the host images' and slots' sizes (layer-mode entries)."""
    if t.entry == "module":
        return {k: t.handle.stats()[k] for k in ("host_bytes", "pinned_bytes")}
    s = (t.handle.wrapped["transformer"] if t.entry == "layer" else t.handle).stats()
    return {k: s[k] for k in HOST_KEYS if k in s}


def offload_all(t: Twins) -> None:
    """Module mode, a LoRA loaded after offloading (resident on the device): the component leaves
    the device, so a fuse writes its host master through the offloaded weights' .data."""
    if t.entry == "module" and not t.before:
        t.handle.offload_all()


def short_sequence(t: Twins, steps: int = 1) -> None:
    """The calls that write weights (coded cells: every fuse re-encodes): a second adapter with
    weights, fuse, unfuse, fuse one and unload."""
    t.check("loaded", steps)
    t.both("load_lora_weights", str(t.files[1]), adapter_name="b")
    t.both("set_adapters", ["a", "b"], adapter_weights=[0.5, 1.0])
    offload_all(t)
    t.both("fuse_lora", lora_scale=0.8)
    t.check("fuse_lora", steps)
    t.both("unfuse_lora")
    t.check("unfuse_lora", steps)
    t.both("fuse_lora", adapter_names=["a"])
    t.both("unload_lora_weights")
    t.check("fused then unloaded", steps)


def user_sequence(t: Twins, steps: int = 1) -> None:
    """The LoRA calls of a user's session, each checked against the resident twin; loading and
    switching adapters change no host image."""
    t.check("loaded", steps)
    host = host_figures(t)
    t.both("load_lora_weights", str(t.files[1]), adapter_name="b")
    t.check("second adapter", steps)
    t.both("set_adapters", ["a", "b"], adapter_weights=[0.7, 0.4])
    t.check("set_adapters with weights", steps)
    t.both("set_adapters", "b")
    t.check("set_adapters one", steps)
    t.both("disable_lora")
    t.check("disable_lora", steps)
    t.both("enable_lora")
    t.check("enable_lora", steps)
    assert host_figures(t) == host, (host_figures(t), host)
    t.both("set_adapters", ["a", "b"], adapter_weights=[0.5, 1.0])
    offload_all(t)
    t.both("fuse_lora", lora_scale=0.8)
    t.check("fuse_lora", steps)
    t.both("unfuse_lora")
    t.check("unfuse_lora", steps)
    t.both("fuse_lora", adapter_names=["a"])
    t.both("unload_lora_weights")  # the fused weights stay, the LoRA layers go
    t.check("fused then unloaded", steps)
