"""Benchmark modes: how one scenario's model is placed and run.

- `resident`: the whole model on the device (built there directly).
- `resident-graph`: the same, each step captured once as a CUDA graph and
  replayed (the yardstick for `graphs`: what graphs alone give a resident model).
- weightstream: `layerwise`, `layerwise-r<R>` (R resident blocks),
  `layerwise-mmap` (blocks streamed straight from a safetensors checkpoint of
  the same random weights, mapped read-only: `offload_from_safetensors`; the
  harness writes the checkpoint first, untimed), `graphs` (CUDA graphs on);
  `-graphs`, `-r<R>`, `-mmap` combine after `layerwise` (e.g. `layerwise-r4-graphs`).
  `layerwise-mmap-staging` forces the mmap source's two-buffer staging copy path
  (`copy_path="staging"`), `-t<N>` after it packs on N threads (`staging_threads`);
  `-s<N>` sets `num_slots=N` (N >= 2);
  mmap modes report `setup_s_per_gb` (set-up over the checkpoint's GB), their
  staging counters after the steps and `ratio_to_pinned` (against `layerwise`).
- coded: `layerwise-coded`, `graphs-coded` (`-coded` combines like the others):
  `weight_codec="exp-k"`, block images stored losslessly coded, H2D of the
  coded bytes, decode on a decode stream beside the copy stream. Their weights are Student-t filled
  (`weightstream.fills`, df=4, std 0.02: heavy tails like trained weights;
  the normal fill of the other modes codes a little better than real
  checkpoints do), so their outputs are not compared with the resident one.
  `streamed_bytes` stays the RAW bytes: ratio_to_floor is against the
  uncoded floor (raw streamed bytes / best H2D of the run), so a coded mode
  below 1.0 beats what any uncoded stream can do. `coded_bytes` and
  `bits_per_weight` come from the source's stats. `layerwise-coded2`,
  `graphs-coded2` (`-coded2` combines like `-coded`): the same with
  `weight_codec="exp-k2"` (the two-level code); `-codedp`: `weight_codec="exp-kp"`
  (escapes patched after the tile: the fastest decode). `-codedauto`: `weight_codec="auto"`
  (raw first; after the first step the planner codes the blocks it predicts
  faster coded: `coded_blocks` and `codec_plan` in the figures).
- the planned default (issue 38): `default` is `OffloadConfig.layerwise()` with no arguments (the
  residency and the coding planned from the first step within the free device memory less the
  headroom), `default-<N>gb` the same capped by `device_memory_budget_gb=N`. Student-t weights as
  the coded modes (compare with `resident-tfill`); the plan and its background coding settle in
  untimed steps first (`coding_step_ms_all`), the figures carry `plan` (stats()["plan"]),
  `ratio_to_uncoded_floor` (the step over every block's raw bytes at the run's H2D rate: the
  `layerwise` floor) and, with `layerwise` in the run, `setup_ratio_to_uncoded`. Every other
  weightstream mode passes `resident_layers=0` and `weight_codec="none"` unless it names them,
  so its meaning stays what it was before the default planned. `default-q<x>` (`default-qnf4`,
  `default-8gb-qfp8`): the planned default over the quantized model (perf/quantized.py; normal
  weights, compared with `resident-q<x>`).
- pinned budget at half the model (issue 15): `layerwise-pinned-half`
  (`pinned_memory_budget_gb` = half the streamed block images; the unpinned
  blocks stage through two pinned bounce buffers filled by a packer thread;
  `ratio_to_pinned` = its step / the `layerwise` step of the same run, so list
  `layerwise` too; the staged copy rate is `stats.staging_pack_gbps`) and
  `layerwise-pageable-half` (the same budget, unpinned blocks copied with a
  pageable `copy_`: the path before the bounce buffers, measured beside it).
- LoRA (issue 36): `-lora<R>` after `layerwise` / `graphs` (e.g. `layerwise-lora64`,
  `graphs-lora64`) adds a rank-R peft LoRA (`LoraConfig(r=R, lora_alpha=R)` on the
  linears diffusers' Flux LoRA trainers target, `LORA_TARGETS`, through the diffusers
  model's `add_adapter`; A and B drawn from a seeded generator, B not zero) before the
  model is wrapped, and runs it unfused; `-lora<R>fused` fuses it after wrapping
  (`fuse_lora`: the fused weights go into the host images). Their yardsticks are
  `resident-lora<R>` / `resident-lora<R>fused` (the same LoRA on the resident model):
  the floor of a LoRA mode is max(that step, streamed bytes / best H2D) and
  `ratio_to_resident_lora` its step over that step; `adapter_bytes` (device bytes of the
  adapter tensors) is in the figures. Adapters stay resident, so `streamed_bytes` is the
  base weights' either way.
- peers: `diffusers-block` (group offload, block level, 1 block per group,
  stream + record_stream), `diffusers-leaf` (leaf level, stream),
  `diffusers-model` (model-level offload as `enable_model_cpu_offload` does it,
  through accelerate's `cpu_offload_with_hook`; the model is put back on the
  host after every step outside the timed region, so each timed step starts
  with the whole model on the host), `accelerate-cpu` (`accelerate.cpu_offload`,
  sequential leaf offload from pageable memory; flux-12b-512 only).

`prepare()` turns a host (or device) model into a `Prepared` runner.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from perf.quantized import split_quant
from perf.results import validate_mode_name
from perf.scenarios import Scenario, block_bytes, tensor_bytes

PEER_MODES = ("diffusers-block", "diffusers-leaf", "diffusers-model", "accelerate-cpu")
# half-pinned modes -> PinnedSource(stage=...): True stages every unpinned block (also on a CPU
# --tiny run, which pins nothing), False copies them pageable
HALF_PINNED_MODES = {"layerwise-pinned-half": True, "layerwise-pageable-half": False}
_LAYERWISE_VARIANT = re.compile(
    r"^(r(\d+)|mmap|graphs|nextstep|ingraph|compile|auto|(\d+)gb|coded2?|codedp|codedauto|sidecar|encgpu|enccpu|encplace|staging|t([1-9]\d*)"
    r"|s([1-9]\d*))$")
CODED_VARIANTS = {"coded": "exp-k", "coded2": "exp-k2", "codedp": "exp-kp", "codedauto": "auto"}  # mode variant -> weight_codec
CODED_FILL = "student-t"  # weight fill of coded modes (perf.scenarios.WEIGHT_FILLS)
_DEFAULT_MODE = re.compile(r"^default(?:-(\d+)gb)?$")  # the planned default, optionally capped
_LORA_VARIANT = re.compile(r"^lora([1-9]\d*)(fused)?$")  # -lora<R>, -lora<R>fused
# the linears diffusers' Flux LoRA trainers target (examples/dreambooth/train_dreambooth_lora_flux.py):
# the attention projections of both streams and both feed-forwards (the single blocks' attention matches too)
LORA_TARGETS = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2")
LORA_SEED = 1234  # the adapter's values: the same on every mode of a run (bit-exact against resident-lora<R>)


@dataclass(frozen=True)
class ModeSpec:
    name: str
    kind: str                      # resident | weightstream | diffusers-group | diffusers-model | accelerate-cpu
    config_kw: dict = field(default_factory=dict)   # OffloadConfig.layerwise(**config_kw)
    peer_kw: dict = field(default_factory=dict)     # apply_group_offloading(**peer_kw)
    source: str = "memory"                          # weightstream: "memory" (host model) | "mmap" (checkpoint)
    compile: bool = False                           # diffusers' regional compile (compile_repeated_blocks)
    half_pinned: bool = False                       # pinned_memory_budget_gb = half the streamed block images
    stage: bool | None = None                       # PinnedSource(stage=...) of the half-pinned modes
    weight_fill: str = "normal"                     # perf.scenarios.build_model(weight_fill=...)
    coded_sidecar: str = "off"                      # offload_from_safetensors(coded_sidecar=...) of -mmap-coded
    encode_on: str | None = None                    # CodedSource(encode_on=...) of -coded modes (None: the product's
                                                    # default, the GPU on CUDA; -encgpu: "device", -enccpu: "cpu",
                                                    # -encplace: "in-place")
    copy_path: str = "auto"                         # offload_from_safetensors(copy_path=...) of -mmap (-staging)
    staging_threads: int | None = None              # offload_from_safetensors(staging_threads=...) (-t<N>)
    default: bool = False                           # the planned default: no resident_layers / weight_codec given
    quantize: str | None = None                     # perf.quantized variant (-qfp8, -qgguf8, -qint8, -qnf4)
    lora_rank: int = 0                              # -lora<R>: a rank-R LoRA added before wrapping (0: none)
    lora_fused: bool = False                        # -lora<R>fused: fused after wrapping (fuse_lora)

    @property
    def lora(self) -> str | None:
        """The LoRA variant (``lora64`` / ``lora64fused``), None without one: names its yardstick."""
        return f"lora{self.lora_rank}{'fused' if self.lora_fused else ''}" if self.lora_rank else None

    @property
    def builds_on_device(self) -> bool:  # quantized models are built and quantized on the host
        return self.kind in ("resident", "resident-graph") and self.quantize is None


def parse_mode(name: str, scenario: Scenario | None = None) -> ModeSpec:
    """Validate a mode name (and whether the scenario allows it)."""
    validate_mode_name(name)
    base, quant = split_quant(name)
    if quant is not None:  # perf/quantized.py: the same mode over the quantized model
        spec = parse_mode(base, scenario)
        if spec.source == "mmap" or spec.kind != "weightstream" and spec.kind not in ("resident", "diffusers-group"):
            raise ValueError(f"mode {name!r}: quantized variants run resident, weightstream from host memory "
                             "(not -mmap: a quantized model does not map) and diffusers group offload")
        # the scenario's normal weights, quantized (coded variants too: their yardstick is resident-q<x>)
        return dataclasses.replace(spec, name=name, quantize=quant, weight_fill="normal")
    if name == "resident":
        return ModeSpec(name, "resident")
    if name == "resident-compile":
        return ModeSpec(name, "resident", compile=True)
    if name == "resident-graph":
        return ModeSpec(name, "resident-graph")
    if name == "resident-tfill":  # the coded modes' weights (Student-t): their bit-exact yardstick
        return ModeSpec(name, "resident", weight_fill=CODED_FILL)
    m = _DEFAULT_MODE.match(name)
    if m:  # the planned default: OffloadConfig.layerwise() (with a device budget cap: default-<N>gb)
        kw = {} if m.group(1) is None else {"device_memory_budget_gb": float(m.group(1))}
        return ModeSpec(name, "weightstream", config_kw=kw, weight_fill=CODED_FILL, default=True)
    if name.startswith("resident-lora"):  # the LoRA modes' yardsticks: the same LoRA, resident
        m = _LORA_VARIANT.match(name[len("resident-"):])
        if not m:
            raise ValueError(f"mode {name!r}: a resident LoRA yardstick is resident-lora<R> or resident-lora<R>fused")
        return ModeSpec(name, "resident", lora_rank=int(m.group(1)), lora_fused=bool(m.group(2)))
    if name in HALF_PINNED_MODES:
        return ModeSpec(name, "weightstream", half_pinned=True, stage=HALF_PINNED_MODES[name])
    if name.startswith(("layerwise", "graphs")):
        head, *variants = name.split("-")
        kw: dict[str, Any] = {"cuda_graphs": "on"} if head == "graphs" else {}
        source = "memory"
        compiled = False
        weight_fill = "normal"
        sidecar = "off"
        encode_on = None
        copy_path, threads = "auto", None
        lora = None
        for v in variants:
            lm = _LORA_VARIANT.match(v)
            if lm:
                if lora is not None:
                    raise ValueError(f"mode {name!r}: one lora variant at most")
                lora = (int(lm.group(1)), bool(lm.group(2)))
                continue
            m = _LAYERWISE_VARIANT.match(v)
            if not m:
                raise ValueError(f"mode {name!r}: unknown variant {v!r}; allowed: r<N> (resident layers), auto "
                                 "(resident_layers='auto'), <N>gb (device_memory_budget_gb), mmap, "
                                 "graphs, nextstep / ingraph (graph_boundary_loads='next-step' / 'in-graph'), "
                                 "compile (regional compile of the repeated blocks), coded (weight_codec='exp-k'), "
                                 "coded2 (weight_codec='exp-k2'), codedp (weight_codec='exp-kp'), "
                                 "codedauto (weight_codec='auto'), "
                                 "sidecar (with mmap-coded: load the coded sidecar an earlier -mmap-coded mode wrote), "
                                 "encgpu / enccpu / encplace (with coded: encode the blocks on the GPU / the CPU / on the GPU where they lie; "
                                 "default: the GPU on CUDA), "
                                 "staging (with mmap: the two-buffer staging copy path), "
                                 "t<N> (with mmap-staging: N packing threads, N >= 1), "
                                 "s<N> (num_slots=N, N >= 2), "
                                 "lora<R> / lora<R>fused (a rank-R LoRA, unfused / fused)")
            if m.group(2) is not None:
                kw["resident_layers"] = int(m.group(2))
            elif v == "auto":
                kw["resident_layers"] = "auto"  # the planner picks the resident set after the first step
            elif m.group(3) is not None:
                kw["device_memory_budget_gb"] = float(m.group(3))
            elif v == "mmap":
                source = "mmap"
            elif v == "nextstep":
                kw["graph_boundary_loads"] = "next-step"
            elif v == "ingraph":
                kw["graph_boundary_loads"] = "in-graph"
            elif v == "compile":
                compiled = True
            elif v in CODED_VARIANTS:
                kw["weight_codec"] = CODED_VARIANTS[v]
                weight_fill = CODED_FILL
            elif v == "sidecar":
                sidecar = "read"
            elif v == "encgpu":
                encode_on = "device"
            elif v == "enccpu":
                encode_on = "cpu"
            elif v == "encplace":
                encode_on = "in-place"
            elif v == "staging":
                copy_path = "staging"
            elif m.group(4) is not None:
                threads = int(m.group(4))
            elif m.group(5) is not None:
                if int(m.group(5)) < 2:
                    raise ValueError(f"mode {name!r}: variant {v!r} is not allowed; s<N> (num_slots=N) needs N >= 2")
                kw["num_slots"] = int(m.group(5))
            else:
                kw["cuda_graphs"] = "on"
        if source == "mmap" and "weight_codec" in kw:
            # the checkpoint's weights (its own fill); -mmap-coded encodes and writes the sidecar,
            # -mmap-coded-sidecar must load it
            weight_fill = "normal"
            sidecar = "read" if sidecar == "read" else "write"
        elif sidecar != "off":
            raise ValueError(f"mode {name!r}: the sidecar variant needs -mmap-coded (a coded checkpoint source)")
        if encode_on is not None and ("weight_codec" not in kw or source != "memory"):
            raise ValueError(f"mode {name!r}: the encgpu / enccpu / encplace variants need -coded from host memory (not -mmap)")
        if copy_path != "auto" and source != "mmap":
            raise ValueError(f"mode {name!r}: the staging variant needs -mmap (the checkpoint source's copy path)")
        if threads is not None and copy_path != "staging":
            raise ValueError(f"mode {name!r}: the t<N> variant needs -mmap-staging (it sets the staging threads)")
        if lora is not None and source != "memory":
            raise ValueError(f"mode {name!r}: the lora variant needs the blocks in host memory (not -mmap: the "
                             "model is built on the meta device there, and peft adds the adapter to a built model)")
        rank, fused = lora or (0, False)
        return ModeSpec(name, "weightstream", config_kw=kw, source=source, compile=compiled,
                        weight_fill=weight_fill, coded_sidecar=sidecar, encode_on=encode_on,
                        copy_path=copy_path, staging_threads=threads, lora_rank=rank, lora_fused=fused)
    if name == "diffusers-block":
        return ModeSpec(name, "diffusers-group", peer_kw=dict(
            offload_type="block_level", num_blocks_per_group=1, use_stream=True, record_stream=True))
    if name == "diffusers-leaf":
        return ModeSpec(name, "diffusers-group", peer_kw=dict(offload_type="leaf_level", use_stream=True))
    if name == "diffusers-model":
        return ModeSpec(name, "diffusers-model")
    if name == "accelerate-cpu":
        if scenario is not None and name not in scenario.allowed_peers:
            raise ValueError(
                f"mode 'accelerate-cpu' is refused on scenario {scenario.name!r}: it streams every weight "
                "from pageable memory each step and would not finish inside the time budget; "
                "it is allowed on: flux-12b-512")
        return ModeSpec(name, "accelerate-cpu")
    raise ValueError(f"mode {name!r} is not implemented by the harness's worker; implemented: resident, resident-graph, "
                     "resident-tfill, resident-compile, layerwise[-r<N>|-mmap[-staging[-t<N>]]|-graphs|-compile|-coded|"
                     f"-coded2], graphs[-nextstep|-ingraph|-coded|-coded2], {', '.join(PEER_MODES)}; module modes run "
                     "with --scenario module-swap, dlo-* modes with --nproc (`python -m perf list`)")


@dataclass
class Prepared:
    module: Callable[..., Any]
    streamed_bytes: int | None = None
    after_step: Callable[[], None] | None = None     # untimed, after each step
    stats: dict = field(default_factory=dict)
    events: Callable[[], list] | None = None
    pinned_bytes: int | None = None
    notes: dict = field(default_factory=dict)
    refresh: Callable[[], None] | None = None        # after the timed steps: re-read stats (auto placement)


class GraphedResident:
    """A resident model whose step is captured once as a CUDA graph: the first
    call runs eager (warm-up), the second captures, later calls copy the inputs
    into the static ones and replay. Outputs are returned as fresh tensors."""

    def __init__(self, model: nn.Module):
        self.model, self.graph, self.calls = model, None, 0

    def __call__(self, **kwargs):
        from torch.utils import _pytree as pytree

        self.calls += 1
        if self.calls == 1:
            return self.model(**kwargs)
        if self.graph is None:
            self.static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.model(**self.static)
        else:
            for k, v in kwargs.items():
                if isinstance(v, torch.Tensor):
                    self.static[k].copy_(v)
        self.graph.replay()
        return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.out)


def _need_accelerate(what: str):
    try:
        import accelerate  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"{what} needs the accelerate package, which is not installed ({e})") from e
    return accelerate


def add_lora(model: nn.Module, rank: int, device: torch.device, *, seed: int = LORA_SEED) -> int:
    """A rank-``rank`` peft LoRA on ``model``'s LORA_TARGETS through diffusers' ``add_adapter``
    (``lora_alpha=rank``: scaling 1), its tensors on ``device``; A ~ N(0, 1/in_features) and
    B ~ N(0, 0.01^2) from a CPU generator seeded ``seed`` (the same values on every mode; peft
    starts B at zero, a no-op). Returns the adapter's bytes."""
    from peft import LoraConfig

    from weightstream.offload.adapters import adapter_tensors, tuner_layers

    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(LORA_TARGETS)), adapter_name="perf")
    g = torch.Generator().manual_seed(seed)
    total = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                std = p.shape[1] ** -0.5 if ".lora_A." in name else 0.01
                p.data = (torch.randn(p.shape, generator=g) * std).to(device=device, dtype=p.dtype)
        for layer in tuner_layers(model):
            for t in adapter_tensors(layer):
                t.data = t.data.to(device)  # where a LoRA loaded for this device lives (never streamed)
                total += t.numel() * t.element_size()
    return total


