"""Block layouts: where every parameter and buffer of a block lives in its image.

A block image is one contiguous byte range holding all of a block's tensors,
each at a 512-byte-aligned offset (the CUDA caching allocator's own alignment:
BLAS libraries may pick kernels by pointer alignment, and bit-exact outputs
against the resident model depend on making the same choice).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .host.quantized import expand
from .misuse import SharedStorageError

TENSOR_ALIGN = 512


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def storage_span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements a strided tensor reaches (0 for an empty tensor)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


@dataclass(frozen=True)
class TensorSpec:
    """Metadata of one tensor of a block image."""

    name: str  # dotted name inside the block
    kind: str  # "parameter" | "buffer"
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # byte offset inside the block image, TENSOR_ALIGN-aligned
    nbytes: int  # bytes of the strided span

    @property
    def span(self) -> int:
        return self.nbytes // self.dtype.itemsize if self.dtype.itemsize else 0

    def view_of(self, image: torch.Tensor) -> torch.Tensor:
        """Typed, strided view of this tensor inside a uint8 ``image``."""
        raw = image[self.offset : self.offset + self.nbytes]
        typed = raw.view(self.dtype)
        return typed.as_strided(self.shape, self.stride, typed.storage_offset())


@dataclass(frozen=True)
class BlockLayout:
    """Every tensor of one block: names, dtypes, shapes, strides, byte offsets."""

    index: int
    name: str
    tensors: tuple[TensorSpec, ...]
    nbytes: int  # image size, TENSOR_ALIGN-aligned

    def __repr__(self) -> str:
        return f"BlockLayout({self.name!r}, {len(self.tensors)} tensors, {self.nbytes / 2**20:.2f} MiB)"


def block_tensors(block: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor object) for every parameter and buffer of a block, deduplicated."""
    out: list[tuple[str, str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, p in block.named_parameters(remove_duplicate=True):
        seen.add(id(p))
        out += expand(name, "parameter", p)  # a tensor subclass: its inner tensors (host/quantized.py)
    for name, b in block.named_buffers(remove_duplicate=True):
        if b is None or id(b) in seen:
            continue
        seen.add(id(b))
        out += expand(name, "buffer", b)
    return out


def build_layout(index: int, name: str, tensors: list[tuple[str, str, torch.Tensor]]) -> BlockLayout:
    specs = []
    offset = 0
    for tname, kind, t in tensors:
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"block {name!r}: tensor {tname!r} has layout {t.layout}; only strided tensors stream")
        shape, stride = tuple(t.shape), tuple(t.stride())
        nbytes = storage_span(shape, stride) * t.element_size()
        offset = align_up(offset, TENSOR_ALIGN)
        specs.append(TensorSpec(tname, kind, t.dtype, shape, stride, offset, nbytes))
        offset += nbytes
    return BlockLayout(index=index, name=name, tensors=tuple(specs), nbytes=align_up(max(offset, 1), TENSOR_ALIGN))


def check_not_shared(blocks, root: nn.Module) -> None:
    """Raise SharedStorageError if a tensor of a block is also used by another block
    or by the rest of the model, as the same object (tied weights) or through one
    storage (distinct tensors viewing the same memory): packing gives each block
    tensor its own host copy, which would silently break the tie."""
    where: dict[int, str] = {}
    storages: dict[int, tuple[int, str]] = {}  # storage address -> (block index, tensor)
    for b in blocks:
        for tname, _, t in block_tensors(b.module):
            name = f"{b.name}.{tname}"
            if id(t) in where:
                raise SharedStorageError(
                    f"tensor {name} is shared with {where[id(t)]}; shared (tied) weights "
                    "cannot be streamed: keep one of the blocks resident or untie the weights"
                )
            where[id(t)] = name
            key = _storage_key(t)
            if key is None:
                continue
            other = storages.setdefault(key, (b.index, name))
            if other[0] != b.index:
                raise SharedStorageError(
                    f"tensor {name} shares its storage with {other[1]} (distinct tensors viewing one "
                    "memory): streaming would give each its own copy and silently break the tie. Keep one "
                    "of the blocks resident, or give each tensor its own storage (.clone())"
                )
    block_ids = {id(b.module) for b in blocks}
    for mname, mod in root.named_modules():
        if id(mod) in block_ids or _inside_block(mname, blocks):
            continue
        for pname, t in [(f"{n}{x}", v) for n, o in list(mod._parameters.items()) + list(mod._buffers.items())
                         if o is not None for x, _, v in expand("", "", o)]:
            full = f"{mname + '.' if mname else ''}{pname}"
            if id(t) in where:
                raise SharedStorageError(
                    f"tensor {where[id(t)]} is also {full} outside the "
                    "streamed blocks; shared weights cannot be streamed"
                )
            key = _storage_key(t)
            if key is not None and key in storages:
                raise SharedStorageError(
                    f"tensor {storages[key][1]} shares its storage with {full} outside the blocks: "
                    "streaming would break the tie silently. Keep that block resident, or give "
                    f"{full} its own storage (.clone())"
                )


def _storage_key(t: torch.Tensor) -> int | None:
    """Address of ``t``'s storage, or None where there is no memory to share (meta, empty)."""
    if t.device.type == "meta":
        return None
    st = t.untyped_storage()
    return st.data_ptr() if st.nbytes() else None


def _inside_block(mname: str, blocks) -> bool:
    return any(mname == b.name or mname.startswith(b.name + ".") for b in blocks)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module`` once (tied tensors counted once)."""
    seen, out = set(), []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out += [v for _, _, v in expand("", "", t)]  # a tensor subclass: its inner tensors
    return out

