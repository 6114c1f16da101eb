"""DLO guards: sticky failures and the decisions every rank takes together.

The executor is one class for every source; what DLO adds to it is policy,
held here and called through a few hooks (``check``, ``mark_failed``,
``reset_target``, ``agree_capture``, ``capture_start``):

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

import hashlib

from weightstream.offload.dlo.control import _Control, tensor_digests


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

    def agree_update(self, items: list) -> None:
        """Before an update writes (``items``: its (key, new tensor) pairs): rank-local, nothing."""

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
        self._open = False  # a forward began and its end (end_forward) has not run yet
        self.weights_version = 0  # the updates this rank wrote, folded (agree_update)

    def _way_out(self) -> str:
        return (" or collective, so it cannot hang on ranks that are out of step; rebuild the "
                "OffloadedTransformer on every rank of the sharding group")

    # -- executor hooks ---------------------------------------------------------------
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
        """Every rank's position, collectives issued, ``flag`` and ``note``: one small collective.
        Anything that stops it (a failed or timed-out collective, a KeyboardInterrupt while it
        waits) ends the backend: this rank can no longer tell which collectives its peers ran."""
        src = self.source
        try:
            rows = self.control.status([ex.position, src.ncoll, int(flag), self.weights_version], note,
                                       f"the DLO agreement on {what}")
        except BaseException as e:
            self.mark_failed(f"{_what(e)} (in the DLO agreement on {what})")
            raise
        src.ncoll += 1
        return [{"position": r[0], "ncoll": r[1], "flag": bool(r[2]), "weights": r[3], "note": n} for r, n in rows]

    def agree_capture(self, ex, ok: bool) -> bool:
        """Capture succeeded on every rank? One small collective per capture; when it did
        not everywhere, every rank resets to the captured step's start and runs it eagerly."""
        rows = self._agree(ex, not ok, "a CUDA-graph capture")
        agreed = not any(r["flag"] for r in rows)
        if not agreed:
            self._reset_to = self.capture_start
        return agreed

    def agree_update(self, items: list) -> None:
        """update_weights under AllGather is a collective: every rank must write the same weights
        (each holds 1/N of every block: one rank's new share beside its peers' old ones mixes the
        weights). Each rank folds the digest of every update (every byte) into its weights version,
        which the end-of-step agreement compares: ranks that wrote other weights, or that updated
        alone, stop with the next forward (named, its output discarded) instead of computing with
        mixed shares. No collective here: a rank calling it alone must not pair a control
        collective with its peers' gathers."""
        mine = sorted(zip([key for key, _ in items], tensor_digests([t for _, t in items])))
        folded = hashlib.sha1(f"{self.weights_version}:{mine!r}".encode()).hexdigest()
        self.weights_version = int(folded[:15], 16)  # a positive int64: one of the agreement's ints

    def _cut_short(self, exc: BaseException | None) -> bool:
        """A load or gather of the source was stopped part-way (by a BaseException that is not an
        Exception: those end the backend where they are raised): its collective may or may not
        have run, and its slot holds part of a block. Nothing may read that slot or issue another
        collective: the backend ends here, named (the peers' next collective fails within
        dlo_timeout_s)."""
        cut = self.source.cut_short() if self.source is not None else None
        if cut is None:
            return False
        self.mark_failed(f"{cut} was cut short by {_what(exc) if exc is not None else 'an exception'}: this rank "
                         "cannot tell whether its collective ran, nor use the slot it was filling")
        return True

    # -- the root hooks (installed by distributed.build_streamed) ---------------------------------
    def begin_forward(self, ex) -> None:
        """Before a forward issues anything: refuse a ring whose last transfer was cut short, or
        whose last forward ended without its end-of-step agreement (an exception no one reported
        to :meth:`end_forward`, e.g. a KeyboardInterrupt through a caller that did not call
        ``StreamedBlocks.forward_aborted``): re-priming alone would pair this rank's gathers with
        whatever its peers issue (a size mismatch aborts the process, a match decodes or computes
        with another block's bytes)."""
        if self._cut_short(None):
            self.check()
        if self._open:
            self.mark_failed("the last forward on this rank ended without its end-of-step agreement (an exception "
                             "that did not reach the DLO end-of-forward handler); the ranks may be out of step")
            self.check()
        self._open = True
        self._forward_start = ex.position

    def end_forward(self, ex, exc: BaseException | None) -> None:
        """After every eager forward, however it ended (an exception of any type inside a block,
        a KeyboardInterrupt included): a rank that stopped part-way first issues the
        step's remaining gathers (its host shards are intact), so every rank issued
        the same collectives; then one small agreement: when any rank raised in
        this step, every rank that did not raises too. The ring stays in step and
        usable. A failed collective, or a load cut short, instead marks the backend unusable."""
        self._open = False
        if ex.capture_tag is not None or self.failure is not None:
            return  # a capture (agree_capture decides) or no collective may run any more
        if self._cut_short(exc):
            return  # the caller re-raises exc; the next call names the failure
        n, start = ex.schedule.n, self._forward_start
        if exc is None and not ex.block_bound and ex.position % n and ex.position != start:
            ex.finish_step()  # its last blocks were skipped by design (SD3 skip_layers): not a failure
        stopped = exc is not None or ex.position % n != 0 or ex.position == start
        note = ""
        if stopped:
            note = (_what(exc) if exc is not None else "the forward returned early") + (
                f" (after {ex.position - start} of {n} streamed blocks)")
            try:
                ex.drain_step(start)
            except BaseException as e:
                self.mark_failed(f"{_what(e)} (completing the step's gathers after: {note})")
                raise
        rows = self._agree(ex, stopped, "the end of a step", note)
        if len({(r["position"], r["ncoll"]) for r in rows}) > 1:
            self.mark_failed("the ranks are out of step after a step (" + ", ".join(
                f"rank {i}: position {r['position']}, {r['ncoll']} collectives" for i, r in enumerate(rows)) + ")")
            self.check()
        if len({r["weights"] for r in rows}) > 1:
            self.mark_failed("the ranks hold other weights: update_weights() ran with other weights, or on some "
                             "ranks only (ranks by the updates they wrote: " + ", ".join(
                                 f"rank {i}: {r['weights']:x}" for i, r in enumerate(rows)) + "); this step's output "
                             "is discarded. update_weights under AllGather is a collective: call it on every rank "
                             "with the same weights")
            self.check()
        failed = [(i, r["note"]) for i, r in enumerate(rows) if r["flag"]]
        if failed and exc is None:
            raise RuntimeError(
                "weightstream DLO (allgather): this step failed on " + "; ".join(
                    f"rank {i}: {n}" for i, n in failed)
                + ". This rank's output of the step is discarded; every rank completed the step's gathers, "
                "so the next forward runs normally"
            )


def _what(exc: BaseException) -> str:
    """``exc`` as a note: its type, and its message where it has one (KeyboardInterrupt has none)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
