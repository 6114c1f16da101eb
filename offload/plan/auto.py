"""The one "auto" mechanism: measure a step, ask the pure planners, apply the result.

``resident_layers="auto"`` (the resident set and slot count: :mod:`.placement`)
and ``weight_codec="auto"`` (the coded blocks and codec: :mod:`.codec`) are the
same three steps, run by one named step hook on the DiT, :class:`AutoStep`:

1. measure: the first eager step of a new input signature (:func:`signature`:
   tensor shapes and dtypes of the DiT's arguments) is logged by the executor
   (:meth:`log_next_step`): per-block compute and the link rate
   (:mod:`.measure`). With CUDA graphs (codec only) that is the warm-up step,
   before any capture. A failed or cut-short step measures nothing; the next
   call of the signature does. Under DLO AllGather (``gather=True``) the
   measured step is kept until every rank agreed it completed
   (:meth:`AutoStep.after_agreed_step`, called by the DLO end-of-step hook),
   and the measurements are joined over the ranks (:func:`join_measurements`,
   one control collective) so that every rank plans from the same figures;
2. plan: the residency first (:class:`.residency.Residency`: the placement
   within the device budget), then the codec for the blocks that still stream
   (:class:`.coding.Coding`; its sampled blocks give each codec's coded bytes
   and decode rate). With both, the codec's device staging buffers (a coded
   copy per slot) are counted in the budget: a placement they would push past
   it is planned again with them reserved (else nothing is coded);
3. apply: the placement re-binds the resident blocks and rebuilds the ring over
   the same source; the coded blocks are coded through the source's
   ``code_blocks`` (``SourceCaps.codes_blocks``): on a background thread while
   the steps stream them raw, or at once under DLO or before CUDA graphs capture.

Each plan is printed once (``progress``) and kept in ``stats()`` (``"placement"``,
``"codec_plan"``, and ``"plan"``: what was measured and what was chosen, one line).

The planned default (``default``: the keys ``resident_layers`` / ``weight_codec`` left unset,
resolved to "auto" by ``sources/select.py`` ``resolve_default``) is the same mechanism with
these differences: a residency of the default's plans in the free device memory less the
headroom, capped by ``device_memory_budget_gb`` (:meth:`.residency.Residency.budget_bytes`), and
among placements predicted equally fast the one keeping more blocks resident wins (streaming
costs what the model leaves out: hooks, copy-engine traffic); with a codec of the default's, a
step whose compute covers the raw stream of the planned residency codes nothing without
sampling a codec (no encode, no decode timing, no background work: compute-bound models pay
nothing; not under DLO AllGather, where the ranks sample together and plan from the joined
figures); and the plan is printed as one line (``weightstream plan: ...``) instead of one per
part.

The placement is planned per input signature and applied again when a signature comes back; a later
codec plan (eager only, raw blocks left, no coding running; never under DLO AllGather) only adds
coded blocks with the codec already chosen. Outputs are the same bytes whatever is resident or
coded; only where they sit and how they travel changes.
"""
from __future__ import annotations

import sys
import time

import torch

from weightstream.offload.hooks import RemovableHooks
from weightstream.offload.plan.coding import Coding
from weightstream.offload.plan.residency import Residency

__all__ = ["AutoStep", "signature"]

_ROUNDS = 4  # placements planned at most with the codec's staging buffers reserved (AutoStep._plan_both)


def signature(args, kwargs) -> tuple:
    """Shapes and dtypes of the tensors among a call's arguments (one level deep)."""
    def sig(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), str(v.dtype))
        if isinstance(v, (list, tuple)):
            return tuple(sig(x) for x in v if isinstance(x, torch.Tensor))
        return None
    return tuple(sig(a) for a in args) + tuple((k, sig(v)) for k, v in sorted(kwargs.items()))


