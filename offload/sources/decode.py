"""DecodeStage: the device side of decoding coded block images, composed by any transport.

A transport (the pinned copy, the mmap copy, the DLO all-gather) moves a block's coded bytes
into a per-slot device buffer; the stage owns those buffers, the decode stream, the events
that order a decode after its write and the next write after the decode that read it, the
device decode tables (uploaded at ``attach``, retabled in place so captured graphs read the
current weights), and when the decode runs: with the write (``decode_at="load"``) or just
before the block computes (``decode_at="use"``, the executor's ``before_use``).

How a transport uses it::

    stage = DecodeStage(layouts, decode_at=..., decode_stream=...)
    # attach (the executor's copy stream current):
    stage.attach(slots, streams, device, buffer_bytes, tables)
    # load of a coded block k into slot (cs: the stream the transport writes on):
    stage.before_write(slot, cs, tag, after)      # buffer(slot) no longer read by a decode
    ...write n coded bytes into stage.buffer(slot)[:n] on cs...
    return stage.written(k, slot, n, table, cs, tag, after)  # decodes now, or at use
    # load of a raw block (no decode; the transport copies into the slot itself):
    stage.before_raw(slot, cs, tag); ...copy into the slot...; stage.raw_written(k, slot)
    # the executor's before_use(k, slot, stream, tag):
    stage.before_use(k, slot, stream, n, table, tag)
    # no streams (the CPU): stage.decode(src, dst, table) synchronously
    # the store re-encoded block k: stage.retable(k, table) (same size) / stage.upload(k, table)
    # coded copies grew: stage.grew(buffer_bytes) (graphs captured before are stale: check())

``after`` is the executor's slot-free event (None: the slot is free); ``tag`` the capture the
load belongs to (None: eager). With ``decode_stream`` the decode runs on a side stream of the
stage (:meth:`side_streams`), else on ``cs`` (at load) or the compute stream (at use).
"""
from __future__ import annotations

import torch

from ...kernels.codec import decode_any
from ...kernels.codec_format import DecodeTable
from weightstream.offload.codecs import CodedCaptureStaleError
from weightstream.offload.misuse import UnsupportedCombinationError

__all__ = ["DecodeStage", "DECODE_AT", "check_codec_supported", "decode_placement", "runs"]

DECODE_AT = ("load", "use")  # when the stage issues a block's decode
_NEVER = object()  # capture tag of an event never recorded


def check_codec_supported(codec: str, where: str) -> None:
    """:class:`~..misuse.UnsupportedCombinationError` naming ``weight_codec`` when ``where`` (a transport no decode stage is composed
    with) is asked to decode with ``codec`` (a request's ``codec``)."""
    if codec != "none":
        raise UnsupportedCombinationError(
            f"weight_codec={codec!r} is not allowed with {where}: coded weights are not supported "
            "there yet (only the pinned host source of layer mode decodes them); choose from: none")


def decode_placement(cfg) -> dict:
    """Where the coded sources decode, by config (``decode_at`` and ``decode_stream``).
    Eager: at load, on the decode stream. CUDA graphs: at use, on the compute stream.
    Captured at load, each block's decode became the first dependant of its copy, and the
    step graph's copies ran at ~50 GB/s instead of 55 (flux graphs-coded 0.806x the uncoded
    floor); issued at use, after the next block's copy, 0.713x (0.732x on the decode
    stream). Eager, decoding at load stays the faster (flux 0.746-0.753x vs 0.757x at use on
    the decode stream). Outputs are the same bytes either way."""
    if cfg.cuda_graphs == "on":
        return {"decode_at": "use", "decode_stream": False}
    return {"decode_at": "load", "decode_stream": True}


def runs(table: DecodeTable, run_bytes: int) -> list[tuple[int, int, DecodeTable]]:
    """A block's coded bytes (decoded by ``table``) cut between tensors into runs of about
    ``run_bytes`` (one run when ``run_bytes <= 0``): ``(start, end, table)`` each, in order,
    ``table`` decoding that run's tensors (source offsets from the start of the block's coded
    bytes), so a copy of run i+1 can overlap the decode of run i."""
    groups: list[list] = [[]]
    start = 0
    for seg in sorted(table.segments, key=lambda sg: sg.src_offset):
        if groups[-1] and run_bytes > 0 and seg.src_end - start > run_bytes:
            groups.append([])
            start = seg.src_offset
        groups[-1].append(seg)
    out, at = [], 0
    for group in groups:
        end = max((sg.src_end for sg in group), default=at)
        out.append((at, end, DecodeTable(group, **table.options())))
        at = end
    return out


