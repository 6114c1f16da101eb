"""Regional compile with inductor over streamed blocks on a GPU (bit-exact
against the resident model with the same compile)."""
import pytest
import torch

from test_compile import compiled_pair

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_regional_compile_inductor_bit_exact(name):
    torch._dynamo.reset()
    ref, wrapped, x = compiled_pair(name, "cuda", "inductor")
    with torch.no_grad():
        expected = ref(**x)[0]
        for step in range(3):
            out = wrapped(**x)[0]
            assert torch.equal(out, expected), f"{name} step {step}: {(out - expected).abs().max()}"
