"""Benchmark scenarios: diffusers DiTs sized like real models, random weights.

A scenario names a diffusers transformer class, its config, the input shapes
(batch 1, bf16), and the block containers that offloading streams. Each has a
tiny variant (`<name>-tiny`, or `tiny=True`) with the same structure and
inputs at toy sizes, so the whole pipeline runs on a CPU in seconds.

Building is fast at 12-14 B parameters: the model is constructed with every
parameter on the `meta` device (a parameter-registration hook replaces each
freshly created parameter by a meta tensor, so no constructor initialises
gigabytes on the CPU; buffers such as rotary tables stay real), then each
parameter is materialised with random values generated on the GPU in chunks
and copied to its destination: on the device directly, or to the host through
two page-locked staging buffers whose D2H copies overlap the multi-threaded
host copies (a plain pageable D2H per parameter ran at ~1 GB/s). Weights get N(0, 0.02), biases
zero and norm scales one, which keeps bf16 activations finite. `weight_fill="student-t"`
(the coded modes) draws the weights from Student's t (df=4, std 0.02,
`weightstream.fills`) instead: heavy tails, exponent statistics like trained weights.
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

DTYPE = torch.bfloat16
WEIGHT_FILLS = ("normal", "student-t")  # build_model(weight_fill=...): how weight matrices are drawn
CHUNK_ELEMS = 1 << 26  # 64 Mi elements (128 MB of bf16) per generated chunk


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str                      # "flux" | "wan"
    config: dict                     # diffusers constructor kwargs
    shape: dict                      # input sizes (see build_inputs)
    tiny_config: dict
    tiny_shape: dict
    block_containers: tuple[str, ...]
    description: str = ""
    approx_model_gb: float = 0.0     # full size, for sizing the host-memory touch before a run
    allowed_peers: tuple[str, ...] = field(default=())  # peers refused elsewhere (accelerate-cpu)


_FLUX_DEV = dict(  # FluxTransformer2DModel defaults are Flux.1-dev sized; dev has guidance embeds
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
    guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
_FLUX_TINY = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
    guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)
_WAN_14B = dict(  # Wan2.1-T2V-14B
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
_WAN_TINY = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
    out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32,
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s for s in (
        Scenario("flux-12b-1024", "flux", _FLUX_DEV,
                 dict(image_hw=(64, 64), text_tokens=512),
                 _FLUX_TINY, dict(image_hw=(8, 8), text_tokens=8),
                 ("transformer_blocks", "single_transformer_blocks"),
                 "Flux.1-dev sized (11.9 B), 1024x1024: 4096 image + 512 text tokens", 23.8),
        Scenario("flux-12b-512", "flux", _FLUX_DEV,
                 dict(image_hw=(32, 32), text_tokens=512),
                 _FLUX_TINY, dict(image_hw=(4, 4), text_tokens=8),
                 ("transformer_blocks", "single_transformer_blocks"),
                 "Flux.1-dev sized, 512x512: 1024 image + 512 text tokens (launch/stream bound)", 23.8,
                 allowed_peers=("accelerate-cpu",)),
        Scenario("wan-14b-480p", "wan", _WAN_14B,
                 dict(latent=(1, 16, 21, 60, 104), text_tokens=512),
                 _WAN_TINY, dict(latent=(1, 16, 2, 8, 8), text_tokens=8),
                 ("blocks",),
                 "Wan2.1-14B sized (14.3 B), 480x832, 81 frames: 32760 video + 512 text tokens", 28.6),
    )
}


def get_scenario(name: str) -> tuple[Scenario, bool]:
    """Scenario and whether its tiny variant was asked for (`<name>-tiny`)."""
    tiny = name.endswith("-tiny")
    base = name[: -len("-tiny")] if tiny else name
    if base not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)} (each also as <name>-tiny)")
    return SCENARIOS[base], tiny


def scenario_label(scenario: Scenario, tiny: bool) -> str:
    return scenario.name + ("-tiny" if tiny else "")


def model_class(family: str) -> type:
    if family == "flux":
        from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
        return FluxTransformer2DModel
    if family == "wan":
        from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
        return WanTransformer3DModel
    raise ValueError(f"unknown model family {family!r}; known: flux, wan")


# ------------------------------------------------------------------ building

def _construct_meta(cls: type, config: dict) -> nn.Module:
    """Construct with every parameter on `meta`; buffers stay real (CPU)."""
    def to_meta(module, name, param):
        if param is None or param.device.type == "meta":
            return None
        return nn.Parameter(param.to("meta"), requires_grad=False)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        return cls(**config)
    finally:
        handle.remove()


def _keeps_fp32(model: nn.Module, name: str) -> bool:
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    parts = name.split(".")
    return any(k in parts for k in keep)


def _fill_kind(owner: nn.Module, pname: str) -> str:
    if pname == "bias":
        return "zeros"
    if "norm" in type(owner).__name__.lower() and pname == "weight":
        return "ones"
    return "normal"


class _HostStager:
    """GPU-generated random chunks -> two page-locked staging buffers -> host
    tensors. The D2H copy of one chunk overlaps the (multi-threaded) host copy
    of the previous one. The staging memory is registered with
    cudaHostRegister and unregistered on close(), so nothing enters torch's
    pinned-memory cache (which would feed a later mode's own pinning)."""

    PAGE = 4096

    def __init__(self, gen_device: torch.device, chunk_elems: int = CHUNK_ELEMS):
        self.device, self.chunk_elems = gen_device, chunk_elems
        self.nbytes = chunk_elems * 4                       # room for an fp32 chunk
        self._raw, self.bufs, self._registered = [], [], []
        cudart = torch.cuda.cudart()
        for _ in range(2):
            raw = torch.empty(self.nbytes + self.PAGE, dtype=torch.uint8)
            off = (-raw.data_ptr()) % self.PAGE
            buf = raw[off: off + self.nbytes]
            buf.fill_(0)                                     # touch before registering
            err = cudart.cudaHostRegister(buf.data_ptr(), self.nbytes, 0)
            self._registered.append(int(err) == 0)
            self._raw.append(raw)
            self.bufs.append(buf)
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.pending: list = [None, None]
        self.slot = 0

    def _drain(self, slot: int) -> None:
        if self.pending[slot] is not None:
            dst, staged = self.pending[slot]
            self.events[slot].synchronize()
            dst.copy_(staged)
            self.pending[slot] = None

    def fill_normal(self, dst: torch.Tensor, std: float, gen: torch.Generator, weight_fill: str = "normal") -> None:
        flat = dst.view(-1)
        for start in range(0, flat.numel(), self.chunk_elems):
            n = min(self.chunk_elems, flat.numel() - start)
            slot = self.slot
            self._drain(slot)
            chunk = _chunk(n, dst.dtype, self.device, std, gen, weight_fill)
            staged = self.bufs[slot][: n * dst.element_size()].view(dst.dtype)
            staged.copy_(chunk, non_blocking=self._registered[slot])
            self.events[slot].record()
            self.pending[slot] = (flat[start:start + n], staged)
            self.slot = 1 - slot

    def close(self) -> None:
        for slot in (self.slot, 1 - self.slot):
            self._drain(slot)
        torch.cuda.synchronize(self.device)
        cudart = torch.cuda.cudart()
        for buf, reg in zip(self.bufs, self._registered):
            if reg:
                cudart.cudaHostUnregister(buf.data_ptr())
        self._raw, self.bufs = [], []


def _chunk(n: int, dtype, device, std: float, gen: torch.Generator, weight_fill: str) -> torch.Tensor:
    """``n`` weight values drawn on ``device`` (see WEIGHT_FILLS)."""
    if weight_fill == "student-t":
        from weightstream.fills import fill

        return fill("student-t", (n,), dtype=dtype, generator=gen, device=device, scale=std)
    return torch.empty(n, dtype=dtype, device=device).normal_(0.0, std, generator=gen)


def _fill(data: torch.Tensor, kind: str, std: float, gen: torch.Generator, stager: _HostStager | None,
          weight_fill: str = "normal") -> None:
    if kind == "zeros":
        data.zero_()
    elif kind == "ones":
        data.fill_(1)
    elif stager is not None:
        stager.fill_normal(data, std, gen, weight_fill)
    elif weight_fill != "normal":
        flat = data.view(-1)
        for start in range(0, flat.numel(), CHUNK_ELEMS):
            n = min(CHUNK_ELEMS, flat.numel() - start)
            flat[start:start + n].copy_(_chunk(n, data.dtype, data.device, std, gen, weight_fill))
    else:
        # same chunking as the stager: the generator hands out the same values
        # whether a model is built on the device or on the host
        flat = data.view(-1)
        for start in range(0, flat.numel(), CHUNK_ELEMS):
            flat[start:start + CHUNK_ELEMS].normal_(0.0, std, generator=gen)


def default_gen_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def build_model(scenario: Scenario, *, tiny: bool = False, device: str | torch.device = "cpu",
                gen_device: str | torch.device | None = None, std: float = 0.02, seed: int = 0,
                progress: Callable[[str], None] | None = None, weight_fill: str = "normal") -> nn.Module:
    """The scenario's transformer with random weights, in eval mode, bf16
    (modules the class keeps in fp32 stay fp32), every tensor on `device`;
    weight matrices drawn as `weight_fill` says (WEIGHT_FILLS)."""
    if weight_fill not in WEIGHT_FILLS:
        raise ValueError(f"weight_fill={weight_fill!r} is not allowed; choose from: {', '.join(WEIGHT_FILLS)}")
    device = torch.device(device)
    gen_device = torch.device(gen_device) if gen_device is not None else default_gen_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if gen_device.type == "cuda" and gen_device.index is None:
        gen_device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    cls = model_class(scenario.family)
    model = _construct_meta(cls, scenario.tiny_config if tiny else scenario.config)
    if device.type == "cuda":
        gen_device = device                                   # generate in place
    gen = torch.Generator(device=gen_device)
    gen.manual_seed(seed)
    stager = _HostStager(gen_device) if device.type == "cpu" and gen_device.type == "cuda" else None
    done = 0
    try:
        for mod_name, module in model.named_modules():
            for pname, param in list(module.named_parameters(recurse=False)):
                full = f"{mod_name}.{pname}" if mod_name else pname
                dtype = torch.float32 if _keeps_fp32(model, full) else DTYPE
                data = torch.empty(param.shape, dtype=dtype, device=device)
                _fill(data, _fill_kind(module, pname), std, gen, stager, weight_fill)
                setattr(module, pname, nn.Parameter(data, requires_grad=False))
                done += data.numel() * data.element_size()
            for bname, buf in list(module.named_buffers(recurse=False)):
                full = f"{mod_name}.{bname}" if mod_name else bname
                dtype = buf.dtype
                if buf.is_floating_point() and not _keeps_fp32(model, full):
                    dtype = DTYPE
                module._buffers[bname] = buf.to(device=device, dtype=dtype)
    finally:
        if stager is not None:
            stager.close()
    if gen_device.type == "cuda":
        torch.cuda.synchronize(gen_device)
        torch.cuda.empty_cache()
    if progress:
        progress(f"built {scenario_label(scenario, tiny)} ({done / 1e9:.2f} GB) on {device} "
                 f"in {time.perf_counter() - t0:.1f} s")
    return model.eval().requires_grad_(False)


def build_inputs(scenario: Scenario, device: str | torch.device, *, tiny: bool = False,
                 seed: int = 1) -> dict:
    """Keyword inputs for one denoising step (batch 1), as the diffusers
    pipelines pass them."""
    cfg = scenario.tiny_config if tiny else scenario.config
    shape = scenario.tiny_shape if tiny else scenario.shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size, dtype=DTYPE):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    if scenario.family == "flux":
        h, w = shape["image_hw"]
        n_txt = shape["text_tokens"]
        img_ids = torch.zeros(h, w, 3)
        img_ids[..., 1] = torch.arange(h)[:, None]
        img_ids[..., 2] = torch.arange(w)[None, :]
        inputs = dict(
            hidden_states=randn(1, h * w, cfg["in_channels"]),
            encoder_hidden_states=randn(1, n_txt, cfg["joint_attention_dim"]),
            pooled_projections=randn(1, cfg["pooled_projection_dim"]),
            timestep=torch.full((1,), 0.999, dtype=DTYPE, device=device),
            img_ids=img_ids.reshape(h * w, 3).to(device=device, dtype=DTYPE),
            txt_ids=torch.zeros(n_txt, 3, dtype=DTYPE, device=device),
            return_dict=False,
        )
        if cfg.get("guidance_embeds"):
            inputs["guidance"] = torch.full((1,), 3.5, dtype=torch.float32, device=device)
        return inputs
    if scenario.family == "wan":
        return dict(
            hidden_states=randn(*shape["latent"]),
            timestep=torch.full((1,), 999.0, dtype=torch.float32, device=device),
            encoder_hidden_states=randn(1, shape["text_tokens"], cfg["text_dim"]),
            return_dict=False,
        )
    raise ValueError(f"unknown model family {scenario.family!r}")


