"""The planned default (issue 38): ``OffloadConfig.layerwise()`` with no arguments plans the residency
and the coding from the first step, within the free device memory less the headroom (capped by
``device_memory_budget_gb``); explicit ``resident_layers`` / ``weight_codec`` keep their meaning.

The resolution is pure (``sources/select.py`` ``resolve_default``) and checked over every cell of
the support matrix. On the CPU the default streams every block raw unless ``device_memory_budget_gb``
gives a budget to plan in; the planned runs below give one, and the link rate a slow (transfer-bound)
or fast (compute-bound) link would measure, as tests/test_auto_joint.py does. Every output is
compared with the resident model bit for bit.
"""
import copy
import itertools
import json

import pytest
import torch

from layerwise_cases import first
from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import ToyDiT, toy_inputs
from weightstream.offload.config import AUTO_DEVICE_MARGIN_GB, LayerOptions
from weightstream.offload.sources.select import (GRAPHS, SUPPORT, TRANSPORTS, Topology, refusal_error,
                                                 resolve_default, select)
from weightstream import UnsupportedCombinationError

DEV = "cpu"
FAST_DECODE = {"exp-k": 1e3, "exp-k2": 1e3}


@pytest.fixture(autouse=True)
def torch_decode(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # decode_torch on the CPU (as tests/test_auto_codec.py)


# -- the sentinel ---------------------------------------------------------------------------------

def test_not_given_is_distinguishable_from_explicit_values():
    plain = OffloadConfig.layerwise()
    assert plain.unset_keys == ("resident_layers", "weight_codec")
    assert plain.weight_codec is None and plain.resident_layers == 0  # 0: what it falls back to
    assert OffloadConfig(mode="layer", components=["dit"]).unset_keys == plain.unset_keys
    assert OffloadConfig.coerce(None).unset_keys == plain.unset_keys
    assert OffloadConfig.layerwise(resident_layers=0).unset_keys == ("weight_codec",)
    assert OffloadConfig.layerwise(weight_codec="none").unset_keys == ("resident_layers",)
    assert OffloadConfig.layerwise(resident_layers=0, weight_codec="none").unset_keys == ()
    assert OffloadConfig.layerwise(weight_transfer="rank-local").unset_keys == plain.unset_keys
    assert LayerOptions() != LayerOptions(resident_layers=0)


def test_explicit_values_survive_serialisation():
    cfg = OffloadConfig.layerwise(resident_layers=0, weight_codec="none")
    d = cfg.to_dict()
    assert d["layer_options"] == {"dit": {"resident_layers": 0}} and d["weight_codec"] == "none"
    for back in (OffloadConfig.from_dict(d), OffloadConfig.from_json(cfg.to_json())):
        assert back == cfg and back.unset_keys == ()
    assert OffloadConfig.layerwise().to_dict() == {"mode": "layer", "components": ["dit"]}
    assert OffloadConfig.from_dict(OffloadConfig.layerwise().to_dict()).unset_keys == OffloadConfig.layerwise().unset_keys


def test_schema_form_keeps_its_documented_meaning():
    """vLLM-Omni's diffusion_offload_config: an explicit resident_layers keeps its meaning (0 is 0);
    without it (or with JSON null) the residency is planned; weight_codec is weightstream's own key."""
    cuda = Topology(device_type="cuda")
    zero = OffloadConfig.from_json(json.dumps(
        {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 0}}}))
    assert select(zero, cuda).residency == "none"
    three = OffloadConfig.from_dict({"mode": "layer", "components": ["dit"],
                                     "layer_options": {"dit": {"resident_layers": 3}}})
    assert select(three, cuda).residency == "fixed" and three.resident_layers == 3
    for d in ({"mode": "layer", "components": ["dit"]},
              {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": None}},
               "weight_codec": None}):
        s = select(OffloadConfig.from_dict(d), cuda)
        assert (s.codec, s.residency, s.planned) == ("auto", "auto", ("resident_layers", "weight_codec"))
    with pytest.raises(ValueError, match="null"):
        OffloadConfig.from_dict({"mode": "layer", "components": ["dit"],
                                 "layer_options": {"dit": {"resident_layers": "some"}}})


