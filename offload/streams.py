"""Stream/event backends: the one seam through which the controller orders its work.

The executor and the weight sources issue every stream and event operation
through a backend object (``executor.streams``):

- ``new_stream(device)``, ``new_event()``, ``current_stream(device)``;
- ``stream(s)``: a context manager making ``s`` the current stream;
- on the objects these return: ``event.record(stream)``,
  ``stream.wait_event(event)``, ``stream.wait_stream(other)``,
  ``stream.synchronize()``, ``event.synchronize()``;
- ``access(kind, slot, what)``: a note that the current stream writes
  (``"write"``) or starts / stops reading (``"read_begin"`` / ``"read_end"``)
  the bytes of ``slot`` (a device buffer: an int for a block slot, a tuple
  such as ``("shard", 0)`` for other buffers); ``what`` names the content
  (the block id written or expected).

:class:`CudaStreams` is a pass-through to ``torch.cuda`` (its attributes *are*
the torch functions; ``access`` does nothing), so the per-block path issues
the same CUDA calls as without the seam. :class:`RecordingStreams` runs on
the CPU: nothing is asynchronous, every operation is appended, with the
stream it was issued on, to ``trace`` (a list of :class:`Op`), so that tests
can check the happens-before order of the stream operations themselves (see
``tests/stream_trace.py``), not the order in which synchronous CPU copies
happened. Graph capture, ``record_stream`` and other CUDA-only calls stay on
the CUDA path.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

ACCESS_KINDS = ("write", "read_begin", "read_end")


class StreamBackend(Protocol):
    """What the executor and the sources call (see the module docstring)."""

    def new_stream(self, device: torch.device) -> Any: ...

    def new_event(self) -> Any: ...

    def current_stream(self, device: torch.device) -> Any: ...

    def stream(self, stream: Any) -> contextlib.AbstractContextManager: ...

    def access(self, kind: str, slot: Any, what: Any) -> None: ...


def _no_access(kind: str, slot: Any, what: Any) -> None:
    return None


class CudaStreams:
    """torch.cuda streams and events, passed through unchanged."""

    name = "cuda"

    def __init__(self):
        self.new_stream = torch.cuda.Stream
        self.new_event = torch.cuda.Event
        self.current_stream = torch.cuda.current_stream
        self.stream = torch.cuda.stream
        self.access = _no_access

    def __repr__(self) -> str:
        return "CudaStreams()"


def default_streams(device: torch.device) -> CudaStreams | None:
    """The backend a device gets by default: CUDA streams on CUDA, none on the CPU
    (synchronous copies, no stream operations at all)."""
    return CudaStreams() if torch.device(device).type == "cuda" else None


def resolve_streams(streams, device: torch.device):
    """``streams`` checked against ``device`` (None: :func:`default_streams`).

    CUDA tensors need :class:`CudaStreams` (their copies really are
    asynchronous); CPU tensors take :class:`RecordingStreams` or none.
    """
    device = torch.device(device)
    if streams is None:
        return default_streams(device)
    cuda = device.type == "cuda"
    if cuda and not isinstance(streams, CudaStreams):
        raise ValueError(
            f"streams={streams!r} is not allowed on device={str(device)!r}; allowed: CudaStreams() or None")
    if not cuda and not isinstance(streams, RecordingStreams):
        raise ValueError(
            f"streams={streams!r} is not allowed on device={str(device)!r}; allowed: RecordingStreams() or None")
    return streams


@dataclass(frozen=True)
class Op:
    """One recorded stream operation, in issue order.

    kind: ``record`` (event recorded on stream), ``wait_event``,
    ``wait_stream`` (stream waits for ``other``), ``access`` (``access`` is
    write / read_begin / read_end of ``slot`` holding ``what``),
    ``sync_stream`` / ``sync_event`` (the host waits for a stream / an event).
    """

    index: int
    kind: str
    stream: str | None
    event: int | None = None
    other: str | None = None
    access: str | None = None
    slot: Any = None
    what: Any = None


class RecStream:
    """A recorded stream: operations on it are appended to its backend's trace."""

    def __init__(self, backend: "RecordingStreams", name: str):
        self.backend, self.name = backend, name

    def wait_event(self, event: "RecEvent") -> None:
        if not isinstance(event, RecEvent):
            raise TypeError(f"wait_event(event={event!r}): expected a RecEvent of this backend")
        self.backend._add("wait_event", self.name, event=event.id)

    def wait_stream(self, other: "RecStream") -> None:
        if not isinstance(other, RecStream):
            raise TypeError(f"wait_stream(other={other!r}): expected a RecStream of this backend")
        self.backend._add("wait_stream", self.name, other=other.name)

    def synchronize(self) -> None:
        self.backend._add("sync_stream", self.name)

    def __repr__(self) -> str:
        return f"RecStream({self.name})"


class RecEvent:
    """A recorded event; ``record(None)`` records on the current stream, as torch does."""

    def __init__(self, backend: "RecordingStreams", ident: int):
        self.backend, self.id = backend, ident

    def record(self, stream: RecStream | None = None) -> None:
        if stream is None:
            stream = self.backend.current
        if not isinstance(stream, RecStream):
            raise TypeError(f"record(stream={stream!r}): expected a RecStream of this backend")
        self.backend._add("record", stream.name, event=self.id)

    def synchronize(self) -> None:
        self.backend._add("sync_event", None, event=self.id)

    def __repr__(self) -> str:
        return f"RecEvent({self.id})"


class _Current(threading.local):
    """A thread's current stream (``stream`` in each thread until it sets its own)."""

    def __init__(self, stream: RecStream):
        self.stream = stream


class RecordingStreams:
    """CPU stand-in for CUDA streams: performs nothing asynchronous, records
    every stream/event operation (and every ``access`` note) into ``trace``."""

    name = "recording"

    def __init__(self):
        self.trace: list[Op] = []
        self.compute = RecStream(self, "compute")
        self._local = _Current(self.compute)  # the current stream is per thread, as torch's is
        self._streams = 0
        self._events = 0

    @property
    def current(self) -> RecStream:
        return self._local.stream

    @current.setter
    def current(self, stream: RecStream) -> None:
        self._local.stream = stream

    def _add(self, kind: str, stream: str | None, **kw) -> None:
        self.trace.append(Op(len(self.trace), kind, stream, **kw))

    def new_stream(self, device=None) -> RecStream:
        self._streams += 1
        return RecStream(self, f"side{self._streams}")

    def new_event(self, **kw) -> RecEvent:
        self._events += 1
        return RecEvent(self, self._events)

    def current_stream(self, device=None) -> RecStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: RecStream):
        if not isinstance(stream, RecStream):
            raise TypeError(f"stream(stream={stream!r}): expected a RecStream of this backend")
        prev, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = prev

    def access(self, kind: str, slot: Any, what: Any) -> None:
        if kind not in ACCESS_KINDS:
            raise ValueError(f"access(kind={kind!r}) is not allowed; choose from: {', '.join(ACCESS_KINDS)}")
        self._add("access", self.current.name, access=kind, slot=slot, what=what)

    def __repr__(self) -> str:
        return f"RecordingStreams({len(self.trace)} ops)"
