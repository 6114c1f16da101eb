"""The module-swap scenario of `python -m perf run`: encoder -> DiT -> encoder transitions at real sizes.

    python -m perf run --scenario module-swap [--modes diffusers-model,module,module-coded,module-coded2,module-codedp]
        [--encoder-gb 9.5] [--dit-gb 23.8] [--width 4096] [--rounds 3] [--peer-rounds 2] [--fill student-t] [--run-mb 64]

Components are stacks of bf16 ``nn.Linear`` layers (with bias, so the tensor
count is close to the real models'): a T5-XXL-sized encoder (4.7 B params,
about 9.5 GB) and a Flux.1-dev-sized DiT (11.9 B params, about 23.8 GB).
Random weights are generated on the GPU in chunks and copied to host memory.
The forward is trivial (first and last layer on one token), so each timed
call is the arrival plus a negligible forward. Measured in the same process:

- pinned H2D bandwidth (1 GiB copies) -> the floor of an arrival, component
  bytes / H2D;
- ``module``: weightstream module offload (``offload_pipeline``): CUDA events
  around the hooked forward call per arrival; departures from the
  controller's event log (host time of the rebind; no copy back);
- ``module-coded`` / ``-coded2`` / ``-codedp``: the same with
  ``weight_codec="exp-k"`` / ``"exp-k2"`` / ``"exp-kp"``: an arrival copies the
  coded bytes and decodes them on the device in runs of ``--run-mb`` (copies
  overlap decodes; 0 = one copy, then one decode); ``ratio_to_floor`` is
  against the UNCODED floor, ``coded_floor_ms`` is coded bytes / H2D;
  ``setup_s`` includes the encode (``encode_s``);
- ``diffusers-model``: what ``DiffusionPipeline.enable_model_cpu_offload``
  installs (accelerate ``cpu_offload_with_hook`` chain, pageable host
  weights, ``.to()`` both ways), departures (``hook.offload()``) timed on
  the host around a synchronised call.

Weights: ``--fill student-t`` (the default when a coded mode runs) or
``normal``; every mode runs on the same weights, so outputs are compared
across modes. Targets: module arrivals within 1.1x of the floor, departures
< 1 ms; coded arrivals <= 0.75x the uncoded floor (issue 14). GPU only. Set-up
times of modes after the first are not fresh-process figures.
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
import types
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from perf.common import git_commit, measure_h2d_gbps

SCENARIO = "module-swap"
MODES = ("diffusers-model", "module", "module-coded", "module-coded2", "module-codedp")
CODECS = {"module": "none", "module-coded": "exp-k", "module-coded2": "exp-k2", "module-codedp": "exp-kp"}
FILLS = ("normal", "student-t")
WEIGHT_STD = 0.02
GB = 1e9
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class LinearStack(nn.Module):
    """``n`` bf16 Linear(width, width) layers; forward touches the first and the last."""

    def __init__(self, n: int, width: int):
        super().__init__()
        with torch.device("meta"):
            self.layers = nn.ModuleList([nn.Linear(width, width, dtype=torch.bfloat16) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[-1](self.layers[0](x))


def build_stack(target_gb: float, width: int, device: torch.device, seed: int,
                weight_fill: str = "normal") -> LinearStack:
    """A stack of about ``target_gb`` with host weights generated on ``device`` (see FILLS)."""
    from perf.scenarios import _chunk

    per_layer = (width * width + width) * 2
    n = max(2, round(target_gb * GB / per_layer))
    stack = LinearStack(n, width)
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in stack.layers:
        for name in ("weight", "bias"):
            meta = getattr(layer, name)
            dev = _chunk(meta.numel(), meta.dtype, device, WEIGHT_STD, gen, weight_fill).view(meta.shape)
            host = torch.empty(meta.shape, dtype=meta.dtype)
            host.copy_(dev)
            setattr(layer, name, nn.Parameter(host, requires_grad=False))
    return stack.eval()


def nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def timed_call(module: nn.Module, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """CUDA-event ms around one hooked call (arrival + trivial forward)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    y = module(x)
    e.record()
    e.synchronize()
    return s.elapsed_time(e), y


