"""`python -m weightstream plan --model M --budget-gb X`: the placement for a
model and a budget, from real block layouts and counted FLOPs (no GPU)."""
import json

import pytest

from weightstream.__main__ import main
from weightstream.offload.plan.placement import PlanInputs, plan
from weightstream.plan_cli import CALIBRATED_TFLOPS, DEFAULT_TFLOPS, figures


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_toy_figures_are_the_executors_bytes_and_the_blocks_flops():
    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import ToyDiT

    fig = figures("toy")
    # ToyBlock: up (width x hidden) and down (hidden x width) over 2 x 5 tokens, 2 FLOPs per MAC
    hidden = [64, 64] + [(3 + i) * 32 for i in range(5)]
    assert fig.block_flops == tuple(2 * 2 * 10 * 32 * h for h in hidden)
    w = OffloadedTransformer(ToyDiT(), OffloadConfig.layerwise(progress=False), device="cpu")
    st = w.stats()
    w.disable()
    assert fig.fixed_bytes == st["resident_bytes"]
    assert sum(fig.block_bytes) == st["streamed_bytes_per_step"] and 2 * max(fig.block_bytes) == st["slot_bytes"]
    assert fig.block_names[0] == "double_blocks.0" and len(fig.block_names) == 7


def test_plan_prints_the_planners_placement_for_tiny_flux(capsys):
    fig = figures("tiny-flux")
    budget_gb = (fig.fixed_bytes + 3 * max(fig.block_bytes)) / 1e9
    out = run_json(capsys, "--model", "tiny-flux", "--budget-gb", repr(budget_gb), "--h2d-gbps", "0.001")
    compute = tuple(f / (DEFAULT_TFLOPS * 1e12) * 1e3 for f in fig.block_flops)
    want = plan(PlanInputs(link_bytes=fig.block_bytes, device_bytes=fig.block_bytes, compute_ms=compute,
                           h2d_gbps=0.001, budget_bytes=int(budget_gb * 1e9), fixed_device_bytes=fig.fixed_bytes))
    assert out["resident_blocks"] == list(want.resident) and out["num_slots"] == want.num_slots
    assert out["predicted_ms"] == pytest.approx(want.predicted_ms) and out["device_bytes"] <= budget_gb * 1e9
    assert out["resident_blocks"] and out["compute_source"].startswith("ESTIMATED from FLOPs")
    assert out["first_n"]["predicted_ms"] >= out["predicted_ms"] - 1e-9
    assert main(["plan", "--model", "tiny-flux", "--budget-gb", repr(budget_gb), "--h2d-gbps", "0.001"]) == 0
    text = capsys.readouterr().out
    assert "ESTIMATED from FLOPs" in text and "no GPU measured here" in text
    assert f"plan: {want.describe()}" in text and "best first-N under the same budget: resident_layers=" in text
    assert "resident blocks: " + ", ".join(fig.block_names[i] for i in want.resident) in text


def test_given_compute_table_streams_the_block_after_the_long_one(capsys):
    # room for two resident blocks and one slot: the long block 2 must stay resident, so the
    # streamed block's 10 ms load hides under its 50 ms compute (streaming 0 or 1 ties)
    fig = figures("tiny-wan", count_flops=False)
    assert len(set(fig.block_bytes)) == 1 and len(fig.block_bytes) == 3
    budget = (fig.fixed_bytes + fig.block_bytes[0] * 3) / 1e9
    h2d = fig.block_bytes[0] / 10e6  # GB/s: a load takes 10 ms
    out = run_json(capsys, "--model", "wan", "--budget-gb", repr(budget), "--compute-ms", "0.5,0.5,50",
                   "--h2d-gbps", repr(h2d), "--slots", "2")
    assert out["compute_source"] == "given (--compute-ms)" and out["compute_ms"] == [0.5, 0.5, 50.0]
    assert out["resident_blocks"] == [0, 2] and out["predicted_ms"] == pytest.approx(51.0)  # ties: lower indices
    # any first-N streams block 2, whose load can start only after its own compute: it waits
    # 10 ms less the short blocks before it (1 resident: 60 ms, as with 2; ties: fewer bytes)
    assert out["first_n"]["resident_layers"] == 1 and out["first_n"]["predicted_ms"] == pytest.approx(60.0)


