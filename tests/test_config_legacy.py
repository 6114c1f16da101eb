"""vLLM-Omni's legacy flat flags and boolean cuda_graphs (issue 16)."""
import warnings

import pytest

from weightstream import OffloadConfig


def test_pin_cpu_memory_maps_to_pin_memory_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="'pin_cpu_memory' is deprecated; use 'pin_memory'"):
        cfg = OffloadConfig.from_dict({"mode": "layer", "components": ["dit"], "pin_cpu_memory": False})
    assert cfg.pin_memory is False


def test_legacy_and_new_spelling_that_disagree_are_rejected():
    with pytest.raises(ValueError, match="pin_cpu_memory=True.*also given as False"):
        OffloadConfig.from_dict({"mode": "layer", "components": ["dit"], "pin_cpu_memory": True, "pin_memory": False})


@pytest.mark.parametrize("flag, new", [
    ("enable_layerwise_offload", "'mode': 'layer'"),
    ("layerwise_num_gpu_layers", "num_slots"),
    ("enable_model_cpu_offload", "'mode': 'module'"),
])
def test_legacy_flags_without_an_exact_equivalent_name_the_new_spelling(flag, new):
    with pytest.raises(ValueError, match=f"{flag}=.*legacy vLLM-Omni flag; write .*{new}"):
        OffloadConfig.from_json('{"%s": true, "mode": "layer", "components": ["dit"]}' % flag)


@pytest.mark.parametrize("value, expected", [(True, "on"), (False, "off"), ("on", "on")])
def test_cuda_graphs_accepts_booleans(value, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = OffloadConfig.from_dict({"mode": "layer", "components": ["dit"], "cuda_graphs": value})
    assert cfg.cuda_graphs == expected
    assert OffloadConfig.from_json(cfg.to_json()) == cfg


def test_cuda_graphs_other_values_still_rejected():
    with pytest.raises(ValueError, match="cuda_graphs=1"):
        OffloadConfig.from_dict({"mode": "layer", "components": ["dit"], "cuda_graphs": 1})
