"""The codec part of the auto mechanism (:mod:`.auto`): ``weight_codec="auto"``.

Policy lives in :mod:`.codec` (pure); this measures what the policy needs
beyond the step's event log and applies the plan. The coded source starts
with every block raw (its plain image, copied straight into the slot: the
pinned store's bytes and speed). A sample of one block of each layout (about
64 MB, the source's ``sample``) is encoded with each codec (the block's coded
bytes, scaled) and decoded on the device (its decode rate, timed from a CUDA
graph); :func:`.codec.plan_codec` picks the codec and the blocks among those
the ring streams, and the source's ``code_blocks`` codes them: on a background
thread while the steps keep streaming raw blocks (each step start swaps in the
blocks finished by then); with CUDA graphs the steps run eager meanwhile and
the capture waits for the job (DLO: at once, before the capture). A later
plan (a new input signature, eager only) only adds coded blocks, with the
codec already chosen; with CUDA graphs the first plan holds.

``gather=True``: DLO AllGather, where every rank gathers every block, so which
blocks are coded must be the same on every rank. The policy is the same, with a
rank's view of a load: its link moves the rank's 1/N share of a block (raw, or
of the coded image), its decode writes the whole block (``decoded_bytes``).
Each rank samples one gathered block of each layout (a collective, in block
order; the encoder is deterministic: the same coded sizes everywhere) and
times its decodes; one control collective joins every rank's measurements into
the slowest (:func:`join_measurements`), so every rank gets the same plan; the
chosen blocks are coded at once, every rank alike. One plan per backend (ranks
may see different input signatures). A failure marks the backend unusable on
that rank (:meth:`.auto.AutoStep.after_agreed_step`); the host shards stay intact.
"""
from __future__ import annotations

import sys
import time

import torch

from weightstream.offload.codecs import AUTO_CODECS, CODECS
from weightstream.offload.host.encode import _ALIGN, _slack
from weightstream.offload.layout import align_up, all_tensors, tensor_bytes
from weightstream.offload.plan.codec import CodecOption, CodecPlan, CodecPlanInputs, plan_codec
from weightstream.offload.plan.measure import compute_from_events, h2d_from_events
from weightstream.offload.misuse import UnsupportedCombinationError
from weightstream.offload.progress import announce
from weightstream.offload.sources.pinned import CodedSource

__all__ = ["Coding", "join_measurements"]

_DECODE_REPS = 8  # timed decodes of a sampled block (one graph; after an eager one: the kernel compiles)


def join_measurements(rows: list[dict]) -> dict:
    """Every rank's measurements joined into the slowest: per-block compute at its largest,
    the link and each codec's decode at their slowest, each layout's coded bytes at their
    largest (they are equal: one deterministic encoder). Pure; the same result on every rank."""
    if not rows:
        raise ValueError("join_measurements: no rows; allowed: one dict per rank")
    n = {len(r["compute"]) for r in rows}
    codecs = {tuple(sorted(r["decode"])) for r in rows}
    keys = {tuple((c, tuple(sorted(r["coded"].get(c, {})))) for c in sorted(r["decode"])) for r in rows}
    if len(n) != 1 or len(codecs) != 1 or len(keys) != 1:
        raise ValueError("join_measurements: the ranks measured different things (block counts "
                         f"{sorted(n)}, codecs {sorted(codecs)}): the ranks are out of step")
    return {
        "compute": [max(r["compute"][i] for r in rows) for i in range(n.pop())],
        "h2d": min(r["h2d"] for r in rows),
        "decode": {c: min(r["decode"][c] for r in rows) for c in rows[0]["decode"]},
        "coded": {c: {key: max(r["coded"][c][key] for r in rows) for key in rows[0]["coded"][c]}
                  for c in rows[0]["coded"]},
    }