def first_output(out) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        return out[0]
    return getattr(out, "sample", out)


# ------------------------------------------------------------------ sizes

def tensor_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of a module (each storage once; a quantized tensor
    subclass by its inner tensors)."""
    from weightstream.offload.layout import all_tensors  # noqa: PLC0415

    seen, total = set(), 0
    for t in all_tensors(module):
        key = (t.device, t.data_ptr()) if t.device.type != "meta" else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def block_bytes(model: nn.Module, scenario: Scenario) -> int:
    """Bytes of the block containers: what a block-streaming peer moves per step."""
    return sum(tensor_bytes(getattr(model, c)) for c in scenario.block_containers)


# ------------------------------------------------------------------ checkpoints (mmap source)

CKPT_ROOT = Path(tempfile.gettempdir()) / "weightstream-perf-ckpt"
CKPT_INFO = "perf-checkpoint.json"


def checkpoint_dir(label: str, seed: int = 0) -> Path:
    return CKPT_ROOT / f"{label}-seed{seed}"


def build_meta_model(scenario: Scenario, *, tiny: bool = False) -> nn.Module:
    """The scenario's transformer with every parameter on `meta` (buffers real)."""
    return _construct_meta(model_class(scenario.family), scenario.tiny_config if tiny else scenario.config).eval()


