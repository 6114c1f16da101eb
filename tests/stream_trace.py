"""Happens-before checker over a :class:`RecordingStreams` trace (tests only).

The trace is the list of stream operations in the order the host issued them.
Happens-before (HB) is built with vector clocks, as CUDA orders work:

- per stream, program order;
- ``event.record(s)`` snapshots ``s``'s clock; a later ``t.wait_event(event)``
  joins the *latest record issued before the wait* into ``t`` (waiting on an
  event never recorded orders nothing, as in CUDA);
- ``t.wait_stream(s)`` joins ``s``'s clock at that moment into ``t``;
- ``s.synchronize()`` / ``event.synchronize()`` join into the host's clock,
  which every later-issued operation joins (the host issues it afterwards).

Nothing here looks at when a CPU copy ran: on the CPU every copy is
synchronous, so only the recorded order of stream operations can tell a
correct schedule from a broken one.

Rules (each a key of :func:`check`'s result, a list of violations):

- ``read_after_load``: every read of a slot (``read_begin``) happens after a
  write of the block it expects into that slot;
- ``write_after_previous_read``: every write into a slot happens after the
  end of the previous reader of that slot (the last read issued before it);
- ``no_concurrent_write``: no write into a slot is concurrent with any read
  of it (each pair is ordered one way: write before read_begin, or read_end
  before write);
- ``reads_expected_block``: among the writes into a slot that happen before
  a read, there is one latest, and it wrote the block the read expects;
- ``overlap``: no read waits for a write issued after the write it reads
  (a prefetch must not be serialised in front of the compute before it).

A read whose ``read_end`` never came (a block that raised) ends at its
``read_begin``: nothing else was issued on its stream in between, and what a
later ``wait_stream`` or event record captures includes the block's kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from weightstream.offload.streams import Op

RULES = ("read_after_load", "write_after_previous_read", "no_concurrent_write", "reads_expected_block", "overlap")


def _join(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


@dataclass
class Stamped:
    """An operation with its stream, sequence number on that stream and vector clock."""

    op: Op
    seq: int
    clock: dict


def stamp(trace: list[Op]) -> list[Stamped | None]:
    """Vector clocks of every stream operation (None for host waits)."""
    clocks: dict[str, dict] = {}
    events: dict[int, dict] = {}
    host: dict = {}
    out: list[Stamped | None] = []
    for op in trace:
        if op.kind == "sync_stream":
            host = _join(host, clocks.get(op.stream, {}))
            out.append(None)
            continue
        if op.kind == "sync_event":
            host = _join(host, events.get(op.event, {}))
            out.append(None)
            continue
        c = _join(clocks.get(op.stream, {}), host)
        if op.kind == "wait_event":
            c = _join(c, events.get(op.event, {}))
        elif op.kind == "wait_stream":
            c = _join(c, clocks.get(op.other, {}))
        elif op.kind not in ("record", "access"):
            raise ValueError(f"trace op {op.index}: kind={op.kind!r} is not a known stream operation")
        c[op.stream] = c.get(op.stream, 0) + 1
        clocks[op.stream] = c
        if op.kind == "record":
            events[op.event] = c
        out.append(Stamped(op, c[op.stream], c))
    return out


def hb(a: Stamped, b: Stamped) -> bool:
    """``a`` happens before ``b`` (strictly)."""
    if a.op.index == b.op.index:
        return False
    return b.clock.get(a.op.stream, 0) >= a.seq


@dataclass
class Read:
    begin: Stamped
    end: Stamped  # the read_begin itself when the block never finished

    @property
    def slot(self):
        return self.begin.op.slot

    @property
    def what(self):
        return self.begin.op.what


@dataclass
class Accesses:
    writes: dict = field(default_factory=dict)  # slot -> [Stamped]
    reads: dict = field(default_factory=dict)  # slot -> [Read]


def accesses(trace: list[Op]) -> Accesses:
    stamped = stamp(trace)
    acc = Accesses()
    open_reads: dict = {}
    for s in stamped:
        if s is None or s.op.kind != "access":
            continue
        kind, slot = s.op.access, s.op.slot
        if kind == "write":
            acc.writes.setdefault(slot, []).append(s)
        elif kind == "read_begin":
            if slot in open_reads:  # the previous reader never finished (an exception)
                prev = open_reads.pop(slot)
                acc.reads.setdefault(slot, []).append(Read(prev, prev))
            open_reads[slot] = s
        elif kind == "read_end":
            begin = open_reads.pop(slot, None)
            if begin is None or begin.op.stream != s.op.stream:
                raise ValueError(f"trace op {s.op.index}: read_end of slot {slot!r} without a read_begin on its stream")
            acc.reads.setdefault(slot, []).append(Read(begin, s))
    for slot, begin in open_reads.items():
        acc.reads.setdefault(slot, []).append(Read(begin, begin))
    for reads in acc.reads.values():
        reads.sort(key=lambda r: r.begin.op.index)
    return acc


def _name(s: Stamped) -> str:
    o = s.op
    return f"#{o.index} {o.access} slot={o.slot!r} block={o.what!r} on {o.stream}"


def check(trace: list[Op]) -> dict[str, list[str]]:
    """Violations of every rule (see the module docstring), keyed by rule."""
    acc = accesses(trace)
    out: dict[str, list[str]] = {r: [] for r in RULES}
    every_write = sorted((w for ws in acc.writes.values() for w in ws), key=lambda w: w.op.index)
    for slot in sorted(set(acc.writes) | set(acc.reads), key=repr):
        writes, reads = acc.writes.get(slot, []), acc.reads.get(slot, [])
        _check_reads(writes, reads, every_write, out)
        _check_writes(writes, reads, out)
    return out


def _check_reads(writes: list[Stamped], reads: list[Read], every_write: list[Stamped], out: dict) -> None:
    for r in reads:
        before = [w for w in writes if hb(w, r.begin)]
        if not any(w.op.what == r.what for w in before):
            out["read_after_load"].append(f"{_name(r.begin)}: no write of block {r.what!r} happens before it")
        latest = [w for w in before if not any(hb(w, v) for v in before)]
        if len(latest) != 1 or latest[0].op.what != r.what:
            out["reads_expected_block"].append(
                f"{_name(r.begin)} sees the writes {[_name(w) for w in latest]} as latest, expected exactly one of "
                f"block {r.what!r}")
        if latest:
            own = max(latest, key=lambda w: w.op.index)
            later = [w for w in every_write if w.op.index > own.op.index and hb(w, r.begin)]
            if later:
                out["overlap"].append(f"{_name(r.begin)} waits for {_name(later[0])}, issued after its own load")


def _check_writes(writes: list[Stamped], reads: list[Read], out: dict) -> None:
    for w in writes:
        earlier = [r for r in reads if r.begin.op.index < w.op.index]
        if earlier and not hb(earlier[-1].end, w):
            out["write_after_previous_read"].append(
                f"{_name(w)} is not ordered after the previous reader's end {_name(earlier[-1].end)}")
        for r in reads:
            if not (hb(w, r.begin) or hb(r.end, w)):
                out["no_concurrent_write"].append(f"{_name(w)} is concurrent with the read {_name(r.begin)}")


def counts(trace: list[Op]) -> dict[str, int]:
    """Number of reads and writes per access kind (tests check the trace is not empty)."""
    acc = accesses(trace)
    return {"writes": sum(map(len, acc.writes.values())), "reads": sum(map(len, acc.reads.values()))}
