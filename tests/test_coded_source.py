"""CodedSource (weight_codec='exp-k' and 'exp-k2') on the CPU: bytes in the slot equal the raw block
image, special values survive, edits/writes re-encode, nothing is lost on a failed build.

The source is driven directly (as the executor does: attach, then load per block) and,
through the wrapper, compared with the unwrapped model (see test_coded_model_* below).
"""
import copy
import os

import pytest
import torch
from layerwise_cases import build, check_equal_outputs, first
from torch import nn

from weightstream import OffloadConfig, OffloadedTransformer, UnsupportedCombinationError
from weightstream.fills import fill
from weightstream.models import tiny_flux, tiny_wan
from weightstream.offload.discovery import discover_blocks
from weightstream.offload.host.arena import HostStore
from weightstream.offload.layout import block_tensors, build_layout
from weightstream.offload.sources.base import STATS_KEYS, check_stats
from weightstream.offload.sources.decode import check_codec_supported
from weightstream.offload.sources.pinned import CodedSource
from weightstream.offload.sources.select import Topology, select
from weightstream.offload.codecs import CodedCaptureStaleError
from weightstream.offload.streams import RecordingStreams


def _blocks(model):
    blocks = discover_blocks(model, None)
    tensors = [block_tensors(b.module) for b in blocks]
    layouts = [build_layout(b.index, b.name, ts) for b, ts in zip(blocks, tensors)]
    return tensors, layouts


def _raw_images(tensors, layouts):
    """The uncoded reference: the pinned store's block images (packed before coding drops them)."""
    store = HostStore(layouts, pin=False)
    for k, ts in enumerate(tensors):
        store.pack(k, [t for _, _, t in ts])
    return [store.image(k).clone() for k in range(len(layouts))]


def _spans_equal(a: torch.Tensor, b: torch.Tensor, layout) -> list[str]:
    """Names of tensors whose bytes differ between two uint8 images (gaps are not compared)."""
    return [s.name for s in layout.tensors if not torch.equal(a[s.offset:s.offset + s.nbytes],
                                                               b[s.offset:s.offset + s.nbytes])]


def _source(model, **kw):
    tensors, layouts = _blocks(model)
    raw = _raw_images(tensors, layouts)
    src = CodedSource(layouts, [[t for _, _, t in ts] for ts in tensors], device="cpu", pin=False, **kw)
    return src, tensors, layouts, raw


def _attach(src, streams=None, n=2):
    slots = [torch.zeros(src.slot_bytes, dtype=torch.uint8) for _ in range(n)]
    src.attach(slots, streams, torch.device("cpu"))
    return slots


def _check_all_loads(src, slots, layouts, raw, tag=None):
    for k in range(len(layouts)):
        s = k % len(slots)
        slots[s].fill_(0xA5)
        out = src.load(k, s, position=k, after=None, tag=tag)
        if src._streams is None:
            assert out is None
        bad = _spans_equal(slots[s], raw[k], layouts[k])
        assert not bad, f"block {k}: tensors {bad} differ from the raw image"


def _versions(src) -> set[int]:
    """Coded tensor format versions the source's blocks hold (2: two-level, "exp-k2")."""
    return {seg.header.version for t in src.tables for seg in t.segments}


_ALL = [(d, r, "exp-k") for d in (torch.bfloat16, torch.float16, torch.float32) for r in (False, True)]


@pytest.mark.parametrize("dtype,recording,codec", _ALL + [(torch.bfloat16, True, "exp-k2"),
                                                          (torch.float16, False, "exp-k2"),
                                                          (torch.bfloat16, True, "exp-kp"),
                                                          (torch.float16, False, "exp-kp")])
def test_loads_give_raw_image(dtype, recording, codec):
    src, tensors, layouts, raw = _source(tiny_flux(dtype=dtype), codec=codec)
    assert src.name == f"coded-{codec}"
    if dtype == torch.bfloat16:  # exp-k2 holds two-level tensors (and one-level ones too small to gain)
        assert _versions(src) == {"exp-k": {1}, "exp-k2": {1, 2}, "exp-kp": {1, 3}}[codec]
    tables = [t for t in src.tables if t is not None]  # every table compiles its codec's paths (re-encodes)
    assert tables and all((t.two_level, t.patched, t.ranked) == (codec == "exp-k2", codec == "exp-kp", codec != "exp-kp")
                          for t in tables)
    assert all(t.numel() == 0 for ts in tensors for _, _, t in ts), "originals are dropped after coding"
    slots = _attach(src, RecordingStreams() if recording else None)
    _check_all_loads(src, slots, layouts, raw)
    for k in range(len(layouts)):  # image(k) decodes the same bytes
        assert not _spans_equal(src.image(k), raw[k], layouts[k])


