"""perf/probe_dlo_decode.py: its store move keeps outputs bit-exact and gives the host store back."""
from __future__ import annotations

import pytest
import torch

from perf import probe_dlo_decode as probe
from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import flux_inputs, tiny_flux


def _store_tensor(source) -> torch.Tensor:
    return source.store.arena if hasattr(source, "store") else source.arena


@pytest.mark.parametrize("codec", ["none", "exp-k", "exp-k2"])
def test_store_on_copies_the_store_and_gives_it_back(codec):
    model = tiny_flux(dtype=torch.bfloat16)
    inputs = flux_inputs(model)
    with torch.no_grad():
        ref = model(**inputs)[0]
        om = OffloadedTransformer(model, OffloadConfig.layerwise(weight_codec=codec), device="cpu")
        source = om._streamed.source
        host = _store_tensor(source)
        back = probe.store_on(source, torch.device("cpu"))
        moved = _store_tensor(source)
        assert moved.data_ptr() != host.data_ptr() and torch.equal(moved, host)
        host_copy = host.clone()
        host.zero_()  # the loads must read the moved store, not the host one
        try:
            assert torch.equal(om(**inputs)[0], ref)
        finally:
            host.copy_(host_copy)
            back()
        assert _store_tensor(source) is host
        assert torch.equal(om(**inputs)[0], ref)
        model = om.disable()
        assert torch.equal(model(**inputs)[0], ref)


def test_store_on_refuses_other_sources():
    with pytest.raises(TypeError, match="not a PinnedSource or CodedSource"):
        probe.store_on(object(), torch.device("cpu"))


@pytest.mark.parametrize("text", ["", "raw,raw", "coded,fast", "graphs-"])
def test_parse_modes_refuses(text):
    with pytest.raises(ValueError, match="--modes"):
        probe.parse_modes(text)


def test_cli_parses_and_needs_cuda():
    with pytest.raises(SystemExit) as info:
        probe.main(["--help"])
    assert info.value.code == 0
    with pytest.raises(SystemExit):
        probe.main(["--modes", "coded,exp-q"])
    with pytest.raises(SystemExit):
        probe.main(["--num-slots", "1"])
    if not torch.cuda.is_available():
        assert probe.main(["--modes", "raw"]) == 2


def test_decode_placement_gates_on_the_named_child():
    from perf import probe_decode_placement as place

    model = tiny_flux()
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    assert place.gate_module(double, "start") is double
    assert place.gate_module(double, "attn") is double.attn and place.gate_module(single, "attn") is single.attn
    assert place.gate_module(double, "mlp") is double.ff and place.gate_module(single, "mlp") is single.proj_mlp
    assert len(place.streamed_blocks(model)) == 5
    with pytest.raises(ValueError, match="has none of"):
        place.gate_module(torch.nn.Linear(2, 2), "mlp")
    for bad in ("", "start,start", "middle"):
        with pytest.raises(ValueError, match="--placements"):
            place.parse_placements(bad)
    with pytest.raises(SystemExit):
        place.main(["--codec", "exp-q"])
    if not torch.cuda.is_available():
        assert place.main(["--placements", "start"]) == 2


def test_spread_picks_an_even_share():
    assert probe.spread(10, 0.5) == [1, 3, 5, 7, 9]
    assert probe.spread(57, 1.0) == list(range(57))
    assert len(probe.spread(57, 0.6)) == 34 and len(set(probe.spread(57, 0.6))) == 34
    assert probe.spread(3, 0.01) == [1]
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="--coded-fraction"):
            probe.spread(10, bad)
    with pytest.raises(SystemExit):
        probe.main(["--coded-fraction", "0"])


@pytest.mark.parametrize("mode", ["coded", "coded2"])
def test_code_part_codes_the_share_and_the_moved_store_stays_exact(mode):
    """--coded-fraction: an auto wrap with its planner removed, a share of the blocks coded at
    once; the moved store (raw and coded regions) still gives the resident outputs."""
    model = tiny_flux(dtype=torch.bfloat16, num_attention_heads=4)
    inputs = flux_inputs(model)
    with torch.no_grad():
        ref = model(**inputs)[0]
        om = OffloadedTransformer(model, probe._mode_config(mode, 2, 0.6), device="cpu")
        ks = probe.code_part(om, mode, 0.6)
        source = om._streamed.source
        assert ks == probe.spread(5, 0.6) and [not r for r in source.raw] == [k in ks for k in range(5)]
        assert om._streamed.codec_planner.state == "removed"
        back = probe.store_on(source, torch.device("cpu"))
        try:
            assert all(torch.equal(om(**inputs)[0], ref) for _ in range(2))
        finally:
            back()
        assert om.stats()["coded_blocks"] == 3
        model = om.disable()
        assert torch.equal(model(**inputs)[0], ref)
    assert probe.code_part(None, "raw", 0.6) == [] and probe._mode_config("raw", 2, 0.6).weight_codec == "none"
