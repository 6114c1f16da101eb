"""The residency part of the auto mechanism (:mod:`.auto`): ``resident_layers="auto"``.

Policy lives in :mod:`.placement` (pure); this plans from a measured step and
applies. The source holds every block's image (all blocks stream at first);
:func:`.placement.plan_from_events` picks the resident blocks (any subset, by
saved transfer per byte of budget) and the slot count; the placement is
applied between steps:

- a block that becomes resident gets a device copy of its image (its tensors
  are views of it); the host image stays its master: ``state_dict()`` keeps
  returning host views, and at every forward start (:meth:`Residency.sync`)
  an edit of a resident tensor on the device (in place, an assignment, a peft merge)
  is written to the host image and an
  edit of the host views (a ``state_dict()`` taken before the plan, say) is
  copied to the device copies, so neither is ever ignored;
- a block that streams again first syncs, then streams as before;
- the executor is rebuilt over the same source with the new schedule.

The plan and its predicted step time are printed once per planning and kept in
``stats()["placement"]``. Eager only: CUDA graphs with "auto" are refused by the config.
"""
from __future__ import annotations

import torch

from weightstream.offload.adapters import merge_state
from weightstream.offload.config import AUTO_DEVICE_MARGIN_GB
from weightstream.offload.plan import placement as planner
from weightstream.offload.plan.measure import auto_budget_bytes
from weightstream.offload.progress import announce

__all__ = ["Residency"]