def host_timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


# ---------------------------------------------------------------- modes
def run_module(enc: nn.Module, dit: nn.Module, x: torch.Tensor, device: torch.device, rounds: int,
               mode: str = "module", run_mb: float | None = None) -> dict:
    from weightstream.offload.config import OffloadConfig
    from weightstream.offload.pipeline import offload_pipeline

    pipe = types.SimpleNamespace(text_encoder=enc, transformer=dit)
    coded = CODECS[mode] != "none"
    cfg = OffloadConfig.module(["dit", "text_encoder"], progress=True, weight_codec=CODECS[mode])
    t = time.perf_counter()
    handle = offload_pipeline(pipe, cfg, device=device)
    setup_s = time.perf_counter() - t
    if coded and run_mb is not None:
        handle.coded_run_bytes = int(run_mb * (1 << 20))
    run_bytes = getattr(handle, "coded_run_bytes", 0)
    stats = handle.stats()
    log(f"{mode}: setup {setup_s:.1f} s ({'encode' if coded else 'pack'} + pin), "
        f"host {stats['host_bytes'] / GB:.2f} GB, pinned {stats['pinned_bytes'] / GB:.2f} GB"
        + (f", coded {stats['coded_bytes'] / stats['raw_bytes']:.3f} of the raw bytes, "
           f"{stats['bits_per_weight']:.2f} bits/weight" if coded else "")
        + (f", pin failure: {stats['pin_failure']}" if stats["pin_failure"] else ""))
    arrivals = {"text_encoder": [], "transformer": []}
    device_gb = {"text_encoder": [], "transformer": []}
    out = None
    for r in range(rounds + 1):  # round 0 warms the allocator (first cudaMalloc of each size)
        ms = {}
        for name, mod in (("text_encoder", enc), ("transformer", dit)):
            ms[name], y = timed_call(mod, x)
            if r:
                arrivals[name].append(ms[name])
                device_gb[name].append(torch.cuda.memory_allocated(device) / GB)
            if name == "transformer":
                out = y
        log(f"{mode}: round {r}{' (warm-up)' if r == 0 else ''}: encoder {ms['text_encoder']:.1f} ms, "
            f"DiT {ms['transformer']:.1f} ms (device now {torch.cuda.memory_allocated(device) / GB:.1f} GB)")
    ms, _ = timed_call(enc, x)  # the DiT leaves once more (for the departure figure)
    departures = {"text_encoder": [], "transformer": []}
    for e in list(handle.events):
        if e.action == "depart":
            departures[e.unit].append(e.host_ms)
    handle.disable()
    del handle
    out = out.detach().cpu()
    for m in (enc, dit):  # disable() gave the weights back on the device: host tensors for the next mode
        m.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    raw = {"arrival_ms": {k: med(v) for k, v in arrivals.items()},
           "arrival_ms_all": {k: [round(a, 2) for a in v] for k, v in arrivals.items()},
           "departure_ms": {k: med(v) for k, v in departures.items() if v},
           "device_gb_after_arrival": {k: round(med(v), 2) for k, v in device_gb.items()},
           "setup_s": round(setup_s, 2), "pinned_host_gb": round(stats["pinned_bytes"] / GB, 2),
           "host_gb": round(stats["host_bytes"] / GB, 3), "output": out}
    if coded:
        raw.update(coded_stats(stats))
        raw["run_mb"] = round(max(0, run_bytes) / (1 << 20), 3)
    return raw


