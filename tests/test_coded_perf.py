"""perf plumbing of the coded modes (layerwise-coded, graphs-coded): mode table, fill, floor, tiny run."""
import json

import pytest
import torch

from perf.harness import run
from perf.modes import _streamed_bytes, coded_figures, parse_mode
from perf.results import summarise, validate_result
from perf.scenarios import build_model, get_scenario


def test_coded_modes_parse():
    flux = get_scenario("flux-12b-1024")[0]
    lw = parse_mode("layerwise-coded", flux)
    assert lw.config_kw == {"weight_codec": "exp-k"} and lw.weight_fill == "student-t"
    g = parse_mode("graphs-coded", flux)
    assert g.config_kw == {"cuda_graphs": "on", "weight_codec": "exp-k"} and g.weight_fill == "student-t"
    assert parse_mode("layerwise-r2-coded", flux).config_kw == {"resident_layers": 2, "weight_codec": "exp-k"}
    assert parse_mode("layerwise", flux).weight_fill == "normal"  # uncoded modes keep their fill
    assert parse_mode("graphs", flux).weight_fill == "normal"
    with pytest.raises(ValueError, match="mmap source"):
        parse_mode("layerwise-mmap-coded", flux)
    with pytest.raises(ValueError, match="coded"):
        parse_mode("layerwise-zip", flux)


def test_coded_floor_counts_raw_bytes():
    spec = parse_mode("layerwise-coded")
    stats = {"streamed_bytes_per_step": 700, "raw_bytes": 1000, "coded_bytes": 690, "bits_per_weight": 11.1}
    assert _streamed_bytes(spec, stats) == 1000
    assert _streamed_bytes(parse_mode("layerwise"), stats) == 700
    assert coded_figures(stats) == {"coded_bytes": 690, "bits_per_weight": 11.1}
    assert coded_figures({"streamed_bytes_per_step": 1}) == {}
    with pytest.raises(RuntimeError, match="weight_codec did not reach a coded source"):
        _streamed_bytes(spec, {"streamed_bytes_per_step": 700})
    out = summarise({"resident": {"step_ms": 100.0},
                     "layerwise-coded": {"step_ms": 140.0, "streamed_bytes": 11e9}}, h2d_gbps=55.0)
    assert out["layerwise-coded"]["floor_ms"] == pytest.approx(200.0)
    assert out["layerwise-coded"]["ratio_to_floor"] == pytest.approx(0.7)  # below the uncoded floor


def test_student_t_fill_is_heavy_tailed_and_deterministic():
    sc = get_scenario("flux-12b-1024")[0]
    a = build_model(sc, tiny=True, weight_fill="student-t", gen_device="cpu")
    b = build_model(sc, tiny=True, weight_fill="student-t", gen_device="cpu")
    n = build_model(sc, tiny=True, gen_device="cpu")
    wa = a.transformer_blocks[0].ff.net[0].proj.weight.float().flatten()
    wn = n.transformer_blocks[0].ff.net[0].proj.weight.float().flatten()
    assert torch.equal(wa, b.transformer_blocks[0].ff.net[0].proj.weight.float().flatten())
    assert wa.std() == pytest.approx(0.02, rel=0.15) and wn.std() == pytest.approx(0.02, rel=0.15)
    kurt = lambda w: float(((w - w.mean()) ** 4).mean() / w.var() ** 2)  # noqa: E731
    assert kurt(wa) > 4.0 > kurt(wn)  # Student-t df=4 tails vs the normal fill's ~3
    assert not a.transformer_blocks[0].ff.net[0].proj.bias.any()  # biases stay zero
    with pytest.raises(ValueError, match="weight_fill='laplace' is not allowed"):
        build_model(sc, tiny=True, weight_fill="laplace")


def test_harness_coded_tiny_cpu(tmp_path):
    """resident and layerwise-coded in fresh workers: the coded mode carries coded_bytes,
    bits_per_weight, a floor from the RAW bytes, and no output comparison with resident
    (other weights)."""
    result, path, ok = run("flux-12b-1024", ["resident", "layerwise-coded"], steps=2, warmup=1,
                           out_dir=tmp_path, tiny=True, device="cpu", touch_gb=0, mode_timeout=300)
    assert ok, result and result.get("failed")
    on_disk = json.loads(path.read_text())
    validate_result(on_disk)
    f = on_disk["modes"]["layerwise-coded"]
    assert f["coded_bytes"] > 0 and f["bits_per_weight"] > 0
    assert f["stats"]["source"].startswith("coded")
    assert f["stats"]["raw_bytes"] == f["stats"]["streamed_bytes_per_step"]
    assert f["streamed_gb"] == pytest.approx(f["stats"]["raw_bytes"] / 1e9, abs=1e-4)
    assert "output_equals_resident" not in f and f["output_finite"]
    assert f["ratio_to_floor"] == pytest.approx(f["step_ms"] / f["floor_ms"], rel=1e-3)
    assert "ratio_to_resident" in f