class _Odd(nn.Module):
    """One block with every awkward tensor: special bf16/fp16 values, a transposed
    parameter, an odd-length byte buffer, int64, bool, an empty tensor."""

    def __init__(self):
        super().__init__()
        specials = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40, 5.9e-8, 3.0e38]
        g = torch.Generator().manual_seed(3)
        w = fill("student-t", (64, 96), dtype=torch.bfloat16, generator=g)
        w.view(-1)[: len(specials)] = torch.tensor(specials, dtype=torch.bfloat16)
        nan_payload = torch.tensor([0x7FC1, -127, 0x7F81, 0x0001, -32768], dtype=torch.int16)
        w.view(-1)[20:25] = nan_payload.view(torch.bfloat16)
        self.w = nn.Parameter(w)
        h = fill("gaussian", (33, 17), dtype=torch.float16, generator=g)
        h.view(-1)[: len(specials)] = torch.tensor(specials, dtype=torch.float16)
        h.view(-1)[20:25] = nan_payload.view(torch.float16)
        self.h = nn.Parameter(h)
        self.t = nn.Parameter(fill("uniform", (40, 24), dtype=torch.bfloat16, generator=g).t())  # strided
        self.f = nn.Parameter(torch.randn(7, 5, generator=g))
        self.register_buffer("bytes", torch.arange(13, dtype=torch.uint8))  # odd byte count
        self.register_buffer("flags", torch.tensor([True, False, True]))
        self.register_buffer("ids", torch.arange(5, dtype=torch.int64) - 2)
        self.register_buffer("empty", torch.zeros(0, dtype=torch.bfloat16))


class _OddDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, n=3):
        super().__init__()
        self.blocks = nn.ModuleList([_Odd() for _ in range(n)])


@pytest.mark.parametrize("recording,codec", [(False, "exp-k"), (True, "exp-k"), (True, "exp-k2"),
                                             (False, "exp-kp")])
def test_special_values_survive(recording, codec):
    src, tensors, layouts, raw = _source(_OddDiT(), codec=codec)
    assert {"exp-k": 1, "exp-k2": 2, "exp-kp": 3}[codec] in _versions(src)
    slots = _attach(src, RecordingStreams() if recording else None)
    _check_all_loads(src, slots, layouts, raw)
    view = src.host_views()
    m = _OddDiT()  # same seeds: the original values
    for (_, _, t), (name, ref) in zip(tensors[0], list(m.blocks[0].named_parameters())
                                      + list(m.blocks[0].named_buffers())):
        hv = view[id(t)]
        assert hv.dtype == ref.dtype and hv.shape == ref.shape and hv.stride() == ref.stride(), name
        if ref.numel() and ref.dtype.is_floating_point and ref.element_size() == 2:
            assert torch.equal(hv.view(torch.int16), ref.detach().view(torch.int16)), name
        else:
            assert torch.equal(hv, ref), name


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2", "exp-kp"])
def test_coded_bytes_below_raw_on_student_t(codec):
    class Big(nn.Module):
        _layerwise_offload_blocks_attrs = ["blocks"]

        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.blocks = nn.ModuleList([nn.Linear(512, 512, dtype=torch.bfloat16) for _ in range(3)])
            with torch.no_grad():
                for b in self.blocks:
                    b.weight.copy_(fill("student-t", b.weight.shape, generator=g))

    src, _, layouts, raw = _source(Big(), codec=codec)
    s = check_stats(src.stats())
    assert set(STATS_KEYS) <= set(s) and s["source"] == f"coded-{codec}"
    assert s["raw_bytes"] == sum(lay.nbytes for lay in layouts)
    bound = 0.77 if codec == "exp-kp" else 0.75
    assert s["coded_bytes"] < bound * s["raw_bytes"], s
    assert s["coded_bytes"] <= s["h2d_bytes_per_step"] < (bound + 0.02) * s["raw_bytes"], s
    if codec == "exp-k":  # 512x512 Student-t: 11.33 / 11.05 bits per weight (weights, biases, headers)
        assert 11.2 < s["bits_per_weight"] < 12.0, s
    elif codec == "exp-kp":  # an escape costs 3 bytes: k = 3 or 4, ~12 bits per weight
        assert 11.6 < s["bits_per_weight"] < 12.3, s
    else:
        assert 10.5 < s["bits_per_weight"] < 11.1, s
    assert s["encode_s"] > 0 and s["pinned"] is False and s["pinned_bytes"] == 0
    _check_all_loads(src, _attach(src), layouts, raw)


