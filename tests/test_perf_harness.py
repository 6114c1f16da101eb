"""perf/: result schema, floor/ratio arithmetic, check and baseline, mode
parsing, tiny scenarios, and the harness end to end on a tiny scenario (CPU)."""
import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from perf.__main__ import main as perf_main  # noqa: E402
from perf.harness import assemble, run  # noqa: E402
from perf.modes import parse_mode  # noqa: E402
from perf.results import (  # noqa: E402
    floor_ms, gpu_slug, markdown_table, result_filename, summarise, validate_result,
)
from perf.worker import setup_rss_figures  # noqa: E402
from perf.scenarios import (  # noqa: E402
    SCENARIOS, block_bytes, build_inputs, build_model, first_output, get_scenario, tensor_bytes,
)

# DESIGN.md section 7's example (ratios consistent with step / floor)
DESIGN_EXAMPLE = {
    "scenario": "flux-12b-1024", "gpu": "NVIDIA H200", "gpus": 1, "commit": "0123456789abcdef",
    "torch": "2.11.0", "date": "2026-12-01T10:00:00Z", "h2d_gbps": 55.2,
    "modes": {
        "resident": {"step_ms": 172.1, "peak_device_gb": 24.3},
        "layerwise": {"step_ms": 441.0, "floor_ms": 431.0, "ratio_to_floor": 1.023, "ratio_to_resident": 2.56,
                      "peak_device_gb": 2.1, "pinned_host_gb": 23.8, "setup_s": 4.2, "ratio_to_best_peer": 0.767},
        "diffusers-block": {"step_ms": 575.0, "floor_ms": 431.0, "ratio_to_floor": 1.334},
    },
}


def _example(**mode_changes):
    r = copy.deepcopy(DESIGN_EXAMPLE)
    for mode, figs in mode_changes.items():
        r["modes"][mode].update(figs)
    return r


# ------------------------------------------------------------------ schema

def test_design_example_validates():
    validate_result(DESIGN_EXAMPLE)


def _drop(key):
    def f(r):
        del r[key]
    return f


@pytest.mark.parametrize("mutate, words", [
    (_drop("commit"), "'commit'"),
    (_drop("modes"), "'modes'"),
    (lambda r: r.update(gpus="1"), "'gpus'"),
    (lambda r: r.update(date="yesterday"), "'date'"),
    (lambda r: r.update(h2d_gbps=-3), "'h2d_gbps'"),
    (lambda r: r.update(modes={}), "empty"),
    (lambda r: r["modes"].update({"Fast Mode": {"step_ms": 1.0}}), "mode name 'Fast Mode'"),
    (lambda r: r["modes"]["resident"].pop("step_ms"), "'step_ms'"),
    (lambda r: r["modes"]["resident"].update(step_ms=-1.0), "'step_ms'"),
    (lambda r: r["modes"]["layerwise"].update(peak_device_gb=float("nan")), "'peak_device_gb'"),
    (lambda r: r["modes"]["layerwise"].pop("floor_ms"), "'floor_ms'"),
    (lambda r: r["modes"]["diffusers-block"].pop("ratio_to_floor"), "'ratio_to_floor'"),
    (lambda r: r["modes"]["layerwise"].update(ratio_to_floor=0.5), "disagrees"),
])
def test_validate_result_names_what_is_wrong(mutate, words):
    r = copy.deepcopy(DESIGN_EXAMPLE)
    mutate(r)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        validate_result(r)


# ------------------------------------------------------------------ arithmetic

def test_floor_is_max_of_compute_and_transfer():
    assert floor_ms(172.0, 23.8e9, 55.0) == pytest.approx(23.8 / 55.0 * 1e3)   # 432.7 ms, transfer bound
    assert floor_ms(3058.0, 28.6e9, 55.0) == 3058.0                             # compute bound
    assert floor_ms(172.0, None, 55.0) == 172.0
    assert floor_ms(172.0, 23.8e9, None) == 172.0


