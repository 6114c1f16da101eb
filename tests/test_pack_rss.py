"""Setup peak host memory (issue 15): packing a model into the host store keeps
the process's peak RSS within 1.15 x the model bytes over the interpreter.

A fresh subprocess imports torch, diffusers' model class and weightstream,
reads its RSS (the baseline), builds a scenario-shaped model of a few hundred
MB the way the perf harness does (parameters on meta, then filled one by one,
so the build itself peaks at the model), offloads it (device cpu) and reports
its peak RSS (VmHWM). On device cpu the ring's slots are device memory that
happens to live in the host, so their bytes (``stats()['slot_bytes']``,
allocated after packing) are not counted as setup host memory.
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from weightstream.offload.host.arena import HostStore
from weightstream.offload.layout import block_tensors, build_layout
from weightstream.offload.host.packing import ahead_bytes, pack_blocks
from weightstream.offload.placeholders import drop_storage
from weightstream.models import ToyDiT

REPO = Path(__file__).resolve().parent.parent
TARGET = 1.15

CHILD = r"""
import json, sys
from weightstream.checkout import root_last; root_last()  # PYTHONPATH's checkout after site-packages
from dataclasses import replace
import torch
from perf.scenarios import SCENARIOS, build_model, model_class, tensor_bytes
from weightstream import OffloadConfig, OffloadedTransformer

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

name, overrides, device = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
base_sc = SCENARIOS[name]
sc = replace(base_sc, tiny_config=dict(base_sc.config, **overrides))
model_class(sc.family)
if device == "cuda":
    torch.zeros(1, device=device)  # the CUDA context belongs to the baseline
baseline = status("VmRSS")
model = build_model(sc, tiny=True, device="cpu", gen_device="cpu")
built = status("VmRSS")
model_bytes = tensor_bytes(model)
wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False, resident_layers=0, weight_codec="none"),
                               device=device)
stats = wrapped.stats()
print(json.dumps({"baseline": baseline, "built": built, "peak": status("VmHWM"), "after": status("VmRSS"),
                  "model_bytes": model_bytes, "pinned_bytes": stats["pinned_bytes"],
                  "slot_bytes": stats["slot_bytes"] if device == "cpu" else 0}))
"""

# the coded source's build alone (weight_codec='exp-k'), from the same model
CHILD_CODED = CHILD.split("wrapped = ")[0] + r"""
from weightstream.offload.discovery import discover_blocks
from weightstream.offload.layout import block_tensors, build_layout
from weightstream.offload.sources.pinned import CodedSource
from weightstream.offload.host.encode import encode_workers
blocks = discover_blocks(model, None)
tensors = [[t for _, _, t in block_tensors(b.module)] for b in blocks]
layouts = [build_layout(b.index, b.name, block_tensors(b.module)) for b in blocks]
src = CodedSource(layouts, tensors, device=device, pin=False)
print(json.dumps({"baseline": baseline, "built": built, "peak": status("VmHWM"), "after": status("VmRSS"),
                  "model_bytes": model_bytes, "coded_bytes": sum(src.coded), "slot_bytes": 0,
                  "in_flight": min(len(layouts), encode_workers()) * max(l.nbytes for l in layouts)}))
"""

# a quantized model (perf/quantized.py, issue 37): quantized on the host, the peak counted from the
# quantized model on (VmHWM reset), the host store holding the quantized bytes only
CHILD_QUANT = CHILD.split("model_bytes = tensor_bytes(model)")[0] + r"""
from perf.quantized import quantize, reset_peak_rss
model = quantize(model, sys.argv[4])
model_bytes = tensor_bytes(model)
if not reset_peak_rss():
    raise SystemExit("no /proc/self/clear_refs")
baseline = status("VmRSS") - model_bytes  # what the process holds beside the quantized model
wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False, resident_layers=0, weight_codec="none"),
                               device=device)
stats = wrapped.stats()
print(json.dumps({"baseline": baseline, "built": baseline + model_bytes, "peak": status("VmHWM"),
                  "after": status("VmRSS"), "model_bytes": model_bytes, "host_bytes": stats["host_bytes"],
                  "streamed": stats["streamed_bytes_per_step"], "slot_bytes": stats["slot_bytes"]}))
