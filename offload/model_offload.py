"""Module (model-level) offload: one selected DiT / encoder group on the device at a time.

Entry point::

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
  instead (a :class:`~weightstream.offload.sources.coded.CodedSource` over
  the unit layouts: encoded on worker threads, originals dropped, pinned
  within ``pinned_memory_budget_gb``). An arrival copies the coded bytes H2D
  on the copy stream into a staging buffer allocated for that arrival (no
  device memory is held for staging between arrivals), in runs of about
  ``CODED_RUN_BYTES`` cut between tensors; a decode stream decodes each run
  (one Triton launch) into the unit's fresh buffer as soon as it is copied,
  so copies overlap decodes, and records ``loaded`` after the last decode.
  ``state_dict()`` values are decoded host copies; an in-place edit of one
  is re-encoded before the next arrival.

Entry points other than ``forward``: hooks sit on each swapped component and
on its direct child modules, so ``vae.decode``-style methods that call a child
(``self.decoder(z)``) and ``encode_prompt`` calling ``text_encoder(...)`` work
unchanged. Code that reaches deeper submodules directly wraps itself in
``with handle.using(name):``, which makes the component resident (enforcing
exclusion) and keeps it there until the block exits.

Split-model components (``SupportsSplitOffload``): a selected DiT / encoder
whose module has a callable ``enable_omni_model_cpu_offload`` is delegated to.
It receives a :class:`SplitMovers` and returns its mutually exclusive parts
(``{"reasoner": self.reasoner, "generator": self.generator}``); each part
becomes its own unit ``"<component>:<part>"`` that excludes its sibling parts
(and, as usual, encoders / DiTs). The model wraps each phase in
``with self._offload_context("reasoner"):``, implemented as
``movers.context("reasoner")``: the same movers and hooks the pipeline-level
path uses. Tensors of the model outside every part stay on the device.
``disable_omni_model_cpu_offload()`` is called on ``disable()``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import time
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from .components import Component, Components, SupportsComponentDiscovery, discover_components
from .config import OffloadConfig
from .tracing import not_traced
from .discovery import resolve_path
from .host_store import HostStore, Progress
from .host_store import copy_from_image as _copy_from_image
from .layout import block_tensors, build_layout
from .sources.coded import CodedSource, module_codec
from .streamed import HostStateDictHook, resolve_device

__all__ = [
    "offload_pipeline",
    "ModuleOffload",
    "ModuleHook",
    "SplitMovers",
    "SplitOffloadMixin",
    "SupportsSplitOffload",
    "SupportsComponentDiscovery",
    "Transition",
]

# config component name -> discovered kinds it selects
SWAPPED_KINDS = ("dit", "text_encoder")
MAX_EVENTS = 10_000
CPU_ALIGN = 4096
PARALLEL_PACK_BYTES = 64 << 20  # below this, packing on one thread is faster than a pool
_MARK = "_weightstream_module_offload"
# per unit and in total in stats() under weight_codec != "none"
CODED_STATS = ("coded_bytes", "raw_bytes", "bits_per_weight", "host_bytes")


@runtime_checkable
class SupportsSplitOffload(Protocol):
    """A component made of mutually exclusive parts that run in different phases.

    ``enable_omni_model_cpu_offload(movers)`` keeps ``movers`` (for
    ``_offload_context``) and returns the parts, ``{part name: submodule}``.
    Each part is swapped as its own unit and excludes its sibling parts.
    ``disable_omni_model_cpu_offload()`` forgets the movers (contexts become
    no-ops). Both must be idempotent. :class:`SplitOffloadMixin` implements
    the protocol from a class attribute ``_offload_parts``.
    """

    def enable_omni_model_cpu_offload(self, movers: "SplitMovers") -> Mapping[str, nn.Module]: ...

    def disable_omni_model_cpu_offload(self) -> None: ...


class SplitOffloadMixin:
    """Implements :class:`SupportsSplitOffload` from ``_offload_parts``
    (part name -> dotted path inside the model)::

        class Cosmos3Like(SplitOffloadMixin, nn.Module):
            _offload_parts = {"reasoner": "reasoner", "generator": "generator"}

            def forward(self, x):
                with self._offload_context("reasoner"):
                    ctx = self.reasoner(x)
                with self._offload_context("generator"):
                    return self.generator(x, ctx)
    """

    _offload_parts: ClassVar[Mapping[str, str]] = {}

    def enable_omni_model_cpu_offload(self, movers: "SplitMovers") -> Mapping[str, nn.Module]:
        object.__setattr__(self, "_omni_movers", movers)
        return {name: resolve_path(self, path, what=f"offload part {name!r}") for name, path in self._offload_parts.items()}

    def disable_omni_model_cpu_offload(self) -> None:
        object.__setattr__(self, "_omni_movers", None)

    def _offload_context(self, part: str):
        movers = self.__dict__.get("_omni_movers")
        return contextlib.nullcontext() if movers is None else movers.context(part)


class SplitMovers:
    """What a split model receives: contexts that make one of its parts resident.

    ``context(part)`` is ``handle.using("<component>:<part>")``: the part
    arrives (its siblings, other DiTs or encoders leave as the exclusion rules
    say) and stays until the block exits. The movers are the controller's own
    arrival / departure, the same ones the pipeline-level hooks use.
    """

    def __init__(self, controller: "ModuleOffload", component: str):
        self._controller = controller
        self.component = component
        self.parts: tuple[str, ...] = ()

    def unit_name(self, part: str) -> str:
        return f"{self.component}:{part}"

    def context(self, part: str):
        if part not in self.parts:
            raise ValueError(
                f"offload part {part!r} is not a part of {self.component!r}; choose from: {', '.join(self.parts)}"
            )
        return self._controller.using(self.unit_name(part))

    def on_device(self) -> tuple[str, ...]:
        """Parts of this model currently on the device."""
        prefix = self.component + ":"
        return tuple(n[len(prefix):] for n in self._controller.on_device() if n.startswith(prefix))

    def __repr__(self) -> str:
        return f"SplitMovers({self.component!r}, parts={list(self.parts)})"


@dataclass(frozen=True)
class Transition:
    """One record of the controller's event log.

    action: "enter" (a component hook ran; nothing may have moved),
    "arrive", "depart". cause: the unit whose hook or context asked for it,
    or "setup" / "offload_all" / "disable". on_device: units resident after
    the record. host_ms: host time spent on it (for an arrival: issuing the
    copy and rebinding, not the copy itself).
    """

    seq: int
    action: str
    unit: str
    cause: str
    nbytes: int
    t_ms: float
    host_ms: float
    on_device: tuple[str, ...]


class _Unit:
    """One swapped component (or part): its tensors, host image and device state."""

    def __init__(self, name: str, kind: str, module: nn.Module, group: str | None):
        self.name, self.kind, self.module, self.group = name, kind, module, group
        self.swapped = kind in SWAPPED_KINDS  # vae units arrive once and stay
        self.index = -1
        self.tensors: list[torch.Tensor] = []
        self.layout = None
        self.placeholders: list[torch.Tensor] = []
        self.excludes: list[_Unit] = []
        self.buffer: torch.Tensor | None = None
        self.loaded = None  # torch.cuda.Event of the last arrival copy
        self.active = 0  # forwards of the component running now
        self.pins = 0  # open using() contexts
        self.arrivals = 0
        self.departures = 0

    @property
    def on_device(self) -> bool:
        return self.buffer is not None

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def busy(self) -> bool:
        return self.active > 0 or self.pins > 0


class ModuleHook:
    """Named, removable pre-forward hook that makes a unit resident.

    ``root`` hooks sit on the component's own module: they also count running
    forwards (a post-forward hook, always called) and log an "enter" record.
    Entry hooks sit on its direct children, for methods such as
    ``vae.decode`` that call a child rather than ``forward``.
    """

    def __init__(self, controller: "ModuleOffload", unit: _Unit, module: nn.Module, entry: str | None):
        self.controller, self.unit, self.entry = controller, unit, entry
        self.name = f"weightstream.module[{unit.name}]" + (f".entry[{entry}]" if entry else "")
        self._handles = [module.register_forward_pre_hook(self.pre_forward)]
        if entry is None:
            self._handles.append(module.register_forward_hook(self.post_forward, always_call=True))

    @not_traced  # swaps rebind parameters and wait on stream events; not traceable
    def pre_forward(self, module, args):
        unit = self.unit
        if self.entry is None:
            unit.active += 1  # first: post_forward runs (and decrements) even if the swap raises
            self.controller._enter(unit, cause=unit.name, log=True)
        elif not unit.on_device:
            self.controller._enter(unit, cause=f"{unit.name}.{self.entry}", log=False)

    @not_traced  # bookkeeping only, but must not be traced into the graph
    def post_forward(self, module, args, output):
        self.unit.active -= 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def removed(self) -> bool:
        return not self._handles

    def __repr__(self) -> str:
        u = self.unit
        where = "on device" if u.on_device else "on host"
        state = "removed" if self.removed else "active"
        return f"ModuleHook({self.name}, {u.kind}, {where}, {state})"


def _aligned_cpu_buffer(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + CPU_ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % CPU_ALIGN
    return raw[skip : skip + nbytes]


def _typed_views(buffer: torch.Tensor, layout) -> list[torch.Tensor]:
    """Strided views of every tensor of ``layout`` inside a uint8 ``buffer``.

    One typed view of the whole buffer per dtype, then one ``as_strided`` per
    tensor (offsets are 512-byte aligned, so they divide every itemsize; the
    buffer itself starts 512-byte aligned, see ``_aligned_cpu_buffer``).
    """
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for spec in layout.tensors:
        size = spec.dtype.itemsize
        base = typed.get(spec.dtype)
        if base is None:
            base = typed[spec.dtype] = buffer[: buffer.numel() // size * size].view(spec.dtype)
        out.append(torch.as_strided(base, spec.shape, spec.stride, base.storage_offset() + spec.offset // size))
    return out


def _single(spec):
    """A one-tensor layout whose tensor starts at byte 0 (for ``_typed_views``)."""
    return types.SimpleNamespace(tensors=(dataclasses.replace(spec, offset=0),))


def _forward_running(module: nn.Module) -> bool:
    """Whether a call of ``module`` (its ``nn.Module._call_impl`` frame) is on some thread's stack."""
    code = nn.Module._call_impl.__code__
    for top in sys._current_frames().values():
        f = top
        while f is not None:
            if f.f_code is code and f.f_locals.get("self") is module:
                return True
            f = f.f_back
    return False


