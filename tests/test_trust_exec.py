"""Executor-level misuse never gives a silent wrong result (CPU: the same executor, no streams).

Each test compares against the real resident model (tests/layerwise_cases.py)."""
import copy
import pickle
import threading
import warnings

import pytest
import torch
from torch import nn

from weightstream import OffloadConfig, OffloadedTransformer, OffloadPlan
from weightstream import (
    AlreadyOffloadedError, ConcurrentUseError, DuplicateKeyError, InferenceOnlyError, OffloadMisuseError,
    SharedStorageError, StreamedModuleAccessError, StreamedWriteError, UnsupportedOperationError,
    WeightUpdateError,
)
from weightstream.models import ToyDiT, toy_inputs
from weightstream.offload.build import streamed_blocks

from layerwise_cases import build, first

DEV = "cpu"

# (model, config keys, via StreamedBlocks: the graph schedules run eagerly on the CPU)
SCHEDULES = [
    ("toy", {}, False),                                   # plain ring, 7 blocks (odd), 2 slots
    ("toy", {"num_slots": 3}, False),
    ("flux", {"resident_layers": 1}, False),              # 4 streamed
    ("flux", {"resident_layers": 2, "num_slots": 3}, False),
    ("wan", {}, False),                                   # 3 blocks
    ("toy", {"cuda_graphs": "on"}, True),                 # defer_last (next-step)
    ("flux", {"cuda_graphs": "on", "num_slots": 3}, True),
    ("toy", {"cuda_graphs": "on", "resident_layers": 2}, True),   # step_local
    ("flux", {"cuda_graphs": "on", "resident_layers": 1, "num_slots": 3}, True),
]
IDS = [f"{m}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'plain'}" for m, c, _ in SCHEDULES]


class Runner:
    """One offloaded model on the CPU: the wrapper, or StreamedBlocks for the graph schedules."""

    def __init__(self, name, cfg, direct):
        self.model, self.ref, self.x = build(name, DEV)
        config = OffloadConfig.layerwise(**cfg)
        if direct:
            self.sb = streamed_blocks(self.model, config, torch.device(DEV), None)
            assert self.sb.schedule.has_step_start
            self.call = lambda: first(self.model(**self.x))
            self.update = self.sb.update_weights
            self.host = lambda key: self.sb.host_views[id(self.model.state_dict(keep_vars=True)[key])]
        else:
            self.wrapped = OffloadedTransformer(self.model, config, device=DEV)
            self.sb = self.wrapped._streamed
            self.call = lambda: first(self.wrapped(**self.x))
            self.update = self.wrapped.update_weights
            self.host = lambda key: self.wrapped.state_dict()[key]

    def expected(self):
        with torch.no_grad():
            return first(self.ref(**self.x))

    def out(self):
        with torch.no_grad():
            return self.call()

    def streamed_keys(self):
        sd = self.model.state_dict(keep_vars=True)
        return [k for k, t in sd.items() if id(t) in self.sb.host_views and t.is_floating_point()]


def scaled(sd, keys, f):
    return {k: (sd[k] * f).to(sd[k].dtype) for k in keys}


# ----------------------------------------------------------------------------- 1. update_weights
@pytest.mark.parametrize("name, cfg, direct", SCHEDULES, ids=IDS)
def test_failed_update_writes_nothing(name, cfg, direct):
    r = Runner(name, cfg, direct)
    keys = r.streamed_keys()
    for _ in range(2):
        assert torch.equal(r.out(), r.expected())  # slots prefetched for the next step
    good = scaled(r.ref.state_dict(), keys[:3], 0.5)
    bad_shape = dict(good, **{keys[3]: torch.zeros(1)})
    bad_dtype = dict(good, **{keys[3]: r.ref.state_dict()[keys[3]].double()})
    bad_name = dict(good, **{"no.such.key": torch.zeros(1)})
    for bad, what in ((bad_shape, keys[3]), (bad_dtype, keys[3]), (bad_name, "no.such.key")):
        with pytest.raises(WeightUpdateError, match=what.replace(".", r"\.")):
            r.update(bad)
        for _ in range(2):  # neither the next forward nor the one after sees a half update
            assert torch.equal(r.out(), r.expected())
    with pytest.raises(WeightUpdateError, match="a Tensor"):
        r.update({keys[0]: [1.0, 2.0]})
    assert torch.equal(r.out(), r.expected())


