"""weight_codec='exp-k' (and 'exp-k2': the *_k2 cases, 'exp-kp': the *_kp ones) on the device: H2D of coded bytes + Triton
decode on the copy stream, bit-exact against the resident model, CUDA graphs off and on (the
decode captured inside the step's graph), each case in its own process (pytest -m gpu)."""

import pytest

from isolated import run_in_process

pytestmark = pytest.mark.gpu


def run_isolated(name: str):
    return run_in_process("test_coded_source_gpu", f"{name}()", what=name)


# -- bodies (run in a fresh process each) -------------------------------------------------

def _student_t(model, torch):
    """Heavy-tailed bf16 weights (what the codec is for) in every 2-D weight."""
    from weightstream.fills import fill

    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and p.dtype == torch.bfloat16:
                p.copy_(fill("student-t", p.shape, dtype=p.dtype, generator=g, scale=0.02))
    return model


def _setup(name="flux", graphs="off", big=False, codec="exp-k", **cfg):
    import copy

    import torch

    from layerwise_cases import MODELS, first, stream_config
    from weightstream import OffloadedTransformer

    make, inputs = MODELS[name]
    over = {}
    if big and name == "flux":  # ~9 MB of weights: headers and tile padding no longer count
        over = dict(attention_head_dim=64, num_attention_heads=4, axes_dims_rope=(16, 24, 24))
    model = _student_t(make(dtype=torch.bfloat16, **over), torch)
    ref = copy.deepcopy(model).to("cuda")
    x = inputs(model, device="cuda")
    w = OffloadedTransformer(model, stream_config(cuda_graphs=graphs, weight_codec=codec, **cfg),
                             device="cuda")
    if codec in ("exp-k2", "exp-kp"):  # version-2 / -3 tensors really stream (tiny ones may stay version 1)
        want = 2 if codec == "exp-k2" else 3
        assert any(seg.header.version == want for t in w.executor.source.tables for seg in t.segments)
    return torch, first, w, ref, x


def _check(torch, first, w, ref, x, steps=5):
    with torch.no_grad():
        expected = first(ref(**x))
        outs = [first(w(**x)) for _ in range(steps)]
    diffs = [float((o.float() - expected.float()).abs().max()) for o in outs]
    assert all(torch.equal(o, expected) for o in outs), diffs
    s = w.stats()
    assert str(s["source"]).startswith("coded") and s["pinned"], s
    return s


def case_eager_flux():
    torch, first, w, ref, x = _setup("flux")
    _check(torch, first, w, ref, x)


def case_eager_wan_resident():
    torch, first, w, ref, x = _setup("wan", resident_layers=1)
    _check(torch, first, w, ref, x)


def case_eager_big_flux_codes_below_raw(codec="exp-k"):
    torch, first, w, ref, x = _setup("flux", big=True, codec=codec)
    s = _check(torch, first, w, ref, x)
    assert s["h2d_bytes_per_step"] < 0.8 * s["raw_bytes"], s
    assert s["bits_per_weight"] < (11.5 if codec == "exp-k2" else 12.5), s
    return s


def case_eager_big_flux_k2_below_exp_k():
    one, two = case_eager_big_flux_codes_below_raw(), case_eager_big_flux_codes_below_raw("exp-k2")
    assert two["coded_bytes"] < one["coded_bytes"] and two["source"] == "coded-exp-k2", (one, two)


def case_eager_big_flux_kp_patched():
    """exp-kp: version-3 tensors (patch lists applied after each tile) stream bit-exact."""
    s = case_eager_big_flux_codes_below_raw("exp-kp")
    assert s["source"] == "coded-exp-kp", s


def case_graphs_wan_resident_kp():
    torch, first, w, ref, x = _setup("wan", graphs="on", resident_layers=1, codec="exp-kp")
    _check(torch, first, w, ref, x)
    assert w.graphs.counts["replay"] >= 2, w.graphs.counts


def case_graphs_decode_reads_current_weights_kp():
    case_graphs_decode_reads_current_weights("exp-kp")


def case_encode_on_device_same_bytes_kp():
    case_encode_on_device_same_bytes("exp-kp")


