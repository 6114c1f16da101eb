"""Command line: ``python -m weightstream demo|plan|bench|monitor``."""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _demo_model(name: str, device: str):
    """A real architecture with random weights: tiny on CPU, larger on a GPU."""
    from weightstream import models

    big = device.startswith("cuda")
    dtype = torch.bfloat16 if big else torch.float32
    if name == "flux":
        kw = dict(num_layers=4, num_single_layers=9, attention_head_dim=128, num_attention_heads=8,
                  joint_attention_dim=1024, pooled_projection_dim=256, in_channels=64,
                  axes_dims_rope=(16, 56, 56)) if big else {}
        model = models.tiny_flux(dtype=dtype, **kw)
        inputs = models.flux_inputs(model, device=device, image_tokens=1024 if big else 16,
                                    text_tokens=128 if big else 8)
    elif name == "wan":
        kw = dict(num_attention_heads=8, attention_head_dim=128, ffn_dim=4096, text_dim=1024,
                  num_layers=9) if big else {}
        model = models.tiny_wan(dtype=dtype, **kw)
        inputs = models.wan_inputs(model, device=device, frames=4 if big else 2, height=32 if big else 8,
                                   width=32 if big else 8)
    else:
        model = models.ToyDiT()
        inputs = models.toy_inputs(device=device)
    return model, inputs


def _timed(fn, device: str, steps: int) -> float:
    with torch.no_grad():
        fn()  # warm-up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3, out


def demo_layer(args) -> int:
    from weightstream import OffloadConfig, OffloadedTransformer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, inputs = _demo_model(args.model, device)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model: {type(model).__name__}, {nbytes / 1e6:.1f} MB of weights, random init; device: {device}")
    resident = copy.deepcopy(model).to(device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms_res, ref = _timed(lambda: _first(resident(**inputs)), device, args.steps)
    peak_res = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    del resident
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cfg = OffloadConfig.layerwise(resident_layers=args.resident_layers)
    streamed = OffloadedTransformer(model, cfg, device=device)
    ms_str, out = _timed(lambda: _first(streamed(**inputs)), device, args.steps)
    s = streamed.stats()
    same = torch.equal(out, ref)
    print(f"resident : {ms_res:8.2f} ms/step" + (f", peak device {peak_res / 1e6:.1f} MB" if peak_res else ""))
    line = f"streamed : {ms_str:8.2f} ms/step"
    if device.startswith("cuda"):
        line += f", peak device {torch.cuda.max_memory_allocated() / 1e6:.1f} MB"
    print(line)
    print(
        f"blocks streamed {s['blocks_streamed']}, resident {s['blocks_resident']}; slots {s['num_slots']} x "
        f"{s['slot_bytes'] / s['num_slots'] / 1e6:.2f} MB; host store {s['host_bytes'] / 1e6:.1f} MB "
        f"({'pinned' if s['pinned'] else 'pageable'}); setup {s['setup_s']:.3f} s"
    )
    print(f"outputs match bit for bit: {same}")
    return 0 if same else 1


def cmd_demo(args) -> int:
    if args.dlo:
        from weightstream.demo_dlo import run_dlo_demo

        return run_dlo_demo(args.dlo)
    if args.mode == "module":
        from weightstream.demo_module import run_module_demo

        return run_module_demo(args.device)
    return demo_layer(args)


def cmd_plan(args) -> int:
    from weightstream import OffloadConfig
    from weightstream.offload.discovery import discover_blocks
    from weightstream.offload.layout import block_tensors, build_layout
    from weightstream.offload.schedule import Schedule

    model, _ = _demo_model(args.model, "cpu")
    cfg = OffloadConfig.layerwise(resident_layers=args.resident_layers)
    blocks = discover_blocks(model)
    sched = Schedule(len(blocks), cfg.resident_layers, cfg.num_slots)
    print(f"{type(model).__name__}: {len(blocks)} blocks, {sched.n} streamed through {sched.slots} slots")
    for b in blocks:
        lay = build_layout(b.index, b.name, block_tensors(b.module))
        where = "resident" if b.index < sched.resident else f"streamed (step 0 slot {sched.slot_at(b.index - sched.resident)})"
        print(f"  {b.index:3d} {b.name:32s} {len(lay.tensors):3d} tensors {lay.nbytes / 1e6:9.3f} MB  {where}")
    return 0


def cmd_monitor(argv: list[str]) -> int:
    from weightstream.telemetry import monitor_main

    return monitor_main(argv)


def cmd_bench(argv: list[str]) -> int:
    try:
        from perf.__main__ import main as perf_main
    except ImportError:
        print("weightstream bench runs the harness in perf/ (run from the repository root): "
              "python -m perf run --scenario flux-12b-1024 --modes resident,layerwise", file=sys.stderr)
        return 2
    return perf_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "monitor":
        return cmd_monitor(argv[1:])
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    p = argparse.ArgumentParser(prog="python -m weightstream")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run a random-weight DiT resident and streamed; compare outputs")
    d.add_argument("--mode", choices=["layer", "module"], default="layer")
    d.add_argument("--dlo", choices=["allgather", "rank-local"], default=None,
                   help="distributed layerwise offload (launch with torchrun --nproc-per-node N)")
    d.add_argument("--model", choices=["flux", "wan", "toy"], default="flux")
    d.add_argument("--device", default=None)
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--resident-layers", type=int, default=0)
    pl = sub.add_parser("plan", help="print discovered blocks, their layouts and slots")
    pl.add_argument("--model", choices=["flux", "wan", "toy"], default="flux")
    pl.add_argument("--resident-layers", type=int, default=0)
    sub.add_parser("bench", help="run the perf harness (python -m weightstream bench run --scenario ...)")
    sub.add_parser("monitor", help="record GPU memory while a command runs: monitor -- CMD ...")
    args = p.parse_args(argv)
    return {"demo": cmd_demo, "plan": cmd_plan}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