@pytest.mark.parametrize("name, cfg, direct", SCHEDULES, ids=IDS)
def test_update_takes_effect_at_the_very_next_forward(name, cfg, direct):
    r = Runner(name, cfg, direct)
    keys = r.streamed_keys()
    for round_ in range(3):
        r.out()
        new = scaled(r.ref.state_dict(), keys, 0.9)
        r.ref.load_state_dict(new, strict=False)
        assert r.update(new) == list(new)
        assert torch.equal(r.out(), r.expected()), f"round {round_}: the next forward used old weights"
        assert torch.equal(r.out(), r.expected())


@pytest.mark.parametrize("name, cfg, direct", SCHEDULES, ids=IDS)
def test_in_place_edit_of_state_dict_tensor_takes_effect(name, cfg, direct):
    """state_dict() tensors are views of the host store: an in-place edit through
    torch is picked up at the next step start (prefetched slots are reloaded)."""
    r = Runner(name, cfg, direct)
    keys = r.streamed_keys()
    for round_ in range(3):
        r.out()
        with torch.no_grad():
            for k in keys:  # every streamed block, so a prefetched slot is affected
                r.host(k).mul_(0.75)
                r.ref.state_dict()[k].mul_(0.75)
        assert torch.equal(r.out(), r.expected()), f"round {round_}: in-place edit not seen by the next forward"
    with torch.inference_mode():
        r.host(keys[-1]).add_(0.25)
    with torch.no_grad():
        r.ref.state_dict()[keys[-1]].add_(0.25)
    assert torch.equal(r.out(), r.expected())


# ----------------------------------------------------------------------------- 2. threads
def test_second_thread_is_refused_and_the_first_is_exact():
    """Thread A pauses inside block 2; thread B calls the same model then. B gets
    ConcurrentUseError (today: a misleading error, and A computes with slots B
    re-primed); A's output is exact; afterwards B can use the model."""
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    inside, b_done = threading.Event(), threading.Event()

    def pause(m, a):
        if threading.current_thread().name == "A":
            inside.set()
            b_done.wait(30)

    model.single_blocks[0].register_forward_pre_hook(pause)
    results = {}

    def run(name):
        try:
            with torch.no_grad():
                results[name] = wrapped(**x)
        except Exception as e:  # noqa: BLE001 - recorded for the asserts
            results[name] = e
        finally:
            if name == "B":
                b_done.set()

    a = threading.Thread(target=run, args=("A",), name="A")
    b = threading.Thread(target=run, args=("B",), name="B")
    a.start()
    assert inside.wait(30)
    b.start()
    b.join(30), a.join(30)
    with torch.no_grad():
        expected = ref(**x)
    assert isinstance(results["B"], ConcurrentUseError), results["B"]
    assert "concurrently" in str(results["B"])
    assert torch.equal(results["A"], expected)
    b = threading.Thread(target=run, args=("B",), name="B")
    b.start(), b.join(30)
    assert torch.equal(results["B"], expected)  # released once A's call returned


def test_second_thread_calling_the_module_directly_is_refused():
    """The guard sits in the executor too: calling the wrapped module (not the
    wrapper), or a streamed block, from a second thread mid-step is refused."""
    model, ref, x = build("flux", DEV)
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(resident_layers=1), device=DEV)
    inside, b_done = threading.Event(), threading.Event()

    def pause(m, a):
        if threading.current_thread().name == "A":
            inside.set()
            b_done.wait(30)

    model.single_transformer_blocks[1].register_forward_pre_hook(pause)
    results = {}

    def run_a():
        with torch.no_grad():
            results["A"] = first(model(**x))

    def run_b():
        try:
            with torch.no_grad():
                results["B"] = model.forward(**x)  # skips the DiT's hook: the first streamed block checks
        except Exception as e:  # noqa: BLE001
            results["B"] = e
        b_done.set()

    a = threading.Thread(target=run_a, name="A")
    a.start()
    assert inside.wait(30)
    b = threading.Thread(target=run_b, name="B")
    b.start(), b.join(30), a.join(30)
    assert isinstance(results["B"], ConcurrentUseError), results["B"]
    with torch.no_grad():
        assert torch.equal(results["A"], first(ref(**x)))
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))