@pytest.mark.parametrize("recording,codec", [(False, "exp-k"), (True, "exp-k"), (False, "exp-k2")])
def test_host_view_edit_is_reencoded_at_step_start(recording, codec):
    src, tensors, layouts, raw = _source(tiny_flux(dtype=torch.bfloat16), codec=codec)
    slots = _attach(src, RecordingStreams() if recording else None)
    _, _, obj = tensors[0][0]
    views = src.host_views()
    assert id(obj) in views and len(views) == sum(len(ts) for ts in tensors)
    hv = views[id(obj)]
    spec = layouts[0].tensors[0]
    assert torch.equal(hv.view(torch.int16), spec.view_of(raw[0]).view(torch.int16))
    version = src.host_version()
    src.check()
    assert src.host_version() == version, "nothing edited: nothing to re-copy"
    hv.mul_(2)  # an in-place edit of a state_dict() value
    want = raw[0].clone()
    spec.view_of(want).mul_(2)
    src.check()  # step start: re-encodes block 0; the executor re-copies loaded slots
    assert src.host_version() != version
    assert {seg.header.version for seg in src.tables[0].segments} == ({1} if codec == "exp-k" else {1, 2})
    src.load(0, 0, position=0, after=None, tag=None)
    assert not _spans_equal(slots[0], want, layouts[0])
    assert not _spans_equal(src.image(0), want, layouts[0])
    del hv, views
    src.check()  # nobody holds a view any more: the decoded copy goes
    assert not src.images._decoded
    slots[1].zero_()
    src.load(0, 1, position=2, after=None, tag=None)
    assert not _spans_equal(slots[1], want, layouts[0])


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2", "exp-kp"])
def test_write_reencodes_and_unheld_copies_go(codec):
    src, tensors, layouts, raw = _source(tiny_wan(dtype=torch.bfloat16), codec=codec)
    slots = _attach(src)
    k, i = 1, 3
    spec = layouts[k].tensors[i]
    new = torch.full(spec.shape, -0.0, dtype=spec.dtype)
    new.view(-1)[0] = float("nan")
    src.write(k, i, new)
    src.reload()
    want = raw[k].clone()
    spec.view_of(want).copy_(new)
    src.load(k, 0, position=0, after=None, tag=None)
    assert not _spans_equal(slots[0], want, layouts[k])
    src.check()
    assert not src.images._decoded, "a decoded copy made only for write() is dropped at the next step"
    assert not _spans_equal(src.image(k), want, layouts[k])


def test_growing_reencode_works_eagerly_and_stales_captures():
    src, tensors, layouts, raw = _source(tiny_flux(dtype=torch.bfloat16))
    slots = _attach(src, RecordingStreams())
    k = 0
    before = src.copy_bytes[k]
    src.load(k, 0, position=0, after=None, tag=7)  # a load inside a capture
    g = torch.Generator().manual_seed(1)
    want = raw[k].clone()
    for i, spec in enumerate(layouts[k].tensors):  # random bits: every exponent, nothing compresses
        noise = torch.randint(-32768, 32767, spec.shape, dtype=torch.int16, generator=g).view(spec.dtype)
        src.write(k, i, noise)
        spec.view_of(want).copy_(noise)
    src.reload()
    assert src.copy_bytes[k] > before
    src.load(k, 1, position=1, after=None, tag=None)
    assert not _spans_equal(slots[1], want, layouts[k])
    src.check()  # eager loads are served
    with pytest.raises(CodedCaptureStaleError, match="disable"):
        src.check_replay()
    src.captures_dropped()  # the graph runner dropped its graphs: nothing stale
    src.check_replay()


