"""Streaming a DiT straight from safetensors: binding the checkpoint, the resident weights,
the source over the mapping (raw: :class:`~.sources.mmap.MmapSource`; coded:
:class:`~.sources.mmap.MmapCodedSource` over blocks encoded from the mapping or a coded
sidecar, :mod:`.host.sidecar`) and :func:`offload_from_safetensors`, the entry point.

Coded: each streamed block's runtime tensors are read from the mapping (views; kernel
transforms and ``mmap_weight_transform`` applied into fresh tensors, as
:func:`.host.binding.host_tensor` does), encoded and stored coded, a few blocks at a time
on worker threads (at most :data:`IN_FLIGHT_BYTES` of raw blocks in flight; never the whole
model in RAM). Once built, the source no longer reads the checkpoint (the coded bytes are its
own copy, or the sidecar's mapping), so the checkpoint is closed.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from .config import OffloadConfig
from .discovery import OffloadPlan
from .host.binding import _named_tensors, bind_checkpoint, check_opt_in, host_tensor
from .host.checkpoint import Checkpoint, _listing, as_sources
from .host.copy_plans import COPY_PATHS, build_plan, file_keys, file_ordered_layout
from .host.encode import encode_image, in_order
from .host.sidecar import check_sidecar_mode, identity, sidecar_path, try_sidecar, write_or_warn
from .host.staging import check_threads
from .codecs import codec_levels
from .layout import BlockLayout
from .placeholders import drop_storage, give_data
from .sources.decode import decode_placement
from .sources.mmap import MmapCodedSource, MmapSource
from .build import streamed_blocks
from .host.quantized import quantized_format
from .sources.select import Topology, check_quantized, select
from .streamed import StreamedBlocks, resolve_device

__all__ = ["offload_from_safetensors", "mmap_streamed_blocks", "mmap_coded_source", "IN_FLIGHT_BYTES"]


def _load_resident(module: nn.Module, ckpt: Checkpoint, bindings: dict, streamed_ids: set, device) -> None:
    """Every bound tensor that does not stream: a private device copy from the mapping, now."""
    with torch.no_grad():
        for _, t in _named_tensors(module):
            b = bindings.get(id(t))
            if b is not None and id(t) not in streamed_ids:
                give_data(t, host_tensor(ckpt, b).to(device, copy=True))


def _private_casts(module: nn.Module, ckpt: Checkpoint, bindings: dict, streamed_ids: set) -> dict:
    """The bindings the source streams from the mapping: all but the streamed tensors a GGUF file
    stores in another float dtype than the model's (its norms and biases in F32, cast to the compute
    dtype as diffusers' loader does). Those are cast once, now, into private host tensors, which the
    source holds as it holds a block's unbound buffers (copied with the block on every path)."""
    kept = dict(bindings)
    with torch.no_grad():
        for _, t in _named_tensors(module):
            b = bindings.get(id(t))
            if b is not None and b.cast is not None and id(t) in streamed_ids:
                give_data(t, host_tensor(ckpt, b))
                del kept[id(t)]
    return kept


def mmap_streamed_blocks(module: nn.Module, config: OffloadConfig, device: torch.device, plan: OffloadPlan | None,
                         ckpt: Checkpoint, copy_path: str = "auto", staging_threads: int | None = None, *,
                         cls=StreamedBlocks, coded_sidecar: str = "off") -> StreamedBlocks:
    """``cls`` (a StreamedBlocks) over ``module`` (on meta) whose source is an
    :class:`MmapSource` over ``ckpt``. Binds every tensor (meta, checkpoint dtype,
    runtime shape), lets StreamedBlocks pick the streamed blocks, then loads the
    rest to ``device`` and builds the source (with ``weight_codec``: a coded source,
    :mod:`.host.sidecar`). ``ckpt`` is closed on failure."""
    t0 = time.perf_counter()
    made: list[MmapSource] = []
    try:
        bindings = bind_checkpoint(module, ckpt)
        with torch.no_grad():
            for _, t in _named_tensors(module):
                b = bindings.get(id(t))
                if b is not None:
                    give_data(t, torch.empty(b.shape, dtype=b.dtype, device="meta"))
        bind_s = time.perf_counter() - t0

        def factory(req) -> MmapSource:
            t1 = time.perf_counter()
            streamed_ids = {id(t) for ts in req.tensors for _, _, t in ts}
            _load_resident(module, ckpt, bindings, streamed_ids, req.device)
            mapped = _private_casts(module, ckpt, bindings, streamed_ids)
            timings = {"open_s": ckpt.open_s, "bind_s": bind_s, "resident_load_s": time.perf_counter() - t1}
            if req.codec != "none":
                made.append(mmap_coded_source(req, ckpt, mapped, coded_sidecar, timings))
                return made[-1]
            made.append(MmapSource(req, ckpt, mapped, copy_path=copy_path, staging_threads=staging_threads,
                                   timings=timings))
            return made[-1]

        streamed = streamed_blocks(module, config, device, plan, select(config, Topology(device_type=device.type), ckpt),
                                   source=factory, cls=cls)
    except BaseException:
        for src in made:
            src.close()
        ckpt.close()
        raise
    try:
        left = [n for n, t in _named_tensors(module) if t.device.type == "meta"]
        if left:  # pragma: no cover - bind_checkpoint guarantees this
            raise ValueError(f"tensors left on the meta device after setup: {_listing(left)}")
        ckpt.check_unchanged()  # resident weights were read from the mapping during setup
    except BaseException:
        streamed.executor.remove()
        made[-1].close()
        raise
    return streamed


