"""The codec's choice of k, k2 and tables from a symbol histogram: one rule for both encoders.

`choose(counts, k, levels, tile, k2)` returns ``(k, table, window start or None, k2)`` minimising
the coded size of a tensor whose symbol histogram (of the tensor or of the chunks sampled from it)
is ``counts`` (256 ints):

- one level (``k2 = 0``): ``k`` bits per element (k = 8: raw, k = 0: one symbol value), the
  table the ``2^k - 1`` most frequent symbols (falling count, then rising symbol), an escape
  costing ``esc_bytes`` (1; 3 for the patched layout: a 2-byte position and the symbol); when a
  circular window of consecutive symbols holds as many elements as those, the table is the window
  (its first start: the decoder's subtraction path);
- two levels (``levels == 2``): the level-1 table, then the ``2^k2 - 1`` next symbols, paying k2
  bits per level-1 escape, a byte per level-2 escape and 8 bytes per tile (its second base stream).

Costs are compared as floats in a fixed order, the first minimum kept: the same inputs choose the
same code on every machine, which the format needs (coded sidecars persist the bytes;
tests/kernels/test_codec_encode.py holds golden digests). Numpy sorts and sums: about 10x faster
per tensor than a Python loop over the counts (the GPU encoder chooses for every tensor of a block
on the host).
"""
from __future__ import annotations

import numpy as np

__all__ = ["choose"]


def _ordered(counts: np.ndarray) -> tuple[list[int], list[int]]:
    """Symbols by falling count, then rising symbol, and the prefix sums of their counts
    (cum[n]: elements of the n most frequent symbols), as lists of ints."""
    order = np.lexsort((np.arange(256), -counts))
    return order.tolist(), np.concatenate([[0], np.cumsum(counts[order])]).tolist()


def _window(counts: np.ndarray, width: int) -> tuple[int, int]:
    """The first start of the circular window of ``width`` symbols holding the most elements,
    and how many it holds."""
    cs = np.concatenate([[0], np.cumsum(np.concatenate([counts, counts[:width]]))])
    runs = cs[width : width + 256] - cs[:256]
    start = int(np.argmax(runs))
    return start, int(runs[start])


def _one_level(counts: np.ndarray, order, cum, k: int | None, esc_bytes: int):
    numel, distinct = cum[-1], int(np.count_nonzero(counts))
    if k == 0 and distinct > 1:
        raise ValueError(f"k=0 needs a tensor with one symbol value, this one has {distinct}")
    best = None
    for kk in range(9) if k is None else [k]:
        if kk == 0 and distinct > 1:
            continue
        exc = 0 if kk in (0, 8) else numel - cum[(1 << kk) - 1]
        if best is None or numel * kk / 8 + esc_bytes * exc < best[0]:
            best = (numel * kk / 8 + esc_bytes * exc, kk)
    kk = best[1]
    if kk in (0, 8):
        return kk, (order[0],) if kk == 0 else (), None
    n_tab = (1 << kk) - 1
    window, held = _window(counts, n_tab)
    if held == cum[n_tab]:
        return kk, tuple((window + j) & 0xFF for j in range(n_tab)), window
    return kk, tuple(order[:n_tab]), None


def _two_level(counts: np.ndarray, order, cum, k: int | None, k2: int | None, tile: int):
    if k in (0, 8) or k2 == 0:
        if k2:
            raise ValueError(f"k2={k2} needs k in [1, 7] (k={k} has no escapes to code at a second level)")
        return _one_level(counts, order, cum, k, 1) + (0,)
    numel, best = cum[-1], None
    if k2 is None:  # the one-level code is a candidate
        one = _one_level(counts, order, cum, k, 1)
        best = (numel * one[0] / 8 + (0 if one[0] in (0, 8) else numel - cum[(1 << one[0]) - 1]), one + (0,))
    for k1 in range(1, 8) if k is None else [k]:
        for kk2 in range(1, 8) if not k2 else [k2]:
            n1, n2 = (1 << k1) - 1, (1 << kk2) - 1
            esc1, esc2 = numel - cum[n1], numel - cum[n1 + n2]
            cost = numel * k1 / 8 + esc1 * kk2 / 8 + esc2 + 8 * numel / tile
            if best is None or cost < best[0]:
                best = (cost, (k1, None, None, kk2))
    k1, _, _, kk2 = best[1]
    if kk2 == 0:
        return best[1]
    _, t1, window = _one_level(counts, order, cum, k1, 1)
    taken = set(t1)
    rest = [s for s in order if s not in taken]
    return k1, tuple(t1) + tuple(rest[: (1 << kk2) - 1]), window, kk2


def choose(counts, k: int | None, levels: int, tile: int, k2: int | None = None, *, patched: bool = False):
    """``(k, table, window start or None, k2)`` for the histogram ``counts`` (see the module
    docstring): ``levels`` 1 or 2; ``patched``: one level, an escape costing 3 bytes; ``k`` / ``k2``:
    None chooses them (two levels: ``k2=None`` keeps the one-level code a candidate)."""
    counts = np.asarray(counts, dtype=np.int64)
    order, cum = _ordered(counts)
    if levels == 2 and not patched:
        return _two_level(counts, order, cum, k, k2, tile)
    return _one_level(counts, order, cum, k, 3 if patched else 1) + (0,)