# -- the resolution, per cell --------------------------------------------------------------------

def _topology(transport: str, device_type: str) -> tuple[Topology, object]:
    transfer = {"dlo-allgather": "allgather", "dlo-rank-local": "rank-local"}.get(transport)
    topo = Topology(2 if transfer else 1, 0, transfer, device_type)
    return topo, ("a mapped checkpoint" if transport == "mmap" else None)


def _config(transport: str, graphs: str, **kw) -> OffloadConfig:
    if transport == "module":
        return OffloadConfig.module(components=("dit",), cuda_graphs=graphs, **kw)
    transfer = {"dlo-allgather": "allgather", "dlo-rank-local": "rank-local"}.get(transport)
    return OffloadConfig.layerwise(weight_transfer=transfer, cuda_graphs=graphs, **kw)


CELLS = [(t, g) for t in TRANSPORTS for g in GRAPHS
         if not (t == "module" and g == "on")]  # module refuses CUDA graphs whatever the default


@pytest.mark.parametrize("transport,graphs", CELLS)
def test_the_default_resolves_to_a_supported_cell_or_to_todays(transport, graphs):
    """On CUDA each key not given is "auto" where its cell is supported, else today's value; never a
    refusal that today's values (0, "none") would not give."""
    topo, ckpt = _topology(transport, "cuda")
    today = (transport, "none", "none", graphs)
    try:
        cfg = _config(transport, graphs)
    except UnsupportedCombinationError:
        assert SUPPORT[today] is not None
        return
    if SUPPORT[today] is not None:
        with pytest.raises(UnsupportedCombinationError):
            select(cfg, topo, ckpt)
        return
    s = select(cfg, topo, ckpt)
    assert SUPPORT[s.cell] is None
    want_codec = "auto" if transport != "module" and SUPPORT[(transport, "auto", "none", graphs)] is None else "none"
    assert s.codec == want_codec
    want_res = "auto" if transport != "module" and any(
        SUPPORT[(transport, c, "auto", graphs)] is None for c in ("none", "auto")) else "none"
    assert s.residency == want_res
    assert s.planned == tuple(k for k, v in (("resident_layers", want_res), ("weight_codec", want_codec))
                              if v == "auto")


def test_what_each_transport_does_with_the_default_on_cuda():
    got = {}
    for transport, graphs in CELLS:
        topo, ckpt = _topology(transport, "cuda")
        try:
            s = select(_config(transport, graphs), topo, ckpt)
            got[transport, graphs] = (s.codec, s.residency)
        except UnsupportedCombinationError:
            got[transport, graphs] = "refused"
    assert got == {
        ("pinned", "off"): ("auto", "auto"), ("pinned", "on"): ("auto", "none"),  # no auto placement under graphs
        ("mmap", "off"): ("none", "none"), ("mmap", "on"): "refused",  # as today: raw mmap cannot be captured
        ("dlo-allgather", "off"): ("auto", "none"), ("dlo-allgather", "on"): ("auto", "none"),
        ("dlo-rank-local", "off"): ("auto", "auto"), ("dlo-rank-local", "on"): ("auto", "none"),
        ("module", "off"): ("none", "none"),  # module's "auto" is exp-k2 encoded at setup: not by default
    }


@pytest.mark.parametrize("transport,graphs", CELLS)
def test_on_the_cpu_the_default_is_todays_stream(transport, graphs):
    topo, ckpt = _topology(transport, "cpu")
    try:
        s = select(_config(transport, graphs), topo, ckpt)
    except UnsupportedCombinationError:
        return
    assert (s.codec, s.residency, s.planned) == ("none", "none", ())
    budgeted = select(_config(transport, graphs, device_memory_budget_gb=1.0), topo, ckpt)
    if transport == "pinned":  # a budget to plan in: planned as on a device
        assert budgeted.planned and budgeted.codec == "auto"
    else:  # DLO ranks must resolve alike; mmap and module refuse auto
        assert (budgeted.codec, budgeted.residency) == ("none", "none")


