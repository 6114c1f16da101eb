"""OffloadedTransformer (the drop-in wrapper) and apply_layerwise_offload (the
in-place mode that keeps the model's class), both over :class:`StreamedBlocks`."""
from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from .casts import APPLY_CALLS, CastGuard, check_to
from .config import OffloadConfig
from .config_schema import CONFIG_FIELDS_HINT, unknown_keyword
from .discovery import OffloadPlan
from .distributed import build_streamed
from weightstream.offload.executor import LayerwiseExecutor
from weightstream.offload.hooks import StepHook
from .misuse import OffloadDisabledError, UnsupportedOperationError
from .tracing import not_traced
from .build import streamed_blocks
from .host.quantized import host_form, streams
from .load_hook import HostLoadHook, WrapperKeys
from .streamed import (
    StreamedBlocks, explain_failure, install_state_dict_hook, resolve_device,
)
from .wrap_checks import check_wrappable

def layer_config(config, who: str) -> OffloadConfig:
    """``config`` as an OffloadConfig for streaming one DiT (layer mode, 'dit' selected)."""
    cfg = OffloadConfig.coerce(config)
    if cfg.mode != "layer":
        raise ValueError(
            f"mode={cfg.mode!r} is not allowed for {who}; choose from: layer "
            "(module mode swaps whole components: use offload_pipeline)"
        )
    if "dit" not in cfg.components:
        raise ValueError(f"components={list(cfg.components)!r} does not select 'dit'; {who} streams a DiT")
    return cfg


def build_streamed_blocks(module: nn.Module, cfg: OffloadConfig, device: torch.device, plan, parallel,
                          streamed: StreamedBlocks | None) -> StreamedBlocks:
    """The streaming machinery over ``module``: given, DLO (``parallel``), or the host store."""
    if streamed is not None:
        # machinery built elsewhere over this module (e.g. the safetensors mmap source)
        if parallel is not None or streamed.module is not module:
            raise ValueError("streamed= must be built over this module, and excludes parallel=")
        return streamed
    if parallel is not None:
        # distributed layerwise offload (DLO) over an existing torch.distributed topology
        return build_streamed(module, cfg, device, plan, parallel)
    if cfg.weight_transfer == "allgather":
        raise ValueError(
            "layer_options.dit.weight_transfer='allgather' needs a process group: pass "
            "parallel=ParallelConfig(...) (DLO); allowed without one: rank-local or unset"
        )
    return streamed_blocks(module, cfg, device, plan)  # the one builder (build.py), select()'s cell


class GraphForward:
    """Instance-level ``forward`` of a module offloaded in place with
    ``cuda_graphs='on'``: a call of the module goes to the GraphRunner (capture,
    replay, eager), whose own calls of the module reach the class's forward.

    Set on the instance by :class:`LayerwiseOffloadHandle` (``module.forward``,
    never the class) and deleted by its ``remove()``. The module's own hooks run
    around both calls; the DiT's step hook does its step work only in the
    runner's call (``inner``), since a replay runs no hooks.
    """

    def __init__(self, module: nn.Module, streamed: StreamedBlocks, config: OffloadConfig):
        from weightstream.graphs.runner import GraphRunner

        self.module, self.streamed = module, streamed
        self.name = f"weightstream.graph_forward[{type(module).__name__}]"
        self.inner = False
        self.runner = GraphRunner(self.call_module, streamed.executor, config, adapters=streamed.adapters.key)
        # diffusers pipelines read inspect.signature(transformer.forward).parameters
        self.__signature__ = inspect.signature(type(module).forward.__get__(module))

    def call_module(self, *args, **kwargs):
        """The runner's call of the module: hooks, then the class's forward."""
        self.inner = True
        try:
            return self.module(*args, **kwargs)
        finally:
            self.inner = False

    @not_traced  # hooks, stream events and graph launches drive the streaming; not traceable
    def __call__(self, *args, **kwargs):
        if self.inner:
            return type(self.module).forward(self.module, *args, **kwargs)
        try:
            return self.runner(args, kwargs)
        except Exception as e:
            named = explain_failure(e, self.streamed)
            if named is not None:
                raise named from e
            raise
        except BaseException as e:  # torch runs no always_call hook for it
            self.streamed.forward_aborted(e)
            raise

    def __repr__(self) -> str:
        return f"GraphForward({self.name}, graphs={len(self.runner.graphs)})"


