"""perf/ LoRA modes (issue 36) on the CPU: `-lora<R>` / `-lora<R>fused` variants and their
`resident-lora<R>[fused]` yardsticks parse, the floor of a LoRA mode is max(resident + LoRA,
streamed bytes / H2D) with `ratio_to_resident_lora` beside it, and the tiny flux scenario run
in-process through perf.modes.prepare gives the resident + LoRA output bit for bit, unfused and
fused, with the adapter's bytes and the base weights' streamed bytes in the figures. The
harness end to end (fresh workers) is `python -m perf run --scenario flux-12b-1024 --tiny
--device cpu --modes layerwise-lora64,layerwise-lora64fused`."""

import pytest
import torch

pytest.importorskip("peft")


from perf.harness import _yardstick  # noqa: E402  (the checkout root is on sys.path: conftest.py)
from perf.modes import LORA_TARGETS, parse_mode, prepare  # noqa: E402
from perf.results import is_offloaded, lora_yardstick, summarise, validate_mode_name  # noqa: E402
from perf.scenarios import build_inputs, build_model, first_output, get_scenario  # noqa: E402


def test_lora_modes_parse_and_name_their_yardstick():
    flux, _ = get_scenario("flux-12b-1024")
    lw = parse_mode("layerwise-lora64", flux)
    assert (lw.kind, lw.lora_rank, lw.lora_fused, lw.config_kw) == ("weightstream", 64, False, {})
    g = parse_mode("graphs-lora64fused", flux)
    assert (g.lora_rank, g.lora_fused, g.config_kw) == (64, True, {"cuda_graphs": "on"})
    assert parse_mode("layerwise-r4-lora16", flux).config_kw == {"resident_layers": 4}
    res = parse_mode("resident-lora64fused", flux)
    assert (res.kind, res.lora, res.builds_on_device) == ("resident", "lora64fused", True)
    for mode, want in (("layerwise-lora64", "resident-lora64"), ("graphs-r2-lora64fused", "resident-lora64fused"),
                       ("resident-lora64", None), ("layerwise", None)):
        assert lora_yardstick(mode) == want, mode
    assert not is_offloaded("resident-lora64") and not is_offloaded("resident-lora8fused")
    assert is_offloaded("layerwise-lora64")
    assert _yardstick("layerwise-lora64") == "resident-lora64" and _yardstick("resident-lora64") == "resident-lora64"
    assert _yardstick("layerwise-coded-lora64") is None  # other weights (Student-t): no bit-exact yardstick
    validate_mode_name("resident-lora64")
    with pytest.raises(ValueError, match="one lora variant at most"):
        parse_mode("layerwise-lora64-lora8", flux)
    with pytest.raises(ValueError, match="needs the blocks in host memory"):
        parse_mode("layerwise-mmap-lora64", flux)
    with pytest.raises(ValueError, match="not one of the allowed forms"):
        parse_mode("resident-lora0", flux)


def test_lora_floor_is_resident_plus_lora_or_the_transfer_term():
    raw = {
        "resident": {"step_ms": 400.0},
        "resident-lora64": {"step_ms": 430.0},
        "resident-lora64fused": {"step_ms": 401.0},
        "layerwise-lora64": {"step_ms": 440.0, "streamed_bytes": 20.0e9},     # 20 GB / 55 GB/s = 363.6 ms
        "layerwise-lora64fused": {"step_ms": 410.0, "streamed_bytes": 20.0e9},
        "graphs-lora64": {"step_ms": 700.0, "streamed_bytes": 30.0e9},        # 545.5 ms: transfer bound
        "layerwise": {"step_ms": 405.0, "streamed_bytes": 20.0e9},
    }
    out = summarise(raw, h2d_gbps=55.0)
    lw = out["layerwise-lora64"]
    assert lw["floor_ms"] == 430.0 and lw["ratio_to_resident_lora"] == pytest.approx(440 / 430, rel=1e-4)
    assert lw["ratio_to_floor"] == pytest.approx(440 / 430, rel=1e-4)
    assert lw["ratio_to_resident"] == pytest.approx(440 / 400, rel=1e-4)  # against the plain resident step
    fused = out["layerwise-lora64fused"]
    assert fused["floor_ms"] == 401.0 and fused["ratio_to_resident_lora"] == pytest.approx(410 / 401, rel=1e-4)
    assert out["graphs-lora64"]["floor_ms"] == pytest.approx(30e9 / 55e9 * 1e3, abs=1e-3)
    assert "ratio_to_resident_lora" not in out["layerwise"] and out["layerwise"]["floor_ms"] == 400.0
    assert "floor_ms" not in out["resident-lora64"]
    # without the LoRA yardstick in the run, the plain resident step is the compute term
    alone = summarise({"resident": {"step_ms": 400.0}, "layerwise-lora64": {"step_ms": 440.0, "streamed_bytes": 1e9}},
                      h2d_gbps=55.0)["layerwise-lora64"]
    assert alone["floor_ms"] == 400.0 and "ratio_to_resident_lora" not in alone


@pytest.fixture(scope="module")
def tiny_flux():
    sc, _ = get_scenario("flux-12b-1024")
    return sc, build_inputs(sc, "cpu", tiny=True)


def _step(mode: str, sc, inputs):
    spec = parse_mode(mode, sc)
    model = build_model(sc, tiny=True, device="cpu", gen_device="cpu")
    prepared = prepare(spec, model, sc, torch.device("cpu"))
    with torch.no_grad():
        y = first_output(prepared.module(**inputs)).clone()
    if prepared.refresh is not None:
        prepared.refresh()
    return y, prepared


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_lora_modes_match_the_resident_lora_model(tiny_flux, fused):
    from weightstream.offload.adapters import tuner_layers

    sc, inputs = tiny_flux
    v = "lora64fused" if fused else "lora64"
    plain, _ = _step("resident", sc, inputs)
    want, res = _step(f"resident-{v}", sc, inputs)
    got, lw = _step(f"layerwise-{v}", sc, inputs)
    assert torch.equal(got, want) and not torch.equal(want, plain)  # the LoRA is not a no-op
    notes = lw.notes["lora"]
    assert notes == res.notes["lora"] and notes["rank"] == 64 and notes["fused"] is fused
    assert notes["targets"] == list(LORA_TARGETS) and notes["adapter_bytes"] > 0
    assert lw.stats["adapter_bytes"] == notes["adapter_bytes"] and lw.stats["adapters_placed"] == 0
    layers = tuner_layers(lw.module.module)
    assert layers and all(bool(layer.merged_adapters) is fused for layer in layers)
    _, base = _step("layerwise", sc, inputs)
    assert lw.streamed_bytes == base.streamed_bytes  # adapters stay resident: the base weights stream