@pytest.mark.parametrize("codec,resident", list(itertools.product(["none", "exp-k", "auto"], [0, 3, [1, 4], "auto"])))
def test_explicit_values_keep_their_meaning(codec, resident):
    cfg = OffloadConfig.layerwise(weight_codec=codec, resident_layers=resident)
    for dev in ("cpu", "cuda"):
        s = select(cfg, Topology(device_type=dev))
        want = "auto" if resident == "auto" else "fixed" if resident else "none"
        assert (s.codec, s.residency, s.planned) == (codec, want, ())


def test_one_key_given_the_other_planned():
    cuda = Topology(device_type="cuda")
    s = select(OffloadConfig.layerwise(weight_codec="none"), cuda)
    assert (s.codec, s.residency, s.planned) == ("none", "auto", ("resident_layers",))
    s = select(OffloadConfig.layerwise(resident_layers=2), cuda)
    assert (s.codec, s.residency, s.planned) == ("auto", "fixed", ("weight_codec",))
    s = select(OffloadConfig.layerwise(weight_codec="exp-k"), cuda, "a mapped checkpoint")
    assert (s.codec, s.residency) == ("exp-k", "none")  # mmap refuses auto placement: today's 0


def test_a_pipelines_text_encoder_streams_as_today_and_the_dit_plans():
    cuda = Topology(device_type="cuda")
    cfg = OffloadConfig.from_dict({"mode": "layer", "components": ["dit", "text_encoder"]})
    enc = cfg.encoder_config()
    assert enc.unset_keys == () and select(enc, cuda).cell == ("pinned", "none", "none", "off")
    assert select(cfg, cuda).planned == ("resident_layers", "weight_codec")
    coded = OffloadConfig.from_dict({"mode": "layer", "components": ["dit", "text_encoder"], "weight_codec": "exp-k"})
    assert coded.encoder_config().weight_codec == "exp-k"  # a codec given applies to both


def test_a_pinned_memory_cap_keeps_the_raw_images():
    """The coded images keep no bounce buffers for blocks left pageable: the default codes nothing there."""
    cuda = Topology(device_type="cuda")
    for kw in (dict(pinned_memory_budget_gb=1.0), dict(pin_memory=False)):
        s = select(OffloadConfig.layerwise(**kw), cuda)
        assert (s.codec, s.residency) == ("none", "auto")


def test_refusals_are_unchanged_by_the_default():
    cfg = OffloadConfig.layerwise(cuda_graphs="on")
    with pytest.raises(UnsupportedCombinationError, match="cuda_graphs='on' cannot capture the mmap"):
        select(cfg, Topology(device_type="cuda"), "a mapped checkpoint")
    assert str(refusal_error(("mmap", "none", "none", "on"), None)).startswith("cuda_graphs='on'")
    assert resolve_default(cfg, "mmap", "cuda") == (("none", "none"), ())


# -- planned runs on the CPU (a budget given, the link rates set) ---------------------------------

def _toy():
    torch.manual_seed(0)
    model = ToyDiT(width=256).to(torch.bfloat16)
    x = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in toy_inputs().items()}
    return model, copy.deepcopy(model), x


@pytest.fixture(scope="module")
def sizes():
    model, _, _ = _toy()
    probe = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device=DEV)
    out = [lay.nbytes for lay in probe.executor.source.layouts], probe.stats()["resident_bytes"]
    probe.disable()
    return out


