"""One thread at a time (offload/ownership.py): every mutating call from a second thread
while a forward runs is refused, and a hold left by a BaseException is never a wedge.

CPU, against the resident model (tests/layerwise_cases.py)."""
import threading
import warnings

import pytest
import torch

from weightstream import ConcurrentUseError, OffloadConfig, OffloadedTransformer, apply_layerwise_offload

from layerwise_cases import build, first

DEV = "cpu"
KEY = "single_blocks.2.up.weight"


class Paused:
    """Thread A runs a forward that pauses inside a streamed block until released."""

    def __init__(self, model, call):
        self.inside, self.go = threading.Event(), threading.Event()
        self.out = None
        self._h = model.single_blocks[1].register_forward_pre_hook(self._pause)
        self.thread = threading.Thread(target=self._run, args=(call,), name="A")

    def _pause(self, m, a):
        if threading.current_thread().name == "A":
            self.inside.set()
            self.go.wait(30)

    def _run(self, call):
        with torch.no_grad():
            self.out = call()

    def __enter__(self):
        self.thread.start()
        assert self.inside.wait(30)
        return self

    def __exit__(self, *exc):
        self.go.set()
        self.thread.join(30)
        self._h.remove()


def _ops(wrapped, model, new):
    return {
        "update_weights": lambda: wrapped.update_weights({KEY: new}),
        "load_state_dict": lambda: wrapped.load_state_dict({KEY: new}, strict=False),
        "data-assign": lambda: setattr(model.single_blocks[2].up.weight, "data", new),
        "disable": lambda: wrapped.disable(),
    }


@pytest.mark.parametrize("codec", ["none", "exp-k"])
@pytest.mark.parametrize("op", ["update_weights", "load_state_dict", "data-assign", "disable"])
def test_mutating_call_from_a_second_thread_is_refused(op, codec):
    """While thread A is inside a forward, every call that changes the host store or tears
    the model down is refused on thread B with ConcurrentUseError and changes nothing: A's
    output is exact, and once A is done B's call takes effect exactly."""
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(weight_codec=codec), device=DEV)
    new = ref.single_blocks[2].up.weight.detach() * 0.5
    with torch.no_grad():
        expected = first(ref(**x))
    with Paused(model, lambda: first(wrapped(**x))) as a:
        with pytest.raises(ConcurrentUseError, match="concurrently"):
            _ops(wrapped, model, new)[op]()
    assert torch.equal(a.out, expected)
    _ops(wrapped, model, new)[op]()  # now it runs
    with torch.no_grad():
        ref.single_blocks[2].up.weight.copy_(new)
        out = first(wrapped(**x)) if op != "disable" else first(model(**x))
        if op == "disable":
            assert torch.equal(out, expected)  # disable() kept the weights as they were
        else:
            assert torch.equal(out, first(ref(**x)))


def test_handle_remove_from_a_second_thread_is_refused():
    model, ref, x = build("toy", DEV)
    handle = apply_layerwise_offload(model, None, device=DEV)
    with torch.no_grad():
        expected = first(ref(**x))
    with Paused(model, lambda: first(model(**x))) as a:
        with pytest.raises(ConcurrentUseError):
            handle.remove()
    assert torch.equal(a.out, expected) and not handle.removed
    with torch.no_grad():
        assert torch.equal(first(model(**x)), expected)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(first(model(**x)), expected)


class Cancelled(BaseException):
    """A cancellation that is not an Exception (as asyncio.CancelledError, trio's Cancelled)."""


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, Cancelled])
@pytest.mark.parametrize("entry", ["wrapper", "inplace"])
@pytest.mark.parametrize("thread_lives", [False, True])
def test_base_exception_in_a_worker_thread_leaves_no_hold(exc, entry, thread_lives):
    """A BaseException inside a block of a forward on a worker thread (torch skips
    always_call hooks for it) leaves no hold: another thread then runs the model, and its
    outputs are exact; so does the worker's next call."""
    model, ref, x = build("toy", DEV)
    if entry == "wrapper":
        call = OffloadedTransformer(model, None, device=DEV)
    else:
        apply_layerwise_offload(model, None, device=DEV)
        call = model
    with torch.no_grad():
        expected = first(ref(**x))
    raise_now = threading.Event()
    raise_now.set()

    def boom(m, a):
        if raise_now.is_set():
            raise exc()

    h = model.single_blocks[1].register_forward_pre_hook(boom)
    worker_done, worker_go, seen = threading.Event(), threading.Event(), {}

    def worker():
        try:
            with torch.no_grad():
                call(**x)
        except BaseException as e:  # noqa: BLE001 - the injected one
            seen["first"] = type(e)
        worker_done.set()
        if thread_lives:  # a worker loop that caught it and carries on (not inside the model)
            worker_go.wait(30)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                seen["again"] = first(call(**x))

    t = threading.Thread(target=worker, name="worker")
    t.start()
    assert worker_done.wait(30)
    if not thread_lives:
        t.join(30)
    assert seen["first"] is exc
    raise_now.clear()
    h.remove()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ring re-primes after the cut-short step
        assert torch.equal(first(call(**x)), expected)
        assert torch.equal(first(call(**x)), expected)
    if thread_lives:
        worker_go.set()
        t.join(30)
        assert torch.equal(seen["again"], expected)


def test_base_exception_on_the_calling_thread_leaves_no_hold():
    """The same thread: after a KeyboardInterrupt inside a block, a second thread is not
    refused (the interrupted call holds nothing) and outputs stay exact."""
    model, ref, x = build("toy", DEV)
    wrapped = OffloadedTransformer(model, None, device=DEV)
    h = model.single_blocks[3].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        wrapped(**x)
    h.remove()
    out = {}

    def other():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["b"] = first(wrapped(**x))

    t = threading.Thread(target=other)
    t.start(), t.join(30)
    with torch.no_grad():
        assert torch.equal(out["b"], first(ref(**x)))