def test_failed_build_gives_weights_back():
    model = tiny_flux(dtype=torch.bfloat16)
    tensors, layouts = _blocks(model)
    before = [[t.detach().clone() for _, _, t in ts] for ts in tensors]
    objs = [[t for _, _, t in ts] for ts in tensors]
    objs[3][1] = torch.zeros(3, dtype=torch.bfloat16)  # not what the layout says
    with pytest.raises(ValueError, match="the layout says"):
        CodedSource(layouts, objs, device="cpu", pin=False)
    for k in range(3):
        for t, b in zip(objs[k], before[k]):
            assert torch.equal(t.view(torch.int16), b.view(torch.int16)), "a dropped tensor lost its weights"


def test_config_weight_codec():
    assert OffloadConfig.layerwise().weight_codec is None  # not given: the planned default (select.py)
    assert OffloadConfig.layerwise(weight_codec="none").weight_codec == "none"
    cfg = OffloadConfig(mode="layer", components=["dit"], weight_codec="exp-k")
    assert OffloadConfig.from_json(cfg.to_json()).weight_codec == "exp-k"
    cfg2 = OffloadConfig(mode="layer", components=["dit"], weight_codec="exp-k2")
    assert OffloadConfig.from_json(cfg2.to_json()).weight_codec == "exp-k2"
    assert OffloadConfig.module(weight_codec="exp-k2").weight_codec == "exp-k2"
    with pytest.raises(ValueError, match=r"weight_codec='zstd' is not allowed; choose from: none, exp-k, exp-k2"):
        OffloadConfig(mode="layer", components=["dit"], weight_codec="zstd")
    with pytest.raises(TypeError, match="weight_codec"):
        OffloadConfig(mode="layer", components=["dit"], weight_codec=True)
    # module mode codes whole components: tests/test_module_coded.py
    assert OffloadConfig(mode="module", components=["dit"], weight_codec="exp-k").weight_codec == "exp-k"
    # DLO takes the codec now (tests/test_dlo_coded.py)
    assert OffloadConfig(mode="layer", components=["dit"], weight_codec="exp-k",
                         layer_options={"dit": {"weight_transfer": "allgather"}}).weight_codec == "exp-k"
    with pytest.raises(UnsupportedCombinationError, match="weight_codec='exp-k' is not allowed with the mmap source"):
        check_codec_supported(cfg.weight_codec, "the mmap source")
    check_codec_supported(select(OffloadConfig.layerwise(), Topology()).codec, "the mmap source")  # the default: raw


# -- the whole model through the wrapper (StreamedBlocks picks the coded source) -------------------

CODED = dict(weight_codec="exp-k")
CODED2 = dict(weight_codec="exp-k2")


def _coded_stats(wrapped):
    s = wrapped.stats()
    assert str(s["source"]).startswith("coded"), s.get("source")
    assert s["coded_bytes"] > 0 and s["raw_bytes"] > 0 and 0 < s["h2d_bytes_per_step"] <= s["host_bytes"], s
    if "placement" not in s:  # every block the source holds streams (auto placement: the resident move nothing)
        assert s["h2d_bytes_per_step"] >= s["coded_bytes"], s
    return s


@pytest.mark.parametrize("name", ["flux", "wan"])
@pytest.mark.parametrize("dtype,resident,slots,codec", [
    (torch.bfloat16, 0, 2, "exp-k"), (torch.bfloat16, 1, 2, "exp-k"), (torch.bfloat16, 0, 3, "exp-k"),
    (torch.float32, 1, 3, "exp-k"), (torch.bfloat16, 0, 2, "exp-k2"), (torch.bfloat16, 1, 3, "exp-k2"),
    (torch.bfloat16, 1, 2, "exp-kp")],
    ids=["bf16-r0s2", "bf16-r1s2", "bf16-r0s3", "fp32-r1s3", "k2-bf16-r0s2", "k2-bf16-r1s3", "kp-bf16-r1s2"])
def test_coded_model_bit_exact(name, dtype, resident, slots, codec):
    wrapped, _, _ = check_equal_outputs(name, "cpu", dtype=dtype, steps=3, resident_layers=resident,
                                        num_slots=slots, weight_codec=codec)
    s = _coded_stats(wrapped)
    assert s["source"] == f"coded-{codec}"
    assert (2 in _versions(wrapped.executor.source)) == (codec == "exp-k2")
    assert (3 in _versions(wrapped.executor.source)) == (codec == "exp-kp")