"""
QUANT_CASES = ("qfp8", "qgguf8", "qint8")


# Wan-shaped (40 uniform blocks, 8.4 MB each) and Flux-shaped (double and
# single blocks, 42 / 18 MB), bf16, ~340 / ~400 MB: tensors of 0.5-8 MB,
# which malloc keeps in its heap (the case a trim matters for)
CASES = {
    "wan": ("wan-14b-480p", dict(num_attention_heads=4, ffn_dim=2048)),
    "flux": ("flux-12b-1024", dict(num_layers=4, num_single_layers=12, num_attention_heads=6)),
}


# a few GB, for the device machine (tensors of 4.7 and 19 MB: heap and mapped)
LARGE = ("wan-14b-480p", dict(num_attention_heads=12, ffn_dim=6144))


def _measure(scenario: str, overrides: dict, device: str = "cpu", child: str = CHILD, *extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", child, scenario, json.dumps(overrides), device, *extra], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_setup_peak_rss_within_target(case):
    r = _measure(*CASES[case])
    assert 2e8 < r["model_bytes"] < 6e8, r["model_bytes"]  # a few hundred MB, as the issue asks
    _check_peak(case, r)


@pytest.mark.parametrize("case", sorted(CASES))
def test_coded_setup_peak_rss_within_target(case):
    """weight_codec='exp-k' (the coded source's build, measured alone: on the CPU a load decodes
    with the reference decoder, whose temporaries are not setup memory): each block's originals
    go as soon as its coded bytes are written (on the encode worker), so blocks coded ahead of
    the in-order pinning hold coded bytes only. Before: 1.77 x / 2.0 x here (Flux- / Wan-shaped),
    and flux-12b-1024 peaked at 1.42 x the model on the H200 (c99ccf1)."""
    r = _measure(*CASES[case], child=CHILD_CODED)
    assert 0.6 < r["coded_bytes"] / r["model_bytes"] < 0.95, r
    # a block being encoded holds its originals and its coded bytes: at most one per worker
    # (2 Flux-shaped double blocks here: 0.21 x the model; 16 of them on the H200 host: 0.3 x)
    _check_peak(case, r, allowance=r["in_flight"])


@pytest.mark.parametrize("variant", QUANT_CASES)
def test_quantized_setup_peak_rss_within_target(variant):
    """Issue 37's host bar on the CPU: a Flux-shaped model quantized (fp8 layerwise casting, GGUF
    Q8_0, torchao int8 weight-only) sets up within 1.15 x the quantized model, and the host store
    holds the quantized bytes (no bf16 copy: each image page-aligned, the fixed modules resident)."""
    r = _measure(*CASES["flux"], "cpu", CHILD_QUANT, variant)
    assert 0.4 < r["model_bytes"] / 4e8 < 0.7, r  # the quantized bytes: about half the bf16 model's
    assert r["host_bytes"] <= r["streamed"] + 4096 * 64 and r["streamed"] < r["model_bytes"], r
    _check_peak(variant, r)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES) + ["large"])
def test_setup_peak_rss_within_target_cuda(case):
    """The same on the device: slots on the GPU, every block image pinned
    (cudaHostRegister on the pinning thread, the packers running ahead of it)."""
    r = _measure(*(LARGE if case == "large" else CASES[case]), device="cuda")
    assert r["pinned_bytes"] >= r["model_bytes"] * 0.9, r
    _check_peak(case, r)


def _check_peak(case: str, r: dict, allowance: int = 0) -> None:
    model = r["model_bytes"]
    assert r["built"] - r["baseline"] > 0.9 * model     # the model really sat in this process
    ratio = (r["peak"] - r["baseline"] - r["slot_bytes"] - allowance) / model
    assert ratio <= TARGET, (
        f"{case}: setup peak RSS {(r['peak'] - r['baseline']) / 1e6:.0f} MB over the baseline, less "
        f"{r['slot_bytes'] / 1e6:.0f} MB of slots and {allowance / 1e6:.0f} MB allowed in flight, is {ratio:.3f} x "
        f"the model ({model / 1e6:.0f} MB); "
        f"target {TARGET}")
    # the originals went back to the OS: what stays is the store (+ slots), not two models
    assert (r["after"] - r["baseline"] - r["slot_bytes"]) / model <= TARGET


class _RecordingStore(HostStore):
    """A real host store that records, as each pack starts, the bytes packed
    (or being packed) whose originals have not been dropped yet."""

    def __init__(self, layouts):
        super().__init__(layouts, pin=False)
        self.lock = threading.Lock()
        self.started, self.dropped, self.most = 0, 0, 0

    def pack(self, i, tensors):
        with self.lock:
            self.started += self.layouts[i].nbytes
            self.most = max(self.most, self.started - self.dropped)
        super().pack(i, tensors)


def test_packing_stays_within_the_window_ahead_of_a_slow_drop():
    """A slow drop (a large free, a slow pin) must not let the packers run
    ahead: the bytes packed and not yet dropped stay within ahead_bytes()."""
    torch.manual_seed(0)
    blocks = [ToyDiT(width=64).single_blocks[i % 5] for i in range(20)]
    for b in blocks:
        b.to(torch.float32)
    tensors = [block_tensors(b) for b in blocks]
    layouts = [build_layout(k, f"b{k}", ts) for k, ts in enumerate(tensors)]
    objs = [[t for _, _, t in ts] for ts in tensors]
    want = [[t.detach().clone() for t in ts] for ts in objs]
    store = _RecordingStore(layouts)
    order = iter(range(len(layouts)))

    def slow_drop(ts):
        time.sleep(0.02)
        with store.lock:  # drops come in block order
            store.dropped += layouts[next(order)].nbytes
        drop_storage(ts, torch.device("cpu"))

    pack_blocks(store, objs, slow_drop, progress=False, what="test")
    sizes = [lay.nbytes for lay in layouts]
    assert store.most <= ahead_bytes(sizes) < sum(sizes) / 4
    for k in range(len(objs)):
        assert all(t.numel() == 0 for t in objs[k])
        for hv, w in zip(store.views(k), want[k]):
            assert torch.equal(hv, w)
