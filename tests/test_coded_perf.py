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
    lw2, g2 = parse_mode("layerwise-coded2", flux), parse_mode("graphs-coded2", flux)  # the two-level code
    assert lw2.config_kw == {"weight_codec": "exp-k2"} and lw2.weight_fill == "student-t"
    assert g2.config_kw == {"cuda_graphs": "on", "weight_codec": "exp-k2"} and g2.weight_fill == "student-t"
    assert parse_mode("layerwise-mmap-coded2", flux).coded_sidecar == "write"
    assert parse_mode("layerwise", flux).weight_fill == "normal"  # uncoded modes keep their fill
    assert parse_mode("graphs", flux).weight_fill == "normal"
    m = parse_mode("layerwise-mmap-coded", flux)  # encodes the checkpoint, writes the sidecar
    assert (m.source, m.coded_sidecar, m.weight_fill) == ("mmap", "write", "normal")
    assert parse_mode("layerwise-mmap-coded-sidecar", flux).coded_sidecar == "read"
    with pytest.raises(ValueError, match="sidecar variant needs -mmap-coded"):
        parse_mode("layerwise-coded-sidecar", flux)
    assert parse_mode("layerwise-coded-encgpu", flux).encode_on == "device"
    assert parse_mode("layerwise-coded-enccpu", flux).encode_on == "cpu"
    assert parse_mode("layerwise-coded-encplace", flux).encode_on == "in-place"
    assert parse_mode("layerwise-coded", flux).encode_on is None  # where the product encodes (the GPU on CUDA)
    for bad in ("layerwise-encgpu", "layerwise-enccpu", "layerwise-encplace", "layerwise-mmap-coded-enccpu"):
        with pytest.raises(ValueError, match="encgpu / enccpu / encplace variants need -coded"):
            parse_mode(bad, flux)
    with pytest.raises(ValueError, match="coded"):
        parse_mode("layerwise-zip", flux)
    auto = parse_mode("graphs-codedauto", flux)  # weight_codec="auto": planned after the first step
    assert auto.config_kw == {"cuda_graphs": "on", "weight_codec": "auto"} and auto.weight_fill == "student-t"


def test_coded_floor_counts_raw_bytes():
    spec = parse_mode("layerwise-coded")
    stats = {"streamed_bytes_per_step": 700, "raw_bytes": 1000, "coded_bytes": 690, "bits_per_weight": 11.1}
    assert _streamed_bytes(spec, stats) == 1000
    assert _streamed_bytes(parse_mode("layerwise"), stats) == 700
    assert coded_figures(stats) == {"coded_bytes": 690, "bits_per_weight": 11.1}
    assert coded_figures({"streamed_bytes_per_step": 1}) == {}
    assert coded_figures({"sidecar_loaded": True, "sidecar_s_per_gb": 0.02, "sidecar_load_s": None}) == \
        {"sidecar_loaded": True, "sidecar_s_per_gb": 0.02}
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
    result, path, ok = run("flux-12b-1024", ["resident", "resident-tfill", "layerwise-coded", "layerwise-coded2",
                                             "layerwise-codedauto"],
                           steps=2, warmup=1, out_dir=tmp_path, tiny=True, device="cpu", touch_gb=0, mode_timeout=300)
    assert ok, result and result.get("failed")
    on_disk = json.loads(path.read_text())
    validate_result(on_disk)
    f2 = on_disk["modes"]["layerwise-coded2"]  # exp-k2: fewer coded bytes of the same weights, still exact
    assert f2["stats"]["source"] == "coded-exp-k2" and f2["output_equals_resident"] is True
    assert 0 < f2["coded_bytes"] < on_disk["modes"]["layerwise-coded"]["coded_bytes"]
    f = on_disk["modes"]["layerwise-coded"]
    assert f["coded_bytes"] > 0 and f["bits_per_weight"] > 0
    assert f["stats"]["source"].startswith("coded")
    assert f["stats"]["raw_bytes"] == f["stats"]["streamed_bytes_per_step"]
    assert f["streamed_gb"] == pytest.approx(f["stats"]["raw_bytes"] / 1e9, abs=1e-4)
    # compared with the resident model of the same (Student-t) weights, not with `resident`
    assert f["output_equals_resident"] is True and f["output_finite"]
    assert on_disk["modes"]["resident-tfill"]["output_sha1"] != on_disk["modes"]["resident"]["output_sha1"]
    assert f["ratio_to_floor"] == pytest.approx(f["step_ms"] / f["floor_ms"], rel=1e-3)
    assert "ratio_to_resident" in f
    a = on_disk["modes"]["layerwise-codedauto"]  # planned after the warm-up step, whatever it chose
    assert a["output_equals_resident"] is True and a["codec_plan"]["describe"]
    assert a["coded_blocks"] == len(a["codec_plan"]["coded_blocks"])
    assert a["streamed_gb"] == f["streamed_gb"]  # the floor counts the raw bytes, coded or not
    assert len(a["coding_step_ms_all"]) >= 1 and a["first_step_ms"] == a["coding_step_ms_all"][0]


