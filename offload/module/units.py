"""A unit (one swapped component or split part) and the host bytes of every unit.

:class:`Unit` is one unit's tensors, layout and device state; arriving rebinds
each tensor (``.data``, identity kept) to its aligned view of a fresh buffer,
departing rebinds it to an empty placeholder and drops the buffer (no D2H copy:
the host master is unchanged).

:class:`UnitImages` owns the host masters: a :class:`~..host.arena.HostStore`
image per unit (every tensor 512-byte aligned, pinned once), or with
``weight_codec`` a :class:`~..sources.pinned.CodedSource` over the unit layouts;
and it fills an arriving unit's buffer from them (on CUDA on side streams,
ordered by events, never a synchronize).
"""
from __future__ import annotations

import dataclasses
import os
import types
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from weightstream.offload.host.registration import empty_host
from weightstream.offload.host.arena import HostStore, copy_from_image
from ..progress import Progress
from weightstream.offload.sources.pinned import CodedSource
from weightstream.offload.codecs import module_codec
from ..placeholders import drop_storage

# config component name -> discovered kinds it selects
SWAPPED_KINDS = ("dit", "text_encoder")
CPU_ALIGN = 4096
PARALLEL_PACK_BYTES = 64 << 20  # below this, packing on one thread is faster than a pool
# per unit and in total in stats() under weight_codec != "none"
CODED_STATS = ("coded_bytes", "raw_bytes", "bits_per_weight", "host_bytes")


class Unit:
    """One swapped component (or part): its tensors, host image and device state."""

    def __init__(self, name: str, kind: str, module: nn.Module, group: str | None):
        self.name, self.kind, self.module, self.group = name, kind, module, group
        self.swapped = kind in SWAPPED_KINDS  # vae units arrive once and stay
        self.index = -1
        self.tensors: list[torch.Tensor] = []
        self.layout = None
        self.excludes: list[Unit] = []
        self.buffer: torch.Tensor | None = None
        self.loaded = None  # torch.cuda.Event of the last arrival copy
        self.active = 0  # forwards of the component running now
        self.pins = 0  # open using() contexts
        self.arrivals = 0
        self.departures = 0
        self.host_version: int | None = None  # the host images' version its device copy was made from
        # what the tensors are between arrivals (shape kept, no storage; ..placeholders), once set up
        self.placeholders = None

    @property
    def on_device(self) -> bool:
        return self.buffer is not None

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def busy(self) -> bool:
        return self.active > 0 or self.pins > 0

    def bind(self, buffer: torch.Tensor) -> None:
        """Every tensor to its view of ``buffer`` (runs on the host while the copy is in flight);
        on only once all are rebound, so an interrupted bind is redone by the next arrival."""
        for t, v in zip(self.tensors, typed_views(buffer, self.layout)):
            if self.placeholders is not None:
                self.placeholders.bound(t)  # its own class first: a placeholder's .data = v is a write
            t.data = v
        self.buffer = buffer

    def unbind(self, device: torch.device) -> None:
        """Every tensor to an empty placeholder; the buffer goes back to the allocator.
        Off first: a departure interrupted half way (KeyboardInterrupt) leaves the unit off,
        so its next use rebinds every tensor again."""
        self.buffer = None
        drop_storage(self.tensors, device)
        if self.placeholders is not None:
            for t in self.tensors:
                self.placeholders.unbound(t)


