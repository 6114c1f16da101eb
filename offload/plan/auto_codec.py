"""``weight_codec="auto"``: code the streamed blocks a measured step needs.

Policy lives in :mod:`.codec_plan` (pure); this is the mechanism. The coded
source starts with every block raw (its plain image, copied straight into the
slot: the pinned store's bytes and speed). The first eager step (with CUDA
graphs: the warm-up step, before any capture) is measured through the
executor's event log: per-block compute and the link rate. A sample of one
block of each layout (about 64 MB, :meth:`CodedSource.sample`) is then encoded
with each codec (the block's coded bytes, scaled) and decoded on the device
(its decode rate, timed from a CUDA graph); :func:`codec_plan.plan_codec` picks the codec and the
blocks, and :meth:`CodedSource.code_blocks` codes them on a background thread
while the steps keep streaming raw blocks (each step start swaps in the blocks
finished by then); with CUDA graphs the steps run eager meanwhile and the
capture waits for the job (DLO, whose ranks agree on each capture: at once,
before the capture). A new input signature (another resolution) is measured and planned
again, eager only: a later plan only adds coded blocks, with the codec already
chosen (the blocks coded stay coded); with CUDA graphs the first plan holds (graphs
captured after it stay valid). Each plan and its prediction are printed; the latest is in
``stats()["codec_plan"]``. Outputs are the same bytes whatever is coded.
"""
from __future__ import annotations

import sys
import time

import torch

from weightstream.offload.plan import placement as planner
from weightstream.offload.plan.auto_placement import signature
from weightstream.offload.hooks import RemovableHooks
from weightstream.offload.progress import announce
from weightstream.offload.layout import all_tensors, tensor_bytes
from weightstream.offload.plan.codec import CodecOption, CodecPlan, CodecPlanInputs, plan_codec
from weightstream.offload.layout import align_up
from weightstream.offload.codecs import AUTO_CODECS
from weightstream.offload.sources.pinned import CodedSource
from weightstream.offload.codecs import CODECS
from weightstream.offload.host.encode import _ALIGN, _slack


_DECODE_REPS = 8  # timed decodes of a sampled block (one graph; after an eager one: the kernel compiles)


