"""Where in a block a decode beside Flux's compute costs least: at the block's start or inside it.

    python perf/probe_decode_placement.py [--placements start,attn,mlp] [--steps 5] [--codec exp-k]

perf/probe_dlo_decode.py (call70/71) found each block's decode stalling the compute stream for
nearly its whole duration (16.1 of 17.0 ms a step): it becomes runnable at a block boundary (the
slot's release), where the next block's first kernels are small elementwise ones, and its grid
takes the SMs first. Beside a loop of large GEMMs (perf/bench_decode_steal.py) the same decode
costs about half its time. This probe runs the resident bench_dlo Flux (Student-t weights) and,
per streamed-sized block, launches one decode of a block-sized coded buffer on a side stream,
made runnable at a chosen point of the block (a forward pre-hook on the block or on one child):

- ``start``: the block's start (where the ring's decodes run today);
- ``attn``: the ``attn`` child's start (after the modulation and norm kernels);
- ``mlp``: the MLP's start (``ff`` in double blocks, ``proj_mlp`` in single ones).

Per placement: median step, excess over the resident step, and that excess over the decodes'
standalone time (``stall_frac``: 1.0 = fully serialised, 0 = free). The decoded output goes to a
scratch buffer (the model's weights are untouched; its output is checked bit-exact).
Results: ``perf/results/decodeplace-<gpu>-<commit>.json``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from perf.common import save_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = {"start": (), "attn": ("attn",), "mlp": ("ff", "proj_mlp")}


def parse_placements(text: str) -> list[str]:
    out = [p for p in text.split(",") if p]
    if not out or any(p not in PLACEMENTS for p in out) or len(set(out)) != len(out):
        raise ValueError(f"--placements {text!r}: allowed a comma list of distinct names from: {', '.join(PLACEMENTS)}")
    return out


def gate_module(block: torch.nn.Module, placement: str) -> torch.nn.Module:
    """The module whose forward start makes the block's decode runnable."""
    for name in PLACEMENTS[placement]:
        child = getattr(block, name, None)
        if isinstance(child, torch.nn.Module):
            return child
    if PLACEMENTS[placement]:
        raise ValueError(f"placement {placement!r}: {type(block).__name__} has none of {PLACEMENTS[placement]}")
    return block


def streamed_blocks(model) -> list[torch.nn.Module]:
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


class Decodes:
    """One coded buffer per distinct block size; ``launch(block)`` decodes it on the side stream
    after the compute stream's work so far."""

    def __init__(self, blocks, codec: str, device):
        from weightstream.fills import fill
        from weightstream.kernels.codec import CodecSegment, DecodeTable, encode, read_header
        from weightstream.offload.sources.codec_names import codec_levels

        self.side, self.jobs, self.by_block = torch.cuda.Stream(device), {}, {}
        for b in blocks:
            n = sum(p.numel() for p in b.parameters())
            if n not in self.jobs:
                w = fill("student-t", (n,), generator=torch.Generator().manual_seed(n)).to(device)
                buf = encode(w, levels=codec_levels(codec))
                table = DecodeTable([CodecSegment(0, 0, read_header(buf))])
                table.upload(device)
                self.jobs[n] = (buf, torch.empty_like(w).view(torch.uint8), table)
            self.by_block[id(b)] = n
        self.decoded_bytes = sum(2 * n for n in self.by_block.values())

    def launch(self, block) -> None:
        from weightstream.kernels.codec import decode

        buf, out, table = self.jobs[self.by_block[id(block)]]
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            decode(buf, out, table)

    def standalone_ms(self, reps: int = 5) -> float:
        """All blocks' decodes back to back, alone."""
        from perf.bench_decode_steal import _median_ms
        from weightstream.kernels.codec import decode

        def all_blocks():
            for n in self.by_block.values():
                decode(*self.jobs[n])

        return _median_ms(all_blocks, reps)


def measure(args) -> dict:
    from perf.bench_dlo import FLUX_12B, build_model, model_inputs
    from perf.common import timed_steps

    device = torch.device("cuda", torch.cuda.current_device())
    model = build_model(FLUX_12B, device, weight_fill="student-t")
    inputs = model_inputs(model, device, 0, False)
    blocks = streamed_blocks(model)
    dec = Decodes(blocks, args.codec, device)
    alone = dec.standalone_ms()
    main = torch.cuda.current_stream()

    def step():
        out = model(**inputs)[0]
        main.wait_stream(dec.side)  # the step ends after its decodes
        return out

    with torch.no_grad():
        ref = model(**inputs)[0]
        resident = statistics.median(timed_steps(step, args.steps, args.warmup, True).ms)
        res = {"codec": args.codec, "decoded_gb_per_step": round(dec.decoded_bytes / 1e9, 3),
               "decode_alone_ms": round(alone, 3), "resident_ms": round(resident, 3), "placements": {}}
        print(f"resident {resident:.1f} ms; decodes alone {alone:.2f} ms for {dec.decoded_bytes / 1e9:.1f} GB", flush=True)
        for placement in args.placements:
            hooks = [gate_module(b, placement).register_forward_pre_hook(lambda m, a, b=b: dec.launch(b))
                     for b in blocks]
            try:
                holder = {}
                t = timed_steps(lambda: holder.__setitem__("out", step()), args.steps, args.warmup, True)
            finally:
                for h in hooks:
                    h.remove()
            ms = statistics.median(t.ms)
            fig = {"step_ms": round(ms, 3), "excess_ms": round(ms - resident, 3),
                   "stall_frac": round((ms - resident) / alone, 3), "bit_exact": bool(torch.equal(holder["out"], ref))}
            res["placements"][placement] = fig
            print(f"{placement}: {ms:.1f} ms/step, +{fig['excess_ms']:.2f} ms = {fig['stall_frac']:.2f}x the decodes' "
                  f"own time, bit-exact {fig['bit_exact']}", flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--placements", default="start,attn,mlp")
    p.add_argument("--codec", default="exp-k", choices=["exp-k", "exp-k2", "exp-kp"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = p.parse_args(argv)
    try:
        args.placements = parse_placements(args.placements)
    except ValueError as e:
        p.error(str(e))
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps >= 1 and --warmup >= 0; got {args.steps}, {args.warmup}")
    if not torch.cuda.is_available():
        print("probe_decode_placement needs a CUDA device", file=sys.stderr)
        return 2
    save_result(args.out, "decodeplace", measure(args), suffix=f"-{args.codec}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