class Coding:
    """The coded blocks of the auto mechanism ``auto`` (:class:`.auto.AutoStep`): the latest
    plan, the plans per input signature, and the sampled figures (module doc)."""

    def __init__(self, auto, *, gather: bool = False):
        streamed = auto.streamed
        src = streamed.source
        if not src.caps.codes_blocks:
            raise UnsupportedCombinationError(f"weight_codec='auto' needs a source that can code its blocks in place (the pinned "
                             f"coded source of layer mode); {type(src).__name__} cannot; choose from: "
                             f"{', '.join(CODECS)}, none")
        self.auto = auto
        self.streamed = streamed
        self.gather = gather
        kind = "auto_codec_gather" if gather else "auto_codec"
        self.name = f"weightstream.{kind}[{type(streamed.module).__name__}]"
        self.active = True
        self._latest: CodecPlan | None = None
        self.plans: dict[tuple, CodecPlan] = {}  # input signature -> its plan
        self.h2d_gbps: float | None = None  # link rate to plan with (None: measured from the event log)
        self.decode_gbps: dict[str, float] | None = None  # codec -> rate (None: measured on sampled blocks)
        self.plan_s: float | None = None  # seconds the latest planning took (sampling included)
        self.plan_parts: dict[str, float] = {}  # of plan_s: sampled encodes, timed decodes, coding start
        self._samples: dict[tuple, int] = {}  # (codec, layout) -> link bytes of one coded block
        self._rates: dict[str, float] = {}  # codec -> decode rate timed on its samples (kept with them)
        self._options: dict[str, CodecOption] = {}  # the latest planning's options, by codec

    @property
    def plan(self) -> CodecPlan | None:
        """The latest plan applied (None: not planned yet)."""
        return self._latest

    def remove(self) -> None:
        """No planning (what is coded stays coded)."""
        self.active = False
        self.auto.part_removed()

    @property
    def state(self) -> str:
        return "active" if self.active else "removed"

    def can_plan(self, measuring: bool) -> bool:
        """A first plan always; later ones (a new input signature) only eager, with raw blocks left
        and no background coding running: a plan only adds coded blocks, and CUDA graphs captured
        after the first plan hold its loads. Gathered: one plan, from one measured step at a time."""
        if self.gather:
            return self._latest is None and not measuring
        if self._latest is None:
            return True
        src = self.streamed.source
        return self.streamed.config.cuda_graphs != "on" and not src.coding_active and any(src.raw)

    # -- the ring planned for --------------------------------------------------------------
    def ring_now(self) -> tuple:
        """(streamed blocks, slots, step_local) of the executor's schedule now."""
        s = self.streamed.schedule
        return tuple(s.streamed), s.ring_slots, s.step_local

    def ring_of(self, placement) -> tuple:
        """(streamed blocks, slots, step_local) of the ring a placement plan will rebuild."""
        step_local = self.streamed.config.cuda_graphs == "on" and bool(placement.resident)
        return placement.streamed, placement.slots_used, step_local

    # -- planning ----------------------------------------------------------------------
    def make_plan(self, events, ring: tuple, *, codecs: tuple | None = None) -> CodecPlan:
        """The codec plan for the blocks ``ring`` streams, from a measured step's ``events``;
        ``codecs``: the codecs to choose from (None: every auto codec, or the one the coded
        blocks have; (): none, no block is added to those coded)."""
        sb = self.streamed
        src = sb.source
        streamed, slots, step_local = ring
        on = set(streamed)
        n = len(sb.blocks)
        nbytes = {lay.index: lay.nbytes for lay in src.layouts}
        sizes = [nbytes.get(i) or max(1, sum(tensor_bytes(t) for t in all_tensors(sb.blocks[i].module)))
                 for i in range(n)]  # resident blocks: their tensors' bytes
        link = [1] * n  # what each block's copy moved in the measured step
        for k, lay in enumerate(src.layouts):
            link[lay.index] = src.link_bytes(k)
        if self.gather:
            return self._plan_gathered(events, sizes, link, on, slots, step_local, codecs)
        compute, _ = compute_from_events(events, sizes, cold_outliers=True)
        h2d = self.h2d_gbps or h2d_from_events(events, link)
        raw = [nbytes[i] if i in on else None for i in range(n)]
        fixed = tuple(sorted(lay.index for k, lay in enumerate(src.layouts) if not src.raw[k] and lay.index in on))
        add = codecs != ()
        if codecs is None or (fixed and not add):
            codecs = (src.codec,) if fixed else AUTO_CODECS  # blocks coded already fix the codec
        options = tuple(self._option(codec, raw) for codec in codecs)
        self._options = {o.name: o for o in options}
        on_compute = src.decode_at == "use" and not src.decode_stream
        inputs = CodecPlanInputs(compute_ms=compute, raw_bytes=tuple(raw), h2d_gbps=h2d, num_slots=slots,
                                 options=options, decode_on="compute" if on_compute else "side",
                                 step_local=step_local, fixed=fixed, **({} if add else {"min_gain": 1.0}))
        return plan_codec(inputs)

    def _option(self, codec: str, raw) -> CodecOption:
        """``codec``'s link bytes per streamed block (coded blocks: theirs; raw ones: one sampled
        block per layout, cached) and decode rate (given, an earlier plan's, or timed on the samples)."""
        src = self.streamed.source
        known = self.decode_gbps or (self._latest.decode_gbps if self._latest is not None else {})
        link = list(raw)
        decoded_bytes, decode_ms = 0, 0.0
        for k, lay in enumerate(src.layouts):
            if raw[lay.index] is None:
                continue  # resident: not coded by this plan
            if not src.raw[k]:
                link[lay.index] = src.link_bytes(k)
                continue
            key = (codec, _layout_key(lay))
            if key not in self._samples:
                t0 = time.perf_counter()
                coded, data, table, nbytes = src.sample(k, (codec,))[codec]
                t1 = time.perf_counter()
                self._samples[key] = min(src.capacity[k], align_up(coded + _slack(lay), _ALIGN))
                if codec not in known:
                    decoded_bytes += nbytes
                    decode_ms += _decode_ms(data, table, nbytes, src.device)
                self.plan_parts["sample_s"] += t1 - t0
                self.plan_parts["decode_s"] += time.perf_counter() - t1
            link[lay.index] = self._samples[key]
        if codec in known:
            rate = known[codec]
        elif decoded_bytes:  # timed now: kept, since the samples are (a later planning times none)
            rate = self._rates[codec] = decoded_bytes / (max(decode_ms, 1e-6) * 1e6)
        elif codec in self._rates:
            rate = self._rates[codec]
        else:  # no raw block streams: the coded ones' own bytes are timed
            rate = self._rates[codec] = self._coded_rate(codec)
        return CodecOption(codec, tuple(link), rate)

    def _coded_rate(self, codec: str) -> float:
        """``codec``'s decode rate timed on the first block the store holds coded with it."""
        src = self.streamed.source
        for k, lay in enumerate(src.layouts):
            if not src.raw[k] and src.codec == codec and src.tables[k] is not None:
                t0 = time.perf_counter()
                ms = _decode_ms(src.region(k)[: src.coded[k]], src.tables[k], lay.nbytes, src.device)
                self.plan_parts["decode_s"] += time.perf_counter() - t0
                return lay.nbytes / (max(ms, 1e-6) * 1e6)
        raise ValueError(f"weight_codec='auto': no block to time {codec!r}'s decode on (every streamed block is "
                         "coded with another codec); give the rate (codec planner decode_gbps)")

    def _plan_gathered(self, events, sizes, link, on, slots, step_local, codecs) -> CodecPlan:
        """Every rank's measurements joined (one control collective), then the same plan everywhere."""
        sb = self.streamed
        src = sb.source
        n = len(sb.blocks)
        events = [ev for ev in events if ev["lane"] in ("copy", "compute")]  # not the gathers' lane
        compute, _ = compute_from_events(events, sizes, cold_outliers=True)
        mine = {"compute": list(compute), "h2d": self.h2d_gbps or h2d_from_events(events, link),
                **self._sample(AUTO_CODECS)}
        rows = sb.control.gather_json(mine, "the DLO agreement on the codec plan")
        src.ncoll += 1  # every rank issued it (the guard compares the counts at each step's end)
        got = join_measurements(rows)
        share = [link[i] if i in on else None for i in range(n)]  # this rank's raw share of a streamed block
        decoded = [sizes[i] if i in on else None for i in range(n)]  # a decode writes the whole image
        options = []
        for codec in AUTO_CODECS if codecs is None else codecs:
            coded = list(share)
            for k, lay in enumerate(src.layouts):
                if lay.index in on:
                    coded[lay.index] = src.coded_shard_bytes(k, got["coded"][codec][_key_name(lay)])
            options.append(CodecOption(codec, tuple(coded), got["decode"][codec]))
        self._options = {o.name: o for o in options}
        inputs = CodecPlanInputs(compute_ms=tuple(got["compute"]), raw_bytes=tuple(share), h2d_gbps=got["h2d"],
                                 num_slots=slots, options=tuple(options), decode_on="side",
                                 step_local=step_local, decoded_bytes=tuple(decoded))
        return plan_codec(inputs)

    def _sample(self, codecs) -> dict:
        """Gathered: one raw block of each layout gathered (a collective, in block order) and
        encoded with each codec: the whole block's coded bytes per layout; each codec's decode
        rate timed on this rank's device (or given: ``decode_gbps``)."""
        src = self.streamed.source
        coded = {c: {} for c in codecs}
        decoded_bytes, decode_ms = dict.fromkeys(codecs, 0), dict.fromkeys(codecs, 0.0)
        for k, lay in enumerate(src.layouts):
            key = _key_name(lay)
            if key in coded[codecs[0]]:
                continue
            t0 = time.perf_counter()
            samples = src.sample(k, codecs)
            t1 = time.perf_counter()
            for c, (nbytes_coded, data, table, nbytes) in samples.items():
                coded[c][key] = nbytes_coded
                if not self.decode_gbps:
                    decoded_bytes[c] += nbytes
                    decode_ms[c] += _decode_ms(data, table, nbytes, src.device)
            self.plan_parts["sample_s"] += t1 - t0
            self.plan_parts["decode_s"] += time.perf_counter() - t1
        rates = {c: self.decode_gbps[c] if self.decode_gbps else
                 decoded_bytes[c] / (max(decode_ms[c], 1e-6) * 1e6) for c in codecs}
        return {"coded": coded, "decode": rates}

    def staging_bytes(self, plan: CodecPlan | None, slots: int) -> int:
        """Device bytes the decode stage's coded buffers take under ``plan`` (None: as coded now):
        one per slot, sized to the largest coded copy, those coded already included (0 with
        nothing coded)."""
        src = self.streamed.source
        now = max((src.link_bytes(k) for k, raw in enumerate(src.raw) if not raw), default=0)
        opt = self._options.get(plan.codec) if plan is not None and plan.codec else None
        planned = max((opt.coded_bytes[i] for i in plan.coded if opt.coded_bytes[i] is not None),
                      default=0) if opt is not None else 0
        return slots * max(now, planned)

    # -- applying ------------------------------------------------------------------------
    def announce(self, sig, plan: CodecPlan, *, show: bool = True) -> None:
        self.plans[sig] = plan
        announce("auto codec", plan.describe(), self.streamed.config.progress and show)

    def apply(self, plan: CodecPlan, *, show: bool = True) -> None:
        """Code the blocks ``plan`` adds; ``show``: print that (and the coding's progress)."""
        self._latest = plan
        if not plan.added:
            return
        sb = self.streamed
        sb.executor.synchronize()
        background = self.background()
        show = show and sb.config.progress
        if background and show:
            print(f"weightstream auto codec: coding {len(plan.added)} blocks with {plan.codec} in the background; "
                  "the steps stream them raw until each is coded", file=sys.stderr)
        sb.source.code_blocks([sb.executor.k_of[i] for i in plan.added], plan.codec,
                              progress=show, background=background)

    def raw_stream_hidden(self, events, ring: tuple) -> bool:
        """Whether the measured step's compute covers the raw link time of the blocks ``ring``
        streams (``ring_now`` / ``ring_of``): coding them cannot make the step faster."""
        sb = self.streamed
        src = sb.source
        n = len(sb.blocks)
        link = [1] * n
        sizes = [max(1, sum(tensor_bytes(t) for t in all_tensors(sb.blocks[i].module))) for i in range(n)]
        for k, lay in enumerate(src.layouts):
            link[lay.index] = src.link_bytes(k)
            sizes[lay.index] = lay.nbytes
        events = [ev for ev in events if ev["lane"] in ("copy", "compute")]  # not the gathers' lane
        compute, _ = compute_from_events(events, sizes, cold_outliers=True)
        h2d = self.h2d_gbps or h2d_from_events(events, link)
        return sum(compute) >= sum(link[i] for i in set(ring[0])) / (h2d * 1e6)

    def background(self) -> bool:
        """Code in the background; CUDA graphs capture once it is done (graphs.runner: eager-settling
        steps meanwhile), except where ranks must agree on each capture (DLO): coded at once."""
        sb = self.streamed
        if self.gather:
            return False  # every rank switches a block to coded at the same step
        return sb.config.cuda_graphs != "on" or sb.executor.guard is None

    def stats(self) -> dict:
        if self._latest is None:
            return {}
        return {"codec_plan": {**self._latest.stats(), "plan_s": self.plan_s,
                               "plan_parts_s": dict(self.plan_parts), "signatures": len(self.plans)}}

    def __repr__(self) -> str:
        if self._latest is None:
            what = "not planned yet"
        else:
            what = f"{len(self._latest.coded)} blocks coded with {self._latest.codec}" if self._latest.codec else "nothing coded"
        return f"Coding({self.name}, {what}, {self.state})"


def _layout_key(lay) -> tuple:
    return tuple((s.dtype, tuple(s.shape), s.nbytes) for s in lay.tensors)


def _key_name(lay) -> str:
    """A layout's key as a JSON object key (the same string on every rank)."""
    return repr(_layout_key(lay))


def _decode_ms(data: torch.Tensor, table, nbytes: int, device: torch.device) -> float:
    """Milliseconds one decode of ``data`` takes on ``device``: on CUDA the mean of
    :data:`_DECODE_REPS` launches replayed from one CUDA graph (a sampled block decodes in tens
    of microseconds, about what a launch from Python takes: timed eager, exp-k read 501 GB/s
    instead of its 800; docs/performance.md), after an eager one (the kernel compiles)."""
    if table.num_tiles == 0:
        return 0.0
    if device.type == "cuda":
        src = data.to(device)
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        table.upload(device)
        CodedSource.decode_table(src, out, table)  # compiles the kernel
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may pin meanwhile
            for _ in range(_DECODE_REPS):
                CodedSource.decode_table(src, out, table)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()  # the first replay uploads the graph
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / _DECODE_REPS
    out = torch.empty(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    CodedSource.decode_table(data, out, table)
    return (time.perf_counter() - t0) * 1e3