class LayerwiseOffloadHandle:
    """Layerwise streaming installed on a module in place (its class is kept).

    Made by :func:`apply_layerwise_offload`. What it installs on the module, all
    named and removable: a pre/post hook per streamed block, a step hook on the
    module, a state_dict post-hook (``state_dict()`` / ``save_pretrained`` read
    the real weights from the host store), load_state_dict hooks (:class:`.load_hook.HostLoadHook`:
    ``load_state_dict`` writes the streamed keys into the host store) and, only with ``cuda_graphs='on'``,
    a :class:`GraphForward` as the instance's ``forward``. ``remove()`` takes
    all of it off and returns the module with every weight on the device.
    ``intercept=False`` (what :class:`OffloadedTransformer` uses, whose own
    forward calls the runner) installs no forward override.
    """

    def __init__(self, module: nn.Module, config=None, *, device=None, plan: OffloadPlan | None = None,
                 parallel=None, streamed: StreamedBlocks | None = None, intercept: bool = True,
                 who: str = "apply_layerwise_offload"):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if streamed is None:  # before any tensor moves
            check_wrappable(module)
        self.config = layer_config(config, who)
        self.module = module
        self.device = resolve_device(device)
        self.streamed = build_streamed_blocks(module, self.config, self.device, plan, parallel, streamed)
        self.graphs = self.forward_override = None
        if self.config.cuda_graphs == "on":
            try:
                self._graph_runner(intercept)
            except BaseException:
                self.streamed.restore()  # nothing lost: the module gets its weights back
                raise
        self.state_dict_hook = install_state_dict_hook(module, self.streamed)
        views = self.streamed.host_views
        self.load_hook = HostLoadHook(f"weightstream.load_state_dict[{type(module).__name__}]", module,
                                      self.streamed.update_weights, lambda t: streams(t, views))
        # in place, casts and moves are the module's own: a guard on the instance (the wrapper has its own)
        undo = "handle.disable()" if who == "offload_pipeline" else "handle.remove()"
        self.cast_guard = CastGuard(module, self.device, who, undo) if intercept else None
        self.removed = False

    def _graph_runner(self, intercept: bool) -> None:
        if not intercept:
            from weightstream.graphs.runner import GraphRunner

            self.graphs = GraphRunner(self.module, self.streamed.executor, self.config,
                                      adapters=self.streamed.adapters.key)
            return
        override = GraphForward(self.module, self.streamed, self.config)
        self.graphs, self.forward_override = override.runner, override
        for h in self.streamed.executor.hooks:
            if isinstance(h, StepHook):
                h.entry = override
        self.module.forward = override  # the instance only; the class is untouched

    @property
    def executor(self) -> LayerwiseExecutor:
        return self.streamed.executor

    def _check_live(self) -> None:
        if self.removed:
            raise OffloadDisabledError("this layerwise offload was removed; the module runs as a plain module: "
                                       "offload it again to stream it")

    def stats(self) -> dict:
        self._check_live()
        return self.streamed.stats()

    def events(self) -> list[dict]:
        """Per-block copy/compute intervals (needs ``record_events=True``); synchronises."""
        self._check_live()
        return self.streamed.executor.events()

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = False) -> list[str]:
        """As :meth:`OffloadedTransformer.update_weights`."""
        self._check_live()
        return self.streamed.update_weights(state_dict, strict=strict)

    def remove(self) -> nn.Module:
        """Stop streaming: every weight back on the device, hooks and the forward
        override removed; returns the (same) plain module."""
        self._check_live()
        with self.streamed.held("remove() / disable()"):  # nothing changes while another thread is inside
            if self.forward_override is not None:
                del self.module.__dict__["forward"]
                self.forward_override = None
            if self.graphs is not None:
                self.graphs.release()
                self.graphs = None
            if self.cast_guard is not None:
                self.cast_guard.remove()
                self.cast_guard = None
            module = self.streamed.restore()
            self.state_dict_hook.remove()
            self.load_hook.remove()
            self.removed = True
        return module

    def __repr__(self) -> str:
        if self.removed:
            return f"LayerwiseOffloadHandle({type(self.module).__name__}, removed)"
        s = self.streamed.stats()
        parts = [f"streamed={s['blocks_streamed']}", f"resident_blocks={s['blocks_resident']}",
                 f"slots={s['num_slots']}", f"device={s['device']}", repr(self.state_dict_hook), repr(self.load_hook)]
        if self.forward_override is not None:
            parts.append(f"forward={self.forward_override!r}")
        return f"LayerwiseOffloadHandle({type(self.module).__name__}, {', '.join(parts)})"