def case_eager_wan_resident_k2():
    torch, first, w, ref, x = _setup("wan", resident_layers=1, codec="exp-k2")
    _check(torch, first, w, ref, x)


def case_graphs_flux():
    torch, first, w, ref, x = _setup("flux", graphs="on")
    _check(torch, first, w, ref, x)
    c = w.graphs.counts
    assert c["capture"] >= 1 and c["replay"] >= 2, c


def case_graphs_wan_resident():
    torch, first, w, ref, x = _setup("wan", graphs="on", resident_layers=1)
    _check(torch, first, w, ref, x)
    assert w.graphs.counts["replay"] >= 2, w.graphs.counts


def case_graphs_decode_reads_current_weights(codec="exp-k"):
    """After capture, update_weights and a state_dict() edit re-encode blocks in place: the
    replayed graphs (H2D of the coded bytes, decode with the in-place table) compute with
    the new weights, without a new capture."""
    torch, first, w, ref, x = _setup("flux", graphs="on", big=True, codec=codec)
    _check(torch, first, w, ref, x, steps=4)
    captures = w.graphs.counts["capture"]
    with torch.no_grad():
        new = {k: (v * 0.5 if v.is_floating_point() else v) for k, v in ref.state_dict().items()}
        ref.load_state_dict(new)
        w.update_weights(new)
        outs = [first(w(**x)) for _ in range(3)]
        expected = first(ref(**x))
        assert all(torch.equal(o, expected) for o in outs)
        key = "single_transformer_blocks.0.proj_out.weight"
        w.state_dict()[key].mul_(-1.0)
        ref.state_dict()[key].mul_(-1.0)
        outs = [first(w(**x)) for _ in range(3)]
        expected = first(ref(**x))
        assert all(torch.equal(o, expected) for o in outs)
    assert w.graphs.counts["capture"] == captures, w.graphs.counts
    plain = w.disable()
    with torch.no_grad():
        assert torch.equal(first(plain(**x)), expected)


def case_graphs_decode_reads_current_weights_k2():
    case_graphs_decode_reads_current_weights("exp-k2")


def case_encode_on_device_same_bytes_k2():
    case_encode_on_device_same_bytes("exp-k2")


def case_encode_on_device_same_bytes(codec="exp-k"):
    """CodedSource(encode_on="device"): blocks coded on the GPU store the CPU encoder's bytes,
    and the streamed model stays bit-exact."""
    import torch

    from test_coded_source import _blocks
    from weightstream.models import tiny_flux
    from weightstream.offload.sources.pinned import CodedSource

    model = _student_t(tiny_flux(dtype=torch.bfloat16), torch)
    tensors, layouts = _blocks(model)
    objs = lambda: [[t.detach().clone() for _, _, t in ts] for ts in tensors]  # noqa: E731
    cpu = CodedSource(layouts, objs(), device="cuda", pin=False, encode_on="cpu", codec=codec)
    gpu = CodedSource(layouts, objs(), device="cuda", pin=False, encode_on="device", codec=codec)
    assert (codec == "exp-k2") == any(seg.header.version == 2 for t in gpu.tables for seg in t.segments)
    assert (codec == "exp-kp") == any(seg.header.version == 3 for t in gpu.tables for seg in t.segments)
    for k in range(len(layouts)):
        n = cpu.coded[k]
        assert n == gpu.coded[k] and torch.equal(cpu.region(k)[:n], gpu.region(k)[:n]), layouts[k].name
        assert cpu.tables[k].segments == gpu.tables[k].segments
    cpu.close()
    gpu.close()


@pytest.mark.parametrize("name", [
    "case_eager_flux", "case_eager_wan_resident", "case_eager_big_flux_codes_below_raw", "case_graphs_flux",
    "case_graphs_wan_resident", "case_graphs_decode_reads_current_weights", "case_encode_on_device_same_bytes",
    "case_eager_big_flux_k2_below_exp_k", "case_eager_wan_resident_k2", "case_graphs_decode_reads_current_weights_k2",
    "case_encode_on_device_same_bytes_k2", "case_eager_big_flux_kp_patched", "case_graphs_wan_resident_kp",
    "case_graphs_decode_reads_current_weights_kp", "case_encode_on_device_same_bytes_kp",
])
def test_coded_gpu(name):
    run_isolated(name)