def typed_views(buffer: torch.Tensor, layout) -> list[torch.Tensor]:
    """Strided views of every tensor of ``layout`` inside a uint8 ``buffer``.

    One typed view of the whole buffer per dtype, then one ``as_strided`` per
    tensor (offsets are 512-byte aligned, so they divide every itemsize; the
    buffer itself starts 512-byte aligned, see :func:`aligned_cpu_buffer`).
    """
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for spec in layout.tensors:
        size = spec.dtype.itemsize
        base = typed.get(spec.dtype)
        if base is None:
            base = typed[spec.dtype] = buffer[: buffer.numel() // size * size].view(spec.dtype)
        out.append(torch.as_strided(base, spec.shape, spec.stride, base.storage_offset() + spec.offset // size))
    return out


def _single(spec):
    """A one-tensor layout whose tensor starts at byte 0 (for :func:`typed_views`)."""
    return types.SimpleNamespace(tensors=(dataclasses.replace(spec, offset=0),))


def aligned_cpu_buffer(nbytes: int, what: str) -> torch.Tensor:
    raw = empty_host(nbytes + CPU_ALIGN, what)
    skip = (-raw.data_ptr()) % CPU_ALIGN
    return raw[skip : skip + nbytes]


class UnitImages:
    """The host masters of ``units`` (layouts set, in layout index order) and arrivals from them.

    ``codec``: the config's ``weight_codec`` ("none": packed images). ``pin``, ``budget``:
    pin the host bytes, within at most ``budget`` bytes (None: no cap). On failure every
    dropped tensor gets its weights back before the error propagates.
    """

    def __init__(self, units: list[Unit], device: torch.device, *, codec: str, pin: bool,
                 budget: int | None, progress: bool | None):
        self.units, self.device = units, device
        self.cuda = device.type == "cuda"
        self.store: HostStore | None = None  # the packed images (weight_codec="none")
        self.coded: CodedSource | None = None  # or the coded images (weight_codec="exp-k" / "exp-k2")
        layouts = [u.layout for u in units]
        if codec != "none" and layouts:
            self.coded = CodedSource(
                layouts, [u.tensors for u in units], device=device, pin=pin, budget_bytes=budget,
                progress=progress, drop=lambda ts: drop_storage(ts, device), decode_stream=False,
                codec=module_codec(codec),
            )  # encoded on worker threads; on failure it gives every dropped tensor its weights back
        else:
            self.store = HostStore(layouts, pin=pin, budget_bytes=budget)
            self._pack_all(progress)

    def start_streams(self) -> None:
        """The side streams and events of CUDA arrivals (once setup succeeded)."""
        if not self.cuda:
            return
        self.copy_stream = torch.cuda.Stream(self.device)
        for u in self.units:
            u.loaded = torch.cuda.Event()
        if self.coded is not None:
            self.decode_stream = torch.cuda.Stream(self.device)
            self._run_copied = torch.cuda.Event()

    # ---------------------------------------------------------------- setup
    def _pack_all(self, progress: bool | None) -> None:
        """Copy every unit's tensors into its image, drop the originals, pin.

        Copies run on worker threads (page-fault and memcpy bound; torch
        copies release the GIL); dropping and pinning stay on this thread in
        unit order. On failure every dropped tensor gets its weights back.
        """
        units = self.units
        bar = Progress(f"packing {len(units)} components into host memory", self.store.nbytes, progress)
        jobs = [(u, spec, t) for u in units for spec, t in zip(u.layout.tensors, u.tensors)]
        total = sum(spec.nbytes for _, spec, _ in jobs)
        workers = max(1, min(8, os.cpu_count() or 1)) if total >= PARALLEL_PACK_BYTES else 1
        done: list[Unit] = []

        def copy_one(job) -> None:
            u, spec, t = job
            with torch.no_grad():
                spec.view_of(self.store.image(u.index)).copy_(t.detach())

        try:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightstream-pack") as pool:
                futures = {id(u): [] for u in units}
                for job in jobs:
                    futures[id(job[0])].append(pool.submit(copy_one, job))
                for u in units:
                    for f in futures[id(u)]:
                        f.result()
                    drop_storage(u.tensors, self.device)  # the store is now the one host copy
                    done.append(u)
                    self.store.pin(u.index)
                    bar.update(u.nbytes)
        except BaseException:
            with torch.no_grad():  # nothing lost: give dropped tensors their weights back
                for u in done:
                    self.give_back(u)
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            self.store.close()
            raise

    def give_back(self, u: Unit) -> None:
        """Every tensor of ``u`` gets its own device allocation, filled from the host image."""
        image = self.store.image(u.index) if self.coded is None else self.coded.image(u.index)
        if u.placeholders is not None:
            u.placeholders.release_all(u.tensors)
        for t, spec in zip(u.tensors, u.layout.tensors):
            raw = torch.empty(spec.nbytes, dtype=torch.uint8, device=self.device)
            copy_from_image(raw, image, spec.offset)
            t.data = typed_views(raw, _single(spec))[0]

    def host_views(self) -> dict[int, torch.Tensor]:
        """id(tensor) -> its view of the host image (zero-copy; coded: of its decoded host copy,
        decoded on first use, edits re-encoded before the next arrival), for state_dict()."""
        if self.coded is not None:
            return self.coded.host_views()
        return {id(t): spec.view_of(self.store.image(u.index))
                for u in self.units for t, spec in zip(u.tensors, u.layout.tensors)}

    def write(self, u: Unit, index: int, value: torch.Tensor) -> None:
        """Tensor ``index`` of ``u``'s host master = ``value`` (coded: re-encoded before the next
        arrival); an edit made on the device (offload/adapters.py UnitEdits)."""
        if self.coded is not None:
            self.coded.write(u.index, index, value)
        else:
            u.layout.tensors[index].view_of(self.store.image(u.index)).copy_(value)

    def host_version(self) -> int:
        """An int that moves when a host view (a ``state_dict()`` tensor) is edited in place: the
        arena's version counter, which every view of it shares; coded: the source's, once the
        decoded host copies edited in place are re-encoded (its ``check``)."""
        if self.coded is None:
            return self.store.arena._version
        self.coded.check()
        return self.coded.host_version()

    # ---------------------------------------------------------------- arrivals
    def load(self, u: Unit, run_bytes: int) -> torch.Tensor:
        """A fresh buffer with ``u``'s image; on CUDA filled on the side streams (one H2D copy
        of the image; or, coded, see :meth:`_load_coded`), ``u.loaded`` recorded after it and
        waited on by the compute stream."""
        if self.coded is not None:
            self.coded.check()  # state_dict() copies edited in place are re-encoded first
        if not self.cuda:
            buf = aligned_cpu_buffer(u.nbytes, f"the CPU buffer of {u.name!r}")
            if self.coded is None:
                buf.copy_(self.store.image(u.index))
            else:  # the same runs and tables as on CUDA, decoded straight from the host region
                region = self.coded.region(u.index)
                for _, _, table in self.coded.runs(u.index, run_bytes):
                    self.coded.decode_table(region, buf, table)
            return buf
        compute = torch.cuda.current_stream(self.device)
        buf = torch.empty(u.nbytes, dtype=torch.uint8, device=self.device)
        # the new buffer may reuse memory that kernels of a unit that just left still read
        self.copy_stream.wait_stream(compute)
        if self.coded is not None:
            self._load_coded(u, buf, compute, run_bytes)
        else:
            with torch.cuda.stream(self.copy_stream):
                copy_from_image(buf, self.store.image(u.index), 0)
                u.loaded.record(self.copy_stream)
        compute.wait_event(u.loaded)
        return buf

    def _load_coded(self, u: Unit, buf: torch.Tensor, compute, run_bytes: int) -> None:
        """``u``'s coded bytes H2D into a staging buffer on the copy stream, in runs of about
        ``run_bytes`` cut between tensors, each run decoded into ``buf`` on the decode
        stream once copied (run i+1's copy overlaps run i's decode); ``u.loaded`` after the last
        decode. Staging is allocated per arrival from the compute stream's pool and
        ``record_stream``-ed on both side streams: no device memory is held for it between
        arrivals (a reused buffer would keep ~0.7x the largest unit on the device for good)."""
        k, region = u.index, self.coded.region(u.index)
        runs = self.coded.runs(k, run_bytes)
        staging = torch.empty(max(runs[-1][1], 1), dtype=torch.uint8, device=self.device)
        self.decode_stream.wait_stream(compute)
        for start, end, table in runs:
            with torch.cuda.stream(self.copy_stream):
                copy_from_image(staging[start:end], region, start)
                self._run_copied.record(self.copy_stream)
            self.decode_stream.wait_event(self._run_copied)  # waits on this record, not later ones
            with torch.cuda.stream(self.decode_stream):
                self.coded.decode_table(staging, buf, table)
        u.loaded.record(self.decode_stream)
        staging.record_stream(self.copy_stream)
        staging.record_stream(self.decode_stream)

    def moved_bytes(self, u: Unit) -> int:
        """Bytes an arrival of ``u`` copies host to device."""
        return u.nbytes if self.coded is None else self.coded.coded[u.index]

    def staging_bytes(self) -> int:
        """Device bytes an arrival holds besides the unit: its coded bytes until decoded."""
        return 0 if self.coded is None else max(self.coded.copy_bytes)

    # ---------------------------------------------------------------- stats
    def unit_stats(self, u: Unit) -> dict:
        """``pinned``, and under a codec the :data:`CODED_STATS` of ``u``."""
        if self.coded is None:
            return {"pinned": self.store.is_pinned(u.index)}
        coded = self.coded.block_stats(u.index)
        return {"pinned": coded["pinned_bytes"] > 0, **{k: coded[k] for k in CODED_STATS}}

    def totals(self) -> dict:
        """host_bytes (packed bytes, or coded bytes page-rounded per unit), pinned_bytes,
        pin_failure; under a codec also the coded totals and encode_s."""
        if self.coded is None:
            return {"host_bytes": self.store.nbytes, "pinned_bytes": self.store.pinned_bytes,
                    "pin_failure": self.store.pin_failure}
        coded = self.coded.stats()
        out = {"host_bytes": coded["host_bytes"], "pinned_bytes": coded["pinned_bytes"],
               "pin_failure": self.coded.pin_failure}
        out.update({k: coded[k] for k in CODED_STATS if k != "host_bytes"})
        out["encode_s"] = coded["encode_s"]
        return out

    # ---------------------------------------------------------------- teardown
    def wait_copies(self) -> None:
        """Wait for in-flight arrival copies (and decodes); teardown only."""
        if self.cuda:
            self.copy_stream.synchronize()
            if self.coded is not None:
                self.decode_stream.synchronize()

    def close(self) -> None:
        """Release the host masters (callers made sure no copy still reads them)."""
        if self.coded is not None:
            self.coded.close()
            self.coded = None  # let the coded arena go
        else:
            self.store.close()
