"""The model opt-in to mmap loading and the binding of a meta-built model to a checkpoint.

:func:`check_opt_in` says how a model opted in (or raises); :func:`bind_checkpoint`
binds every expected tensor of the model to a (file, key) of a
:class:`~.checkpoint.Checkpoint` as a :class:`TensorBinding` (with an optional
``mmap_weight_transform`` or ``mmap_kernel_transform`` declared on the tensor);
:func:`host_tensor` is the runtime-layout host tensor of a binding. Pure host
code: nothing here touches CUDA.

A key whose dtype or size does not fit the model's tensor is a
:class:`~.checkpoint.CheckpointFormatError` naming the key, both dtypes and what
to do; unknown, duplicate or missing names are ValueErrors listing them.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from weightstream.kernels.materialise import Segment, SegmentTable, materialise_torch
from weightstream.offload.host.checkpoint import Checkpoint, CheckpointFormatError, CkptTensor, _listing
from weightstream.offload.host.gguf_file import type_name
from weightstream.offload.host.quantized import _gguf_class, casting_leaves

KERNEL_TRANSFORMS = {"qkv_reorder": Segment.qkv_reorder, "qkv_interleave": Segment.qkv_interleave}


def _is_diffusers_model(model: nn.Module) -> bool:
    mod = sys.modules.get("diffusers")
    mixin = getattr(mod, "ModelMixin", None) if mod is not None else None
    return mixin is not None and isinstance(model, mixin)


def check_opt_in(model: nn.Module) -> str:
    """How ``model`` opted in to mmap loading (raises ValueError if it did not)."""
    cls = type(model).__name__
    flag = getattr(model, "_supports_mmap_loading", None)
    if flag is False:
        raise ValueError(f"{cls}._supports_mmap_loading is False: this model opted out of mmap loading")
    if flag is True:
        return "_supports_mmap_loading"
    if callable(getattr(model, "_remap_ckpt_key", None)):
        return "_remap_ckpt_key"
    if _is_diffusers_model(model):
        return "diffusers"
    raise ValueError(
        f"{cls} does not declare mmap loading support: set `_supports_mmap_loading = True` on the class when "
        "checkpoint keys (after the source prefix) equal its parameter names, or define "
        "`_remap_ckpt_key(name) -> runtime name | None`; diffusers models need neither"
    )


@dataclass(frozen=True)
class TensorBinding:
    """A runtime tensor bound to its checkpoint source."""

    name: str  # runtime name (the first one, for tied tensors)
    src: CkptTensor
    shape: tuple[int, ...]  # runtime shape
    transform: Callable | None = None  # mmap_weight_transform (host, staging only)
    kernel: tuple | None = None  # ("qkv_reorder"|"qkv_interleave", num_heads, num_kv_heads)
    cast: torch.dtype | None = None  # a GGUF file's plain float tensor, cast to the model's dtype (diffusers' loader)

    @property
    def dtype(self) -> torch.dtype:
        """The runtime dtype: the checkpoint's, or the cast's."""
        return self.cast if self.cast is not None else self.src.dtype

    def kernel_segment(self, src_offset: int, dst_offset: int) -> Segment:
        kind, heads, kv = self.kernel
        head_bytes = self.src.nbytes // (heads + 2 * kv)
        return KERNEL_TRANSFORMS[kind](src_offset, dst_offset, heads, kv, head_bytes)


def _transform_error(b: TensorBinding, out, what: str) -> ValueError:
    got = f"{out.dtype} with {out.numel()} elements {tuple(out.shape)}" if isinstance(out, torch.Tensor) else repr(type(out))
    return ValueError(
        f"mmap_weight_transform of parameter {b.name!r} must preserve dtype and element count ({what}): "
        f"checkpoint {b.src.key!r} is {b.src.dtype} with {b.src.numel} elements {b.src.shape}, "
        f"the transform returned {got}"
    )


def _check_transform_output(b: TensorBinding, out) -> None:
    if not isinstance(out, torch.Tensor):
        raise _transform_error(b, out, "it returned no tensor")
    if out.dtype != b.src.dtype:
        raise _transform_error(b, out, "dtype changed")
    if out.numel() != b.src.numel:
        raise _transform_error(b, out, "element count changed")


def apply_transform(b: TensorBinding, src: torch.Tensor) -> torch.Tensor:
    out = b.transform(src)
    _check_transform_output(b, out)
    return out.reshape(b.shape)


def _parse_kernel(name: str, spec, src: CkptTensor) -> tuple:
    ok = (
        isinstance(spec, (tuple, list)) and len(spec) == 3 and spec[0] in KERNEL_TRANSFORMS
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in spec[1:])
    )
    if not ok:
        raise ValueError(
            f"mmap_kernel_transform of {name!r} is {spec!r}; expected (kind, num_heads, num_kv_heads) with kind "
            f"one of {sorted(KERNEL_TRANSFORMS)} and positive ints"
        )
    kind, heads, kv = spec
    rows = heads + 2 * kv
    if heads % kv or not src.shape or src.shape[0] % rows:
        raise ValueError(
            f"mmap_kernel_transform {tuple(spec)!r} of {name!r} does not fit checkpoint {src.key!r} of shape "
            f"{src.shape}: num_heads must be a multiple of num_kv_heads and dim 0 a multiple of "
            f"num_heads + 2 * num_kv_heads = {rows}"
        )
    return (kind, heads, kv)


def bind_checkpoint(model: nn.Module, ckpt: Checkpoint) -> dict[int, TensorBinding]:
    """Bind every expected tensor of ``model`` to a checkpoint entry: id(tensor) -> binding.

    Expected: every parameter, and every buffer that is on ``meta`` or named
    in the checkpoint. Raises ValueError for unknown, duplicate or missing
    names, a shape or transform mismatch, and lists tensors left on meta;
    CheckpointFormatError for a dtype that does not fit (:func:`_check_dtypes`).
    """
    cls = type(model).__name__
    objs: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        objs[name], kinds[name] = p, "parameter"
    for name, b in model.named_buffers(remove_duplicate=False):
        if b is not None and name not in objs:
            objs[name], kinds[name] = b, "buffer"
    remap = getattr(model, "_remap_ckpt_key", None)
    remap = remap if callable(remap) else None
    target_of: dict[str, str] = {}  # runtime name -> checkpoint name
    unknown = []
    for cname in ckpt.entries:
        rname = remap(cname) if remap is not None else cname
        if rname is None:
            continue
        if rname not in objs:
            unknown.append(cname if rname == cname else f"{cname} -> {rname}")
            continue
        if rname in target_of:
            raise ValueError(f"checkpoint keys {target_of[rname]!r} and {cname!r} both map to {rname!r}")
        target_of[rname] = cname
    if unknown:
        hint = "return None from _remap_ckpt_key to ignore a key" if remap else (
            "define _remap_ckpt_key(name) -> runtime name | None to rename or ignore keys"
        )
        raise ValueError(f"checkpoint keys that {cls} has no tensor for: {_listing(unknown)}; {hint}")

    out: dict[int, TensorBinding] = {}
    for rname, cname in target_of.items():
        t = objs[rname]
        if id(t) in out:
            continue  # a tied tensor, bound under its other name
        src = ckpt.entries[cname]
        out[id(t)] = _make_binding(rname, t, src, ckpt)
    _check_dtypes(model, objs, target_of, out, ckpt)
    stuck = [n for n, t in objs.items() if id(t) not in out and t.device.type == "meta"]
    if stuck:
        raise CheckpointFormatError(
            f"{len(stuck)} expected tensor(s) of {cls} are still on the meta device after checkpoint mapping "
            f"(no checkpoint key maps to them): {_listing(stuck)}; checkpoint files: "
            f"{[str(f.path) for f in ckpt.files][:4]}"
        )
    missing = [n for n, t in objs.items() if id(t) not in out and kinds[n] == "parameter"]
    if missing:
        raise CheckpointFormatError(f"parameters of {cls} missing from the checkpoint: {_listing(missing)}; "
                                    "stream a checkpoint of this model (or build the model from its config)")
    return out


def _kept_fp32(model: nn.Module, name: str) -> bool:
    """Whether diffusers keeps ``name`` in float32 whatever the checkpoint's dtype
    (``ModelMixin._keep_in_fp32_modules``, as ``from_pretrained(torch_dtype=...)`` does)."""
    keep = type(model)._keep_in_fp32_modules if _is_diffusers_model(model) else None
    return bool(keep) and any(m in name.split(".") for m in keep)


def _check_dtypes(model: nn.Module, objs: dict, target_of: dict, out: dict, ckpt: Checkpoint) -> None:
    """A float8 tensor binds only an entry of its own dtype (:func:`_check_float8`). Otherwise the
    checkpoint's dtypes replace the model's only as a whole: every floating-point tensor
    of one model dtype takes one checkpoint dtype (a model built in float32 on meta, loaded
    from a bfloat16 checkpoint), or keeps its own. A key that breaks that (a mix the first
    forward would fail on, or run with), or a non-float key of another dtype, is a
    CheckpointFormatError naming the key, both dtypes and what to do."""
    cls = type(model).__name__
    _check_float8(model, objs, target_of, out, ckpt)
    groups: dict[torch.dtype, dict[torch.dtype, list[str]]] = {}
    for rname, cname in target_of.items():
        t, b = objs[rname], out.get(id(objs[rname]))
        if b is None or b.name != rname or b.cast is not None or b.src.quant_type is not None:
            continue  # a tied tensor (checked under its first name), a GGUF cast or GGUF bytes (_gguf_binding)
        if t.dtype != b.dtype and not (t.dtype.is_floating_point and b.dtype.is_floating_point):
            raise _dtype_error(cls, rname, cname, b, t.dtype, ckpt, "only floating-point tensors take the checkpoint's "
                               "dtype (as a whole-model cast)", to=t.dtype)
        if b.dtype == torch.float32 and _kept_fp32(model, rname):
            continue  # float32 where diffusers keeps it so, whatever the rest is cast to
        groups.setdefault(t.dtype, {}).setdefault(b.dtype, []).append(cname)
    for mdt, by in groups.items():
        if len(by) < 2:
            continue
        main = max(by, key=lambda d: (len(by[d]), d == mdt))  # the most keys (a tie: the model's own)
        odd = sorted(c for d, cs in by.items() if d != main for c in cs)
        cname = odd[0]
        rname = next(r for r, c in target_of.items() if c == cname)
        b = out[id(objs[rname])]
        shown = _listing(by[main][:3]) + (f" and {len(by[main]) - 3} more" if len(by[main]) > 3 else "")
        gives = f"keeps the model's other {mdt} tensors in {mdt}" if main == mdt else \
            f"gives the model's other {mdt} tensors {main}"
        raise _dtype_error(cls, rname, cname, b, mdt, ckpt,
                           f"the checkpoint {gives} ({shown}), so this one would run in another dtype than its "
                           f"neighbours (keys that do so: {_listing(odd)})", to=main)


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _check_float8(model: nn.Module, objs: dict, target_of: dict, out: dict, ckpt: Checkpoint) -> None:
    """A float8 tensor (diffusers' layerwise casting storage) binds only a checkpoint entry of its
    own dtype, and a float8 entry only a tensor of its dtype: the mmap source streams the file's
    bytes as they are, so the whole-model cast :func:`_check_dtypes` allows between other float
    dtypes would give a float8-cast model the checkpoint's bf16 (or other float8) weights. The
    first such key is a CheckpointFormatError naming it, both dtypes and what to do."""
    bad = [(r, c) for r, c in target_of.items() if (b := out.get(id(objs[r]))) is not None and b.name == r
           and b.src.quant_type is None and objs[r].dtype != b.dtype
           and (_is_float8(objs[r].dtype) or _is_float8(b.dtype))]
    if not bad:
        return
    rname, cname = bad[0]
    t, b = objs[rname], out[id(objs[rname])]
    where = f"checkpoint key {cname!r} ({ckpt.files[b.src.file].path}) is {b.dtype}"
    more = f" ({len(bad)} keys so: {_listing([c for _, c in bad])})" if len(bad) > 1 else ""
    cast = "" if casting_leaves(model) else "not "
    if _is_float8(t.dtype):
        raise CheckpointFormatError(
            f"{where}; {type(model).__name__}'s tensor {rname!r} is stored in {t.dtype} (the model is {cast}layerwise "
            f"cast){more}: a float8 tensor binds only a checkpoint entry of its own dtype, since the mmap source "
            f"streams the file's bytes as they are (no cast on the way). Stream a checkpoint saved from the cast "
            f"model (enable_layerwise_casting(storage_dtype={t.dtype}, ...), then save_pretrained), or load the "
            "model into memory, cast it and wrap it with OffloadedTransformer")
    raise CheckpointFormatError(
        f"{where}; {type(model).__name__}'s tensor {rname!r} is {t.dtype} (the model is {cast}layerwise cast){more}: "
        f"a float8 entry binds only a tensor of its own dtype. Build the model on meta as the saved one was: "
        f"enable_layerwise_casting(storage_dtype={b.dtype}, compute_dtype=...) with the same skip_modules_pattern, "
        "before offload_from_safetensors")


def _dtype_error(cls: str, rname: str, cname: str, b: TensorBinding, model_dtype, ckpt: Checkpoint, why: str, *,
                 to) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"checkpoint key {cname!r} ({ckpt.files[b.src.file].path}) is {b.dtype}, {cls}'s tensor {rname!r} is "
        f"{model_dtype}: {why}. Convert the checkpoint (that key to {to}), or build the model in the "
        f"checkpoint's dtypes (on meta, before offload_from_safetensors: e.g. module.to({b.dtype}) for the "
        "modules it stores so)")


def _gguf_binding(name: str, t: torch.Tensor, src: CkptTensor, ckpt: Checkpoint) -> TensorBinding | None:
    """The binding of ``t`` to an entry of a GGUF file (None: an entry of a safetensors file, bound
    as before). A ``GGUFParameter`` binds the quantized entry of its own quant type and byte shape;
    a plain float tensor binds a plain float entry, cast to the model's dtype where they differ (as
    diffusers' GGUF loader casts them to its compute dtype). Anything else is a CheckpointFormatError
    naming the key, the value and what was expected."""
    if ckpt.files[src.file].kind != "gguf":
        if _gguf_class(t) is not None:
            raise CheckpointFormatError(
                f"{name!r}: the model's tensor is a GGUF weight of quant_type {type_name(int(t.quant_type))} (uint8 "
                f"bytes {tuple(t.shape)}); checkpoint {src.key!r} ({ckpt.files[src.file].path}) is a plain {src.dtype} "
                f"tensor of a {ckpt.files[src.file].kind} file: stream a GGUF model from its .gguf file")
        return None
    where = f"checkpoint {src.key!r} ({ckpt.files[src.file].path})"
    model_q = int(t.quant_type) if _gguf_class(t) is not None else None
    if model_q is None and src.quant_type is not None:
        raise CheckpointFormatError(
            f"{where} is {type_name(src.quant_type)} (uint8 bytes {src.shape}); the model's {name!r} is a plain "
            f"{t.dtype} tensor of shape {tuple(t.shape)}: build the model with gguf_on_meta(model, path) from this "
            "file, so that its linears take the file's quantized weights as GGUFParameters")
    if model_q is not None and src.quant_type != model_q:
        got = "a plain " + str(src.dtype) if src.quant_type is None else type_name(src.quant_type)
        raise CheckpointFormatError(
            f"{where} is {got} of shape {src.shape}; the model's {name!r} is a GGUF weight of quant_type "
            f"{type_name(model_q)} (uint8 bytes {tuple(t.shape)}): build the model with gguf_on_meta(model, path) "
            "from the file it streams from")
    if tuple(t.shape) != src.shape:
        raise CheckpointFormatError(f"{name!r}: the model has shape {tuple(t.shape)}, {where} has {src.shape} ("
                                    f"{type_name(src.quant_type) if src.quant_type is not None else src.dtype})")
    if model_q is not None:
        return TensorBinding(name, src, src.shape)
    if t.dtype != src.dtype:
        if not (t.dtype.is_floating_point and src.dtype.is_floating_point):
            raise CheckpointFormatError(f"{where} is {src.dtype}, the model's {name!r} is {t.dtype}: only floating-"
                                        "point tensors of a GGUF file are cast to the model's dtype")
        return TensorBinding(name, src, src.shape, cast=t.dtype)
    return TensorBinding(name, src, src.shape)


def _make_binding(name: str, t: torch.Tensor, src: CkptTensor, ckpt: Checkpoint) -> TensorBinding:
    shape = tuple(t.shape)
    if not t.is_contiguous():
        raise ValueError(f"{name!r} is not contiguous (stride {t.stride()}); mmap loading binds contiguous tensors")
    gguf = _gguf_binding(name, t, src, ckpt)
    if gguf is not None:
        return gguf
    fn = getattr(t, "mmap_weight_transform", None)
    kernel = getattr(t, "mmap_kernel_transform", None)
    numel = t.numel()
    if numel != src.numel:
        raise CheckpointFormatError(
            f"{name!r}: the model has {numel} elements {shape}, checkpoint {src.key!r} has {src.numel} "
            f"elements {src.shape}"
        )
    if fn is not None and kernel is not None:
        raise ValueError(f"{name!r} declares both mmap_weight_transform and mmap_kernel_transform; keep one")
    if fn is not None:
        if not callable(fn):
            raise ValueError(f"mmap_weight_transform of {name!r} must be callable, got {type(fn).__name__}")
        b = TensorBinding(name, src, shape, transform=fn)
        try:
            probe = fn(torch.empty(src.shape, dtype=src.dtype, device="meta"))
        except Exception:  # not meta-traceable: check on the real data once
            probe = fn(ckpt.tensor(src))
        _check_transform_output(b, probe)
        return b
    if shape != src.shape:
        raise CheckpointFormatError(
            f"{name!r}: the model has shape {shape}, checkpoint {src.key!r} has {src.shape}; attach an "
            "mmap_weight_transform to the parameter if the layouts differ"
        )
    if kernel is not None:
        return TensorBinding(name, src, shape, kernel=_parse_kernel(name, kernel, src))
    return TensorBinding(name, src, shape)


def host_tensor(ckpt: Checkpoint, b: TensorBinding) -> torch.Tensor:
    """Runtime-layout host tensor of a binding: a read-only view of the mapping,
    or (transformed tensors) a fresh tensor."""
    if b.transform is not None:
        return apply_transform(b, ckpt.tensor(b.src))
    if b.cast is not None:
        return ckpt.tensor(b.src).to(b.cast)
    if b.kernel is not None:
        out = torch.empty(b.src.nbytes, dtype=torch.uint8)
        materialise_torch(ckpt.bytes(b.src), out, SegmentTable([b.kernel_segment(0, 0)]))
        return out.view(b.dtype).view(b.shape)
    return ckpt.tensor(b.src)


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen = set()
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    ):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            yield name, t

