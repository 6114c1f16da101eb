"""The support matrix, walked: every cell of ``SUPPORT`` (offload/sources/select.py) either runs
bit-exact against the resident model, or is refused at construction by
UnsupportedCombinationError, and the table says which. CPU cells here (the DLO cells in one
2-rank gloo launch); the CUDA-graph cells run in the GPU suite (marked ``gpu``)."""
import copy

import pytest
import torch
from safetensors.torch import save_file

from weightstream import OffloadConfig, OffloadedTransformer, ParallelConfig, UnsupportedCombinationError
from weightstream.offload.host.checkpoint import on_meta
from weightstream.offload.sources.select import SUPPORT, refusals, support_table_markdown

from layerwise_cases import ResidualBlocks
from test_distributed import get, run_ranks

RESIDENT = {"none": 0, "fixed": 1, "auto": "auto"}
STEPS = 3  # auto placement / auto codec: a measured step, then the planned ones


def _model():
    torch.manual_seed(0)
    return ResidualBlocks(n=4).eval()


def _x(seed=1):
    return torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed))


def _config(transport, codec, residency, graphs, **kw):
    if transport == "module":
        layers = {} if residency == "none" else {"layer_options": {"dit": {"resident_layers": RESIDENT[residency]}}}
        return OffloadConfig.module(["dit", "text_encoder", "vae"], weight_codec=codec, cuda_graphs=graphs,
                                    progress=False, **layers, **kw)
    return OffloadConfig.layerwise(resident_layers=RESIDENT[residency], weight_codec=codec, cuda_graphs=graphs,
                                   progress=False, device_memory_budget_gb=1.0 if residency == "auto" else None, **kw)


def _run_layer(transport, codec, residency, graphs, device, tmp_path=None, parallel=None, seed=1):
    """Outputs of STEPS forwards equal the resident model's; the wrapper's selection is this cell."""
    cell = (transport, codec, residency, graphs)
    model, x = _model(), _x(seed).to(device)
    ref = copy.deepcopy(model).to(device)
    transfer = {"dlo-allgather": "allgather", "dlo-rank-local": "rank-local"}.get(transport)
    with torch.no_grad():
        expected = ref(x)
        cfg = _config(transport, codec, residency, graphs, weight_transfer=transfer)
        if transport == "mmap":
            from weightstream.offload.checkpoint_offload import offload_from_safetensors

            path = tmp_path / "toy.safetensors"
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
            with on_meta():
                meta = ResidualBlocks(n=4).eval()
            wrapped = offload_from_safetensors(meta, path, cfg, device=device)
        else:
            wrapped = OffloadedTransformer(model, cfg, device=device, parallel=parallel)
        outs = [wrapped(x) for _ in range(STEPS)]
    assert wrapped._streamed.selection.cell == cell
    return [torch.equal(o, expected) for o in outs]


def _run_module(codec, residency, graphs, device):
    from weightstream.demo_module import ToyPipeline, toy_pipeline_inputs
    from weightstream.offload.pipeline import offload_pipeline

    pipe, inputs = ToyPipeline(), toy_pipeline_inputs()
    expected = copy.deepcopy(pipe)(**inputs)
    handle = offload_pipeline(pipe, _config("module", codec, residency, graphs), device=device)
    assert handle.selection.cell == ("module", codec, residency, graphs)
    return [torch.equal(pipe(**inputs), expected) for _ in range(2)]


def _cell(cell, device, tmp_path=None, parallel=None, rank=0):
    """"ok" with the equalities of a supported cell, or "refused" with the error's class name."""
    try:
        if cell[0] == "module":
            eq = _run_module(*cell[1:], device)
        else:
            eq = _run_layer(*cell, device, tmp_path=tmp_path, parallel=parallel, seed=1 + rank)
    except UnsupportedCombinationError as e:
        return ("refused", str(e))
    return ("ok", eq)


def _check(cell, result):
    kind, what = result
    if SUPPORT[cell] is None:
        assert kind == "ok", f"{cell} is supported in SUPPORT but was refused: {what}"
        assert all(what), f"{cell}: outputs differ from the resident model at steps {what}"
    else:
        assert kind == "refused", f"{cell} is refused in SUPPORT ({SUPPORT[cell][2]}) but ran"
        # the first rule of the cell, or another rule refusing it (the config's validation runs before
        # the transport is known: it may name another of the cell's refusals)
        assert any(why in what for _, _, why in refusals(cell)) and "support matrix cell" in what, what


LOCAL = [c for c in SUPPORT if c[0] in ("pinned", "mmap", "module")]
DLO = [c for c in SUPPORT if c[0].startswith("dlo") and c[3] == "off"]


@pytest.mark.parametrize("cell", [c for c in LOCAL if c[3] == "off"], ids="-".join)
def test_cpu_cell(cell, tmp_path):
    _check(cell, _cell(cell, "cpu", tmp_path))


@pytest.mark.gpu
@pytest.mark.parametrize("cell", [c for c in LOCAL if c[3] == "on"], ids="-".join)
def test_graph_cell(cell, tmp_path):
    _check(cell, _cell(cell, "cuda", tmp_path))


def dlo_cells(rank, world):
    """Every eager DLO cell on one rank of the group (the same order on every rank)."""
    parallel = ParallelConfig(dp=world)
    return {cell: _cell(cell, "cpu", parallel=parallel, rank=rank) for cell in DLO}


@pytest.fixture(scope="module")
def dlo_two(tmp_path_factory):
    return run_ranks(2, tmp_path_factory.mktemp("matrix"), "test_matrix:dlo_cells")


@pytest.mark.parametrize("cell", DLO, ids="-".join)
def test_dlo_cell(dlo_two, cell):
    for result in get(dlo_two, cell):
        _check(cell, result)


def test_architecture_doc_prints_the_matrix():
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    assert support_table_markdown() in doc, "docs/architecture.md: paste support_table_markdown()'s output"