def checkpoint_info(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / CKPT_INFO
    if not path.is_file():
        raise FileNotFoundError(f"no perf checkpoint at {ckpt_dir} (missing {CKPT_INFO}); "
                                "`python -m perf _ckpt --scenario <name>` writes one")
    return json.loads(path.read_text())


def _checkpoint_key(scenario: Scenario, tiny: bool, seed: int, shard_gb: float) -> dict:
    cfg = scenario.tiny_config if tiny else scenario.config
    return {"scenario": scenario_label(scenario, tiny), "seed": seed, "config": repr(sorted(cfg.items())),
            "shard_gb": shard_gb}


def existing_checkpoint(scenario: Scenario, ckpt_dir: str | Path, *, tiny: bool = False, seed: int = 0,
                        shard_gb: float = 5.0) -> dict | None:
    """The info of a checkpoint already written for these weights, else None."""
    try:
        info = checkpoint_info(ckpt_dir)
    except (FileNotFoundError, ValueError):
        return None
    want = _checkpoint_key(scenario, tiny, seed, shard_gb)
    return info if all(info.get(k) == v for k, v in want.items()) else None


def warm_page_cache(ckpt_dir: str | Path) -> int:
    """Read every shard once (bytes read)."""
    n = 0
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 26):
                n += len(chunk)
    return n


