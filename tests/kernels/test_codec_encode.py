"""The CPU encoder (kernels/codec_encode.py): encode -> reference decode is the identity on raw bits,
the coded sizes are what the format promises, k (and k2) are chosen as documented, and the bytes
are the golden ones the format first shipped (whatever the chunking, the index path, the threads).
Every comparison is exact (`torch.equal` on integer views)."""
import math

import pytest
import torch

from weightstream.fills import FILLS, fan_in, fill
from weightstream.kernels.codec import decode_tensor
from weightstream.kernels.codec_encode import encode, symbol_entropy
from weightstream.kernels.codec_format import DEFAULT_TILE, read_header

from codec_cases import _all_patterns, _roundtrip, _skewed_bits, _weightlike_bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [None, 1, 2, 3, 5, 7, 8])
def test_exhaustive_roundtrip_reference(dtype, k):
    x = _all_patterns(dtype)
    blob = _roundtrip(x, k=k)
    head = read_header(blob)
    assert head.k == (8 if k is None else k)  # 256 equally frequent symbols: nothing to gain
    if k is not None and k < 8:
        assert head.num_exceptions == 65536 - 256 * (2**k - 1)


def test_special_values_survive():
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3.0e38, -1.0]
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.tensor(specials * 50, dtype=torch.float32).to(dtype)
        nan_payloads = torch.tensor([0x7FC1, 0x7F81, -0x7F, -0x1], dtype=torch.int16).view(dtype)
        _roundtrip(torch.cat([x, nan_payloads]))


# coded bytes / raw bytes on weight-like fills; bf16 bounds from the exponent
# entropy (DESIGN.md: 0.64 / 0.66 / 0.67) plus ~1/32 for the fixed-length code
RATIO_BOUNDS = {
    torch.bfloat16: {"uniform": (0.66, 0.70), "gaussian": (0.68, 0.71), "student-t": (0.69, 0.72)},
    torch.float16: {"uniform": (0.80, 0.90), "gaussian": (0.80, 0.91), "student-t": (0.80, 0.91)},
}


