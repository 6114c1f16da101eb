"""The command line (`make demo` runs `python -m weightstream demo`)."""
import os
import subprocess
import sys

import pytest

from weightstream.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("model", ["toy", "flux", "wan"])
def test_demo_layer_mode_matches_bit_for_bit(model, capsys):
    assert main(["demo", "--model", model, "--steps", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "outputs match bit for bit: True" in out and "step (median)" in out
    assert "weights held on the device" in out and "host store" in out


def test_demo_resident_layers(capsys):
    assert main(["demo", "--model", "toy", "--steps", "1", "--device", "cpu", "--resident-layers", "2"]) == 0
    assert "2 resident" in capsys.readouterr().out


def test_demo_resident_layers_auto(capsys):
    assert main(["demo", "--model", "flux", "--steps", "1", "--device", "cpu", "--resident-layers", "auto"]) == 0
    out = capsys.readouterr().out
    assert "resident layers: auto, planner budget" in out and "outputs match bit for bit: True" in out


def test_demo_closes_with_the_pipeline_recipe(capsys):
    assert main(["demo", "--model", "toy", "--steps", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for step in ("from_pretrained(", "offload_pipeline(pipe,", "= pipe(", "save_pretrained("):
        assert step in out.split("next, your own pipeline")[1], step


def test_a_missing_extra_is_one_line_naming_it():
    from weightstream.__main__ import missing_extra

    line = missing_extra(ModuleNotFoundError("No module named 'diffusers'", name="diffusers"), "weightstream plan")
    assert line == "weightstream plan needs diffusers, which is not installed: pip install 'weightstream[models]'"
    assert missing_extra(ModuleNotFoundError("x", name="matplotlib.figure"), "m").endswith("'weightstream[report]'")
    assert missing_extra(ModuleNotFoundError("x", name="something_else"), "m") is None


def test_demo_module_mode(capsys):
    assert main(["demo", "--mode", "module", "--device", "cpu"]) == 0
    assert "outputs match the resident pipeline bit for bit: YES" in capsys.readouterr().out


def test_demo_dlo_starts_local_ranks_without_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-m", "weightstream", "demo", "--dlo", "allgather"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "all 2 ranks match bit for bit: True" in r.stdout


def test_plan_lists_blocks(capsys):
    assert main(["plan", "--model", "flux", "--resident-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "5 blocks, 4 streamed through 2 slots" in out and "single_transformer_blocks.2" in out


def test_bad_arguments_exit_with_usage():
    with pytest.raises(SystemExit) as e:
        main(["demo", "--model", "nope"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv, message", [
    (["demo", "--resident-layers", "99", "--device", "cpu"], "--resident-layers 99 is not allowed"),
    (["plan", "--resident-layers", "99"], "--resident-layers 99 is not allowed"),
    (["demo", "--device", "tpu"], "--device 'tpu' is not allowed"),
])
def test_bad_values_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_one_line_error(capsys):
    assert main(["demo", "--device", "cuda"]) == 2
    assert "torch sees no CUDA device here" in capsys.readouterr().err


def test_resident_layers_takes_an_integer_or_auto(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--resident-layers", "many"])
    assert e.value.code == 2
    assert "'many' is not allowed; give an integer >= 0 or 'auto'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_steps_must_be_a_positive_integer(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--steps", value])
    assert e.value.code == 2
    assert "--steps" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["demo", "plan"])
def test_help_does_not_import_torch(sub):
    code = (f"import sys; from weightstream.__main__ import main\n"
            f"try:\n    main(['{sub}', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_importing_the_public_api_does_not_import_dynamo():
    code = ("import sys\nfrom weightstream import OffloadConfig, OffloadedTransformer, offload_pipeline, "
            "offload_from_safetensors, ParallelConfig\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported at import time'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_bench_outside_the_repository_root_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "run", "--scenario", "flux-12b-1024"]) == 2
    assert "not installed" in capsys.readouterr().err


FACTORY = '''from weightstream import models


def make():
    return models.ToyDiT(), models.toy_inputs()


def bare():
    return models.ToyDiT()
'''


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_models", raising=False)  # each test imports its own my_models.py


def test_plan_takes_the_users_own_model(user_models, capsys):
    assert main(["plan", "--model", "my_models:make"]) == 0
    assert "ToyDiT: 7 blocks" in capsys.readouterr().out
    assert main(["plan", "--model", "my_models:make", "--budget-gb", "0.0003"]) == 0
    out = capsys.readouterr().out
    assert "your factory my_models:make" in out and "ESTIMATED from FLOPs" in out and "plan:" in out
    assert main(["plan", "--model", "my_models:bare", "--budget-gb", "0.0003", "--compute-ms", "1"]) == 0
    assert "given (--compute-ms)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "my_models:bare", "--budget-gb", "0.0003"], "the factory returns no example inputs"),
    (["plan", "--model", "my_models:nope"], "cannot load the factory"),
    (["plan", "--model", "nowhere:make", "--budget-gb", "1"], "cannot load the factory (No module named"),
])
def test_a_bad_factory_is_a_one_line_error(user_models, argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_bench_list_names_every_mode():
    import re

    from perf.dlo import MODES as DLO_MODES
    from perf.modes import _LAYERWISE_VARIANT, HALF_PINNED_MODES, PEER_MODES
    from perf.module_swap import MODES as MODULE_MODES

    r = subprocess.run([sys.executable, "-m", "weightstream", "bench", "list"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    listed = set(re.findall(r"[\w<>-]+", r.stdout))
    spelled = {r"r(\d+)": "r<N>", r"(\d+)gb": "<N>gb", r"t([1-9]\d*)": "t<N>", r"s([1-9]\d*)": "s<N>", "coded2?": "coded"}
    variants = [spelled.get(v, v) for v in _LAYERWISE_VARIANT.pattern[2:-2].split("|")] + ["coded2"]
    want = ["resident", "resident-graph", "resident-compile", "resident-tfill", *PEER_MODES, *HALF_PINNED_MODES,
            *DLO_MODES, *MODULE_MODES, *variants]
    missing = [m for m in want if m not in listed]
    assert not missing, f"bench list omits {missing}"


META_FACTORY = '''import torch
from diffusers import FluxTransformer2DModel

def make_dit():
    with torch.device("meta"):
        return FluxTransformer2DModel(num_layers=19, num_single_layers=38).to(torch.bfloat16)
'''


def test_plan_takes_a_factory_on_meta(tmp_path, monkeypatch, capsys):
    """docs/cli.md's my_models.py, as written there: a Flux.1-sized model on meta, planned without memory."""
    doc = open(os.path.join(ROOT, "docs", "cli.md")).read()
    assert META_FACTORY.strip() in doc, "docs/cli.md's factory example changed: update this test"
    (tmp_path / "my_models.py").write_text(META_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    assert main(["plan", "--model", "my_models:make_dit", "--budget-gb", "16", "--compute-ms", "4"]) == 0
    out = capsys.readouterr().out
    assert "FluxTransformer2DModel, 57 blocks" in out and "budget 16 GB" in out and "plan:" in out
