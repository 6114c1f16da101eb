"""CopyPool: the staging packer's host copy split over threads (CPU)."""
import threading

import pytest
import torch

from weightstream.offload.host.staging import PIECE_MAX, PIECE_MIN, CopyPool, check_threads, default_threads




@pytest.mark.parametrize("threads", [1, 2, 5, 8])
@pytest.mark.parametrize("sizes", [[1], [3 * PIECE_MIN + 7], [PIECE_MAX * 3 + 1, 5, 4096], [0, 12345]])
def test_pieces_cover_each_run_once_within_bounds(threads, sizes):
    pool = CopyPool(threads)
    try:
        runs, at = [], 0
        for n in sizes:
            runs.append((10**9 + at, 5 * 10**9 + 3 * at, n))
            at += n + 100
        pieces = sorted(pool.pieces(runs))
        for d, s, n in runs:  # each run tiled exactly, in order, same offset on both sides
            mine = [p for p in pieces if d <= p[0] < d + max(n, 1)]
            assert sum(p[2] for p in mine) == n
            pos = d
            for pd, ps, pn in mine:
                assert pd == pos and ps - s == pd - d and 0 < pn <= PIECE_MAX
                pos += pn
        total = sum(sizes)
        if total >= 4 * threads * PIECE_MIN and len(sizes) == 1:  # enough work: every thread gets several pieces
            assert len(pieces) >= 4 * threads
    finally:
        pool.close()


def test_copy_is_byte_exact_and_uses_pool_threads():
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (3 * PIECE_MIN + 12345,), dtype=torch.uint8, generator=g)
    dst = torch.zeros(src.numel() + 64, dtype=torch.uint8)
    runs = [(dst.data_ptr() + 64, src.data_ptr(), 2 * PIECE_MIN + 5), (dst.data_ptr(), src.data_ptr() + 2 * PIECE_MIN + 5, 64)]
    pool = CopyPool(3)
    try:
        pool.copy(runs)
        assert torch.equal(dst[64 : 64 + 2 * PIECE_MIN + 5], src[: 2 * PIECE_MIN + 5])
        assert torch.equal(dst[:64], src[2 * PIECE_MIN + 5 : 2 * PIECE_MIN + 69])
        assert pool.bytes == 2 * PIECE_MIN + 69
        assert pool.thread_names and all(n.startswith("weightstream-stager-copy") for n in pool.thread_names)
        assert threading.current_thread().name not in pool.thread_names
    finally:
        pool.close()


def test_check_threads():
    assert check_threads(None) == default_threads() >= 1
    assert check_threads(3) == 3
    with pytest.raises(ValueError, match="staging_threads=0 is not allowed"):
        check_threads(0)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="must be an int >= 1"):
            check_threads(bad)
