"""Graph capture/replay policy: pure, on the CPU."""
import pytest
import torch

from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.graphs.policy import (
    Action,
    GraphPolicy,
    UnsupportedInput,
    autocast_problem,
    output_problem,
    signature,
    step_problem,
)
from weightstream.graphs.runner import CapturePreconditionError
from weightstream.models import ToyDiT, toy_inputs


def test_signature_keys_shapes_dtypes_and_values():
    a = torch.zeros(2, 3)
    base = signature((a,), {"flag": True})
    assert base == signature((torch.ones(2, 3),), {"flag": True})  # values of tensors do not matter
    assert base != signature((torch.zeros(2, 4),), {"flag": True})
    assert base != signature((torch.zeros(2, 3, dtype=torch.float64),), {"flag": True})
    assert base != signature((a,), {"flag": False})
    assert base != signature((a,), {"flag": True, "extra": None})
    assert base != signature((a.t().contiguous().t(),), {"flag": True})  # strides
    nested = signature((), {"kw": {"x": a, "scale": 1.0}})
    assert nested != signature((), {"kw": {"x": a, "scale": 2.0}})
    hash(base), hash(nested)


def test_signature_keys_requires_grad_and_device():
    a = torch.zeros(2, 3)
    base = signature((a,), {})
    assert base != signature((torch.zeros(2, 3, requires_grad=True),), {})
    assert base != signature((torch.zeros(2, 3, device="meta"),), {})
    assert base == signature((torch.zeros(2, 3, device="cpu"),), {})


def _cuda_autocast(enabled, dtype):
    """Set CUDA autocast state directly (torch.autocast('cuda') refuses on a CPU-only build)."""
    torch.set_autocast_enabled("cuda", enabled)
    torch.set_autocast_dtype("cuda", dtype)


def test_signature_keys_grad_inference_and_autocast_modes():
    a = torch.zeros(2, 3)
    sig = lambda: signature((a,), {"flag": True})  # noqa: E731
    with torch.no_grad():
        plain = sig()
        assert plain == sig()  # the same mode twice: the same key
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cpu_bf16 = sig()
        with torch.autocast("cpu", dtype=torch.float16):
            cpu_f16 = sig()
    with torch.enable_grad():
        grad = sig()
    with torch.inference_mode():
        inference = sig()
    dtype_before = torch.get_autocast_dtype("cuda")
    try:
        with torch.no_grad():
            _cuda_autocast(True, torch.bfloat16)
            cuda_bf16 = sig()
            _cuda_autocast(True, torch.float16)
            cuda_f16 = sig()
            _cuda_autocast(False, torch.bfloat16)  # a dtype without autocast changes nothing
            cuda_off = sig()
    finally:
        _cuda_autocast(False, dtype_before)
    keys = [plain, cpu_bf16, cpu_f16, grad, inference, cuda_bf16, cuda_f16]
    assert len(set(keys)) == len(keys)
    assert cuda_off == plain


def test_autocast_cache_flag_is_keyed_and_refused():
    a = torch.zeros(2, 3)
    with torch.no_grad():
        assert autocast_problem("cpu") is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cached = signature((a,), {})
            why = autocast_problem("cpu")
            assert why is not None and "cache_enabled=False" in why
            assert autocast_problem("cuda") is None  # another device type's autocast is off
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            assert autocast_problem("cpu") is None
            uncached = signature((a,), {})
    assert cached != uncached


class _Unregistered:
    """An output container torch's pytree does not know."""

    def __init__(self, sample):
        self.sample = sample


def test_outputs_whose_containers_pytree_does_not_know_are_refused():
    from weightstream.models import flux_inputs, tiny_flux

    model = tiny_flux()
    x = flux_inputs(model)
    with torch.no_grad():
        out = model(**{**x, "return_dict": True})  # diffusers' BaseOutput: registered with pytree
        tup = model(**{**x, "return_dict": False})
    assert type(out).__name__ == "Transformer2DModelOutput" and isinstance(tup, tuple)
    t = torch.zeros(2)
    for ok in (t, out, tup, (t, None, 3), {"a": t, "b": [t, 1.5]}):
        assert output_problem(ok) is None, ok
    for bad in (_Unregistered(t), (t, _Unregistered(t)), {"x": [_Unregistered(t)]}, [object()]):
        why = output_problem(bad)
        assert why is not None and "pytree" in why, bad
    assert "_Unregistered" in output_problem((t, _Unregistered(t)))