def coded_stats(stats: dict) -> dict:
    """The codec's figures of a module-offload ``stats()``: per component and in total."""
    comps = stats["components"]
    return {"coded_bytes": {k: c["coded_bytes"] for k, c in comps.items()},
            "bits_per_weight": {k: round(c["bits_per_weight"], 3) for k, c in comps.items()},
            "coded_ratio": {k: round(c["coded_bytes"] / c["raw_bytes"], 4) for k, c in comps.items()},
            "coded_bytes_total": stats["coded_bytes"], "bits_per_weight_total": round(stats["bits_per_weight"], 3),
            "encode_s": round(stats["encode_s"], 2)}


def run_diffusers_model(enc: nn.Module, dit: nn.Module, x: torch.Tensor, device: torch.device, rounds: int) -> dict:
    from accelerate import cpu_offload_with_hook

    # what DiffusionPipeline.enable_model_cpu_offload builds for text_encoder->transformer
    _, hook_e = cpu_offload_with_hook(enc, device)
    _, hook_d = cpu_offload_with_hook(dit, device, prev_module_hook=hook_e)
    arrivals = {"text_encoder": [], "transformer": []}
    departures = {"text_encoder": [], "transformer": []}
    out = None
    try:
        for r in range(rounds + 1):
            ms_e, _ = timed_call(enc, x)
            dep_e = host_timed(hook_e.offload)  # (the DiT's pre-forward would do this itself)
            ms_d, out = timed_call(dit, x)
            dep_d = host_timed(hook_d.offload)  # maybe_free_model_hooks() at the end of a pipeline call
            if r:
                arrivals["text_encoder"].append(ms_e)
                arrivals["transformer"].append(ms_d)
                departures["text_encoder"].append(dep_e)
                departures["transformer"].append(dep_d)
            log(f"diffusers-model: round {r}{' (warm-up)' if r == 0 else ''}: encoder {ms_e:.0f} ms "
                f"(+{dep_e:.0f} ms to offload), DiT {ms_d:.0f} ms (+{dep_d:.0f} ms to offload)")
    finally:
        hook_e.remove()
        hook_d.remove()
    return {"arrival_ms": {k: med(v) for k, v in arrivals.items()},
            "arrival_ms_all": {k: [round(a, 1) for a in v] for k, v in arrivals.items()},
            "departure_ms": {k: med(v) for k, v in departures.items()},
            "output": out.detach().cpu() if out is not None else None}


def figures(raw: dict, sizes: dict, h2d: float) -> dict:
    floors = {k: round(b / (h2d * GB) * 1e3, 3) for k, b in sizes.items()}
    ratios = {k: round(raw["arrival_ms"][k] / floors[k], 4) for k in floors}
    step = raw["arrival_ms"]["transformer"]
    out = {"step_ms": step, "floor_ms": floors["transformer"],
           "ratio_to_floor": round(step / floors["transformer"], 4),
           "arrival_ratio_to_floor": ratios["transformer"],
           "arrival_ms": raw["arrival_ms"], "floors_ms": floors, "arrival_ratios_to_floor": ratios,
           "departure_ms": raw["departure_ms"], "streamed_gb": round(sizes["transformer"] / GB, 3)}
    for k in ("arrival_ms_all", "device_gb_after_arrival", "setup_s", "pinned_host_gb", "host_gb", "coded_bytes",
              "bits_per_weight", "coded_ratio", "coded_bytes_total", "bits_per_weight_total", "encode_s", "run_mb"):
        if k in raw:
            out[k] = raw[k]
    if "coded_bytes" in raw:  # what the coded bytes alone would take over the same link
        out["coded_floors_ms"] = {k: round(b / (h2d * GB) * 1e3, 3) for k, b in raw["coded_bytes"].items()}
        out["coded_floor_ms"] = out["coded_floors_ms"]["transformer"]
    return out


