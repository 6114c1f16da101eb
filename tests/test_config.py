"""OffloadConfig: validation, serialisation, constructors (CPU only)."""
import copy
import dataclasses
import json
import pickle

import pytest

from weightstream.offload.config import ConfigTypeError, LayerOptions, OffloadConfig

LAYER = {"mode": "layer", "components": ["dit"]}
MODULE = {"mode": "module", "components": ["dit", "text_encoder"]}


def _with(base, **kw):
    return {**base, **kw}


# (dict given to from_dict, exception type, substrings that must all be in the message)
REJECTIONS = {
    "unknown_top_level_key": (
        _with(LAYER, offload_mode="layer"), ValueError,
        ["OffloadConfig", "'offload_mode'", "mode", "components", "cuda_graphs"]),
    "missing_mode": (
        {"components": ["dit"]}, ValueError,
        ["mode=None", "choose from: module, layer", "enable_cpu_offload"]),
    "missing_components": (
        {"mode": "layer"}, ValueError,
        ["components=()", "choose from: dit, text_encoder, vae"]),
    "empty_components": (
        _with(LAYER, components=[]), ValueError,
        ["components=()", "choose from: dit, text_encoder, vae"]),
    "unknown_mode": (
        _with(LAYER, mode="layerwise"), ValueError,
        ["mode='layerwise'", "choose from: module, layer"]),
    "unknown_component": (
        _with(MODULE, components=["dit", "unet"]), ValueError,
        ["components[1]='unet'", "choose from: dit, text_encoder, vae"]),
    "duplicate_component": (
        _with(MODULE, components=["dit", "vae", "dit"]), ValueError,
        ["components=('dit', 'vae', 'dit')", "duplicate 'dit'"]),
    "vae_in_layer_mode": (
        _with(LAYER, components=["dit", "vae"]), ValueError,
        ["components[1]='vae'", "mode='layer'", "choose from: dit, text_encoder"]),
    "layer_options_in_module_mode": (
        _with(MODULE, layer_options={"dit": {"resident_layers": 1}}), ValueError,
        ["layer_options={'dit': {'resident_layers': 1}}", "mode='layer'", "mode='module'"]),
    "layer_options_unselected_component": (
        _with(LAYER, layer_options={"text_encoder": {"weight_transfer": "allgather"}}), ValueError,
        ["layer_options", "'text_encoder'", "components=['dit']", "choose from: dit"]),
    "layer_options_not_a_component": (
        _with(LAYER, layer_options={"transformer": {}}), ValueError,
        ["layer_options", "'transformer'", "choose from: dit"]),
    "unknown_layer_setting": (
        _with(LAYER, layer_options={"dit": {"foo": 1}}), ValueError,
        ["layer_options.dit", "'foo'", "choose from: weight_transfer, resident_layers"]),
    "misspelled_transfer": (
        _with(LAYER, layer_options={"dit": {"weight_transfer": "rank_local"}}), ValueError,
        ["layer_options.dit.weight_transfer='rank_local'", "choose from: allgather, rank-local"]),
    "transfer_wrong_type": (
        _with(LAYER, layer_options={"dit": {"weight_transfer": True}}), TypeError,
        ["layer_options.dit.weight_transfer=True", "choose from: allgather, rank-local", "bool"]),
    "resident_layers_non_dit": (
        _with(LAYER, components=["dit", "text_encoder"],
              layer_options={"text_encoder": {"resident_layers": 2}}), ValueError,
        ["layer_options.text_encoder.resident_layers=2", "only to dit"]),
    "resident_layers_negative": (
        _with(LAYER, layer_options={"dit": {"resident_layers": -1}}), ValueError,
        ["layer_options.dit.resident_layers=-1", "int >= 0"]),
    "resident_layers_float": (
        _with(LAYER, layer_options={"dit": {"resident_layers": 1.5}}), TypeError,
        ["layer_options.dit.resident_layers=1.5", "int >= 0", "float"]),
    "resident_layers_str": (
        _with(LAYER, layer_options={"dit": {"resident_layers": "2"}}), TypeError,
        ["layer_options.dit.resident_layers='2'", "int >= 0", "str"]),
    "resident_layers_bool": (
        _with(LAYER, layer_options={"dit": {"resident_layers": True}}), TypeError,
        ["layer_options.dit.resident_layers=True", "int >= 0", "bool"]),
    "resident_layers_with_allgather": (
        _with(LAYER, layer_options={"dit": {"resident_layers": 2, "weight_transfer": "allgather"}}),
        ValueError,
        ["layer_options.dit.resident_layers=2", "'allgather'", "resident layers require rank-local"]),
    "layer_entry_wrong_type": (
        _with(LAYER, layer_options={"dit": 3}), TypeError,
        ["layer_options.dit=3", "LayerOptions"]),
    "layer_options_wrong_type": (
        _with(LAYER, layer_options=["dit"]), TypeError,
        ["layer_options=['dit']", "dict"]),
    "pin_memory_int": (
        _with(LAYER, pin_memory=1), TypeError, ["pin_memory=1", "bool", "int"]),
    "pin_memory_str": (
        _with(LAYER, pin_memory="true"), TypeError, ["pin_memory='true'", "bool", "str"]),
    "enable_cpu_offload_str": (
        {"enable_cpu_offload": "yes"}, TypeError, ["enable_cpu_offload='yes'", "bool"]),
    "components_str": (
        _with(LAYER, components="dit"), TypeError, ["components='dit'", "a list"]),
    "component_wrong_type": (
        _with(LAYER, components=[1]), TypeError, ["components[0]=1", "choose from: dit"]),
    "mode_wrong_type": (
        _with(LAYER, mode=1), TypeError, ["mode=1", "choose from: module, layer"]),
    "cuda_graphs_unknown": (
        _with(LAYER, cuda_graphs="auto"), ValueError, ["cuda_graphs='auto'", "choose from: off, on"]),
    "cuda_graphs_int": (
        _with(LAYER, cuda_graphs=1), TypeError, ["cuda_graphs=1", "choose from: off, on"]),
    "cuda_graphs_in_module_mode": (
        _with(MODULE, cuda_graphs="on"), ValueError,
        ["cuda_graphs='on'", "mode='layer'", "mode='module'", "choose from: off"]),
    "graph_boundary_unknown": (
        _with(LAYER, cuda_graphs="on", graph_boundary_loads="after"), ValueError,
        ["graph_boundary_loads='after'", "choose from: auto, in-graph, next-step"]),
    "graph_boundary_without_graphs": (
        _with(LAYER, graph_boundary_loads="next-step"), ValueError,
        ["graph_boundary_loads='next-step'", "cuda_graphs='on'", "in-graph"]),
    "graph_boundary_with_resident_layers": (
        _with(LAYER, cuda_graphs="on", graph_boundary_loads="next-step",
              layer_options={"dit": {"resident_layers": 2}}), ValueError,
        ["graph_boundary_loads='next-step'", "resident_layers=2", "in-graph"]),
    "num_slots_one": (
        _with(LAYER, num_slots=1), ValueError, ["num_slots=1", "int >= 2"]),
    "num_slots_bool": (
        _with(LAYER, num_slots=True), TypeError, ["num_slots=True", "int >= 2", "bool"]),
    "num_slots_float": (
        _with(LAYER, num_slots=2.0), TypeError, ["num_slots=2.0", "int >= 2", "float"]),
    "pinned_budget_zero": (
        _with(LAYER, pinned_memory_budget_gb=0), ValueError,
        ["pinned_memory_budget_gb=0", "> 0"]),
    "pinned_budget_str": (
        _with(LAYER, pinned_memory_budget_gb="8"), TypeError,
        ["pinned_memory_budget_gb='8'", "> 0", "str"]),
    "device_budget_negative": (
        _with(LAYER, device_memory_budget_gb=-1.5), ValueError,
        ["device_memory_budget_gb=-1.5", "> 0"]),
    "device_budget_inf": (
        _with(LAYER, device_memory_budget_gb=float("inf")), ValueError,
        ["device_memory_budget_gb=inf", "finite number > 0"]),
    "device_budget_bool": (
        _with(LAYER, device_memory_budget_gb=True), TypeError,
        ["device_memory_budget_gb=True", "> 0", "bool"]),
    "record_events_int": (
        _with(LAYER, record_events=0), TypeError, ["record_events=0", "bool"]),
    "progress_none": (
        _with(LAYER, progress=None), TypeError, ["progress=None", "bool"]),
    "debug_graph_addresses_str": (
        _with(LAYER, debug_graph_addresses="on"), TypeError, ["debug_graph_addresses='on'", "bool"]),
    "compat_contradicting_mode": (
        {"enable_cpu_offload": True, "mode": "layer"}, ValueError,
        ["mode='layer'", "enable_cpu_offload=True", "choose from: module"]),
    "compat_contradicting_components": (
        {"enable_cpu_offload": True, "components": ["dit"]}, ValueError,
        ["components=('dit',)", "enable_cpu_offload=True", "['dit', 'text_encoder']"]),
    "compat_with_vae": (
        {"enable_cpu_offload": True, "mode": "module", "components": ["dit", "text_encoder", "vae"]},
        ValueError, ["components=('dit', 'text_encoder', 'vae')", "enable_cpu_offload=True"]),
}


