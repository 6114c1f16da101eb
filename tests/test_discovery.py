import pytest
import torch
from torch import nn

from weightstream import OffloadPlan
from weightstream.models import ToyBlock, ToyDiT, tiny_flux, tiny_wan
from weightstream.offload.discovery import discover_blocks


def names(blocks):
    return [b.name for b in blocks]


def test_flux_containers_concatenated_in_execution_order():
    blocks = discover_blocks(tiny_flux())
    assert names(blocks) == [
        "transformer_blocks.0", "transformer_blocks.1",
        "single_transformer_blocks.0", "single_transformer_blocks.1", "single_transformer_blocks.2",
    ]
    assert [b.index for b in blocks] == list(range(5))


def test_wan_blocks():
    assert names(discover_blocks(tiny_wan())) == ["blocks.0", "blocks.1", "blocks.2"]


def test_declared_attrs_win():
    m = ToyDiT()
    assert names(discover_blocks(m))[:3] == ["double_blocks.0", "double_blocks.1", "single_blocks.0"]
    assert len(discover_blocks(m)) == 7


def test_plan_overrides_and_accepts_dotted_paths():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = ToyDiT()

    blocks = discover_blocks(Outer(), OffloadPlan(["inner.single_blocks", "inner.double_blocks"]))
    assert names(blocks)[0] == "inner.single_blocks.0" and len(blocks) == 7


def test_discovery_moves_nothing():
    m = tiny_flux()
    before = {k: (v.data_ptr(), v.device) for k, v in m.state_dict().items()}
    discover_blocks(m)
    assert before == {k: (v.data_ptr(), v.device) for k, v in m.state_dict().items()}


class Bad(nn.Module):
    def __init__(self, blocks, attrs=None):
        super().__init__()
        self.stack = blocks
        if attrs is not None:
            self._attrs = attrs


def test_missing_attribute():
    with pytest.raises(ValueError, match=r"'single_blocks.nope' not found.*has no attribute 'nope'"):
        discover_blocks(ToyDiT(), OffloadPlan(["single_blocks.nope"]))


def test_item_not_a_module():
    m = nn.Module()
    m.items = [ToyBlock(4, 8, torch.float32), "not a module"]
    with pytest.raises(ValueError, match=r"block 'items.1' is a str, not an nn.Module"):
        discover_blocks(m, OffloadPlan(["items"]))


def test_too_few_blocks():
    m = nn.Module()
    m.blocks = nn.ModuleList([ToyBlock(4, 8, torch.float32)])
    with pytest.raises(ValueError, match=r"found 1 streamable block.*at least 2"):
        discover_blocks(m)


def test_block_claimed_twice():
    m = ToyDiT()
    with pytest.raises(ValueError, match=r"claimed twice"):
        discover_blocks(m, OffloadPlan(["double_blocks", "double_blocks"]))


def test_block_inside_another_block():
    m = nn.Module()
    m.blocks = nn.ModuleList([ToyBlock(4, 8, torch.float32) for _ in range(2)])
    m.wrapper = nn.Module()
    m.wrapper.inner = m.blocks[0]
    with pytest.raises(ValueError, match=r"'blocks.0' is claimed twice: it lies inside block 'wrapper'"):
        discover_blocks(m, OffloadPlan(["wrapper", "blocks"]))


def test_no_containers():
    with pytest.raises(ValueError, match=r"no block containers found on Linear"):
        discover_blocks(nn.Linear(2, 2))


def test_plan_validation():
    with pytest.raises(TypeError, match="not one string"):
        OffloadPlan("blocks")
    with pytest.raises(ValueError, match="empty"):
        OffloadPlan([])
