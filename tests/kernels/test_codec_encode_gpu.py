"""The GPU encoder (kernels/codec_encode_gpu.py, under TRITON_INTERPRET=1 on the CPU): the CPU
encoder's bytes (kernels/codec_encode.py, the reference) for every dtype, level, size around the
tiles, escape pattern and given k; the host store's block rule (offload/host/encode_device.py
against offload/host/encode.py encode_image) through the staging pipeline; the golden digests on
the GPU. Every comparison is exact (`torch.equal` on the bytes)."""
import hashlib

import pytest
import torch

from weightstream.kernels.codec_encode import encode
from weightstream.kernels.codec_encode_gpu import EncodeJob, bytes_moved, encode_gpu, encode_jobs
from weightstream.kernels.codec_format import PATCHED, read_header
from weightstream.offload.host.encode import encode_image
from weightstream.offload.host.encode_device import by_offset, code_on_device, fill_from_tensors, pieces
from weightstream.offload.layout import build_layout

from codec_cases import DEVICE, SMALL_TILE, _every_symbol, _skewed_bits, _weightlike_bits

LEVEL_CASES = [1, 2, PATCHED]
TILE = 4 * SMALL_TILE  # small enough for several tiles per tensor, large enough that two levels can win


def _inputs() -> list[torch.Tensor]:
    """Sizes around the tile (TILE), skewed symbols with escapes (level-1 tables a window and a
    lookup), every symbol, one symbol (k = 0), two symbols, an empty tensor; fp16 and int16 read
    their symbol from the high byte (fewer cases: the code path after it is the same)."""
    bf16 = torch.bfloat16
    return [
        _skewed_bits(1), _skewed_bits(TILE - 1), _skewed_bits(TILE + 1, window=False), _skewed_bits(3 * TILE + 1),
        _every_symbol(bf16, per=2), torch.full((300,), 7, dtype=torch.int16).view(bf16),
        torch.tensor([1, 2] * 150, dtype=torch.int16).view(bf16), torch.zeros(0, dtype=bf16),
        _skewed_bits(2 * TILE + 3, torch.float16), _every_symbol(torch.float16, per=2),
        _weightlike_bits(700, dtype=torch.int16),
    ]


def _concat(tensors) -> tuple[torch.Tensor, list[EncodeJob]]:
    """The tensors' bytes in one buffer, each 512-byte aligned, and their jobs."""
    jobs, parts, at = [], [], 0
    for t in tensors:
        b = t.reshape(-1).view(torch.uint8)
        pad = -(at + b.numel()) % 512
        jobs.append(EncodeJob(at, b.numel(), t.dtype))
        parts += [b, torch.zeros(pad, dtype=torch.uint8)]
        at += b.numel() + pad
    return torch.cat(parts), jobs


@pytest.mark.parametrize("levels", LEVEL_CASES)
def test_one_launch_gives_the_cpu_bytes_of_every_tensor(levels):
    xs = _inputs()
    src, jobs = _concat(xs)
    coded, heads, offsets = encode_jobs(src.to(DEVICE), jobs, levels=levels, tile=TILE)
    coded = coded.cpu()
    at = 0
    for x, h, o in zip(xs, heads, offsets):
        want = encode(x, levels=levels, tile=TILE)
        assert o == at and read_header(want) == h
        assert torch.equal(coded[o : o + h.nbytes], want), (x.numel(), h)
        at += h.nbytes
    assert coded.numel() == at
    versions = {h.version for h in heads}
    assert versions == ({1} if levels == 1 else {1, 2} if levels == 2 else {1, 3})  # escapes, and k in {0, 8}
    assert bytes_moved(heads) == sum(h.decoded_bytes + h.nbytes for h in heads)


@pytest.mark.parametrize("k, levels", [(0, 1), (1, 2), (3, PATCHED), (7, 1), (7, 2), (8, 2)])
def test_given_k_gives_the_cpu_bytes(k, levels):
    x = torch.full((300,), 3, dtype=torch.int16).view(torch.bfloat16) if k == 0 else _skewed_bits(300)
    assert torch.equal(encode_gpu(x.to(DEVICE), k=k, levels=levels, tile=SMALL_TILE).cpu(),
                       encode(x, k=k, levels=levels, tile=SMALL_TILE))


def test_default_tile_and_the_golden_digest():
    x = _weightlike_bits(5000)
    got = encode_gpu(x.to(DEVICE)).cpu()
    assert hashlib.sha256(got.numpy().tobytes()).hexdigest() == \
        "822635647261d4d836d41a6c75cc60dad3ee31ac5a66732945d6dbccf3022541"  # GOLDEN_SHA256[("bf16-lookup", 5000)]


