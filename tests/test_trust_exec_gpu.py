"""Executor-level misuse on the device: updates, in-place host edits, direct
forward calls and threads under CUDA streams and graphs (pytest -m gpu).
Each case runs in its own process (graph captures)."""

import pytest

from isolated import run_in_process

pytestmark = pytest.mark.gpu

# graphs: next-step (defer_last), in-graph, step-local (resident layers), odd/even counts, 3 slots
GRAPH_CFGS = {
    "next-step": {},
    "next-step-3slots": {"num_slots": 3},
    "in-graph": {"graph_boundary_loads": "in-graph"},
    "step-local": {"resident_layers": 1},
    "step-local-odd-3slots": {"resident_layers": 2, "num_slots": 3},
}
EAGER_CFGS = {"plain": {}, "resident": {"resident_layers": 1}, "3slots": {"num_slots": 3}}


def run_isolated(call: str):
    return run_in_process("test_trust_exec_gpu", call)


def _setup(cfg: dict, graphs: bool, name="flux"):
    import torch

    from layerwise_cases import build, stream_config
    from weightstream import OffloadedTransformer

    model, ref, x = build(name, "cuda", torch.bfloat16)
    config = stream_config(cuda_graphs="on" if graphs else "off", **cfg)
    return model, ref, x, OffloadedTransformer(model, config, device="cuda")


def _streamed_keys(w):
    sd = w.module.state_dict(keep_vars=True)
    return [k for k, t in sd.items() if id(t) in w._streamed.host_views and t.is_floating_point()]


# -- bodies ------------------------------------------------------------------------------------
def case_update_next_forward(cfg_name: str, graphs: bool):
    import torch

    from layerwise_cases import first
    from weightstream import WeightUpdateError

    cfg = (GRAPH_CFGS if graphs else EAGER_CFGS)[cfg_name]
    model, ref, x, w = _setup(cfg, graphs)
    keys = _streamed_keys(w)
    with torch.no_grad():
        for round_ in range(4):  # warm-up, capture, replays in both phases
            w(**x)
            bad = {keys[0]: ref.state_dict()[keys[0]] * 0.5, keys[1]: torch.zeros(1, device="cuda")}
            try:
                w.update_weights(bad)
                raise AssertionError("a bad update was accepted")
            except WeightUpdateError:
                pass
            assert torch.equal(first(w(**x)), first(ref(**x))), f"round {round_}: half-applied update"
            new = {k: (ref.state_dict()[k] * 0.875).to(torch.bfloat16) for k in keys}
            ref.load_state_dict(new, strict=False)
            w.update_weights(new)
            assert torch.equal(first(w(**x)), first(ref(**x))), f"round {round_}: next forward used old weights"
    if graphs:
        c = w.graphs.counts
        assert c["capture"] >= 1 and c["replay"] >= 3, c


def case_inplace_host_edit(cfg_name: str, graphs: bool):
    import torch

    from layerwise_cases import first

    cfg = (GRAPH_CFGS if graphs else EAGER_CFGS)[cfg_name]
    model, ref, x, w = _setup(cfg, graphs)
    keys = _streamed_keys(w)
    with torch.no_grad():
        for round_ in range(5):
            w(**x)
            # the previous step's copies read the pinned pages asynchronously: an edit made while
            # they run may reach that step (documented); the next step must see it whole
            torch.cuda.synchronize()
            sd = w.state_dict()
            for k in keys:
                sd[k].mul_(0.75)
                ref.state_dict()[k].mul_(0.75)
            assert torch.equal(first(w(**x)), first(ref(**x))), f"round {round_}: in-place host edit not seen"
    if graphs:
        assert w.graphs.counts["replay"] >= 3, w.graphs.counts


def case_direct_forward_step_schedules(cfg_name: str):
    """StreamedBlocks with a graph schedule, run eagerly on CUDA streams, entered
    through model.forward (no DiT hook) and __call__ alternately."""
    import torch

    from layerwise_cases import build, first, stream_config
    from weightstream.offload.build import streamed_blocks

    model, ref, x = build("flux", "cuda", torch.bfloat16)
    cfg = stream_config(cuda_graphs="on", **GRAPH_CFGS[cfg_name])
    sb = streamed_blocks(model, cfg, torch.device("cuda"), None)
    assert sb.schedule.has_step_start
    with torch.no_grad():
        expected = first(ref(**x))
        for how in ("forward", "forward", "call", "forward", "call"):
            out = first(model.forward(**x) if how == "forward" else model(**x))
            assert torch.equal(out, expected), how


