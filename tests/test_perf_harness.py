"""perf/: result schema, floor/ratio arithmetic, one merged result file per scenario and GPU kind,
check and baseline, mode parsing, tiny scenarios, and the harness end to end on tiny scenarios (CPU):
single-GPU modes in fresh workers, the mmap staging modes, DLO modes on gloo ranks, and the pieces of
the module-swap scenario that run without a GPU."""
import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

from perf.__main__ import main as perf_main  # noqa: E402  (the checkout root is on sys.path: conftest.py)
from perf.harness import assemble, run  # noqa: E402
from perf.modes import parse_mode  # noqa: E402
from perf.results import (  # noqa: E402
    ResultFileError, floor_ms, gpu_kind, gpu_slug, markdown_table, result_filename, summarise, validate_result,
    write_result,
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
    """One file per scenario and GPU kind: no commit in the name, -x<N> for an N-GPU result."""
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert result_filename("flux-12b-1024", "NVIDIA H200", 1) == "flux-12b-1024-nvidia-h200.json"
    assert result_filename("flux-12b-1024", "NVIDIA H200", 2) == "flux-12b-1024-nvidia-h200-x2.json"
    assert result_filename("flux-12b-1024-tiny", "cpu", 0) == "flux-12b-1024-tiny-cpu.json"
    assert gpu_kind("NVIDIA H200", 8) == "nvidia-h200-x8"


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
    """The modes of the file this run merges into stay, each with the commit and date of its own
    run; their ratios are worked out against this run's resident step and H2D rate, except DLO
    modes (a per-rank floor): those stay as measured."""
    prior = copy.deepcopy(DESIGN_EXAMPLE)
    prior["modes"]["diffusers-block"]["streamed_gb"] = 23.8
    prior["modes"]["dlo-allgather"] = {"step_ms": 250.5, "floor_ms": 245.4, "ratio_to_floor": 1.0208,
                                       "ratio_to_resident": 1.452, "streamed_gb": 23.8, "h2d_gb_per_rank": 11.9,
                                       "commit": "9" * 40, "date": "2026-11-29T10:00:00Z"}
    workers = {
        "resident": dict(ok=True, gpu="NVIDIA H200", gpus=1, torch="2.11.0", step_ms=170.0, h2d_gbps=50.0),
        "layerwise": dict(ok=True, gpu="NVIDIA H200", gpus=1, torch="2.11.0", step_ms=480.0, h2d_gbps=50.0,
                          streamed_bytes=int(23.8e9), streamed_gb=23.8),
        "diffusers-block": {"ok": False, "error": "OutOfMemoryError: boom"},  # failed now: the earlier figure stays
    }
    r = assemble("flux-12b-1024", workers, {"diffusers-block": "OutOfMemoryError: boom"}, commit="f" * 40, dirty=False,
                 prior=prior)
    validate_result(r)
    assert r["merged_from"] == DESIGN_EXAMPLE["date"] and r["failed"] == {"diffusers-block": "OutOfMemoryError: boom"}
    blk = r["modes"]["diffusers-block"]
    assert blk["floor_ms"] == pytest.approx(476.0) and blk["ratio_to_resident"] == pytest.approx(575 / 170, abs=1e-4)
    assert r["modes"]["layerwise"]["ratio_to_best_peer"] == pytest.approx(480 / 575, abs=1e-4)
    assert (blk["commit"], blk["date"]) == (DESIGN_EXAMPLE["commit"], DESIGN_EXAMPLE["date"])  # its own run
    assert r["modes"]["layerwise"]["commit"] == "f" * 40 and r["modes"]["layerwise"]["date"] == r["date"]
    assert r["modes"]["dlo-allgather"] == prior["modes"]["dlo-allgather"]  # not against 23.8 GB / 50 GB/s


def _result(scenario="flux-12b-1024", gpus=1, commit="a" * 40, date="2026-12-01T10:00:00Z", **modes):
    return {"scenario": scenario, "gpu": "NVIDIA H200", "gpus": gpus, "commit": commit, "torch": "2.11.0",
            "date": date, "modes": modes}


def test_write_result_merges_into_one_file_per_scenario_and_gpu_kind(tmp_path):
    """A second run's modes replace the same-named ones and keep the others, each mode naming the
    commit and date it was measured at; an N-GPU result goes to its own file; a file that cannot be
    merged into is refused before anything is written, naming it."""
    first = _result(resident={"step_ms": 172.0}, **{"diffusers-block": {"step_ms": 575.0, "floor_ms": 431.0,
                                                                         "ratio_to_floor": 1.3341}})
    path = write_result(tmp_path, first)
    assert path.name == "flux-12b-1024-nvidia-h200.json"
    second = _result(commit="b" * 40, date="2026-12-02T10:00:00Z", resident={"step_ms": 171.0},
                     layerwise={"step_ms": 430.0, "floor_ms": 429.0, "ratio_to_floor": 1.0023})
    assert write_result(tmp_path, second) == path
    got = json.loads(path.read_text())
    validate_result(got)
    assert set(got["modes"]) == {"resident", "diffusers-block", "layerwise"}
    assert got["modes"]["resident"]["step_ms"] == 171.0 and got["modes"]["resident"]["commit"] == "b" * 40
    assert got["modes"]["diffusers-block"]["commit"] == "a" * 40
    assert got["modes"]["diffusers-block"]["date"] == "2026-12-01T10:00:00Z"
    assert got["commit"] == "b" * 40 and got["merged_from"] == "2026-12-01T10:00:00Z"
    assert write_result(tmp_path, _result(gpus=2, resident={"step_ms": 1.0})).name == "flux-12b-1024-nvidia-h200-x2.json"
    (tmp_path / "wan-14b-480p-nvidia-h200.json").write_text(path.read_text())  # a file whose name lies
    with pytest.raises(ResultFileError, match="holds scenario 'flux-12b-1024'.*move it away"):
        write_result(tmp_path, _result(scenario="wan-14b-480p", resident={"step_ms": 3000.0}))
    path.write_text("{not json")
    with pytest.raises(ResultFileError, match=f"{path.name} this run would merge into is not usable"):
        write_result(tmp_path, second)
    assert path.read_text() == "{not json"
    assert isinstance(ResultFileError("x"), ValueError)


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
    assert parse_mode("layerwise-s3-qfp8", flux).config_kw == {"num_slots": 3}
    assert parse_mode("graphs-s12", flux).config_kw == {"cuda_graphs": "on", "num_slots": 12}
    for bad in ("layerwise-s1", "layerwise-s0", "layerwise-s03"):
        with pytest.raises(ValueError, match="s<N>|unknown variant"):
            parse_mode(bad, flux)
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
    mode computes the resident output bit for bit. A second run of the mmap
    staging mode merges into the same file: the first run's modes stay."""
    modes = ["resident", "layerwise", "layerwise-mmap"]
    from perf.scenarios import write_checkpoint

    write_checkpoint(get_scenario("flux-12b-1024")[0], tmp_path / "ckpt", tiny=True)  # in-process: one start less
    result, path, ok = run("flux-12b-1024", modes, steps=2, warmup=1, out_dir=tmp_path / "res", tiny=True,
                           device="cpu", touch_gb=0, ckpt_dir=str(tmp_path / "ckpt"), mode_timeout=300)
    assert ok, result.get("failed")
    assert path == tmp_path / "res" / "flux-12b-1024-tiny-cpu.json"
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
    mm = on_disk["modes"]["layerwise-mmap"]  # the mmap source's own figures, against the pinned store
    assert mm["ratio_to_pinned"] == pytest.approx(mm["step_ms"] / on_disk["modes"]["layerwise"]["step_ms"], rel=1e-3)
    assert mm["setup_s_per_gb"] > 0 and isinstance(mm["checkpoint_fs"], str)

    again, path2, ok = run("flux-12b-1024", ["layerwise-mmap-staging-t2"], steps=2, warmup=1, out_dir=tmp_path / "res",
                           tiny=True, device="cpu", touch_gb=0, ckpt_dir=str(tmp_path / "ckpt"), mode_timeout=300)
    assert ok and path2 == path, again.get("failed")
    merged = json.loads(path.read_text())
    validate_result(merged)
    assert set(merged["modes"]) == {"resident", "layerwise", "layerwise-mmap", "layerwise-mmap-staging-t2"}
    assert merged["modes"]["layerwise"]["date"] == on_disk["modes"]["layerwise"]["date"]  # kept from the first run
    assert merged["modes"]["resident"]["date"] == merged["date"] and merged["merged_from"] == on_disk["date"]
    st = merged["modes"]["layerwise-mmap-staging-t2"]
    assert st["output_equals_resident"] is True and st["notes"]["copy_path"] == "staging"
    assert st["stats"]["staging_threads"] == 2 and st["stats"]["staged_blocks"] == st["stats"]["blocks_streamed"]
    assert st["staging_after_steps"]["staging_packs"] > 0 and st["staging_pack_gbps"] > 0
    assert st["ratio_to_pinned"] == pytest.approx(st["step_ms"] / merged["modes"]["layerwise"]["step_ms"], rel=1e-3)


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


# ------------------------------------------------------------------ the mmap source's modes

def test_mmap_staging_modes_parse_and_refuse_without_mmap():
    spec = parse_mode("layerwise-mmap-staging-t4")
    assert (spec.source, spec.copy_path, spec.staging_threads) == ("mmap", "staging", 4)
    assert (parse_mode("layerwise-mmap").copy_path, parse_mode("layerwise-mmap").staging_threads) == ("auto", None)
    assert parse_mode("layerwise-mmap-staging").staging_threads is None
    with pytest.raises(ValueError, match="staging variant needs -mmap"):
        parse_mode("layerwise-staging")
    with pytest.raises(ValueError, match="t<N> variant needs -mmap-staging"):
        parse_mode("layerwise-mmap-t4")
    with pytest.raises(ValueError, match="unknown variant 't0'"):
        parse_mode("layerwise-mmap-staging-t0")


def test_mmap_figures_and_verdicts():
    """The packing rate from the staging counters (packs x the mean block over the packing time),
    ratio_to_pinned of every mmap mode against layerwise, and the mmap targets judged on this
    run's modes only."""
    from perf.harness import verdicts
    from perf.modes import staging_figures

    stats = {"staging_packs": 20, "staging_pack_s": 0.5, "staging_wait_s": 0.1, "streamed_bytes_per_step": 10e9,
             "blocks_streamed": 10}
    assert staging_figures(stats) == {"staging_after_steps": {"staging_packs": 20, "staging_pack_s": 0.5,
                                                              "staging_wait_s": 0.1}, "staging_pack_gbps": 40.0}
    assert staging_figures({"staging_packs": 0}) == {}
    out = summarise({"resident": {"step_ms": 170.0}, "layerwise": {"step_ms": 440.0, "streamed_gb": 22.0},
                     "layerwise-mmap": {"step_ms": 450.0, "streamed_gb": 22.0, "setup_s_per_gb": 0.084},
                     "layerwise-mmap-staging-t4": {"step_ms": 500.0, "streamed_gb": 22.0}}, 50.0)
    assert out["layerwise-mmap"]["ratio_to_pinned"] == pytest.approx(450 / 440, rel=1e-4)
    assert "ratio_to_pinned" not in out["layerwise"] and "ratio_to_pinned" not in out["resident"]
    result = {"commit": "c", "modes": {m: dict(f, commit="c") for m, f in out.items()}}
    result["modes"]["layerwise-mmap-staging"] = {"step_ms": 900.0, "ratio_to_pinned": 2.0, "commit": "older"}
    lines = verdicts(result)
    assert "layerwise-mmap: step 1.023x pinned (target <= 1.05) PASS" in lines
    assert "layerwise-mmap-staging-t4: step 1.136x pinned (target <= 1.1) MISS" in lines
    assert "layerwise-mmap: setup 0.084 s/GB (target < 0.2) PASS" in lines
    assert not any(line.startswith("layerwise-mmap-staging:") for line in lines)  # an earlier run's mode


# ------------------------------------------------------------------ `perf run` families and `perf list`

@pytest.mark.parametrize("argv, words", [
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather,graphs"],
     "mixes dlo-* modes with graphs"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "layerwise", "--num-slots", "3"],
     "--num-slots applies to dlo-* modes"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather", "--trace-dir", "x"],
     "--trace-dir applies to single-GPU modes"),
    (["--scenario", "wan-14b-480p", "--tiny", "--modes", "dlo-allgather"], "DLO modes run the flux-12b-1024 scenario"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather", "--device", "cuda"],
     "--device cuda does not apply to DLO modes"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather-coded3"], "dlo-allgather-coded3 is not allowed"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather", "--num-slots", "1"],
     "--num-slots 1 is not allowed"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather", "--profile-dir", "x"],
     "--profile-dir needs CUDA ranks"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather-codedauto", "--warmup", "1"],
     "--warmup 1 is not allowed with dlo-allgather-codedauto"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather", "--plan-h2d-gbps", "0"],
     "--plan-h2d-gbps 0.0 is not allowed"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather", "--nproc", "2,2"], "--nproc '2,2'"),
    (["--scenario", "module-swap", "--modes", "modul"], "--modes modul is not allowed with --scenario module-swap"),
    (["--scenario", "module-swap", "--tiny"], "--tiny applies to single-GPU modes"),
    (["--scenario", "module-swap", "--rounds", "0"], "--rounds 0 is not allowed"),
    (["--scenario", "flux-12b-1024", "--tiny", "--modes", "module"], "module modes run with --scenario module-swap"),
    (["--scenario", "flux-12b-1024", "--tiny", "--device", "cpu", "--modes", "layerwise", "--profile-dir", "x"],
     "--profile-dir profiles the CUDA copy and compute lanes"),
])
def test_perf_run_refuses_what_its_family_does_not_take(argv, words, capsys):
    """Every refusal is exit code 2 with a line naming the option or mode and what to do, before
    any process starts."""
    assert perf_main(["run", *argv]) == 2
    assert words in capsys.readouterr().err


