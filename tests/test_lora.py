"""LoRA on streamed blocks (CPU): diffusers' load_lora_weights from files written here,
set_adapters with weights, disable/enable, fuse/unfuse, unload, hotswap, and peft's add_adapter
with merge/unmerge, on every entry point (wrapper, in place, offload_pipeline layer and module
mode; module mode also loading while the component is offloaded), raw and coded, with the LoRA
loaded before and after offloading, with resident_layers="auto" and over DLO AllGather on two
gloo ranks: outputs and state_dict() bit-exact against the same calls on a resident twin.
The full call sequence runs on one raw cell per entry point, the calls that write weights on the
coded cells (each fuse re-encodes). CUDA graphs: tests/test_lora_gpu.py."""
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import lora_cases as lc  # noqa: E402

from weightstream.offload.placeholders import holds_placeholder  # noqa: E402

CELLS = [  # (model, entry, weight_codec, LoRA loaded before offloading, sequence)
    ("flux", "wrapper", "none", True, "full"),
    ("flux", "inplace", "none", False, "full"),
    ("flux", "layer", "none", False, "full"),
    ("flux", "module", "none", False, "full"),
    ("flux", "inplace", "exp-k", True, "short"),
    ("flux", "layer", "exp-k", False, "short"),
    ("flux", "module", "exp-k", True, "short"),
    ("wan", "wrapper", "none", False, "short"),
]


def _twins(tmp_path, kind, entry, codec, before, **kw):
    return lc.Twins(kind, entry, codec, tmp_path, before=before, small=True, **kw)


def _adapters_resident(t) -> None:
    """Adapter tensors are ordinary device tensors, the base weights of streamed blocks placeholders."""
    from weightstream.offload.adapters import adapter_tensors, tuner_layers

    root = t.pipe.transformer.module if t.entry == "wrapper" else t.pipe.transformer
    layers = tuner_layers(root)
    assert layers
    if t.entry == "module" and t.before:
        return  # a LoRA loaded before module offload travels with its component (its host image)
    adapters = [x for layer in layers for x in adapter_tensors(layer)]
    assert all(not holds_placeholder(x) and x.numel() and x.device.type == "cpu" for x in adapters)
    if t.entry != "module":
        assert any(holds_placeholder(layer.get_base_layer().weight) for layer in layers)
    stats = (t.handle.wrapped["transformer"] if t.entry == "layer" else t.handle).stats()
    if t.entry != "module":
        assert stats["adapter_layers"] == len(layers) and stats["adapter_bytes"] > 0
        assert stats["adapters_placed"] == 0  # peft put them on the streamed weights' (compute) device


@pytest.mark.parametrize("kind,entry,codec,before,seq", CELLS, ids=["-".join(map(str, c[:4])) for c in CELLS])
def test_lora_calls_match_the_resident_model(kind, entry, codec, before, seq, tmp_path):
    t = _twins(tmp_path, kind, entry, codec, before)
    _adapters_resident(t)
    (lc.user_sequence if seq == "full" else lc.short_sequence)(t)


def test_streamed_bytes_leave_the_adapters_out(tmp_path):
    from weightstream import OffloadConfig, OffloadedTransformer

    t = _twins(tmp_path, "flux", "wrapper", "none", True)
    plain_model, _ = lc.model_and_inputs("flux", small=True)
    plain = OffloadedTransformer(plain_model, OffloadConfig.layerwise(progress=False), device="cpu")
    assert t.handle.stats()["streamed_bytes_per_step"] == plain.stats()["streamed_bytes_per_step"]


def test_hotswap_then_peft_merge_match_the_resident_model(tmp_path):
    """enable_lora_hotswap + hotswap=True; then peft's add_adapter with merge / unmerge (coded merges:
    the fuses of the coded cells, the same .data write)."""
    from peft import LoraConfig

    from weightstream.offload.adapters import tuner_layers

    t = _twins(tmp_path, "flux", "inplace", "none", False)
    t.both("unload_lora_weights")
    t.both("enable_lora_hotswap", target_rank=8)
    t.both("load_lora_weights", str(t.files[0]), adapter_name="a")
    t.check("loaded for hotswap")
    t.both("load_lora_weights", str(t.files[1]), adapter_name="a", hotswap=True)
    t.check("hotswapped")
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
    for what in ("merge", "unmerge"):
        for p in (t.ref, t.pipe):
            for layer in tuner_layers(p.transformer):
                getattr(layer, what)()
        t.check(what)


def test_module_mode_offloaded_component_answers_shapes_and_refuses_value_reads(tmp_path):
    """Module mode between forwards: a weight keeps its shape (diffusers' loader reads it), .data is a
    device copy of the host master, a read of its values is a named error."""
    from weightstream.offload.misuse import StreamedModuleAccessError

    t = _twins(tmp_path, "flux", "module", "none", False)
    w = t.pipe.transformer.transformer_blocks[0].attn.to_q.base_layer.weight
    ref = t.ref.transformer.transformer_blocks[0].attn.to_q.base_layer.weight
    assert "transformer" not in t.handle.on_device() and holds_placeholder(w)
    assert w.shape == ref.shape and w.dtype == ref.dtype and torch.equal(w.data, ref)
    with pytest.raises(StreamedModuleAccessError, match="handle.using"):
        w.sum()
    t.check("loaded while offloaded")
    assert not holds_placeholder(w)  # on the device after its forward


