"""CUDA graphs on the device: each case runs in its own process (pytest -m gpu)."""

import pytest

from isolated import run_in_process

pytestmark = pytest.mark.gpu


def run_isolated(name: str):
    return run_in_process("test_graphs_gpu", f"{name}()", what=name)


# -- bodies (run in a fresh process each) -------------------------------------------------

def _setup(name="flux", dtype="bfloat16", **cfg):
    import torch

    from layerwise_cases import build, first, stream_config
    from weightstream import OffloadedTransformer

    model, ref, x = build(name, "cuda", getattr(torch, dtype))
    w = OffloadedTransformer(model, stream_config(cuda_graphs="on", **cfg), device="cuda")
    return torch, first, w, ref, x


def case_graph_equals_eager_flux(**cfg):
    torch, first, w, ref, x = _setup("flux", **cfg)
    # no resident layers: 'auto' (the default) and 'next-step' defer the boundary load
    assert w._streamed.schedule.defer_last == (cfg.get("graph_boundary_loads", "auto") != "in-graph")
    with torch.no_grad():
        expected = first(ref(**x))
        outs = [first(w(**x)) for _ in range(5)]  # warm-up, capture, replays (odd n: two phases)
    assert all(torch.equal(o, expected) for o in outs), [float((o.float() - expected.float()).abs().max()) for o in outs]
    c = w.graphs.counts
    assert c["eager-warmup"] == 1 and c["capture"] == 2 and c["replay"] == 2, c
    assert outs[-1].data_ptr() != outs[-2].data_ptr()  # fresh tensors, not the static output


def case_graph_equals_eager_flux_next_step():
    # the boundary load starts the next step's graph instead of ending this one
    case_graph_equals_eager_flux(graph_boundary_loads="next-step")


def case_graph_equals_eager_flux_in_graph():
    # the boundary load ends the step's graph (the plain ring inside each graph)
    case_graph_equals_eager_flux(graph_boundary_loads="in-graph")


def case_graph_equals_eager_even_block_count():
    # resident blocks: the step-local schedule (one phase; the step's first loads behind them)
    torch, first, w, ref, x = _setup("flux", resident_layers=1)
    with torch.no_grad():
        expected = first(ref(**x))
        outs = [first(w(**x)) for _ in range(4)]
    assert all(torch.equal(o, expected) for o in outs)
    c = w.graphs.counts
    assert c["capture"] == 1 and c["replay"] == 2, c


def case_step_local_odd_streamed_count_one_graph():
    torch, first, w, ref, x = _setup("flux", resident_layers=2)  # 3 streamed blocks, still one phase
    assert w._streamed.schedule.step_local
    with torch.no_grad():
        expected = first(ref(**x))
        outs = [first(w(**x)) for _ in range(5)]
    assert all(torch.equal(o, expected) for o in outs)
    c = w.graphs.counts
    assert c["capture"] == 1 and c["replay"] == 3 and len(w.graphs.graphs) == 1, c


def case_graph_equals_eager_wan():
    torch, first, w, ref, x = _setup("wan", "float32")
    with torch.no_grad():
        expected = first(ref(**x))
        outs = [first(w(**x)) for _ in range(4)]
    assert all(torch.equal(o, expected) for o in outs)
    assert w.graphs.counts["replay"] >= 1


def case_update_weights_without_recapture():
    torch, first, w, ref, x = _setup("flux")
    with torch.no_grad():
        for _ in range(4):
            w(**x)
        captures = w.graphs.counts["capture"]
        new = {k: v * 0.5 if v.is_floating_point() else v for k, v in ref.state_dict().items()}
        ref.load_state_dict(new)
        w.update_weights(new)
        expected = first(ref(**x))
        outs = [first(w(**x)) for _ in range(2)]
    assert w.graphs.counts["capture"] == captures, "update_weights must not recapture"
    assert all(torch.equal(o, expected) for o in outs)


def case_fallback_on_host_sync():
    import warnings

    import torch

    from weightstream import OffloadedTransformer
    from layerwise_cases import stream_config
    from weightstream.models import ToyDiT, toy_inputs

    class Syncing(ToyDiT):
        def forward(self, x):
            h = super().forward(x)
            if h.sum().item() > 1e30:  # a host sync: cannot be captured
                h = h * 2
            return h

    model = Syncing().cuda()
    ref = Syncing().cuda()
    x = toy_inputs(device="cuda")
    w = OffloadedTransformer(model, stream_config(cuda_graphs="on"), device="cuda")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [w(**x) for _ in range(4)]
        expected = ref(**x)
    msgs = [str(c.message) for c in caught if "cuda_graphs" in str(c.message)]
    assert len(msgs) == 1 and "capture failed" in msgs[0], msgs
    assert all(torch.equal(o, expected) for o in outs)
    assert w.graphs.counts["eager-fallback"] >= 2