@pytest.mark.parametrize("d,exc,parts", list(REJECTIONS.values()), ids=list(REJECTIONS))
def test_rejections(d, exc, parts):
    with pytest.raises(exc) as info:
        OffloadConfig.from_dict(d)
    # every rejection is also a ValueError (DESIGN section 2)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "is not allowed" in msg
    for part in parts:
        assert part in msg, f"{part!r} missing from {msg!r}"


def test_wrong_types_raise_config_type_error():
    with pytest.raises(ConfigTypeError) as info:
        OffloadConfig.layerwise(pin_memory="yes")
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("kw, closest", [({"num_slot": 3}, "num_slots"), ({"resident_layer": 1}, "resident_layers"),
                                         ({"weight_codecs": "exp-k"}, "weight_codec")])
def test_a_typo_keyword_of_layerwise_names_the_closest_field(kw, closest):
    with pytest.raises(ConfigTypeError, match=rf"OffloadConfig.layerwise\(\) got unknown keyword '{next(iter(kw))}', "
                                              rf"which is not allowed; choose from: {closest}, .*"
                                              rf"\(did you mean '{closest}'\?\)$") as e:
        OffloadConfig.layerwise(**kw)
    assert isinstance(e.value, TypeError)


def test_misspelled_transfer_exact_message():
    with pytest.raises(ValueError, match=r"^layer_options\.dit\.weight_transfer='rank_local' is not "
                                         r"allowed; choose from: allgather, rank-local$"):
        OffloadConfig.layerwise(weight_transfer="rank_local")