def test_summarise_ratios_and_best_peer():
    raw = {
        "resident": {"step_ms": 172.0},
        "layerwise": {"step_ms": 441.0, "streamed_bytes": 23.8e9},
        "layerwise-r8": {"step_ms": 400.0, "streamed_gb": 20.0},
        "diffusers-block": {"step_ms": 575.0, "streamed_bytes": 23.8e9},
        "diffusers-leaf": {"step_ms": 526.0, "streamed_bytes": 23.8e9},
    }
    out = summarise(raw, h2d_gbps=55.0)
    assert "floor_ms" not in out["resident"] and "ratio_to_floor" not in out["resident"]
    lw = out["layerwise"]
    assert lw["floor_ms"] == pytest.approx(432.727, abs=1e-3)
    assert lw["ratio_to_floor"] == pytest.approx(441.0 / 432.727, abs=1e-4)
    assert lw["ratio_to_resident"] == pytest.approx(441.0 / 172.0, abs=1e-4)
    assert lw["ratio_to_best_peer"] == pytest.approx(441.0 / 526.0, abs=1e-4)   # leaf is the faster peer
    assert out["layerwise-r8"]["floor_ms"] == pytest.approx(20.0 / 55.0 * 1e3, abs=1e-3)
    assert "ratio_to_best_peer" not in out["diffusers-block"]                    # peers are not compared to peers
    assert raw["layerwise"].get("floor_ms") is None                              # input left alone


def test_summarise_without_resident_uses_the_transfer_floor():
    out = summarise({"layerwise": {"step_ms": 441.0, "streamed_bytes": 23.8e9}}, h2d_gbps=55.0)
    assert out["layerwise"]["floor_ms"] == pytest.approx(432.727, abs=1e-3)
    assert "ratio_to_resident" not in out["layerwise"]
    assert "floor_ms" not in summarise({"layerwise": {"step_ms": 441.0}}, h2d_gbps=None)["layerwise"]


def test_gpu_slug_and_file_name():
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert result_filename("flux-12b-1024", "NVIDIA H200", "abcdef0123456789") == "flux-12b-1024-nvidia-h200-abcdef012345.json"


def test_assemble_records_failures_and_the_best_bandwidth():
    def worker(step, h2d, **kw):
        return dict(ok=True, gpu="NVIDIA H200", gpus=1, torch="2.11.0", driver="580.1", model_gb=23.8,
                    step_ms=step, h2d_gbps=h2d, **kw)
    workers = {
        "resident": worker(172.0, 54.0),
        "layerwise": worker(441.0, 55.0, streamed_bytes=int(23.8e9), streamed_gb=23.8, setup_s=4.0,
                            **setup_rss_figures(int(26.5e9), int(23.8e9))),
        "diffusers-block": worker(575.0, 56.0, streamed_bytes=int(23.8e9), streamed_gb=23.8),
        "diffusers-leaf": {"ok": False, "error": "OutOfMemoryError: boom"},
    }
    r = assemble("flux-12b-1024", workers, {"diffusers-leaf": "OutOfMemoryError: boom"}, commit="f" * 40, dirty=False)
    validate_result(r)
    assert r["h2d_gbps"] == 56.0 and r["driver"] == "580.1" and r["model_gb"] == 23.8
    # one floor for all: the best link rate of the run, not each mode's own nor the median
    assert r["modes"]["layerwise"]["floor_ms"] == pytest.approx(23.8e9 / 56e9 * 1e3, abs=0.01)
    assert set(r["modes"]) == {"resident", "layerwise", "diffusers-block"}
    assert r["failed"] == {"diffusers-leaf": "OutOfMemoryError: boom"}
    assert r["modes"]["layerwise"]["ratio_to_best_peer"] == pytest.approx(441 / 575, abs=1e-4)
    assert "streamed_bytes" not in r["modes"]["layerwise"]
    # issue 15's setup peak host memory, per mode, with its target
    lw = r["modes"]["layerwise"]
    assert lw["model_gb"] == 23.8 and lw["setup_peak_rss_gb"] == 26.5
    assert lw["setup_peak_rss_ratio"] == pytest.approx(26.5 / 23.8, abs=1e-4)
    assert lw["target_setup_peak_rss_ratio"] == 1.15
    table = markdown_table(r)
    assert "| layerwise | 441.0 |" in table and "failed: OutOfMemoryError" in table


