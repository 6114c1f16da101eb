"""Module (model-level) offload: one selected DiT / encoder group on the device at a time.

Entry point (:func:`weightstream.offload.pipeline.offload_pipeline`)::

    handle = offload_pipeline(pipe, OffloadConfig.module(["dit", "text_encoder"]), device="cuda")
    images = pipe(prompt)                 # hooks swap components as they run
    print(handle.stats())
    with handle.using("text_encoder"):    # for code that calls submodules directly
        embeds = pipe.text_encoder.encoder.layers[0](x)
    handle.disable()                      # back to an ordinary resident pipeline

Mechanism (DESIGN.md section 3):

- Each swapped component ("unit") is packed once into a :class:`HostStore`
  image (every tensor 512-byte aligned) and pinned once. That image is the
  one host master; nothing is ever copied back (weights are immutable).
- Arrival: allocate the unit's device buffer, ONE H2D copy of its image on a
  copy stream (issued as one copy per registered 1 GiB range of the image:
  CUDA rejects a copy whose source spans two ``cudaHostRegister`` ranges with
  "invalid argument"), the compute stream waits on the copy's event
  (``current_stream().wait_event``, no synchronize), and every parameter /
  buffer is rebound (``.data``) to its aligned view of the buffer while the
  copy is in flight. Parameter objects keep their identity.
- Departure: every tensor is rebound to an empty placeholder and the buffer
  reference is dropped, which returns its memory to the allocator. No D2H
  copy, no synchronisation.
- Exclusion (pre-forward hooks): before an encoder runs, selected DiTs leave;
  before a DiT runs, selected encoders and every other selected DiT leave
  (Wan2.2 A14B's ``transformer`` / ``transformer_2`` exclude each other).
  Encoders may share the device with each other. Selected VAEs arrive once
  and stay (their pinned master is kept but never swapped). Resident modules
  and unselected components are moved to the device and left there.
- On ``device="cpu"`` the same mechanism runs: "on the device" is a private
  CPU buffer copied from the host image, "off" is the placeholder.
- ``weight_codec="exp-k"``: each unit's image is kept losslessly coded
  instead (a :class:`~weightstream.offload.sources.pinned.CodedSource` over
  the unit layouts: encoded on worker threads, originals dropped, pinned
  within ``pinned_memory_budget_gb``). An arrival copies the coded bytes H2D
  on the copy stream into a staging buffer allocated for that arrival (no
  device memory is held for staging between arrivals), in runs of about
  ``CODED_RUN_BYTES`` cut between tensors; a decode stream decodes each run
  (one Triton launch) into the unit's fresh buffer as soon as it is copied,
  so copies overlap decodes, and records ``loaded`` after the last decode.
  ``state_dict()`` values are decoded host copies; an in-place edit of one
  is re-encoded before the next arrival.

Entry points other than ``forward`` (:mod:`.hooks`): hooks sit on each swapped
component and on its direct child modules. Code that reaches deeper submodules
directly wraps itself in ``with handle.using(name):``, which makes the component
resident (enforcing exclusion) and keeps it there until the block exits.

Split-model components (:mod:`.split`): each part of a ``SupportsSplitOffload``
model becomes its own unit ``"<component>:<part>"`` that excludes its sibling
parts (and, as usual, encoders / DiTs).

Files: :mod:`.units` (a unit and the host bytes of every unit), :mod:`.selection`
(which components and tensors become units), :mod:`.hooks`, :mod:`.split`,
:mod:`.events` (the transition log); this file is the handle (the swap policy).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..casts import CastGuard
from ..components import Component, Components
from ..config import OffloadConfig
from ..misuse import OffloadDisabledError
from ..progress import format_bytes
from ..host.quantized import host_form, prepare, quantized_format, rehome, streams
from ..sources.select import Topology, check_quantized, select
from ..adapters import UnitEdits, dora_read_error
from ..placeholders import Placeholders
from ..streamed import HostStateDictHook
from .events import Transition, TransitionLog
from .hooks import LoadArrival, ModuleHook, casting_rebinds, forward_running, unit_hooks
from .selection import MARK, assign_tensors, device_peak, select_units, tensors_of
from .split import SplitMovers, SplitOffloadMixin, SupportsSplitOffload, undo_split
from .units import Unit, UnitImages

__all__ = [
    "ModuleOffload",
    "ModuleHook",
    "SplitMovers",
    "SplitOffloadMixin",
    "SupportsSplitOffload",
    "Transition",
]


class ModuleOffload:
    """Handle of a pipeline under module offload (what ``offload_pipeline`` returns).

    ``using(name)``: context manager making a component resident (see the
    module docstring). ``on_device()``: names of units on the device now.
    ``events``: the transition log (:class:`Transition`, newest last, at most
    ``MAX_EVENTS``). ``stats()``: per component bytes / pinned / where, and
    totals. ``offload_all()``: every swapped unit leaves the device.
    ``disable()``: hooks removed, every weight back on the device as an
    ordinary tensor, host store released; returns the pipeline.
    """

    # weight_codec: an arrival copies and decodes a unit's coded bytes in runs of about this
    # many bytes, so copies overlap decodes (<= 0: one copy, then one decode). Settable per
    # handle (``handle.coded_run_bytes``) between arrivals.
    CODED_RUN_BYTES = 64 << 20

    def __init__(self, pipe: Any, config: OffloadConfig, device: torch.device, components: Components):
        t0 = time.perf_counter()
        self.pipe, self.config, self.device = pipe, config, device
        self.selection = select(config, Topology(device_type=device.type))  # the support matrix's cell
        self.components = components
        for c in components.items:  # quantized components: the quantized support matrix (sources/select.py)
            fmt = quantized_format(c.module)
            check_quantized(fmt, "module")
            prepare(c.module, fmt, device)  # a format's own state before the layouts (host/bnb.py)
        for c in components.items:  # tensor subclasses claim the device their inner tensors move to
            rehome(c.module, device)
        self.cuda = device.type == "cuda"
        self._log = TransitionLog(t0)
        self.events = self._log.events
        self._transitions = 0
        self._h2d_bytes = 0
        self._disabled = False
        self._split: list[tuple[nn.Module, SplitMovers]] = []
        self.units: dict[str, Unit] = {}
        self._resident_only: dict[str, Component] = {}
        self.hooks: list = []  # ModuleHook, CastingRebind
        self.state_dict_hooks: list[HostStateDictHook] = []
        self.cast_guards: list[CastGuard] = []
        self.host_views: Mapping[int, torch.Tensor] = {}
        self._marked: list[nn.Module] = []
        self.images: UnitImages | None = None
        self.edits: UnitEdits | None = None  # device edits written back (peft merge / fuse_lora)
        try:
            self.units, self._resident_only, self._marked = select_units(
                self, components, set(config.components), self._split)
            self._setup_images()
            self._install_hooks()
            self._install_placeholders()
        except BaseException:
            for u in self.units.values():
                if u.placeholders is not None:
                    u.placeholders.release_all(u.tensors)
            self._remove_hooks()
            undo_split(self._split)
            raise
        self.coded_run_bytes = self.CODED_RUN_BYTES
        self.images.start_streams()
        for u in self.units.values():
            if not u.swapped:
                self._arrive(u, cause="setup")
        for m in self._marked:
            object.__setattr__(m, MARK, self)
        if self.cuda:
            torch.cuda.current_stream(device).synchronize()  # setup only: settle the vae copies
        self.setup_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ setup
    def _setup_images(self) -> None:
        rest = assign_tensors(self.units.values(), self.components)
        self.resident_bytes = sum(t.numel() * t.element_size() for t in rest)
        self.peak_device_bytes = device_peak(self.units.values(), self.resident_bytes,
                                             self.config.device_memory_budget_gb)
        gb = self.config.pinned_memory_budget_gb
        self.images = UnitImages(
            list(self.units.values()), self.device, codec=self.selection.codec,
            pin=self.config.pin_memory and self.cuda, budget=None if gb is None else int(gb * 1e9),
            progress=self.config.progress,
        )
        self.edits = UnitEdits(self.images)
        # an arrival also holds the unit's coded bytes on the device until its decode ran
        self.peak_device_bytes += self.images.staging_bytes()
        with torch.no_grad():  # everything else we know about goes to the device and stays
            for t in rest:
                if t.device != self.device:
                    t.data = t.data.to(self.device)

    def _install_hooks(self) -> None:
        self.host_views = views = self.images.host_views()
        for u in self.units.values():
            # every unit, VAEs too: parents (the pipeline's save_pretrained) reach it through its module
            self.state_dict_hooks.append(HostStateDictHook(
                f"weightstream.state_dict[{u.name}]", u.module,
                lookup=lambda t: host_form(t, views), offloaded=lambda t: streams(t, views),
                before=self._write_back,
            ))
        for u in self.units.values():
            if u.swapped:
                self.hooks += unit_hooks(self._enter, u)
                self.hooks.append(LoadArrival(self._enter, u))  # load_state_dict: into its device tensors
                self.hooks += casting_rebinds(u)  # layerwise casting: tensors back on the unit's buffer
        # a cast or move of a unit would reach its device copy only, not its host master: refused by name
        self.cast_guards = [CastGuard(u.module, self.device, "offload_pipeline (mode='module')", "handle.disable()")
                            for u in self.units.values()]

    def _install_placeholders(self) -> None:
        """Between arrivals a unit's tensors keep their shape, dtype and device with no storage
        (:mod:`..placeholders`): what reads only metadata (diffusers' LoRA loader reads the base
        weights' shapes, peft places adapters on the weights' device) works on a component that
        is not on the device; ``.data`` is a device copy of the host master and an assignment
        (peft's merge, ``fuse_lora``) writes the host master; a read of the values raises
        StreamedModuleAccessError."""
        where = {id(t): (u, i) for u in self.units.values() for i, t in enumerate(u.tensors)}
        views = self.host_views

        def read(t: torch.Tensor) -> torch.Tensor:
            return views[id(t)].to(self.device, copy=True)

        def write(t: torch.Tensor, value) -> None:
            u, i = where[id(t)]
            spec = u.layout.tensors[i]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(spec.shape) or value.dtype != spec.dtype:
                got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f".data of {ph.name(t)!r} (offloaded with {u.name!r}) must keep its shape and dtype "
                                 f"{(tuple(spec.shape), spec.dtype)}, got {got}")
            self.images.write(u, i, value.detach())

        ph = Placeholders(self.device, read, write, access_hint=(
            "the component is offloaded between its forwards. Read its weights with state_dict() or .data (a "
            "device copy), or call the code inside handle.using(name), which keeps it on the device"),
            explain=lambda t, what: dora_read_error(where[id(t)][0].module, t, what, ph.name(t)))
        for u in self.units.values():
            for t, spec in zip(u.tensors, u.layout.tensors):
                ph.register(t, u.name, spec.name, spec.shape, spec.stride, spec.dtype)
            u.placeholders = ph
            if not u.on_device:
                for t in u.tensors:
                    ph.unbound(t)

    @property
    def store(self):
        """The packed host images (weight_codec="none"), else None."""
        return self.images.store

    @property
    def coded(self):
        """The coded host images (a weight_codec), else None."""
        return self.images.coded

    # ---------------------------------------------------------------- movers
    def _arrive(self, u: Unit, cause: str) -> None:
        t0 = time.perf_counter()
        u.host_version = self.images.host_version()  # before the load: an edit meanwhile reloads again
        u.bind(self.images.load(u, self.coded_run_bytes))
        self.edits.arrived(u)
        u.arrivals += 1
        self._transitions += 1
        moved = self.images.moved_bytes(u)
        self._h2d_bytes += moved
        self._log.record("arrive", u.name, cause, moved, t0, self.on_device())

    def _depart(self, u: Unit, cause: str) -> None:
        t0 = time.perf_counter()
        self.edits.write_back(u)  # a fused LoRA: the host master gets the device's weights
        u.unbind(self.device)  # no copy: the host master is unchanged
        u.departures += 1
        self._transitions += 1
        self._log.record("depart", u.name, cause, u.nbytes, t0, self.on_device())

    def _enter(self, u: Unit, *, cause: str, log: bool) -> None:
        if self._disabled:
            raise RuntimeError(f"module offload of {self.components.pipeline} was disabled, yet a hook of {u.name!r} ran")
        if u.on_device and u.active <= 1 and self.images.host_version() != u.host_version:  # u's own forward only
            # a state_dict() tensor was edited in place since u's device copy was made: that copy
            # is stale; make it again (state_dict() shows the host images, so the forward must use them)
            self._depart(u, cause="host edit")
        if not u.on_device:
            leaving = [v for v in u.excludes if v.on_device]
            for v in leaving:
                if v.busy() and self._still_busy(v):
                    what = "its forward is running" if v.active else "a using() context holds it"
                    raise RuntimeError(
                        f"{u.name!r} needs the device, but {v.name!r} must leave first and cannot: {what}. "
                        f"Module offload keeps one {v.kind}/{u.kind} group resident at a time; "
                        f"call {u.name!r} outside {v.name!r}"
                    )
            for v in leaving:
                self._depart(v, cause=cause)
            self._arrive(u, cause=cause)
        else:
            self._write_back_unit(u)  # fused / unfused since the last forward: into the host master
        if log:
            self._log.enter(u.name, cause, self.on_device())

    def _write_back(self) -> None:
        """Before state_dict() reads the host masters: the device edits of the units on the device."""
        if not self._disabled:
            for u in self.units.values():
                self._write_back_unit(u)

    def _write_back_unit(self, u: Unit) -> None:
        """``u``'s device edits into its host master; the device copy it came from stays current
        (only our own write moved the host images' version: no reload at its next call)."""
        current = self.images.host_version() == u.host_version
        if self.edits.write_back(u) and current:
            u.host_version = self.images.host_version()

    @staticmethod
    def _still_busy(u: Unit) -> bool:
        """Whether busy ``u`` really is (slow path: a refusal is about to be raised).

        A forward left by a BaseException (KeyboardInterrupt, SystemExit) never
        ran its post-forward hook: torch runs ``always_call`` hooks for
        ``Exception`` only. A count whose forward is on no thread's stack is
        such a leftover: it is reset, and the next use proceeds (as the layer
        path recovers at its next step); nothing was lost, the host image is
        the master.
        """
        if u.active and not forward_running(u.module):
            u.active = 0
        return u.busy()

    # ---------------------------------------------------------------- public
    def _unit(self, name: str) -> Unit | None:
        if name in self.units:
            return self.units[name]
        if name in self._resident_only:
            return None
        raise ValueError(
            f"component {name!r} is not known to this module offload; choose from: "
            f"{', '.join(list(self.units) + list(self._resident_only))}"
        )

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        """Make component ``name`` resident for the block (exclusion enforced).

        For code that calls a component's submodules directly (not through
        its ``forward`` or a direct child). While the block runs, a component
        that would evict ``name`` raises ``RuntimeError``. ``name`` is a
        component path ("text_encoder") or a split part
        ("transformer:reasoner"); components that are never swapped (VAEs,
        resident or unselected ones) are accepted and do nothing.
        """
        self._check_live()
        u = self._unit(name)
        if u is None or not u.swapped:
            yield
            return
        u.pins += 1
        try:
            self._enter(u, cause=f"using({name})", log=True)
            yield
        finally:
            u.pins -= 1

    resident = using  # alias: ``with handle.resident("text_encoder"):``

    def on_device(self) -> tuple[str, ...]:
        """Names of the swapped / VAE units whose weights are on the device now."""
        return tuple(n for n, u in self.units.items() if u.on_device)

    def offload_all(self) -> None:
        """Every swapped unit leaves the device (frees its device memory)."""
        self._check_live()
        busy = [u.name for u in self.units.values() if u.swapped and u.on_device and u.busy() and self._still_busy(u)]
        if busy:
            raise RuntimeError(f"offload_all(): {busy} are running or held by using(); call it outside them")
        for u in self.units.values():
            if u.swapped and u.on_device:
                self._depart(u, cause="offload_all")

    def stats(self) -> dict:
        """Per component: kind, bytes, pinned, where, arrivals/departures; and totals."""
        self._check_live()
        comps = {name: self._unit_stats(u) for name, u in self.units.items()}
        for name, c in self._resident_only.items():
            tensors = tensors_of(c.module)
            comps[name] = {
                "kind": c.kind, "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "tensors": len(tensors), "pinned": False, "where": "device", "swapped": False,
                "arrivals": 0, "departures": 0,
            }
        totals = self.images.totals()
        out = {
            "mode": "module",
            "device": str(self.device),
            "source": self.components.source,
            "weight_codec": self.selection.codec,
            "components": comps,
            "on_device": list(self.on_device()),
            "transitions": self._transitions,
            "h2d_bytes": self._h2d_bytes,
            **{k: totals.pop(k) for k in ("host_bytes", "pinned_bytes", "pin_failure")},
            "resident_bytes": self.resident_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "setup_s": self.setup_s,
        }
        out.update(totals)  # under a codec: the coded totals and encode_s
        return out

    def _unit_stats(self, u: Unit) -> dict:
        extra = self.images.unit_stats(u)
        return {
            "kind": u.kind, "bytes": u.nbytes, "tensors": len(u.tensors), "pinned": extra.pop("pinned"),
            "where": "device" if u.on_device else "host", "swapped": u.swapped,
            "arrivals": u.arrivals, "departures": u.departures, **extra,
        }

    def disable(self) -> Any:
        """Remove hooks and give every weight an ordinary device copy; returns the pipeline.

        Idempotent. Waits for in-flight copies (not a hot-path call).
        """
        if self._disabled:
            return self.pipe
        self._remove_hooks()
        self.images.wait_copies()
        with torch.no_grad():
            for u in self.units.values():
                if u.on_device:
                    self._depart(u, cause="disable")
                self.images.give_back(u)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the store goes away next
        undo_split(self._split)
        for m in self._marked:
            if getattr(m, MARK, None) is self:
                object.__delattr__(m, MARK)
        self.images.close()
        self._disabled = True
        return self.pipe

    @property
    def coded_run_bytes(self) -> int:
        """weight_codec: bytes per copy/decode run of an arrival (<= 0: one copy, then one decode)."""
        return self._coded_run_bytes

    @coded_run_bytes.setter
    def coded_run_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"coded_run_bytes={value!r} is not allowed; expected an int number of bytes "
                            "(<= 0: one copy, then one decode)")
        self._coded_run_bytes = value

    def _remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        for h in self.state_dict_hooks:
            h.remove()
        for g in self.cast_guards:
            g.remove()
        self.host_views.clear()  # the hooks' lookups hold this dict: let the store's memory go

    def _check_live(self) -> None:
        if self._disabled:
            raise OffloadDisabledError("this module offload was disabled; offload the pipeline again to use it")

    @property
    def disabled(self) -> bool:
        return self._disabled

    def __repr__(self) -> str:
        if self._disabled:
            return f"ModuleOffload({self.components.pipeline}, disabled)"
        totals = self.images.totals()
        lines = [
            f"ModuleOffload({self.components.pipeline}, device={self.device}, "
            f"components={list(self.config.components)}, source={self.components.source!r}, "
            f"host={format_bytes(totals['host_bytes'])}, pinned={format_bytes(totals['pinned_bytes'])},"
            + ("" if self.coded is None else f" coded {self.selection.codec},"),
            f"  on_device={list(self.on_device())}, transitions={self._transitions}, "
            f"h2d={format_bytes(self._h2d_bytes)},",
            "  hooks=[",
        ]
        lines += [f"    {h!r}," for h in self.hooks]
        lines += [f"    {h!r}," for h in self.state_dict_hooks]
        lines.append("  ],")
        if self._resident_only:
            lines.append(f"  resident={list(self._resident_only)},")
        lines.append(")")
        return "\n".join(lines)
