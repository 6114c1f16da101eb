"""StreamedBlocks: the layerwise machinery for one DiT (blocks, host store,
executor), and what every front end shares: device resolution, the wrap-time
checks, the state-dict hook that serves host weights, failure explanations.

Every front end builds it through :mod:`.build` for one cell of the support matrix
(:mod:`.sources.select`); it imports none of them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Mapping

import torch
from torch import nn

from .config import OffloadConfig
from .discovery import Block, OffloadPlan, discover_blocks
from .executor import LayerwiseExecutor
from .hooks import RemovableHooks
from .sources.base import check_stats
from .sources.pinned import SourceRequest
from .sources.select import Selection, check_quantized
from .adapters import AdapterWatch, dora_read_error, merge_note, streamable_tensors
from .host.quantized import (
    check_update, expand, host_form, parts_of, prepare, quantized_format, rehome, split_update, streams, unhome,
)
from .layout import all_tensors, build_layout, check_not_shared, tensor_bytes
from .misuse import (
    OffloadMisuseError, StreamedModuleAccessError, WeightUpdateError,
)
from .ownership import Ownership
from .progress import format_bytes
from .wrap_checks import check_wrappable
from .placeholders import Placeholders
from .schedule import Schedule


def resolve_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} asks for CUDA, but torch.cuda.is_available() is False")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported; use 'cpu' or 'cuda[:N]'")
    return dev


class StreamedBlocks:
    """The layerwise machinery for one DiT: blocks, schedule, weight source, executor.

    ``selection``: its cell of the support matrix. ``source``: a factory ``SourceRequest ->
    WeightSource`` (:func:`~.build.streamed_blocks` passes pinned host images by default), run
    before anything is packed, so it may refuse (DLO's setup agreement). ``guard``: DLO failure policy (:mod:`.dlo.guard`).
    """

    # graph_boundary_loads='auto' picks 'next-step' (Schedule.defer_last) when True
    supports_next_step = True
    # stream/event backend handed to the executor (streams.py); None: the device's default
    streams = None
    executor_cls = LayerwiseExecutor  # tests substitute mutants (tests/test_happens_before.py)

    def __init__(self, module: nn.Module, config: OffloadConfig, device: torch.device, plan: OffloadPlan | None,
                 *, selection: Selection, source, guard=None, prime: str = "now", next_step: bool = True):
        """Built by :func:`~.build.streamed_blocks` only: ``selection`` is the supported cell of the
        support matrix, ``source`` its transport's factory ``SourceRequest -> WeightSource``."""
        t0 = time.perf_counter()
        check_wrappable(module, allow_meta=True)  # sources that bind checkpoints start from meta
        self.module, self.config, self.device = module, config, device
        self.selection = selection
        self.supports_next_step = self.supports_next_step and next_step
        self.quantized = quantized_format(module)  # streamed as it is (host/quantized.py)
        check_quantized(self.quantized, self.selection.transport)
        prepare(module, self.quantized, device)  # a format's own state before the layouts (host/bnb.py)
        self.blocks: list[Block] = discover_blocks(module, plan)
        resident = config.resident_layers
        self.auto = self.selection.residency == "auto"  # given or the planned default: plan/auto.py plans it
        if self.auto:
            resident = 0
            if device.type != "cuda" and config.device_memory_budget_gb is None:
                raise ValueError(
                    "layer_options.dit.resident_layers='auto' on the CPU needs device_memory_budget_gb (the "
                    "planner's budget; on CUDA it defaults to the free device memory less a margin)")
        n = len(self.blocks)
        bad = [i for i in ((resident,) if isinstance(resident, int) else resident) if i >= n] \
            if not isinstance(resident, int) else ([resident] if resident >= n else [])
        if bad or (not isinstance(resident, int) and len(set(resident)) >= n):
            raise ValueError(
                f"layer_options.dit.resident_layers={config.resident_layers!r} leaves no block to stream or names "
                f"a block that does not exist: {type(module).__name__} has {n} blocks; allowed: an int "
                f"0..{n - 1}, or indices in 0..{n - 1} that leave at least one block streamed"
            )
        self.schedule = self._schedule(n, resident)
        check_not_shared(self.blocks, module)
        streamed = [self.blocks[i] for i in self.schedule.streamed]
        tensors = [streamable_tensors(b.module) for b in streamed]  # adapters (peft) stay resident
        layouts = [build_layout(b.index, b.name, ts) for b, ts in zip(streamed, tensors)]
        streamed_ids = {id(t) for ts in tensors for _, _, t in ts}
        rest = [t for t in all_tensors(module) if id(t) not in streamed_ids]
        self.resident_bytes = sum(tensor_bytes(t) for t in rest)
        slot_total = self.schedule.ring_slots * max(lay.nbytes for lay in layouts)
        budget = config.device_memory_budget_bytes
        if budget is not None and self.resident_bytes + slot_total > budget:
            raise ValueError(
                f"device_memory_budget_gb={config.device_memory_budget_gb} is too small ({format_bytes(budget)}): "
                f"resident modules need {format_bytes(self.resident_bytes)} and {self.schedule.ring_slots} slots "
                f"{format_bytes(slot_total)}; raise the budget or lower num_slots/resident_layers"
            )
        self.tensors = tensors
        codec = self.selection.codec
        req = SourceRequest(config, device, streamed, tensors, layouts, self.schedule, codec=codec)
        moved = rehome(module, device)  # tensor subclasses claim the device their inner tensors stream to
        try:
            self.source = source(req)
        except BaseException:
            unhome(moved)  # the source gave the inner tensors their weights back
            raise
        self.selection = self.selection.for_source(self.source.caps)  # a given raw source stays raw by default
        codec = self.selection.codec
        self.layouts = self.source.layouts
        with torch.no_grad():
            for t in rest:
                if t.device != device:
                    t.data = t.data.to(device)
        # id(tensor object) -> its host view, for state_dict() and weight updates
        self.host_views = self.source.host_views()
        self._where = {id(t): (k, i) for k, ts in enumerate(tensors) for i, (_, _, t) in enumerate(ts)}
        self.guard = guard
        self.ownership = Ownership()  # one thread at a time, across executor rebuilds (auto placement)
        self.ownership.add_entries(self, module)
        self.placeholders = Placeholders(device, self._read_tensor, self._write_tensor, explain=lambda t, what:
                                         dora_read_error(module, t, what, self.placeholders.name(t)))
        for k, ts in enumerate(tensors):
            for (_, _, t), spec in zip(ts, self.layouts[k].tensors):
                self.placeholders.register(t, self.layouts[k].name, spec.name, spec.shape, spec.stride, spec.dtype)
        self.executor = self._new_executor(self.schedule, prime)
        self.executor.attach_root(module)
        self.adapters = AdapterWatch(module, device)  # peft adapters: on the device; graphs key (adapters.py)
        self._root_hooks: list = [self.adapters]
        self._forward_end: list[ForwardEndHook] = []
        self._stats_extra: list = [self.adapters.stats]
        self.auto_step = self.placement = self.codec_planner = None
        if self.auto or codec == "auto":  # measure a step, plan, apply (plan/auto.py)
            from weightstream.offload.plan.auto import AutoStep

            self.auto_step = AutoStep(self, residency=self.auto, codec=codec == "auto", default=self.selection.planned,
                                      gather=self.source.caps.collective)  # DLO AllGather: the ranks plan together
            self.placement, self.codec_planner = self.auto_step.residency, self.auto_step.codec
            self._root_hooks.append(self.auto_step)
            self._stats_extra.append(self.auto_step.stats)
        self.setup_s = time.perf_counter() - t0

    def _schedule(self, num_blocks: int, resident: int) -> Schedule:
        """The ring; CUDA graphs change where a step's boundary loads are issued
        (a graph waits for every copy it holds, see Schedule): with resident
        blocks every load stays in its step and the first ones hide behind the
        resident blocks; without, the load waiting for the last block stays at
        the graph's end ('in-graph') or starts the next step's graph
        ('next-step'; 'auto' where the streamed blocks support it)."""
        cfg = self.config
        graphs = cfg.cuda_graphs == "on"
        next_step = cfg.graph_boundary_loads == "next-step" or (
            cfg.graph_boundary_loads == "auto" and self.supports_next_step)
        has_resident = bool(resident)  # an int > 0 or a non-empty set of blocks
        return Schedule(
            num_blocks, resident, cfg.num_slots,
            step_local=graphs and has_resident,
            defer_last=graphs and not has_resident and next_step,
        )

    def rebuild_executor(self, resident, num_slots: int) -> None:
        """A new ring over the same source: ``resident`` blocks (their tensors already
        on the device) stay out of it, ``num_slots`` slots (auto placement, between steps)."""
        self.executor.remove()
        schedule = dataclasses.replace(self._schedule(len(self.blocks), resident), num_slots=num_slots)
        self.schedule = schedule
        self.executor = self._new_executor(schedule, "now")
        self.executor.attach_root(self.module)

    def _new_executor(self, schedule: Schedule, prime: str) -> LayerwiseExecutor:
        return self.executor_cls(self.blocks, self.source, schedule, self.device,
                                 record_events=self.config.record_events, prime=prime, streams=self.streams,
                                 guard=self.guard, ownership=self.ownership, placeholders=self.placeholders)

    def held(self, what: str):
        """Context: the model held by this thread for ``what`` (an update, disable()):
        ConcurrentUseError while another thread runs a forward or another such call."""
        return _Held(self.ownership, what)

    # -- .data of an unbound streamed tensor (placeholders.py) --------------------------------
    def _read_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of ``t``'s current weights (its host view)."""
        with self.held(f"reading .data of {self.placeholders.name(t)!r}"), merge_note(self.module, t):
            return host_form(t, self.host_views).to(self.device, copy=True)  # a GGUF weight stays one

    def _write_tensor(self, t: torch.Tensor, value) -> None:
        """``t.data = value`` (or an edited ``.data`` copy): an update of that one tensor
        (found by identity: adapters injected since may have renamed its key)."""
        name = self.placeholders.name(t)
        with self.held(f"writing .data of {name!r}"), merge_note(self.module, t):
            self.executor.check_usable(f"writing .data of {name!r}")
            self._apply(self._plan_one(name, t, value))

    def add_stats(self, fn) -> None:
        """A front end's extra stats() keys (``fn() -> dict``)."""
        self._stats_extra.append(fn)

    def add_root_hook(self, handle) -> None:
        """A front end's hook on the DiT (DLO's forward checks); removed by restore()."""
        self._root_hooks.append(handle)

    def add_forward_end(self, name: str, fn) -> None:
        """Run ``fn(exc)`` once at the end of every forward of the DiT, ``exc`` the exception
        that ended it or None. torch runs ``always_call`` hooks for ``Exception`` only: for any
        other ``BaseException`` (KeyboardInterrupt, SystemExit, a cancellation) the front end
        calls :meth:`forward_aborted`, so ``fn`` sees every way a forward can end."""
        hook = ForwardEndHook(name, self.module, fn)
        self._forward_end.append(hook)
        self._root_hooks.append(hook)

    def forward_aborted(self, exc: BaseException) -> None:
        """A forward ended with ``exc``, a ``BaseException`` that is not an ``Exception``
        (torch skipped its ``always_call`` hooks): run the end-of-forward handlers with it."""
        for hook in list(self._forward_end):
            if not hook.removed:
                hook.end(exc)

    @property
    def usable(self) -> bool:
        return self.executor.failure is None

    def stats(self) -> dict:
        s = self.schedule
        # the source holds every block it was built with; blocks the placement made resident since
        # (resident_layers="auto") move nothing per step
        kept = set(s.resident_blocks)
        placed = [k for k, lay in enumerate(self.layouts) if lay.index in kept]
        out = {
            "blocks_streamed": s.n, "blocks_resident": s.num_resident, "resident_blocks": list(s.resident_blocks),
            "num_slots": s.ring_slots,
            "streamed_bytes_per_step": sum(lay.nbytes for lay in self.layouts) - sum(self.layouts[k].nbytes for k in placed),
            "resident_bytes": self.resident_bytes + sum(self.layouts[k].nbytes for k in placed),
            "setup_s": self.setup_s, "device": str(self.device), "quantized_format": self.quantized,
        }
        out.update(check_stats(self.source.stats()))
        out["h2d_bytes_per_step"] -= sum(self.source.link_bytes(k) for k in placed)
        out["slot_bytes"] = s.ring_slots * self.executor.slot_bytes  # all slots together (as before)
        for fn in self._stats_extra:
            out.update(fn())
        return out

    def _current_for_update(self, state_dict: Mapping[str, torch.Tensor], strict: bool) -> dict:
        """The module's tensors by key, after checking ``state_dict``'s keys against them."""
        if not isinstance(state_dict, Mapping):
            raise WeightUpdateError(
                f"update_weights: state_dict is a {type(state_dict).__name__}; pass a mapping of key -> tensor")
        current = self.module.state_dict(keep_vars=True)
        unknown = [k for k in state_dict if k not in current]
        if unknown:
            raise WeightUpdateError(
                f"update_weights: unknown keys {unknown[:5]}{'...' if len(unknown) > 5 else ''}; nothing was "
                f"written. Keys are the wrapped model's state_dict() keys, e.g. {next(iter(current), None)!r}")
        if strict:
            missing = [k for k in current if k not in state_dict]
            if missing:
                raise WeightUpdateError(
                    f"update_weights(strict=True): missing keys {missing[:5]}; nothing was written. "
                    "Pass every key, or strict=False")
        return current

    def _plan_update(self, state_dict: Mapping[str, torch.Tensor], strict: bool) -> list:
        """(key, where, new value) for every key, each checked (name, type, shape, dtype)
        before anything is written: an update applies whole or not at all. ``where`` is
        (block, tensor index) for a streamed tensor, else the resident tensor's data."""
        current = self._current_for_update(state_dict, strict)
        plan = []
        for key, new in state_dict.items():
            plan += self._plan_one(key, current[key], new)
        return plan

    def _plan_one(self, key: str, obj: torch.Tensor, new) -> list:
        parts = split_update(key, obj, new)  # a tensor subclass: its inner tensors (host/quantized.py)
        if parts is not None:
            return [(key, dst, v) for name, inner, value in parts for _, dst, v in self._plan_one(name, inner, value)]
        loc = self._where.get(id(obj))
        if loc is None:
            check_update(key, obj, new)  # first: bitsandbytes' serialised quant state names itself (host/bnb.py)
            check_update_value(key, new, tuple(obj.shape), obj.dtype)
            return [(key, obj.data, new)]
        spec = self.layouts[loc[0]].tensors[loc[1]]
        check_update_value(key, new, spec.shape, spec.dtype)
        check_update(key, obj, new)  # a quantized tensor's bytes mean the same in the new value
        self.source.check_write(*loc)  # a read-only source refuses here, before any write
        if self.placement is not None and id(obj) in self.placement.resident_tensors():
            return [(key, loc, new), (key, obj.data, new)]  # resident under auto placement: its device copy too
        return [(key, loc, new)]

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = False) -> list[str]:
        """Write new weights: streamed tensors through the source, others in place.

        Atomic: every key is checked (name, shape, dtype) before the first
        write; a rejected update raises :class:`WeightUpdateError` and writes
        nothing. Waits for in-flight copies first (not a hot-path call), then
        reloads the slots already prefetched for the next step, so the very
        next forward uses the new weights under every schedule (under DLO
        AllGather a collective: call it on every rank with the same weights).
        Returns the keys written.
        """
        with self.held("update_weights()"):
            self.executor.check_usable("update_weights()")
            return self._apply(self._plan_update(state_dict, strict))

    def _apply(self, plan: list) -> list[str]:
        if self.guard is not None:  # DLO AllGather: a write on some ranks only is caught at the next step
            self.guard.agree_update([(key, new) for key, _, new in plan])
        if self.placement is not None:
            self.placement.sync()  # device edits of resident blocks first: the snapshot below would hide them
        self.executor.synchronize()
        try:
            with torch.no_grad():
                for _, dst, new in plan:
                    if isinstance(dst, tuple):
                        self.source.write(dst[0], dst[1], new)
                    else:
                        dst.copy_(new)
        finally:
            # slots prefetched before the update hold old weights (also after a
            # write that failed part-way, e.g. out of memory moving ``new``)
            self.executor.reload_pending()
            if self.placement is not None:
                self.placement.snapshot()  # host images and resident device copies were written alike
        return list(dict.fromkeys(key for key, _, _ in plan))

    def flush_edits(self) -> None:
        """Before any read of the host store (state_dict(), restore): write the ``.data``
        copies of unbound tensors edited in place, and the device edits of blocks resident
        under auto placement."""
        if self.placeholders.handed:
            self.placeholders.flush()
        if self.placement is not None:
            self.placement.sync()

    def _images(self) -> list[torch.Tensor]:
        self.executor.synchronize()
        return [self.source.image(k) for k in range(len(self.layouts))]

    def restore(self) -> nn.Module:
        """Give every streamed tensor a device copy of its weights; tear down.

        One block image at a time after the slots are freed (device memory peaks at the
        model plus one block image). Under DLO AllGather every block is gathered (a
        collective) before any tensor changes, so a failure part-way leaves everything
        as it was on every rank."""
        with self.held("disable() / remove()"):
            return self._restore()

    def _restore(self) -> nn.Module:
        self.source.check()  # a changed checkpoint refuses before anything is torn down
        self.flush_edits()
        images = self._images() if self.source.caps.collective else None
        keep = self.placement.resident_tensors() if self.placement is not None else set()
        for h in self._root_hooks:
            h.remove()
        self._root_hooks = []
        self.executor.remove()
        with torch.no_grad():
            for k, ts in enumerate(self.tensors):
                if all(id(t) in keep for _, _, t in ts):
                    continue  # resident under auto placement: its device tensors already
                image = images[k] if images is not None else self.source.image(k)
                for (_, _, t), spec in zip(ts, self.layouts[k].tensors):
                    if id(t) not in keep:
                        t.data = spec.view_of(image).clone()
                del image
                if images is not None:
                    images[k] = None
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.source.close()
        self.host_views.clear()
        return self.module

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict on CPU. Under DLO AllGather a collective (call on every
        rank of the sharding group); it raises after a failure and names local_state_dict()."""
        names = self.module.state_dict(keep_vars=True)
        images = None
        out = {}
        for name, t in names.items():
            parts = parts_of(t)  # a tensor subclass: its inner tensors (host/quantized.py)
            if any(id(v) not in self._where for _, v in parts):
                out[name] = t.detach().to("cpu", copy=True)
                continue
            if images is None:
                if self.source.caps.sharded:
                    self.source.ready_to_gather("gather_state_dict()")
                images = self._images()
            views = {id(v): self.layouts[k].tensors[i].view_of(images[k])
                     for _, v in parts for k, i in [self._where[id(v)]]}
            out[name] = host_form(t, views).to("cpu", copy=True)
        return out

    def local_state_dict(self) -> dict:
        """This rank's weights with no collective (usable after any failure).

        Non-streamed tensors as in ``state_dict()``; streamed ones as the source
        holds them: under DLO AllGather a tensor wholly in this rank's share is a
        CPU tensor, any other a :class:`ShardPiece` with the bytes this rank has
        (``merge_shards`` of every rank's result is the full state dict; a tensor
        subclass comes as its inner tensors, keys ``key[qdata]``, ...)."""
        sharded = self.source.caps.sharded
        out = {}
        # resident tensors are read on a stream of their own: after a timed-out
        # gather the compute stream may wait forever on the stuck collective
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for name, t in self.module.state_dict(keep_vars=True).items():
                parts = parts_of(t)  # a tensor subclass: a piece per inner tensor, named key[inner]
                if any(id(v) not in self._where for _, v in parts):
                    out[name] = t.detach().to("cpu", copy=True)
                elif sharded:
                    for suffix, v in parts:
                        out[name + suffix] = self.source.local_piece(name + suffix, *self._where[id(v)])
                else:
                    out[name] = host_form(t, self.host_views).to("cpu", copy=True)
        return out


def check_update_value(key: str, new, shape: tuple, dtype: torch.dtype) -> None:
    """Raise WeightUpdateError unless ``new`` is a tensor of ``shape`` and ``dtype``."""
    if not isinstance(new, torch.Tensor):
        raise WeightUpdateError(
            f"update_weights: {key!r} is a {type(new).__name__}, not a Tensor; nothing was written. "
            f"Pass a {dtype} tensor of shape {shape}")
    if new.device.type == "meta":
        raise WeightUpdateError(
            f"update_weights: {key!r} is a meta tensor (no data: e.g. built under init_empty_weights or "
            "device='meta'); nothing was written. Pass a tensor with real values (load it first)")
    if tuple(new.shape) != shape or new.dtype != dtype:
        raise WeightUpdateError(
            f"update_weights: {key!r} is {new.dtype} {tuple(new.shape)}, the model has {dtype} {shape}; "
            "nothing was written. Cast/reshape the new value, or rebuild the offloaded model for a new architecture")


def explain_failure(exc: BaseException, streamed: "StreamedBlocks") -> StreamedModuleAccessError | None:
    """After a failed forward: if a submodule of a streamed block ran while its block
    was not bound (the model reads it outside the block's forward), the named error
    saying which block to keep resident; else None. Walks the traceback only on
    failure, so the hot path pays nothing."""
    if isinstance(exc, OffloadMisuseError):
        return None  # already named
    ex = streamed.executor
    owner = {}
    for i in ex.schedule.streamed:
        b = streamed.blocks[i]
        for sub_name, sub in b.module.named_modules():
            owner[id(sub)] = (ex.k_of[i], b.name, f"{b.name}.{sub_name}" if sub_name else b.name)
    found = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        hit = owner.get(id(frame.f_locals.get("self"))) if frame.f_code.co_name == "forward" else None
        if hit is not None and hit[0] != ex.bindings.bound:
            found = hit  # keep the innermost
        tb = tb.tb_next
    if found is None:
        return None
    _, block, sub = found
    return StreamedModuleAccessError(
        f"{sub} (part of the streamed block {block!r}) ran outside {block!r}'s own forward, when its "
        f"weights are not on the device (the model reads it directly, e.g. a DiT that calls "
        f"transformer_blocks[0].norm1.emb after the block loop); this failed with {type(exc).__name__}: "
        f"{str(exc)[:200]}. Keep {block!r} resident: layer_options.dit.resident_layers (it must then be "
        "among the first blocks) or an OffloadPlan whose containers leave it out"
    )


class _Held:
    """``with`` a model held (see :meth:`StreamedBlocks.held`); released whatever ends the block."""

    def __init__(self, ownership: Ownership, what: str):
        self.ownership, self.what = ownership, what

    def __enter__(self):
        self.depth = self.ownership.acquire(self.what)
        return self

    def __exit__(self, *exc) -> None:
        self.ownership.release_to(self.depth)


class ForwardEndHook(RemovableHooks):
    """Named, removable ``always_call`` forward hook on the DiT: ``fn(exc)`` at the end of
    every forward (``exc``: the exception it raised, or None); see
    :meth:`StreamedBlocks.add_forward_end`."""

    def __init__(self, name: str, module: nn.Module, fn):
        self.name, self.fn = name, fn
        self.armed = False  # a forward began and its end has not run yet
        self._handles = [module.register_forward_pre_hook(self.pre_forward),
                         module.register_forward_hook(self, always_call=True)]

    def pre_forward(self, module, args) -> None:
        self.armed = True

    def __call__(self, module, args, output) -> None:
        self.end(sys.exc_info()[1])

    def end(self, exc: BaseException | None) -> None:
        """``fn(exc)`` once per forward (torch's hook, or the front end's forward_aborted)."""
        if self.armed:
            self.armed = False
            self.fn(exc)

    def __repr__(self) -> str:
        return f"ForwardEndHook({self.name}, {self.state})"


class HostStateDictHook:
    """Named, removable ``state_dict`` post-hook: offloaded tensors read from their host owner.

    Installed on the module whose tensors are offloaded (the wrapped DiT, each
    module-offloaded component), so every path that reaches its
    ``state_dict()`` (its own, a parent module's, diffusers ``save_pretrained``,
    ``torch.save``, peft, accelerate) sees the real weights, never the empty
    placeholders that stand in between forwards. Entries become the host
    views themselves (zero-copy). ``keep_vars=True`` entries are the live
    tensor objects and stay as they are (update paths look tensors up by
    identity). ``lookup(tensor)`` gives the host view, None to leave the entry,
    or raises (a DLO AllGather rank holds no tensor whole).
    """

    def __init__(self, name: str, module: nn.Module, lookup, offloaded, before=None):
        self.name = name
        self._lookup = lookup
        self._before = before  # called once per state_dict() before any lookup (pending edits written)
        self._offloaded, self._module = offloaded, module
        self._handle = module.register_state_dict_post_hook(self)

    @property
    def _keys(self) -> dict:  # key -> offloaded tensor (tied ones under each key); per call: peft renames keys
        m = self._module
        named = list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False))
        out = {k: t for k, t in named if t is not None and self._offloaded(t)}
        for k, t in named:  # a format's tensors beside a weight, under the keys it serialises them (host/bnb.py)
            out.update((n, p) for n, _, p in expand(k, "", t) if n not in out and p is not t and self._offloaded(p))
        return out

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        if self._before is not None:
            self._before()
        for key, t in self._keys.items():
            v = state_dict.get(prefix + key)
            if v is None or v is t:
                continue  # not in this dict, or keep_vars=True: the live tensor object
            hv = self._lookup(t)
            if hv is not None:
                state_dict[prefix + key] = hv

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def removed(self) -> bool:
        return self._handle is None

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return f"HostStateDictHook({self.name}, {len(self._keys)} offloaded tensors, {state})"


def install_state_dict_hook(module: nn.Module, streamed: StreamedBlocks) -> HostStateDictHook:
    """The hook that makes ``module.state_dict()`` read streamed tensors from ``streamed``'s host store."""
    views = streamed.host_views
    return HostStateDictHook(
        f"weightstream.state_dict[{type(module).__name__}]", module,
        lookup=lambda t: host_form(t, views), offloaded=lambda t: streams(t, views), before=streamed.flush_edits,
    )
