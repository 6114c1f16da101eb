"""Progress of long host work (packing, pinning, registering tens of GB), and
the one formatter of byte counts in messages (:func:`format_bytes`).

A tqdm bar on stderr where tqdm is installed (it comes with diffusers and
huggingface_hub), else lines on the ``weightstream`` logger at INFO, at most
one a second. Work under ``min_bytes`` shows nothing.
"""
from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("weightstream")

# decimal units: the config's size keys are GB (1e9 bytes), and a message says the unit its key uses
_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB")


def format_bytes(n: int | float) -> str:
    """``n`` bytes with three significant digits in decimal units: "812 B", "812 KB",
    "3.41 MB", "12.4 GB" (a fixed ``n / 1e9:.3f`` printed a 400 KB need as "0.000 GB")."""
    v = float(n)
    if abs(v) < 999.5:
        return f"{v:.0f} B"
    for unit in _UNITS[1:]:
        v /= 1000
        digits = 0 if abs(v) >= 99.95 else 1 if abs(v) >= 9.995 else 2
        if abs(round(v, digits)) < 1000 or unit == _UNITS[-1]:
            break
    return f"{v:.{digits}f} {unit}"


class Progress:
    def __init__(self, what: str, total_bytes: int, enabled: bool, min_bytes: int = 1 << 30):
        self.enabled = enabled and total_bytes >= min_bytes
        self.what, self.total, self.done = what, total_bytes, 0
        self.t0 = self.last = time.perf_counter()
        self._bar = None
        if not self.enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            log.info("%s: %s", what, format_bytes(total_bytes))
            return
        self._bar = tqdm(total=total_bytes, desc=f"weightstream: {what}", unit="B", unit_scale=True,
                         unit_divisor=1000, leave=False, mininterval=0.5)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        finished = self.done >= self.total
        if self._bar is not None:
            self._bar.update(nbytes)
            if finished:
                self.close()
            return
        now = time.perf_counter()
        if now - self.last >= 1.0 or finished:
            self.last = now
            log.info("%s: %s of %s (%.0f%%) %.1f s", self.what, format_bytes(self.done), format_bytes(self.total),
                     100 * self.done / max(self.total, 1), now - self.t0)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            log.info("%s: %s in %.1f s", self.what, format_bytes(self.done), time.perf_counter() - self.t0)


def announce(what: str, text: str, progress: bool) -> None:
    """One planner's decision (``what``: "auto placement", "auto codec"): logged, and printed to
    stderr with ``progress``."""
    log.info("weightstream %s: %s", what, text)
    if progress:
        print(f"weightstream {what}: {text}", file=sys.stderr)