def prepare(spec: ModeSpec, model: nn.Module, scenario: Scenario, device: torch.device,
            *, record_events: bool = False) -> Prepared:
    adapter_bytes = add_lora(model, spec.lora_rank, device) if spec.lora_rank else None
    prepared = _prepare(spec, model, scenario, device, record_events=record_events)
    if spec.lora_rank:
        if spec.lora_fused:
            model.fuse_lora()  # after wrapping: peft's merge writes the fused weights into the host images
        prepared.notes["lora"] = {"rank": spec.lora_rank, "alpha": spec.lora_rank, "targets": list(LORA_TARGETS),
                                  "fused": spec.lora_fused, "adapter_bytes": adapter_bytes}
    if spec.compile:
        # diffusers' regional compile: each repeated block class compiled once (inductor)
        model.compile_repeated_blocks()  # the streamed model's hooks sit on this module too
        prepared.notes["compile"] = "compile_repeated_blocks() (inductor)"
    return prepared


def _prepare(spec: ModeSpec, model: nn.Module, scenario: Scenario, device: torch.device,
             *, record_events: bool = False) -> Prepared:
    if spec.kind == "resident":
        return Prepared(model.to(device), streamed_bytes=None)
    if spec.kind == "resident-graph":
        if device.type != "cuda":
            raise RuntimeError("mode 'resident-graph' needs a CUDA device")
        return Prepared(GraphedResident(model.to(device)), streamed_bytes=None)
    if spec.kind == "weightstream":
        return _prepare_weightstream(spec, model, device, record_events)
    blocks = block_bytes(model, scenario)
    if spec.kind == "diffusers-group":
        _need_accelerate("diffusers group offloading (diffusers.hooks calls accelerate's send_to_device)")
        from diffusers.hooks import apply_group_offloading
        kw = dict(spec.peer_kw)
        if device.type != "cuda":
            kw["use_stream"] = False       # streams exist only on CUDA
            kw.pop("record_stream", None)
        apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"), **kw)
        return Prepared(model, streamed_bytes=blocks, notes={"peer_kwargs": kw})
    if spec.kind == "diffusers-model":
        accelerate = _need_accelerate("diffusers model-level offload (enable_model_cpu_offload)")
        model, hook = accelerate.cpu_offload_with_hook(model, execution_device=device)
        return Prepared(model, streamed_bytes=blocks, after_step=hook.offload,
                        notes={"peer": "accelerate.cpu_offload_with_hook, hook.offload() after each step"})
    if spec.kind == "accelerate-cpu":
        accelerate = _need_accelerate("accelerate-cpu")
        model = accelerate.cpu_offload(model, execution_device=device)
        return Prepared(model, streamed_bytes=blocks, notes={"peer": "accelerate.cpu_offload"})
    raise ValueError(f"unknown mode kind {spec.kind!r}")