def test_harness_mmap_coded_writes_then_loads_the_sidecar_tiny_cpu(tmp_path):
    """-mmap-coded encodes the checkpoint and writes the coded sidecar; -mmap-coded-sidecar loads
    it (coded_sidecar='read' fails without it); both equal the resident model bit for bit."""
    modes = ["resident", "layerwise-mmap-coded", "layerwise-mmap-coded-sidecar"]
    result, path, ok = run("flux-12b-1024", modes, steps=2, warmup=1, out_dir=tmp_path / "out", tiny=True,
                           device="cpu", touch_gb=0, mode_timeout=300, ckpt_dir=str(tmp_path / "ckpt"))
    assert ok, result and result.get("failed")
    m = json.loads(path.read_text())["modes"]
    wrote, read = m["layerwise-mmap-coded"], m["layerwise-mmap-coded-sidecar"]
    assert wrote["coded_sidecar"] == "write" and not wrote.get("sidecar_loaded") and wrote["sidecar_bytes"] > 0
    assert read["coded_sidecar"] == "read" and read["sidecar_loaded"] is True and read["sidecar_s_per_gb"] > 0
    assert wrote["output_equals_resident"] is True and read["output_equals_resident"] is True
    assert read["coded_bytes"] == wrote["coded_bytes"]


def test_auto_codec_excess_and_payoff_against_the_uncoded_mode():
    """layerwise-codedauto beside layerwise: the coding steps' cost over as many uncoded steps and
    the step count after which auto is ahead; no payoff when the coded step is not faster; no
    figures without the uncoded mode of the same run."""
    raw = {"resident": {"step_ms": 170.0}, "layerwise": {"step_ms": 430.0, "streamed_gb": 23.7},
           "layerwise-codedauto": {"step_ms": 300.0, "streamed_gb": 16.3,
                                   "coding_step_ms_all": [1800.0, 440.0, 420.0, 450.0]},
           "graphs-codedauto": {"step_ms": 305.0, "streamed_gb": 16.3, "coding_step_ms_all": [900.0]}}
    out = summarise(raw, h2d_gbps=55.0)
    f = out["layerwise-codedauto"]
    assert f["auto_excess_s"] == pytest.approx((1800 + 440 + 420 + 450 - 4 * 430) / 1e3)
    assert f["auto_payoff_steps"] == 4 + 11  # 1390 ms over 130 ms a step: 10.7 -> 11 more steps
    assert "auto_excess_s" not in out["graphs-codedauto"]  # no graphs mode in this run
    slower = summarise({**raw, "layerwise-codedauto": {**raw["layerwise-codedauto"], "step_ms": 431.0}},
                       h2d_gbps=55.0)["layerwise-codedauto"]
    assert slower["auto_payoff_steps"] is None and slower["auto_excess_s"] > 0