def case_backward_is_named():

    from layerwise_cases import first
    from weightstream import InferenceOnlyError

    model, ref, x, w = _setup({}, False)
    out = first(w(**x))
    try:
        out.float().sum().backward()
    except InferenceOnlyError:
        return
    raise AssertionError("backward through streamed blocks did not raise InferenceOnlyError")


def case_second_thread_refused():
    import threading

    import torch

    from layerwise_cases import first
    from weightstream import ConcurrentUseError

    model, ref, x, w = _setup({}, False)
    inside, b_done, res = threading.Event(), threading.Event(), {}

    def pause(m, a):
        if threading.current_thread().name == "A":
            inside.set()
            b_done.wait(30)

    model.single_transformer_blocks[1].register_forward_pre_hook(pause)

    def run(name):
        try:
            with torch.no_grad():
                res[name] = first(w(**x))
        except Exception as e:  # noqa: BLE001
            res[name] = e
        if name == "B":
            b_done.set()

    a = threading.Thread(target=run, args=("A",), name="A")
    a.start()
    assert inside.wait(30)
    b = threading.Thread(target=run, args=("B",), name="B")
    b.start(), b.join(30), a.join(30)
    assert isinstance(res["B"], ConcurrentUseError), res["B"]
    with torch.no_grad():
        assert torch.equal(res["A"], first(ref(**x)))


def case_recover_after_exception(cfg_name: str):
    """Graphs on, then an eager step (a new input signature) raises part-way; the
    next calls (eager, capture, replay) are exact, with and without resident layers."""
    import warnings

    import torch

    from layerwise_cases import first
    from weightstream.models import flux_inputs

    model, ref, x, w = _setup(GRAPH_CFGS[cfg_name], True)
    blocks = [b.module for b in w._streamed.blocks]
    with torch.no_grad():
        for _ in range(3):
            w(**x)
        for i, at in enumerate((0, len(blocks) // 2, len(blocks) - 1)):
            # a signature not seen yet runs eager (warm-up), so the hook can raise part-way
            x2 = flux_inputs(model, batch=2 + i, device="cuda")

            def boom(*a):
                raise KeyError("boom")
            h = blocks[at].register_forward_pre_hook(boom)
            try:
                w(**x2)
                raise AssertionError("the hook did not raise")
            except KeyError:
                pass
            h.remove()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for inp in (x, x2, x2, x2, x):
                    assert torch.equal(first(w(**inp)), first(ref(**inp))), (cfg_name, at)


# -- pytest entry points -------------------------------------------------------------------------
@pytest.mark.parametrize("cfg_name", list(GRAPH_CFGS))
def test_update_next_forward_graphs(cfg_name):
    run_isolated(f"case_update_next_forward({cfg_name!r}, True)")


@pytest.mark.parametrize("cfg_name", list(EAGER_CFGS))
def test_update_next_forward_eager(cfg_name):
    run_isolated(f"case_update_next_forward({cfg_name!r}, False)")


@pytest.mark.parametrize("cfg_name", list(GRAPH_CFGS))
def test_inplace_host_edit_graphs(cfg_name):
    run_isolated(f"case_inplace_host_edit({cfg_name!r}, True)")


@pytest.mark.parametrize("cfg_name", list(EAGER_CFGS))
def test_inplace_host_edit_eager(cfg_name):
    run_isolated(f"case_inplace_host_edit({cfg_name!r}, False)")


@pytest.mark.parametrize("cfg_name", ["next-step", "next-step-3slots", "step-local", "step-local-odd-3slots"])
def test_direct_forward_step_schedules(cfg_name):
    run_isolated(f"case_direct_forward_step_schedules({cfg_name!r})")


def test_backward_is_named():
    run_isolated("case_backward_is_named()")


def test_second_thread_refused():
    run_isolated("case_second_thread_refused()")


@pytest.mark.parametrize("cfg_name", list(GRAPH_CFGS))
def test_recover_after_exception_graphs(cfg_name):
    run_isolated(f"case_recover_after_exception({cfg_name!r})")