def weightstream_config(spec: ModeSpec, record_events: bool = False):
    """The OffloadConfig of a weightstream mode; a clear RuntimeError when the
    API rejects it (checked before the model is built: no time wasted)."""
    from weightstream import OffloadConfig

    kw = dict(spec.config_kw)
    if not spec.default:  # what each mode names, not the planned default (OffloadConfig.unset_keys)
        kw.setdefault("resident_layers", 0)
        kw.setdefault("weight_codec", "none")
    if record_events:
        kw["record_events"] = True
    try:
        cfg = OffloadConfig.layerwise(**kw)
    except (TypeError, ValueError) as e:
        raise RuntimeError(
            f"mode {spec.name!r}: the weightstream API rejected OffloadConfig.layerwise(**{kw!r}): {e}") from e
    return cfg


def prepare_mmap(spec: ModeSpec, model_on_meta: nn.Module, ckpt_dir, device: torch.device,
                 *, record_events: bool = False) -> Prepared:
    """A weightstream mode whose streamed blocks come from a mapped checkpoint."""
    try:
        from weightstream.offload.checkpoint_offload import offload_from_safetensors
    except ImportError as e:
        raise RuntimeError(f"mode {spec.name!r}: the weightstream mmap source is not available ({e})") from e
    cfg = weightstream_config(spec, record_events)
    extra = {"coded_sidecar": spec.coded_sidecar} if spec.coded_sidecar != "off" else {}
    m = offload_from_safetensors(model_on_meta, str(ckpt_dir), cfg, device=device, copy_path=spec.copy_path,
                                 staging_threads=spec.staging_threads, **extra)
    stats = m.stats()
    pinned = stats.get("pinned_bytes", stats.get("registered_bytes"))
    prepared = Prepared(m, streamed_bytes=int(stats["streamed_bytes_per_step"]), stats=stats,
                        events=m.events if record_events else None, pinned_bytes=pinned,
                        notes={"config": cfg.to_dict(), "checkpoint": str(ckpt_dir), "copy_path": spec.copy_path})

    def refresh() -> None:  # the staging packer's counters once the steps ran
        prepared.stats = m.stats()

    prepared.refresh = refresh
    return prepared