# ----------------------------------------------------------------------------- 3. writes to streamed tensors
class CountingBlock(nn.Module):
    """A block with state updated in forward (a counter buffer and a BatchNorm)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return x + self.bn(self.lin(x))


class BnDiT(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([CountingBlock() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_batchnorm_train_mode_write_is_an_error_not_lost():
    model = BnDiT().eval()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    with torch.no_grad():
        assert torch.equal(wrapped(x), ref(x))  # eval mode: no writes
        model.train()
        with pytest.raises(StreamedWriteError, match=r"'blocks\.0\.bn\.num_batches_tracked'.*eval\(\)"):
            wrapped(x)
        model.eval()
        out = wrapped(x)  # raised after the block was unbound: the step's rest counts as skipped
        assert torch.equal(out, ref(x))  # the lost running stats never leaked in


def test_counter_written_in_forward_is_an_error():
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    def count(m, a):  # runs inside the block's forward (after our hook bound its tensors)
        m.gate.add_(1.0)

    h = model.single_blocks[1].register_forward_pre_hook(count)
    with torch.no_grad(), pytest.raises(StreamedWriteError, match=r"single_blocks\.1\.gate"):
        wrapped(**x)
    h.remove()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(wrapped(**x), ref(**x))


@pytest.mark.parametrize("edit", ["mul_", "zero_", "copy_", "add_"])
def test_inplace_op_on_streamed_parameter_between_forwards_is_refused(edit):
    """An in-place op on a placeholder raises the named error at once and changes nothing."""
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    with torch.no_grad():
        wrapped(**x)
        p = model.single_blocks[2].up.weight
        args = {"mul_": (2.0,), "zero_": (), "copy_": (torch.zeros(5 * 32, 32),), "add_": (torch.ones(5 * 32, 32),)}
        with pytest.raises(StreamedWriteError, match=rf"{edit}\(\).*single_blocks\.2\.up\.weight.*update_weights"):
            getattr(p, edit)(*args[edit])
        assert torch.equal(wrapped(**x), ref(**x))  # the refused edit left the host weights as they were
    assert torch.equal(wrapped.state_dict()["single_blocks.2.up.weight"], ref.single_blocks[2].up.weight)


@pytest.mark.parametrize("edit", ["mul_", "zero_"])
def test_edit_that_bypasses_the_placeholder_is_an_error_at_the_next_forward(edit):
    """The version-counter backstop: an in-place op that skips __torch_function__ still moves
    the placeholder's counter, and the next bind refuses it."""
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    with torch.no_grad():
        wrapped(**x)
        p = model.single_blocks[2].up.weight
        with torch._C.DisableTorchFunctionSubclass():
            getattr(p, edit)() if edit == "zero_" else p.mul_(2.0)
        with pytest.raises(StreamedWriteError, match=r"single_blocks\.2\.up\.weight.*update_weights"):
            wrapped(**x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.equal(wrapped(**x), ref(**x))  # the refused edit left the host weights as they were
        assert torch.equal(wrapped.state_dict()["single_blocks.2.up.weight"], ref.single_blocks[2].up.weight)


@pytest.mark.parametrize("entry", ["wrapper", "in place"])
@pytest.mark.parametrize("error", ["op on a placeholder", "bypassed op", "write in forward"])
def test_a_state_dict_edit_after_a_streamed_write_error_is_used_by_the_next_forward(error, entry):
    """Issue 36: after a StreamedWriteError, an in-place edit of a state_dict() tensor shows in
    state_dict() and the very next forward uses it (and every one after), for a tensor of the
    blocks that raised and for one of another block."""
    from weightstream import apply_layerwise_offload

    model, ref, x = build("toy", DEV)
    cfg = OffloadConfig.layerwise(progress=False)
    if entry == "wrapper":
        run = OffloadedTransformer(model, cfg, device=DEV)
    else:
        apply_layerwise_offload(model, cfg, device=DEV)
        run = model
    sd = run.state_dict
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the re-priming warning after a cut-short step
        run(**x)
        p = model.single_blocks[2].up.weight
        with pytest.raises(StreamedWriteError):
            if error == "op on a placeholder":
                p.mul_(2.0)
            elif error == "bypassed op":
                with torch._C.DisableTorchFunctionSubclass():
                    p.mul_(2.0)
                run(**x)
            else:
                h = model.single_blocks[1].register_forward_pre_hook(lambda m, a: (m.gate.add_(1.0), None)[1])
                try:
                    run(**x)
                finally:
                    h.remove()
        for key in ("single_blocks.2.up.weight", "single_blocks.1.gate", "single_blocks.0.up.weight"):
            sd()[key].add_(0.125)
            ref.state_dict()[key].add_(0.125)
            assert torch.equal(sd()[key], ref.state_dict()[key])
        for _ in range(2):
            assert torch.equal(first(run(**x)), first(ref(**x)))


@pytest.mark.parametrize("how", ["assign", "iadd", "inplace-on-data", "safe-merge"])
def test_data_write_between_forwards_takes_effect(how):
    """``.data`` of an unbound streamed tensor is a device copy of its weights: assigning it,
    or editing the copy in place, changes the weights from the next forward on (peft merge)."""
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    delta = torch.full((5 * 32, 32), 0.25)
    with torch.no_grad():
        wrapped(**x)
        p = model.single_blocks[2].up.weight
        if how == "assign":
            p.data = ref.single_blocks[2].up.weight + delta
        elif how == "iadd":
            p.data += delta
        elif how == "inplace-on-data":
            p.data.add_(delta)  # the copy is dropped at once: its edit is still written
        else:  # peft's safe_merge: clone, add, assign
            w = p.data.clone()
            w += delta
            p.data = w
        ref.single_blocks[2].up.weight.add_(delta)
        assert torch.equal(first_out(wrapped, x), first_out(ref, x))
        assert torch.equal(wrapped.state_dict()["single_blocks.2.up.weight"], ref.single_blocks[2].up.weight)
        assert torch.equal(first_out(wrapped, x), first_out(ref, x))
    assert torch.equal(wrapped.disable().single_blocks[2].up.weight, ref.single_blocks[2].up.weight)


def first_out(m, x):
    return first(m(**x))


def test_storage_shared_across_blocks_is_rejected():
    m = ToyDiT()
    with torch.no_grad():  # distinct parameters, one storage (a view), across two blocks
        m.double_blocks[1].norm.weight = nn.Parameter(m.double_blocks[0].norm.weight.view(-1))
    with pytest.raises(SharedStorageError, match=r"double_blocks\.1\.norm\.weight.*double_blocks\.0\.norm\.weight"):
        OffloadedTransformer(m, None, device=DEV)
    assert all(p.numel() > 0 for p in m.parameters())  # rejected before anything moved


def test_storage_shared_with_a_non_block_tensor_is_rejected():
    m = ToyDiT()
    with torch.no_grad():
        m.head.bias = nn.Parameter(m.single_blocks[0].up.bias[:8])
    with pytest.raises(SharedStorageError, match=r"single_blocks\.0\.up\.bias.*head\.bias"):
        OffloadedTransformer(m, None, device=DEV)


# ----------------------------------------------------------------------------- 9. JSON duplicates
@pytest.mark.parametrize("text, key", [
    ('{"mode": "layer", "mode": "module", "components": ["dit"]}', "mode"),
    ('{"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"resident_layers": 1, '
     '"resident_layers": 3}}}', "resident_layers"),
    ('{"mode": "layer", "components": ["dit"], "layer_options": {"dit": {}, "dit": {"resident_layers": 2}}}', "dit"),
])
def test_from_json_rejects_duplicate_keys(text, key):
    with pytest.raises(DuplicateKeyError, match=f"key '{key}' twice"):
        OffloadConfig.from_json(text)
    with pytest.raises(ValueError, match=f"'{key}'"):  # also through every entry point taking JSON
        OffloadedTransformer(ToyDiT(), text, device=DEV)


def test_from_json_without_duplicates_still_parses():
    cfg = OffloadConfig.from_json('{"mode": "layer", "components": ["dit"], '
                                  '"layer_options": {"dit": {"resident_layers": 2}}}')
    assert cfg.resident_layers == 2


# ----------------------------------------------------------------------------- 4. casts, copies, re-wrapping
@pytest.mark.parametrize("op", ["half", "float", "bfloat16", "double", "to_dtype", "to_other_device", "cpu"])
def test_cast_or_move_of_the_wrapper_is_refused(op):
    model, ref, x = build("flux", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    call = {"to_dtype": lambda: wrapped.to(torch.float16), "to_other_device": lambda: wrapped.to("meta")}.get(
        op, lambda: getattr(wrapped, op)())
    with pytest.raises(UnsupportedOperationError, match="host store"):
        call()
    with torch.no_grad():  # nothing was cast: the model still computes exactly
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))
    assert wrapped.to(DEV) is wrapped and wrapped.to(torch.float32) is wrapped  # no-ops stay allowed


