"""``weight_codec="auto"``: code the streamed blocks a measured step needs.

Policy lives in :mod:`.codec_plan` (pure); this is the mechanism. The coded
source starts with every block raw (its plain image, copied straight into the
slot: the pinned store's bytes and speed). The first eager step (with CUDA
graphs: the warm-up step, before any capture) is measured through the
executor's event log: per-block compute and the link rate. One block of each
layout is then encoded with each codec (its coded bytes) and decoded on the
device (its decode rate); :func:`codec_plan.plan_codec` picks the codec and the
blocks, and :meth:`CodedSource.code_blocks` codes them in place: eager, on a
background thread while the steps keep streaming raw blocks (each step start
stores the blocks finished by then); with CUDA graphs at once, before the
capture. Planned once: later input signatures keep the choice (graphs captured
after it stay valid). The plan and its prediction are printed once and kept in
``stats()["codec_plan"]``. Outputs are the same bytes whatever is coded.
"""
from __future__ import annotations

import logging
import sys
import time

import torch

from . import planner
from .hooks import RemovableHooks
from .codec_plan import CodecOption, CodecPlan, CodecPlanInputs, plan_codec
from .layout import align_up
from .sources.coded import CODECS, CodedSource
from .sources.coded_encode import _ALIGN, _slack

log = logging.getLogger("weightstream")

_DECODE_REPS = 3  # timed decodes of a sampled block (after one untimed: the kernel compiles)


class AutoCodec(RemovableHooks):
    """Named, removable hooks on the DiT that plan the coded blocks after the first step."""

    def __init__(self, streamed):
        src = streamed.source
        if not callable(getattr(src, "code_blocks", None)):
            raise ValueError(f"weight_codec='auto' needs a source that can code its blocks in place (the pinned "
                             f"coded source of layer mode); {type(src).__name__} cannot; choose from: "
                             f"{', '.join(CODECS)}, none")
        self.streamed = streamed
        self.name = f"weightstream.auto_codec[{type(streamed.module).__name__}]"
        self.plan: CodecPlan | None = None
        self.h2d_gbps: float | None = None  # link rate to plan with (None: measured from the event log)
        self.decode_gbps: dict[str, float] | None = None  # codec -> rate (None: measured on sampled blocks)
        self.plan_s: float | None = None  # seconds spent planning and coding
        self._pending = False
        m = streamed.module
        self._handles = [m.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
                         m.register_forward_hook(self.post_forward, always_call=True)]

    # -- hooks ---------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        if self.plan is None:
            self._pending = True  # measured by this step; planned after it
            self.streamed.executor.log_next_step()
        return None

    def post_forward(self, module, args, output):
        pending, self._pending = self._pending, False
        ex = self.streamed.executor
        if not pending or sys.exc_info()[1] is not None or ex.mid_step:
            return  # a failed or cut-short step measures nothing; the next call does
        t0 = time.perf_counter()
        plan = self._plan(ex.take_events())
        text = plan.describe()
        log.info("weightstream auto codec: %s", text)
        if self.streamed.config.progress:
            print(f"weightstream auto codec: {text}", file=sys.stderr)
        self.apply(plan)
        self.plan_s = time.perf_counter() - t0

    # -- planning ----------------------------------------------------------------------
    def _plan(self, events) -> CodecPlan:
        sb = self.streamed
        src = sb.source
        n = len(sb.blocks)
        raw: list[int | None] = [None] * n
        for lay in src.layouts:
            raw[lay.index] = lay.nbytes
        sizes = [r if r is not None else max(1, _module_bytes(sb.blocks[i].module)) for i, r in enumerate(raw)]
        compute, _ = planner.compute_from_events(events, sizes, cold_outliers=True)
        h2d = self.h2d_gbps or planner.h2d_from_events(events, [r or 1 for r in raw])
        options = tuple(self._option(codec, raw) for codec in CODECS)
        on_compute = src.decode_at == "use" and not src.decode_stream
        inputs = CodecPlanInputs(compute_ms=compute, raw_bytes=tuple(raw), h2d_gbps=h2d,
                                 num_slots=sb.schedule.ring_slots, options=options,
                                 decode_on="compute" if on_compute else "side",
                                 step_local=sb.schedule.step_local)
        return plan_codec(inputs)

    def _option(self, codec: str, raw) -> CodecOption:
        """``codec``'s link bytes per block (one sampled block per layout) and decode rate."""
        src: CodedSource = self.streamed.source
        groups: dict[tuple, list[int]] = {}
        for k, lay in enumerate(src.layouts):
            if src.raw[k]:
                groups.setdefault(_layout_key(lay), []).append(k)
        link = list(raw)
        decoded_bytes, decode_ms = 0, 0.0
        for ks in groups.values():
            lay = src.layouts[ks[0]]
            coded, data, table = src.sample(ks[0], codec)
            size = min(src.capacity[ks[0]], align_up(coded + _slack(lay), _ALIGN))
            for k in ks:
                link[src.layouts[k].index] = size
            if self.decode_gbps is None:
                decoded_bytes += lay.nbytes
                decode_ms += _decode_ms(data, table, lay.nbytes, src.device)
        if self.decode_gbps is not None:
            rate = self.decode_gbps[codec]
        else:
            rate = decoded_bytes / (max(decode_ms, 1e-6) * 1e6)
        return CodecOption(codec, tuple(link), rate)

    # -- applying ------------------------------------------------------------------------
    def apply(self, plan: CodecPlan) -> None:
        self.plan = plan
        if plan.codec is None:
            return
        sb = self.streamed
        sb.executor.synchronize()
        background = sb.config.cuda_graphs != "on"  # graphs are captured next: coded before them
        if background and sb.config.progress:
            print(f"weightstream auto codec: coding {len(plan.coded)} blocks with {plan.codec} in the background; "
                  "the steps stream them raw until each is coded", file=sys.stderr)
        sb.source.code_blocks([sb.executor.k_of[i] for i in plan.coded], plan.codec,
                              progress=sb.config.progress, background=background)

    def stats(self) -> dict:
        if self.plan is None:
            return {}
        return {"codec_plan": {**self.plan.stats(), "plan_s": self.plan_s}}

    def __repr__(self) -> str:
        if self.plan is None:
            what = "not planned yet"
        else:
            what = f"{len(self.plan.coded)} blocks coded with {self.plan.codec}" if self.plan.codec else "nothing coded"
        return f"AutoCodec({self.name}, {what}, {self.state})"


def _layout_key(lay) -> tuple:
    return tuple((s.dtype, tuple(s.shape), s.nbytes) for s in lay.tensors)


def _module_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _decode_ms(data: torch.Tensor, table, nbytes: int, device: torch.device) -> float:
    """Milliseconds one decode of ``data`` takes on ``device`` (median of a few, after a warm-up)."""
    if device.type == "cuda":
        src = data.to(device)
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        CodedSource.decode_table(src, out, table)  # compiles the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(_DECODE_REPS):
            CodedSource.decode_table(src, out, table)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / _DECODE_REPS
    out = torch.empty(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    CodedSource.decode_table(data, out, table)
    return (time.perf_counter() - t0) * 1e3