def test_rejections_also_via_constructor_and_replace():
    with pytest.raises(ValueError, match="components"):
        OffloadConfig(mode="layer", components=("vae",))
    c = OffloadConfig.layerwise(resident_layers=2)
    with pytest.raises(ValueError, match="layer_options"):
        c.replace(mode="module")
    with pytest.raises(ValueError, match="resident layers require rank-local"):
        c.replace(layer_options={"dit": LayerOptions("allgather", 2)})
    with pytest.raises(ValueError, match="num_slots=1"):
        c.replace(num_slots=1)


# ----------------------------------------------------------------- defaults
def test_defaults():
    c = OffloadConfig.from_dict(LAYER)
    assert c.mode == "layer"
    assert c.components == ("dit",)
    assert dict(c.layer_options) == {}
    assert c.pin_memory is True
    assert c.enable_cpu_offload is False
    assert c.cuda_graphs == "off"
    assert c.num_slots == 2
    assert c.pinned_memory_budget_gb is None
    assert c.device_memory_budget_gb is None
    assert c.record_events is False
    assert c.progress is True
    assert c.debug_graph_addresses is False
    assert c.resident_layers == 0  # not given: 0 until the planned default resolves it (select.py)
    assert c.weight_codec is None and c.unset_keys == ("resident_layers", "weight_codec")
    assert c.weight_transfer is None
    assert c.layer_option("text_encoder") == LayerOptions()
    assert LayerOptions() == LayerOptions(weight_transfer=None, resident_layers=None)
    assert LayerOptions() != LayerOptions(resident_layers=0)  # an explicit 0 is not the default


