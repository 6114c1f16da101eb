"""LoRA on streamed blocks on the device (pytest -m gpu): the user's LoRA calls with CUDA graphs
(every check runs four steps: warm-up, a capture per ring phase, replay) and coded weights, on the wrapper, in
place and in layer mode, and module mode eager; bit-exact against a resident twin on the GPU.
Adapters added after offloading live on the device; switching adapters re-pins nothing. Each case
runs in its own process (graph capture)."""

import pytest

from isolated import run_in_process

pytestmark = pytest.mark.gpu


def run_isolated(name: str, *args):
    return run_in_process("test_lora_gpu", f"{name}(*{args!r})", timeout=600, what=f"{name}{args}")


# -- bodies (run in a fresh process each) -------------------------------------------------

def case_user_sequence(kind: str, entry: str, codec: str, before: bool, graphs: str):
    import tempfile
    from pathlib import Path

    import torch

    import lora_cases as lc

    t = lc.Twins(kind, entry, codec, Path(tempfile.mkdtemp()), before=before, device="cuda",
                 dtype=torch.bfloat16, graphs=graphs)
    # under graphs four steps per adapter state: a warm-up, a capture per ring phase (two slots: two
    # phases), then a replay
    lc.user_sequence(t, steps=4 if graphs == "on" else 1)
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


def case_fuse_growing_coded_blocks_under_graphs():
    """A fuse whose re-encode outgrows the captured copies: every write applies, the adapter change
    drops the graphs and the staleness, the next steps warm up, capture and replay the fused weights."""
    import copy

    import torch

    from test_lora_graphs import growing_lora_model
    from weightstream import OffloadConfig, OffloadedTransformer

    model, x = growing_lora_model()
    x = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    ref = copy.deepcopy(model).cuda()
    om = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False, weight_codec="exp-k", cuda_graphs="on"),
                              device="cuda")

    def steps(what):
        with torch.no_grad():
            want = ref(**x)[0]
            for i in range(3):  # warm-up, capture, replay
                got = om(**x)[0]
                assert torch.equal(got, want), (what, i, float((got.float() - want.float()).abs().max()))

    steps("unfused")
    src = om._streamed.source
    before, replays = list(src.images.copy_bytes), om.graphs.counts["replay"]
    assert src.stage.captured and replays >= 1
    for m in (ref, model):
        m.fuse_lora()
    assert all(a > b for a, b in zip(src.images.copy_bytes, before)), (src.images.copy_bytes, before)
    assert src.stage.stale is not None  # the old graphs are stale until they are dropped
    steps("fused")
    assert om.graphs.adapter_drops >= 1 and om.graphs.counts["replay"] > replays and src.stage.stale is None
    for m in (ref, model):
        m.unfuse_lora()
    steps("unfused again")
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


def test_lora_fuse_growing_coded_blocks_under_cuda_graphs():
    run_isolated("case_fuse_growing_coded_blocks_under_graphs")