def test_a_capture_that_did_not_run_exactly_one_step_is_named():
    assert step_problem(7, 7) is None
    assert "ran 3 of the 7 streamed block" in step_problem(3, 7)
    assert "ran 14 of the 7 streamed block" in step_problem(14, 7)
    assert step_problem(0, 7) is not None


def test_unhashable_leaf_is_rejected():
    with pytest.raises(UnsupportedInput, match="bytearray"):
        signature((bytearray(b"x"),), {})


def test_warmup_then_capture_then_replay():
    pol = GraphPolicy(max_graphs=4)
    sig = signature((torch.zeros(1),), {})
    assert pol.decide(sig, 0) is Action.EAGER_WARMUP
    pol.warmed_up(sig)
    assert pol.decide(sig, 0) is Action.CAPTURE
    assert pol.captured(sig, 0) == []
    assert pol.decide(sig, 0) is Action.REPLAY
    assert pol.decide(sig, 1) is Action.CAPTURE  # other phase: its own graph


def test_cache_is_bounded_lru():
    pol = GraphPolicy(max_graphs=2)
    sigs = [signature((torch.zeros(i + 1),), {}) for i in range(3)]
    for s in sigs[:2]:
        pol.warmed_up(s)
        pol.captured(s, 0)
    pol.decide(sigs[0], 0)  # touch: sigs[1] becomes least recently used
    pol.warmed_up(sigs[2])
    assert pol.captured(sigs[2], 0) == [(sigs[1], 0)]
    assert pol.decide(sigs[1], 0) is Action.CAPTURE
    assert pol.decide(sigs[0], 0) is Action.REPLAY


def test_failed_capture_falls_back_for_that_signature_only():
    pol = GraphPolicy()
    s1, s2 = signature((1,), {}), signature((2,), {})
    pol.warmed_up(s1)
    pol.warmed_up(s2)
    assert pol.capture_failed(s1, "host sync") is True
    assert pol.capture_failed(s2, "again") is False  # warn once
    assert pol.decide(s1, 0) is Action.EAGER_FALLBACK
    pol.failed.pop(s2)
    assert pol.decide(s2, 0) is Action.CAPTURE


@pytest.mark.parametrize("n, slots, period", [(4, 2, 1), (5, 2, 2), (57, 2, 2), (6, 3, 1), (7, 3, 3)])
def test_phase_period(n, slots, period):
    from weightstream.offload.schedule import Schedule

    assert Schedule(n, 0, slots).phase_period == period
    assert Schedule(n + 1, 1, slots, step_local=True).phase_period == 1


def test_bad_max_graphs():
    with pytest.raises(ValueError, match="max_graphs=0"):
        GraphPolicy(max_graphs=0)


def test_preconditions_are_named_and_lose_nothing():
    model = ToyDiT()
    x = toy_inputs()
    with torch.no_grad():
        ref = model(**x)
    with pytest.raises(CapturePreconditionError, match="needs a CUDA device"):
        OffloadedTransformer(model, OffloadConfig.layerwise(cuda_graphs="on"), device="cpu")
    with torch.no_grad():
        assert torch.equal(model(**x), ref)  # weights given back


def test_settling_holds_back_a_capture_not_a_warmup_or_replay():
    """While the source's loads are about to change (blocks coded in the background) a warmed
    signature runs eager; the warm-up and an existing graph are not held back."""
    pol = GraphPolicy(max_graphs=4)
    sig = signature((torch.zeros(1),), {})
    why = "3 blocks are being coded in the background"
    assert pol.decide(sig, 0, settling=why) is Action.EAGER_WARMUP
    pol.warmed_up(sig)
    assert pol.decide(sig, 0, settling=why) is Action.EAGER_SETTLING
    assert pol.decide(sig, 0) is Action.CAPTURE
    pol.captured(sig, 0)
    assert pol.decide(sig, 0, settling=why) is Action.REPLAY
    assert pol.decide(sig, 1, settling=why) is Action.EAGER_SETTLING