def _streamed_keys(wrapped, ref):
    sd = ref.state_dict()
    streamed = [k for k in sd if k.startswith(("transformer_blocks.", "single_transformer_blocks.", "blocks."))
                and sd[k].dtype == torch.bfloat16 and sd[k].dim() == 2]
    assert len(streamed) > 4
    return streamed


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2", "exp-kp"])
def test_coded_model_state_dict_and_edits(codec):
    model, ref, x = build("flux", "cpu", torch.bfloat16)
    ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.no_grad():
        wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(weight_codec=codec), device="cpu")
        first(wrapped(**x))
    sd = wrapped.state_dict()
    assert sd.keys() == ref_sd.keys()
    bad = [k for k in sd if not torch.equal(sd[k].view(torch.uint8) if sd[k].dim() else sd[k],
                                             ref_sd[k].view(torch.uint8) if ref_sd[k].dim() else ref_sd[k])]
    assert not bad, bad
    keys = _streamed_keys(wrapped, ref)
    with torch.no_grad():
        for k in (keys[0], keys[-1]):  # the first block is prefetched for the next step already
            sd[k].mul_(0.75)
            ref.state_dict()[k].mul_(0.75)
        for _ in range(2):
            assert torch.equal(first(wrapped(**x)), first(ref(**x)))
        del sd
        wrapped.state_dict()[keys[1]].add_(0.25)  # a state_dict() dropped at once: the edit still lands
        ref.state_dict()[keys[1]].add_(0.25)
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2", "exp-kp"])
def test_coded_model_update_weights_and_restore(codec):
    model, ref, x = build("wan", "cpu", torch.bfloat16)
    with torch.no_grad():
        wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(resident_layers=1, weight_codec=codec),
                                       device="cpu")
        first(wrapped(**x))
        new = {k: (v * 0.5 if v.is_floating_point() else v) for k, v in ref.state_dict().items()}
        ref.load_state_dict(new)
        wrapped.update_weights(new)
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))
        plain = wrapped.disable()
        assert all(p.numel() for p in plain.parameters())
        for (k, a), b in zip(plain.state_dict().items(), ref.state_dict().values()):
            assert torch.equal(a, b), k
        assert torch.equal(first(plain(**x)), first(ref(**x)))


def test_coded_model_special_weights_round_trip():
    model, ref, x = build("flux", "cpu", torch.bfloat16)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, -1e-40],
                            dtype=torch.bfloat16)
    w = model.transformer_blocks[0].attn.to_q.weight
    with torch.no_grad():
        w.view(-1)[: specials.numel()] = specials
        w.view(-1)[10] = torch.tensor(0x7FC3, dtype=torch.int16).view(torch.bfloat16)  # a NaN payload
    want = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(**CODED), device="cpu")
    with torch.no_grad():
        first(wrapped(**x))
    for k, v in wrapped.state_dict().items():
        assert torch.equal(v.view(torch.uint8) if v.dim() else v,
                           want[k].view(torch.uint8) if want[k].dim() else want[k]), k
    plain = wrapped.disable()
    got = plain.transformer_blocks[0].attn.to_q.weight
    assert torch.equal(got.view(torch.int16), want["transformer_blocks.0.attn.to_q.weight"].view(torch.int16))


# DLO and the mmap source code too now: tests/test_dlo_coded.py, tests/test_mmap_coded.py


@pytest.mark.parametrize("name,codec", [("flux", "exp-k"), ("wan", "exp-k"), ("flux", "exp-k2")])
def test_coded_auto_placement_is_bit_exact(name, codec):
    """resident_layers='auto' over the coded source: promoted blocks get a decoded device image,
    demoted ones are written back (re-encoded); outputs stay exact, the planner sees coded bytes."""
    model, ref, x = build(name, "cpu", torch.bfloat16)
    probe = OffloadedTransformer(copy.deepcopy(model), OffloadConfig.layerwise(progress=False), device="cpu")
    sizes, fixed = [lay.nbytes for lay in probe.executor.source.layouts], probe.stats()["resident_bytes"]
    probe.disable()
    budget = fixed + 2 * max(sizes) + sum(sizes) // 2
    cfg = OffloadConfig.layerwise(resident_layers="auto", device_memory_budget_gb=budget / 1e9, progress=False,
                                  weight_codec=codec)
    wrapped = OffloadedTransformer(model, cfg, device="cpu")
    wrapped._streamed.placement.h2d_gbps = 1e-6  # a very slow link: the planner keeps blocks resident
    src = wrapped.executor.source
    assert [src.link_bytes(k) for k in range(len(sizes))] == src.copy_bytes
    with torch.no_grad():
        expected = first(ref(**x))
        outs = [first(wrapped(**x)) for _ in range(4)]
        assert all(torch.equal(o, expected) for o in outs)
        s = _coded_stats(wrapped)
        assert 0 < s["blocks_resident"] < len(sizes), s
        sd = wrapped.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
        back = wrapped.disable()
        assert torch.equal(first(back(**x)), expected)