def case_several_signatures_alive():
    torch, first, w, ref, x = _setup("toy", "float32")
    from weightstream.models import toy_inputs

    x2 = toy_inputs(batch=3, tokens=7, device="cuda", seed=5)
    with torch.no_grad():
        e1, e2 = ref(**x), ref(**x2)
        outs = []
        for _ in range(4):
            outs.append((w(**x), w(**x2)))
    assert all(torch.equal(a, e1) and torch.equal(b, e2) for a, b in outs)
    assert len({k[0] for k in w.graphs.graphs}) == 2, list(w.graphs.graphs)


def case_disable_releases_graph_memory():
    import gc

    torch, first, w, ref, x = _setup("flux")
    with torch.no_grad():
        for _ in range(4):
            w(**x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    plain = w.disable()
    del w
    gc.collect()
    torch.cuda.empty_cache()
    after_reserved = torch.cuda.memory_reserved()
    assert after_reserved < before, (before, after_reserved)
    with torch.no_grad():
        assert torch.equal(first(plain(**x)), first(ref(**x)))


def case_debug_addresses():
    torch, first, w, ref, x = _setup("toy", "float32", debug_graph_addresses=True)
    from weightstream.graphs.runner import StaticAddressError

    with torch.no_grad():
        for _ in range(3):
            w(**x)
        g = next(iter(w.graphs.graphs.values()))
        g.static_in[0] = g.static_in[0].clone()  # simulate a moved static buffer
        try:
            w(**x)
        except StaticAddressError:
            return
    raise AssertionError("moved static input not detected")


def _flagged_toy():
    import torch

    from weightstream.models import ToyDiT

    class Flagged(ToyDiT):
        """ToyDiT whose forward may stop after ``stop_after`` blocks or run them ``passes`` times."""

        stop_after = None
        passes = 1

        def forward(self, x):
            h = self.embed(x)
            blocks = list(self.double_blocks) + list(self.single_blocks)
            for _ in range(self.passes):
                for i, b in enumerate(blocks):
                    if self.stop_after is not None and i >= self.stop_after:
                        break
                    h = b(h)
            return self.head(h)

    return torch, Flagged


def _capture_not_one_step(flag: str, value: int, **cfg):
    import warnings

    from weightstream import OffloadedTransformer
    from layerwise_cases import stream_config
    from weightstream.models import toy_inputs

    torch, Flagged = _flagged_toy()
    model, ref = Flagged().cuda(), Flagged().cuda()
    x = toy_inputs(device="cuda")
    w = OffloadedTransformer(model, stream_config(cuda_graphs="on", **cfg), device="cuda")
    n = w.executor.schedule.n
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = ref(**x)
        assert torch.equal(w(**x), full)  # warm-up, eager
        setattr(model, flag, value)  # the capture call leaves early / runs the blocks again
        setattr(ref, flag, value)
        odd = ref(**x)
        got = w(**x)
        setattr(model, flag, Flagged.__dict__[flag])
        after = [w(**x) for _ in range(3)]
    assert not torch.equal(odd, full)
    assert torch.equal(got, odd), float((got - odd).abs().max())
    assert all(torch.equal(o, full) for o in after), [float((o - full).abs().max()) for o in after]
    msgs = [str(c.message) for c in caught if "cuda_graphs" in str(c.message)]
    ran = value if flag == "stop_after" else value * n
    assert len(msgs) == 1 and f"ran {ran} of the {n} streamed blocks" in msgs[0], msgs
    c = w.graphs.counts
    assert c["capture"] == 0 and not w.graphs.graphs and c["replay"] == 0, c
    assert c["eager-fallback"] == 4, c


def case_early_exit_capture_falls_back():
    _capture_not_one_step("stop_after", 4)


def case_early_exit_capture_falls_back_in_graph():
    _capture_not_one_step("stop_after", 3, graph_boundary_loads="in-graph")


def case_repeated_pass_capture_falls_back():
    # 'in-graph': the plain ring (the eager 'next-step' ring issues a step's deferred
    # load at the forward's start, so it cannot run the block list twice per forward)
    _capture_not_one_step("passes", 2, graph_boundary_loads="in-graph")


def case_unregistered_output_container_runs_eager():
    import warnings

    import torch

    from weightstream import OffloadedTransformer
    from layerwise_cases import stream_config
    from weightstream.models import ToyDiT, toy_inputs

    class Out:  # not registered with torch's pytree
        def __init__(self, sample):
            self.sample = sample

    class Wrapped(ToyDiT):
        def forward(self, x):
            return Out(super().forward(x))

    model, ref = Wrapped().cuda(), Wrapped().cuda()
    x = toy_inputs(device="cuda")
    w = OffloadedTransformer(model, stream_config(cuda_graphs="on"), device="cuda")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [w(**x).sample for _ in range(4)]
        expected = ref(**x).sample
    assert all(torch.equal(o, expected) for o in outs)
    assert len({o.data_ptr() for o in outs}) == 4  # never one static buffer handed out twice
    msgs = [str(c.message) for c in caught if "cuda_graphs" in str(c.message)]
    assert len(msgs) == 1 and "pytree" in msgs[0] and "Out" in msgs[0], msgs
    assert w.graphs.counts["capture"] == 0 and not w.graphs.graphs


def case_modes_get_their_own_graphs():
    import contextlib

    torch, first, w, ref, x = _setup("toy", "float32")

    def autocast():
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False))
        return stack

    def calls(mode, k):
        outs = []
        for _ in range(k):  # one context per call, as a pipeline step would
            with mode():
                outs.append(w(**x))
        with mode():
            return outs, ref(**x)

    modes = {"no_grad": torch.no_grad, "inference": torch.inference_mode, "autocast": autocast}
    for name, mode in modes.items():
        outs, expected = calls(mode, 5)  # warm-up, two captures (odd n: two phases), replays
        assert all(torch.equal(o, expected) for o in outs), (name, [float((o.float() - expected.float()).abs().max()) for o in outs])
    assert calls(autocast, 1)[1].dtype == torch.bfloat16  # autocast changed the kernels: the keys must differ
    sigs = {k[0] for k in w.graphs.graphs}
    assert len(sigs) == 3 and len(w.graphs.graphs) == 6, list(w.graphs.graphs)
    captures = w.graphs.counts["capture"]
    for name, mode in modes.items():  # back to each mode: its own graphs replay, nothing is recaptured
        outs, expected = calls(mode, 2)
        assert all(torch.equal(o, expected) for o in outs), name
    assert w.graphs.counts["capture"] == captures
    outs, expected = calls(torch.enable_grad, 4)  # grad mode: never a no_grad graph's output
    assert all(o.requires_grad for o in outs)
    assert all(torch.equal(o.detach(), expected.detach()) for o in outs)