def test_flux_12b_on_meta(capsys):
    """The real-size model is built on meta: 57 blocks, 23.7 GB, FLOPs of a 1024x1024 step."""
    out = run_json(capsys, "--model", "flux-12b", "--budget-gb", "16")
    assert out["model"] == "flux-12b-1024" and len(out["blocks"]) == 57
    assert 23.5e9 < sum(out["block_bytes"]) < 23.9e9 and 0.05e9 < out["fixed_bytes"] < 0.2e9
    # 74.4 TFLOP per step at the calibrated rate: about the measured resident step (173 ms)
    assert 165 < sum(out["compute_ms"]) < 180 and str(CALIBRATED_TFLOPS["flux-12b-1024"]).rstrip("0").rstrip(".") in \
        out["compute_source"]
    assert out["device_bytes"] <= 16e9 and len(out["resident_blocks"]) > 10
    assert out["predicted_ms"] <= out["first_n"]["predicted_ms"] + 1e-9
    # the double blocks are 2.4x the single ones: all streamed ones share the largest slot size
    assert max(out["block_bytes"]) > 2 * min(out["block_bytes"])


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope", "--budget-gb", "1"], "--model 'nope' is not allowed; choose from: tiny-flux"),
    (["--model", "toy", "--budget-gb", "0.00001"], "budget_bytes=10000 is too small"),
    (["--model", "toy", "--budget-gb", "1", "--compute-ms", "1,2"], "--compute-ms has 2 values"),
    (["--model", "toy", "--budget-gb", "1", "--compute-ms", "a"], "--compute-ms 'a' is not allowed"),
    (["--model", "toy", "--budget-gb", "1", "--compute-ms", "-1"], "--compute-ms '-1' is not allowed"),
    (["--model", "flux-12b"], "--model flux-12b: listing blocks without --budget-gb"),
    (["--model", "toy", "--budget-gb", "1", "--resident-layers", "2"], "--resident-layers 2 is not allowed with"),
    (["--model", "toy", "--json", "--cuda-graphs"], "--cuda-graphs, --json need --budget-gb"),
    (["--model", "toy", "--budget-gb", "1", "--codec-ratio", "1.5"], "--codec-ratio 1.5 is not allowed"),
])
def test_bad_values_are_one_line_errors(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, flag", [
    (["--budget-gb", "0"], "--budget-gb"), (["--budget-gb", "x"], "--budget-gb"), (["--budget-gb", "inf"], "--budget-gb"),
    (["--budget-gb", "1", "--h2d-gbps", "-3"], "--h2d-gbps"), (["--budget-gb", "1", "--slots", "1,2"], "--slots"),
    (["--budget-gb", "1", "--tflops", "0"], "--tflops"),
])
def test_bad_numbers_exit_with_usage(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "toy", *argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_listing_without_a_budget_is_unchanged(capsys):
    assert main(["plan", "--model", "tiny-flux", "--resident-layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "5 blocks, 3 streamed through 2 slots" in out


def test_cuda_graphs_plans_the_step_local_schedule(capsys):
    fig = figures("tiny-wan", count_flops=False)
    budget = repr((fig.fixed_bytes + fig.block_bytes[0] * 3) / 1e9)
    h2d = repr(fig.block_bytes[0] / 10e6)  # 10 ms loads
    argv = ["--model", "wan", "--budget-gb", budget, "--compute-ms", "0.5,0.5,50", "--h2d-gbps", h2d, "--slots", "2"]
    eager, graphs = run_json(capsys, *argv), run_json(capsys, *argv, "--cuda-graphs")
    assert not eager["cuda_graphs"] and graphs["cuda_graphs"]
    # in a graph the one streamed block's 10 ms load starts with the step and cannot hide under
    # block 2's 50 ms: streaming 0 costs 10 + 1 + 50, streaming 1 10 + 0.5 + 50, streaming 2
    # (behind the two short resident blocks) 10 + 50
    assert graphs["resident_blocks"] == [0, 1] and graphs["predicted_ms"] == pytest.approx(60.0)
    assert eager["resident_blocks"] == [0, 2] and eager["predicted_ms"] == pytest.approx(51.0)


def test_codec_ratio_and_decode_rate_enter_the_model(capsys):
    fig = figures("tiny-wan", count_flops=False)
    base = ["--model", "wan", "--budget-gb", repr((fig.fixed_bytes + 2 * fig.block_bytes[0]) / 1e9),
            "--compute-ms", "1", "--h2d-gbps", repr(fig.block_bytes[0] / 10e6), "--slots", "2"]
    raw = run_json(capsys, *base)  # streams all three: 10 ms loads, transfer-bound
    coded = run_json(capsys, *base, "--codec-ratio", "0.5", "--decode-gbps", repr(fig.block_bytes[0] / 1e6))
    assert raw["resident_blocks"] == [] and raw["predicted_ms"] == pytest.approx(30.0)
    assert coded["link_bytes"] == [-(-b // 2) for b in fig.block_bytes]
    assert coded["predicted_ms"] == pytest.approx(3 * (5.0 + 1.0), rel=1e-3)  # copy 5 ms + decode 1 ms per block
    assert main(["plan", *base, "--codec-ratio", "0.5"]) == 0
    assert "codec: 0.5 of the raw bytes cross the link, no decode time" in capsys.readouterr().out
