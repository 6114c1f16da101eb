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


def model_and_inputs(kind: str, device="cpu", dtype=torch.float32):
    from weightstream.models import flux_inputs, tiny_flux, tiny_wan, wan_inputs

    if kind == "flux":
        model = tiny_flux(dtype=dtype)
        return model, flux_inputs(model, device=device)
    model = tiny_wan(dtype=dtype)
    return model, wan_inputs(model, device=device)


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


def offload(entry: str, pipe, codec: str = "none", device="cpu", graphs: str = "off"):
    """Offload ``pipe.transformer`` through ``entry``; returns the handle (or the wrapper)."""
    from weightstream import OffloadConfig, OffloadedTransformer, apply_layerwise_offload, offload_pipeline

    keys = dict(progress=False, weight_codec=codec, cuda_graphs=graphs)
    if entry in ("wrapper", "inplace"):  # every block streamed, as before the planned default
        keys["resident_layers"] = 0
    elif entry == "layer":
        keys["layer_options"] = {"dit": {"resident_layers": 0}}
    if entry == "wrapper":
        pipe.transformer = OffloadedTransformer(pipe.transformer, OffloadConfig.layerwise(**keys), device=device)
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
                 dtype=torch.float32, graphs: str = "off"):
        quiet()
        model, self.inputs = model_and_inputs(kind, device, dtype)
        self.files = [write_lora(kind, folder / f"lora{i}", model, rank=4 + 4 * i, seed=i + 1, dtype=dtype)
                      for i in range(2)]
        self.ref = pipeline(kind, copy.deepcopy(model).to(device))
        self.pipe = pipeline(kind, model)
        self.entry, self.before = entry, before
        if before:
            self.both("load_lora_weights", str(self.files[0]), adapter_name="a")
        self.handle = offload(entry, self.pipe, codec, device, graphs)
        if entry == "module" and not before:
            # module mode: a swapped component holds empty tensors between its forwards; diffusers'
            # Flux loader reads the base weights' shapes, so load while the component is on the device
            with self.handle.using("transformer"):
                self.pipe.load_lora_weights(str(self.files[0]), adapter_name="a")
            self.ref.load_lora_weights(str(self.files[0]), adapter_name="a")
        elif not before:
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
        bad = same_weights(self.ref.transformer.state_dict(), self.pipe.transformer.state_dict())
        assert not bad, (what, bad[:5])


def user_sequence(t: Twins, steps: int = 1) -> None:
    """The LoRA calls of a user's session, each checked against the resident twin."""
    t.check("loaded", steps)
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
    t.both("set_adapters", ["a", "b"], adapter_weights=[0.5, 1.0])
    t.both("fuse_lora", lora_scale=0.8)
    t.check("fuse_lora", steps)
    t.both("unfuse_lora")
    t.check("unfuse_lora", steps)
    t.both("fuse_lora", adapter_names=["a"])
    t.both("unload_lora_weights")  # the fused weights stay, the LoRA layers go
    t.check("fused then unloaded", steps)
