"""The codec's choice of k, k2 and tables (kernels/codec_choose.py, the one rule of both encoders)
against a brute-force search written here: every k (and k2) costed, the first minimum kept, the
table the most frequent symbols or the first circular window holding as many. The encoders' bytes
are held by the golden digests (tests/kernels/test_codec_encode.py)."""
import pytest
import torch

from weightstream.kernels.codec_choose import choose


def _histograms(n: int = 120):
    """Symbol histograms of every shape the choice meets: weight-like (geometric around an
    exponent, wrapping past 255 too), sparse, tied counts, uniform, one symbol, none."""
    gen = torch.Generator().manual_seed(11)
    out = [torch.zeros(256, dtype=torch.int64), torch.zeros(256, dtype=torch.int64).index_fill_(0, torch.tensor([9]), 5)]
    for i in range(n):
        kind = i % 4
        if kind == 0:  # weight-like: falling counts around a centre (some wrapping past 255)
            centre = int(torch.randint(0, 256, (1,), generator=gen))
            d = (torch.arange(256) - centre) % 256
            h = (1e6 * 0.5 ** torch.minimum(d, 256 - d).double()).long()
        elif kind == 1:  # sparse
            h = torch.zeros(256, dtype=torch.int64)
            idx = torch.randint(0, 256, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen)
            h[idx] = torch.randint(1, 1000, (idx.numel(),), generator=gen)
        elif kind == 2:  # ties: a few count values only
            h = torch.randint(0, 3, (256,), generator=gen) * int(torch.randint(1, 50, (1,), generator=gen))
        else:
            h = torch.randint(0, 10**6, (256,), generator=gen)
        out.append(h)
    return out


def _top(h: list[int], n: int) -> list[int]:
    return sorted(range(256), key=lambda s: (-h[s], s))[:n]


def _escapes(h: list[int], k: int) -> int:
    return 0 if k in (0, 8) else sum(h) - sum(h[s] for s in _top(h, (1 << k) - 1))


def _brute_one(h: list[int], k, esc_bytes: int):
    numel, distinct = sum(h), sum(1 for c in h if c)
    ks = [k] if k is not None else [kk for kk in range(9) if kk or distinct <= 1]
    costs = [(numel * kk / 8 + esc_bytes * _escapes(h, kk), kk) for kk in ks]
    kk = min(costs, key=lambda c: c[0])[1]  # min keeps the first of equal costs: the smaller k
    if kk in (0, 8):
        return kk, (_top(h, 1)[0],) if kk == 0 else (), None
    n = (1 << kk) - 1
    held = [sum(h[(w + j) % 256] for j in range(n)) for w in range(256)]
    w = held.index(max(held))
    if held[w] == sum(h[s] for s in _top(h, n)):
        return kk, tuple((w + j) % 256 for j in range(n)), w
    return kk, tuple(_top(h, n)), None


def _cost2(h: list[int], k1: int, k2: int, tile: int) -> float:
    numel, order = sum(h), _top(h, 256)
    n1, n2 = (1 << k1) - 1, (1 << k2) - 1
    esc1 = numel - sum(h[s] for s in order[:n1])
    esc2 = numel - sum(h[s] for s in order[: n1 + n2])
    return numel * k1 / 8 + esc1 * k2 / 8 + esc2 + 8 * numel / tile


@pytest.mark.parametrize("levels, patched", [(1, False), (1, True), (2, False)])
def test_the_choice_is_the_cheapest_code(levels, patched):
    for i, t in enumerate(_histograms()):
        h = t.tolist()
        tile = (128, 4096, 65536)[i % 3]
        for k in [None, 1, 3, 7, 8] + ([0] if sum(1 for c in h if c) <= 1 else []):
            got = choose(t.numpy(), k, levels, tile, patched=patched)
            one = _brute_one(h, k, 3 if patched else 1)
            if levels == 1:
                assert got == one + (0,), (i, k)
                continue
            numel = sum(h)
            best = numel * one[0] / 8 + _escapes(h, one[0])
            if got[3] == 0:
                assert got == one + (0,), (i, k)
                assert all(_cost2(h, k1, k2, tile) >= best for k1 in ([k] if k else range(1, 8))
                           for k2 in range(1, 8) if k not in (0, 8)), (i, k)
            else:
                k1, k2 = got[0], got[3]
                cost = _cost2(h, k1, k2, tile)
                assert cost < best and all(_cost2(h, a, b, tile) >= cost for a in ([k] if k else range(1, 8))
                                           for b in range(1, 8)), (i, k)
                t1 = _brute_one(h, k1, 1)[1]
                assert got[1][: len(t1)] == t1
                assert got[1][len(t1):] == tuple(s for s in _top(h, 256) if s not in t1)[: (1 << k2) - 1]


def test_given_k2_and_refusals():
    h = torch.tensor([1000 >> min(abs(s - 120), 20) for s in range(256)])
    k, _, _, k2 = choose(h.numpy(), 2, 2, 4096, 3)
    assert (k, k2) == (2, 3)
    with pytest.raises(ValueError, match="k2=3 needs k in"):
        choose(h.numpy(), 8, 2, 4096, 3)
    with pytest.raises(ValueError, match="k=0 needs"):
        choose(h.numpy(), 0, 1, 4096)
