"""resident_layers="auto" and explicit resident block sets: bit-exact under every placement."""
import copy

import pytest
import torch

from layerwise_cases import build, first
from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import ToyDiT, toy_inputs

DEV = "cpu"


def _image_bytes(wrapped) -> list[int]:
    return [lay.nbytes for lay in wrapped.executor.source.layouts]


def _auto(model, budget_gb: float, **kw):
    """Auto placement over a slow link (1 kB/s): on the CPU the measured copy rate is
    noise, and a transfer-bound step makes the planner keep blocks resident."""
    kw.setdefault("weight_codec", "none")  # the placement alone (not given, the codec would be planned too)
    cfg = OffloadConfig.layerwise(resident_layers="auto", device_memory_budget_gb=budget_gb,
                                  progress=False, **kw)
    wrapped = OffloadedTransformer(model, cfg, device=DEV)
    wrapped._streamed.placement.h2d_gbps = 1e-6
    return wrapped


def _same(a, b) -> bool:
    return torch.equal(first(a), first(b))


@pytest.mark.parametrize("name", ["flux", "wan", "toy"])
def test_auto_placement_is_bit_exact_and_keeps_some_blocks(name):
    model, ref, x = build(name, DEV)
    probe = OffloadedTransformer(copy.deepcopy(model), OffloadConfig.layerwise(progress=False), device=DEV)
    sizes, fixed = _image_bytes(probe), probe.stats()["resident_bytes"]
    probe.disable()
    # room for the fixed modules, two slots and about half the blocks
    budget = fixed + 2 * max(sizes) + sum(sizes) // 2
    wrapped = _auto(model, budget / 1e9)
    with torch.no_grad():
        expected = first(ref(**x))
        outs = [first(wrapped(**x)) for _ in range(4)]
    assert all(torch.equal(o, expected) for o in outs)
    s = wrapped.stats()
    placed = s["placement"]
    assert placed["resident_blocks"] == s["resident_blocks"] and s["blocks_resident"] == len(placed["resident_blocks"])
    assert placed["device_bytes"] <= placed["budget_bytes"]
    assert 0 < s["blocks_resident"] < len(sizes), s  # the budget keeps some, not all
    assert "Predicted step" in placed["describe"]
    # the blocks the plan made resident move nothing per step and count as resident bytes
    kept = set(s["resident_blocks"])
    moved = sum(b for i, b in enumerate(sizes) if i not in kept)
    assert s["streamed_bytes_per_step"] == moved and s["h2d_bytes_per_step"] == moved, s
    assert s["resident_bytes"] == fixed + sum(sizes[i] for i in kept), s
    back = wrapped.disable()
    with torch.no_grad():
        assert torch.equal(first(back(**x)), expected)


def test_replanning_between_signatures_is_bit_exact():
    """Each new input signature is measured once and planned; switching back reuses
    its plan; outputs stay equal to the resident model under every placement."""
    model = ToyDiT()
    ref = copy.deepcopy(model)
    wrapped = _auto(model, 6e-4)
    small, large = toy_inputs(tokens=5), toy_inputs(tokens=64, batch=4)
    placements = []
    with torch.no_grad():
        for x in (small, small, large, large, small, large):
            assert torch.equal(wrapped(**x), ref(**x))
            placements.append(tuple(wrapped.stats()["resident_blocks"]))
    assert len(wrapped._streamed.placement.plans) == 2
    assert placements[1] == placements[4] and placements[3] == placements[5]


def test_a_block_that_streams_again_keeps_edits_made_while_resident():
    """A plan change demotes a resident block: its device tensors (edited in place while
    resident) are written back to the host image first, so nothing is lost."""
    model = ToyDiT()
    ref = copy.deepcopy(model)
    wrapped = _auto(model, 6e-4)
    placement = wrapped._streamed.placement
    x, x2 = toy_inputs(tokens=5), toy_inputs(tokens=7)
    with torch.no_grad():
        wrapped(**x)
        resident = wrapped.stats()["resident_blocks"]
        assert resident
        b = resident[0]
        blocks = [*model.double_blocks, *model.single_blocks]
        ref_blocks = [*ref.double_blocks, *ref.single_blocks]
        w = next(iter(blocks[b].parameters()))
        w.mul_(0.5)  # an in-place edit of a resident block's tensor
        next(iter(ref_blocks[b].parameters())).mul_(0.5)
        placement.budget_bytes = lambda: 2 * max(_image_bytes(wrapped)) + 60_000  # the next plan streams it
        assert torch.equal(wrapped(**x2), ref(**x2))  # measured with the old plan, then re-planned
        assert b not in wrapped.stats()["resident_blocks"]
        for _ in range(2):
            assert torch.equal(wrapped(**x2), ref(**x2))  # streamed now, from the written-back image
        sd = wrapped.state_dict()
        for k, v in ref.state_dict().items():
            assert torch.equal(sd[k], v), k


