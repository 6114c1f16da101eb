"""Quantized blocks under DLO (two gloo ranks on the CPU): layerwise casting (fp8 bytes), GGUF
Q8_0 (uint8 blocks), torchao int8 (its inner tensors) and bitsandbytes nf4 (packed bytes and
quant-state tensors) are plain bytes to the shares, so
AllGather gathers the quantized images and rank-local streams them whole; bit-exact against the same quantized model unwrapped on
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

CASES = [(kind, transfer) for kind in ("casting", "gguf", "torchao", "bitsandbytes")
         for transfer in ("allgather", "rank-local")]


def _make(kind, folder):
    from weightstream.quant_models import layerwise_fp8, load_gguf, write_gguf  # noqa: PLC0415

    if kind == "casting":
        return layerwise_fp8(tiny_flux(dtype=torch.bfloat16))
    if kind == "torchao":
        from weightstream.quant_models import torchao_weight_only  # noqa: PLC0415

        return torchao_weight_only(tiny_flux(dtype=torch.bfloat16), "int8")
    if kind == "bitsandbytes":  # nf4 with double quantization: packed bytes, absmax, nested absmax
        from weightstream.quant_models import bnb_quantize  # noqa: PLC0415

        return bnb_quantize(tiny_flux(dtype=torch.bfloat16), "nf4")
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
    gathered, want_sd = om.gather_state_dict(), ref.state_dict()  # a collective under AllGather
    same_sd = gathered.keys() == want_sd.keys() and all(_same(gathered[k], v) for k, v in want_sd.items())
    local = om.local_state_dict()
    inner_keys = any(k.endswith("[qdata]") for k in local)
    back = om.disable()
    with torch.no_grad():
        restored = torch.equal(back(**x)[0], want)
    return dict(equal=equal, restored=restored, host_bytes=s["host_bytes"], images=images,
                quantized=s["quantized_format"], same_sd=same_sd, inner_keys=inner_keys)


def _same(a, b) -> bool:
    """The same tensor in the same form: class, quant type / inner tensors, bytes."""
    if type(a) is not type(b) or getattr(a, "quant_type", None) != getattr(b, "quant_type", None):
        return False
    names = b.__tensor_flatten__()[0] if type(b).__module__.startswith("torchao.") else None
    if names is not None:
        return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


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
        assert rep["same_sd"], rep  # gather_state_dict(): the quantized tensors in their own form
        # local_state_dict(): under AllGather a subclass comes as pieces of its inner tensors
        assert rep["inner_keys"] == (kind == "torchao" and transfer == "allgather"), rep
        if transfer == "allgather":  # each rank holds about half of every quantized image
            assert rep["host_bytes"] < 0.75 * rep["images"], rep