def test_module_swap_without_cuda_is_refused(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-machine refusal")  # never on CI's CPU machine
    assert perf_main(["run", "--scenario", "module-swap", "--modes", "module"]) == 2
    assert "module-swap needs a CUDA GPU" in capsys.readouterr().err


def test_list_names_every_scenario_and_mode_family(capsys):
    assert perf_main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("flux-12b-1024", "wan-14b-480p", "module-swap", "module-coded2", "dlo-allgather-codedauto",
                 "dlo-rank-local", "staging, t<N>", "diffusers-leaf", "layerwise-pinned-half"):
        assert name in out, name


# ------------------------------------------------------------------ DLO modes (perf/dlo.py)

@pytest.mark.parametrize("world,ratio,ratio_max,pinned", [(2, "ratio_to_floor", 1.1, 0.51),
                                                          (4, "ratio_to_resident", 1.05, 0.26),
                                                          (8, "ratio_to_resident", 1.05, 0.13)])
def test_dlo_targets_per_world(world, ratio, ratio_max, pinned):
    from perf.dlo import targets_for

    assert targets_for(world) == {"ratio": ratio, "ratio_max": ratio_max, "pinned_fraction_max": pinned}
    with pytest.raises(ValueError, match="world=1"):
        targets_for(1)


def test_dlo_options_nproc_and_coded_floor():
    """Resident first; ranks lists; a coded mode's ratio_to_floor against the UNCODED floor (at N=2,
    24 GB streamed, 55 GB/s, resident 170 ms: 24e9 / 2 / 55e9 = 218.2 ms; its coded shard of 8 GB
    per rank would floor at the resident 170 ms)."""
    from perf.dlo import CODED_MODES, coded_figures, dlo_run, parse_nproc

    run_ = dlo_run(["dlo-allgather-coded2", "dlo-allgather-codedp"], num_slots=3)
    assert run_.modes == ("resident", "dlo-allgather-coded2", "dlo-allgather-codedp") and run_.num_slots == 3
    assert CODED_MODES == {"dlo-allgather-coded": "exp-k", "dlo-allgather-coded2": "exp-k2",
                           "dlo-allgather-codedp": "exp-kp", "dlo-allgather-codedauto": "auto"}
    assert parse_nproc("8,4") == [8, 4]
    for bad in ("0", "four", ""):
        with pytest.raises(ValueError, match="--nproc"):
            parse_nproc(bad)
    f0 = {"streamed_gb": 24.0, "h2d_gb_per_rank": 8.0, "coded_bytes": 16_000_000_000, "bits_per_weight": 10.9,
          "coded_ratio": 0.68}
    out = coded_figures(f0, 170.0, 55.0, 2, 200.0)
    assert out["floor_ms"] == pytest.approx(24e9 / 2 / 55e9 * 1e3, abs=0.01)
    assert out["coded_floor_ms"] == pytest.approx(170.0, abs=0.01) and out["ratio_to_floor"] < 1
    assert "floor_ms" not in coded_figures(f0, 170.0, 0.0, 2, 200.0)  # CPU: no link measured


def test_dlo_student_t_fill():
    from perf.dlo import FLUX_TINY, build_model

    normal, heavy = build_model(FLUX_TINY, "cpu"), build_model(FLUX_TINY, "cpu", weight_fill="student-t")
    kurt = lambda w: float(((w - w.mean()) ** 4).mean() / w.var() ** 2)  # noqa: E731
    w_n, w_t = normal.transformer_blocks[0].attn.to_q.weight, heavy.transformer_blocks[0].attn.to_q.weight
    assert kurt(w_n) < 3.5 < kurt(w_t)
    with pytest.raises(ValueError, match="weight_fill='uniform'"):
        build_model(FLUX_TINY, "cpu", weight_fill="uniform")


def test_dlo_scaling_row_takes_the_allgather_runs_own_resident_and_bus_rate():
    """In a merged file the resident mode and the top-level all-gather rate may be a later run's:
    the scaling table takes those the AllGather mode was measured with."""
    from perf.results import scaling_table

    ag = {"step_ms": 239.0, "ratio_to_resident": 1.378, "ratio_to_floor": 1.121, "pinned_host_gb_per_rank": 11.84,
          "pinned_fraction": 0.497, "host_gb_per_rank": 11.84, "host_fraction": 0.497, "setup_s": 2.7,
          "bit_exact": True, "resident_ms": 173.456, "allgather_busbw_gbps": 259.6}
    res = {"gpu": "NVIDIA H200", "allgather_busbw_gbps": 100.0, "allgather_backend": "nccl",
           "modes": {"resident": {"step_ms": 168.7}, "dlo-allgather": ag}}
    row = scaling_table({2: res, 4: "not run: 4 ranks need 4 GPUs, torch sees 2"}).splitlines()
    assert row[2] == ("| 2 | 173.5 ms | 239.0 ms | 1.378 | 1.121 | 11.84 GB (0.497x) | 11.84 GB (0.497x) | 2.7 s | "
                      "True | 260 GB/s nccl |")
    assert row[3].startswith("| 4 | not run: 4 ranks need 4 GPUs")


def _perf_run(*argv, timeout=400):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "perf", "run", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_dlo_modes_tiny_on_two_gloo_ranks_merge_into_the_x2_file(tmp_path):
    """`perf run --nproc 2 --tiny` (CPU ranks over gloo): bit-exact DLO modes, the scaling table, and
    the result merged into <scenario>-cpu-x2.json: a mode already filed there stays as it was, the new
    ones carry their commit, date, weight fill and slot count."""
    path = tmp_path / "flux-12b-1024-tiny-cpu-x2.json"
    earlier = {"step_ms": 5.0, "floor_ms": 4.0, "ratio_to_floor": 1.25, "commit": "0" * 40,
               "date": "2026-11-30T10:00:00Z"}
    path.write_text(json.dumps({"scenario": "flux-12b-1024-tiny", "gpu": "cpu", "gpus": 2, "commit": "0" * 40,
                                "torch": "2.13.0", "date": "2026-11-30T10:00:00Z",
                                "modes": {"resident": {"step_ms": 4.0}, "layerwise-coded": earlier}}))
    out = _perf_run("--scenario", "flux-12b-1024", "--tiny", "--modes", "dlo-allgather,dlo-rank-local",
                    "--nproc", "2", "--steps", "2", "--warmup", "1", "--num-slots", "3", "--out", str(tmp_path))
    assert f"result: {path}" in out
    row = next(line for line in out[out.index("DLO scaling"):].splitlines() if line.startswith("| 2 |"))
    assert "| True |" in row and "gloo" in row, row
    got = json.loads(path.read_text())
    validate_result(got)
    assert got["gpus"] == 2 and got["allgather_backend"] == "gloo" and got["allgather_gbps"] > 0
    assert got["modes"]["layerwise-coded"] == earlier and got["merged_from"] == "2026-11-30T10:00:00Z"
    assert got["modes"]["resident"]["commit"] == got["commit"] != "0" * 40  # this run's resident replaced it
    for mode in ("dlo-allgather", "dlo-rank-local"):  # (coded DLO modes decode under the Triton interpreter here:
        f = got["modes"][mode]                           # ~15 s a tiny step, left to the DLO tests)
        assert f["bit_exact"] is True and len(f["step_ms_per_rank"]) == 2, (mode, f)
        assert (f["weight_fill"], f["num_slots"], f["commit"], f["date"]) == ("normal", 3, got["commit"], got["date"])
        assert f["resident_ms"] == got["modes"]["resident"]["step_ms"] and f["allgather_busbw_gbps"] > 0
    assert got["modes"]["dlo-allgather"]["shard_group_size"] == 2 and got["modes"]["dlo-rank-local"]["shard_group_size"] == 1
    assert got["num_slots"] == 3 and got["modes"]["dlo-allgather"]["host_fraction"] < 0.75


# ------------------------------------------------------------------ the module-swap scenario (perf/module_swap.py)

def test_module_swap_pieces_on_cpu(capsys):
    """The module-coded figures on the CPU (the timed loop is GPU only): Student-t stacks offloaded
    coded, arrivals against the uncoded floor, the table and the verdicts; the modes' order."""
    import types

    from perf import module_swap as ms
    from weightstream import OffloadConfig, offload_pipeline

    assert ms.parse_modes(["module-coded", "module", "diffusers-model"]) == ("diffusers-model", "module", "module-coded")
    assert ms.CODECS == {"module": "none", "module-coded": "exp-k", "module-coded2": "exp-k2", "module-codedp": "exp-kp"}
    with pytest.raises(ValueError, match="--fill 'laplace' is not allowed"):
        ms.SwapSizes(fill="laplace")
    cpu = torch.device("cpu")
    enc = ms.build_stack(0.0004, 128, cpu, seed=1, weight_fill="student-t")
    dit = ms.build_stack(0.001, 128, cpu, seed=2, weight_fill="student-t")
    w = dit.layers[0].weight.float()
    assert w.std().item() == pytest.approx(ms.WEIGHT_STD, rel=0.2)
    assert (w.abs() > 6 * ms.WEIGHT_STD).float().mean().item() > 1e-4  # heavy tails, unlike N(0, 0.02)
    sizes = {"text_encoder": ms.nbytes(enc), "transformer": ms.nbytes(dit)}
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    want = copy.deepcopy(dit)(x)
    handle = offload_pipeline(types.SimpleNamespace(text_encoder=enc, transformer=dit),
                              OffloadConfig.module(["dit", "text_encoder"], weight_codec="exp-k", progress=False),
                              device="cpu")
    assert torch.equal(dit(x), want)
    raw = {"arrival_ms": {"text_encoder": 1.0, "transformer": 2.0}, "departure_ms": {"transformer": 0.01},
           "setup_s": 0.5, "run_mb": 64.0, **ms.coded_stats(handle.stats())}
    f = ms.figures(raw, sizes, h2d=1.0)
    assert f["floor_ms"] == pytest.approx(sizes["transformer"] / 1e9 * 1e3, rel=1e-3)  # raw bytes / H2D
    assert f["coded_floor_ms"] < 0.8 * f["floor_ms"] and 10.0 < f["bits_per_weight"]["transformer"] < 12.5
    result = {"scenario": ms.SCENARIO, "gpu": "cpu", "gpus": 0, "commit": "x", "torch": "2", "h2d_gbps": 1.0,
              "date": "2026-12-01T00:00:00Z", "component_gb": {k: v / 1e9 for k, v in sizes.items()},
              "modes": {"module-coded": f}}
    validate_result(result)
    assert "coded: text_encoder" in ms.table(result)
    assert ms.verdicts(result["modes"])[0].startswith("module-coded arrivals <= 0.75x the uncoded floor: NO")
    handle.disable()


# ------------------------------------------------------------------ on the GPU (the lead's H200 run; not in CI)

@pytest.mark.gpu
def test_gpu_mmap_direct_and_staging_modes_tiny(tmp_path):
    """On CUDA the mmap source copies registered pages directly; -staging packs every block through
    the bounce buffers on the given threads. Both compute the resident output bit for bit."""
    modes = ["layerwise", "layerwise-mmap", "layerwise-mmap-staging-t2"]
    result, path, ok = run("flux-12b-1024", modes, steps=2, warmup=1, out_dir=tmp_path / "res", tiny=True,
                           device="cuda", touch_gb=0, ckpt_dir=str(tmp_path / "ckpt"), mode_timeout=300)
    assert ok, result.get("failed")
    assert path.name == result_filename("flux-12b-1024-tiny", result["gpu"], result["gpus"])
    direct, staged = result["modes"]["layerwise-mmap"], result["modes"]["layerwise-mmap-staging-t2"]
    assert direct["output_equals_resident"] is True and staged["output_equals_resident"] is True
    assert direct["stats"]["direct_blocks"] > 0 and direct["h2d_gbps"] > 0
    assert staged["stats"]["staged_blocks"] == staged["stats"]["blocks_streamed"] and staged["stats"]["staging_threads"] == 2
    assert staged["staging_pack_gbps"] > 0 and staged["ratio_to_pinned"] > 0


@pytest.mark.gpu
def test_gpu_module_swap_small_components(tmp_path):
    """`perf run --scenario module-swap` at small sizes: arrivals against their floors, the coded
    mode against the uncoded floor, every mode with its commit, the same outputs across modes."""
    out = _perf_run("--scenario", "module-swap", "--modes", "module,module-coded", "--encoder-gb", "0.05",
                    "--dit-gb", "0.1", "--width", "1024", "--rounds", "1", "--out", str(tmp_path), timeout=600)
    (path,) = tmp_path.glob("module-swap-*.json")
    assert f"result: {path}" in out and "module-coded arrivals <= 0.75x the uncoded floor" in out
    got = json.loads(path.read_text())
    validate_result(got)
    assert got["outputs_equal_across_modes"] is True and got["weight_fill"] == "student-t"
    for mode in ("module", "module-coded"):
        f = got["modes"][mode]
        assert f["commit"] == got["commit"] and f["floor_ms"] > 0 and set(f["arrival_ms"]) == {"text_encoder", "transformer"}
    assert got["modes"]["module-coded"]["coded_floor_ms"] < got["modes"]["module"]["floor_ms"]


def test_kernel_bench_modes_are_valid_names_without_a_streaming_floor():
    """bench_codec's identity modes (encode-*) validate and, like copy-* / triton-*, stream nothing."""
    from perf.results import is_offloaded, validate_mode_name

    for mode in ("encode-identity-64mb", "encode-identity-64mb-k2", "copy-d2d", "triton-decode"):
        validate_mode_name(mode)
        assert not is_offloaded(mode), mode
    assert is_offloaded("layerwise-coded")
