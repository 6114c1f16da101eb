"""The quantized support matrix (offload/sources/select.py QUANTIZED_SUPPORT): every refused cell
raises its named error naming the key and the cell; every supported cell has the test that
streams it bit-exact; docs/quantized.md prints the table quantized_table_markdown() gives."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from weightstream.offload.misuse import UnsupportedCombinationError
from weightstream.offload.sources.select import (
    QUANTIZED_FORMATS, QUANTIZED_SUPPORT, TRANSPORTS, check_quantized, quantized_table_markdown,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "quantized.md"
# every supported (format, transport) -> the test that streams it, bit-exact against the same model unwrapped
COVERED = {
    ("layerwise-casting", "pinned"): "test_quantized::test_wrapper_streams_the_fp8_bytes_bit_exact",
    ("layerwise-casting", "mmap"): "test_quantized_fp8_mmap::test_streams_bit_exact_from_the_folder",
    ("layerwise-casting", "dlo-allgather"): "test_quantized_dlo::test_two_ranks_stream_quantized_images_bit_exact",
    ("layerwise-casting", "dlo-rank-local"): "test_quantized_dlo::test_two_ranks_stream_quantized_images_bit_exact",
    ("layerwise-casting", "module"): "test_quantized::test_pipeline_layer_and_module_mode",
    ("gguf", "pinned"): "test_quantized_gguf::test_wrapper_streams_the_gguf_bytes",
    ("gguf", "mmap"): "test_quantized_gguf_mmap::test_streams_bit_exact_from_the_file",
    ("gguf", "dlo-allgather"): "test_quantized_dlo::test_two_ranks_stream_quantized_images_bit_exact",
    ("gguf", "dlo-rank-local"): "test_quantized_dlo::test_two_ranks_stream_quantized_images_bit_exact",
    ("gguf", "module"): "test_quantized_gguf::test_in_place_resident_and_pipelines",
    ("torchao", "pinned"): "test_quantized_torchao::test_wrapper_streams_the_quantized_bytes",
    ("torchao", "dlo-allgather"): "test_quantized_dlo::test_two_ranks_stream_quantized_images_bit_exact",
    ("torchao", "dlo-rank-local"): "test_quantized_dlo::test_two_ranks_stream_quantized_images_bit_exact",
    ("torchao", "module"): "test_quantized_torchao::test_in_place_resident_and_layer_pipeline",
    ("bitsandbytes", "pinned"): "test_quantized_bnb::test_wrapper_streams_the_packed_bytes",
    ("bitsandbytes", "dlo-allgather"): "test_quantized_dlo::test_two_ranks_stream_quantized_images_bit_exact",
    ("bitsandbytes", "dlo-rank-local"): "test_quantized_dlo::test_two_ranks_stream_quantized_images_bit_exact",
    ("bitsandbytes", "module"): "test_quantized_bnb::test_in_place_resident_layers_and_pipelines",
}


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_cell_is_refused_by_name_or_covered(fmt, transport):
    refusal = QUANTIZED_SUPPORT[(fmt, transport)]
    if refusal is None:
        if fmt == "none":
            check_quantized(fmt, transport)  # plain models: the main matrix (tests/test_matrix.py)
            return
        module, test = COVERED[(fmt, transport)].split("::")
        assert callable(getattr(importlib.import_module(module), test))
        check_quantized(fmt, transport)
        return
    key, why = refusal
    with pytest.raises(UnsupportedCombinationError) as e:
        check_quantized(fmt, transport)
    msg = str(e.value)
    assert msg.startswith(f"{key}: a {fmt} quantized model is not allowed with transport={transport}")
    assert f"format={fmt}, transport={transport}" in msg and why in msg


def test_no_covered_cell_is_refused():
    assert all(QUANTIZED_SUPPORT[cell] is None for cell in COVERED)


def test_docs_print_the_table():
    assert quantized_table_markdown() in DOC.read_text()


def test_a_model_mixing_formats_is_refused_by_name_with_a_tensor_of_each():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: PLC0415

    from weightstream import OffloadConfig, OffloadedTransformer  # noqa: PLC0415
    from weightstream.models import flux_inputs, tiny_flux  # noqa: PLC0415
    from weightstream.quant_models import gguf_random  # noqa: PLC0415

    model = gguf_random(tiny_flux(dtype=torch.bfloat16), "Q8_0")  # the blocks' linears
    quantize_(model, Int8WeightOnlyConfig(version=2), filter_fn=lambda m, fqn: fqn == "x_embedder")
    x = flux_inputs(model)
    with torch.no_grad():
        want = model(**x)[0]
    with pytest.raises(UnsupportedCombinationError, match=r"mixes quantized formats: gguf \('transformer_blocks.*"
                                                          r"torchao \('x_embedder.weight'\)"):
        OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device="cpu")
    with torch.no_grad():
        assert torch.equal(model(**x)[0], want)  # refused before any tensor moved