def case_autocast_with_its_cache_runs_eager():
    import warnings

    torch, first, w, ref, x = _setup("toy", "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # one autocast region over several steps, as a pipeline's loop would: warm-up
        # casts are cached and a capture would read them as constants
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            expected = ref(**x)
            outs = [w(**x) for _ in range(5)]
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            outs += [w(**x) for _ in range(2)]  # a new region: nothing freed is read
            expected2 = ref(**x)
    assert torch.equal(expected, expected2) and expected.dtype == torch.bfloat16
    assert all(torch.equal(o, expected) for o in outs), [float((o.float() - expected.float()).abs().max()) for o in outs]
    msgs = [str(c.message) for c in caught if "cuda_graphs" in str(c.message)]
    assert len(msgs) == 1 and "cache_enabled=False" in msgs[0], msgs
    assert w.graphs.counts["capture"] == 0 and not w.graphs.graphs


# -- pytest entry points ---------------------------------------------------------------------

def case_a_failed_load_then_replays_are_exact():
    """A load that raises (a transient read error) at each of the first loads: its call fails, every
    later call (eager, capture or replay) equals the resident model. A replay runs no hook that
    re-primes: the runner resets the ring first (executor.load_failed)."""
    import torch

    from layerwise_cases import build, first, stream_config
    from weightstream import OffloadedTransformer

    for at in range(1, 12):
        model, ref, x = build("flux", "cuda", torch.bfloat16)
        w = OffloadedTransformer(model, stream_config(cuda_graphs="on"), device="cuda")
        src, calls = w.executor.source, []
        load = src.load

        def failing(k, slot, _load=load, _calls=calls, _at=at, **kw):
            _calls.append(1)
            if len(_calls) == _at:
                raise OSError("injected: a transient read error")
            return _load(k, slot, **kw)

        src.load = failing
        with torch.no_grad(), __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore")
            expected, errors = first(ref(**x)), 0
            for _ in range(6):
                try:
                    out = first(w(**x))
                except OSError:
                    errors += 1
                    continue
                assert torch.equal(out, expected), (at, w.graphs.counts)
        assert errors <= 1, at
        w.disable()


@pytest.mark.parametrize(
    "case",
    [
        "case_graph_equals_eager_flux",
        "case_graph_equals_eager_flux_next_step",
        "case_graph_equals_eager_flux_in_graph",
        "case_graph_equals_eager_wan",
        "case_graph_equals_eager_even_block_count",
        "case_step_local_odd_streamed_count_one_graph",
        "case_update_weights_without_recapture",
        "case_fallback_on_host_sync",
        "case_several_signatures_alive",
        "case_disable_releases_graph_memory",
        "case_debug_addresses",
        "case_early_exit_capture_falls_back",
        "case_early_exit_capture_falls_back_in_graph",
        "case_repeated_pass_capture_falls_back",
        "case_unregistered_output_container_runs_eager",
        "case_modes_get_their_own_graphs",
        "case_autocast_with_its_cache_runs_eager",
        "case_a_failed_load_then_replays_are_exact",
    ],
)
def test_graphs(case):
    run_isolated(case)
