"""``weight_codec="auto"`` under DLO AllGather: the ranks plan together and code together.

Every rank gathers every block, so which blocks are coded must be the same on
every rank (a gather moves shares of one image). The policy is
:func:`.codec_plan.plan_codec`, as for one process, with a rank's view of a
load: its link moves the rank's 1/N share of a block (raw, or of the coded
image), its decode writes the whole block (``decoded_bytes``). Coding only the
blocks the link needs keeps the decode, which every rank runs for every coded
block, off the others: a step that is transfer-bound with raw shares codes
until the link hides under the compute, and no further.

The mechanism, each part the same on every rank and in the same order:

1. the first eager step is measured (the executor's event log), as for one process;
2. once every rank completed that step (the guard's end-of-step agreement
   passed: :meth:`GatherAutoCodec.after_agreed_step`, called by
   :func:`.distributed.build_streamed`'s end hook), one block of each layout is
   gathered and encoded aside with each codec (the encoder is deterministic:
   the same coded sizes everywhere) and decoded on the device, timed;
3. one control collective joins every rank's measurements: the slowest
   (per-block compute and decode rates at their worst, the link at its
   slowest), so every rank plans from the same inputs and gets the same plan;
4. the chosen blocks are coded at once (:meth:`.sources.dlo.ShardSource.code_blocks`:
   a gather per block, in block order), before any CUDA graph is captured.

One plan per backend: ranks may see different input signatures (data
parallel), so no later plan is made. A failure in any of it marks the backend
unusable on that rank (the next collective of its peers then fails, bounded by
``dlo_timeout_s``); the host shards stay intact.
"""
from __future__ import annotations

import sys
import time

from weightstream.offload.plan import placement as planner
from weightstream.offload.plan.auto_codec import AutoCodec, _decode_ms, _layout_key
from weightstream.offload.plan.codec import CodecOption, CodecPlan, CodecPlanInputs, plan_codec
from weightstream.offload.codecs import AUTO_CODECS
from weightstream.offload.layout import all_tensors, tensor_bytes

__all__ = ["GatherAutoCodec", "join_measurements"]


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


class GatherAutoCodec(AutoCodec):
    """:class:`.auto_codec.AutoCodec` for a collective source (module doc)."""

    def __init__(self, streamed):
        super().__init__(streamed)
        self.name = f"weightstream.auto_codec_gather[{type(streamed.module).__name__}]"
        self._measured = None  # (signature, events) of the measured step, until every rank agreed it completed

    def _can_plan(self) -> bool:
        return self.plan is None and self._measured is None

    def post_forward(self, module, args, output):
        """Keep the measured step's events; plan only once every rank completed it (after_agreed_step)."""
        sig, self._pending = self._pending, None
        ex = self.streamed.executor
        if sig is None or sys.exc_info()[1] is not None or ex.mid_step:
            return
        self._measured = (sig, ex.take_events())

    def discard(self) -> None:
        """The step failed on some rank (every rank is told at its end): measure another one."""
        self._measured = None

    def after_agreed_step(self) -> None:
        """After a step every rank completed: plan and code, the same collectives on every rank."""
        if self._measured is None:
            return
        sig, events = self._measured
        self._measured = None
        guard = self.streamed.guard
        if guard.failure is not None:
            return  # no collective may run any more
        try:
            self.plan_and_apply(sig, events)
        except Exception as e:
            guard.mark_failed(f"{type(e).__name__}: {e} (planning or coding weight_codec='auto' after step "
                              f"{self.streamed.executor.position // self.streamed.executor.schedule.n})")
            raise

    # -- planning ----------------------------------------------------------------------
    def _plan(self, events) -> CodecPlan:
        sb = self.streamed
        src = sb.source
        n = len(sb.blocks)
        link: list = [None] * n  # this rank's raw share of each streamed block (its link bytes)
        decoded: list = [None] * n  # what a decode of the block writes: the whole image
        for k, lay in enumerate(src.layouts):
            link[lay.index], decoded[lay.index] = src.link_bytes(k), lay.nbytes
        sizes = [d if d is not None else max(1, sum(tensor_bytes(t) for t in all_tensors(sb.blocks[i].module)))
                 for i, d in enumerate(decoded)]
        events = [ev for ev in events if ev["lane"] in ("copy", "compute")]  # not the gathers' lane
        compute, _ = planner.compute_from_events(events, sizes, cold_outliers=True)
        mine = {"compute": list(compute),
                "h2d": self.h2d_gbps or planner.h2d_from_events(events, [b or 1 for b in link]),
                **self._sample(AUTO_CODECS)}
        rows = sb.control.gather_json(mine, "the DLO agreement on the codec plan")
        src.ncoll += 1  # every rank issued it (the guard compares the counts at each step's end)
        got = join_measurements(rows)
        options = []
        for codec in AUTO_CODECS:
            coded = list(link)
            for k, lay in enumerate(src.layouts):
                coded[lay.index] = src.coded_shard_bytes(k, got["coded"][codec][_key_name(lay)])
            options.append(CodecOption(codec, tuple(coded), got["decode"][codec]))
        inputs = CodecPlanInputs(compute_ms=tuple(got["compute"]), raw_bytes=tuple(link), h2d_gbps=got["h2d"],
                                 num_slots=sb.schedule.ring_slots, options=tuple(options), decode_on="side",
                                 step_local=sb.schedule.step_local, decoded_bytes=tuple(decoded))
        return plan_codec(inputs)

    def _sample(self, codecs) -> dict:
        """One raw block of each layout gathered (a collective, in block order) and encoded with
        each codec: the whole block's coded bytes per layout; each codec's decode rate timed on
        this rank's device (or given: ``decode_gbps``)."""
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

    def _background(self) -> bool:
        return False  # every rank switches a block to coded at the same step


def _key_name(lay) -> str:
    """A layout's key as a JSON object key (the same string on every rank)."""
    return repr(_layout_key(lay))