class Residency:
    """The resident set of the auto mechanism ``auto`` (:class:`.auto.AutoStep`): its plans
    per input signature, the current one, and the device copies of the resident blocks."""

    def __init__(self, auto):
        self.auto = auto
        self.streamed = auto.streamed
        self.name = f"weightstream.auto_placement[{type(self.streamed.module).__name__}]"
        self.active = True
        self.plans: dict[tuple, planner.AutoPlan] = {}
        self.current: planner.AutoPlan | None = None
        self.h2d_gbps: float | None = None  # the link rate to plan with (None: measured from the event log)
        self.budget_from: str | None = None  # where the latest budget came from (budget_bytes)
        self._device_images: dict[int, torch.Tensor] = {}  # source k -> device image of a resident block
        self._dev_versions: dict[int, list[int]] = {}  # source k -> its device tensors' versions when synced
        self._host_version: int | None = None  # the source's host_version() when last synced

    @property
    def planned_by_default(self) -> bool:
        """Whether the residency is the planned default's (resident_layers not given)."""
        return "resident_layers" in self.auto.default

    def remove(self) -> None:
        """No further planning (the current placement stays)."""
        self.active = False
        self.auto.part_removed()

    @property
    def state(self) -> str:
        return "active" if self.active else "removed"

    # -- planning ----------------------------------------------------------------------
    def budget_bytes(self) -> int:
        """``device_memory_budget_gb`` where given, else the free device memory less the headroom
        (``AUTO_DEVICE_MARGIN_GB``); the planned default takes the smaller of both on CUDA (the
        given budget caps it, the free memory bounds it)."""
        sb = self.streamed
        given = sb.config.device_memory_budget_bytes
        if given is not None and (not self.planned_by_default or sb.device.type != "cuda"):
            self.budget_from = "device_memory_budget_gb"
            return given
        dev = sb.device
        free, _ = torch.cuda.mem_get_info(dev)
        weights = sum(lay.nbytes for lay in sb.source.layouts) + sb.resident_bytes
        budget = auto_budget_bytes(
            free_bytes=free, reserved_bytes=torch.cuda.memory_reserved(dev),
            peak_allocated_bytes=torch.cuda.max_memory_allocated(dev), weight_bytes=weights,
            margin_bytes=int(AUTO_DEVICE_MARGIN_GB * 1e9))
        headroom = f"the free device memory less the {AUTO_DEVICE_MARGIN_GB:g} GB headroom"
        self.budget_from = headroom if given is None or budget < given else "device_memory_budget_gb"
        return budget if given is None else min(given, budget)

    def make_plan(self, events, *, reserve_bytes: int = 0) -> planner.AutoPlan:
        """The placement from a measured step's ``events``; ``reserve_bytes``: device bytes held
        for others within the budget (the codec's staging buffers)."""
        sb = self.streamed
        src = sb.source
        device = [0] * len(sb.blocks)
        link = [0] * len(sb.blocks)
        for k, lay in enumerate(src.layouts):
            device[lay.index] = lay.nbytes
            link[lay.index] = src.link_bytes(k)
        prior = self.current.inputs.compute_ms if self.current is not None else None
        return planner.plan_from_events(
            events, link_bytes=link, device_bytes=device, budget_bytes=self.budget_bytes(),
            fixed_device_bytes=sb.resident_bytes + reserve_bytes, prior_compute_ms=prior, h2d_gbps=self.h2d_gbps,
            cold_outliers=True,  # a signature's first step runs its first blocks cold
            prefer_resident=self.planned_by_default)  # the default: ties keep more blocks resident

    def adopt(self, sig, plan: planner.AutoPlan, *, show: bool = True) -> None:
        """``plan`` is signature ``sig``'s: printed once (``show``; the planned default prints one
        line for both parts), applied."""
        self.plans[sig] = plan
        announce("auto placement", plan.describe(), self.streamed.config.progress and show)
        self.apply(plan)

    # -- applying ------------------------------------------------------------------------
    def apply(self, plan: planner.AutoPlan) -> None:
        sb = self.streamed
        resident = tuple(sorted(plan.placement.resident))
        old = set(self._device_images)
        new = {sb.executor.k_of[i] for i in resident}
        sb.executor.synchronize()
        self.sync()
        for k in sorted(old - new):
            self._demote(k)
        for k in sorted(new - old):
            self._promote(k)
        sb.rebuild_executor(resident, plan.placement.num_slots)
        self.snapshot()
        self.current = plan

    def _promote(self, k: int) -> None:
        """Block ``k`` becomes resident: its tensors view a device copy of its image."""
        sb = self.streamed
        ts = [t for _, _, t in sb.tensors[k]]
        sb.placeholders.release_all(ts)  # their own classes: no longer streamed placeholders
        self._bind_image(k, sb.source.image(k))

    def _bind_image(self, k: int, image: torch.Tensor) -> None:
        sb = self.streamed
        with torch.no_grad():
            for (_, _, t), spec in zip(sb.tensors[k], sb.source.layouts[k].tensors):
                t.data = spec.view_of(image)
        self._device_images[k] = image
        self._dev_versions[k] = self._seen(k)

    def _seen(self, k: int) -> tuple:
        """What an edit of resident block ``k`` on the device moves: each tensor's version and
        address (an assignment), and its peft layers' merged adapters (a merge's ``.data +=``
        moves neither; :func:`..adapters.merge_state`)."""
        sb = self.streamed
        ts = [t for _, _, t in sb.tensors[k]]
        return [(t._version, t.data_ptr()) for t in ts], merge_state(sb.blocks[sb.source.layouts[k].index].module)

    def _demote(self, k: int) -> None:
        """Block ``k`` streams again (synced first: its host image holds every edit)."""
        self._device_images.pop(k)  # the executor's unbind at its construction drops the views
        self._dev_versions.pop(k)

    def sync(self) -> None:
        """Device copies and host images of the resident blocks agree again: a device
        tensor written since the last sync goes to the host image; then, if the host
        store was edited (host views, update_weights), the device copies are refreshed.
        A few integer reads per resident tensor when nothing changed."""
        if not self._device_images:
            return
        sb = self.streamed
        src = sb.source
        sb.executor.check_usable("auto placement's sync")  # a coded source re-encodes edited host copies here
        host_edited = src.host_version() != self._host_version
        for k in self._device_images:
            ts = [t for _, _, t in sb.tensors[k]]
            (seen, merged), (was, was_merged) = self._seen(k), self._dev_versions[k]
            if seen != was or merged != was_merged:
                sb.executor.synchronize()
                for i, (t, a, b) in enumerate(zip(ts, seen, was)):
                    if a != b or merged != was_merged:  # a merge: every tensor of the block (not the hot path)
                        src.write(k, i, t.data)
                sb.executor.reload_pending()  # a coded source re-encodes what was just written
        if host_edited:
            sb.executor.synchronize()
            for k in list(self._device_images):
                self._bind_image(k, src.image(k))
        self.snapshot()

    def snapshot(self) -> None:
        """The current state is in sync (after an update wrote host and device alike)."""
        sb = self.streamed
        self._host_version = sb.source.host_version()
        for k in self._device_images:
            self._dev_versions[k] = self._seen(k)

    def resident_tensors(self) -> set[int]:
        """ids of the tensors of blocks the current plan keeps resident."""
        sb = self.streamed
        return {id(t) for k in self._device_images for _, _, t in sb.tensors[k]}

    def stats(self) -> dict:
        return {} if self.current is None else {"placement": self.current.stats()}

    def __repr__(self) -> str:
        res = sorted(self.current.placement.resident) if self.current is not None else "not planned yet"
        return f"Residency({self.name}, resident {res}, {len(self.plans)} signature(s), {self.state})"