def staging_figures(stats: dict) -> dict:
    """A staged mmap mode's packer figures after the steps: its counters, and the packing rate
    (packs x the mean streamed block over the packing time); empty when nothing was staged."""
    if not stats.get("staging_packs"):
        return {}
    out = {"staging_after_steps": {k: stats[k] for k in ("staging_packs", "staging_pack_s", "staging_wait_s")
                                   if k in stats}}
    if stats.get("staging_pack_s"):
        mean_block = stats["streamed_bytes_per_step"] / max(stats.get("blocks_streamed", 1), 1)
        out["staging_pack_gbps"] = round(stats["staging_packs"] * mean_block / stats["staging_pack_s"] / 1e9, 2)
    return out


def half_pinned_budget_gb(model: nn.Module) -> float:
    """Half the host bytes of the model's streamed block images (page-aligned, as the host store lays them out)."""
    from weightstream.offload.discovery import discover_blocks
    from weightstream.offload.host.arena import PAGE
    from weightstream.offload.layout import align_up, block_tensors, build_layout

    total = sum(align_up(build_layout(b.index, b.name, block_tensors(b.module)).nbytes, PAGE)
                for b in discover_blocks(model, None))
    return total / 2 / 1e9


def _encode_on_device(spec: ModeSpec, model: nn.Module, device: torch.device, record_events: bool):
    """A -coded-encgpu / -enccpu mode's wrapper: the coded source codes its blocks there."""
    from weightstream import OffloadedTransformer
    from weightstream.offload.sources.pinned import coded_source
    from weightstream.offload.build import streamed_blocks

    cfg = weightstream_config(spec, record_events)
    st = streamed_blocks(model, cfg, device, None, source=lambda req: coded_source(req, encode_on=spec.encode_on))
    return OffloadedTransformer(model, cfg, device=device, streamed=st), cfg


