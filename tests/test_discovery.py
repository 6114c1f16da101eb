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


# ------------------------------------------------------------------ automatic discovery: execution order
import copy  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402

from weightstream import OffloadConfig, OffloadedTransformer  # noqa: E402
from weightstream.offload.discovery import BlockOrderError, find_candidates, trace_plan  # noqa: E402

W = 8


def toy_list(n):
    return nn.ModuleList([ToyBlock(W, 2 * W, torch.float32) for _ in range(n)])


class RefinerFirst(nn.Module):
    """Refiner registered after the main layers, but run before them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = toy_list(3)
        self.noise_refiner = toy_list(2)

    def forward(self, x):
        for b in self.noise_refiner:
            x = b(x)
        for b in self.layers:
            x = b(x)
        return x


class Zipped(nn.Module):
    """Two lists run interleaved; the body calls the temporal block first."""

    def __init__(self, n_temporal=2):
        super().__init__()
        torch.manual_seed(0)
        self.transformer_blocks = toy_list(2)
        self.temporal_transformer_blocks = toy_list(n_temporal)

    def forward(self, x):
        for i, (spatial, temporal) in enumerate(zip(self.transformer_blocks, self.temporal_transformer_blocks)):
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                x = spatial(x)  # the training path is skipped by discovery
            x = temporal(x)
            x = spatial(x)
        return x

    gradient_checkpointing = False


class Indexed(nn.Module):
    """A second list indexed inside the first one's loop (as WanVACE-like hints or ConsisID)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = toy_list(2)
        self.vace_blocks = toy_list(2)

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x)
            x = self.vace_blocks[i](x)
        return x


class Conditional(nn.Module):
    """``layers`` run only when an input is given; ``blocks`` only when a config flag is set."""

    def __init__(self, use_refiner=False):
        super().__init__()
        torch.manual_seed(0)
        self.use_refiner = use_refiner
        self.noise_refiner = toy_list(2)
        self.blocks = toy_list(2)
        self.layers = toy_list(2)

    def forward(self, x, extra=None):
        if self.use_refiner:
            for b in self.noise_refiner:
                x = b(x)
        for b in self.blocks:
            x = b(x)
        if extra is not None:
            for b in self.layers:
                x = b(x + extra)
        return x


class Refiner(nn.Module):
    def __init__(self):
        super().__init__()
        self.refiner_blocks = toy_list(2)

    def forward(self, x):
        for b in self.refiner_blocks:
            x = b(x)
        return x


