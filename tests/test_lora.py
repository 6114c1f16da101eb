"""LoRA on streamed blocks (CPU): diffusers' load_lora_weights from files written here,
set_adapters with weights, disable/enable, fuse/unfuse, unload, hotswap, and peft's add_adapter
with merge/unmerge, on every entry point (wrapper, in place, offload_pipeline layer and module
mode), raw and coded, with the LoRA loaded before and after offloading: outputs and state_dict()
bit-exact against the same calls on a resident twin. CUDA graphs: tests/test_lora_gpu.py."""
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import lora_cases as lc  # noqa: E402

from weightstream.offload.placeholders import holds_placeholder  # noqa: E402

CELLS = [  # (model, entry, weight_codec, LoRA loaded before offloading)
    ("flux", "wrapper", "none", False),
    ("flux", "inplace", "exp-k", True),
    ("flux", "layer", "exp-k", False),
    ("flux", "module", "none", False),
    ("flux", "module", "exp-k", True),
    ("wan", "wrapper", "exp-k", True),
]


@pytest.mark.parametrize("kind,entry,codec,before", CELLS, ids=["-".join(map(str, c)) for c in CELLS])
def test_lora_calls_match_the_resident_model(kind, entry, codec, before, tmp_path):
    twins = lc.Twins(kind, entry, codec, tmp_path, before=before)
    lc.user_sequence(twins)


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """Flux, a LoRA loaded before offloading, then wrapped."""
    return lc.Twins("flux", "wrapper", "none", tmp_path_factory.mktemp("lora"), before=True)


def test_adapters_are_resident_not_streamed(wrapped):
    from weightstream.models import tiny_flux
    from weightstream.offload.adapters import adapter_tensors, tuner_layers
    from weightstream import OffloadConfig, OffloadedTransformer

    plain = OffloadedTransformer(tiny_flux(), OffloadConfig.layerwise(progress=False), device="cpu")
    s = wrapped.pipe.transformer.stats()
    assert s["streamed_bytes_per_step"] == plain.stats()["streamed_bytes_per_step"]  # the blocks' base weights
    layers = tuner_layers(wrapped.pipe.transformer.module)
    assert layers and s["adapter_layers"] == len(layers) and s["adapter_bytes"] > 0
    adapters = [t for layer in layers for t in adapter_tensors(layer)]
    assert all(not holds_placeholder(t) and t.numel() and t.device.type == "cpu" for t in adapters)
    assert all(holds_placeholder(layer.get_base_layer().weight) for layer in layers
               if "blocks" in repr(layer.get_base_layer().weight))


def test_switching_adapters_repins_nothing(wrapped):
    t = wrapped
    before = t.pipe.transformer.stats()
    t.both("load_lora_weights", str(t.files[1]), adapter_name="b2")
    for names, weights in ((["a", "b2"], [0.3, 0.9]), ("b2", None), ("a", None)):
        t.both("set_adapters", names, adapter_weights=weights)
        t.check(f"set_adapters {names}")
    after = t.pipe.transformer.stats()
    for key in ("host_bytes", "pinned_bytes", "streamed_bytes_per_step", "slot_bytes"):
        assert after[key] == before[key], key
    assert after["adapter_bytes"] > before["adapter_bytes"] and after["adapters_placed"] == 0  # peft placed them


def test_hotswap_matches_the_resident_model(tmp_path):
    t = lc.Twins("flux", "layer", "none", tmp_path, before=False)
    t.both("unload_lora_weights")
    t.both("enable_lora_hotswap", target_rank=8)
    t.both("load_lora_weights", str(t.files[0]), adapter_name="a")
    t.check("loaded for hotswap")
    t.both("load_lora_weights", str(t.files[1]), adapter_name="a", hotswap=True)
    t.check("hotswapped")


def test_peft_add_adapter_merge_unmerge_match_the_resident_model(tmp_path):
    from peft import LoraConfig

    from weightstream.offload.adapters import tuner_layers

    t = lc.Twins("flux", "inplace", "exp-k", tmp_path, before=False)
    t.both("unload_lora_weights")
    for p in (t.ref, t.pipe):
        p.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "proj_mlp"]),
                                  adapter_name="p")
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, w in sorted(p.transformer.named_parameters()):
                if "lora_" in name:  # peft starts A at random, B at zero: the same values on both
                    w.copy_(torch.randn(w.shape, generator=g) * 0.2)
    t.check("add_adapter")
    for p in (t.ref, t.pipe):
        for layer in tuner_layers(p.transformer):
            layer.merge()
    t.check("merge")
    for p in (t.ref, t.pipe):
        for layer in tuner_layers(p.transformer):
            layer.unmerge()
    t.check("unmerge")