def _half_pinned(spec: ModeSpec, model: nn.Module, device: torch.device, record_events: bool):
    """A half-pinned mode's wrapper: the budget, and the source staged (or not)."""
    import dataclasses

    from weightstream import OffloadedTransformer
    from weightstream.offload.sources.pinned import PinnedSource
    from weightstream.offload.build import streamed_blocks

    budget = half_pinned_budget_gb(model)
    spec = dataclasses.replace(spec, config_kw={**spec.config_kw, "pinned_memory_budget_gb": budget})
    cfg = weightstream_config(spec, record_events)
    st = streamed_blocks(model, cfg, device, None, source=lambda req: PinnedSource(req, stage=spec.stage))
    return OffloadedTransformer(model, cfg, device=device, streamed=st), cfg


def _prepare_weightstream(spec: ModeSpec, model: nn.Module, device: torch.device,
                          record_events: bool) -> Prepared:
    from weightstream import OffloadedTransformer

    if spec.half_pinned:
        m, cfg = _half_pinned(spec, model, device, record_events)
    elif spec.encode_on is not None:
        m, cfg = _encode_on_device(spec, model, device, record_events)
    else:
        cfg = weightstream_config(spec, record_events)
        m = OffloadedTransformer(model, cfg, device=device)
    stats = m.stats()
    pinned = stats.get("pinned_bytes")
    if pinned is None and stats.get("pinned"):
        pinned = stats.get("host_bytes")
    prepared = Prepared(m, streamed_bytes=_streamed_bytes(spec, stats), stats=stats,
                        events=m.events if record_events else None, pinned_bytes=pinned,
                        notes=_notes(spec, cfg))
    if spec.default:
        prepared.notes["planned_keys"] = planned_keys(cfg, device)

    def refresh() -> None:  # the placement (and so the streamed bytes) is known after the first step
        prepared.stats = m.stats()
        prepared.streamed_bytes = _streamed_bytes(spec, prepared.stats)

    prepared.refresh = refresh
    return prepared