def table(result: dict) -> str:
    rows = [f"module-swap on {result['gpu']} ({result['commit'][:12]}), H2D {result['h2d_gbps']:.1f} GB/s",
            f"{'mode':<16}{'component':<14}{'GB':>7}{'floor ms':>10}{'arrival ms':>12}{'x floor':>9}{'depart ms':>11}"]
    sizes = result["component_gb"]
    for mode, f in result["modes"].items():
        for comp in ("text_encoder", "transformer"):
            rows.append(f"{mode:<16}{comp:<14}{sizes[comp]:>7.2f}{f['floors_ms'][comp]:>10.1f}"
                        f"{f['arrival_ms'][comp]:>12.1f}{f['arrival_ratios_to_floor'][comp]:>9.3f}"
                        f"{f['departure_ms'].get(comp, float('nan')):>11.2f}")
        if "coded_bytes" in f:
            rows.append(f"{'':<16}coded: " + ", ".join(
                f"{comp} {f['coded_bytes'][comp] / GB:.2f} GB ({f['coded_ratio'][comp]:.3f}x, "
                f"{f['bits_per_weight'][comp]:.2f} bits/weight, coded floor {f['coded_floors_ms'][comp]:.1f} ms)"
                for comp in ("text_encoder", "transformer"))
                + f"; runs of {f['run_mb']:g} MiB; setup {f['setup_s']:.1f} s (encode {f['encode_s']:.1f} s)")
    return "\n".join(rows)


def parse_modes(names) -> tuple[str, ...]:
    """The modes asked for, in the order they run (MODES); ValueError naming a bad one."""
    names = tuple(m.strip() for m in names if m.strip())
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise ValueError(f"--modes {','.join(bad) or '(empty)'} is not allowed with --scenario {SCENARIO}; "
                         f"choose from: {', '.join(MODES)}")
    return tuple(m for m in MODES if m in names)


@dataclass(frozen=True)
class SwapSizes:
    """The module-swap scenario's components and rounds (decimal GB)."""
    encoder_gb: float = 9.5    # T5-XXL
    dit_gb: float = 23.8       # Flux.1-dev
    width: int = 4096          # Linear width: 32 MiB per layer
    rounds: int = 3            # timed rounds per mode after one warm-up round
    peer_rounds: int = 2       # timed rounds of diffusers-model (slow)
    fill: str | None = None    # weight values (None: student-t when a coded mode runs, else normal)
    run_mb: float | None = None  # coded modes: copy/decode run size in MiB (None: the library's)

    def __post_init__(self):
        for key in ("encoder_gb", "dit_gb", "width", "rounds", "peer_rounds"):
            if not getattr(self, key) > 0:
                raise ValueError(f"--{key.replace('_', '-')} {getattr(self, key)} is not allowed; allowed: > 0")
        if self.fill is not None and self.fill not in FILLS:
            raise ValueError(f"--fill {self.fill!r} is not allowed; choose from: {', '.join(FILLS)}")
        if self.run_mb is not None and self.run_mb < 0:
            raise ValueError(f"--run-mb {self.run_mb} is not allowed; allowed: >= 0 (0 = one copy, then one decode)")


def verdicts(modes: dict) -> list[str]:
    """One line per target: module arrivals <= 1.1x floor and departures < 1 ms; module-coded
    arrivals <= 0.75x the uncoded floor."""
    out = []
    if "module" in modes:
        m = modes["module"]
        ok = all(r <= 1.1 for r in m["arrival_ratios_to_floor"].values()) and \
            all(d < 1.0 for d in m["departure_ms"].values())
        out.append(f"module arrivals within 1.1x of the floor and departures < 1 ms: {'YES' if ok else 'NO'}")
    for name in ("module-coded", "module-coded2", "module-codedp"):
        if name in modes:
            r = modes[name]["arrival_ratios_to_floor"]
            ok = all(v <= 0.75 for v in r.values())
            out.append(f"{name} arrivals <= 0.75x the uncoded floor: {'YES' if ok else 'NO'} "
                       f"({', '.join(f'{k} {v:.3f}' for k, v in r.items())})")
    return out