def fs_type(path: str | Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts; "unknown" elsewhere)."""
    best, kind = "", "unknown"
    try:
        p = str(Path(path).resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and p.startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _make_room(ckpt_dir: Path, need_bytes: float, progress) -> None:
    """Delete other perf checkpoints (folders beside this one holding a
    perf-checkpoint.json) while the disk lacks room for this one."""
    import shutil

    for other in sorted(ckpt_dir.parent.iterdir()):
        if shutil.disk_usage(ckpt_dir).free >= need_bytes:
            return
        if other != ckpt_dir and (other / CKPT_INFO).is_file():
            if progress:
                progress(f"checkpoint: deleting {other} to make room")
            shutil.rmtree(other)


def write_checkpoint(scenario: Scenario, ckpt_dir: str | Path, *, tiny: bool = False, seed: int = 0,
                     shard_gb: float = 5.0, progress: Callable[[str], None] | None = None) -> dict:
    """The scenario's random weights (same as build_model's) as a sharded
    diffusers-layout safetensors folder; reused when already written for the
    same scenario, config and seed. Returns the folder's info dict."""
    from safetensors.torch import save_file

    ckpt_dir = Path(ckpt_dir)
    want = _checkpoint_key(scenario, tiny, seed, shard_gb)
    info = existing_checkpoint(scenario, ckpt_dir, tiny=tiny, seed=seed, shard_gb=shard_gb)
    if info is not None:
        if progress:
            progress(f"checkpoint: reusing {ckpt_dir} ({info['model_bytes'] / 1e9:.2f} GB)")
        return info
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for old in list(ckpt_dir.glob("*.safetensors")) + list(ckpt_dir.glob("*.json")):
        old.unlink()
    _make_room(ckpt_dir, scenario.approx_model_gb * 1.1e9 if not tiny else 0, progress)
    model = build_model(scenario, tiny=tiny, device="cpu", seed=seed, progress=progress)
    sd = model.state_dict()
    limit, shards, cur, size = int(shard_gb * 1e9), [], [], 0
    for k, t in sd.items():
        if cur and size + t.nbytes > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += t.nbytes
    shards.append(cur)
    t0, weight_map, done = time.perf_counter(), {}, 0
    for i, keys in enumerate(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: sd[k] for k in keys}, str(ckpt_dir / name), metadata={"format": "pt"})
        for k in keys:
            weight_map[k] = name
            done += sd[k].nbytes
        if progress:
            progress(f"checkpoint: {done / 1e9:.2f} GB written ({done / 1e9 / (time.perf_counter() - t0):.2f} GB/s)")
    index = {"metadata": {"total_size": done}, "weight_map": weight_map}
    (ckpt_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    info = dict(want, model_bytes=tensor_bytes(model), block_bytes=block_bytes(model, scenario),
                checkpoint_bytes=done, files=len(shards))
    (ckpt_dir / CKPT_INFO).write_text(json.dumps(info, indent=1))
    return info
