"""Quantized blocks under DLO (two gloo ranks on the CPU): layerwise casting (fp8 bytes) and GGUF
Q8_0 (uint8 blocks) are plain bytes to the shares, so AllGather gathers the quantized images
and rank-local streams them whole; bit-exact against the same quantized model unwrapped on
every rank, and the host bytes per rank are half the quantized images (docs/quantized.md)."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("gguf")

from test_distributed import Checks, get, run_ranks  # noqa: E402
from weightstream import OffloadConfig, OffloadedTransformer  # noqa: E402
from weightstream.models import flux_inputs, tiny_flux  # noqa: E402
from weightstream.offload.dlo.topology import ParallelConfig  # noqa: E402

CASES = [("casting", "allgather"), ("casting", "rank-local"), ("gguf", "allgather"), ("gguf", "rank-local")]


def _make(kind, folder):
    from weightstream.quant_models import layerwise_fp8, load_gguf, write_gguf  # noqa: PLC0415

    if kind == "casting":
        return layerwise_fp8(tiny_flux(dtype=torch.bfloat16))
    path = os.path.join(folder, "flux-q8.gguf")
    if not os.path.exists(path):
        write_gguf(tiny_flux(dtype=torch.bfloat16), path, "Q8_0")
    return load_gguf(tiny_flux(dtype=torch.bfloat16), path)


def check(kind, transfer, parallel, rank, folder):
    model, ref = _make(kind, folder), _make(kind, folder)
    x = flux_inputs(ref, dtype=torch.bfloat16, seed=1 + rank)
    with torch.no_grad():
        want = ref(**x)[0]
        om = OffloadedTransformer(model, OffloadConfig.layerwise(weight_transfer=transfer, progress=False),
                                  device="cpu", parallel=parallel)
        equal = [torch.equal(om(**x)[0], want) for _ in range(2)]
    s = om.stats()
    images = sum(lay.nbytes for lay in om._streamed.layouts)
    back = om.disable()
    with torch.no_grad():
        restored = torch.equal(back(**x)[0], want)
    return dict(equal=equal, restored=restored, host_bytes=s["host_bytes"], images=images,
                quantized=s["quantized_format"])


def scenario(rank, world):
    parallel = ParallelConfig(dp=world)
    folder = os.path.join(tempfile.gettempdir(), f"ws-quant-dlo-{os.getppid()}-{rank}")
    os.makedirs(folder, exist_ok=True)
    c = Checks()
    for kind, transfer in CASES:
        c.run(f"{kind}-{transfer}", check, kind, transfer, parallel, rank, folder)
    return c.report


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(2, tmp_path_factory.mktemp("qdlo"), "test_quantized_dlo:scenario")


@pytest.mark.parametrize("kind,transfer", CASES)
def test_two_ranks_stream_quantized_images_bit_exact(two, kind, transfer):
    for rep in get(two, f"{kind}-{transfer}"):
        assert rep["equal"] == [True, True] and rep["restored"], rep
        assert rep["quantized"] == {"casting": "layerwise-casting"}.get(kind, kind)
        if transfer == "allgather":  # each rank holds about half of every quantized image
            assert rep["host_bytes"] < 0.75 * rep["images"], rep