def _planned(budget_bytes: int, *, slow: bool, progress: bool = False):
    model, ref, x = _toy()
    wrapped = OffloadedTransformer(
        model, OffloadConfig.layerwise(device_memory_budget_gb=budget_bytes / 1e9, progress=progress), device=DEV)
    sb = wrapped._streamed
    assert sb.selection.planned == ("resident_layers", "weight_codec")
    sb.placement.h2d_gbps = 1e-6 if slow else 1e6  # transfer-bound / compute-bound
    sb.codec_planner.h2d_gbps, sb.codec_planner.decode_gbps = sb.placement.h2d_gbps, FAST_DECODE
    return wrapped, ref, x


def _steps(wrapped, ref, x, n: int):
    with torch.no_grad():
        want = first(ref(**x))
        for _ in range(n):
            assert torch.equal(first(wrapped(**x)), want)
    return want


def _until_coded(wrapped, x, want, steps: int = 200) -> None:
    for _ in range(steps):
        if wrapped.stats().get("coding_in_background") is None:
            return
        with torch.no_grad():
            assert torch.equal(first(wrapped(**x)), want)
    raise AssertionError(f"still coding after {steps} steps: {wrapped.stats().get('coding_in_background')}")


def test_transfer_bound_plans_residency_and_coding_bit_exact(sizes, capsys):
    blocks, fixed = sizes
    budget = fixed + 2 * max(blocks) + sum(blocks) // 2
    wrapped, ref, x = _planned(budget, slow=True, progress=True)
    want = _steps(wrapped, ref, x, 3)
    _until_coded(wrapped, x, want)
    _steps(wrapped, ref, x, 2)
    s = wrapped.stats()
    plan = s["plan"]
    assert plan["default"] and plan["planned_keys"] == ["resident_layers", "weight_codec"]
    assert 0 < len(plan["resident_blocks"]) < len(blocks) == plan["measured"]["blocks"]
    assert plan["resident_blocks"] == s["placement"]["resident_blocks"] == s["resident_blocks"]
    assert plan["codec"] in FAST_DECODE and plan["coded_blocks"] == s["codec_plan"]["coded_blocks"]
    assert not set(plan["coded_blocks"]) & set(plan["resident_blocks"])
    assert plan["budget_bytes"] == budget and plan["budget_from"] == "device_memory_budget_gb"
    assert plan["measured"]["h2d_gbps"] == 1e-6 and plan["measured"]["compute_ms"] > 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("weightstream ")]
    assert lines == [f"weightstream plan: {plan['describe']}"], err  # one line, once: no part prints its own
    assert "resident" in lines[0] and f"coded with {plan['codec']}" in lines[0] and "budget" in lines[0]
    sd = wrapped.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    back = wrapped.disable()
    with torch.no_grad():
        assert torch.equal(first(back(**x)), want)


def test_compute_bound_codes_nothing_and_samples_nothing(sizes):
    """A step whose compute covers the raw stream: no codec sampled (no encode, no decode timing, no
    background work), and with room for them the blocks stay resident (ties keep more resident)."""
    blocks, fixed = sizes
    budget = fixed + 2 * max(blocks) + sum(blocks)
    wrapped, ref, x = _planned(budget, slow=False)
    _steps(wrapped, ref, x, 3)
    s = wrapped.stats()
    plan, cplan = s["plan"], s["codec_plan"]
    assert plan["codec"] is None and plan["coded_blocks"] == [] and not plan["coding_in_background"]
    assert cplan["candidates"] == {} and cplan["plan_parts_s"]["sample_s"] == 0.0
    assert s.get("coding_in_background") is None and s["coded_blocks"] == 0
    assert len(plan["resident_blocks"]) == len(blocks) - 1  # all the budget holds; one block streams
    assert "no coding" in plan["describe"] and "compute-bound" in plan["describe"]
    # the same measurements under an explicit resident_layers="auto": ties keep fewer device bytes
    model, ref2, x2 = _toy()
    explicit = OffloadedTransformer(model, OffloadConfig.layerwise(
        resident_layers="auto", weight_codec="none", device_memory_budget_gb=budget / 1e9, progress=False), device=DEV)
    explicit._streamed.placement.h2d_gbps = 1e6
    _steps(explicit, ref2, x2, 2)
    assert explicit.stats()["placement"]["resident_blocks"] == []
    assert explicit.stats()["plan"]["default"] is False


