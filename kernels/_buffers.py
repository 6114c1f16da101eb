"""What the byte-moving launchers share (materialise, codec decode): argument
checks and the per-device table lookup that must not upload inside a capture."""
from __future__ import annotations

import os

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


def canonical_device(device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``; other devices as they are."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_table(src, dst, table, table_type: type, op: str):
    """Check a launch's arguments and return ``table``'s tensor on ``dst``'s device
    (uploaded on first use, never inside a CUDA-graph capture), or None when the
    table moves nothing."""
    check_byte_buffers(src, dst, table, table_type, op)
    if dst.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"src and dst must be CUDA tensors (or set TRITON_INTERPRET=1), got {dst.device}")
    if table.num_tiles == 0:
        return None
    device = canonical_device(dst.device)
    tab = table._device.get(device)
    if tab is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("table is not on this device yet: call table.upload(device) before graph capture")
        tab = table.upload(device)
    return tab


class PackedTable:
    """What a launch table shares: a packed int64 table on the host (``_host``) and its
    copies per device (``_device``), uploaded once, before any capture."""

    def packed(self) -> torch.Tensor:
        """The packed int64 table on the host (a copy)."""
        return self._host.clone()

    def upload(self, device) -> torch.Tensor:
        """Copy the packed table to `device` once and keep it (call before capture)."""
        device = canonical_device(device)
        tab = self._device.get(device)
        if tab is None:
            tab = self._host if device.type == "cpu" else self._host.to(device)
            self._device[device] = tab
        return tab