def run_module_swap(modes, sizes: SwapSizes = SwapSizes(), *, out_dir: str | Path | None = None,
                    device: str | None = None) -> tuple[dict, Path]:
    """Run the modes on one GPU and file the result (merged over ``module-swap-<gpu>.json``)."""
    from perf.results import write_result

    modes_run = parse_modes(modes)
    weight_fill = sizes.fill or ("student-t" if {"module-coded", "module-coded2", "module-codedp"} & set(modes_run)
                                 else "normal")
    if not torch.cuda.is_available() or (device or "cuda").startswith("cpu"):
        raise ValueError(f"--scenario {SCENARIO} needs a CUDA GPU (it times arrivals over the H2D link); "
                         "run it on the device machine")
    device = torch.device(device or "cuda")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    gpu = torch.cuda.get_device_name(device)
    commit, dirty = git_commit()
    log(f"{gpu}, torch {torch.__version__}, commit {commit[:12]}{' (dirty)' if dirty else ''}")

    h2d = measure_h2d_gbps(device, reps=9)[0]
    log(f"pinned H2D: {h2d:.1f} GB/s (1 GiB copies, median)")
    x = torch.randn(1, sizes.width, device=device, dtype=torch.bfloat16)
    enc = build_stack(sizes.encoder_gb, sizes.width, device, seed=1, weight_fill=weight_fill)
    log(f"built encoder: {len(enc.layers)} layers, {nbytes(enc) / GB:.2f} GB ({weight_fill})")
    dit = build_stack(sizes.dit_gb, sizes.width, device, seed=2, weight_fill=weight_fill)
    log(f"built DiT: {len(dit.layers)} layers, {nbytes(dit) / GB:.2f} GB ({weight_fill})")
    torch.cuda.empty_cache()
    comp = {"text_encoder": nbytes(enc), "transformer": nbytes(dit)}

    modes, raws, failed = {}, {}, {}
    if "diffusers-model" in modes_run:
        try:
            log("diffusers-model (accelerate cpu_offload_with_hook chain) ...")
            raws["diffusers-model"] = run_diffusers_model(enc, dit, x, device, sizes.peer_rounds)
        except Exception as e:  # accelerate missing or broken: keep our own figures
            failed["diffusers-model"] = f"{type(e).__name__}: {e}"
            log(f"diffusers-model failed: {failed['diffusers-model']}")
        for m in (enc, dit):  # back to plain host tensors for the next mode
            m.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()
    for name in ("module", "module-coded", "module-coded2", "module-codedp"):
        if name in modes_run:
            log(f"{name} (weightstream offload_pipeline) ...")
            raws[name] = run_module(enc, dit, x, device, sizes.rounds, mode=name, run_mb=sizes.run_mb)
    for name in MODES:
        if name in raws:
            modes[name] = dict(figures(raws[name], comp, h2d), weight_fill=weight_fill)
    outs = [r.get("output") for r in raws.values() if r.get("output") is not None]
    same = len(outs) >= 2 and all(torch.equal(outs[0].cpu(), o.cpu()) for o in outs[1:])

    result = {
        "scenario": SCENARIO, "gpu": gpu, "gpus": 1, "commit": commit, "dirty": dirty,
        "torch": torch.__version__.split("+")[0],
        "date": datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "h2d_gbps": round(h2d, 2), "model_gb": round(sum(comp.values()) / GB, 2),
        "component_gb": {k: round(v / GB, 3) for k, v in comp.items()},
        "width": sizes.width, "weight_fill": weight_fill,
        "outputs_equal_across_modes": same if len(outs) >= 2 else None,
        "modes": modes,
    }
    if failed:
        result["failed"] = failed
    path = write_result(out_dir or DEFAULT_OUT, result)
    print(table(result))
    print("\n".join(verdicts(modes)) + f"; outputs equal across modes: {result['outputs_equal_across_modes']}")
    log("done")
    return result, path
