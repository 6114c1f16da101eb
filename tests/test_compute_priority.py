"""compute_priority='high': OffloadedTransformer runs eager forwards on a high-priority stream.
CPU: the key's rules. GPU: the same bytes as the unwrapped model, with and without the codec,
and the caller's stream is ordered after the forward (its outputs read correctly there)."""
import pytest
import torch

from layerwise_cases import build, first
from weightstream import OffloadConfig, OffloadedTransformer, apply_layerwise_offload
from weightstream.models import ToyDiT


def test_choices_and_combinations_are_named():
    with pytest.raises(ValueError, match="compute_priority.*'highest'"):
        OffloadConfig.layerwise(compute_priority="highest")
    with pytest.raises(ValueError, match="compute_priority.*eager layer-mode"):
        OffloadConfig.layerwise(compute_priority="high", cuda_graphs="on")
    with pytest.raises(ValueError, match="compute_priority.*eager layer-mode"):
        OffloadConfig(mode="module", components=["dit"], compute_priority="high")
    assert OffloadConfig.layerwise().compute_priority == "default"


def test_needs_cuda_and_the_wrapper():
    cfg = OffloadConfig.layerwise(compute_priority="high", progress=False)
    model = ToyDiT()
    with pytest.raises(ValueError, match="needs a CUDA device, got device=cpu"):
        OffloadedTransformer(model, cfg, device="cpu")
    with pytest.raises(ValueError, match="needs OffloadedTransformer"):
        apply_layerwise_offload(model, cfg, device="cpu")
    # refused before anything moved: the model still runs as it was
    assert all(p.numel() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["none", "exp-k"])
def test_high_priority_forward_is_bit_exact_on_cuda(codec):
    model, ref, x = build("flux", "cuda", torch.bfloat16)
    cfg = OffloadConfig.layerwise(compute_priority="high", weight_codec=codec, progress=False)
    wrapped = OffloadedTransformer(model, cfg, device="cuda")
    caller = torch.cuda.Stream()
    with torch.no_grad():
        expected = first(ref(**x))
        torch.cuda.synchronize()
        with torch.cuda.stream(caller):  # a caller on its own stream reads the outputs right away
            outs = [first(wrapped(**x)).clone() for _ in range(3)]
        caller.synchronize()
    assert all(torch.equal(o, expected) for o in outs)
    assert wrapped._compute_stream.priority < caller.priority
    assert wrapped.stats()["compute_priority"] == "high"