@pytest.mark.parametrize("op", ["deepcopy", "copy", "pickle", "torch.save"])
def test_copy_pickle_and_save_of_the_wrapper_are_refused(op, tmp_path):
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    fn = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps,
          "torch.save": lambda m: torch.save(m, tmp_path / "m.pt")}[op]
    with pytest.raises(UnsupportedOperationError, match="state_dict"):
        fn(wrapped)
    with torch.no_grad():
        assert torch.equal(wrapped(**x), ref(**x))


def test_wrapping_a_wrapped_or_streamed_model_is_refused():
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    with pytest.raises(AlreadyOffloadedError, match="already an OffloadedTransformer"):
        OffloadedTransformer(wrapped, None, device=DEV)
    with pytest.raises(AlreadyOffloadedError, match="already streamed or offloaded by weightstream"):
        OffloadedTransformer(model, None, device=DEV)  # the inner module: its blocks carry our hooks
    holder = nn.Sequential(wrapped)
    with pytest.raises(AlreadyOffloadedError, match="already an OffloadedTransformer"):
        OffloadedTransformer(holder, OffloadConfig.layerwise(), device=DEV, plan=OffloadPlan(["0.module.single_blocks"]))
    with torch.no_grad():
        assert torch.equal(wrapped(**x), ref(**x))
    plain = wrapped.disable()
    again = OffloadedTransformer(plain, None, device=DEV)  # after disable() it wraps again
    with torch.no_grad():
        assert torch.equal(again(**x), ref(**x))


