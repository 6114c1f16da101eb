"""CUDA-graph mechanism: capture one denoising step over the fixed slots, replay it.

What one graph holds: every streamed block's H2D copy from the pinned host
store into its slot (issued by the executor's hooks on the copy stream during
capture), the compute of every block, the copies the last blocks issue for the
next step, and the events joining the streams. A graph ends only when all its
copies have, so the schedule keeps no copy that waits for the step's last block
inside it: that one starts the next graph (``Schedule.defer_last``), or, with
resident blocks, every boundary load does (``Schedule.step_local``). Loads a
previous graph or an eager step issued for this step's first positions are
waited for by the launching stream, because a capture may not wait on events
recorded outside it. Host weights are read at replay time, so
``update_weights`` needs no recapture; a change of a peft adapter's state
(``adapters``: merged, active, enabled, scaling) drops every graph.

A capture that did not run exactly one step's streamed blocks (an early exit
in the model's forward), or whose output hides tensors in a container torch's
pytree does not know, is discarded before any replay: the ring is re-primed at
the next step boundary (``executor.reset()``, which reloads the slots) and the
step runs eager, with one warning.

Policy (keys, when to capture, fallback) lives in :mod:`policy`.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils import _pytree as pytree

from .policy import (
    Action,
    GraphPolicy,
    UnsupportedInput,
    autocast_problem,
    output_problem,
    signature,
    step_problem,
    tensor_leaves,
)


class CapturePreconditionError(RuntimeError):
    """A condition for capturing the step does not hold (named in the message)."""


class StaticAddressError(RuntimeError):
    """debug_graph_addresses: a static buffer moved between capture and replay."""


def check_preconditions(executor, config) -> None:
    """Raise CapturePreconditionError naming the first unmet condition."""
    if executor.device.type != "cuda":
        raise CapturePreconditionError(f"cuda_graphs='on' needs a CUDA device, got {executor.device}")
    src = executor.source.stats()
    if not src["pinned"]:
        raise CapturePreconditionError(
            "cuda_graphs='on' needs every block of the host store pinned (pin_memory=true and no "
            f"pinned-memory budget cut-off); source: {executor.source!r}, reason: {src['pin_failure']}"
        )
    if config.record_events:
        raise CapturePreconditionError("cuda_graphs='on' cannot record the per-block event log; set record_events=false")
    unpinned = executor.uncapturable()
    if unpinned:
        raise CapturePreconditionError(unpinned)


class _Graph:
    def __init__(self, graph, static_in: list[torch.Tensor], static_out, addresses: list[int]):
        self.graph, self.static_in, self.static_out, self.addresses = graph, static_in, static_out, addresses


class GraphRunner:
    """Runs a module's steps through captured CUDA graphs, eager where it must."""

    def __init__(self, module, executor, config, *, max_graphs: int = 8, adapters=None):
        check_preconditions(executor, config)
        self.module, self.executor, self.config = module, executor, config
        # () -> the peft adapter state a capture bakes in (offload/adapters.py AdapterWatch.key):
        # when it changes (set_adapters, disable_lora, fuse_lora, a load) every graph is dropped
        self.adapters = adapters
        self.adapter_drops = 0  # times the graphs were dropped for a changed adapter state
        self.policy = GraphPolicy(max_graphs=max_graphs)
        self.graphs: dict = {}
        # the memory pool the live graphs share; a fresh one whenever none is live (a pool every
        # graph of which was destroyed is torch's to free: capturing into it again is an error)
        self.pool = None
        self.period = executor.schedule.phase_period
        self.counts = {a.value: 0 for a in Action}
        self._captures = 0  # capture tags handed to the executor

    def _phase(self) -> int:
        ex = self.executor
        return ex.step_index % self.period

    def __call__(self, args: tuple, kwargs: dict):
        ex = self.executor
        # first: a fuse that made coded blocks outgrow the captured copies left them stale, and
        # dropping the graphs it changed clears that (check_replay would refuse them)
        if self.adapters is not None and self.policy.adapters_changed(self.adapters()):
            self._drop_graphs()
        ex.check_usable()  # DLO: a failed backend raises before any collective; mmap: a changed file
        if ex.mid_step:
            # an earlier eager step stopped part-way: a replay runs no hooks that could
            # notice, so line the ring up first; a step whose last blocks were skipped
            # (nothing bound) finishes as skipped, one that raised inside a block or whose load
            # failed re-primes
            if ex.block_bound or ex.load_failed:
                ex.reset()
            else:
                ex.finish_step()
        try:
            sig = signature(args, kwargs)
        except UnsupportedInput as e:
            return self._eager(args, kwargs, Action.EAGER_FALLBACK, cause=str(e))
        problem = autocast_problem(ex.device.type)
        if problem is not None:
            return self._eager(args, kwargs, Action.EAGER_FALLBACK, cause=problem)
        action = self.policy.decide(sig, self._phase(), settling=ex.capture_deferred())
        if action is Action.REPLAY:
            ex.check_replay()  # coded blocks re-encoded past the captured copies (not by an adapter change)
            return self._replay(self.graphs[(sig, self._phase())], args, kwargs)
        if action is Action.CAPTURE:
            return self._capture(sig, args, kwargs)
        out = self._eager(args, kwargs, action)
        if action is Action.EAGER_WARMUP:
            problem = output_problem(out)
            if problem is None:
                self.policy.warmed_up(sig)
            elif self.policy.capture_failed(sig, problem):
                warnings.warn(f"weightstream: cuda_graphs: not capturing, running eager: {problem}", stacklevel=3)
        return out

    def _eager(self, args, kwargs, action: Action, cause: str | None = None):
        if cause is not None and self.policy.capture_failed(("unsupported",), cause):
            warnings.warn(f"weightstream: cuda_graphs: running eager: {cause}", stacklevel=4)
        self.counts[action.value] += 1
        return self.module(*args, **kwargs)

    # -- capture -----------------------------------------------------------------
    def _capture(self, sig, args, kwargs):
        ex = self.executor
        leaves, spec = pytree.tree_flatten((args, kwargs))
        static = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        for x in static:
            if isinstance(x, torch.Tensor) and x.device != ex.device:
                return self._fail(sig, args, kwargs, f"input tensor on {x.device}, not {ex.device}: inputs must live on the device")
        s_args, s_kwargs = pytree.tree_unflatten(static, spec)
        phase = self._phase()
        ex.wait_pending(torch.cuda.current_stream(ex.device))  # primes a deferred executor
        if not self.graphs:  # first capture, or every graph dropped (adapter change, failed capture)
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # the step's first loads were issued before the graph (torch.cuda.graph
        # synchronises on entry); inside, only this capture's events are waited on
        self._captures += 1
        start = ex.begin_capture(self._captures)
        prev = torch.cuda.current_stream(ex.device)
        first_error = failed = None
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                try:
                    out = self.module(*s_args, **s_kwargs)
                    # join every side stream the step used back into the capturing stream
                    for side in ex.side_streams():
                        torch.cuda.current_stream(ex.device).wait_stream(side)
                except Exception as e:
                    first_error = e  # the cause; capture_end then fails with a generic error
                    raise
        except Exception as e:  # data-dependent shapes, host syncs, unsupported ops
            # a failed capture_end leaves torch's capture stream current: restore ours
            torch.cuda.set_stream(prev)
            failed = first_error if first_error is not None else e
        # Capture ran the hooks but executed nothing (the replay below executes the
        # step): it must have advanced exactly one step and produced outputs we can copy
        problem = None
        if failed is None:
            problem = step_problem(ex.position - start, ex.schedule.n) or output_problem(out)
        # DLO: one small collective, so every rank keeps or drops its graph alike
        if not ex.agree_capture(failed is None and problem is None):
            ex.end_capture()
            graph = out = None  # never replayed
            ex.reset()  # the ring is re-primed at a step boundary; eager runs the step
            if failed is not None:
                cause = f"{type(failed).__name__}: {failed}"
            else:
                cause = problem or "the capture failed on a peer rank"
            return self._fail(sig, args, kwargs, cause)
        ex.end_capture()
        tensors = [x for x in static if isinstance(x, torch.Tensor)]
        g = _Graph(graph, tensors, out, [t.data_ptr() for t in tensors])
        for key in self.policy.captured(sig, phase):
            self.graphs.pop(key, None)
        self.graphs[(sig, phase)] = g
        self.counts[Action.CAPTURE.value] += 1
        graph.replay()
        return _fresh(out)

    def _fail(self, sig, args, kwargs, cause: str):
        if self.policy.capture_failed(sig, cause):
            warnings.warn(f"weightstream: cuda_graphs: capture failed, running eager: {cause}", stacklevel=4)
        self.counts[Action.EAGER_FALLBACK.value] += 1
        return self.module(*args, **kwargs)

    # -- replay ------------------------------------------------------------------
    def _replay(self, g: _Graph, args, kwargs):
        ex = self.executor
        if self.config.debug_graph_addresses:
            moved = [i for i, (t, a) in enumerate(zip(g.static_in, g.addresses)) if t.data_ptr() != a]
            if moved:
                raise StaticAddressError(f"static inputs {moved} moved since capture")
        with torch.no_grad():
            for dst, src in zip(g.static_in, tensor_leaves(args, kwargs)):
                dst.copy_(src)
        stream = torch.cuda.current_stream(ex.device)
        ex.wait_pending(stream)
        g.graph.replay()
        ex.replayed_step()
        self.counts[Action.REPLAY.value] += 1
        return _fresh(g.static_out)

    def _drop_graphs(self) -> None:
        """Every graph out (their replays finished first); the next steps warm up and capture again
        (the source forgets what it kept for them: :meth:`~..offload.executor.LayerwiseExecutor.captures_dropped`)."""
        torch.cuda.current_stream(self.executor.device).synchronize()
        self.graphs.clear()
        self.policy.clear()
        self.executor.captures_dropped()
        self.adapter_drops += 1

    def release(self) -> None:
        """Drop every graph and static buffer (their pool memory returns to the allocator)."""
        torch.cuda.synchronize(self.executor.device)
        self.graphs.clear()
        self.policy.clear()
        self.pool = None
        torch.cuda.empty_cache()


def _fresh(out):
    """Clone every tensor of a static output (the next replay overwrites it)."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