def test_assemble_merge_keeps_prior_modes_and_recomputes_ratios():
    prior = copy.deepcopy(DESIGN_EXAMPLE)
    prior["modes"]["diffusers-block"]["streamed_gb"] = 23.8
    workers = {
        "resident": dict(ok=True, gpu="NVIDIA H200", gpus=1, torch="2.11.0", step_ms=170.0, h2d_gbps=50.0),
        "layerwise": dict(ok=True, gpu="NVIDIA H200", gpus=1, torch="2.11.0", step_ms=480.0, h2d_gbps=50.0,
                          streamed_bytes=int(23.8e9), streamed_gb=23.8),
    }
    r = assemble("flux-12b-1024", workers, {}, commit="f" * 40, dirty=False, prior=prior)
    validate_result(r)
    assert r["merged_from"] == DESIGN_EXAMPLE["date"]
    blk = r["modes"]["diffusers-block"]
    assert blk["floor_ms"] == pytest.approx(476.0) and blk["ratio_to_resident"] == pytest.approx(575 / 170, abs=1e-4)
    assert r["modes"]["layerwise"]["ratio_to_best_peer"] == pytest.approx(480 / 575, abs=1e-4)


# ------------------------------------------------------------------ check / baseline

def _write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def test_baseline_then_check_passes(tmp_path, capsys):
    res = _write(tmp_path, "r.json", DESIGN_EXAMPLE)
    base = tmp_path / "b.json"
    assert perf_main(["baseline", res, "--out", str(base)]) == 0
    stored = json.loads(base.read_text())
    assert stored["gpu"] == "NVIDIA H200"
    assert stored["scenarios"]["flux-12b-1024"]["layerwise"] == {
        "ratio_to_floor": 1.023, "ratio_to_resident": 2.56, "ratio_to_best_peer": 0.767}
    assert stored["scenarios"]["flux-12b-1024"]["diffusers-block"] == {"ratio_to_floor": 1.334}
    assert "resident" not in stored["scenarios"]["flux-12b-1024"]          # no ratios, nothing to keep
    assert stored["sources"]["flux-12b-1024"]["commit"] == "0123456789abcdef"
    capsys.readouterr()
    # same figures, slightly better, and worse within the tolerance: all pass
    for lw_step in (441.0, 430.0, 441.0 * 1.04):
        r = _example(layerwise={"step_ms": lw_step, "ratio_to_floor": round(lw_step / 431.0, 4)})
        assert perf_main(["check", _write(tmp_path, "n.json", r), "--baseline", str(base)]) == 0
    out = capsys.readouterr().out
    assert "REGRESSION" not in out and "0 regression(s)" in out