def test_an_explicit_auto_placement_keeps_its_rule_and_the_codec_is_the_defaults(sizes):
    blocks, fixed = sizes
    budget = fixed + 2 * max(blocks) + sum(blocks)
    model, ref, x = _toy()
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(
        resident_layers="auto", device_memory_budget_gb=budget / 1e9, progress=False), device=DEV)
    sb = wrapped._streamed
    assert sb.selection.planned == ("weight_codec",)
    sb.placement.h2d_gbps = sb.codec_planner.h2d_gbps = 1e6  # compute-bound
    _steps(wrapped, ref, x, 2)
    s = wrapped.stats()
    assert s["placement"]["resident_blocks"] == []  # its own tie rule: the fewest device bytes
    assert s["codec_plan"]["candidates"] == {} and s["plan"]["codec"] is None  # the default's: not sampled
    assert s["plan"]["planned_keys"] == ["weight_codec"] and s["plan"]["budget_from"] == "device_memory_budget_gb"


def test_the_plan_is_printed_once_over_steps_and_signatures(sizes, capsys):
    blocks, fixed = sizes
    wrapped, ref, x = _planned(fixed + 2 * max(blocks) + sum(blocks), slow=False, progress=True)
    _steps(wrapped, ref, x, 4)
    err = capsys.readouterr().err
    assert sum(ln.startswith("weightstream plan: ") for ln in err.splitlines()) == 1, err
    assert "auto placement" not in err and "auto codec" not in err


def test_on_the_cpu_without_a_budget_the_default_is_todays_stream():
    model, ref, x = _toy()
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device=DEV)
    explicit_model, _, _ = _toy()
    explicit = OffloadedTransformer(explicit_model, OffloadConfig.layerwise(
        resident_layers=0, weight_codec="none", progress=False), device=DEV)
    _steps(wrapped, ref, x, 2)
    _steps(explicit, ref, x, 2)
    s, e = wrapped.stats(), explicit.stats()
    assert wrapped._streamed.auto_step is None and "plan" not in s
    assert {k: v for k, v in s.items() if not k.endswith("_s")} == {k: v for k, v in e.items() if not k.endswith("_s")}


def test_the_headroom_is_documented_and_positive():
    assert AUTO_DEVICE_MARGIN_GB > 0
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert f"{AUTO_DEVICE_MARGIN_GB:g} GB" in text and "The default" in text


# -- the perf harness's default modes -------------------------------------------------------------

def test_perf_default_modes_and_the_other_modes_keep_their_meaning():
    from perf.modes import parse_mode, weightstream_config
    from perf.results import validate_mode_name

    for name, kw in (("default", {}), ("default-8gb", {"device_memory_budget_gb": 8.0}),
                     ("default-24gb", {"device_memory_budget_gb": 24.0})):
        validate_mode_name(name)
        spec = parse_mode(name)
        assert spec.default and spec.config_kw == kw and spec.weight_fill == "student-t"
        assert weightstream_config(spec).unset_keys == ("resident_layers", "weight_codec")
    for name in ("layerwise", "layerwise-auto-8gb", "layerwise-codedauto", "graphs-coded", "layerwise-mmap"):
        cfg = weightstream_config(parse_mode(name))
        assert cfg.unset_keys == (), name  # named: not the planned default
    assert weightstream_config(parse_mode("layerwise")).resident_layers == 0
    with pytest.raises(ValueError):
        validate_mode_name("default-auto")