def test_module_mode_fuse_of_a_lora_offloaded_with_its_component_is_refused_by_name(tmp_path):
    """A LoRA loaded before module offload is part of the component's host image: fusing it while the
    component is off the device reads its adapter values (a named error, nothing changed); inside
    handle.using() it fuses."""
    from weightstream.offload.misuse import StreamedModuleAccessError

    t = _twins(tmp_path, "flux", "module", "none", True)
    t.handle.offload_all()
    with pytest.raises(StreamedModuleAccessError, match="handle.using"):
        t.pipe.fuse_lora()
    t.check("refused fuse changed nothing")
    t.ref.fuse_lora()
    with t.handle.using("transformer"):
        t.pipe.fuse_lora()
    t.check("fused inside using()")


def test_dora_runs_unfused_and_its_merge_is_refused_by_name():
    """DoRA added before offloading runs unfused, bit-exact; its merge reads the base weight's values
    (AdapterMergeUnsupportedError, nothing merged); added after offloading, peft reads them to size
    its magnitude: a named error too."""
    import copy

    from peft import LoraConfig

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.offload.adapters import tuner_layers
    from weightstream.offload.misuse import AdapterMergeUnsupportedError, StreamedModuleAccessError

    model, x = lc.model_and_inputs("flux", small=True)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_q", "to_v"]), adapter_name="d")
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, w in sorted(model.named_parameters()):
            if "lora_B" in name:
                w.copy_(torch.randn(w.shape, generator=g) * 0.2)
    ref = copy.deepcopy(model)
    om = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device="cpu")
    with torch.no_grad():
        assert torch.equal(om(**x)[0], ref(**x)[0])
    for safe in (False, True):
        with pytest.raises(AdapterMergeUnsupportedError, match="DoRA merges are not supported"):
            model.fuse_lora(safe_fusing=safe)
    assert not any(layer.merged_adapters for layer in tuner_layers(model))
    with torch.no_grad():
        assert torch.equal(om(**x)[0], ref(**x)[0])
    with pytest.raises(StreamedModuleAccessError, match="to_k.weight"):
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_k"]), adapter_name="e")


def test_a_merge_refused_part_way_names_the_layers_it_left_merged():
    """peft merges layer by layer: a DoRA adapter on a resident layer (x_embedder) and on streamed
    ones (to_q) merges x_embedder before the refusal at to_q. The error says so, names the layer,
    and tells how to get the exact weights back (diffusers' unfuse_lora() does not know of it)."""
    from peft import LoraConfig

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.offload.adapters import tuner_layers
    from weightstream.offload.misuse import AdapterMergeUnsupportedError

    model, x = lc.model_and_inputs("flux", small=True)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False,
                                 target_modules=["x_embedder", "to_q"]), adapter_name="d")
    OffloadedTransformer(model, OffloadConfig.layerwise(progress=False, resident_layers=0), device="cpu")
    with pytest.raises(AdapterMergeUnsupportedError, match=r"merge stopped at this layer: the 1 adapter layer\(s\) "
                                                          r"merged before it \(x_embedder; .*load the originals back"):
        model.fuse_lora()
    assert [layer for layer in tuner_layers(model) if layer.merged_adapters] == [model.x_embedder]


def test_lora_with_automatic_placement_matches_the_resident_model(tmp_path):
    """resident_layers="auto" (a device budget on the CPU): the planner promotes blocks after the
    first step; LoRA calls before and after it, fuse and unfuse on promoted and streamed blocks."""
    t = _twins(tmp_path, "flux", "wrapper", "none", True, resident_layers="auto", device_memory_budget_gb=1.0)
    t.check("first step (measured)")
    placed = t.handle.stats()["placement"]
    assert placed["resident_blocks"], placed  # the budget holds blocks: some were promoted
    lc.short_sequence(t)


def _rank_lora(rank, world):
    """One rank of DLO AllGather: a LoRA loaded before offloading runs (switching, weights, disable),
    bit-exact against its resident twin; calls that read a base weight whole (a load after
    offloading, a fuse) are refused by name and change nothing."""
    import tempfile
    from pathlib import Path

    from weightstream.offload.dlo.topology import ParallelConfig
    from weightstream.offload.misuse import ShardedWeightError

    t = lc.Twins("flux", "wrapper", "none", Path(tempfile.mkdtemp()), before=True, small=True,
                 parallel=ParallelConfig(dp=world))
    stats = t.handle.stats()
    t.check("loaded before offloading")
    refused = []
    for call, args, kw in (("load_lora_weights", (str(t.files[1]),), {"adapter_name": "b"}), ("fuse_lora", (), {})):
        try:
            getattr(t.pipe, call)(*args, **kw)
        except ShardedWeightError:
            refused.append(call)
    t.both("set_adapters", "a", adapter_weights=[0.6])
    t.check("set_adapters with a weight")
    t.both("disable_lora")
    t.check("disable_lora")
    return {"transfer": stats["transfer"], "shard_group_size": stats["shard_group_size"], "refused": refused}


def scenario_dlo_lora(rank, world):
    from test_distributed import Checks

    c = Checks()
    c.run("lora", _rank_lora, rank, world)
    return c.report


def test_lora_over_dlo_allgather_on_two_ranks_matches_the_resident_model(tmp_path):
    from test_distributed import get, run_ranks

    for r in get(run_ranks(2, tmp_path, "test_lora:scenario_dlo_lora"), "lora"):
        assert r == {"transfer": "allgather", "shard_group_size": 2, "refused": ["load_lora_weights", "fuse_lora"]}, r