def _streamed_bytes(spec: ModeSpec, stats: dict) -> int:
    """Bytes the floor counts: the raw (uncoded) streamed bytes for coded modes (every
    streamed block's raw image; under resident_layers='auto' also the promoted ones'),
    else what the placement streams."""
    if spec.default:  # the raw bytes of the blocks the placement streams, coded or not
        if "placement" in stats:
            return placed_streamed_bytes(stats)
        return int(stats.get("raw_bytes", stats["streamed_bytes_per_step"]))
    if spec.config_kw.get("weight_codec", "none") != "none":
        if "coded_bytes" not in stats or "raw_bytes" not in stats:
            raise RuntimeError(f"mode {spec.name!r}: the model's stats() carry no coded_bytes/raw_bytes; "
                               "weight_codec did not reach a coded source")
        return int(stats["raw_bytes"])
    return placed_streamed_bytes(stats)


def planned_keys(cfg, device: torch.device) -> list[str]:
    """The keys the planned default sets to "auto" for ``cfg`` on ``device`` (pinned transport)."""
    from weightstream.offload.sources.select import Topology, select

    return list(select(cfg, Topology(device_type=device.type)).planned)


def _notes(spec: ModeSpec, cfg) -> dict:
    notes = {"config": cfg.to_dict()}
    if spec.weight_fill != "normal":
        notes["weight_fill"] = f"{spec.weight_fill} (df=4, std 0.02): outputs differ from the resident mode's"
    return notes


def coded_figures(stats: dict) -> dict:
    """The per-mode figures a coded mode adds beside step_ms (empty for other modes)."""
    keys = ("coded_bytes", "coded_blocks", "codec_plan", "plan", "bits_per_weight", "encode_s", "coded_sidecar", "sidecar_loaded", "sidecar_load_s",
            "sidecar_write_s", "sidecar_bytes", "sidecar_s_per_gb")
    return {k: stats[k] for k in keys if stats.get(k) is not None}


def placed_streamed_bytes(stats: dict) -> int:
    """Bytes a step moves under the current placement: the streamed blocks' images."""
    placed = stats.get("placement")
    if placed is None:
        return int(stats["streamed_bytes_per_step"])
    resident = set(placed["resident_blocks"])
    return int(sum(b for i, b in enumerate(placed.get("link_bytes", [])) if i not in resident)) \
        or int(stats["streamed_bytes_per_step"])


def model_sizes(model: nn.Module, scenario: Scenario) -> tuple[int, int]:
    return tensor_bytes(model), block_bytes(model, scenario)
