"""bitsandbytes ``Linear4bit`` (nf4 / fp4) and ``Linear8bitLt`` streamed as they are: the
"bitsandbytes" entry of the quantized formats table (:data:`.quantized.FORMATS`).

A ``Params4bit`` weight holds the packed 4-bit bytes (uint8); its ``quant_state`` (a Python
object) holds the tensors that dequantize them: ``absmax`` (fp32, or uint8 with double
quantization, then ``state2.absmax`` too), the quant map ``code``, the nested ``offset``. An
``Int8Params`` weight holds the int8 rows; the row scales ``SCB`` live beside it (on the weight
before the first forward, on the module's ``state`` after it). The block image holds the
per-weight tensors once, named as bitsandbytes serialises them (``weight``, ``weight.absmax``,
``weight.nested_absmax``, ``SCB``); the ring binds those very tensor objects, so the quant state
reads the slot. What stays resident on the compute device (moved once, at wrap time): the quant
maps (16 and 256 floats; the nested map is one tensor every layer shares) and the nested
``offset`` (a scalar whose value ``state_dict()`` reads).

Torch-level only: bitsandbytes is never imported here (its classes are known by module and name).
"""
from __future__ import annotations

import torch
from torch import nn

from ..misuse import UnsupportedOperationError, WeightUpdateError

# keys of bitsandbytes' serialised form that are made fresh at every state_dict() (not tensors a
# module computes with): an update must give them back unchanged
_DERIVED = (".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4", "weight.nested_quant_map",
            "weight_format")


def _is(t, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("bitsandbytes.") for c in type(t).__mro__)


def owns(cls: type) -> bool:
    """Whether a tensor or module class is bitsandbytes'."""
    return cls.__module__.startswith("bitsandbytes.")


def parts(name: str, kind: str, t) -> list[tuple[str, str, torch.Tensor]] | None:
    """``(name, kind, tensor)`` the block image holds for the bitsandbytes weight ``t`` named
    ``name``: the weight itself and its per-weight quant-state tensors; None for any other tensor."""
    if _is(t, "Params4bit"):
        qs = t.quant_state
        if qs is None:
            raise UnsupportedOperationError(
                f"{name!r} is a bitsandbytes Params4bit that was never quantized (quant_state None); quantize it "
                "first (BitsAndBytesConfig through from_pretrained, or Linear4bit.to(device)), then wrap")
        out = [(name, kind, t), (f"{name}.absmax", kind, qs.absmax)]
        if qs.state2 is not None:
            out.append((f"{name}.nested_absmax", kind, qs.state2.absmax))
        return out
    if _is(t, "Int8Params") and t.dtype == torch.int8:
        if t.SCB is None:
            raise UnsupportedOperationError(
                f"{name!r} is a bitsandbytes Int8Params without its SCB row scales on the weight; wrap the model "
                "through weightstream's entry points (they call prepare() first), which give the scales back to it")
        return [(name, kind, t), (f"{name[: -len('weight')]}SCB", kind, t.SCB)]
    return None


def prepare(module: nn.Module, device: torch.device) -> None:
    """Before the layouts are built: every ``Linear8bitLt`` in the state of its first forward
    (bitsandbytes' own ``init_8bit_state``), with ``state.CB`` the weight object itself and the
    weight holding its ``SCB`` again, so its forward neither moves the scales nor rebinds the
    weight's ``.data`` (what it does resident, per forward); every ``Linear4bit`` bias in its
    ``compute_dtype`` (its first forward casts it, resident). Refuses a ``Linear4bit`` that
    bitsandbytes repacks for the CPU (AVX512-BF16 kernels) when it computes there."""
    for name, m in module.named_modules():
        if not owns(type(m)):
            continue
        w = m._parameters.get("weight")
        if _is(m, "Linear4bit") and _is(w, "Params4bit") and w.quant_state is not None:
            packed = w.quant_state.__dict__.get("packing_format_for_cpu", False)
            repacks = m.__dict__.get("support_avx512bf16_for_cpu", False)  # set by bitsandbytes >= 0.49 at init
            if packed or (device.type == "cpu" and repacks):
                raise UnsupportedOperationError(
                    f"{name!r} is a bitsandbytes Linear4bit that bitsandbytes repacks for the CPU's AVX512-BF16 "
                    f"kernels ({'repacked already' if packed else 'at its first CPU forward'}): the repack and its "
                    "inverse in state_dict() rewrite the weight's bytes, which streaming keeps in the host store. "
                    "Stream to a CUDA device, or set support_avx512bf16_for_cpu=False on its Linear4bit modules "
                    "before the first forward (bitsandbytes' portable CPU path), then wrap")
            bias = m._parameters.get("bias")
            if bias is not None and m.compute_dtype is not None and bias.dtype != m.compute_dtype:
                bias.data = bias.data.to(m.compute_dtype)  # what its first forward does, resident
        if _is(w, "Int8Params") and w.dtype == torch.int8:
            if w.CB is not None:
                m.init_8bit_state()
            if m.state.CB is not None:
                m.state.CB = w  # the very weight object the ring binds (bit for bit its .data)
            w.SCB = m.state.SCB


def rehome(module: nn.Module, device: torch.device) -> list:
    """The resident quant-state tensors of every bitsandbytes weight of ``module`` move to
    ``device`` (new objects, as ``QuantState.to`` makes them); returns undo callables."""
    undo = []
    for m in module.modules():
        w = m._parameters.get("weight")
        if not _is(w, "Params4bit") or w.quant_state is None:
            continue
        qs = w.quant_state
        for obj, attr in ((qs, "code"), (qs, "offset"), (qs.state2, "code")):
            v = obj.__dict__.get(attr) if obj is not None else None
            if v is not None and v.device != device:
                undo.append(lambda obj=obj, attr=attr, v=v: setattr(obj, attr, v))
                setattr(obj, attr, v.to(device))
    return undo


def check_update(key: str, obj, new) -> None:
    """An update of a key of bitsandbytes' serialised form made fresh by each state_dict() (the
    packed quant-state blob, the nested quant map, int8's weight_format): it must be the value
    the model has (another quant type, block size, shape or dtype would need the weight
    re-quantized, which an update of bytes is not)."""
    if not key.endswith(_DERIVED) or isinstance(obj, nn.Parameter):
        return
    same = isinstance(new, torch.Tensor) and new.dtype == obj.dtype and new.shape == obj.shape and \
        torch.equal(new.detach().cpu(), obj.detach().cpu())
    if not same:
        raise WeightUpdateError(
            f"update_weights: {key!r} is bitsandbytes' serialised quant state of this model ({obj.dtype}, "
            f"{tuple(obj.shape)}); the new value differs (another quant type, block size, shape or nesting); "
            "nothing was written. Update with a state dict of the model quantized with the same BitsAndBytesConfig "
            "(its weight, weight.absmax, ... keys), or quantize and wrap the model again")
