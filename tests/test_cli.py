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
    assert "outputs match bit for bit: True" in out and "ms/step" in out


def test_demo_resident_layers(capsys):
    assert main(["demo", "--model", "toy", "--steps", "1", "--device", "cpu", "--resident-layers", "2"]) == 0
    assert "resident 2" in capsys.readouterr().out


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
