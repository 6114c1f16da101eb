"""Layerwise offload on CUDA (run on the device machine: pytest -m gpu)."""
import pytest
import torch

from weightstream import OffloadedTransformer
from weightstream.models import flux_inputs, tiny_flux

from layerwise_cases import build, check_equal_outputs, first, stream_config

pytestmark = pytest.mark.gpu
DEV = "cuda"


# the toy DiT mixes dtypes itself: float32 only
@pytest.mark.parametrize("name,dtype", [(n, d) for n in ("flux", "wan") for d in (torch.float32, torch.bfloat16)]
                         + [("toy", torch.float32)])
def test_bit_exact_on_cuda(name, dtype):
    wrapped, _, _ = check_equal_outputs(name, DEV, dtype=dtype)
    assert wrapped.stats()["pinned"] is True


@pytest.mark.parametrize("resident_layers", [0, 2])
def test_resident_layers_and_slots_on_cuda(resident_layers):
    check_equal_outputs("flux", DEV, dtype=torch.bfloat16, resident_layers=resident_layers, num_slots=3)


def test_pageable_host_store():
    wrapped, _, _ = check_equal_outputs("toy", DEV, pin_memory=False)
    assert wrapped.stats()["pinned"] is False


def test_peak_weight_memory_is_resident_plus_two_blocks():
    """Weights on the device during a streamed forward <= resident modules + 2 x largest block."""
    torch.manual_seed(0)
    model = tiny_flux(num_layers=3, num_single_layers=5, attention_head_dim=64, num_attention_heads=4,
                      joint_attention_dim=64, axes_dims_rope=(16, 24, 24))
    x = flux_inputs(model, device=DEV, image_tokens=4, text_tokens=2)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    wrapped = OffloadedTransformer(model, stream_config(), device=DEV)
    s = wrapped.stats()
    largest = max(lay.nbytes for lay in wrapped.executor.source.store.layouts)
    with torch.no_grad():
        first(wrapped(**x))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    activations_allowance = 4 << 20  # tiny activations
    assert s["resident_bytes"] + 2 * largest + activations_allowance >= peak
    assert peak < total / 2, (peak, total)  # and far below the resident model


def test_events_show_copies_beside_compute():
    model, _, x = build("flux", DEV, torch.bfloat16)
    wrapped = OffloadedTransformer(model, stream_config(record_events=True), device=DEV)
    with torch.no_grad():
        for _ in range(2):
            wrapped(**x)
    ev = wrapped.events()
    compute = [e for e in ev if e["lane"] == "compute"]
    assert [e["block"] for e in compute] == list(range(5)) * 2
    for c in compute:  # the one copy that loaded this block for this step ended before its compute started
        loads = [e for e in ev if e["lane"] == "copy" and (e["step"], e["block"]) == (c["step"], c["block"])]
        assert len(loads) == 1 and loads[0]["end_ms"] <= c["start_ms"] + 1e-3, (c, loads)


def test_disable_and_state_dict_on_cuda():
    wrapped, ref, x = check_equal_outputs("toy", DEV)
    sd = wrapped.state_dict()
    assert all(torch.equal(sd[k].to(DEV), v) for k, v in ref.state_dict().items())
    plain = wrapped.disable()
    assert all(p.is_cuda and p.numel() > 0 for p in plain.parameters())
    with torch.no_grad():
        assert torch.equal(plain(**x), ref(**x))


def test_update_weights_on_cuda():
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, stream_config(), device=DEV)
    with torch.no_grad():
        wrapped(**x)
        new = {k: v * 0.25 for k, v in ref.state_dict().items()}
        ref.load_state_dict(new)
        wrapped.update_weights(new)
        assert torch.equal(wrapped(**x), ref(**x))