def test_accelerate_and_diffusers_hooks_and_meta_tensors_are_refused_before_anything_moves():
    from diffusers.hooks import HookRegistry, ModelHook

    class AlignDevicesHook:  # accelerate is not installed here: its hooks live in `_hf_hook`
        pass

    m = ToyDiT()
    m.single_blocks[0]._hf_hook = AlignDevicesHook()
    with pytest.raises(AlreadyOffloadedError, match=r"single_blocks\.0 carries accelerate.*remove_hook_from_module"):
        OffloadedTransformer(m, None, device=DEV)
    del m.single_blocks[0]._hf_hook
    HookRegistry.check_if_exists_or_initialize(m.double_blocks[1]).register_hook(ModelHook(), "probe")
    with pytest.raises(AlreadyOffloadedError, match=r"double_blocks\.1 carries diffusers hooks"):
        OffloadedTransformer(m, None, device=DEV)
    assert all(p.numel() > 0 for p in m.parameters())
    with torch.device("meta"):
        meta = ToyDiT()
    with pytest.raises(AlreadyOffloadedError, match="meta device"):
        OffloadedTransformer(meta, None, device=DEV)


# ----------------------------------------------------------------------------- 5. a block's submodule used outside
def tiny_dit():
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=3,
                                 norm_num_groups=4, sample_size=4, patch_size=2, num_embeds_ada_norm=10).eval()