def _tensors_of(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, _, t in block_tensors(module)]


class ModuleOffload:
    """Handle of a pipeline under module offload (what :func:`offload_pipeline` returns).

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
        self.components = components
        self.cuda = device.type == "cuda"
        self._t0 = t0
        self._seq = 0
        self._transitions = 0
        self._h2d_bytes = 0
        self.events: collections.deque[Transition] = collections.deque(maxlen=MAX_EVENTS)
        self._disabled = False
        self._split: list[tuple[nn.Module, SplitMovers]] = []
        self.units: dict[str, _Unit] = {}
        self._resident_only: dict[str, Component] = {}
        self.hooks: list[ModuleHook] = []
        self.state_dict_hooks: list[HostStateDictHook] = []
        self.host_views: Mapping[int, torch.Tensor] = {}
        self._marked: list[nn.Module] = []
        self.store: HostStore | None = None  # the packed images (weight_codec="none")
        self.coded: CodedSource | None = None  # or the coded images (weight_codec="exp-k" / "exp-k2")
        try:
            self._build_units()
            self._setup_store()
            self._install_hooks()
        except BaseException:
            self._remove_hooks()
            self._undo_split()
            raise
        self.coded_run_bytes = self.CODED_RUN_BYTES
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            for u in self.units.values():
                u.loaded = torch.cuda.Event()
            if self.coded is not None:
                self.decode_stream = torch.cuda.Stream(device)
                self._run_copied = torch.cuda.Event()
        for u in self.units.values():
            if not u.swapped:
                self._arrive(u, cause="setup")
        for m in self._marked:
            object.__setattr__(m, _MARK, self)
        if self.cuda:
            torch.cuda.current_stream(device).synchronize()  # setup only: settle the vae copies
        self.setup_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ setup
    def _build_units(self) -> None:
        selected = set(self.config.components)
        for c in self.components.items:
            if getattr(c.module, _MARK, None) is not None:
                raise ValueError(
                    f"component {c.name!r} of {self.components.pipeline} is already under module offload; "
                    "call disable() on the first handle before offloading again"
                )
            if c.kind == "resident" or c.kind not in selected:
                self._resident_only[c.name] = c
                continue
            self._marked.append(c.module)
            enable = getattr(c.module, "enable_omni_model_cpu_offload", None)
            if c.kind in SWAPPED_KINDS and callable(enable):
                self._add_split(c, enable)
            else:
                self.units[c.name] = _Unit(c.name, c.kind, c.module, group=None)
        for kind in selected:
            if not self.components.of_kind(kind):
                warnings.warn(
                    f"weightstream: components selects {kind!r}, but {self.components.pipeline} has no "
                    f"{kind} component ({self.components.source}); nothing of that kind is offloaded",
                    stacklevel=4,
                )
        swapped = [u for u in self.units.values() if u.swapped]
        for u in swapped:
            u.excludes = [
                v for v in swapped
                if v is not u and ((u.group is not None and u.group == v.group) or "dit" in (u.kind, v.kind))
            ]

    def _add_split(self, c: Component, enable) -> None:
        movers = SplitMovers(self, c.name)
        parts = enable(movers)
        self._split.append((c.module, movers))
        if not isinstance(parts, Mapping) or not parts:
            raise ValueError(
                f"{type(c.module).__name__}.enable_omni_model_cpu_offload (component {c.name!r}) returned "
                f"{parts!r}; expected a non-empty mapping of part name -> submodule"
            )
        inside = {id(m) for m in c.module.modules()}
        for part, module in parts.items():
            if not isinstance(part, str) or not part or ":" in part:
                raise ValueError(f"split part name {part!r} of {c.name!r} is not allowed; use a non-empty name without ':'")
            if not isinstance(module, nn.Module) or id(module) not in inside or module is c.module:
                raise ValueError(
                    f"split part {part!r} of {c.name!r} is {type(module).__name__}; expected a proper "
                    f"submodule of {type(c.module).__name__}"
                )
        movers.parts = tuple(parts)
        for part, module in parts.items():
            name = movers.unit_name(part)
            self.units[name] = _Unit(name, c.kind, module, group=c.name)

    def _setup_store(self) -> None:
        # tensors that must stay on the device: resident modules (also inside components)
        keep: set[int] = set()
        for c in self.components.of_kind("resident"):
            keep.update(id(t) for t in _tensors_of(c.module))
        owner: dict[int, str] = {}
        for u in self.units.values():
            objs = []
            for tname, kind, t in block_tensors(u.module):
                if id(t) in keep:
                    continue
                if id(t) in owner:
                    raise ValueError(
                        f"tensor {u.name}.{tname} is shared with component {owner[id(t)]!r}; a tensor can have "
                        "one host master only: untie the weights or keep one of the components resident"
                    )
                owner[id(t)] = u.name
                objs.append((tname, kind, t))
            u.tensors = [t for _, _, t in objs]
            u.layout = build_layout(len(self._ordered_layouts()), u.name, objs)
            u.index = u.layout.index
        # everything else we know about goes to the device and stays
        rest: list[torch.Tensor] = []
        seen: set[int] = set(owner)
        for c in self.components.items:
            for tname, _, t in block_tensors(c.module):
                unit = self.units.get(owner.get(id(t), ""))
                if unit is not None and unit.module is not c.module and unit.group != c.name:
                    raise ValueError(
                        f"tensor {c.name}.{tname} is shared with component {unit.name!r}, which is offloaded; "
                        "a swapped tensor cannot also belong to another component: untie the weights"
                    )
                if id(t) not in seen:
                    seen.add(id(t))
                    rest.append(t)
        self.resident_bytes = sum(t.numel() * t.element_size() for t in rest)
        self._check_device_budget()
        pin_budget = self.config.pinned_memory_budget_gb
        budget = None if pin_budget is None else int(pin_budget * 1e9)
        layouts = self._ordered_layouts()
        if self.config.weight_codec != "none" and layouts:
            self._code_all(layouts, budget)
        else:
            self.store = HostStore(layouts, pin=self.config.pin_memory and self.cuda, budget_bytes=budget)
            self._pack_all()
        with torch.no_grad():
            for t in rest:
                if t.device != self.device:
                    t.data = t.data.to(self.device)

    def _pack_all(self) -> None:
        """Copy every unit's tensors into its image, drop the originals, pin.

        Copies run on worker threads (page-fault and memcpy bound; torch
        copies release the GIL); dropping and pinning stay on this thread in
        unit order. On failure every dropped tensor gets its weights back.
        """
        units = list(self.units.values())
        progress = Progress(f"packing {len(units)} components into host memory", self.store.nbytes,
                            self.config.progress)
        jobs = [(u, spec, t) for u in units for spec, t in zip(u.layout.tensors, u.tensors)]
        total = sum(spec.nbytes for _, spec, _ in jobs)
        workers = max(1, min(8, os.cpu_count() or 1)) if total >= PARALLEL_PACK_BYTES else 1
        empties: dict[torch.dtype, torch.Tensor] = {}
        done: list[_Unit] = []

        def copy_one(job) -> None:
            u, spec, t = job
            with torch.no_grad():
                spec.view_of(self.store.image(u.index)).copy_(t.detach())

        try:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightstream-pack") as pool:
                futures = {id(u): [] for u in units}
                for job in jobs:
                    futures[id(job[0])].append(pool.submit(copy_one, job))
                for u in units:
                    for f in futures[id(u)]:
                        f.result()
                    u.placeholders = [empties.setdefault(t.dtype, torch.empty(0, dtype=t.dtype, device=self.device))
                                      for t in u.tensors]
                    for t, ph in zip(u.tensors, u.placeholders):  # the store is now the one host copy
                        t.data = ph
                    done.append(u)
                    self.store.pin(u.index)
                    progress.update(u.nbytes)
        except BaseException:
            with torch.no_grad():  # nothing lost: give dropped tensors their weights back
                for u in done:
                    self._give_back(u)
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            self.store.close()
            raise

    def _code_all(self, layouts, budget: int | None) -> None:
        """Every unit's image coded into a :class:`CodedSource` (encoded on worker threads,
        originals dropped, pinned within the budget, unit by unit); on failure the source
        gives every dropped tensor its weights back (decoded, on the host) before raising."""
        empties: dict[torch.dtype, torch.Tensor] = {}
        for u in self.units.values():
            u.placeholders = [empties.setdefault(t.dtype, torch.empty(0, dtype=t.dtype, device=self.device))
                              for t in u.tensors]

        def drop(tensors) -> None:  # the coded region is now the one host copy
            for t in tensors:
                t.data = empties[t.dtype]

        self.coded = CodedSource(
            layouts, [u.tensors for u in self.units.values()], device=self.device,
            pin=self.config.pin_memory and self.cuda, budget_bytes=budget, progress=self.config.progress,
            drop=drop, decode_stream=False, codec=module_codec(self.config.weight_codec),
        )
        # an arrival also holds the unit's coded bytes on the device until its decode ran
        self.peak_device_bytes += max(self.coded.copy_bytes)

    def _give_back(self, u: _Unit) -> None:
        """Every tensor of ``u`` gets its own device allocation, filled from the host image."""
        image = self.store.image(u.index) if self.coded is None else self.coded.image(u.index)
        for t, spec in zip(u.tensors, u.layout.tensors):
            raw = torch.empty(spec.nbytes, dtype=torch.uint8, device=self.device)
            _copy_from_image(raw, image, spec.offset)
            t.data = _typed_views(raw, _single(spec))[0]

    def _ordered_layouts(self):
        return [u.layout for u in self.units.values() if u.layout is not None]

    def _check_device_budget(self) -> None:
        swapped = [u for u in self.units.values() if u.swapped]
        stay = sum(u.nbytes for u in self.units.values() if not u.swapped)
        worst = 0
        for u in swapped:  # upper bound of what can share the device with u
            excl = {id(v) for v in u.excludes}
            worst = max(worst, u.nbytes + sum(v.nbytes for v in swapped if v is not u and id(v) not in excl))
        self.peak_device_bytes = self.resident_bytes + stay + worst
        budget = self.config.device_memory_budget_gb
        if budget is not None and self.peak_device_bytes > budget * 1e9:
            raise ValueError(
                f"device_memory_budget_gb={budget} is too small for module offload: resident modules and "
                f"VAEs need {(self.resident_bytes + stay) / 1e9:.3f} GB and the largest co-resident "
                f"component group {worst / 1e9:.3f} GB; raise the budget or use mode='layer'"
            )

    def _install_hooks(self) -> None:
        # id(tensor) -> its view of the host image (zero-copy; coded: of its decoded host copy,
        # decoded on first use, edits re-encoded before the next arrival), for state_dict()
        if self.coded is not None:
            self.host_views = self.coded.host_views()
        else:
            self.host_views = {id(t): spec.view_of(self.store.image(u.index))
                               for u in self.units.values() for t, spec in zip(u.tensors, u.layout.tensors)}
        views = self.host_views
        for u in self.units.values():
            # every unit, VAEs too: parents (the pipeline's save_pretrained) reach it through its module
            self.state_dict_hooks.append(HostStateDictHook(
                f"weightstream.state_dict[{u.name}]", u.module,
                lookup=lambda t: views.get(id(t)), offloaded=lambda t: id(t) in views,
            ))
        for u in self.units.values():
            if not u.swapped:
                continue
            self.hooks.append(ModuleHook(self, u, u.module, entry=None))
            unit_ids = {id(t) for t in u.tensors}
            for cname, child in u.module.named_children():
                if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                    continue
                if not any(id(t) in unit_ids for t in _tensors_of(child)):
                    continue  # a resident child, or one without weights: nothing to bring in
                self.hooks.append(ModuleHook(self, u, child, entry=cname))

    # ---------------------------------------------------------------- movers
    def _arrive(self, u: _Unit, cause: str) -> None:
        t0 = time.perf_counter()
        if self.coded is not None:
            self.coded.check()  # state_dict() copies edited in place are re-encoded first
        buf = self._load(u)
        # rebinding runs on the host while the copy is in flight
        for t, v in zip(u.tensors, _typed_views(buf, u.layout)):
            t.data = v
        u.buffer = buf
        u.arrivals += 1
        self._transitions += 1
        moved = u.nbytes if self.coded is None else self.coded.coded[u.index]
        self._h2d_bytes += moved
        self._log("arrive", u, cause, moved, t0)

    def _load(self, u: _Unit) -> torch.Tensor:
        """A fresh buffer with ``u``'s image; on CUDA filled on the side streams (one H2D copy
        of the image; or, coded, see :meth:`_load_coded`), ``u.loaded`` recorded after it and
        waited on by the compute stream."""
        if not self.cuda:
            buf = _aligned_cpu_buffer(u.nbytes)
            if self.coded is None:
                buf.copy_(self.store.image(u.index))
            else:  # the same runs and tables as on CUDA, decoded straight from the host region
                region = self.coded.region(u.index)
                for _, _, table in self.coded.runs(u.index, self.coded_run_bytes):
                    self.coded.decode_table(region, buf, table)
            return buf
        compute = torch.cuda.current_stream(self.device)
        buf = torch.empty(u.nbytes, dtype=torch.uint8, device=self.device)
        # the new buffer may reuse memory that kernels of a unit that just left still read
        self.copy_stream.wait_stream(compute)
        if self.coded is not None:
            self._load_coded(u, buf, compute)
        else:
            with torch.cuda.stream(self.copy_stream):
                _copy_from_image(buf, self.store.image(u.index), 0)
                u.loaded.record(self.copy_stream)
        compute.wait_event(u.loaded)
        return buf

    def _load_coded(self, u: _Unit, buf: torch.Tensor, compute) -> None:
        """``u``'s coded bytes H2D into a staging buffer on the copy stream, in runs of about
        ``coded_run_bytes`` cut between tensors, each run decoded into ``buf`` on the decode
        stream once copied (run i+1's copy overlaps run i's decode); ``u.loaded`` after the last
        decode. Staging is allocated per arrival from the compute stream's pool and
        ``record_stream``-ed on both side streams: no device memory is held for it between
        arrivals (a reused buffer would keep ~0.7x the largest unit on the device for good)."""
        k, region = u.index, self.coded.region(u.index)
        runs = self.coded.runs(k, self.coded_run_bytes)
        staging = torch.empty(max(runs[-1][1], 1), dtype=torch.uint8, device=self.device)
        self.decode_stream.wait_stream(compute)
        for start, end, table in runs:
            with torch.cuda.stream(self.copy_stream):
                _copy_from_image(staging[start:end], region, start)
                self._run_copied.record(self.copy_stream)
            self.decode_stream.wait_event(self._run_copied)  # waits on this record, not later ones
            with torch.cuda.stream(self.decode_stream):
                self.coded.decode_table(staging, buf, table)
        u.loaded.record(self.decode_stream)
        staging.record_stream(self.copy_stream)
        staging.record_stream(self.decode_stream)

    def _depart(self, u: _Unit, cause: str) -> None:
        t0 = time.perf_counter()
        # off first: a departure interrupted half way (KeyboardInterrupt) leaves the unit
        # off, so its next use rebinds every tensor again
        u.buffer = None  # back to the allocator once rebound; no copy: the host master is unchanged
        for t, ph in zip(u.tensors, u.placeholders):
            t.data = ph
        u.departures += 1
        self._transitions += 1
        self._log("depart", u, cause, u.nbytes, t0)

    def _log(self, action: str, u: _Unit, cause: str, nbytes: int, t0: float) -> None:
        now = time.perf_counter()
        self._seq += 1
        self.events.append(Transition(
            self._seq, action, u.name, cause, nbytes, (t0 - self._t0) * 1e3, (now - t0) * 1e3, self.on_device()))

    def _enter(self, u: _Unit, *, cause: str, log: bool) -> None:
        if self._disabled:
            raise RuntimeError(f"module offload of {self.components.pipeline} was disabled, yet a hook of {u.name!r} ran")
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
        if log:
            self._seq += 1
            self.events.append(Transition(self._seq, "enter", u.name, cause, 0,
                                          (time.perf_counter() - self._t0) * 1e3, 0.0, self.on_device()))

    @staticmethod
    def _still_busy(u: _Unit) -> bool:
        """Whether busy ``u`` really is (slow path: a refusal is about to be raised).

        A forward left by a BaseException (KeyboardInterrupt, SystemExit) never
        ran its post-forward hook: torch runs ``always_call`` hooks for
        ``Exception`` only. A count whose forward is on no thread's stack is
        such a leftover: it is reset, and the next use proceeds (as the layer
        path recovers at its next step); nothing was lost, the host image is
        the master.
        """
        if u.active and not _forward_running(u.module):
            u.active = 0
        return u.busy()

    # ---------------------------------------------------------------- public
    def _unit(self, name: str) -> _Unit | None:
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
        comps = {}
        for name, u in self.units.items():
            coded = None if self.coded is None else self.coded.block_stats(u.index)
            comps[name] = {
                "kind": u.kind,
                "bytes": u.nbytes,
                "tensors": len(u.tensors),
                "pinned": self.store.is_pinned(u.index) if coded is None else coded["pinned_bytes"] > 0,
                "where": "device" if u.on_device else "host",
                "swapped": u.swapped,
                "arrivals": u.arrivals,
                "departures": u.departures,
            }
            if coded is not None:
                comps[name].update({k: coded[k] for k in CODED_STATS})
        for name, c in self._resident_only.items():
            comps[name] = {
                "kind": c.kind, "bytes": sum(t.numel() * t.element_size() for t in _tensors_of(c.module)),
                "tensors": len(_tensors_of(c.module)), "pinned": False, "where": "device", "swapped": False,
                "arrivals": 0, "departures": 0,
            }
        out = {
            "mode": "module",
            "device": str(self.device),
            "source": self.components.source,
            "weight_codec": self.config.weight_codec,
            "components": comps,
            "on_device": list(self.on_device()),
            "transitions": self._transitions,
            "h2d_bytes": self._h2d_bytes,
            "host_bytes": self._host_bytes(),
            "pinned_bytes": self._pinned_bytes(),
            "pin_failure": (self.store if self.coded is None else self.coded).pin_failure,
            "resident_bytes": self.resident_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "setup_s": self.setup_s,
        }
        if self.coded is not None:
            coded = self.coded.stats()
            out.update({k: coded[k] for k in CODED_STATS if k != "host_bytes"})
            out["encode_s"] = coded["encode_s"]
        return out

    def _host_bytes(self) -> int:
        """Host memory of the images: packed bytes, or coded bytes (page-rounded per unit)."""
        return self.store.nbytes if self.coded is None else self.coded.stats()["host_bytes"]

    def _pinned_bytes(self) -> int:
        return self.store.pinned_bytes if self.coded is None else self.coded.stats()["pinned_bytes"]

    def disable(self) -> Any:
        """Remove hooks and give every weight an ordinary device copy; returns the pipeline.

        Idempotent. Waits for in-flight copies (not a hot-path call).
        """
        if self._disabled:
            return self.pipe
        self._remove_hooks()
        if self.cuda:
            self.copy_stream.synchronize()
            if self.coded is not None:
                self.decode_stream.synchronize()
        with torch.no_grad():
            for u in self.units.values():
                if u.on_device:
                    self._depart(u, cause="disable")
                self._give_back(u)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the store goes away next
        self._undo_split()
        for m in self._marked:
            if getattr(m, _MARK, None) is self:
                object.__delattr__(m, _MARK)
        if self.coded is not None:
            self.coded.close()
            self.coded = None  # let the coded arena go
        else:
            self.store.close()
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
        self.host_views.clear()  # the hooks' lookups hold this dict: let the store's memory go

    def _undo_split(self) -> None:
        for module, _ in self._split:
            off = getattr(module, "disable_omni_model_cpu_offload", None)
            if callable(off):
                off()
        self._split.clear()

    def _check_live(self) -> None:
        if self._disabled:
            raise RuntimeError("this module offload was disabled")

    @property
    def disabled(self) -> bool:
        return self._disabled

    def __repr__(self) -> str:
        if self._disabled:
            return f"ModuleOffload({self.components.pipeline}, disabled)"
        lines = [
            f"ModuleOffload({self.components.pipeline}, device={self.device}, "
            f"components={list(self.config.components)}, source={self.components.source!r}, "
            f"host={self._host_bytes() / 1e9:.3f} GB, pinned={self._pinned_bytes() / 1e9:.3f} GB,"
            + ("" if self.coded is None else f" coded {self.config.weight_codec},"),
            f"  on_device={list(self.on_device())}, transitions={self._transitions}, "
            f"h2d={self._h2d_bytes / 1e9:.3f} GB,",
            "  hooks=[",
        ]
        lines += [f"    {h!r}," for h in self.hooks]
        lines += [f"    {h!r}," for h in self.state_dict_hooks]
        lines.append("  ],")
        if self._resident_only:
            lines.append(f"  resident={list(self._resident_only)},")
        lines.append(")")
        return "\n".join(lines)


def offload_pipeline(pipe: Any, config: Any = None, *, device=None) -> ModuleOffload:
    """Offload a pipeline's components; returns the handle (:class:`ModuleOffload`).

    ``pipe``: any object holding its components as attributes (a diffusers
    pipeline, an ``nn.Module`` pipeline, a plain object). ``config``: an
    :class:`OffloadConfig`, a dict or JSON string in the
    ``diffusion_offload_config`` schema, or None (module mode over dit and
    text_encoder). ``{"enable_cpu_offload": True}`` is the compatibility
    spelling of that. ``device``: where components run (default CUDA if
    available, else CPU; CPU runs the same mechanism).

    ``mode="layer"`` replaces each selected DiT (and text encoder) on the
    pipeline by an :class:`weightstream.OffloadedTransformer` and returns a
    :class:`weightstream.offload.pipeline.LayerwisePipelineOffload`.
    """
    cfg = OffloadConfig.module() if config is None else OffloadConfig.coerce(config)
    dev = resolve_device(device)
    components = discover_components(pipe)
    if cfg.mode == "layer":
        from .pipeline import LayerwisePipelineOffload

        return LayerwisePipelineOffload(pipe, cfg, dev, components)
    return ModuleOffload(pipe, cfg, dev, components)
