"""Nothing lost through state_dict / save_pretrained on a CUDA device (pytest -m gpu).

Streamed weights live in pinned host images, the rest on the device: saving
must write the real weights of both, and loading them back must give the same
outputs (torch.equal) as the resident model on the device.
"""
from __future__ import annotations

import copy

import pytest

from isolated import run_in_process
import torch

from test_trust_save import (
    MODELS,
    _aligned,
    _loadable,
    _no_empty_tensors,
    _pipeline,
    first,
    layer_cfg,
    module_cfg,
)
from weightstream import OffloadedTransformer, offload_pipeline

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _to(x: dict, dev=DEV) -> dict:
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in x.items()}


def _cuda_case(name, dtype):
    make, inputs = MODELS[name]
    model = make(dtype=dtype)
    ref = copy.deepcopy(model).to(DEV)
    x = _to(inputs(model))  # the input builders follow the model's dtype
    with torch.no_grad():
        expected = first(ref(**x))
    return model, ref, x, expected


def _reloaded(model_cls, folder, dtype):
    return _aligned(_loadable(model_cls).from_pretrained(str(folder), torch_dtype=dtype).eval()).to(DEV)


@pytest.mark.parametrize("name,dtype", [("flux", torch.bfloat16), ("flux", torch.float32), ("wan", torch.float32),
                                        ("sd3", torch.float32)])
def test_layer_mode_save_pretrained_on_cuda(name, dtype, tmp_path):
    model, ref, x, expected = _cuda_case(name, dtype)
    wrapped = OffloadedTransformer(model, layer_cfg(), device=DEV)
    assert wrapped.stats()["pinned"]
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), expected)
    sd = model.state_dict()
    _no_empty_tensors(sd)
    assert any(v.device.type == "cpu" and v.is_pinned() for v in sd.values())  # host views of the pinned store
    wrapped.save_pretrained(str(tmp_path / "saved"))
    with torch.no_grad():
        assert torch.equal(first(_reloaded(type(model), tmp_path / "saved", dtype)(**x)), expected)
        assert torch.equal(first(wrapped(**x)), expected)


@pytest.mark.parametrize("mode", ["module", "layer"])
def test_pipeline_round_trip_on_cuda(mode, tmp_path):
    pipe, ids, kw = _pipeline()
    ids, kw = ids.to(DEV), _to(kw)
    ref = copy.deepcopy(pipe).to(DEV)
    expected = ref(ids, kw)
    config = (module_cfg(["dit", "text_encoder", "vae"]) if mode == "module"
              else {"mode": "layer", "components": ["dit", "text_encoder"], "progress": False})
    handle = offload_pipeline(pipe, config, device=DEV)
    assert torch.equal(pipe(ids, kw), expected)
    if mode == "module":
        handle.offload_all()
    pipe.save_pretrained(str(tmp_path / "saved"))
    loaded = type(pipe).from_pretrained(str(tmp_path / "saved"))
    for n in ("transformer", "text_encoder", "vae"):
        _aligned(getattr(loaded, n))
    loaded.to(DEV)
    assert torch.equal(loaded(ids, kw), expected)
    assert torch.equal(pipe(ids, kw), expected)
    handle.disable()
    assert torch.equal(pipe(ids, kw), expected)


def test_module_mode_interrupt_recovers_on_cuda():
    from weightstream.demo_module import DeclaredToyPipeline, toy_pipeline_inputs

    pipe = DeclaredToyPipeline()  # declares time_embed resident: the pipeline's execution device is CUDA
    inputs = toy_pipeline_inputs()
    expected = copy.deepcopy(pipe).to(DEV)(**inputs)

    def boom(module, args, output):
        raise KeyboardInterrupt

    handle = offload_pipeline(pipe, module_cfg(["dit", "text_encoder"]), device=DEV)
    h = pipe.transformer.blocks[1].register_forward_hook(boom)
    with pytest.raises(KeyboardInterrupt):
        pipe(**inputs)
    h.remove()
    assert torch.equal(pipe(**inputs), expected)
    handle.disable()
    assert torch.equal(pipe(**inputs), expected)


# -- CUDA graphs: the graph runner intercepts the call; saving goes through the module's hook


def case_graphs_wrapper_save(folder):
    import torch

    from layerwise_cases import build, first, stream_config
    from test_trust_save import _aligned, _loadable
    from weightstream import OffloadedTransformer

    model, ref, x = build("flux", "cuda", torch.bfloat16)
    w = OffloadedTransformer(model, stream_config(cuda_graphs="on", progress=False), device="cuda")
    with torch.no_grad():
        expected = first(ref(**x))
        outs = [first(w(**x)) for _ in range(4)]  # warm-up, capture, replays
    assert all(torch.equal(o, expected) for o in outs)
    assert w.graphs.counts["replay"] >= 1, w.graphs.counts
    w.save_pretrained(folder)
    loaded = _aligned(_loadable(type(model)).from_pretrained(folder, torch_dtype=torch.bfloat16).eval()).to("cuda")
    with torch.no_grad():
        assert torch.equal(first(loaded(**x)), expected)
        assert torch.equal(first(w(**x)), expected)  # a replay after saving


def test_graphs_wrapper_save_pretrained(tmp_path):
    run_in_process("test_trust_save_gpu", f"case_graphs_wrapper_save({str(tmp_path / 'saved')!r})")