def test_sampled_histogram_and_an_odd_byte_count():
    """Over 1 Mi elements the CPU encoder chooses k from every 4th chunk of 256 Ki: so does the
    GPU's (large tiles keep the interpreter quick). A job of an odd byte count reads a zero high
    byte last, as the host store pads its raw tensors."""
    x = _skewed_bits(1_100_000, window=False)
    x[:262144] = _skewed_bits(262144, window=True)  # the sampled chunks differ from the whole
    got = encode_gpu(x.to(DEVICE), tile=65536).cpu()
    assert torch.equal(got, encode(x, tile=65536))
    raw = torch.arange(301, dtype=torch.int64).to(torch.uint8)
    src = torch.cat([raw, torch.full((11,), 255, dtype=torch.uint8)])  # bytes past the job are not read
    coded, (head,), _ = encode_jobs(src.to(DEVICE), [EncodeJob(0, 301, torch.int16, 8)], tile=SMALL_TILE)
    assert torch.equal(coded.cpu(), encode(torch.cat([raw, raw.new_zeros(1)]).view(torch.int16), k=8,
                                           tile=SMALL_TILE))


def test_validation():
    src = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="src_offset must be even"):
        EncodeJob(1, 4, torch.bfloat16)
    with pytest.raises(TypeError, match="dtype must be one of"):
        EncodeJob(0, 4, torch.float32)
    with pytest.raises(ValueError, match=r"jobs\[0\] reads bytes \[0, 128\) but src has 64"):
        encode_jobs(src, [EncodeJob(0, 128, torch.bfloat16)])
    with pytest.raises(ValueError, match="out has 16 bytes, the coded tensors need"):
        encode_jobs(src, [EncodeJob(0, 64, torch.bfloat16)], torch.zeros(16, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(TypeError, match="src must be a 1-D contiguous uint8 tensor"):
        encode_jobs(src.view(torch.int16), [])
    with pytest.raises(TypeError, match="tensor dtype must be one of"):
        encode_gpu(torch.zeros(4, device=DEVICE))


def _block(gen, scale: int = 1):
    """A block of every kind of tensor the host store meets: bf16 / fp16 weights, a strided
    (transposed) bf16 one, fp32 (raw at k = 8) and fp8 (coded; an odd byte count) ones, an
    incompressible bf16 one (past its raw bound: raw int16), an empty one."""
    ts = [("w", "param", (torch.randn(48 * scale, 64, generator=gen) * 0.02).bfloat16()),
          ("t", "param", (torch.randn(64, 40 * scale, generator=gen) * 0.02).bfloat16().t()),
          ("h", "param", (torch.randn(333 * scale, generator=gen) * 0.1).half()),
          ("f", "buffer", torch.randn(77, generator=gen)),
          ("q", "param", (torch.randn(1001, generator=gen)).to(torch.float8_e4m3fn)),
          ("r", "param", torch.randint(-32768, 32768, (900,), generator=gen).to(torch.int16).view(torch.bfloat16)),
          ("e", "param", torch.zeros(0, dtype=torch.bfloat16))]
    return ts


@pytest.mark.parametrize("levels, host_staging, host_chunk, depth",
                         [(1, True, 1 << 20, 3), (2, False, 1 << 20, 2), (PATCHED, True, 1000, 4)])
def test_blocks_through_the_staging_pair_give_the_host_bytes(levels, host_staging, host_chunk, depth):
    """code_on_device (the staging pipeline of BlockImages on CUDA; here with RecordingStreams on
    the CPU) stores, per block, encode_image's bytes and table, pieces cut or not; through the
    host buffers (as pageable memory goes on CUDA; chunks smaller than a piece too) or straight, with
    2 to 4 staging buffers of each kind."""
    gen = torch.Generator().manual_seed(levels)
    blocks = [_block(gen, s) for s in (1, 2)]
    layouts = [build_layout(k, f"b{k}", ts) for k, ts in enumerate(blocks)]
    objs = [[t for _, _, t in ts] for ts in blocks]
    for piece_bytes in ((1 << 30, 8192) if levels == 2 else (1 << 30,)):
        got = {}
        regions = [torch.zeros(8 * lay.nbytes + 65536, dtype=torch.uint8) for lay in layouts]
        ps = [pieces(k, lay, piece_bytes) for k, lay in enumerate(layouts)]
        assert all(len(p) == 1 for p in ps) == (piece_bytes > 8192)
        code_on_device(DEVICE, ps, levels, fill_from_tensors(lambda k, specs: by_offset(layouts[k], objs[k], specs)),
                       lambda k, at, n: (regions[k][at : at + n], "pageable"),
                       lambda k, n, table: got.setdefault(k, (n, table)), host_staging=host_staging,
                       host_chunk=host_chunk, depth=depth)
        assert sorted(got) == [0, 1]
        for k, lay in enumerate(layouts):
            blobs, table = encode_image(lay, objs[k], levels=levels)
            want = torch.cat(blobs)
            n, gtable = got[k]
            assert n == want.numel() and torch.equal(regions[k][:n], want)
            assert gtable.segments == table.segments and gtable.options() == table.options()
            assert (gtable.two_level, gtable.patched, gtable.ranked) == (table.two_level, table.patched, table.ranked)


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("stage", ["fill", "dest", "done"])
def test_a_failing_stage_raises_its_error_and_nothing_hangs(stage):
    """Each of the encoder's stages (uploads, downloads, done) runs on a thread of its own: a failure
    in any is raised by code_on_device itself (not a stand-in), the other stages stop, and ``done``
    ran only for blocks before the failure, in order."""
    gen = torch.Generator().manual_seed(3)
    blocks = [_block(gen, 1) for _ in range(4)]
    layouts = [build_layout(k, f"b{k}", ts) for k, ts in enumerate(blocks)]
    objs = [[t for _, _, t in ts] for ts in blocks]
    regions = [torch.zeros(8 * lay.nbytes + 65536, dtype=torch.uint8) for lay in layouts]
    inner = fill_from_tensors(lambda k, specs: by_offset(layouts[k], objs[k], specs))
    finished = []

    def fill(piece, staging, host=None):
        if stage == "fill" and piece.k == 2:
            raise _Boom("fill")
        inner(piece, staging, host)

    def dest(k, at, n):
        if stage == "dest" and k == 2:
            raise _Boom("dest")
        return regions[k][at : at + n], "pageable"

    def done(k, n, table):
        if stage == "done" and k == 2:
            raise _Boom("done")
        finished.append(k)

    with pytest.raises(ValueError, match="depth=1 is not allowed"):
        code_on_device(DEVICE, [pieces(0, layouts[0])], 1, fill, dest, done, depth=1)
    with pytest.raises(_Boom, match=stage):
        code_on_device(DEVICE, [pieces(k, lay) for k, lay in enumerate(layouts)], 1, fill, dest, done,
                       host_staging=True)
    assert finished == [0, 1][: len(finished)] and 3 not in finished


def _raw_store(seed: int):
    """A CPU store of three raw blocks (codec='auto') told to code through the GPU pipeline (the
    interpreter and RecordingStreams), its layouts and a copy of each raw image."""
    from weightstream.offload.host.images import BlockImages

    gen = torch.Generator().manual_seed(seed)
    blocks = [_block(gen, 1) for _ in range(3)]
    layouts = [build_layout(k, f"b{k}", ts) for k, ts in enumerate(blocks)]
    images = BlockImages(layouts, [[t.clone() for _, _, t in ts] for ts in blocks], device="cpu", pin=False,
                         codec="auto")
    images.encode_on = "device"
    return images, layouts, [images.region(k)[: lay.nbytes].clone() for k, lay in enumerate(layouts)]


def _assert_coded_like_the_cpu(images, k: int, lay, raw: torch.Tensor) -> None:
    blobs, table = encode_image(lay, [s.view_of(raw) for s in lay.tensors], levels=PATCHED)
    want = torch.cat(blobs)
    assert images.coded[k] == want.numel() and torch.equal(images.region(k)[: want.numel()], want)
    assert images.tables[k].segments == table.segments


def test_coding_in_place_keeps_the_raw_region_as_it_is_past_the_coded_bytes():
    """The setup's in-place coding (``_code_on_device(keep=True)``, encode_on='in-place' on CUDA;
    here a CPU store told to take the pipeline): the encoder's bytes and table at each region's
    start, the raw bytes past them left where they were (no tail given back), nothing raw."""
    images, layouts, raw = _raw_store(11)
    images.levels = PATCHED
    images._code_on_device([0, 1, 2], False, keep=True)
    assert images.raw == [False] * 3
    for k, lay in enumerate(layouts):
        _assert_coded_like_the_cpu(images, k, lay, raw[k])
        tail = slice(images.copy_bytes[k], lay.nbytes)
        assert torch.equal(images.region(k)[tail], raw[k][tail])  # kept, not given back (keep=True)
    images.close()


def test_auto_codes_raw_blocks_where_they_lie_through_the_pipeline():
    """weight_codec='auto''s at-once path of a store that codes on the device
    (AutoCoding._code_on_device; here a CPU store told to take it: the interpreter and
    RecordingStreams): the blocks asked for hold encode_image's bytes and table, the others stay raw,
    no background job is left even when one was asked for."""
    images, layouts, raw = _raw_store(7)
    images.code_blocks([0, 2], "exp-kp", background=True)
    assert not images.coding_active and images.raw == [False, True, False]
    for k in (0, 2):
        _assert_coded_like_the_cpu(images, k, layouts[k], raw[k])
    assert torch.equal(images.region(1)[: layouts[1].nbytes], raw[1])
    images.close()


@pytest.mark.gpu
def test_gpu_large_tensors_and_the_golden_digests():
    """The compiled kernels on CUDA: a 64 MB bf16 random-normal * 0.02 tensor, a Student-t one
    and the golden inputs of tests/kernels/test_codec_encode.py, every level: the CPU bytes."""
    from test_codec_encode import _V2_INPUTS, GOLDEN_SHA256, GOLDEN_V2_SHA256

    from weightstream.fills import fill

    for (case, numel), digest in GOLDEN_SHA256.items():
        x = {"bf16-lookup": lambda: _weightlike_bits(numel), "bf16-window": lambda: _weightlike_bits(numel, window=7),
             "fp16": lambda: _weightlike_bits(numel, dtype=torch.float16),
             "int16-k8": lambda: _weightlike_bits(numel, dtype=torch.int16)}[case]()
        kw = {"k": 8, "tile": 1024} if case == "int16-k8" else {}
        got = encode_gpu(x.cuda(), **kw).cpu()
        assert hashlib.sha256(got.numpy().tobytes()).hexdigest() == digest, case
    for case, digest in GOLDEN_V2_SHA256.items():
        got = encode_gpu(_V2_INPUTS[case]().cuda(), levels=2).cpu()
        assert hashlib.sha256(got.numpy().tobytes()).hexdigest() == digest, case
    gen = torch.Generator().manual_seed(0)
    big = [(torch.randn(32 << 20, generator=gen) * 0.02).bfloat16(),
           fill("student-t", (4096, 3072), generator=gen).to(torch.bfloat16),
           fill("gaussian", (3072, 1000), generator=gen).to(torch.float16)]
    for x in big:
        for levels in LEVEL_CASES:
            assert torch.equal(encode_gpu(x.cuda(), levels=levels).cpu(), encode(x, levels=levels)), (x.shape, levels)


@pytest.mark.gpu
@pytest.mark.parametrize("host_chunk", [64 << 20, 12345])
def test_gpu_blocks_through_the_staging_pair(host_chunk):
    """The pipeline on CUDA streams (uploads, encodes and downloads overlapping, each from a thread
    of its own; pageable bytes through the pinned buffers whole or in many chunks a piece):
    encode_image's bytes."""
    gen = torch.Generator().manual_seed(1)
    blocks = [_block(gen, s) for s in (64, 128, 64, 32)]
    layouts = [build_layout(k, f"b{k}", ts) for k, ts in enumerate(blocks)]
    objs = [[t for _, _, t in ts] for ts in blocks]
    for levels in LEVEL_CASES:
        got = {}
        regions = [torch.zeros(2 * lay.nbytes + 65536, dtype=torch.uint8) for lay in layouts]
        code_on_device("cuda", [pieces(k, lay, 1 << 20) for k, lay in enumerate(layouts)], levels,
                       fill_from_tensors(lambda k, specs: by_offset(layouts[k], objs[k], specs)),
                       lambda k, at, n: (regions[k][at : at + n], "pageable"),
                       lambda k, n, table: got.setdefault(k, (n, table)), host_chunk=host_chunk)
        for k, lay in enumerate(layouts):
            blobs, table = encode_image(lay, objs[k], levels=levels)
            want = torch.cat(blobs)
            assert got[k][0] == want.numel() and torch.equal(regions[k][: want.numel()], want)
            assert got[k][1].segments == table.segments


def _tiny_flux_blocks(codec_seed: int = 0):
    from weightstream.fills import fill
    from weightstream.models import tiny_flux
    from weightstream.offload.discovery import discover_blocks
    from weightstream.offload.layout import block_tensors

    model = tiny_flux(dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(codec_seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(fill("student-t", tuple(p.shape), generator=gen).to(p.dtype))
    blocks = discover_blocks(model, None)
    tensors = [block_tensors(b.module) for b in blocks]
    return model, [build_layout(b.index, b.name, ts) for b, ts in zip(blocks, tensors)], tensors


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["exp-k", "exp-k2", "exp-kp"])
def test_gpu_coded_source_codes_on_the_device_by_default(codec):
    """On CUDA a CodedSource codes its blocks on the GPU unless told encode_on='cpu': the CPU
    encoder's bytes and tables, pinned."""
    from weightstream.offload.sources.pinned import CodedSource

    _, layouts, tensors = _tiny_flux_blocks()
    objs = lambda: [[t.detach().clone() for _, _, t in ts] for ts in tensors]  # noqa: E731
    cpu = CodedSource(layouts, objs(), device="cuda", pin=True, encode_on="cpu", codec=codec)
    gpu = CodedSource(layouts, objs(), device="cuda", pin=True, codec=codec)
    # in place: raw images packed and pinned, then coded where they lie (DMA both ways)
    place = CodedSource(layouts, objs(), device="cuda", pin=True, codec=codec, encode_on="in-place")
    assert gpu.images.encode_on == "device" and cpu.images.encode_on == "cpu"
    for other in (gpu, place):
        for k in range(len(layouts)):
            n = cpu.images.coded[k]
            assert n == other.images.coded[k] and torch.equal(cpu.images.region(k)[:n], other.images.region(k)[:n])
            assert cpu.images.tables[k].segments == other.images.tables[k].segments
            assert other.images._regs[k].bytes >= other.images.copy_bytes[k]  # a copy reads one registration
        assert other.images.all_pinned and not any(other.images.raw)
    cpu.close()
    gpu.close()
    place.close()  # the streamed model on these bytes: tests/test_coded_source_gpu.py (CUDA codes on the GPU)


@pytest.mark.gpu
def test_gpu_auto_codes_the_planned_blocks_at_once():
    """weight_codec='auto' on CUDA: code_blocks (background asked or not) codes the blocks on the GPU
    where they lie before it returns: no background job, the CPU encoder's bytes, raw pages given
    back, pinned at their coded size."""
    from weightstream.offload.sources.pinned import CodedSource

    _, layouts, tensors = _tiny_flux_blocks(1)
    objs = lambda: [[t.detach().clone() for _, _, t in ts] for ts in tensors]  # noqa: E731
    src = CodedSource(layouts, objs(), device="cuda", pin=True, codec="auto")
    images = src.images
    raw = [images.region(k)[: layouts[k].nbytes].clone() for k in range(len(layouts))]
    ks = [0, 2, len(layouts) - 1]
    images.code_blocks(ks, "exp-k2", background=True)
    assert not images.coding_active and images.raw == [k not in ks for k in range(len(layouts))]
    for k in ks:
        blobs, table = encode_image(layouts[k], [s.view_of(raw[k]) for s in layouts[k].tensors], levels=2)
        want = torch.cat(blobs)
        assert images.coded[k] == want.numel() and torch.equal(images.region(k)[: want.numel()], want)
        assert images.tables[k].segments == table.segments
        assert images._regs[k].bytes >= images.copy_bytes[k]
    src.close()


def test_a_failed_encode_leaves_every_block_raw_or_coded_never_between(monkeypatch):
    """An encode that fails half way through coding raw blocks where they lie: the error is raised,
    and every block is either raw (its bytes untouched) or coded (the encoder's bytes, committed):
    a block whose coded bytes already came down is committed even after the failure (the done
    stage drains), so no region holds coded bytes while it is read as raw."""
    import weightstream.offload.host.encode_device as ed

    import threading
    import time

    images, layouts, raw = _raw_store(5)
    images.levels = PATCHED
    real, calls, failed = ed.encode_jobs, [], threading.Event()

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            time.sleep(0.5)  # the second block comes down meanwhile (its done waits behind the first's)
            failed.set()
            raise RuntimeError("injected: the encoder failed on the third block")
        return real(*a, **kw)

    commit = images._commit

    def late_commit(*a, **kw):  # the done stage runs only after the failure: the window this guards
        failed.wait(timeout=30)
        return commit(*a, **kw)

    monkeypatch.setattr(ed, "encode_jobs", failing)
    monkeypatch.setattr(images, "_commit", late_commit)
    with pytest.raises(RuntimeError, match="injected"):
        images._code_on_device([0, 1, 2], False, keep=True)
    assert images.raw[2] and not images.raw[0]
    for k, lay in enumerate(layouts):
        if images.raw[k]:
            assert torch.equal(images.region(k)[: lay.nbytes], raw[k]), k
        else:
            _assert_coded_like_the_cpu(images, k, lay, raw[k])
    images.close()
