"""DLO AllGather with coded shards (offload/sources/dlo_coded.py), on the CPU.

A fake world-of-1 group (the real source, the gather a copy) and real gloo
groups of 2 ranks; outputs compare bit for bit with the unwrapped model."""
from __future__ import annotations

import copy

import pytest
import torch

from weightstream import OffloadConfig, OffloadedTransformer, ParallelConfig
from weightstream.models import ToyDiT, flux_inputs, tiny_flux, toy_inputs
from weightstream.offload.distributed import DLOPlan, build_streamed, merge_shards
from weightstream.offload.sources.dlo_coded import CodedPiece, CodedShardSource, merge_coded_shards
from weightstream.offload.streamed import StreamedBlocks
from weightstream.offload.streams import RecordingStreams

from stream_trace import accesses, check, counts

DEV = torch.device("cpu")


class _Done:
    def wait(self, timeout=None):
        return None


class FakeCodedGather(CodedShardSource):
    """The coded shard source over a fake world of 1: the gathered bytes are this rank's one share."""

    @staticmethod
    def gather_mode(dlo, timeout_s, device):
        return "tensor"

    def all_gather(self, out, inp, *, async_op=False):
        out.copy_(inp)
        return _Done()


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _model(kind, seed_inputs=1):
    if kind == "toy":
        return ToyDiT(), toy_inputs(seed=seed_inputs)
    m = tiny_flux(dtype=torch.bfloat16, num_attention_heads=8)  # tensors that code
    return m, flux_inputs(m, seed=seed_inputs)


def _fake(model, cls=StreamedBlocks, **cfg_kw):
    cfg = OffloadConfig.layerwise(weight_codec="exp-k", progress=False, **cfg_kw)
    dlo = DLOPlan("allgather", "allgather", None, 1, 0, "dp", "fake")
    sb = build_streamed(model, cfg, DEV, None, ParallelConfig(), dlo=dlo, cls=cls, source_cls=FakeCodedGather)
    return OffloadedTransformer(sb.module, cfg, device=DEV, streamed=sb)


@pytest.mark.parametrize("kind", ["toy", "flux"])
def test_fake_world_of_one_is_bit_exact_and_moves_coded_bytes(kind):
    model, x = _model(kind)
    ref = copy.deepcopy(model)
    om = _fake(model)
    with torch.no_grad():
        want = _first(ref(**x))
        assert all(torch.equal(_first(om(**x)), want) for _ in range(3))
    s = om._streamed.source.stats()
    assert s["source"] == "dlo-allgather-coded" and s["h2d_bytes_per_step"] == s["shard_bytes"]
    if kind == "flux":  # bf16 weights code below their raw size
        assert 8 < s["bits_per_weight"] < 14 and s["coded_bytes"] < 0.9 * s["raw_bytes"], s
        assert s["coded_bytes"] <= s["shard_bytes"] < s["raw_bytes"], s
    plain = om.disable()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in plain.state_dict().items())


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def test_fake_update_weights_reshards_and_stays_exact():
    """An update with random bit patterns codes larger than N * shard (a re-shard; gathered back
    bit for bit), then ordinary new weights: the outputs follow every update."""
    model, x = _model("flux")
    ref = copy.deepcopy(model)
    om = _fake(model)
    src = om._streamed.source
    with torch.no_grad():
        om(**x)
    before = list(src.store.shard_bytes)
    g = torch.Generator().manual_seed(3)
    name = "single_transformer_blocks.0.proj_mlp.weight"
    shape = ref.state_dict()[name].shape
    noise = torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    om.update_weights({name: noise})
    assert src.store.shard_bytes != before, "the re-encode outgrew the shard: re-sharded"
    assert torch.equal(_bits(om.gather_state_dict()[name]), _bits(noise))
    new = {k: (torch.randn(v.shape, generator=g) * 0.05).to(v.dtype) for k, v in ref.state_dict().items()}
    om.update_weights(new)
    ref.load_state_dict(new)
    with torch.no_grad():
        want = _first(ref(**x))
        assert all(torch.equal(_first(om(**x)), want) for _ in range(2))
    full = om.gather_state_dict()
    assert all(torch.equal(full[k], new[k]) for k in new)
    with pytest.raises(RuntimeError, match="gather_state_dict"):
        om.state_dict()


def test_local_state_dict_gives_coded_pieces_that_merge():
    model, x = _model("flux")
    ref = copy.deepcopy(model)
    om = _fake(model)
    local = om.local_state_dict()
    pieces = [v for v in local.values() if isinstance(v, CodedPiece)]
    assert pieces and all(p.data.dtype == torch.uint8 for p in pieces)
    merged = merge_coded_shards([local])
    assert sorted(merged) == sorted(ref.state_dict())
    assert all(torch.equal(merged[k], v) for k, v in ref.state_dict().items())
    raw = merge_shards([local])  # the plain merge leaves coded bytes: not the weights
    name = pieces[0].name
    assert raw[name].dtype == torch.uint8 and raw[name].shape != ref.state_dict()[name].shape


def test_happens_before_over_the_fake_group():
    from test_happens_before import _traced

    rec = RecordingStreams()
    model, x = _model("toy")
    ref = copy.deepcopy(model)
    om = _fake(model, cls=_traced(StreamedBlocks, rec, 2, "ring"))
    with torch.no_grad():
        want = ref(**x)
        assert all(torch.equal(om(**x), want) for _ in range(3))
    c = counts(rec.trace)
    assert c["reads"] >= 3 * 7 and c["writes"] >= 3 * 7, c
    bad = {r: v[:3] for r, v in check(rec.trace).items() if v}
    assert not bad, bad
    reads = accesses(rec.trace).reads
    assert any(isinstance(s, tuple) and s[0] == "coded" for s in reads), "decodes note their coded reads"
    assert any(isinstance(s, tuple) and s[0] == "shard" for s in reads), "gathers note their shard reads"


def test_happens_before_event_log_has_a_gather_lane():
    from test_happens_before import _traced

    rec = RecordingStreams()
    model, x = _model("toy")
    om = _fake(model, cls=_traced(StreamedBlocks, rec, 2, "ring"), record_events=True)
    with torch.no_grad():
        for _ in range(2):
            om(**x)
    lanes = [e["lane"] for e in om.events()]
    assert lanes.count("gather") == lanes.count("copy") > 0


def test_config_and_wiring_accept_the_codec_with_dlo():
    cfg = OffloadConfig(mode="layer", components=["dit"], weight_codec="exp-k",
                        layer_options={"dit": {"weight_transfer": "allgather"}})
    assert cfg.weight_codec == "exp-k"
    with pytest.raises(ValueError, match="weight_codec='exp-k'.*mode='layer' only"):
        OffloadConfig(mode="module", components=["dit"], weight_codec="exp-k")
