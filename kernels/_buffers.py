"""The argument checks byte-moving launchers share (materialise, codec decode)."""
from __future__ import annotations

import torch


def check_byte_buffers(src, dst, table, table_type: type, op: str) -> None:
    """``src`` / ``dst``: 1-D contiguous uint8 tensors holding data on one device, large
    enough for ``table`` (a ``table_type`` with ``src_nbytes`` / ``dst_nbytes``), and not
    overlapping. TypeError / ValueError naming the argument otherwise."""
    if not isinstance(table, table_type):
        raise TypeError(f"table must be a {table_type.__name__}, got {type(table).__name__}")
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise TypeError(f"{name} dtype must be torch.uint8 (a byte view), got {t.dtype}")
        if t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be a 1-D contiguous byte tensor, got shape {tuple(t.shape)}")
    if src.device != dst.device:
        raise ValueError(f"src and dst must be on one device, got src on {src.device} and dst on {dst.device}")
    if src.device.type == "meta":
        raise ValueError("src and dst must hold data, got meta tensors")
    if src.numel() < table.src_nbytes:
        raise ValueError(f"src has {src.numel()} bytes but the table reads up to byte {table.src_nbytes}")
    if dst.numel() < table.dst_nbytes:
        raise ValueError(f"dst has {dst.numel()} bytes but the table writes up to byte {table.dst_nbytes}")
    if src.numel() and dst.numel():
        s0, d0 = src.data_ptr(), dst.data_ptr()
        if s0 < d0 + dst.numel() and d0 < s0 + src.numel():
            raise ValueError(f"src and dst overlap in memory; {op} needs distinct buffers")