@pytest.mark.parametrize("kind", FILLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fills_roundtrip_and_ratio(kind, dtype):
    x = fill(kind, (384, 1024), dtype=dtype, generator=torch.Generator().manual_seed(3))
    head = read_header(_roundtrip(x))
    lo, hi = RATIO_BOUNDS[dtype][kind]
    assert lo <= head.ratio <= hi, (kind, dtype, head.ratio, head.k)
    assert head.bits_per_weight == pytest.approx(16 * head.ratio)
    # no code beats the symbol entropy: 8 raw bits + H per element
    assert head.bits_per_weight >= 8 + symbol_entropy(x) - 1e-6
    if dtype == torch.bfloat16:
        assert head.k in (2, 3)


def test_fills_are_deterministic_and_scaled():
    a = fill("student-t", (64, 256), generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    b = fill("student-t", (64, 256), generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    assert torch.equal(a, b)
    assert a.std().item() == pytest.approx(1 / math.sqrt(256), rel=0.15)
    u = fill("uniform", (64, 256), generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    assert u.abs().max().item() <= 1 / math.sqrt(256)
    g = fill("gaussian", (4096,), scale=2.0, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    assert g.std().item() == pytest.approx(2.0, rel=0.1)
    kurt = lambda t: ((t - t.mean()) ** 4).mean() / t.var() ** 2  # noqa: E731
    big = (256, 1024)
    t4 = fill("student-t", big, generator=torch.Generator().manual_seed(6), dtype=torch.float32)
    g4 = fill("gaussian", big, generator=torch.Generator().manual_seed(6), dtype=torch.float32)
    assert kurt(t4) > 4.5 > kurt(g4)  # heavy tails
    assert fan_in((3, 4, 5)) == 20 and fan_in((7,)) == 7 and fan_in(()) == 1


def test_fill_validation():
    with pytest.raises(ValueError, match="kind must be one of"):
        fill("laplace", (2,))
    with pytest.raises(ValueError, match="df must be an int >= 1"):
        fill("student-t", (2,), df=0)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        fill("gaussian", (2,), scale=-1.0)
    with pytest.raises(ValueError, match="shape must have sizes >= 0"):
        fill("gaussian", (2, -1))


def test_sampled_histogram_never_trusts_one_symbol():
    """Over 1 Mi elements the encoder picks k from every 4th chunk of 256 Ki;
    a rare symbol outside the sample must still be coded (escape or k > 0)."""
    x = torch.full((5 << 18,), 1.0, dtype=torch.bfloat16)
    x[300_000] = 4.0  # in chunk 1, which the sample skips
    head = read_header(_roundtrip(x))
    assert head.k == 1 and head.table == (127,) and head.num_exceptions == 1  # 4.0 is the one escape
    with pytest.raises(ValueError, match="k=0 needs a tensor with one symbol value, this one has 2"):
        encode(x, k=0)
    with pytest.raises(ValueError, match="k=0 needs every symbol to be table"):
        encode(x, k=0, table=[127])


def test_encode_validation():
    x = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="tensor dtype must be one of"):
        encode(torch.ones(4))
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        encode([1.0])
    with pytest.raises(ValueError, match=r"k must be in \[0, 8\], got 9"):
        encode(x, k=9)
    with pytest.raises(ValueError, match="tile must be a power of two"):
        encode(x, tile=1000)
    with pytest.raises(ValueError, match=r"tile must be in \[128, 65536\], got 64"):
        encode(x, tile=64)
    with pytest.raises(ValueError, match="k=0 needs a tensor with one symbol value"):
        encode(torch.tensor([1.0, 4.0], dtype=torch.bfloat16), k=0)
    with pytest.raises(ValueError, match="table must hold 3 distinct symbols for k=2"):
        encode(x, k=2, table=[1, 2])
    with pytest.raises(ValueError, match="table needs k in"):
        encode(x, table=[1])


# sha256 of the coded bytes as the format first shipped them (computed with the encoder before
# its speed-ups): the encoder may get faster, its bytes may not change
GOLDEN_SHA256 = {
    ("bf16-lookup", 5000): "822635647261d4d836d41a6c75cc60dad3ee31ac5a66732945d6dbccf3022541",
    ("bf16-lookup", 1_500_000): "3d182d68070e640887a0043c22af3bc405807d5219815e68d621d0360323fcb4",
    ("bf16-window", 1_500_000): "32180cab8a28c4aea23e797d91a149ca7ae5788c7717189bd8b3935853b9458f",
    ("fp16", 1_500_000): "4789bb8c91d561ed47c78e43461119370822314f1772025f7df9549aba166a17",
    ("int16-k8", 1_300_001): "fe0dda3ec4eaf54313e770073676825dabb4d61167b1f62c98e6eb850e864087",
}


def _golden_blob(case: str, numel: int) -> torch.Tensor:
    if case == "bf16-lookup":
        return encode(_weightlike_bits(numel))
    if case == "bf16-window":
        return encode(_weightlike_bits(numel, window=7))
    if case == "fp16":
        return encode(_weightlike_bits(numel, dtype=torch.float16))
    return encode(_weightlike_bits(numel, dtype=torch.int16), k=8, tile=1024)


@pytest.mark.parametrize("case, numel", sorted(GOLDEN_SHA256))
def test_encoded_bytes_are_the_format_golden_bytes(case, numel):
    import hashlib

    blob = _golden_blob(case, numel)
    head = read_header(blob)
    assert head.k == (8 if case == "int16-k8" else 3) and (head.num_exceptions > 0) == (case != "int16-k8")
    if case.startswith("bf16"):  # the window case codes by subtraction, the other by a lookup
        t = head.table
        assert all((b - a) % 256 == 1 for a, b in zip(t, t[1:])) == (case == "bf16-window")
    assert hashlib.sha256(blob.numpy().tobytes()).hexdigest() == GOLDEN_SHA256[(case, numel)]


def test_encoded_bytes_do_not_depend_on_intra_op_threads():
    t = fill("student-t", (1200, 1024), generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        blobs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            blobs.append(encode(t))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(blobs[0], b) for b in blobs[1:])
    assert torch.equal(decode_tensor(blobs[0], t.shape).view(torch.int16), t.view(torch.int16))


def test_bench_codec_build_path_figures():
    """perf/bench_codec.py's build-path rates: real encodes at 1 and 2 workers, figures that
    agree with each other, and a result file perf/results.py accepts."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from perf import bench_codec
    from perf.results import validate_result

    assert bench_codec.default_build_workers(16) == [1, 2, 4, 8, 16]
    assert bench_codec.default_build_workers(6) == [1, 2, 4, 6]
    assert bench_codec.default_build_workers(1) == [1]
    gen = torch.Generator().manual_seed(0)
    tensors = [fill("gaussian", (300, 1024), generator=gen),
               fill("gaussian", (64,), generator=gen, dtype=torch.float16)]
    modes = bench_codec.build_figures(tensors, blocks=3, workers=[1, 2], reps=2)
    assert sorted(modes) == ["triton-build-source", "triton-build-w1", "triton-build-w2"]
    raw = 3 * (300 * 1024 + 64) * 2
    for name, f in modes.items():
        assert f["raw_bytes"] == raw and f["blocks"] == 3 and f["reps"] == 2
        assert math.isclose(f["gbps"], raw / f["build_s"] / 1e9)
        assert math.isclose(f["gbps_per_worker"], f["gbps"] / f["workers"])
        assert f["cpu_gbps_per_core"] > 0 and math.isclose(f["step_ms"], 1e3 * f["build_s"])
    assert modes["triton-build-w2"]["workers"] == 2
    whole = modes["triton-build-source"]
    assert whole["workers"] == whole["cores"] == bench_codec.usable_cores()
    validate_result({"scenario": "codec-cpu", "gpu": "cpu", "gpus": 0, "commit": "abc", "torch": torch.__version__,
                     "date": "2026-01-01T00:00:00Z", "modes": modes})


def test_encode_into_out():
    t = fill("student-t", (700, 1600), generator=torch.Generator().manual_seed(5))
    ref = encode(t)
    big = torch.full((ref.numel() + 100,), 0xA5, dtype=torch.uint8)
    got = encode(t, out=big[16:])
    assert got.data_ptr() == big[16:].data_ptr() and torch.equal(got, ref)
    assert (big[:16] == 0xA5).all() and (big[16 + ref.numel():] == 0xA5).all(), "wrote outside the coded bytes"
    small = torch.zeros(ref.numel() - 1, dtype=torch.uint8)
    got = encode(t, out=small)
    assert got.data_ptr() != small.data_ptr() and torch.equal(got, ref) and not small.any()
    for bad in (torch.zeros(10, dtype=torch.int16), torch.zeros(2, 8, dtype=torch.uint8), [0] * 10):
        with pytest.raises(TypeError, match="out must be"):
            encode(t, out=bad)


@pytest.mark.parametrize("case", ["bf16-lookup", "bf16-window", "fp16"])
def test_encoded_bytes_do_not_depend_on_the_code_chunk(case, monkeypatch):
    """The encoder codes a tensor chunk by chunk (_CODE_CHUNK elements): any multiple of the tile
    gives the same bytes (the golden tensors fit one default chunk: cut them in many here)."""
    import weightstream.kernels.codec_encode as codec_mod

    whole = _golden_blob(case, 1_500_000)
    monkeypatch.setattr(codec_mod, "_CODE_CHUNK", 3 * DEFAULT_TILE)
    assert torch.equal(_golden_blob(case, 1_500_000), whole)
    x = {"bf16-lookup": lambda: _weightlike_bits(1_500_000),
         "bf16-window": lambda: _weightlike_bits(1_500_000, window=7),
         "fp16": lambda: _weightlike_bits(1_500_000, dtype=torch.float16)}[case]()
    assert torch.equal(encode(x, _torch_index=True), whole)  # the torch escape path, chunk after chunk


@pytest.mark.parametrize("case", ["bf16-lookup", "bf16-window", "fp16"])
def test_torch_index_path_gives_the_golden_bytes(case):
    """The escape indices found with torch ops (the path a CUDA tensor takes: nonzero,
    searchsorted, indexing where the chunk lives) equal numpy's: the same golden bytes."""
    import hashlib

    x = {"bf16-lookup": lambda: _weightlike_bits(1_500_000),
         "bf16-window": lambda: _weightlike_bits(1_500_000, window=7),
         "fp16": lambda: _weightlike_bits(1_500_000, dtype=torch.float16)}[case]()
    blob = encode(x, _torch_index=True)
    assert hashlib.sha256(blob.numpy().tobytes()).hexdigest() == GOLDEN_SHA256[(case, 1_500_000)]


@pytest.mark.gpu
@pytest.mark.parametrize("numel", [1, 4095, 4097, 3_000_001])
def test_encode_on_the_gpu_gives_the_cpu_bytes(numel):
    """A CUDA tensor is coded on its device: the same bytes as the CPU encoder, into a CPU
    `out` (D2H) or as a CUDA buffer."""
    x = _weightlike_bits(numel)
    want = encode(x)
    on_gpu = encode(x.cuda())
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), want)
    out = torch.zeros(want.numel() + 64, dtype=torch.uint8)
    got = encode(x.cuda(), out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, k2", [(None, None), (1, 1), (2, 3), (3, 2), (7, 7), (4, 0)])
def test_v2_exhaustive_roundtrip_reference(dtype, k, k2):
    x = _all_patterns(dtype)
    blob = _roundtrip(x, levels=2, k=k, k2=k2)
    head = read_header(blob)
    if k2 is None:  # 256 equally frequent symbols: one level (k = 8) is the smallest, version-1 bytes
        assert (head.version, head.k, head.k2) == (1, 8, 0) and torch.equal(blob, encode(x))
    elif k2 == 0:  # forced one level: exactly exp-k's bytes
        assert head.version == 1 and torch.equal(blob, encode(x, k=k))
    else:
        n1, n2 = 2**k - 1, 2**k2 - 1
        assert (head.version, head.k, head.k2, len(head.table)) == (2, k, k2, n1 + n2)
        assert head.num_escapes == 65536 - 256 * n1 and head.num_exceptions == 65536 - 256 * (n1 + n2)
        assert bytes(blob[:4].tolist()) == b"WSC1" and int(blob[4]) == 2


def test_v2_student_t_bits_per_weight():
    """exp-k2 on Student-t (df=4) bf16 weights of Flux's fan-in (3072): 10.98 bits per weight
    measured ((k, k2) = (2, 3); one level: 11.31). Other fan-ins move it with the scale's
    place between powers of two: 1024 -> 11.02, 5120 -> 11.06 (one level 11.32 / 11.34)."""
    x = fill("student-t", (3072, 3072), generator=torch.Generator().manual_seed(1))
    one, two = read_header(_roundtrip(x)), read_header(_roundtrip(x, levels=2))
    assert (two.version, two.k, two.k2) == (2, 2, 3)
    assert two.bits_per_weight <= 11.0 < 11.25 <= one.bits_per_weight, (two.bits_per_weight, one.bits_per_weight)
    assert two.bits_per_weight >= 8 + symbol_entropy(x) - 1e-6


@pytest.mark.parametrize("kind", FILLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_v2_never_larger_than_one_level(kind, dtype):
    x = fill(kind, (384, 1024), dtype=dtype, generator=torch.Generator().manual_seed(3))
    one, two = read_header(_roundtrip(x)), read_header(_roundtrip(x, levels=2))
    assert two.nbytes <= one.nbytes and (two.version == 1) == (two.nbytes == one.nbytes)
    if dtype == torch.bfloat16:
        assert two.version == 2 and two.nbytes < 0.985 * one.nbytes, (kind, two.bits_per_weight)


GOLDEN_V2_SHA256 = {
    "bf16-window": "7565bda942b3de13f3b17480ac363cff109c61f06c2101d39e9508ee2e54bc5a",
    "bf16-lookup": "0b708d712da0a71691221609318543f2b12fec55d39beebfccbdc49ef4f7dd6a",
    "fp16": "468d7d261fca064b136af8780b080a308d431737af6df7bf05c77cc08a1ab29e",
}
_V2_INPUTS = {
    "bf16-window": lambda: _skewed_bits(1_500_000),
    "bf16-lookup": lambda: _skewed_bits(1_500_000, window=False),
    "fp16": lambda: _skewed_bits(1_500_000, dtype=torch.float16),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_V2_SHA256))
@pytest.mark.parametrize("torch_index", [False, True])
def test_v2_encoded_bytes_are_the_golden_bytes(case, torch_index):
    """Version-2 bytes as first shipped (levels=2), from numpy's escape indices and from
    torch's (the path a CUDA tensor takes): the same golden bytes."""
    import hashlib

    blob = encode(_V2_INPUTS[case](), levels=2, _torch_index=torch_index)
    head = read_header(blob)
    assert head.version == 2 and (head.k, head.k2) == ((3, 3) if case == "fp16" else (2, 3))
    if case.startswith("bf16"):  # the window case codes level 1 by subtraction, the other by a lookup
        assert (head.table[:3] == (124, 125, 126)) == (case == "bf16-window")
    assert hashlib.sha256(blob.numpy().tobytes()).hexdigest() == GOLDEN_V2_SHA256[case]


@pytest.mark.parametrize("case", sorted(GOLDEN_V2_SHA256))
def test_v2_encoded_bytes_do_not_depend_on_the_code_chunk(case, monkeypatch):
    """Cut in many chunks, level-2 codes straddle chunk ends: the same bytes."""
    import weightstream.kernels.codec_encode as codec_mod

    whole = encode(_V2_INPUTS[case](), levels=2)
    monkeypatch.setattr(codec_mod, "_CODE_CHUNK", 3 * DEFAULT_TILE)
    assert torch.equal(encode(_V2_INPUTS[case](), levels=2), whole)
    assert torch.equal(encode(_V2_INPUTS[case](), levels=2, _torch_index=True), whole)


def test_v2_validation():
    x = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"levels must be in \[1, 3\], got 4"):
        encode(x, levels=4)
    with pytest.raises(ValueError, match="k2=2 needs levels=2"):
        encode(x, k2=2)
    with pytest.raises(ValueError, match=r"k2 must be in \[0, 7\], got 8"):
        encode(x, levels=2, k2=8)
    with pytest.raises(ValueError, match=r"k2=3 needs k in \[1, 7\]"):
        encode(x, levels=2, k=8, k2=3)
    with pytest.raises(ValueError, match="table with levels=2 needs k2=0"):
        encode(x, levels=2, k=2, table=[1, 2, 3])
    assert torch.equal(encode(x, levels=2, k=2, k2=0, table=[1, 2, 127]), encode(x, k=2, table=[1, 2, 127]))


@pytest.mark.gpu
@pytest.mark.parametrize("numel", [1, 4097, 3_000_001])
def test_gpu_v2_encode_on_the_gpu_gives_the_cpu_bytes(numel):
    x = _skewed_bits(numel)
    want = encode(x, levels=2)
    assert numel == 1 or read_header(want).version == 2
    assert torch.equal(encode(x.cuda(), levels=2).cpu(), want)


def test_bench_codec_reports_both_codecs():
    """perf/bench_codec.py --codec exp-k exp-k2: the figures of each (CPU part), -k2 modes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from perf import bench_codec

    tensors = [fill("student-t", (512, 3072), generator=torch.Generator().manual_seed(2))]
    _, t1, one = bench_codec.encode_stats(tensors, DEFAULT_TILE, threaded=False, codec="exp-k")
    _, t2, two = bench_codec.encode_stats(tensors, DEFAULT_TILE, threaded=False, codec="exp-k2")
    assert (one["k"], one["k2"], two["k"], two["k2"]) == ([3], [0], [2], [3])
    assert two["coded_bytes"] < one["coded_bytes"] and two["bits_per_weight"] < 11.0 < one["bits_per_weight"]
    assert two["exception_fraction"] < one["exception_fraction"] < two["escape_fraction"]
    assert t2.segments[0].header.version == 2
    assert bench_codec.CODEC_SUFFIX == {"exp-k": "", "exp-k2": "-k2", "exp-kp": "-kp"}
    _, tp, patched = bench_codec.encode_stats(tensors, DEFAULT_TILE, threaded=False, codec="exp-kp")
    assert tp.segments[0].header.version == 3 and tp.patched
    assert one["coded_bytes"] < patched["coded_bytes"] < 0.77 * 2 * tensors[0].numel()
