"""DLO guards: sticky failures and the decisions every rank takes together.

The executor is one class for every source; what DLO adds to it is policy,
held here and called through a few hooks (``check``, ``mark_failed``,
``refuse_resync``, ``reset_target``, ``agree_capture``, ``capture_start``):

- :class:`DLOGuard` (rank-local): a failed load makes the backend unusable,
  named, instead of leaving a half-loaded ring.
- :class:`AllGatherGuard`: loads are collectives. Any failure is sticky (no
  further collective may run: a pending gloo operation would pair with the next,
  an NCCL one blocks its communicator); a cut-short step is completed from the
  intact host shards (no compute) and one small agreement at the end of every
  eager forward tells each rank whether any rank failed; a CUDA-graph capture is
  kept only when it succeeded everywhere.
"""
from __future__ import annotations

from .dlo_control import DLOCollectiveError, _Control


class DLOGuard:
    """Rank-local DLO: sticky, named failures; primes at the first forward."""

    mode = "rank-local"
    collective = False
    sticky_blocks = False  # an exception inside a block's hooks does not end the backend

    def __init__(self):
        self.failure: str | None = None
        self.capture_start = 0

    def check(self, what: str = "this forward") -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"weightstream DLO ({self.mode}) is unusable after an earlier failure on this rank: "
                f"{self.failure}. {what[:1].upper() + what[1:]} was stopped before any transfer"
                + self._way_out()
            )

    def _way_out(self) -> str:
        return "; rebuild the OffloadedTransformer"

    def mark_failed(self, what: str) -> None:
        if self.failure is None:
            self.failure = what

    def agree_capture(self, ex, ok: bool) -> bool:
        return ok

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'usable' if self.failure is None else 'failed: ' + self.failure})"


class AllGatherGuard(DLOGuard):
    """DLO AllGather: every load is a collective; ranks stay in step or stop, named."""

    mode = "allgather"
    collective = True
    sticky_blocks = True

    def __init__(self, control: _Control | None, source=None):
        super().__init__()
        self.control = control
        self.source = source  # the ShardSource (it counts the collectives); set by its factory
        self._reset_to: int | None = None  # step start every rank agreed to reset to (a capture failed somewhere)
        self._forward_start = 0  # position when the current forward began

    def _way_out(self) -> str:
        return (" or collective, so it cannot hang on ranks that are out of step; rebuild the "
                "OffloadedTransformer on every rank of the sharding group")

    # -- executor hooks ---------------------------------------------------------------
    def refuse_resync(self, ex) -> None:
        """A forward stopped between streamed blocks: other ranks may have issued more
        gathers than this one, so re-priming could pair wrong collectives."""
        self.mark_failed(f"a forward stopped part-way through the streamed blocks (at position {ex.position}, "
                         f"block {ex.blocks[ex.schedule.block_at(ex.position)].name!r})")
        self.check()

    def reset_target(self, ex) -> int:
        """Re-priming on one rank alone would issue gathers its peers do not: only a
        reset every rank agreed to (agree_capture) runs; anything else stops."""
        if self._reset_to is None:
            self.mark_failed(f"the ring had to be reset at position {ex.position} (a failed graph capture "
                             "or an interrupted step); under AllGather every rank must reset together")
            self.check()
        target, self._reset_to = self._reset_to, None
        return target

    def _agree(self, ex, flag: bool, what: str, note: str = "") -> list[dict]:
        """Every rank's position, collectives issued, ``flag`` and ``note``: one small collective."""
        src = self.source
        rows = self.control.status([ex.position, src.ncoll, int(flag)], note, f"the DLO agreement on {what}")
        src.ncoll += 1
        return [{"position": r[0], "ncoll": r[1], "flag": bool(r[2]), "note": n} for r, n in rows]

    def agree_capture(self, ex, ok: bool) -> bool:
        """Capture succeeded on every rank? One small collective per capture; when it did
        not everywhere, every rank resets to the captured step's start and runs it eagerly."""
        try:
            rows = self._agree(ex, not ok, "a CUDA-graph capture")
        except DLOCollectiveError as e:
            self.mark_failed(str(e))
            raise
        agreed = not any(r["flag"] for r in rows)
        if not agreed:
            self._reset_to = self.capture_start
        return agreed

    # -- the root hooks (installed by distributed.build_streamed) ---------------------------------
    def begin_forward(self, ex) -> None:
        self._forward_start = ex.position

    def end_forward(self, ex, exc: BaseException | None) -> None:
        """After every eager forward: a rank that stopped part-way first issues the
        step's remaining gathers (its host shards are intact), so every rank issued
        the same collectives; then one small agreement: when any rank raised in
        this step, every rank that did not raises too. The ring stays in step and
        usable. A failed collective instead marks the backend unusable."""
        if ex.capture_tag is not None or self.failure is not None:
            return  # a capture (agree_capture decides) or no collective may run any more
        n, start = ex.schedule.n, self._forward_start
        if exc is None and not ex.block_bound and ex.position % n and ex.position != start:
            ex.finish_step()  # its last blocks were skipped by design (SD3 skip_layers): not a failure
        stopped = exc is not None or ex.position % n != 0 or ex.position == start
        note = ""
        if stopped:
            note = (f"{type(exc).__name__}: {exc}" if exc is not None else "the forward returned early") + (
                f" (after {ex.position - start} of {n} streamed blocks)")
            try:
                ex.drain_step(start)
            except Exception as e:
                self.mark_failed(f"{type(e).__name__}: {e} (completing the step's gathers after: {note})")
                raise
        try:
            rows = self._agree(ex, stopped, "the end of a step", note)
        except DLOCollectiveError as e:
            self.mark_failed(str(e))
            raise
        if len({(r["position"], r["ncoll"]) for r in rows}) > 1:
            self.mark_failed("the ranks are out of step after a step (" + ", ".join(
                f"rank {i}: position {r['position']}, {r['ncoll']} collectives" for i, r in enumerate(rows)) + ")")
            self.check()
        failed = [(i, r["note"]) for i, r in enumerate(rows) if r["flag"]]
        if failed and exc is None:
            raise RuntimeError(
                "weightstream DLO (allgather): this step failed on " + "; ".join(
                    f"rank {i}: {n}" for i, n in failed)
                + ". This rank's output of the step is discarded; every rank completed the step's gathers, "
                "so the next forward runs normally"
            )
