"""LoRA on streamed blocks on the device (pytest -m gpu): the user's LoRA calls with CUDA graphs
(every check runs three steps: warm-up, capture, replay) and coded weights, on the wrapper, in
place and in layer mode, and module mode eager; bit-exact against a resident twin on the GPU.
Adapters added after offloading live on the device; switching adapters re-pins nothing. Each case
runs in its own process (graph capture)."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
HERE = os.path.dirname(os.path.abspath(__file__))


def run_isolated(name: str, *args):
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_lora_gpu as t; t.{name}(*{args!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{name}{args} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r


# -- bodies (run in a fresh process each) -------------------------------------------------

def case_user_sequence(kind: str, entry: str, codec: str, before: bool, graphs: str):
    import tempfile
    from pathlib import Path

    import torch

    import lora_cases as lc

    t = lc.Twins(kind, entry, codec, Path(tempfile.mkdtemp()), before=before, device="cuda",
                 dtype=torch.bfloat16, graphs=graphs)
    lc.user_sequence(t, steps=3 if graphs == "on" else 1)
    if graphs == "on":
        runner = next(iter(t.handle.wrapped.values())).graphs if entry == "layer" else t.handle.graphs
        assert runner.counts["replay"] >= 1 and runner.adapter_drops >= 5, (runner.counts, runner.adapter_drops)
    print("ok")


def case_adapters_on_the_device():
    import tempfile
    from pathlib import Path

    import torch

    import lora_cases as lc
    from weightstream.offload.adapters import adapter_tensors, tuner_layers

    t = lc.Twins("flux", "wrapper", "none", Path(tempfile.mkdtemp()), before=False, device="cuda",
                 dtype=torch.bfloat16, graphs="on")
    t.check("loaded after offloading", steps=3)
    layers = tuner_layers(t.pipe.transformer.module)
    assert all(x.device.type == "cuda" for layer in layers for x in adapter_tensors(layer))
    before = t.pipe.transformer.stats()
    # an adapter tensor the user left on the host is placed on the device at the next step
    a = adapter_tensors(layers[0])[0]
    a.data = a.data.cpu()
    t.check("placed again", steps=3)
    assert a.device.type == "cuda" and t.pipe.transformer.stats()["adapters_placed"] == before["adapters_placed"] + 1
    t.both("load_lora_weights", str(t.files[1]), adapter_name="b")
    for names in (["a", "b"], "b", "a"):
        t.both("set_adapters", names)
        t.check(f"switched to {names}", steps=3)
    after = t.pipe.transformer.stats()
    for key in ("host_bytes", "pinned_bytes", "slot_bytes", "streamed_bytes_per_step"):
        assert after[key] == before[key], key
    print("ok")


# -- the tests ------------------------------------------------------------------------------

GRAPH_CELLS = [
    ("flux", "wrapper", "none", False), ("flux", "wrapper", "exp-k", True), ("flux", "inplace", "none", True),
    ("flux", "layer", "exp-k", False), ("wan", "wrapper", "none", False),
]


@pytest.mark.parametrize("kind,entry,codec,before", GRAPH_CELLS, ids=["-".join(map(str, c)) for c in GRAPH_CELLS])
def test_lora_under_cuda_graphs_matches_the_resident_model(kind, entry, codec, before):
    run_isolated("case_user_sequence", kind, entry, codec, before, "on")


@pytest.mark.parametrize("codec,before", [("none", False), ("exp-k", True)])
def test_lora_module_mode_on_the_device_matches_the_resident_model(codec, before):
    run_isolated("case_user_sequence", "flux", "module", codec, before, "off")


def test_lora_eager_coded_on_the_device_matches_the_resident_model():
    run_isolated("case_user_sequence", "flux", "layer", "exp-k", True, "off")


def test_lora_adapters_live_on_the_device_and_switching_repins_nothing():
    run_isolated("case_adapters_on_the_device")