def _big_blocks(n=5, seed=0):
    """Blocks of multi-chunk tensors (over 1 Mi elements: the encoder samples its histogram),
    bf16 / fp16 / float32 (stored raw), Student-t weights with some special values."""
    gen = torch.Generator().manual_seed(seed)
    tensors, layouts = [], []
    for k in range(n):
        w = fill("student-t", (1100, 1024 + 64 * k), generator=gen, dtype=torch.bfloat16)
        w.view(-1)[:: 9973] = float("nan")
        ts = [("w", "parameter", w),
              ("h", "parameter", fill("gaussian", (700, 1600), generator=gen, dtype=torch.float16)),
              ("b", "buffer", torch.randn(257, generator=gen))]
        tensors.append(ts)
        layouts.append(build_layout(k, f"big.{k}", ts))
    return tensors, layouts


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2", "exp-kp"])
def test_parallel_build_is_byte_identical_to_one_thread_build(codec):
    """Coded images are the same bytes whatever the worker count and intra-op threads."""
    from weightstream.offload.codecs import codec_levels
    from weightstream.offload.host.encode import encoded_in_order

    tensors, layouts = _big_blocks()
    objs = [[t for _, _, t in ts] for ts in tensors]
    raw = _raw_images(tensors, layouts)
    levels = codec_levels(codec)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the reference: one worker, one intra-op thread, block by block
        ref = [b for b in encoded_in_order(layouts, objs, workers=1, levels=levels)]
    finally:
        torch.set_num_threads(before)
    par = list(encoded_in_order(layouts, objs, workers=4, levels=levels))
    src = CodedSource(layouts, [list(o) for o in objs], device="cpu", pin=False, codec=codec)  # default workers
    assert (2 in _versions(src)) == (codec == "exp-k2") and (3 in _versions(src)) == (codec == "exp-kp")
    for k, ((rb, rt), (pb, pt)) in enumerate(zip(ref, par)):
        one = torch.cat(rb)
        assert torch.equal(one, torch.cat(pb)), f"block {k}: 4 workers coded other bytes than 1"
        assert torch.equal(rt._host, pt._host), f"block {k}: decode tables differ"
        assert src.coded[k] == one.numel()
        assert torch.equal(src.region(k)[: one.numel()], one), f"block {k}: the source's build coded other bytes"
    from weightstream.kernels.codec import decode_tensor

    for seg in src.tables[0].segments:  # and they decode to the raw image (plain-torch reference decode)
        vals = decode_tensor(src.region(0)[seg.src_offset : seg.src_end]).view(torch.uint8)
        assert torch.equal(vals[: seg.dst_end - seg.dst_offset], raw[0][seg.dst_offset : seg.dst_end])


def test_build_runs_one_intra_op_thread_per_worker_and_restores():
    from weightstream.offload.host.encode import encode_workers, in_order

    outer = torch.get_num_threads()
    torch.set_num_threads(3)  # not 1, whatever the machine: a restore must show
    try:
        _check_threads_restored(in_order, 3)
    finally:
        torch.set_num_threads(outer)
    assert encode_workers() == len(os.sched_getaffinity(0))


def _check_threads_restored(in_order, before):
    seen = list(in_order(6, lambda k: torch.get_num_threads(), workers=3))
    assert seen == [1] * 6, "encode workers ran torch ops on more than one intra-op thread"
    assert torch.get_num_threads() == before

    def boom(k):
        if k == 2:
            raise RuntimeError("encode failed")
        return k

    gen = in_order(5, boom, workers=2)
    with pytest.raises(RuntimeError, match="encode failed"):
        list(gen)
    assert torch.get_num_threads() == before, "intra-op threads not restored after a failed encode"
    stopped = in_order(5, lambda k: k, workers=2)
    assert next(stopped) == 0 and torch.get_num_threads() == 1
    stopped.close()
    assert torch.get_num_threads() == before, "intra-op threads not restored when the consumer stops early"
    model = tiny_flux(dtype=torch.bfloat16)
    tensors, layouts = _blocks(model)
    objs = [[t for _, _, t in ts] for ts in tensors]
    objs[3][1] = torch.zeros(3, dtype=torch.bfloat16)  # a failed build
    with pytest.raises(ValueError, match="the layout says"):
        CodedSource(layouts, objs, device="cpu", pin=False)
    assert torch.get_num_threads() == before, "intra-op threads not restored after a failed build"