class NestedAfter(nn.Module):
    """A nested list (``token_refiner.refiner_blocks``) registered first, run after ``blocks``, via a helper."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.token_refiner = Refiner()
        self.blocks = toy_list(2)

    def _main(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, x):
        x = self._main(x)
        return self.token_refiner(x)


def x_in(seed=1):
    return torch.randn(2, 3, W, generator=torch.Generator().manual_seed(seed))


def streams_bit_exact(model, plan=None, **kw):
    ref = copy.deepcopy(model)
    x = x_in()
    with torch.no_grad():
        want = ref(x, **kw)
        wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device="cpu", plan=plan)
        outs = [wrapped(x, **kw) for _ in range(2)]
    assert all(torch.equal(o, want) for o in outs)


def test_execution_order_not_registration_order():
    m = RefinerFirst()
    assert names(discover_blocks(m)) == ["noise_refiner.0", "noise_refiner.1", "layers.0", "layers.1", "layers.2"]
    streams_bit_exact(m)


def test_zip_interleaves_in_body_order():
    m = Zipped()
    assert names(discover_blocks(m)) == [
        "temporal_transformer_blocks.0", "transformer_blocks.0",
        "temporal_transformer_blocks.1", "transformer_blocks.1",
    ]
    streams_bit_exact(m)


def test_zip_of_unequal_lists_raises():
    with pytest.raises(BlockOrderError, match=r"zips .* of different lengths.*trace_plan"):
        discover_blocks(Zipped(n_temporal=3))


def test_nested_list_through_helper_and_submodule_call():
    m = NestedAfter()
    assert names(discover_blocks(m)) == ["blocks.0", "blocks.1", "token_refiner.refiner_blocks.0",
                                         "token_refiner.refiner_blocks.1"]
    streams_bit_exact(m)


def test_indexed_inside_another_loop_raises_naming_containers():
    with pytest.raises(BlockOrderError) as err:
        discover_blocks(Indexed())
    msg = str(err.value)
    assert "'blocks' (2 blocks), 'vace_blocks' (2 blocks)" in msg
    assert "uses self.vace_blocks as `self.vace_blocks[i]` inside the loop over 'blocks'" in msg
    assert "trace_plan" in msg and "OffloadPlan" in msg


def test_trace_plan_records_real_order_and_streams_it():
    m = Indexed()
    plan = trace_plan(m, x_in())
    assert plan.block_containers == ("blocks.0", "vace_blocks.0", "blocks.1", "vace_blocks.1")
    assert plan.not_run == ()
    assert names(discover_blocks(m, plan)) == list(plan.block_containers)
    streams_bit_exact(m, plan)


def test_trace_plan_removes_hooks_and_moves_nothing():
    m = Indexed()
    before = {k: (v.data_ptr(), v.clone()) for k, v in m.state_dict().items()}
    trace_plan(m, x_in())
    assert all(not c.module._forward_pre_hooks for c in find_candidates(m))
    after = m.state_dict()
    assert all(after[k].data_ptr() == p and torch.equal(after[k], v) for k, (p, v) in before.items())

    class Boom(Exception):
        pass

    def fail(module, args):
        raise Boom

    m.blocks[1].register_forward_pre_hook(fail)
    with pytest.raises(Boom):
        trace_plan(m, x_in())
    assert len(m.blocks[1]._forward_pre_hooks) == 1  # only ours is left: trace_plan removed its own
    assert all(not c.module._forward_pre_hooks for c in find_candidates(m) if c.module is not m.blocks[1])


def test_trace_plan_rejects_a_block_run_twice():
    class Twice(RefinerFirst):
        def forward(self, x):
            return super().forward(self.layers[0](x))

    with pytest.raises(ValueError, match=r"ran more than once.*'layers.0' \(2 times\)"):
        trace_plan(Twice(), x_in())


def test_conditional_on_input_stays_resident_and_is_explained():
    m = Conditional()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert names(discover_blocks(m)) == ["blocks.0", "blocks.1"]
    said = [str(w.message) for w in caught]
    assert any("'noise_refiner' (2 blocks) never run" in w for w in said)
    assert any(re.search(r"'layers' \(2 blocks\) only when Conditional: extra is not None.*zero times.*"
                         r"stay resident.*trace_plan", w) for w in said)
    with pytest.warns(UserWarning, match="stay resident"):
        streams_bit_exact(m, extra=x_in(2))  # the resident layers run whichever way
    with pytest.warns(UserWarning, match="stay resident"):
        streams_bit_exact(Conditional())


def test_only_conditional_lists_raise():
    class OnlyIf(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = toy_list(2)

        def forward(self, x, extra=None):
            if extra is not None:
                for b in self.blocks:
                    x = b(x)
            return x

    with pytest.raises(BlockOrderError, match=r"'blocks' \(2 blocks\) only when OnlyIf: extra is not None.*"
                                              r"zero times.*trace_plan"):
        discover_blocks(OnlyIf())


def test_trace_plan_leaves_unrun_blocks_out():
    m = Conditional()
    with pytest.warns(UserWarning, match=r"4 candidate block\(s\) .* did not run.*noise_refiner.0, noise_refiner.1, "
                                         r"layers.0, layers.1"):
        plan = trace_plan(m, x_in())
    assert plan.block_containers == ("blocks.0", "blocks.1")
    assert plan.not_run == ("noise_refiner.0", "noise_refiner.1", "layers.0", "layers.1")
    streams_bit_exact(m, plan)  # without `extra`: the layers stay resident and are not run


def test_static_config_condition_is_evaluated():
    on = Conditional(use_refiner=True)
    on.layers = None  # leave only the statically decided branch
    assert names(discover_blocks(on)) == ["noise_refiner.0", "noise_refiner.1", "blocks.0", "blocks.1"]
    off = Conditional(use_refiner=False)
    off.layers = None
    with pytest.warns(UserWarning, match=r"'noise_refiner' \(2 blocks\) never run.*self.use_refiner.*stay resident"):
        assert names(discover_blocks(off)) == ["blocks.0", "blocks.1"]


def test_declared_classes_win_over_names():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = ToyBlock(W, 2 * W, torch.float32)

        def forward(self, x):
            return self.block(x)

    class Declared(nn.Module):
        _no_split_modules = ["ToyBlock"]

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Wrapper() for _ in range(2)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    found = find_candidates(Declared())
    assert [(c.name, c.reason) for c in found] == [("blocks.0.block", "_no_split_modules"),
                                                  ("blocks.1.block", "_no_split_modules")]


def test_plan_not_run_validation():
    with pytest.raises(TypeError, match="not_run='x' must be a list"):
        OffloadPlan(["blocks"], not_run="x")


class Sliced(nn.Module):
    """One list run in two slices through a local alias, another list between them (as Motif-Video)."""

    def __init__(self, n_tail=1):
        super().__init__()
        torch.manual_seed(0)
        self.n_tail = n_tail
        self.blocks = toy_list(3)
        self.layers = toy_list(2)

    def forward(self, x):
        blocks = self.blocks
        for b in blocks[: len(blocks) - self.n_tail]:
            x = b(x)
        for b in self.layers:
            x = b(x)
        if self.n_tail > 0:
            for b in blocks[-self.n_tail:]:
                x = b(x)
        return x


def test_sliced_list_is_split_at_its_slices():
    m = Sliced()
    assert names(discover_blocks(m)) == ["blocks.0", "blocks.1", "layers.0", "layers.1", "blocks.2"]
    streams_bit_exact(m)
    assert names(discover_blocks(Sliced(n_tail=0))) == ["blocks.0", "blocks.1", "blocks.2", "layers.0", "layers.1"]


def test_slices_that_repeat_blocks_raise():
    class Overlap(Sliced):
        def forward(self, x):
            for b in self.blocks[:2]:
                x = b(x)
            for b in self.layers:
                x = b(x)
            for b in self.blocks[1:]:
                x = b(x)
            return x

    with pytest.raises(BlockOrderError, match=r"iterates self.blocks as `self.blocks\[:2\]`, `self.blocks\[1:\]`, "
                                              r"which runs some of its blocks zero or several times"):
        discover_blocks(Overlap())
