"""Early device smoke run: registration, H2D bandwidth, and a Flux-sized layerwise step.

Developer tool for checking the mechanism on the device before the full perf
harness runs; results are printed and written to $OUT/smoke.json.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def h2d_gbps(src: torch.Tensor, dst: torch.Tensor, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return src.numel() / (times[len(times) // 2] * 1e-3) / 1e9


def random_fill_(model: torch.nn.Module, std: float = 0.02) -> None:
    """Materialise a meta model on the CPU with random values drawn on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            t = torch.randn(p.shape, device="cuda", dtype=torch.float32, generator=gen).mul_(std).to(p.dtype)
            mod._parameters[name] = torch.nn.Parameter(t.cpu(), requires_grad=False)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)


def main() -> int:
    from diffusers import FluxTransformer2DModel

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import flux_inputs

    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    # 1. registration and bandwidth from a registered anonymous mapping
    from weightstream.offload.host_store import HostStore
    from weightstream.offload.layout import BlockLayout

    lay = BlockLayout(0, "probe", (), 1 << 30)
    t0 = time.perf_counter()
    store = HostStore([lay], pin=True)
    store.image(0).fill_(1)
    t1 = time.perf_counter()
    store.pin(0)
    t2 = time.perf_counter()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    out["register_1gib_s"] = t2 - t1
    out["fill_1gib_s"] = t1 - t0
    out["h2d_registered_gbps"] = h2d_gbps(store.image(0), dst)
    pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    out["h2d_pinned_gbps"] = h2d_gbps(pinned, dst)
    log("registration:", {k: round(v, 3) for k, v in out.items() if isinstance(v, float)}, "failure:", store.pin_failure)
    store.close()
    del pinned, dst

    # 2. Flux.1-sized transformer, bf16, 1024x1024
    layers = int(os.environ.get("SMOKE_LAYERS", "19"))
    singles = int(os.environ.get("SMOKE_SINGLE", "38"))
    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=layers, num_single_layers=singles, guidance_embeds=True)
    model = model.to(torch.bfloat16)
    t0 = time.perf_counter()
    random_fill_(model)
    log(f"built flux ({layers}+{singles} blocks) in {time.perf_counter() - t0:.1f} s")
    x = flux_inputs(model, device="cuda", image_tokens=4096, text_tokens=512)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out["model_gb"] = nbytes / 1e9

    def bench(fn, steps=5, warm=2):
        with torch.no_grad():
            for _ in range(warm):
                fn()
            ts = []
            for _ in range(steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
        ts.sort()
        return ts[len(ts) // 2], ts

    import copy

    resident = copy.deepcopy(model).cuda()
    ref = resident(**x)[0]
    out["resident_ms"], _ = bench(lambda: resident(**x))
    log("resident ms", out["resident_ms"])
    del resident
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    w = OffloadedTransformer(model, OffloadConfig.layerwise(record_events=bool(os.environ.get("SMOKE_EVENTS"))),
                             device="cuda")
    out["setup_s"] = time.perf_counter() - t0
    s = w.stats()
    out["stats"] = {k: v for k, v in s.items()}
    log("setup s", out["setup_s"], s)
    with torch.no_grad():
        o = w(**x)[0]
    out["bit_exact"] = bool(torch.equal(o, ref))
    torch.cuda.reset_peak_memory_stats()
    out["layerwise_ms"], out["layerwise_all_ms"] = bench(lambda: w(**x))
    out["peak_device_gb"] = torch.cuda.max_memory_allocated() / 1e9
    bw = out["h2d_pinned_gbps"]
    floor = max(out["resident_ms"], s["streamed_bytes_per_step"] / (bw * 1e9) * 1e3)
    out["floor_ms"] = floor
    out["ratio_to_floor"] = out["layerwise_ms"] / floor
    log("layerwise ms", out["layerwise_ms"], "floor", floor, "ratio", out["ratio_to_floor"], "exact", out["bit_exact"])
    if os.environ.get("SMOKE_EVENTS"):
        ev = w.events()
        with open(os.path.join(os.environ.get("OUT", "."), "smoke_events.json"), "w") as f:
            json.dump(ev, f)
    with open(os.path.join(os.environ.get("OUT", "."), "smoke.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in out.items() if k not in ("stats", "layerwise_all_ms")}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