def test_perf_default_figures_beside_the_uncoded_floor_and_setup():
    from perf.harness import MODE_KEYS
    from perf.results import summarise

    assert "plan" in MODE_KEYS and "block_gb" in MODE_KEYS  # copied into the result's entry

    modes = {"resident": {"step_ms": 172.0}, "layerwise": {"step_ms": 428.0, "streamed_gb": 23.8, "setup_s": 3.7},
             "default-8gb": {"step_ms": 215.0, "streamed_gb": 15.8, "block_gb": 23.8, "setup_s": 5.0}}
    out = summarise(modes, 55.0)
    d = out["default-8gb"]
    assert d["uncoded_floor_ms"] == pytest.approx(23.8e9 / 55e9 * 1e3, rel=1e-3)
    assert d["ratio_to_uncoded_floor"] == pytest.approx(215.0 / d["uncoded_floor_ms"], rel=1e-4)
    assert d["setup_ratio_to_uncoded"] == pytest.approx(5.0 / 3.7, rel=1e-4) and d["uncoded_setup_s"] == 3.7
    assert d["ratio_to_resident"] == pytest.approx(215.0 / 172.0, rel=1e-4)
    assert d["ratio_to_floor"] == pytest.approx(215.0 / d["floor_ms"], rel=1e-4)
    assert d["ready_s"] == 5.0  # no planning steps: ready at the end of setup


def test_perf_ready_counts_the_planning_and_coding_steps():
    """ready_s: setup plus what the steps that planned and coded took over as many settled steps
    (the time until full speed), beside the uncoded setup of the same quantization."""
    from perf.results import summarise

    modes = {"resident": {"step_ms": 170.0}, "layerwise": {"step_ms": 428.0, "streamed_gb": 23.8, "setup_s": 3.0},
             "default-8gb": {"step_ms": 230.0, "block_gb": 23.8, "setup_s": 3.5,
                             "coding_step_ms_all": [4500.0, 240.0]},
             "layerwise-codedauto": {"step_ms": 300.0, "setup_s": 3.0, "coding_step_ms_all": [2300.0]},
             "layerwise-qfp8": {"step_ms": 280.0, "setup_s": 1.5},
             "layerwise-coded-qfp8": {"step_ms": 260.0, "setup_s": 2.0}}
    out = summarise(modes, 55.0)
    d = out["default-8gb"]
    assert d["ready_s"] == pytest.approx(3.5 + (4500 + 240 - 2 * 230) / 1e3)
    assert d["ready_ratio_to_uncoded"] == pytest.approx(d["ready_s"] / 3.0, rel=1e-4)
    assert d["setup_ratio_to_uncoded"] == pytest.approx(3.5 / 3.0, rel=1e-4)
    assert out["layerwise-codedauto"]["ready_ratio_to_uncoded"] == pytest.approx((3.0 + 2.0) / 3.0, rel=1e-4)
    q = out["layerwise-coded-qfp8"]
    assert q["uncoded_setup_s"] == 1.5 and q["ready_ratio_to_uncoded"] == pytest.approx(2.0 / 1.5, rel=1e-4)
    assert "ready_s" not in out["layerwise"] and "ready_s" not in out["layerwise-qfp8"]


def test_the_placement_tie_rule_of_the_default_is_pure():
    """prefer_resident: among placements predicted equally fast, the most resident block bytes
    (then the fewest device bytes: one slot, not four); without it, the fewest device bytes."""
    from weightstream.offload.plan.placement import PlanInputs, plan

    kw = dict(link_bytes=(100, 200, 300, 400), device_bytes=(100, 200, 300, 400), compute_ms=(5.0, 5.0, 5.0, 5.0),
              h2d_gbps=1e3, budget_bytes=10_000, fixed_device_bytes=50)
    lean, full = plan(PlanInputs(**kw)), plan(PlanInputs(**kw, prefer_resident=True))
    assert lean.predicted_ms == full.predicted_ms == 20.0
    assert lean.resident == () and full.resident == (1, 2, 3) and full.slots_used == 1
    assert full.device_bytes == 50 + 900 + 100
    tight = plan(PlanInputs(**{**kw, "budget_bytes": 1000}, prefer_resident=True))
    assert tight.resident == (0,) and tight.fits  # as much as fits: block 0 and two slots of 400 (950 bytes)