def test_update_weights_and_state_dict_under_auto_placement():
    model = ToyDiT()
    ref = copy.deepcopy(model)
    wrapped = _auto(model, 6e-4)
    x = toy_inputs()
    with torch.no_grad():
        wrapped(**x)
        assert wrapped.stats()["blocks_resident"] > 0
        new = {k: (v * 1.25 if v.is_floating_point() else v) for k, v in ref.state_dict().items()}
        written = wrapped.update_weights(new)
        assert sorted(written) == sorted(new)
        ref.load_state_dict(new)
        assert torch.equal(wrapped(**x), ref(**x))
        sd = wrapped.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("resident", [[1, 3], [0, 6], [2]])
def test_explicit_resident_block_sets_are_bit_exact(resident):
    model = ToyDiT()
    ref = copy.deepcopy(model)
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(resident_layers=resident, progress=False),
                                   device=DEV)
    x = toy_inputs()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(wrapped(**x), ref(**x))
    s = wrapped.stats()
    assert s["resident_blocks"] == sorted(resident) and s["blocks_streamed"] == 7 - len(resident)


def test_auto_rules_are_named():
    with pytest.raises(ValueError, match="device_memory_budget_gb"):
        OffloadedTransformer(ToyDiT(), OffloadConfig.layerwise(resident_layers="auto", progress=False), device=DEV)
    with pytest.raises(ValueError, match="cuda_graphs"):
        OffloadConfig.layerwise(resident_layers="auto", cuda_graphs="on")


@pytest.mark.gpu
def test_auto_placement_on_cuda_equals_resident():
    model, ref, x = build("flux", "cuda", torch.bfloat16)
    cfg = OffloadConfig.layerwise(resident_layers="auto", weight_codec="none",
                                  progress=False)  # budget: free memory less the margin
    wrapped = OffloadedTransformer(model, cfg, device="cuda")
    with torch.no_grad():
        expected = first(ref(**x))
        outs = [first(wrapped(**x)) for _ in range(3)]
    assert all(torch.equal(o, expected) for o in outs)
    s = wrapped.stats()
    assert s["placement"]["budget_bytes"] > 0 and s["blocks_resident"] == len(s["placement"]["resident_blocks"])


def _auto_half(name, **kw):
    model, ref, x = build(name, DEV)
    probe = OffloadedTransformer(copy.deepcopy(model), OffloadConfig.layerwise(progress=False), device=DEV)
    sizes, fixed = _image_bytes(probe), probe.stats()["resident_bytes"]
    probe.disable()
    wrapped = _auto(model, (fixed + 2 * max(sizes) + sum(sizes) // 2) / 1e9, **kw)
    return model, ref, x, wrapped


@pytest.mark.parametrize("codec", ["none", "exp-k"])
@pytest.mark.parametrize("where", ["host-view", "device-param", "update"])
def test_edits_of_a_block_made_resident_by_the_plan_take_effect(where, codec):
    """The host image stays the master of a block the plan keeps resident: a state_dict()
    tensor taken before the plan and edited after it, an in-place edit of the resident
    parameter itself, and update_weights all reach the next forward, state_dict() and
    disable() (none is silently ignored, none overwrites another later)."""
    model, ref, x, wrapped = _auto_half("toy", weight_codec=codec)
    before = wrapped.state_dict()  # host views, taken before the plan
    with torch.no_grad():
        wrapped(**x)  # measures, plans: some blocks become resident
    resident = wrapped.stats()["resident_blocks"]
    assert resident
    blocks = list(model.double_blocks) + list(model.single_blocks)
    ref_blocks = list(ref.double_blocks) + list(ref.single_blocks)
    i = resident[0]
    name = [n for n, _ in blocks[i].named_parameters()][0]
    key = f"{'double' if i < len(model.double_blocks) else 'single'}_blocks." \
          f"{i if i < len(model.double_blocks) else i - len(model.double_blocks)}.{name}"
    delta = 0.125
    with torch.no_grad():
        if where == "host-view":
            before[key].add_(delta)
        elif where == "device-param":
            dict(blocks[i].named_parameters())[name].add_(delta)
        else:
            wrapped.update_weights({key: before[key] + delta})
        dict(ref_blocks[i].named_parameters())[name].add_(delta)
        expected = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), expected)
        assert torch.equal(wrapped.state_dict()[key], ref.state_dict()[key])
        assert torch.equal(first(wrapped(**x)), expected)
    back = wrapped.disable()
    with torch.no_grad():
        assert torch.equal(first(back(**x)), expected)