@pytest.mark.parametrize("levels", [1, 2])
def test_tensor_parallel_encode_gives_the_same_bytes(levels):
    """Few large blocks (module offload's components) encode their tensors on worker threads:
    the region and the decode table equal the one-thread-per-block encoder's."""
    from weightstream.offload.host.encode import _capacity, encode_into, encode_tensors_into

    tensors, layouts = _blocks(tiny_flux(dtype=torch.bfloat16))
    for lay, ts in zip(layouts, tensors):
        objs = [t for _, _, t in ts]
        a = torch.zeros(_capacity(lay), dtype=torch.uint8)
        b = torch.zeros(_capacity(lay), dtype=torch.uint8)
        na, ta = encode_into(a, lay, objs, levels=levels)
        nb, tb = encode_tensors_into(b, lay, objs, workers=2, levels=levels)
        assert na == nb > 0 and torch.equal(a, b)
        assert ta.segments == tb.segments
        assert max(seg.header.version for seg in ta.segments) == levels


def test_one_block_source_encodes_tensors_in_parallel_and_round_trips():
    """Fewer blocks than encode workers (one here, on any machine with 2+ cores) take the
    tensor-parallel encoder inside CodedSource: the stored image decodes bit for bit."""
    from weightstream.offload.host.encode import encode_workers

    tensors, layouts = _blocks(tiny_flux(dtype=torch.bfloat16))
    raw = _raw_images(tensors[:1], layouts[:1])
    if encode_workers() < 2:
        pytest.fail("this test needs 2+ usable cores (CI has 2)")
    src = CodedSource(layouts[:1], [[t for _, _, t in tensors[0]]], device="cpu", pin=False)
    assert _spans_equal(src.image(0), raw[0], layouts[0]) == []
    src.close()


def test_encode_on_is_validated():
    tensors, layouts = _blocks(tiny_flux(dtype=torch.bfloat16))
    objs = [[t for _, _, t in ts] for ts in tensors]
    with pytest.raises(ValueError, match="encode_on='gpu' is not allowed; choose from: cpu, device, in-place"):
        CodedSource(layouts, objs, device="cpu", pin=False, encode_on="gpu")
    for where in ("device", "in-place"):
        with pytest.raises(ValueError, match=f"encode_on='{where}' needs a CUDA device"):
            CodedSource(layouts, objs, device="cpu", pin=False, encode_on=where)
    with pytest.raises(ValueError, match="weight_codec='exp-k3' is not allowed here; choose from: exp-k, exp-k2"):
        CodedSource(layouts, objs, device="cpu", pin=False, codec="exp-k3")
    assert all(t.numel() for t in objs[0])  # refused before anything was dropped


def test_decode_placement_by_config():
    """Graphs decode at use on the compute stream (their copies ran slower when each decode was
    captured right after its copy); eager decodes at load on the decode stream; stats() says which."""
    from weightstream.offload.sources.decode import decode_placement

    assert decode_placement(OffloadConfig.layerwise(weight_codec="exp-k")) == {"decode_at": "load",
                                                                                "decode_stream": True}
    assert decode_placement(OffloadConfig.layerwise(weight_codec="exp-k", cuda_graphs="on")) == {
        "decode_at": "use", "decode_stream": False}
    src = _source(tiny_flux(dtype=torch.bfloat16))[0]
    assert src.stats()["decode"] == "at load, on the decode stream"
    use = _source(tiny_flux(dtype=torch.bfloat16), decode_at="use", decode_stream=False)[0]
    assert use.stats()["decode"] == "at use, on the compute stream"
    with pytest.raises(ValueError, match="decode_at='later' is not allowed; choose from: load, use"):
        _source(tiny_flux(dtype=torch.bfloat16), decode_at="later")