def dit_inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 4, 4, 4, generator=g), timestep=torch.tensor([3]),
                class_labels=torch.tensor([2]), return_dict=False)


def test_block_submodule_called_outside_its_block_names_the_block():
    """DiT calls transformer_blocks[0].norm1.emb after its loop: discovery keeps that block resident
    (tests/test_discovery_diffusers.py); a plan that streams it anyway gets the named error."""
    model, x = tiny_dit(), dit_inputs()
    ref = copy.deepcopy(model)
    wrapped = OffloadedTransformer(model, None, device=DEV, plan=OffloadPlan(["transformer_blocks"]))
    with torch.no_grad(), pytest.raises(StreamedModuleAccessError,
                                        match=r"transformer_blocks\.0\.norm1\.emb.*'transformer_blocks\.0'.*resident_layers"):
        wrapped(**x)
    # the advice works: keep block 0 resident; and so does the default (discovery keeps it resident)
    model2 = tiny_dit()
    w2 = OffloadedTransformer(model2, OffloadConfig.layerwise(resident_layers=1), device=DEV,
                              plan=OffloadPlan(["transformer_blocks"]))
    with pytest.warns(UserWarning, match=r"transformer_blocks\.0 stay resident"):
        w3 = OffloadedTransformer(tiny_dit(), None, device=DEV)
    with torch.no_grad():
        assert torch.equal(first(w2(**x)), first(ref(**x)))
        assert torch.equal(first(w3(**x)), first(ref(**x)))


def test_ordinary_errors_inside_a_block_are_not_renamed():
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    with torch.no_grad(), pytest.raises(RuntimeError) as info:
        wrapped(x=torch.randn(2, 5, 9))  # wrong input width: fails in the resident embed
    assert not isinstance(info.value, OffloadMisuseError)


# ----------------------------------------------------------------------------- 6. backward
@pytest.mark.parametrize("name", ["toy", "flux"])
def test_backward_through_streamed_blocks_is_a_named_error(name):
    model, ref, x = build(name, DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    out = first(wrapped(**x))  # grad enabled, parameters require grad: the forward itself is exact
    with torch.no_grad():
        assert torch.equal(out, first(ref(**x)))
    with pytest.raises(InferenceOnlyError, match=r"inference only.*torch\.no_grad\(\).*inference_mode"):
        out.sum().backward()
    with torch.inference_mode():
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))


def test_backward_into_resident_parts_only_is_allowed():
    """Gradients that never reach a streamed block (frozen blocks, inputs without
    grad, a trainable head) are computed as the resident model computes them."""
    model, ref, x = build("toy", DEV)
    for m in (model, ref):
        m.requires_grad_(False)
        m.head.requires_grad_(True)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    wrapped(**x).sum().backward()
    ref(**x).sum().backward()
    assert torch.equal(model.head.weight.grad, ref.head.weight.grad)


# ----------------------------------------------------------------------------- 7. recovery with resident layers
@pytest.mark.parametrize("name, cfg, direct", [s for s in SCHEDULES if s[1].get("resident_layers")] + [
    ("flux", {"resident_layers": 3}, False), ("flux", {"resident_layers": 3, "num_slots": 3}, False),
    ("toy", {"resident_layers": 4, "num_slots": 2}, False), ("toy", {"resident_layers": 1, "num_slots": 3}, False)])
def test_recovers_after_an_exception_with_resident_layers(name, cfg, direct):
    r = Runner(name, cfg, direct)
    blocks = [b.module for b in r.sb.blocks]
    for at in range(len(blocks)):  # in a resident block, the first streamed one, later ones
        for where in ("pre", "post"):
            def boom(*a):
                raise KeyError("boom")
            h = (blocks[at].register_forward_pre_hook if where == "pre" else blocks[at].register_forward_hook)(boom)
            with pytest.raises(KeyError):
                r.out()
            h.remove()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "re-priming" when the step stopped part-way
                assert torch.equal(r.out(), r.expected()), (at, where)
            assert torch.equal(r.out(), r.expected()), (at, where)