def apply_layerwise_offload(module: nn.Module, config=None, *, device=None,
                            plan: OffloadPlan | None = None, **unknown) -> LayerwiseOffloadHandle:
    """Stream ``module``'s blocks in place: the module keeps its class and object
    (``isinstance`` checks, ``save_pretrained``, pipelines see it unchanged).

    ``config``: as for :class:`OffloadedTransformer` (layer mode over the DiT).
    Returns the handle; ``handle.remove()`` gives back the plain module with every
    weight on the device. With ``cuda_graphs='on'`` the handle sets the
    instance's ``forward`` to a :class:`GraphForward` (removed by ``remove()``).
    As with the wrapper, a cast or move of the module (``.to(dtype)``, ``.half()``,
    ``.to("cuda")`` from the CPU) is an :class:`UnsupportedOperationError`, and a
    ``.to()`` that changes nothing is a no-op (a :class:`~.casts.CastGuard` on the
    instance, removed by ``remove()``).
    """
    _refuse_keywords("apply_layerwise_offload()", unknown, APPLY_KEYWORDS)
    return LayerwiseOffloadHandle(module, config, device=device, plan=plan)


APPLY_KEYWORDS = ("config", "device", "plan")
WRAPPER_KEYWORDS = ("config", "device", "plan", "parallel", "streamed")


def _refuse_keywords(where: str, unknown: Mapping, allowed: tuple[str, ...]) -> None:
    """A typo'd keyword of an entry point: the named ConfigTypeError (a TypeError, as Python's own)
    naming it, the keywords allowed (the closest first) and where config fields go."""
    if unknown:
        raise unknown_keyword(where, next(iter(unknown)), allowed, tail=CONFIG_FIELDS_HINT)


