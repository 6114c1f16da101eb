"""The planned default on CUDA (issue 38; run on the device machine: pytest -m gpu).

``OffloadConfig.layerwise()`` with no arguments plans the residency and the coding from the first
step within the free device memory less the headroom (capped by ``device_memory_budget_gb``);
outputs equal the resident model's bit for bit before, during and after the plan. The CUDA-graph
case runs in its own process (STYLE.md).
"""
import copy
import time

import pytest

from isolated import run_in_process
import torch

from layerwise_cases import build, first
from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import ToyDiT, toy_inputs

pytestmark = pytest.mark.gpu
DEV = "cuda"


def run_isolated(name: str):
    return run_in_process("test_default_config_gpu", f"{name}()", what=name)


def _settle(wrapped, x, want, timeout_s: float = 120.0) -> int:
    """Steps (each bit-exact) until the planned coding finished; their count."""
    steps, t0 = 0, time.monotonic()
    while wrapped.stats().get("coding_in_background") is not None:
        assert time.monotonic() - t0 < timeout_s, wrapped.stats()["coding_in_background"]
        with torch.no_grad():
            assert torch.equal(first(wrapped(**x)), want)
        steps += 1
    return steps


@pytest.mark.parametrize("name", ["flux", "wan", "toy"])
def test_the_default_plans_within_free_memory_bit_exact(name):
    dtype = torch.float32 if name == "toy" else torch.bfloat16
    model, ref, x = build(name, DEV, dtype)
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device=DEV)
    assert wrapped._streamed.selection.planned == ("resident_layers", "weight_codec")
    with torch.no_grad():
        want = first(ref(**x))
        assert all(torch.equal(first(wrapped(**x)), want) for _ in range(3))
    _settle(wrapped, x, want)
    with torch.no_grad():
        assert all(torch.equal(first(wrapped(**x)), want) for _ in range(2))
    s = wrapped.stats()
    plan, n = s["plan"], s["blocks_streamed"] + s["blocks_resident"]
    assert plan["default"] and "headroom" in plan["budget_from"]
    free, total = torch.cuda.mem_get_info()
    assert 0 < plan["budget_bytes"] < total
    assert len(plan["resident_blocks"]) == n - 1  # a tiny model fits: all but one block stays resident
    assert s["placement"]["device_bytes"] <= plan["budget_bytes"]
    sd = wrapped.state_dict()
    assert all(torch.equal(sd[k].to(DEV), v) for k, v in ref.state_dict().items())


def test_a_device_budget_caps_the_default():
    model, ref, x = build("flux", DEV, torch.bfloat16)
    probe = OffloadedTransformer(copy.deepcopy(model), OffloadConfig.layerwise(
        resident_layers=0, weight_codec="none", progress=False), device=DEV)
    sizes, fixed = [lay.nbytes for lay in probe.executor.source.layouts], probe.stats()["resident_bytes"]
    probe.disable()
    cap = fixed + 2 * max(sizes) + sum(sizes) // 2
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(device_memory_budget_gb=cap / 1e9, progress=False),
                                   device=DEV)
    with torch.no_grad():
        want = first(ref(**x))
        assert all(torch.equal(first(wrapped(**x)), want) for _ in range(3))
    _settle(wrapped, x, want)
    s = wrapped.stats()
    assert s["plan"]["budget_bytes"] == cap and s["plan"]["budget_from"] == "device_memory_budget_gb"
    assert 0 < len(s["plan"]["resident_blocks"]) < len(sizes)
    assert s["placement"]["device_bytes"] <= cap


def test_the_plan_is_printed_once_on_cuda(capsys):
    torch.manual_seed(0)
    model = ToyDiT()
    ref = copy.deepcopy(model).to(DEV)
    x = toy_inputs(device=DEV)
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(), device=DEV)
    with torch.no_grad():
        want = ref(**x)
        for _ in range(4):
            assert torch.equal(wrapped(**x), want)
    _settle(wrapped, x, want)
    err = capsys.readouterr().err
    assert sum(ln.startswith("weightstream plan: ") for ln in err.splitlines()) == 1, err
    assert "auto placement:" not in err and "auto codec:" not in err


def test_the_mmap_source_streams_raw_by_default(tmp_path):
    from test_mmap_source_gpu import _run

    wrapped, _ = _run("flux", tmp_path)  # OffloadConfig.layerwise() by default
    s = wrapped.stats()
    assert "plan" not in s and s["blocks_resident"] == 0 and s["direct_blocks"] == s["blocks_streamed"]


def case_graphs_default_plans_the_codec_only():
    model, ref, x = build("flux", DEV, torch.bfloat16)
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(cuda_graphs="on", progress=False), device=DEV)
    assert wrapped._streamed.selection.planned == ("weight_codec",)  # no auto placement under graphs
    with torch.no_grad():
        want = first(ref(**x))
        assert all(torch.equal(first(wrapped(**x)), want) for _ in range(3))
    _settle(wrapped, x, want)
    with torch.no_grad():
        assert all(torch.equal(first(wrapped(**x)), want) for _ in range(4))
    s = wrapped.stats()
    assert s["plan"]["resident_blocks"] == [] and "placement" not in s and "codec_plan" in s


def test_graphs_default_plans_the_codec_only():
    run_isolated("case_graphs_default_plans_the_codec_only")