def offload_from_safetensors(
    model_on_meta: nn.Module,
    source=None,
    config=None,
    *,
    device=None,
    plan: OffloadPlan | None = None,
    copy_path: str = "auto",
    staging_threads: int | None = None,
    coded_sidecar: str = "off",
):
    """Stream ``model_on_meta``'s blocks straight from safetensors (or GGUF) files.

    model_on_meta: the DiT with its parameters on ``meta`` (see :func:`on_meta`,
    :func:`meta_from_pretrained`; :func:`gguf_on_meta` for a GGUF file; diffusers'
    ``enable_layerwise_casting`` on it for a checkpoint saved from a cast model, whose float8 tensors
    bind only entries of their own dtype); it is bound in place and wrapped.
    source: a folder (diffusers layout), a .safetensors or .gguf file, an index.json,
    a :class:`WeightsSource`, a dict with keys path/prefix/subfolder, or a list
    of these; None: the model's ``weights_sources``.
    config: as for :class:`OffloadedTransformer` (layer mode, rank-local).
    copy_path: "auto" (direct DMA from registered pages on CUDA, staging on
    CPU or where registration is not possible), "direct" (also on CPU:
    synchronous copies straight from the mapping, for tests), or "staging".
    staging_threads: threads that pack staged blocks (int >= 1; None: the
    CPUs available less two, at most 16). 1 packs on the packer thread alone
    (torch's multi-threaded copy).
    coded_sidecar: with ``weight_codec='exp-k'`` or ``'exp-k2'`` (blocks packed from the mapping, encoded,
    streamed coded; :mod:`.host.sidecar`): "off" (encode at every start), "write" (encode,
    write ``<checkpoint dir>/.weightstream-coded/<hash>.wsc``), "auto" (load a valid sidecar,
    else encode and write one) or "read" (load one; CodedSidecarError if none is valid).
    """
    from .transformer import OffloadedTransformer  # the wrapper imports the front ends, not the sources

    if not isinstance(model_on_meta, nn.Module):
        raise TypeError(f"model_on_meta must be a torch.nn.Module, got {type(model_on_meta).__name__}")
    if copy_path not in COPY_PATHS:
        raise ValueError(f"copy_path={copy_path!r} is not allowed; choose from: {', '.join(COPY_PATHS)}")
    check_threads(staging_threads)
    cfg = OffloadConfig.coerce(config)
    if cfg.mode != "layer":
        raise ValueError(f"mode={cfg.mode!r} is not allowed for the mmap source; choose from: layer")
    codec = select(cfg, Topology(), checkpoint="safetensors").codec  # the support matrix's refusals
    check_quantized(quantized_format(model_on_meta), "mmap")  # and the quantized one's, before any binding
    check_sidecar_mode(coded_sidecar, codec)
    if codec != "none" and (copy_path != "auto" or staging_threads is not None):
        key, val = ("copy_path", copy_path) if copy_path != "auto" else ("staging_threads", staging_threads)
        raise ValueError(f"{key}={val!r} is not allowed with weight_codec={codec!r}: coded blocks "
                         f"copy from the coded host store; choose from: {key}={'auto' if key == 'copy_path' else None!r}")
    if "dit" not in cfg.components:
        raise ValueError(f"components={list(cfg.components)!r} does not select 'dit'; the mmap source streams a DiT")
    if cfg.weight_transfer == "allgather":
        raise ValueError(
            "layer_options.dit.weight_transfer='allgather' is not allowed for the mmap source; choose from: "
            "rank-local (every process maps the same checkpoint and shares its page cache)"
        )
    dev = resolve_device(device)
    check_opt_in(model_on_meta)
    ckpt = Checkpoint(as_sources(source, model_on_meta))
    streamed = mmap_streamed_blocks(model_on_meta, cfg, dev, plan, ckpt, copy_path, staging_threads,
                                    coded_sidecar=coded_sidecar)
    return OffloadedTransformer(model_on_meta, cfg, device=dev, streamed=streamed)