def test_layerwise_and_module_constructors():
    assert OffloadConfig.layerwise() == OffloadConfig(mode="layer", components=("dit",))
    c = OffloadConfig.layerwise(resident_layers=3, weight_transfer="rank-local", num_slots=3,
                                cuda_graphs="on", record_events=True)
    assert c.resident_layers == 3 and c.weight_transfer == "rank-local"
    assert c.layer_option("dit") == LayerOptions("rank-local", 3)
    assert (c.num_slots, c.cuda_graphs, c.record_events) == (3, "on", True)
    assert OffloadConfig.layerwise(weight_transfer="allgather").resident_layers == 0
    both = OffloadConfig.layerwise(components=["dit", "text_encoder"],
                                   layer_options={"text_encoder": {"weight_transfer": "allgather"}})
    assert both.components == ("dit", "text_encoder")
    assert both.layer_option("text_encoder").weight_transfer == "allgather"
    with pytest.raises(ValueError, match="not both"):
        OffloadConfig.layerwise(resident_layers=1, layer_options={"dit": {}})

    m = OffloadConfig.module()
    assert (m.mode, m.components) == ("module", ("dit", "text_encoder"))
    m = OffloadConfig.module(["dit", "text_encoder", "vae"], pin_memory=False)
    assert m.components == ("dit", "text_encoder", "vae") and m.pin_memory is False


def test_layer_option_accessor_rejects_unknown_component():
    with pytest.raises(ValueError, match=r"component='unet'.*choose from: dit, text_encoder, vae"):
        OffloadConfig.layerwise().layer_option("unet")


def test_list_components_stored_as_tuple_and_numbers_normalised():
    c = OffloadConfig(mode="module", components=["vae"], device_memory_budget_gb=8,
                      pinned_memory_budget_gb=0.5)
    assert c.components == ("vae",)
    assert c.device_memory_budget_gb == 8.0 and isinstance(c.device_memory_budget_gb, float)
    assert c.pinned_memory_budget_gb == 0.5


# ----------------------------------------------------- enable_cpu_offload
@pytest.mark.parametrize("extra", [
    {},
    {"mode": "module"},
    {"components": ["dit", "text_encoder"]},
    {"mode": "module", "components": ["dit", "text_encoder"]},
    {"mode": "module", "components": ["text_encoder", "dit"]},
])
def test_enable_cpu_offload_maps_to_module_mode(extra):
    c = OffloadConfig.from_dict({"enable_cpu_offload": True, **extra})
    assert c.mode == "module"
    assert sorted(c.components) == ["dit", "text_encoder"]
    assert c.enable_cpu_offload is True
    assert dict(c.layer_options) == {}
    assert OffloadConfig.from_dict(c.to_dict()) == c


def test_enable_cpu_offload_keeps_other_keys():
    c = OffloadConfig(enable_cpu_offload=True, pin_memory=False, device_memory_budget_gb=4)
    assert (c.mode, c.components, c.pin_memory) == ("module", ("dit", "text_encoder"), False)


# ------------------------------------------------------------ round trips
CONFIGS = {
    "layer_default": OffloadConfig.layerwise(),
    "layer_full": OffloadConfig.layerwise(
        components=["dit", "text_encoder"],
        layer_options={"dit": {"weight_transfer": "rank-local", "resident_layers": 4},
                       "text_encoder": {"weight_transfer": "allgather"}},
        pin_memory=False, cuda_graphs="on", num_slots=3, pinned_memory_budget_gb=64,
        device_memory_budget_gb=12.5, record_events=True, progress=False,
        debug_graph_addresses=True),
    "layer_all_default_entry": OffloadConfig.layerwise(layer_options={"dit": {}}),
    "module": OffloadConfig.module(["dit", "text_encoder", "vae"], pin_memory=False),
    "compat": OffloadConfig(enable_cpu_offload=True),
}


@pytest.mark.parametrize("c", list(CONFIGS.values()), ids=list(CONFIGS))
def test_round_trips(c):
    d = c.to_dict()
    assert OffloadConfig.from_dict(d) == c
    assert json.loads(json.dumps(d)) == d  # plain JSON types only
    assert OffloadConfig.from_json(c.to_json()) == c
    assert hash(OffloadConfig.from_json(c.to_json())) == hash(c)
    assert pickle.loads(pickle.dumps(c)) == c
    assert copy.deepcopy(c) == c