class AutoStep(RemovableHooks):
    """Named, removable hooks on the DiT: measure a step, plan, apply (module doc).

    ``residency``: plan the resident set (resident_layers="auto"); ``codec``: plan the coded
    blocks (weight_codec="auto"); ``gather``: the ranks of a collective source plan together.
    The parts are ``self.residency`` / ``self.codec`` (None when not asked for); each can be
    removed on its own (``part.remove()``), the hooks go with the last one."""

    def __init__(self, streamed, *, residency: bool, codec: bool, gather: bool = False, default: tuple = ()):
        self.streamed = streamed
        self.gather = gather
        self.default = tuple(default)  # the keys the planned default set to "auto" (module doc)
        self.summary: dict | None = None  # stats()["plan"] of the latest planning
        self.name = f"weightstream.auto[{type(streamed.module).__name__}]"
        self.residency = Residency(self) if residency else None
        self.codec = Coding(self, gather=gather) if codec else None
        self._pending: tuple | None = None  # (signature, parts) whose first step is measuring now
        self._measured: tuple | None = None  # gather: ((signature, parts), events) until every rank agreed
        m = streamed.module
        self._handles = [m.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
                         m.register_forward_hook(self.post_forward, always_call=True)]

    @property
    def parts(self) -> list:
        return [p for p in (self.residency, self.codec) if p is not None and p.active]

    def part_removed(self) -> None:
        if not self.parts:
            self.remove()

    def remove(self) -> None:
        super().remove()
        for p in (self.residency, self.codec):
            if p is not None:
                p.active = False

    # -- measure ---------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        res, cod = self.residency, self.codec
        if res is not None:
            res.sync()  # removed or not: its resident blocks stay resident
        sig = signature(args, kwargs)
        wants = []
        if res is not None and res.active:
            plan = res.plans.get(sig)
            if plan is None:
                wants.append(res)  # measured by this step; planned after it
            elif plan is not res.current:
                res.apply(plan)  # a signature planned before: its placement again
        if cod is not None and cod.active and sig not in cod.plans and cod.can_plan(self._measured is not None):
            wants.append(cod)
        if wants:
            self._pending = (sig, tuple(wants))
            self.streamed.executor.log_next_step()
        return None

    def post_forward(self, module, args, output):
        pending, self._pending = self._pending, None
        ex = self.streamed.executor
        if pending is None or sys.exc_info()[1] is not None or ex.mid_step:
            return  # a failed or cut-short step measures nothing; the next call of the signature does
        events = ex.take_events()
        if self.gather:
            self._measured = (pending, events)  # planned once every rank completed it (after_agreed_step)
            return
        self.plan_and_apply(pending, events)

    def discard(self) -> None:
        """DLO: the measured step failed on some rank (every rank is told at its end): measure another."""
        self._measured = None

    def after_agreed_step(self) -> None:
        """DLO: after a step every rank completed: plan and apply, the same collectives on every rank."""
        if self._measured is None:
            return
        pending, events = self._measured
        self._measured = None
        guard = self.streamed.guard
        if guard.failure is not None:
            return  # no collective may run any more
        try:
            self.plan_and_apply(pending, events)
        except Exception as e:
            guard.mark_failed(f"{type(e).__name__}: {e} (planning or coding weight_codec='auto' after step "
                              f"{self.streamed.executor.position // self.streamed.executor.schedule.n})")
            raise

    # -- plan and apply --------------------------------------------------------------------
    def plan_and_apply(self, pending, events) -> None:
        """Plan from a measured step's ``events`` (``pending``: its input signature and the parts
        that asked for it), print each plan, apply: the residency first, then the codec."""
        sig, parts = pending
        res = self.residency if self.residency in parts and self.residency.active else None
        cod = self.codec if self.codec in parts and self.codec.active else None
        events = list(events)  # read by each planner
        show = not self.default  # the planned default prints one line (summary) instead of one per part
        if cod is None:
            if res is not None:
                rplan = self._plan_residency(res, events)
                res.adopt(sig, rplan, show=show)
                self._summarise(rplan, None, events)
            return
        t0 = time.perf_counter()
        cod.plan_parts = {"sample_s": 0.0, "decode_s": 0.0}
        rplan = None
        if res is None:
            ring = cod.ring_now()
            cplan = cod.make_plan(events, ring, codecs=() if self._hidden(cod, events, ring) else None)
        else:
            rplan, cplan = self._plan_both(res, cod, events)
            res.adopt(sig, rplan, show=show)
        cod.announce(sig, cplan, show=show)
        t1 = time.perf_counter()
        cod.apply(cplan, show=show)
        cod.plan_parts["apply_s"] = time.perf_counter() - t1
        cod.plan_s = time.perf_counter() - t0
        self._summarise(rplan, cplan, events)

    def _hidden(self, cod: Coding, events, ring) -> bool:
        """The planned default: whether the step's compute covers the raw stream of ``ring`` (then
        no codec is sampled: coding cannot make the step faster, and nothing is encoded)."""
        # not gathered: the ranks sample together (a collective), so none may skip it on its own figures
        return "weight_codec" in self.default and not self.gather and cod.raw_stream_hidden(events, ring)

    def _summarise(self, rplan, cplan, events) -> None:
        """stats()["plan"]: what the step measured and what was chosen; printed as one line by the
        planned default (``progress``)."""
        from weightstream.offload.plan.summary import plan_summary
        from weightstream.offload.progress import announce

        self.summary = plan_summary(self, rplan, cplan, events)
        if self.default:
            announce("plan", self.summary["describe"], self.streamed.config.progress)

    def _plan_both(self, res: Residency, cod: Coding, events):
        """The placement within the budget, then the codec for the blocks it streams; where the
        codec's staging buffers would push the placement past the budget, the placement again
        with them reserved (and the codec for that one; a placement that streams more may code
        larger blocks: the reserve grows to the largest seen, a few rounds), else no block coded."""
        rplan = res.make_plan(events)
        ring = cod.ring_of(rplan.placement)
        if self._hidden(cod, events, ring):
            return rplan, cod.make_plan(events, ring, codecs=())
        cplan = cod.make_plan(events, ring)
        first, reserve = (rplan, cplan), 0
        for _ in range(_ROUNDS):
            p = rplan.placement  # its device bytes hold ``reserve`` already
            need = cod.staging_bytes(cplan, p.slots_used)
            if p.device_bytes - reserve + need <= p.budget_bytes:
                return rplan, cplan
            reserve = max(reserve, need)
            try:
                rplan = res.make_plan(events, reserve_bytes=reserve)
            except ValueError:  # the budget holds no placement with the buffers
                break
            cplan = cod.make_plan(events, cod.ring_of(rplan.placement))
        rplan = first[0]  # stream raw what the first placement streams
        return rplan, cod.make_plan(events, cod.ring_of(rplan.placement), codecs=())

    def _plan_residency(self, res: Residency, events):
        """The placement alone (the codec plans nothing now), with the staging buffers of the
        blocks coded already reserved in the budget (where there are any)."""
        rplan = res.make_plan(events)
        if self.codec is None:
            return rplan
        reserve = 0
        for _ in range(_ROUNDS):
            p = rplan.placement  # its device bytes hold ``reserve`` already
            need = self.codec.staging_bytes(None, p.slots_used)
            if p.device_bytes - reserve + need <= p.budget_bytes:
                break
            reserve = max(reserve, need)
            try:
                rplan = res.make_plan(events, reserve_bytes=reserve)
            except ValueError:  # no placement leaves room for them: the smallest one, as planned
                break
        return rplan

    # -- reading ---------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {}
        for p in (self.residency, self.codec):
            if p is not None:
                out.update(p.stats())
        if self.summary is not None:
            out["plan"] = dict(self.summary)
        return out

    def __repr__(self) -> str:
        parts = ", ".join(repr(p) for p in (self.residency, self.codec) if p is not None)
        return f"AutoStep({self.name}, {parts}, {self.state})"
