"""What a module must be for weightstream to wrap or stream it: read-only checks, nothing moves."""
from __future__ import annotations

from torch import nn

from .host.quantized import foreign_hooks
from .misuse import AlreadyOffloadedError


def check_wrappable(module: nn.Module, *, allow_meta: bool = False) -> None:
    """Raise AlreadyOffloadedError if ``module`` is already wrapped or streamed by
    weightstream, carries accelerate or diffusers offload hooks, or (unless
    ``allow_meta``) holds meta tensors. Reads only; nothing moves."""
    for name, m in module.named_modules():
        where = f"{type(module).__name__}" + (f".{name}" if name else "")
        if getattr(type(m), "_weightstream_wrapper", False):  # an OffloadedTransformer (no import of it here)
            raise AlreadyOffloadedError(
                f"{where} is already an OffloadedTransformer: use it as is, or call its disable() and wrap "
                "the plain module it returns")
        hooks = list(m._forward_pre_hooks.values()) + list(m._forward_hooks.values())
        ours = [h for h in hooks if type(getattr(h, "__self__", None)).__module__.startswith("weightstream.")]
        if ours:
            raise AlreadyOffloadedError(
                f"{where} is already streamed or offloaded by weightstream ({ours[0].__self__!r}); "
                "disable() the existing offload first, or keep using it")
        if hasattr(m, "_hf_hook"):
            raise AlreadyOffloadedError(
                f"{where} carries accelerate offload/dispatch hooks (_hf_hook: {type(m._hf_hook).__name__}); "
                "remove them first (accelerate.hooks.remove_hook_from_module(model, recurse=True), or load "
                "the model without device_map / enable_model_cpu_offload / cpu_offload)")
        registry = getattr(m, "_diffusers_hook", None)  # a diffusers HookRegistry (left empty by cache_context)
        if registry is not None and foreign_hooks(registry):
            raise AlreadyOffloadedError(
                f"{where} carries diffusers hooks ({', '.join(foreign_hooks(registry))}: e.g. group offload; "
                "layerwise casting alone streams, docs/quantized.md); "
                "remove them first (model.disable_group_offload() / building the model without "
                "enable_group_offload), then wrap it")
    if not allow_meta:
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.device.type == "meta":
                raise AlreadyOffloadedError(
                    f"{type(module).__name__}.{name} is on the meta device (accelerate init_empty_weights, "
                    "device_map offload or low_cpu_mem_usage left it unloaded): load real weights first, or "
                    "stream from the checkpoint with weightstream.offload_from_safetensors")