class OffloadedTransformer(nn.Module):
    """Drop-in wrapper: same forward, same outputs, blocks streamed from host memory.

    ``config``: an :class:`OffloadConfig`, a dict, a JSON string or None
    (layer mode over the DiT). ``device``: where compute runs (default: CUDA
    if available, else CPU; the CPU path runs the same mechanism without
    streams). ``plan``: an :class:`OffloadPlan` naming the block containers.
    ``parallel``: a ``ParallelConfig`` for distributed layerwise offload (DLO).
    ``streamed``: streaming machinery already built over ``module`` (other
    weight sources, see :func:`weightstream.offload.checkpoint_offload.offload_from_safetensors`).
    """

    _weightstream_wrapper = True  # check_wrappable refuses to wrap one again

    def __init__(
        self,
        module: nn.Module,
        config=None,
        *,
        device=None,
        plan: OffloadPlan | None = None,
        parallel=None,
        streamed: StreamedBlocks | None = None,
        **unknown,
    ):
        super().__init__()
        _refuse_keywords("OffloadedTransformer()", unknown, WRAPPER_KEYWORDS)
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        # the wrapper's own forward intercepts calls: no forward override on the module
        handle = LayerwiseOffloadHandle(module, config, device=device, plan=plan, parallel=parallel,
                                        streamed=streamed, intercept=False, who="OffloadedTransformer")
        self.module = module
        self.__dict__["__module__"] = type(module).__module__  # with __class__: diffusers' component lookup
        self._handle = handle
        handle.streamed.ownership.add_entries(self)  # a graph replay holds the model from the wrapper's frame
        # not `.config`: that name passes through to the wrapped model (diffusers'
        # pipelines read transformer.config.in_channels and the like)
        self.offload_config = handle.config
        self._device = handle.device
        self._streamed = handle.streamed
        self._graphs = handle.graphs
        # on the wrapped module itself: save_pretrained and parents reach it without the wrapper
        self.state_dict_hook = handle.state_dict_hook
        self.load_keys = WrapperKeys("weightstream.load_state_dict[OffloadedTransformer]", self)  # a parent's load
        self._disabled = False

    @property
    def __class__(self):
        """The wrapped model's class, as a transparent proxy reports it (``type()`` is still
        OffloadedTransformer; ``isinstance`` sees both). With the instance's ``__module__``
        it is what diffusers reads of a pipeline component: ``pipe.transformer = wrapper``
        records the real class in ``model_index.json`` and ``pipe.save_pretrained`` calls
        the model's own ``save_pretrained``, which reads the real weights (state_dict hook)."""
        inner = (self.__dict__.get("_modules") or {}).get("module")
        return type(self) if inner is None else type(inner)

    def _get_name(self) -> str:  # the repr names the wrapper, not the __class__ above
        return "OffloadedTransformer"

    # attribute access passes through to the wrapped model (.config, .dtype, ...)
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if modules is None or "module" not in modules:
                raise
            return getattr(modules["module"], name)

    @not_traced  # hooks and stream events drive the streaming; not traceable
    def forward(self, *args, **kwargs):
        if self._disabled:
            raise OffloadDisabledError("this OffloadedTransformer was disabled; call the module disable() returned")
        sb = self._streamed
        depth = sb.ownership.acquire("a forward")  # ConcurrentUseError when another thread is inside
        try:
            if self._graphs is not None:
                return self._graphs(args, kwargs)
            return self.module(*args, **kwargs)
        except Exception as e:
            named = explain_failure(e, sb)
            if named is not None:
                raise named from e
            raise
        except BaseException as e:  # KeyboardInterrupt, SystemExit, a cancellation: torch ran no always_call hook
            sb.forward_aborted(e)
            raise
        finally:
            sb.ownership.release_to(depth)  # whatever hold a BaseException left inside

    # -- operations that would break streaming: refused with a named error ------
    def to(self, *args, **kwargs):
        """No-op when it changes nothing (pipelines call ``.to(device)`` on every
        component); a dtype, device or memory-format change is refused: it would
        reach the resident parts only, not the host store."""
        dtypes = lambda: {t.dtype for t in self.state_dict(keep_vars=True).values() if t.is_floating_point()}  # noqa: E731
        check_to(args, kwargs, self._device, dtypes, self._refuse)
        return self

    def _apply(self, fn, recurse=True):
        raise self._refuse(APPLY_CALLS)

    def _refuse(self, what: str) -> UnsupportedOperationError:
        return UnsupportedOperationError(
            f"{what} on an OffloadedTransformer is not supported: it would cast or move only the resident "
            "parts, not the host store of the streamed blocks, and the next forward would fail or mix "
            "dtypes. Cast/move the model before wrapping it (call disable() to get the plain module back, "
            "change it, wrap it again)"
        )

    def __reduce_ex__(self, protocol):
        raise UnsupportedOperationError(
            "an OffloadedTransformer cannot be pickled, deep-copied or torch.save()d: its streamed weights "
            "live in a host store and device slots that do not travel. Save the weights with "
            "torch.save(model.state_dict()) / save_pretrained, or disable() first and save the plain module"
        )

    def __deepcopy__(self, memo):
        self.__reduce_ex__(2)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped model's state dict; streamed weights are (CPU) views of the host store."""
        if not self._disabled:
            self._streamed.flush_edits()
        sd = self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=True)
        host = self._streamed.host_views if not self._disabled else {}
        for k, v in list(sd.items()):
            hv = host_form(v, host)  # a quantized tensor in its own form (host/quantized.py)
            if hv is not None:
                sd[k] = hv
            elif not keep_vars:
                sd[k] = v.detach()
        return sd

    def gather_state_dict(self) -> dict:
        """Full weights on the CPU. Under DLO AllGather each rank holds a 1/N share,
        so this is a collective (every rank calls it); otherwise it equals state_dict()."""
        self._check_live()
        return self._streamed.gather_state_dict() if self._streamed.source.caps.collective else self.state_dict()

    def local_state_dict(self) -> dict:
        """This rank's weights with no collective, usable after any DLO failure (DLO
        AllGather: tensors outside this rank's share are ``ShardPiece``s;
        ``weightstream.offload.distributed.merge_shards`` of every rank's result is
        the full state dict). Without DLO AllGather: ``state_dict()``."""
        self._check_live()
        return self._streamed.local_state_dict() if self._streamed.source.caps.sharded else self.state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict`` (through :meth:`update_weights`): ``strict=False``
        loads the keys the model has and reports the missing and unexpected ones."""
        if assign:
            raise ValueError("load_state_dict(assign=True) is not allowed on an OffloadedTransformer; use assign=False")
        if strict or not isinstance(state_dict, Mapping):
            self.update_weights(state_dict, strict=strict)
            return torch.nn.modules.module._IncompatibleKeys([], [])
        have = self.module.state_dict(keep_vars=True)
        self.update_weights({k: v for k, v in state_dict.items() if k in have}, strict=False)
        return torch.nn.modules.module._IncompatibleKeys(
            [k for k in have if k not in state_dict], [k for k in state_dict if k not in have])

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = False) -> list[str]:
        """Write new weights (streamed ones into the host store); the very next forward uses them.

        Atomic: every key, shape and dtype is checked first; a bad one raises
        :class:`WeightUpdateError` and nothing is written.

        Editing the tensors ``state_dict()`` returns in place through torch
        (``sd[k].mul_(0.5)``, ``sd[k].copy_(new)``, also under inference_mode)
        takes effect exactly like an update: those tensors are views of the host
        store, whose version counter the executor reads once per step, and the
        next step reloads any slot prefetched before the edit (with CUDA graphs
        too, no recapture). Not detected, so do not use them: writes that bypass
        torch's version counter (through numpy, ctypes, DLPack consumers, or the
        ``.data`` of a view), and edits made while a forward is still running on
        the device (synchronise first, as for any pinned source of async copies).
        Under the mmap and DLO AllGather sources streamed weights are not
        editable in place (see those sources)."""
        self._check_live()
        return self._streamed.update_weights(state_dict, strict=strict)

    def disable(self) -> nn.Module:
        """Stop streaming: every weight back on the device, hooks removed; returns the plain module."""
        self._check_live()
        module = self._handle.remove()
        self.load_keys.remove()
        self._graphs = None
        self._disabled = True
        return module

    def stats(self) -> dict:
        self._check_live()
        return self._streamed.stats()

    def events(self) -> list[dict]:
        """Per-block copy/compute intervals (needs ``record_events=True``); synchronises."""
        self._check_live()
        return self._streamed.executor.events()

    @property
    def graphs(self):
        """The GraphRunner when cuda_graphs='on' (counts, policy), else None."""
        return self._graphs

    @property
    def executor(self) -> LayerwiseExecutor:
        return self._streamed.executor

    def _check_live(self):
        if self._disabled:
            raise OffloadDisabledError("this OffloadedTransformer was disabled; use the module disable() returned, "
                                       "or wrap it again")

    def extra_repr(self) -> str:
        if self._disabled:
            return "disabled"
        s = self._streamed.stats()
        return (
            f"streamed={s['blocks_streamed']}, resident_blocks={s['blocks_resident']}, slots={s['num_slots']}, "
            f"slot_bytes={s['slot_bytes']}, host_bytes={s['host_bytes']}, pinned={s['pinned']}, "
            f"device={s['device']}"
        )