# ----------------------------------------------------------------------------- 8. entering through .forward()
@pytest.mark.parametrize("name, cfg", [("toy", {}), ("flux", {"num_slots": 3}), ("wan", {}),
                                       ("toy", {"resident_layers": 2}), ("flux", {"resident_layers": 1, "num_slots": 3})])
def test_direct_forward_call_runs_the_step_start(name, cfg):
    """model.forward(...) skips the DiT's forward-pre-hook; under the graph
    schedules (defer_last, step_local) the first streamed block issues the
    step-start loads itself. Mixed with __call__ steps, every output is exact."""
    model, ref, x = build(name, DEV)
    sb = streamed_blocks(model, OffloadConfig.layerwise(cuda_graphs="on", **cfg), torch.device(DEV), None)
    assert sb.schedule.has_step_start
    with torch.no_grad():
        expected = first(ref(**x))
        for how in ("forward", "forward", "call", "forward", "call", "call", "forward"):
            out = first(model.forward(**x) if how == "forward" else model(**x))
            assert torch.equal(out, expected), how


def test_load_state_dict_non_strict_reports_missing_and_unexpected_keys():
    """strict=False loads what matches and reports the rest, as nn.Module does (it used to say
    "All keys matched" whatever was missing, and refuse unexpected keys)."""
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    sd["single_blocks.2.up.weight"].mul_(0.5)
    missing = "single_blocks.0.up.bias"
    del sd[missing]
    sd["not.a.key"] = torch.zeros(1)
    result = wrapped.load_state_dict(sd, strict=False)
    assert result.missing_keys == [missing] and result.unexpected_keys == ["not.a.key"]
    with torch.no_grad():
        ref.single_blocks[2].up.weight.mul_(0.5)
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))
    with pytest.raises(WeightUpdateError, match="not.a.key"):
        wrapped.load_state_dict(sd, strict=True)


def test_update_with_a_meta_tensor_is_refused():
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    with pytest.raises(WeightUpdateError, match=r"single_blocks\.2\.up\.weight.*meta"):
        wrapped.update_weights({"single_blocks.2.up.weight": torch.empty(5 * 32, 32, device="meta")})
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))


def test_wrapping_after_a_pipeline_ran_the_model_is_allowed():
    """A pipeline's call leaves an empty diffusers hook registry on the transformer
    (cache_context): that is not an offload hook, so wrapping still works, bit-exact."""
    model, ref, x = build("flux", DEV)
    with model.cache_context("cond"):
        pass
    assert model._diffusers_hook is not None and not model._diffusers_hook.hooks
    wrapped = OffloadedTransformer(model, None, device=DEV)
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))


class _FailingLoad:
    """A source's load that raises at its ``at``-th call (a transient read error), once."""

    def __init__(self, source, at: int):
        self.calls, self.at, self._load = 0, at, source.load
        source.load = self  # the instance only: this test's own source object

    def __call__(self, k, slot, **kw):
        self.calls += 1
        if self.calls == self.at:
            raise OSError("injected: a transient read error")
        return self._load(k, slot, **kw)


@pytest.mark.parametrize("at", range(1, 13))
@pytest.mark.parametrize("slots", [2, 3])
def test_a_failed_load_anywhere_then_every_step_is_bit_exact(at, slots):
    """A load that raises fails its forward (the error itself); every later step is the resident
    model's output. Before: a failed load that a step's end carries into the next step (the position
    already at the boundary) left its slot holding another block, and the next step computed with
    it silently."""
    model = ToyDiT()
    ref, x = copy.deepcopy(model), toy_inputs()
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False, resident_layers=0,
                                                                  weight_codec="none", num_slots=slots), device="cpu")
    failing = _FailingLoad(wrapped.executor.source, at)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the re-priming warning after the failed load
        want = ref(**x)
        failed = 0
        for _ in range(4):
            try:
                out = wrapped(**x)
            except OSError as e:
                assert "injected" in str(e)
                failed += 1
                continue
            assert torch.equal(out, want), (at, slots, failing.calls)
    assert failed == (1 if failing.calls >= at else 0)