def test_to_dict_omits_defaults_but_keeps_mode_and_components():
    assert OffloadConfig.layerwise().to_dict() == {"mode": "layer", "components": ["dit"]}
    assert OffloadConfig.layerwise(resident_layers=2, num_slots=3).to_dict() == {
        "mode": "layer", "components": ["dit"],
        "layer_options": {"dit": {"resident_layers": 2}}, "num_slots": 3}
    assert OffloadConfig(enable_cpu_offload=True).to_dict() == {
        "mode": "module", "components": ["dit", "text_encoder"], "enable_cpu_offload": True}


def test_vllm_omni_examples_parse():
    # the exact strings of vLLM-Omni's docs
    c = OffloadConfig.from_json('{"mode":"module","components":["dit","text_encoder"]}')
    assert c == OffloadConfig.module()
    c = OffloadConfig.from_json(
        '{"mode":"layer","components":["dit"],'
        '"layer_options":{"dit":{"weight_transfer":"rank-local","resident_layers":2}}}')
    assert c.resident_layers == 2 and c.weight_transfer == "rank-local"


@pytest.mark.parametrize("s,exc,part", [
    ("{not json", ValueError, "expected a JSON object"),
    ("[1, 2]", TypeError, "expected a JSON object"),
    ('{"mode": "layer", "components": ["dit"], "slots": 2}', ValueError, "'slots'"),
])
def test_from_json_rejections(s, exc, part):
    with pytest.raises(exc, match=part):
        OffloadConfig.from_json(s)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(TypeError, match=r"OffloadConfig=\[\('mode', 'layer'\)\].*a dict"):
        OffloadConfig.from_dict([("mode", "layer")])


# ----------------------------------------------------------------- coerce
def test_coerce_each_kind():
    c = OffloadConfig.layerwise(resident_layers=1)
    assert OffloadConfig.coerce(c) is c
    assert OffloadConfig.coerce(None) == OffloadConfig.layerwise()
    assert OffloadConfig.coerce(MODULE) == OffloadConfig.module()
    assert OffloadConfig.coerce(json.dumps(MODULE)) == OffloadConfig.module()
    assert OffloadConfig.coerce(c.to_json()) == c


@pytest.mark.parametrize("obj", [3, ["layer"], b'{"mode": "layer"}', object()])
def test_coerce_rejects_other_types(obj):
    with pytest.raises(TypeError) as info:
        OffloadConfig.coerce(obj)
    msg = str(info.value)
    assert repr(obj) in msg
    assert "an OffloadConfig, a dict, a JSON string, or None" in msg


def test_coerce_validates():
    with pytest.raises(ValueError, match="choose from: allgather, rank-local"):
        OffloadConfig.coerce(_with(LAYER, layer_options={"dit": {"weight_transfer": "rank_local"}}))


# ------------------------------------------------------------ immutability
@pytest.mark.parametrize("field", ["mode", "components", "layer_options", "num_slots", "cuda_graphs"])
def test_frozen(field):
    c = OffloadConfig.layerwise()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(c, field, getattr(c, field))


def test_layer_options_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        OffloadConfig.layerwise(resident_layers=1).layer_option("dit").resident_layers = 5


def test_layer_options_mapping_is_read_only_and_copied():
    src = {"dit": {"resident_layers": 1}}
    c = OffloadConfig.layerwise(layer_options=src)
    assert isinstance(c.layer_options["dit"], LayerOptions)
    with pytest.raises(TypeError):
        c.layer_options["dit"] = LayerOptions()
    with pytest.raises(TypeError):
        del c.layer_options["dit"]
    src["dit"] = {"resident_layers": 9}
    src["text_encoder"] = {}
    assert c.resident_layers == 1 and list(c.layer_options) == ["dit"]


def test_replace_returns_new_validated_config():
    c = OffloadConfig.layerwise()
    d = c.replace(num_slots=4)
    assert d is not c and d.num_slots == 4 and c.num_slots == 2
    assert d.replace(num_slots=2) == c


def test_equal_configs_hash_equal():
    a = OffloadConfig.layerwise(components=["dit", "text_encoder"],
                                layer_options={"dit": {}, "text_encoder": {}})
    b = OffloadConfig.layerwise(components=["dit", "text_encoder"],
                                layer_options={"text_encoder": {}, "dit": {}})
    assert a == b and hash(a) == hash(b)
    assert len({a, b, OffloadConfig.layerwise()}) == 2