class AutoCodec(RemovableHooks):
    """Named, removable hooks on the DiT that plan the coded blocks after the first step."""

    def __init__(self, streamed):
        src = streamed.source
        if not src.caps.codes_blocks:
            raise ValueError(f"weight_codec='auto' needs a source that can code its blocks in place (the pinned "
                             f"coded source of layer mode); {type(src).__name__} cannot; choose from: "
                             f"{', '.join(CODECS)}, none")
        self.streamed = streamed
        self.name = f"weightstream.auto_codec[{type(streamed.module).__name__}]"
        self.plan: CodecPlan | None = None  # the latest plan
        self.plans: dict[tuple, CodecPlan] = {}  # input signature -> its plan
        self.h2d_gbps: float | None = None  # link rate to plan with (None: measured from the event log)
        self.decode_gbps: dict[str, float] | None = None  # codec -> rate (None: measured on sampled blocks)
        self.plan_s: float | None = None  # seconds the latest planning took (sampling included)
        self.plan_parts: dict[str, float] = {}  # of plan_s: sampled encodes, timed decodes, coding start
        self._samples: dict[tuple, int] = {}  # (codec, layout) -> link bytes of one coded block
        self._pending: tuple | None = None  # signature whose first step is measuring now
        m = streamed.module
        self._handles = [m.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
                         m.register_forward_hook(self.post_forward, always_call=True)]

    # -- hooks ---------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        sig = signature(args, kwargs)
        if sig not in self.plans and self._can_plan():
            self._pending = sig  # measured by this step; planned after it
            self.streamed.executor.log_next_step()
        return None

    def _can_plan(self) -> bool:
        """A first plan always; later ones (a new input signature) only eager, with raw blocks left
        and no background coding running: a plan only adds coded blocks, and CUDA graphs captured
        after the first plan hold its loads."""
        if self.plan is None:
            return True
        src = self.streamed.source
        return self.streamed.config.cuda_graphs != "on" and not src.coding_active and any(src.raw)

    def post_forward(self, module, args, output):
        sig, self._pending = self._pending, None
        ex = self.streamed.executor
        if sig is None or sys.exc_info()[1] is not None or ex.mid_step:
            return  # a failed or cut-short step measures nothing; the next call does
        self.plan_and_apply(sig, ex.take_events())

    def plan_and_apply(self, sig, events) -> None:
        """Plan from a measured step's ``events`` (for input signature ``sig``), print it, code."""
        t0 = time.perf_counter()
        self.plan_parts = {"sample_s": 0.0, "decode_s": 0.0}
        plan = self._plan(events)
        self.plans[sig] = plan
        announce("auto codec", plan.describe(), self.streamed.config.progress)
        t1 = time.perf_counter()
        self.apply(plan)
        self.plan_parts["apply_s"] = time.perf_counter() - t1
        self.plan_s = time.perf_counter() - t0

    # -- planning ----------------------------------------------------------------------
    def _plan(self, events) -> CodecPlan:
        sb = self.streamed
        src = sb.source
        n = len(sb.blocks)
        raw: list[int | None] = [None] * n
        for lay in src.layouts:
            raw[lay.index] = lay.nbytes
        sizes = [r if r is not None else max(1, sum(tensor_bytes(t) for t in all_tensors(sb.blocks[i].module)))
                 for i, r in enumerate(raw)]  # resident blocks: their tensors' bytes
        compute, _ = planner.compute_from_events(events, sizes, cold_outliers=True)
        fixed = tuple(sorted(lay.index for k, lay in enumerate(src.layouts) if not src.raw[k]))
        link = [r or 1 for r in raw]
        for k, lay in enumerate(src.layouts):
            link[lay.index] = src.link_bytes(k)  # coded blocks (an earlier plan) copy their coded bytes
        h2d = self.h2d_gbps or planner.h2d_from_events(events, link)
        codecs = (src.codec,) if fixed else AUTO_CODECS  # blocks coded already fix the codec
        options = tuple(self._option(codec, raw) for codec in codecs)
        on_compute = src.decode_at == "use" and not src.decode_stream
        inputs = CodecPlanInputs(compute_ms=compute, raw_bytes=tuple(raw), h2d_gbps=h2d,
                                 num_slots=sb.schedule.ring_slots, options=options,
                                 decode_on="compute" if on_compute else "side",
                                 step_local=sb.schedule.step_local, fixed=fixed)
        return plan_codec(inputs)

    def _option(self, codec: str, raw) -> CodecOption:
        """``codec``'s link bytes per block (coded blocks: theirs; raw ones: one sampled block per
        layout, cached) and decode rate (given, an earlier plan's, or timed on the samples)."""
        src: CodedSource = self.streamed.source
        known = self.decode_gbps or (self.plan.decode_gbps if self.plan is not None else {})
        link = list(raw)
        decoded_bytes, decode_ms = 0, 0.0
        for k, lay in enumerate(src.layouts):
            if not src.raw[k]:
                link[lay.index] = src.link_bytes(k)
                continue
            key = (codec, _layout_key(lay))
            if key not in self._samples:
                t0 = time.perf_counter()
                coded, data, table, nbytes = src.sample(k, codec)
                t1 = time.perf_counter()
                self._samples[key] = min(src.capacity[k], align_up(coded + _slack(lay), _ALIGN))
                if codec not in known:
                    decoded_bytes += nbytes
                    decode_ms += _decode_ms(data, table, nbytes, src.device)
                self.plan_parts["sample_s"] += t1 - t0
                self.plan_parts["decode_s"] += time.perf_counter() - t1
            link[lay.index] = self._samples[key]
        rate = known[codec] if codec in known else decoded_bytes / (max(decode_ms, 1e-6) * 1e6)
        return CodecOption(codec, tuple(link), rate)

    # -- applying ------------------------------------------------------------------------
    def apply(self, plan: CodecPlan) -> None:
        self.plan = plan
        if not plan.added:
            return
        sb = self.streamed
        sb.executor.synchronize()
        background = self._background()
        if background and sb.config.progress:
            print(f"weightstream auto codec: coding {len(plan.added)} blocks with {plan.codec} in the background; "
                  "the steps stream them raw until each is coded", file=sys.stderr)
        sb.source.code_blocks([sb.executor.k_of[i] for i in plan.added], plan.codec,
                              progress=sb.config.progress, background=background)

    def _background(self) -> bool:
        """Code in the background; CUDA graphs capture once it is done (graphs.runner: eager-settling
        steps meanwhile), except where ranks must agree on each capture (DLO): coded at once."""
        sb = self.streamed
        return sb.config.cuda_graphs != "on" or sb.executor.guard is None

    def stats(self) -> dict:
        if self.plan is None:
            return {}
        return {"codec_plan": {**self.plan.stats(), "plan_s": self.plan_s,
                               "plan_parts_s": dict(self.plan_parts), "signatures": len(self.plans)}}

    def __repr__(self) -> str:
        if self.plan is None:
            what = "not planned yet"
        else:
            what = f"{len(self.plan.coded)} blocks coded with {self.plan.codec}" if self.plan.codec else "nothing coded"
        return f"AutoCodec({self.name}, {what}, {self.state})"


def _layout_key(lay) -> tuple:
    return tuple((s.dtype, tuple(s.shape), s.nbytes) for s in lay.tensors)


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