IN_FLIGHT_BYTES = 4 << 30  # raw block bytes encoded at once (bounds the coded blobs waiting in order)


def _runtime_tensors(ckpt: Checkpoint, plan, layout: BlockLayout, tensors, bindings) -> list[torch.Tensor]:
    """Block ``plan.k``'s runtime host tensors: views of the mapping (no transform), fresh
    tensors (kernel transforms, ``mmap_weight_transform``), the private bytes of unbound buffers."""
    local = iter(plan.local)
    out = []
    for spec, t in zip(layout.tensors, tensors):
        b = bindings.get(id(t))
        out.append(host_tensor(ckpt, b) if b is not None else next(local)[0].view(spec.dtype).view(spec.shape))
    return out


def _encode_blocks(ckpt: Checkpoint, layouts, plans, tensors, bindings, counter: list, levels: int = 1):
    """(blobs, table) of every block in order, encoded on workers from the mapping (the files
    checked before and after each block: never a truncated read, never a mixed block)."""

    def work(k: int):
        ckpt.check_unchanged()
        blobs_table = encode_image(layouts[k], _runtime_tensors(ckpt, plans[k], layouts[k], tensors[k], bindings),
                                   levels=levels)
        ckpt.check_unchanged()
        # read once: the block's mapped pages leave the resident set (setup peak RSS near the model)
        ckpt.drop_pages([b.src for t in tensors[k] if (b := bindings.get(id(t))) is not None])
        return blobs_table

    for done in in_order(len(layouts), work, ahead=max(1, IN_FLIGHT_BYTES // max(lay.nbytes for lay in layouts))):
        counter[0] += 1  # counted here, on the consuming thread
        yield done


def mmap_coded_source(req, ckpt: Checkpoint, bindings: dict, sidecar: str = "off", timings: dict | None = None):
    """A :class:`MmapCodedSource` for the streamed blocks of ``req`` from ``ckpt`` (closed once built)."""
    cfg, device = req.config, req.device
    tensors = [[t for _, _, t in ts] for ts in req.tensors]
    layouts = [file_ordered_layout(lay, file_keys(ts, bindings, len(ckpt.files))) for lay, ts in zip(req.layouts, tensors)]
    ident = identity(ckpt, layouts, tensors, bindings, req.codec)
    path = sidecar_path(ckpt, ident)
    t0 = time.perf_counter()
    regions = watch = verifier = None
    if sidecar in ("auto", "read"):
        regions, watch, verifier = try_sidecar(path, ident, layouts, sidecar)
    size = watch.size if watch is not None else 0
    plans = [build_plan(k, lay, ts, bindings) for k, (lay, ts) in enumerate(zip(layouts, tensors))]
    with torch.no_grad():  # streamed tensors leave meta: the source drops them to placeholders
        drop_storage([t for ts in tensors for t in ts if t.device.type == "meta"], device)
    counter = [0]
    levels = codec_levels(req.codec)
    encoded = regions if regions is not None else _encode_blocks(ckpt, layouts, plans, tensors, bindings, counter,
                                                                 levels)
    budget = cfg.pinned_memory_budget_gb
    try:
        src = MmapCodedSource(layouts, tensors, device=device, pin=cfg.pin_memory, progress=cfg.progress,
                              budget_bytes=None if budget is None else int(budget * 1e9), encoded=encoded,
                              codec=req.codec, sidecar=watch, verifier=verifier, **decode_placement(cfg))
    except BaseException:
        if verifier is not None:
            verifier.stop()
        if watch is not None:
            watch.close()
        raise
    load_s = time.perf_counter() - t0
    try:
        ckpt.check_unchanged()  # resident weights and packed blocks were read from the mapping
        write_s = 0.0
        if sidecar == "write" or (sidecar == "auto" and regions is None):
            t1 = time.perf_counter()
            size = write_or_warn(path, ident, src.images, must=sidecar == "write")
            write_s = time.perf_counter() - t1
    except BaseException:
        src.close()
        raise
    if regions is not None:
        src.images.encode_s = 0.0
    src.checkpoint_files = len(ckpt.files)
    src.sidecar_stats = {
        "coded_sidecar": sidecar, "sidecar_path": str(path) if sidecar != "off" else None,
        "sidecar_loaded": regions is not None, "sidecar_load_s": load_s if regions is not None else 0.0,
        "sidecar_bytes": size, "sidecar_write_s": write_s, "blocks_encoded": counter[0],
        "sidecar_s_per_gb": load_s / (size / 1e9) if regions is not None and size else None,
        **(timings or {}),
    }
    ckpt.close()  # the coded bytes are the source's own now (its arena, or the sidecar mapping)
    return src