class DecodeStage:
    """Coded device buffers per slot, the decode stream and its events (see the module docstring)."""

    def __init__(self, layouts, *, decode_at: str = "load", decode_stream: bool = True):
        if decode_at not in DECODE_AT:
            raise ValueError(f"decode_at={decode_at!r} is not allowed; choose from: {', '.join(DECODE_AT)}")
        self.layouts = layouts  # block k's layout (its index names the block in traces)
        self.decode_at = decode_at
        self.decode_stream = bool(decode_stream)  # decode on a side stream, overlapping the next write
        self.device = None
        self._streams = self._slots = None
        self._buffers: list[torch.Tensor] = []
        self._dev_tables: list[torch.Tensor | None] = []
        self._dstream = None
        self._read_tag: list = []
        self.captured = False  # a load was issued inside a capture
        self.stale: str | None = None  # why captured graphs cannot be replayed any more

    @property
    def writes_at_use(self) -> bool:
        """The slot is written at use (the executor notes no load-time write)."""
        return self.decode_at == "use"

    # -- the ring ---------------------------------------------------------------------
    def attach(self, slots: list[torch.Tensor], streams, device: torch.device, buffer_bytes: int, tables) -> None:
        """One device buffer of ``buffer_bytes`` per slot (plus, with ``decode_stream``, the decode
        stream and two events per slot); every table of ``tables`` (per block, None: raw) on the
        device now (never inside a capture)."""
        self._slots, self._streams, self.device = slots, streams, device
        self.alloc(buffer_bytes)
        self._dev_tables = [t.upload(device) if t is not None and t.num_tiles else None for t in tables]
        self._read_tag = [_NEVER] * len(slots)  # capture context each _read was recorded in
        if streams is not None and (self.decode_stream or self.decode_at == "use"):
            if self.decode_stream:
                self._dstream = streams.new_stream(device)
            self._copied = [streams.new_event() for _ in slots]  # write into buffer[s] done
            self._read = [streams.new_event() for _ in slots]  # decode from buffer[s] done
            self._copied_tag: list = [_NEVER] * len(slots)  # capture context each _copied was recorded in
            self._free: list = [None] * len(slots)  # decode_at="use": the slot-free event its load got

    @property
    def attached(self) -> bool:
        return bool(self._slots)

    def alloc(self, buffer_bytes: int) -> None:
        self._buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, device=self.device) for _ in self._slots]

    def slot(self, slot: int) -> torch.Tensor:
        """The executor's device slot ``slot`` (the decode's destination)."""
        return self._slots[slot]

    def buffer(self, slot: int) -> torch.Tensor:
        """The coded device buffer of ``slot`` (the transport writes a block's coded bytes here)."""
        return self._buffers[slot]

    def buffer_bytes(self) -> int:
        return self._buffers[0].numel() if self._buffers else 0

    def side_streams(self) -> list:
        return [self._dstream] if self._dstream is not None else []

    def note_load(self, tag) -> None:
        if tag is not None:
            self.captured = True

    def before_write(self, slot: int, cs, tag, after) -> None:
        """Order ``cs`` (the write into ``buffer(slot)``) after the last decode that read that
        buffer; when that decode was recorded in another capture context (or there is none),
        after the slot's release ``after``: ordered through the slot's readers."""
        if self._read_tag[slot] == tag:
            cs.wait_event(self._read[slot])
        elif after is not None:
            cs.wait_event(after)

    def written(self, k: int, slot: int, n: int, table: DecodeTable, cs, tag, after):
        """``n`` coded bytes of block ``k`` are in ``buffer(slot)`` on ``cs``: decode them into the
        slot now (on the decode stream, after the write and ``after``; or on ``cs``), or, with
        ``decode_at="use"``, note what :meth:`before_use` waits for. Returns the stream on which
        the slot (or, at use, the buffer) is complete."""
        st, what, key = self._streams, self.layouts[k].index, ("coded", slot)
        st.access("write", key, what)
        if self.decode_at == "use":
            self._copied[slot].record(cs)
            self._copied_tag[slot], self._free[slot] = tag, after
            return cs
        ds = self._dstream
        if ds is not None:
            self._copied[slot].record(cs)
            ds.wait_event(self._copied[slot])
            if after is not None:
                ds.wait_event(after)  # compute no longer reads the slot the decode writes
        with st.stream(ds if ds is not None else cs):
            st.access("read_begin", key, what)
            self.decode(self._buffers[slot][:n], self._slots[slot], table)
            st.access("read_end", key, what)
            if ds is not None:
                self._read[slot].record(ds)
                self._read_tag[slot] = tag
        return ds if ds is not None else cs

    def before_use(self, k: int, slot: int, stream, n: int, table: DecodeTable, tag=None) -> None:
        """decode_at="use": decode block ``k`` from ``buffer(slot)[:n]`` into ``slots[slot]``;
        ``stream`` (the compute stream) has waited for the load. On the decode stream (ordered
        after the write and the slot's release; ``stream`` waits for the decode), else on
        ``stream``. Every use decodes (a block run again after an exception decodes again: its
        coded buffer is not reloaded before the block's post-hook)."""
        if self.decode_at != "use" or self._streams is None:
            return
        st, ds, key, what = self._streams, self._dstream, ("coded", slot), self.layouts[k].index
        if ds is not None:
            if self._copied_tag[slot] == tag:
                ds.wait_event(self._copied[slot])
                if self._free[slot] is not None:
                    ds.wait_event(self._free[slot])
            else:  # written in another capture context: ``stream`` is ordered after it (step start)
                ds.wait_stream(stream)
        with st.stream(ds if ds is not None else stream):
            st.access("read_begin", key, what)
            self.decode(self._buffers[slot][:n], self._slots[slot], table)
            st.access("read_end", key, what)
            st.access("write", slot, what)  # the slot's write (the executor notes none at load)
            self._read[slot].record(ds if ds is not None else stream)
            self._read_tag[slot] = tag
        if ds is not None:
            stream.wait_event(self._read[slot])

    def before_raw(self, slot: int, cs, tag) -> None:
        """Before a raw block's copy into ``slots[slot]`` on ``cs``: a skipped coded block's
        decode (on the decode stream) may still write the slot."""
        if self._dstream is not None and self._read_tag[slot] == tag:
            cs.wait_stream(self._dstream)

    def raw_written(self, k: int, slot: int) -> None:
        """A raw block's copy wrote ``slots[slot]``: noted here where the executor notes none."""
        if self.writes_at_use:
            self._streams.access("write", slot, self.layouts[k].index)

    @staticmethod
    def decode(src: torch.Tensor, dst: torch.Tensor, table: DecodeTable) -> None:
        """One decode launch of ``table`` (Triton on CUDA, the plain-torch reference on the
        CPU), on the current stream."""
        decode_any(src, dst, table)

    # -- tables and sizes -----------------------------------------------------------------
    def check(self) -> None:
        """Step start / before a replay: refuse replays of captures that went stale."""
        if self.stale is not None:
            raise CodedCaptureStaleError(self.stale)

    def upload(self, k: int, table: DecodeTable | None) -> None:
        """Block ``k`` has a new table (it became coded): on the device now (between steps)."""
        if self._dev_tables:
            self._dev_tables[k] = table.upload(self.device) if table is not None and table.num_tiles else None

    def retable(self, k: int, table: DecodeTable) -> None:
        """Block ``k``'s re-encoded table into its device tensor, in place (graphs read it at replay)."""
        if not self._dev_tables or self._dev_tables[k] is None:
            return
        dev = self._dev_tables[k]
        dev.copy_(table._host)  # same size: one record per tensor, fixed tile counts
        table._device[self.device] = dev

    def fit(self, buffer_bytes: int) -> bool:
        """Buffers of at least ``buffer_bytes`` (reallocated when smaller); True when reallocated."""
        if not self._slots or buffer_bytes <= self.buffer_bytes():
            return False
        self.alloc(buffer_bytes)
        return True

    def grew(self, buffer_bytes: int, what: str) -> None:
        """Coded copies grew past what was copied before: buffers large enough, and captured
        graphs (which copy the old byte counts) stale, ``what`` saying what grew."""
        if not self._slots:  # not attached, or the executor was torn down
            return
        self.fit(buffer_bytes)
        if self.captured:
            self.stale = (f"{what} made a coded block larger than the bytes the captured CUDA graphs copy for it; "
                          "those graphs would read it truncated. disable() the model and wrap it again (or use "
                          "cuda_graphs='off')")

    def forget_captures(self) -> None:
        """Every graph captured over these buffers was dropped: nothing is stale, and a later growth
        stales only graphs captured after it."""
        self.captured = False
        self.stale = None

    def stats(self) -> dict:
        return {"coded_buffer_bytes": sum(b.numel() for b in self._buffers),
                "decode": f"at {self.decode_at}, on the " + ("decode" if self.decode_stream else
                                                               "copy" if self.decode_at == "load" else "compute")
                + " stream"}

    def remove(self) -> None:
        """Executor teardown: let go of the slots and the coded buffers."""
        self._slots, self._buffers = [], []

    def close(self) -> None:
        self._buffers = []
        self._dev_tables = []
