"""LoRA fuses under CUDA graphs with coded weights, the logic on the CPU: the graph policy drops
its graphs when the adapters' state changes (pure, graphs/policy.py), and a fuse that re-encodes
coded blocks larger than the captured copies applies whole (every write of the fuse goes in),
leaves the captures stale for replays only (eager steps are served, bit-exact), and dropping
the graphs clears the staleness so the next steps capture again. The same on the device with
real captures: tests/test_lora_gpu.py (test_lora_fuse_growing_coded_blocks_under_cuda_graphs)."""
import copy

import pytest
import torch

pytest.importorskip("peft")

from weightstream.graphs.policy import Action, GraphPolicy  # noqa: E402


def test_policy_drops_graphs_when_the_adapter_state_changes():
    p = GraphPolicy()
    assert not p.adapters_changed(("a",))  # first state seen: nothing to drop
    assert p.decide("sig", 0) is Action.EAGER_WARMUP
    p.warmed_up("sig")
    assert p.decide("sig", 0) is Action.CAPTURE
    p.captured("sig", 0)
    assert p.decide("sig", 0) is Action.REPLAY
    assert not p.adapters_changed(("a",))  # the same state: replay on
    assert p.adapters_changed(("a", "merged"))  # a fuse: the caller drops the graphs
    p.clear()
    assert p.decide("sig", 0) is Action.EAGER_WARMUP  # warm up and capture again
    assert not p.adapters_changed(("a", "merged")) and p.adapter_state == ("a", "merged")
    assert not GraphPolicy().adapters_changed(("x",))


def growing_lora_model():
    """A Flux of two blocks of ~1 MB (bf16) with a rank-1 LoRA on the feed-forward inputs whose A
    spans 2^-30..2^30 (log-uniform): fused, those weights' exponents are nearly incompressible and
    their exp-k code grows past the copy slack of a captured graph (offload/host/encode.py _slack)."""
    from peft import LoraConfig

    from weightstream.models import flux_inputs, tiny_flux

    model = tiny_flux(dtype=torch.bfloat16, num_layers=1, num_single_layers=1, attention_head_dim=64,
                      num_attention_heads=2, axes_dims_rope=(16, 24, 24), joint_attention_dim=64)
    model.add_adapter(LoraConfig(r=1, lora_alpha=1, target_modules=["proj_mlp", "ff.net.0.proj"]), adapter_name="g")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, w in sorted(model.named_parameters()):
            if "lora_A" in name:
                w.copy_(torch.randn(w.shape, generator=g).sign() * 2.0 ** (torch.rand(w.shape, generator=g) * 60 - 30))
            elif "lora_B" in name:
                w.copy_(torch.randn(w.shape, generator=g))
    return model, flux_inputs(model, image_tokens=4, text_tokens=4)


def test_a_fuse_that_grows_coded_blocks_applies_whole_and_dropping_the_graphs_clears_staleness():
    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.offload.adapters import tuner_layers
    from weightstream.offload.codecs import CodedCaptureStaleError

    model, x = growing_lora_model()
    ref = copy.deepcopy(model)
    om = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False, weight_codec="exp-k"), device="cpu")
    with torch.no_grad():
        assert torch.equal(om(**x)[0], ref(**x)[0])
    src = om._streamed.source
    before = list(src.images.copy_bytes)
    src.stage.note_load(1)  # what a load inside a capture (tag 1) records: graphs copy these sizes now
    for m in (ref, model):
        m.fuse_lora()
    assert all(a > b for a, b in zip(src.images.copy_bytes, before)), (src.images.copy_bytes, before)
    assert all(layer.merged_adapters == ["g"] for layer in tuner_layers(model))  # every layer fused
    with pytest.raises(CodedCaptureStaleError, match="captured CUDA graphs"):
        om.executor.check_replay()  # a replay of the old graphs is refused
    with torch.no_grad():
        assert torch.equal(om(**x)[0], ref(**x)[0])  # an eager step copies the new sizes
    om.executor.captures_dropped()  # the graph runner's drop on the adapter change
    om.executor.check_replay()
    sd, want = om.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], want[k]) for k in want)
