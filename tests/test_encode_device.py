"""offload/host/encode_device.py's HostStaging on the CPU (RecordingStreams): pageable bytes up and
down through two small buffers, chunk by chunk, byte-exact for runs shorter than, equal to and
longer than a buffer; a buffer is refilled only after the host waited for the copy that last used it."""
import pytest
import torch

from weightstream.offload.host.encode_device import HostStaging
from weightstream.offload.streams import RecordingStreams

CHUNK = 64
LENGTHS = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 17]


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _reuse_waits(trace) -> None:
    """Every record of a buffer's event after its first is preceded, since the previous record of
    that event, by a host wait on it."""
    last: dict[int, int] = {}
    for i, op in enumerate(trace):
        if op.kind != "record":
            continue
        if op.event in last:
            between = trace[last[op.event] + 1 : i]
            assert any(o.kind == "sync_event" and o.event == op.event for o in between), (i, op)
        last[op.event] = i


@pytest.mark.parametrize("lengths", [LENGTHS, [CHUNK] * 5, [5 * CHUNK + 3]])
def test_upload_packs_runs_into_chunks_and_every_byte_arrives(lengths):
    streams = RecordingStreams()
    up = streams.new_stream()
    staging = HostStaging(CHUNK, pin=False, streams=streams)
    dst = torch.zeros(sum(lengths) + 7, dtype=torch.uint8)
    srcs = [_bytes(n, i) for i, n in enumerate(lengths)]
    runs, at = [], 3
    for s in srcs:
        runs.append((dst[at : at + s.numel()], s))
        at += s.numel()
    with streams.stream(up):
        staging.upload(runs, up)
    assert torch.equal(dst[3:at], torch.cat(srcs)) and not dst[:3].any() and not dst[at:].any()
    records = [op for op in streams.trace if op.kind == "record"]
    assert len(records) == -(-sum(lengths) // CHUNK)  # one record per chunk, small runs packed together
    _reuse_waits(streams.trace)
    staging.close()


@pytest.mark.parametrize("n", [1, CHUNK, CHUNK + 1, 4 * CHUNK + 9])
def test_download_in_chunks_gives_the_bytes_back(n):
    streams = RecordingStreams()
    down = streams.new_stream()
    staging = HostStaging(CHUNK, pin=False, streams=streams)
    src = _bytes(n, n)
    dst = torch.zeros(n, dtype=torch.uint8)
    for _ in range(2):  # a second download reuses both buffers
        dst.zero_()
        with streams.stream(down):
            staging.download(dst, src, down)
        assert torch.equal(dst, src)
    _reuse_waits(streams.trace)
    staging.close()


def test_piece_size_follows_free_device_memory():
    """The setup's pieces: PIECE_BYTES off CUDA and with room; smaller where the staging buffers
    (2 x DEPTH of them) would take more than a quarter of the free device memory; never below 16 MB."""
    from weightstream.offload.host.encode_device import DEPTH, PIECE_BYTES, piece_bytes_for

    assert piece_bytes_for("cpu") == PIECE_BYTES
    assert piece_bytes_for("cuda", free_bytes=100 << 30) == PIECE_BYTES
    small = piece_bytes_for("cuda", free_bytes=2 << 30)
    assert small < PIECE_BYTES and 2 * DEPTH * small <= (2 << 30) // 4
    assert piece_bytes_for("cuda", free_bytes=1 << 20) == 16 << 20
