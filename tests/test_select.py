"""select(): the one support matrix, pure (no tensors), and its named refusals."""
import itertools
import subprocess
import sys

import pytest

from weightstream import OffloadConfig, UnsupportedCombinationError, OffloadMisuseError
from weightstream.offload.codecs import WEIGHT_CODECS
from weightstream.offload.sources.select import (
    GRAPHS, RESIDENCIES, SUPPORT, TRANSPORTS, Selection, Topology, refusal_error, select, support_table_markdown,
)


def test_the_table_holds_every_cell_once():
    assert set(SUPPORT) == set(itertools.product(TRANSPORTS, WEIGHT_CODECS, RESIDENCIES, GRAPHS))
    with pytest.raises(TypeError):
        SUPPORT[("pinned", "none", "none", "off")] = "x"  # read-only: no module-level mutable state


@pytest.mark.parametrize("topology, checkpoint, transport", [
    (Topology(), None, "pinned"),
    (Topology(), "safetensors", "mmap"),
    (Topology(2, 1, "allgather"), None, "dlo-allgather"),
    (Topology(2, 0, "rank-local"), None, "dlo-rank-local"),
])
def test_transport_from_topology_and_checkpoint(topology, checkpoint, transport):
    s = select(OffloadConfig.layerwise(weight_codec="exp-k", progress=False), topology, checkpoint)
    assert s == Selection(transport, "exp-k", "none", False, topology)
    assert s.coded and s.cell == (transport, "exp-k", "none", "off")


def test_module_mode_and_residency():
    assert select(OffloadConfig.module(["dit"], weight_codec="auto")).cell == ("module", "auto", "none", "off")
    assert select(OffloadConfig.layerwise(resident_layers=2)).residency == "fixed"
    assert select(OffloadConfig.layerwise(resident_layers=[0, 3])).residency == "fixed"
    assert select(OffloadConfig.layerwise(resident_layers="auto")).residency == "auto"


def test_refusal_names_the_cell_why_and_what_instead():
    with pytest.raises(UnsupportedCombinationError) as info:
        select(OffloadConfig.layerwise(weight_codec="auto", progress=False), Topology(), "safetensors")
    e = info.value
    assert isinstance(e, ValueError) and isinstance(e, OffloadMisuseError)
    msg = str(e)
    assert "weight_codec='auto' is not allowed" in msg and "choose from: exp-k" in msg
    assert "support matrix cell: transport=mmap, weight_codec=auto, residency=none, cuda_graphs=off" in msg


def test_config_refuses_the_cells_no_transport_supports():
    with pytest.raises(UnsupportedCombinationError, match="re-plans between eager steps"):
        OffloadConfig.layerwise(resident_layers="auto", cuda_graphs="on")
    with pytest.raises(UnsupportedCombinationError, match=r"resident_layers=2 is not allowed; resident layers "
                                                          r"require rank-local"):
        OffloadConfig.layerwise(resident_layers=2, weight_transfer="allgather")
    with pytest.raises(UnsupportedCombinationError, match="CUDA graphs need mode='layer'"):
        OffloadConfig.module(["dit"], cuda_graphs="on")
    # refused for one transport only: the config is fine, select() refuses that transport
    cfg = OffloadConfig.layerwise(resident_layers="auto", device_memory_budget_gb=1.0)
    assert select(cfg).transport == "pinned"
    with pytest.raises(UnsupportedCombinationError, match="mmap source"):
        select(cfg, Topology(), "safetensors")


def test_refusal_error_and_table_agree():
    for cell, ref in SUPPORT.items():
        if ref is not None:
            assert ref[2] in str(refusal_error(cell, "x"))
    md = support_table_markdown()
    assert md.count("\n| ") == len(TRANSPORTS) * len(RESIDENCIES)


def test_select_is_torch_free():
    code = ("import sys; from weightstream.offload.sources import select; "
            "assert 'torch' not in sys.modules, 'select.py imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
