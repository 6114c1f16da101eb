"""In-place mode with CUDA graphs on the device (pytest -m gpu): the handle's
instance-level forward override routes calls of the module itself through the
GraphRunner. Each case runs in its own process (graph capture)."""

import pytest

from isolated import run_in_process

pytestmark = pytest.mark.gpu


def run_isolated(name: str):
    return run_in_process("test_inplace_gpu", f"{name}()", what=name)


# -- bodies (run in a fresh process each) -------------------------------------------------

def _flux(resident=0):
    import copy

    import torch

    from weightstream.models import flux_inputs, tiny_flux

    model = tiny_flux(dtype=torch.bfloat16)
    ref = copy.deepcopy(model).cuda()
    x = flux_inputs(model, device="cuda")
    with torch.no_grad():
        expected = ref(**x)[0]
    return torch, model, x, expected


def case_inplace_graphs(resident=0):
    from diffusers import FluxTransformer2DModel

    from weightstream import apply_layerwise_offload
    from layerwise_cases import stream_config
    from weightstream.offload.transformer import GraphForward

    torch, model, x, expected = _flux()
    cfg = stream_config(cuda_graphs="on", resident_layers=resident, progress=False)
    handle = apply_layerwise_offload(model, cfg, device="cuda")
    assert type(model) is FluxTransformer2DModel
    assert isinstance(model.__dict__.get("forward"), GraphForward) and "GraphForward" in repr(handle)
    with torch.no_grad():
        outs = [model(**x)[0] for _ in range(6)]  # warm-up, capture(s), replays
    assert all(torch.equal(o, expected) for o in outs), [float((o.float() - expected.float()).abs().max()) for o in outs]
    c = handle.graphs.counts
    assert c["capture"] >= 1 and c["replay"] >= 3, c
    assert handle.executor.position == 6 * handle.executor.schedule.n  # every call one step, none doubled
    assert handle.remove() is model and "forward" not in model.__dict__
    with torch.no_grad():
        assert torch.equal(model(**x)[0], expected)
    print("counts", c)


def case_inplace_graphs_resident():
    case_inplace_graphs(resident=2)


def case_pipeline_graphs_keeps_module_and_saves():
    import tempfile

    from diffusers import DiffusionPipeline, FluxTransformer2DModel

    from weightstream import offload_pipeline
    from layerwise_cases import stream_config

    class TinyPipe(DiffusionPipeline):
        def __init__(self, transformer):
            super().__init__()
            self.register_modules(transformer=transformer)

    torch, model, x, expected = _flux()
    pipe = TinyPipe(model)
    handle = offload_pipeline(pipe, stream_config(cuda_graphs="on", progress=False), device="cuda")
    assert pipe.transformer is model
    with torch.no_grad():
        outs = [pipe.transformer(**x)[0] for _ in range(5)]
    assert all(torch.equal(o, expected) for o in outs)
    assert handle.wrapped["transformer"].graphs.counts["replay"] >= 2
    with tempfile.TemporaryDirectory() as d:
        pipe.save_pretrained(d)
        back = FluxTransformer2DModel.from_pretrained(  # saved in the model's dtype; loads default to fp32
            d, subfolder="transformer", torch_dtype=x["hidden_states"].dtype).cuda().eval()
        with torch.no_grad():
            assert torch.equal(back(**x)[0], expected)
    handle.disable()
    assert pipe.transformer is model and "forward" not in model.__dict__


def case_pipeline_to_the_device_is_a_no_op_and_casts_are_refused():
    """pipe.to("cuda") after offload_pipeline on CUDA (layer mode, module mode, apply_layerwise_offload):
    a no-op, the next generation bit-exact; a cast or a move to the CPU: UnsupportedOperationError."""
    from diffusers import DiffusionPipeline

    from weightstream import OffloadConfig, UnsupportedOperationError, apply_layerwise_offload, offload_pipeline

    class TinyPipe(DiffusionPipeline):
        def __init__(self, transformer):
            super().__init__()
            self.register_modules(transformer=transformer)

    for entry in ("layer", "module", "in place"):
        torch, model, x, expected = _flux()
        pipe = TinyPipe(model)
        if entry == "in place":
            handle = apply_layerwise_offload(model, OffloadConfig.layerwise(progress=False), device="cuda")
        else:
            handle = offload_pipeline(pipe, {"mode": entry, "components": ["dit"], "progress": False}, device="cuda")
        assert pipe.to("cuda") is pipe and model.to("cuda:0") is model and model.to(torch.bfloat16) is model
        with torch.no_grad():
            assert torch.equal(pipe.transformer(**x)[0], expected), entry
        for call in (lambda: pipe.to(torch.float16), lambda: model.to("cpu"), lambda: model.float()):
            try:
                call()
            except UnsupportedOperationError as e:
                assert "is not supported" in str(e) and "no-op" in str(e), e
            else:
                raise AssertionError(f"{entry}: a cast or move was accepted")
        with torch.no_grad():
            assert torch.equal(pipe.transformer(**x)[0], expected), entry
        handle.remove() if entry == "in place" else handle.disable()
        assert "to" not in model.__dict__ and "_apply" not in model.__dict__
        assert model.to(torch.float16) is model  # a plain module again


# -- tests ---------------------------------------------------------------------------------

def test_inplace_graphs():
    run_isolated("case_inplace_graphs")


def test_inplace_graphs_resident():
    run_isolated("case_inplace_graphs_resident")


def test_pipeline_graphs_keeps_module_and_saves():
    run_isolated("case_pipeline_graphs_keeps_module_and_saves")


def test_pipeline_to_the_device_is_a_no_op_and_casts_are_refused():
    run_isolated("case_pipeline_to_the_device_is_a_no_op_and_casts_are_refused")
