"""Command line: ``python -m weightstream demo|plan|bench|monitor``.

torch is imported only by the subcommand that runs, so ``--help`` is fast.
Bad values end with one line on stderr and exit status 2, not a traceback.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from weightstream.checkout import root_last


class CliError(ValueError):
    """A command-line value that is not allowed (printed as one line, exit 2)."""


# top-level module -> the extra of pyproject.toml that installs it
EXTRAS = {"diffusers": "models", "transformers": "models", "matplotlib": "report"}


def missing_extra(error: ModuleNotFoundError, command: str) -> str | None:
    """The one line for a subcommand that needs a module of an extra that is not
    installed (None when the missing module belongs to no extra)."""
    module = (error.name or "").split(".")[0]
    if module not in EXTRAS:
        return None
    return (f"{command} needs {module}, which is not installed: pip install 'weightstream[{EXTRAS[module]}]'")


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum`` (argparse prints the one-line error)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} is not allowed; give an integer >= {minimum}")
        return v

    return parse


_positive_int, _non_negative_int = _int_at_least(1), _int_at_least(0)


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (argparse names the flag)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"{text} is not allowed; give a finite number > 0")
    return v


def _resident_layers(text: str) -> int | str:
    """An argparse type: an integer >= 0 or "auto" (the planner picks the resident blocks)."""
    if text == "auto":
        return text
    try:
        return _non_negative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; give an integer >= 0 or 'auto'") from None


def _slot_counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"{text} is not allowed; every slot count must be >= 2")
    return values


def _device(text: str | None) -> str:
    import torch

    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise CliError(f"--device {text}: torch sees no CUDA device here; use --device cpu")
    if text != "cpu" and not text.startswith("cuda"):
        raise CliError(f"--device {text!r} is not allowed; choose from: cpu, cuda, cuda:N")
    return text


def _demo_model(name: str, device: str):
    """A real architecture with random weights: tiny on CPU, larger on a GPU."""
    import torch

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


def _check_resident_layers(model, resident: int | str) -> int:
    from weightstream.offload.discovery import discover_blocks

    n = len(discover_blocks(model))
    if resident != "auto" and resident >= n:
        raise CliError(f"--resident-layers {resident} is not allowed: {type(model).__name__} has {n} blocks; "
                       f"choose 0..{n - 1} (at least one block must stream)")
    return n


def _cpu_auto_budget(model, weight_bytes: int) -> int:
    """A demo budget for resident_layers="auto" on the CPU: the non-block weights, two slots of the
    largest block and half of the block bytes (so the planner keeps some blocks resident)."""
    from weightstream.offload.discovery import discover_blocks

    sizes = [sum(t.numel() * t.element_size() for t in list(b.module.parameters()) + list(b.module.buffers()))
             for b in discover_blocks(model)]
    return weight_bytes - sum(sizes) + 2 * max(sizes) + sum(sizes) // 2


def _median_ms(fn, device: str, steps: int):
    """Median wall time of ``steps`` calls after one warm-up (synchronised per call on CUDA)."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = []
    with torch.no_grad():
        out = fn()  # warm-up
        sync()
        for _ in range(steps):
            t0 = time.perf_counter()
            out = fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def _h2d_gbps(device: str, nbytes: int = 256 << 20) -> float:
    """Pinned host -> device bandwidth, the best of a few copies."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best / 1e9


def demo_layer(args) -> int:
    import copy

    import torch

    from weightstream import OffloadConfig, OffloadedTransformer

    device = _device(args.device)
    cuda = device.startswith("cuda")
    model, inputs = _demo_model(args.model, device)
    nblocks = _check_resident_layers(model, args.resident_layers)
    weight_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    print(f"model: {type(model).__name__}, {nblocks} blocks, {weight_bytes / 1e6:.1f} MB of weights "
          f"(random init); device: {device}; median of {args.steps} steps after one warm-up")
    resident = copy.deepcopy(model).to(device)
    ms_res, ref = _median_ms(lambda m=resident: _first(m(**inputs)), device, args.steps)
    del resident
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    budget = None
    if args.resident_layers == "auto" and not cuda:  # on CUDA the planner's budget is the free memory
        budget = _cpu_auto_budget(model, weight_bytes) / 1e9
        print(f"resident layers: auto, planner budget {budget * 1e3:.3f} MB (the non-block weights, 2 slots and "
              "half the blocks; on the CPU the planner needs a budget)")
    cfg = OffloadConfig.layerwise(resident_layers=args.resident_layers, progress=False,
                                  device_memory_budget_gb=budget)
    streamed = OffloadedTransformer(model, cfg, device=device)
    ms_str, out = _median_ms(lambda: _first(streamed(**inputs)), device, args.steps)
    s = streamed.stats()
    same = torch.equal(out, ref)
    on_device = s["resident_bytes"] + s["slot_bytes"]
    print(f"weights held on the device: resident model {weight_bytes / 1e6:9.2f} MB | streamed "
          f"{on_device / 1e6:9.2f} MB = resident parts {s['resident_bytes'] / 1e6:.2f} MB + "
          f"{s['num_slots']} slots {s['slot_bytes'] / 1e6:.2f} MB ({on_device / max(weight_bytes, 1):.0%})")
    print(f"host store: {s['host_bytes'] / 1e6:.2f} MB ({'pinned' if s['pinned'] else 'pageable'}), "
          f"{s['blocks_streamed']} blocks streamed, {s['blocks_resident']} resident; setup {s['setup_s']:.3f} s")
    print(f"step (median): resident {ms_res:8.2f} ms | streamed {ms_str:8.2f} ms")
    if cuda:
        streamed_bytes = s["streamed_bytes_per_step"]
        gbps = _h2d_gbps(device)
        floor = max(ms_res, streamed_bytes / gbps / 1e6)
        print(f"streamed {streamed_bytes / 1e6:.1f} MB per step = {streamed_bytes / ms_str / 1e6:.1f} GB/s; "
              f"pinned H2D {gbps:.1f} GB/s; floor max(resident, bytes/H2D) {floor:.2f} ms; "
              f"step / floor {ms_str / floor:.3f}; peak device {torch.cuda.max_memory_allocated() / 1e6:.1f} MB")
    else:
        print("on the CPU copies are plain memcpy and compute is the CPU's: the times show overhead only; "
              "streaming pays off on a GPU (--device cuda)")
    print(f"outputs match bit for bit: {same}")
    print(PIPELINE_HINT)
    return 0 if same else 1


PIPELINE_HINT = """next, your own pipeline (README, Quickstart): load, offload, generate, save
    pipe = FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev", torch_dtype=torch.bfloat16)
    handle = weightstream.offload_pipeline(pipe, {"mode": "layer", "components": ["dit", "text_encoder"]})
    image = pipe("a photo of a cat").images[0]
    pipe.save_pretrained("flux-copy")"""


def cmd_demo(args) -> int:
    if args.dlo:
        from weightstream.demo_dlo import run_dlo_demo

        return run_dlo_demo(args.dlo)
    if args.mode == "module":
        from weightstream.demo_module import run_module_demo

        return run_module_demo(None if args.device is None else _device(args.device))
    return demo_layer(args)


_PLAN_ONLY = ("compute_ms", "tflops", "codec_ratio", "decode_gbps", "cuda_graphs", "json")  # flags of the placement view


def cmd_plan(args) -> int:
    if args.budget_gb is not None and args.resident_layers:
        raise CliError(f"--resident-layers {args.resident_layers} is not allowed with --budget-gb: the planner "
                       "picks the resident blocks; drop one of them")
    given = [f"--{k.replace('_', '-')}" for k in _PLAN_ONLY if getattr(args, k) not in (None, False)]
    if args.budget_gb is None and given:
        raise CliError(f"{', '.join(given)} need --budget-gb (the placement view); without it plan lists blocks")
    if args.budget_gb is not None:
        from weightstream import plan_cli

        try:
            return plan_cli.run(args)
        except ValueError as e:  # a value the planner or the model table does not allow
            raise CliError(str(e).splitlines()[0]) from None
    return _list_blocks(args)


def _list_blocks(args) -> int:
    from weightstream import OffloadConfig
    from weightstream.offload.discovery import discover_blocks
    from weightstream.offload.layout import block_tensors, build_layout
    from weightstream.offload.schedule import Schedule

    from weightstream import plan_cli

    if plan_cli.is_factory(args.model):
        try:
            model, _ = plan_cli.load_factory(args.model)
        except ValueError as e:
            raise CliError(str(e).splitlines()[0]) from None
    elif args.model in ("flux", "wan", "toy", "tiny-flux", "tiny-wan"):
        model, _ = _demo_model(args.model.removeprefix("tiny-"), "cpu")
    else:
        raise CliError(f"--model {args.model}: listing blocks without --budget-gb builds the model on the CPU; "
                       "choose from: flux, wan, toy, or your own as package.module:attr (or give --budget-gb "
                       "for the placement)")
    _check_resident_layers(model, args.resident_layers)
    cfg = OffloadConfig.layerwise(resident_layers=args.resident_layers)
    blocks = discover_blocks(model)
    sched = Schedule(len(blocks), cfg.resident_layers, cfg.num_slots)
    print(f"{type(model).__name__}: {len(blocks)} blocks, {sched.n} streamed through {sched.ring_slots} slots")
    for b in blocks:
        lay = build_layout(b.index, b.name, block_tensors(b.module))
        where = "resident" if b.index < sched.resident else f"streamed (step 0 slot {sched.slot_at(b.index - sched.resident)})"
        print(f"  {b.index:3d} {b.name:32s} {len(lay.tensors):3d} tensors {lay.nbytes / 1e6:9.3f} MB  {where}")
    return 0


def cmd_monitor(argv: list[str]) -> int:
    from weightstream.telemetry import monitor_main

    return monitor_main(argv)


def cmd_bench(argv: list[str]) -> int:
    """The perf harness lives in the repository's perf/ folder (not installed): run it
    as a separate process from the repository root."""
    if not os.path.isfile(os.path.join("perf", "__main__.py")):
        raise CliError("bench runs the harness in perf/, which is not installed: run it from the repository "
                       "root (python -m weightstream bench run --scenario flux-12b-1024 --modes resident,layerwise)")
    return subprocess.call([sys.executable, "-m", "perf", *argv])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m weightstream")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run a random-weight DiT resident and streamed; compare outputs")
    d.add_argument("--mode", choices=["layer", "module"], default="layer")
    d.add_argument("--dlo", choices=["allgather", "rank-local"], default=None,
                   help="distributed layerwise offload (launch with torchrun --nproc-per-node N)")
    d.add_argument("--model", choices=["flux", "wan", "toy"], default="flux")
    d.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    d.add_argument("--steps", type=_positive_int, default=10, help="timed steps, median reported (default 10)")
    d.add_argument("--resident-layers", type=_resident_layers, default=0,
                   help="the first N blocks stay on the device, or 'auto': the planner picks them")
    pl = sub.add_parser(
        "plan", help="the planner's placement for a model and a device budget (--budget-gb); without a "
                     "budget, list the discovered blocks, their layouts and slots",
        description="With --budget-gb: which blocks stay resident and how many slots, the predicted step and "
                    "the best first-N placement beside it. Per-block compute is estimated from FLOPs unless "
                    "--compute-ms gives measured figures.")
    pl.add_argument("--model", default="flux", metavar="MODEL",
                    help="tiny-flux, tiny-wan, toy, flux-12b-1024 (= flux-12b), flux-12b-512, wan-14b-480p "
                         "(= wan-14b); flux / wan = the tiny ones (default flux); or your own model: "
                         "package.module:attr, a factory returning the model or (model, keyword inputs)")
    pl.add_argument("--budget-gb", type=_positive_float, default=None,
                    help="device budget for weights in GB (1e9 bytes): fixed modules + resident blocks + slots")
    pl.add_argument("--h2d-gbps", type=_positive_float, default=55.0,
                    help="host-to-device GB/s (default 55, one H200's pinned rate)")
    pl.add_argument("--compute-ms", default=None, metavar="MS[,MS...]",
                    help="measured per-block compute in ms: one value for every block or one per block")
    pl.add_argument("--tflops", type=_positive_float, default=None,
                    help="effective TFLOP/s for the FLOP-based estimate (default: one H200 in bf16, calibrated "
                         "per model on its measured resident step: flux-12b-1024 430, flux-12b-512 330, "
                         "wan-14b-480p 530; others 430)")
    pl.add_argument("--slots", type=_slot_counts, default=(2, 3, 4), metavar="N[,N...]",
                    help="slot counts the planner may choose from (each >= 2; default 2,3,4)")
    pl.add_argument("--codec-ratio", type=_positive_float, default=None, metavar="R",
                    help="weight codec: coded / raw bytes crossing the link, in (0, 1] (e.g. 0.7)")
    pl.add_argument("--decode-gbps", type=_positive_float, default=None, metavar="D",
                    help="weight codec: decode rate in decoded GB/s, on the copy stream (e.g. 450)")
    pl.add_argument("--cuda-graphs", action="store_true",
                    help="plan for cuda_graphs='on' (with resident blocks, loads stay inside their step)")
    pl.add_argument("--json", action="store_true", help="print the placement as one JSON object")
    pl.add_argument("--resident-layers", type=_non_negative_int, default=0,
                    help="without --budget-gb: the first N blocks resident in the listing")
    sub.add_parser("bench", help="run the perf harness from the repository root (bench run --scenario ...)")
    sub.add_parser("monitor", help="record GPU memory while a command runs: monitor -- CMD ...")
    return p


def main(argv: list[str] | None = None) -> int:
    root_last()  # from a checkout: its kernels/ folder must not shadow the PyPI `kernels` (weightstream/checkout.py)
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "monitor":
            return cmd_monitor(argv[1:])
        if argv and argv[0] == "bench":
            return cmd_bench(argv[1:])
        args = _parser().parse_args(argv)
        return {"demo": cmd_demo, "plan": cmd_plan}[args.cmd](args)
    except CliError as e:
        print(f"weightstream: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        line = missing_extra(e, f"weightstream {' '.join(argv[:1])}".strip())
        if line is None:
            raise
        print(f"weightstream: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