def test_check_fails_on_worse_ratio_and_names_it(tmp_path, capsys):
    base = tmp_path / "b.json"
    assert perf_main(["baseline", _write(tmp_path, "r.json", DESIGN_EXAMPLE), "--out", str(base)]) == 0
    worse = _example(layerwise={"step_ms": 480.0, "ratio_to_floor": round(480 / 431.0, 4), "ratio_to_resident": 2.79})
    path = _write(tmp_path, "w.json", worse)
    capsys.readouterr()
    assert perf_main(["check", path, "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION flux-12b-1024 layerwise ratio_to_floor: baseline 1.0230 new 1.1137" in out
    assert "REGRESSION flux-12b-1024 layerwise ratio_to_resident: baseline 2.5600 new 2.7900" in out
    assert "2 regression(s)" in out
    # a looser tolerance lets the same result through
    assert perf_main(["check", path, "--baseline", str(base), "--tolerance", "0.10"]) == 0


def test_kernel_bandwidth_ratio_regresses_when_it_falls(tmp_path, capsys):
    def kernel_result(ratio):
        return {**{k: DESIGN_EXAMPLE[k] for k in ("gpu", "gpus", "commit", "torch", "date")}, "scenario": "materialise",
                "modes": {"copy-300mb": {"step_ms": 0.138},
                          "triton-300mb": {"step_ms": 0.138 / ratio, "ratio_to_copy": ratio}}}

    base = tmp_path / "b.json"
    assert perf_main(["baseline", _write(tmp_path, "r.json", kernel_result(0.96)), "--out", str(base)]) == 0
    assert json.loads(base.read_text())["scenarios"]["materialise"] == {"triton-300mb": {"ratio_to_copy": 0.96}}
    capsys.readouterr()
    assert perf_main(["check", _write(tmp_path, "up.json", kernel_result(0.99)), "--baseline", str(base)]) == 0
    assert perf_main(["check", _write(tmp_path, "down.json", kernel_result(0.80)), "--baseline", str(base)]) == 1
    assert "REGRESSION materialise triton-300mb ratio_to_copy: baseline 0.9600 new 0.8000" in capsys.readouterr().out


def test_check_errors_clearly_without_baseline(tmp_path, capsys):
    path = _write(tmp_path, "r.json", DESIGN_EXAMPLE)
    assert perf_main(["check", path, "--baseline", str(tmp_path / "missing.json")]) == 2
    out = capsys.readouterr().out
    assert "no baseline for GPU 'NVIDIA H200'" in out and "python -m perf baseline" in out
    other = copy.deepcopy(DESIGN_EXAMPLE)
    other["scenario"] = "wan-14b-480p"
    base = tmp_path / "b.json"
    assert perf_main(["baseline", _write(tmp_path, "o.json", other), "--out", str(base)]) == 0
    assert perf_main(["check", path, "--baseline", str(base)]) == 2
    assert "has no scenario 'flux-12b-1024'" in capsys.readouterr().out
    bad = copy.deepcopy(DESIGN_EXAMPLE)
    del bad["modes"]["layerwise"]["floor_ms"]
    assert perf_main(["check", _write(tmp_path, "bad.json", bad), "--baseline", str(base)]) == 2
    assert "invalid result" in capsys.readouterr().out


def test_baseline_update_merges_scenarios_and_replaces_modes(tmp_path):
    base = tmp_path / "b.json"
    wan = copy.deepcopy(DESIGN_EXAMPLE)
    wan["scenario"] = "wan-14b-480p"
    assert perf_main(["baseline", _write(tmp_path, "a.json", DESIGN_EXAMPLE), _write(tmp_path, "w.json", wan),
                      "--out", str(base)]) == 0
    newer = _example(layerwise={"step_ms": 435.0, "ratio_to_floor": round(435 / 431.0, 4)})
    assert perf_main(["baseline", _write(tmp_path, "c.json", newer), "--out", str(base)]) == 0
    stored = json.loads(base.read_text())
    assert set(stored["scenarios"]) == {"flux-12b-1024", "wan-14b-480p"}
    assert stored["scenarios"]["flux-12b-1024"]["layerwise"]["ratio_to_floor"] == round(435 / 431.0, 4)
    assert stored["scenarios"]["wan-14b-480p"]["layerwise"]["ratio_to_floor"] == 1.023
    assert stored["sources"]["flux-12b-1024"]["file"] == "c.json"


# ------------------------------------------------------------------ modes / scenarios

def test_parse_mode_variants_and_refusals():
    flux, _ = get_scenario("flux-12b-1024")
    flux512, _ = get_scenario("flux-12b-512")
    assert parse_mode("layerwise", flux).config_kw == {}
    assert parse_mode("layerwise-r4", flux).config_kw == {"resident_layers": 4}
    assert parse_mode("graphs", flux).config_kw == {"cuda_graphs": "on"}
    assert parse_mode("layerwise-r2-graphs", flux).config_kw == {"resident_layers": 2, "cuda_graphs": "on"}
    assert parse_mode("graphs-nextstep", flux).config_kw == {"cuda_graphs": "on", "graph_boundary_loads": "next-step"}
    assert parse_mode("graphs-ingraph", flux).config_kw == {"cuda_graphs": "on", "graph_boundary_loads": "in-graph"}
    mm = parse_mode("layerwise-mmap-r2", flux)
    assert (mm.source, mm.config_kw) == ("mmap", {"resident_layers": 2})
    assert parse_mode("layerwise", flux).source == "memory"
    assert parse_mode("diffusers-block", flux).peer_kw == dict(
        offload_type="block_level", num_blocks_per_group=1, use_stream=True, record_stream=True)
    assert parse_mode("accelerate-cpu", flux512).kind == "accelerate-cpu"
    with pytest.raises(ValueError, match="refused on scenario 'flux-12b-1024'"):
        parse_mode("accelerate-cpu", flux)
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        parse_mode("layerwise-fast", flux)
    with pytest.raises(ValueError, match="not one of the allowed forms"):
        parse_mode("turbo", flux)
    with pytest.raises(ValueError, match="unknown scenario"):
        get_scenario("sd3-2b")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_tiny_scenarios_build_and_run(name):
    sc, _ = get_scenario(name)
    model = build_model(sc, tiny=True, device="cpu", gen_device="cpu")
    dtypes = {p.dtype for p in model.parameters()}
    assert torch.bfloat16 in dtypes
    if sc.family == "wan":   # the class keeps these modules in fp32, as from_pretrained(torch_dtype=bf16) does
        assert model.scale_shift_table.dtype == torch.float32
    assert all(p.device.type == "cpu" and not p.requires_grad for p in model.parameters())
    assert 0 < block_bytes(model, sc) < tensor_bytes(model)
    with torch.no_grad():
        y = first_output(model(**build_inputs(sc, "cpu", tiny=True)))
    assert torch.isfinite(y).all()


def test_full_scenario_configs_have_the_real_sizes():
    """Meta construction only: parameter counts of Flux.1-dev and Wan2.1-14B."""
    from perf.scenarios import _construct_meta, model_class

    flux = _construct_meta(model_class("flux"), SCENARIOS["flux-12b-1024"].config)
    wan = _construct_meta(model_class("wan"), SCENARIOS["wan-14b-480p"].config)
    assert sum(p.numel() for p in flux.parameters()) == pytest.approx(11.90e9, rel=0.01)
    assert sum(p.numel() for p in wan.parameters()) == pytest.approx(14.29e9, rel=0.01)
    assert all(p.device.type == "meta" for p in wan.parameters())
    assert wan.rope.freqs_cos.device.type == "cpu"       # buffers stay real
    inputs = SCENARIOS["flux-12b-1024"].shape
    assert inputs["image_hw"][0] * inputs["image_hw"][1] == 4096


def test_checkpoint_written_once_and_reused(tmp_path):
    from perf.scenarios import checkpoint_info, write_checkpoint

    sc, _ = get_scenario("wan-14b-480p")
    with pytest.raises(FileNotFoundError, match="no perf checkpoint"):
        checkpoint_info(tmp_path)
    info = write_checkpoint(sc, tmp_path, tiny=True)
    model = build_model(sc, tiny=True, device="cpu", gen_device="cpu")
    assert info["model_bytes"] == tensor_bytes(model) and info["block_bytes"] == block_bytes(model, sc)
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    shard = tmp_path / "diffusion_pytorch_model-00001-of-00001.safetensors"
    os.utime(shard, ns=(0, 0))  # a rewrite would move the time stamp
    msgs = []
    assert write_checkpoint(sc, tmp_path, tiny=True, progress=msgs.append) == info
    assert shard.stat().st_mtime_ns == 0 and "reusing" in msgs[0]
    from safetensors.torch import load_file
    on_disk = load_file(str(shard))
    assert on_disk["scale_shift_table"].dtype == torch.float32       # fp32-kept modules stay fp32
    assert torch.equal(on_disk["blocks.0.ffn.net.0.proj.weight"], model.blocks[0].ffn.net[0].proj.weight)


def test_harness_end_to_end_tiny_cpu(tmp_path, capsys):
    """resident, layerwise and layerwise-mmap, each in a fresh worker process
    (the checkpoint is written first); the result file validates and every
    mode computes the resident output bit for bit."""
    modes = ["resident", "layerwise", "layerwise-mmap"]
    from perf.scenarios import write_checkpoint

    write_checkpoint(get_scenario("flux-12b-1024")[0], tmp_path / "ckpt", tiny=True)  # in-process: one start less
    result, path, ok = run("flux-12b-1024", modes, steps=2, warmup=1, out_dir=tmp_path / "res", tiny=True,
                           device="cpu", touch_gb=0, ckpt_dir=str(tmp_path / "ckpt"), mode_timeout=300)
    assert ok, result.get("failed")
    assert path == tmp_path / "res" / result_filename("flux-12b-1024-tiny", "cpu", result["commit"])
    on_disk = json.loads(path.read_text())
    validate_result(on_disk)
    assert on_disk["scenario"] == "flux-12b-1024-tiny" and on_disk["gpu"] == "cpu" and on_disk["gpus"] == 0
    assert on_disk["model_gb"] > 0 and on_disk["h2d_gbps"] is None
    res = on_disk["modes"]["resident"]
    assert len(res["step_ms_all"]) == 2 and res["output_finite"]
    for mode in modes[1:]:
        f = on_disk["modes"][mode]
        # no H2D figure on a CPU: the floor is the resident step
        assert f["floor_ms"] == res["step_ms"]
        assert f["ratio_to_floor"] == pytest.approx(f["step_ms"] / res["step_ms"], rel=1e-3)
        assert f["stats"]["streamed_bytes_per_step"] > 0
        assert f["output_equals_resident"] is True, mode
    for mode in modes:  # the setup peak host memory (build + setup, before any step) of each mode
        f = on_disk["modes"][mode]
        assert f["model_gb"] == pytest.approx(on_disk["model_gb"], rel=1e-3)
        assert 0 < f["setup_peak_rss_gb"] <= f["host_rss_peak_gb"]
        # model_gb is rounded to 0.1 MB: loose on a model of a few hundred kB
        assert f["setup_peak_rss_ratio"] == pytest.approx(f["setup_peak_rss_gb"] / f["model_gb"], rel=0.1)
        assert f["target_setup_peak_rss_ratio"] == 1.15
    assert on_disk["modes"]["layerwise-mmap"]["stats"]["source"] == "mmap"
    assert "| resident |" in capsys.readouterr().out


def test_resident_graph_is_a_yardstick_not_an_offloaded_mode():
    raw = {
        "resident": {"step_ms": 85.0},
        "resident-graph": {"step_ms": 70.0},
        "layerwise-r55": {"step_ms": 90.0, "streamed_bytes": 0.57e9},
        "graphs-r55": {"step_ms": 72.1, "streamed_bytes": 0.57e9},
    }
    out = summarise(raw, h2d_gbps=55.0)
    assert "floor_ms" not in out["resident-graph"]
    assert out["graphs-r55"]["ratio_to_resident_graph"] == pytest.approx(72.1 / 70.0, rel=1e-4)
    assert "ratio_to_resident_graph" not in out["layerwise-r55"]
    assert parse_mode("resident-graph").builds_on_device


def test_coded_modes_compare_with_the_resident_model_of_their_weights():
    raw = {
        "resident": {"step_ms": 3178.7},
        "resident-tfill": {"step_ms": 3199.8},
        "layerwise-coded": {"step_ms": 3218.4, "streamed_bytes": 19.9e9},
        "graphs-coded2": {"step_ms": 3230.0, "streamed_bytes": 19.5e9},
        "layerwise": {"step_ms": 3190.0, "streamed_bytes": 28.1e9},
    }
    out = summarise(raw, h2d_gbps=55.0)
    assert out["layerwise-coded"]["ratio_to_resident"] == pytest.approx(3218.4 / 3178.7, rel=1e-4)
    assert out["layerwise-coded"]["ratio_to_resident_tfill"] == pytest.approx(3218.4 / 3199.8, rel=1e-4)
    assert out["graphs-coded2"]["ratio_to_resident_tfill"] == pytest.approx(3230.0 / 3199.8, rel=1e-4)
    assert "ratio_to_resident_tfill" not in out["layerwise"]


def test_bench_graphs_plan():
    from perf.bench_graphs import plan

    assert plan(55, False) == [("flux-12b-512", ["resident", "resident-graph", "layerwise-r55", "graphs-r55"])]
    assert [sc for sc, _ in plan(55, True)] == ["flux-12b-512", "flux-12b-1024", "wan-14b-480p"]
    for _, modes in plan(3, True):
        for m in modes:
            parse_mode(m)


def test_full_size_scenario_without_cuda_is_refused_before_any_work(tmp_path):
    from perf.harness import run

    if __import__("torch").cuda.is_available():
        pytest.skip("checks the CPU-machine refusal")  # never on CI's CPU machine
    with pytest.raises(ValueError, match="needs a CUDA GPU; on this machine add --tiny"):
        run("flux-12b-1024", ["layerwise"], out_dir=tmp_path, touch_gb=None)
    assert not any(tmp_path.iterdir())


def test_tiny_results_go_to_a_temporary_folder_unless_out_is_given(monkeypatch, capsys):
    from perf.__main__ import main as perf_main

    assert perf_main(["run", "--scenario", "flux-12b-1024", "--tiny", "--modes", "layerwise", "--steps", "1",
                      "--warmup", "0", "--device", "cpu"]) == 0
    path = capsys.readouterr().out.strip().splitlines()[-1].split("result: ")[1]
    assert "weightstream-perf-tiny-" in path and os.path.isfile(path)
    assert "perf/results" not in path


def test_host_touch_is_capped_by_what_the_machine_offers():
    from perf.harness import Clock, _touch_size, host_memory_cap_gb

    cap = host_memory_cap_gb()
    assert cap is not None and cap > 0
    assert _touch_size(10 * cap, Clock()) <= 0.8 * cap + 1
    assert _touch_size(1, Clock()) == 1


def test_compile_modes_parse_and_compare_with_the_compiled_resident():
    from perf.results import summarise

    assert parse_mode("resident-compile").compile and parse_mode("resident-compile").kind == "resident"
    spec = parse_mode("layerwise-r4-compile")
    assert spec.compile and spec.config_kw == {"resident_layers": 4}
    out = summarise({"resident": {"step_ms": 100.0}, "resident-compile": {"step_ms": 80.0},
                     "layerwise-compile": {"step_ms": 84.0, "streamed_gb": 1.0}}, 50.0)
    assert out["layerwise-compile"]["ratio_to_resident_compile"] == pytest.approx(1.05)
    assert "floor_ms" not in out["resident-compile"]


def test_auto_modes_parse_and_compare_with_the_best_fixed_count_that_fits():
    from perf.modes import parse_mode
    from perf.results import summarise

    spec = parse_mode("layerwise-auto-12gb")
    assert spec.config_kw == {"resident_layers": "auto", "device_memory_budget_gb": 12.0}
    with pytest.raises(ValueError, match="auto"):
        parse_mode("layerwise-autox")
    raw = {
        "resident": {"step_ms": 100.0},
        "layerwise": {"step_ms": 400.0, "streamed_bytes": 20e9, "device_weight_gb": 2.0},
        "layerwise-r20": {"step_ms": 200.0, "streamed_bytes": 10e9, "device_weight_gb": 11.0},
        "layerwise-r30": {"step_ms": 150.0, "streamed_bytes": 6e9, "device_weight_gb": 15.0},  # over 12 GB
        "layerwise-auto-12gb": {"step_ms": 180.0, "streamed_bytes": 9e9, "budget_gb": 12.0, "predicted_ms": 175.0,
                                "device_weight_gb": 11.9},
    }
    out = summarise(raw, 50.0)["layerwise-auto-12gb"]
    assert out["best_fixed_mode"] == "layerwise-r20" and out["ratio_to_best_fixed"] == pytest.approx(0.9)
    assert out["ratio_to_predicted"] == pytest.approx(180 / 175, rel=1e-3)


@pytest.mark.parametrize("bench, bad", [
    ("bench_graph_copy", ["--host", "tmpfs"]),
    ("bench_coded_ring", ["--place", "nowhere"]),
    ("bench_decode_steal", ["--num-warps", "3"]),
    ("bench_decode_steal", ["--codec", "exp-q"]),
    ("probe_patch_decode", ["--k", "5"]),
    ("probe_words_only", ["--codec", "exp-q"]),
    ("probe_words_only", ["--elem-chunk", "100"]),
    ("probe_words_only", ["--elem-chunk", "8192"]),
])
def test_small_bench_cli(bench, bad):
    """The small device benches parse their options on any machine, refuse a bad value, and refuse
    to time without CUDA."""
    import importlib

    mod = importlib.import_module(f"perf.{bench}")
    with pytest.raises(SystemExit) as exit_info:
        mod.main(["--help"])
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit):
        mod.main(bad)
    if not torch.cuda.is_available():
        assert mod.main(["--reps", "1"]) == 2


def test_save_result_writes_meta_and_body(tmp_path, capsys):
    from perf.common import save_result

    path = save_result(tmp_path / "r", "kind", {"modes": {"a": 1}}, suffix="-x")
    assert path.parent == tmp_path / "r" and path.name.startswith("kind-") and path.name.endswith("-x.json")
    got = json.loads(path.read_text())
    assert got["modes"] == {"a": 1} and {"gpu", "commit", "torch", "date"} <= set(got)
    assert f"wrote {path}" in capsys.readouterr().out
