"""DLO AllGather with coded shares (offload/sources/dlo.py over offload/host/shares.py), on the CPU.

A fake world-of-1 group (the real source, the gather a copy) and real gloo
groups of 2 ranks; outputs compare bit for bit with the unwrapped model."""
from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch

from weightstream import OffloadConfig, OffloadedTransformer, ParallelConfig
from weightstream.models import ToyDiT, flux_inputs, tiny_flux, toy_inputs
from weightstream.offload.dlo.control import merge_shards
from weightstream.offload.dlo.control import CodedPiece
from weightstream.offload.sources.dlo import ShardSource
from weightstream.offload.streamed import StreamedBlocks
from weightstream.offload.streams import RecordingStreams

from stream_trace import accesses, check, counts, hb

DEV = torch.device("cpu")


class _Done:
    """A finished collective (the fake group's gather is a plain copy)."""

    def wait(self, timeout=None):
        return None

    def is_completed(self) -> bool:  # polled on CUDA (dlo/control.py bounded_wait)
        return True


class FakeCodedGather(ShardSource):
    """The coded shard source over a fake world of 1: the gathered bytes are this rank's one share."""

    @staticmethod
    def gather_mode(dlo, timeout_s, device):
        return "tensor"

    def all_gather(self, out, inp, *, async_op=False):
        out.copy_(inp)
        return _Done()


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _model(kind, seed_inputs=1, device="cpu"):
    if kind == "toy":
        return ToyDiT(), toy_inputs(seed=seed_inputs, device=device)
    m = tiny_flux(dtype=torch.bfloat16, num_attention_heads=4)  # tensors that code
    return m, flux_inputs(m, seed=seed_inputs, device=device)


def _fake(model, cls=StreamedBlocks, codec="exp-k", **cfg_kw):
    from test_happens_before import fake_dlo

    cfg = OffloadConfig.layerwise(weight_codec=codec, progress=False, **cfg_kw)
    sb = fake_dlo(model, cfg, cls, source_cls=FakeCodedGather)
    return OffloadedTransformer(sb.module, cfg, device=DEV, streamed=sb)


def _versions(tables) -> set[int]:
    """Coded tensor format versions of the tables' tensors (2: two-level, "exp-k2")."""
    return {seg.header.version for t in tables if t is not None for seg in t.segments}


@pytest.mark.parametrize("kind,codec", [("toy", "exp-k"), ("flux", "exp-k"), ("flux", "exp-k2"), ("flux", "exp-kp")])
def test_fake_world_of_one_is_bit_exact_and_moves_coded_bytes(kind, codec):
    model, x = _model(kind)
    ref = copy.deepcopy(model)
    om = _fake(model, codec=codec)
    if kind == "flux":
        versions = _versions(om._streamed.source.store.tables)
        assert (2 in versions) == (codec == "exp-k2") and (3 in versions) == (codec == "exp-kp")
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


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2"])
def test_fake_update_weights_reshards_and_stays_exact(codec):
    """An update with random bit patterns codes larger than N * shard (a re-shard; gathered back
    bit for bit), then ordinary new weights: the outputs follow every update."""
    model, x = _model("flux")
    ref = copy.deepcopy(model)
    om = _fake(model, codec=codec)
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
    assert (2 in _versions(src.store.tables)) == (codec == "exp-k2")  # re-encoded with the same codec
    with pytest.raises(RuntimeError, match="gather_state_dict"):
        om.state_dict()


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2", "exp-kp"])
def test_local_state_dict_gives_coded_pieces_that_merge(codec):
    """merge_shards (the recovery the README names) decodes coded pieces: the weights bit for bit,
    never coded bytes under a weight's name."""
    model, x = _model("flux")
    ref = copy.deepcopy(model)
    om = _fake(model, codec=codec)
    local = om.local_state_dict()
    pieces = [v for v in local.values() if isinstance(v, CodedPiece)]
    assert pieces and all(p.data.dtype == torch.uint8 for p in pieces)
    merged = merge_shards([local])
    assert sorted(merged) == sorted(ref.state_dict())
    assert all(v.dtype == merged[k].dtype and torch.equal(merged[k], v) for k, v in ref.state_dict().items())


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


def test_coded_gather_runs_while_compute_still_reads_the_slot():
    """Only the decode waits for the slot's release: the gather of a block into the slot's coded
    buffer is not ordered after the compute that reads the slot (the block two positions back),
    so it overlaps that compute; the decode after it is."""
    from test_happens_before import _traced

    rec = RecordingStreams()
    model, x = _model("toy")
    om = _fake(model, cls=_traced(StreamedBlocks, rec, 2, "ring"))
    with torch.no_grad():
        for _ in range(3):
            om(**x)
    acc = accesses(rec.trace)
    early = late = 0
    for key, writes in acc.writes.items():
        if not (isinstance(key, tuple) and key[0] == "coded"):
            continue
        for w in writes:  # a gather; the compute before it on the same block slot:
            prior = [r for r in acc.reads.get(key[1], []) if r.begin.op.index < w.op.index]
            if not prior:
                continue
            decode = next(r for r in acc.reads[key] if r.begin.op.index > w.op.index)
            assert hb(prior[-1].end, decode.begin), "the decode waits for the slot's release"
            if hb(prior[-1].end, w):
                late += 1
            else:
                early += 1
    assert early and not late, (early, late)  # before the change every gather waited: early 0, late 21


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
    # module mode codes whole components now (tests/test_module_coded.py)
    assert OffloadConfig(mode="module", components=["dit"], weight_codec="exp-k").weight_codec == "exp-k"


# --------------------------------------------------------------------------- weight_codec="auto", fake group
FAST_DECODE = {"exp-k": 1e3, "exp-k2": 1e3}


def _auto_fake(model, h2d_gbps, **kw):
    om = _fake(model, codec="auto", **kw)
    planner = om._streamed.codec_planner
    planner.h2d_gbps, planner.decode_gbps = h2d_gbps, FAST_DECODE  # a slow (transfer-bound) or fast link
    return om


@pytest.mark.parametrize("kind", ["flux"])  # bf16 weights that code (the toy's fp32 stay raw: nothing to plan)
def test_auto_starts_raw_then_a_slow_link_codes_every_block(kind):
    model, x = _model(kind)
    ref = copy.deepcopy(model)
    om = _auto_fake(model, 1e-6)
    src = om._streamed.source
    assert all(src.raw) and src.codec is None and src.stats()["coded_blocks"] == 0
    raw_shards = list(src.store.shard_bytes)
    with torch.no_grad():
        want = _first(ref(**x))
        outs = [_first(om(**x)) for _ in range(3)]
    assert all(torch.equal(o, want) for o in outs)
    plan = om.stats()["codec_plan"]
    assert plan["codec"] == "exp-k2" and plan["coded_blocks"] == list(range(len(src.layouts)))  # equal rates
    assert not any(src.raw) and src.codec == "exp-k2" and 2 in _versions(src.store.tables)
    if kind == "flux":  # coded shares are smaller: the link moves fewer bytes
        assert all(c < r for c, r in zip(src.store.shard_bytes, raw_shards))
        assert src.stats()["coded_ratio"] < 0.9
    plain = om.disable()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in plain.state_dict().items())


def test_auto_fast_link_codes_nothing_and_streams_raw_shares():
    model, x = _model("flux")
    ref = copy.deepcopy(model)
    om = _auto_fake(model, 1e6)
    src = om._streamed.source
    with torch.no_grad():
        want = _first(ref(**x))
        assert all(torch.equal(_first(om(**x)), want) for _ in range(3))
    s = om.stats()
    assert s["codec_plan"]["codec"] is None and all(src.raw) and src.stage.buffer_bytes() == 0
    assert s["coded_blocks"] == 0 and src.stats()["coded_ratio"] == 1.0
    assert "nothing coded" in repr(om._streamed.codec_planner)


def test_mixed_raw_and_coded_blocks_are_exact_ordered_and_give_weights_back():
    """Some blocks coded, the others raw (what a partial plan leaves): outputs bit for bit, the
    ordering rules hold over both kinds of load, updates reach both kinds, and the weights come
    back from local_state_dict() and disable()."""
    from test_happens_before import _traced

    rec = RecordingStreams()
    model, x = _model("flux")
    ref = copy.deepcopy(model)
    om = _fake(model, cls=_traced(StreamedBlocks, rec, 2, "ring"), codec="auto")
    om._streamed.codec_planner.remove()  # no plan: the test codes blocks itself
    src = om._streamed.source
    with torch.no_grad():
        want = _first(ref(**x))
        assert torch.equal(_first(om(**x)), want)
        src.code_blocks([0, 3], "exp-k")
        assert src.raw == [False, True, True, False, True]
        assert all(torch.equal(_first(om(**x)), want) for _ in range(3))
    bad = {r: v[:3] for r, v in check(rec.trace).items() if v}
    assert not bad, bad
    reads = accesses(rec.trace).reads
    assert any(isinstance(key, tuple) and key[0] == "coded" for key in reads), "the coded blocks decode"
    s = src.stats()
    assert s["coded_blocks"] == 2 and s["codec"] == "exp-k" and s["raw_bytes"] > s["coded_bytes"]
    local = om.local_state_dict()
    merged = merge_shards([local])
    assert sorted(merged) == sorted(ref.state_dict())
    assert all(torch.equal(merged[k], v) for k, v in ref.state_dict().items())
    g = torch.Generator().manual_seed(5)
    new = {k: (torch.randn(v.shape, generator=g) * 0.05).to(v.dtype) for k, v in ref.state_dict().items()}
    om.update_weights(new)  # raw blocks keep raw shares, coded ones are re-encoded
    ref.load_state_dict(new)
    assert src.raw == [False, True, True, False, True]
    with torch.no_grad():
        want = _first(ref(**x))
        assert all(torch.equal(_first(om(**x)), want) for _ in range(2))
    full = om.gather_state_dict()
    assert all(torch.equal(full[k], new[k]) for k in new)
    plain = om.disable()
    assert all(torch.equal(v, new[k]) for k, v in plain.state_dict().items())


def test_code_blocks_refusals_are_named():
    model, x = _model("flux")
    om = _fake(model, codec="auto")
    om._streamed.codec_planner.remove()
    src = om._streamed.source
    with pytest.raises(ValueError, match="background=True is not allowed with DLO AllGather"):
        src.code_blocks([0], "exp-k", background=True)
    with pytest.raises(ValueError, match=r"blocks \[9\] are not raw blocks"):
        src.code_blocks([9], "exp-k")
    with pytest.raises(ValueError, match="weight_codec='nope' is not allowed"):
        src.code_blocks([0], "nope")
    src.code_blocks([0], "exp-k")
    with pytest.raises(ValueError, match=r"blocks \[0\] are not raw blocks"):
        src.code_blocks([0], "exp-k")
    with pytest.raises(ValueError, match="one codec per source"):
        src.code_blocks([1], "exp-k2")
    with pytest.raises(ValueError, match="coded already"):
        src.sample(0, ("exp-k",))
    with torch.no_grad():
        om(**x)
    om.disable()


def test_join_measurements_takes_the_slowest_rank():
    from weightstream.offload.plan.coding import join_measurements

    a = {"compute": [1.0, 5.0], "h2d": 50.0, "decode": {"exp-k": 900.0}, "coded": {"exp-k": {"L": 70}}}
    b = {"compute": [2.0, 4.0], "h2d": 40.0, "decode": {"exp-k": 1000.0}, "coded": {"exp-k": {"L": 70}}}
    got = join_measurements([a, b])
    assert got == {"compute": [2.0, 5.0], "h2d": 40.0, "decode": {"exp-k": 900.0}, "coded": {"exp-k": {"L": 70}}}
    assert join_measurements([b, a]) == got  # the same on every rank, whatever its place
    with pytest.raises(ValueError, match="out of step"):
        join_measurements([a, dict(b, compute=[1.0])])
    with pytest.raises(ValueError, match="out of step"):
        join_measurements([a, dict(b, coded={"exp-k": {"M": 70}})])
    with pytest.raises(ValueError, match="no rows"):
        join_measurements([])


# --------------------------------------------------------------------------- gloo, 2 ranks
def _coded_cfg(transfer="allgather", codec="exp-k", **kw):
    return OffloadConfig.layerwise(weight_transfer=transfer, weight_codec=codec, progress=False, **kw)


def _rank_equal(kind, parallel, rank, device="cpu", forwards=2, **cfg_kw):
    """Bit-exact vs the unwrapped model over ``forwards``; disable() gives the weights back."""
    model, x = _model(kind, seed_inputs=1 + rank, device=device)
    ref = copy.deepcopy(model).to(device)
    om = OffloadedTransformer(model, _coded_cfg(**cfg_kw), device=device, parallel=parallel)
    with torch.no_grad():
        want = _first(ref(**x))
        equal = [torch.equal(_first(om(**x)), want) for _ in range(forwards)]
    src = om._streamed.source
    stats = dict(src.stats(), **{k: om.stats().get(k) for k in ("transfer", "pinned_host_gb_per_rank")})
    plan = om.stats().get("codec_plan")
    tables = getattr(src.store, "tables", []) if hasattr(src, "store") else src.tables  # no codec: no tables
    stats["versions"] = sorted(_versions([t for t in tables if t is not None]))  # "auto": raw blocks have none
    local = om.local_state_dict()
    plain = om.disable()
    with torch.no_grad():
        restored = torch.equal(_first(plain(**x)), want)
    back = all(torch.equal(v.cpu(), ref.state_dict()[k].cpu()) for k, v in plain.state_dict().items())
    return dict(equal=equal, restored=restored, back=back, stats=stats, local=local, plan=plan,
                ref={k: v.cpu().clone() for k, v in ref.state_dict().items()})


def _rank_weights(parallel, rank, device="cpu"):
    model, x = _model("flux", seed_inputs=1 + rank, device=device)
    ref = copy.deepcopy(model).to(device)
    om = OffloadedTransformer(model, _coded_cfg(), device=device, parallel=parallel)
    with torch.no_grad():
        om(**x)
    g = torch.Generator().manual_seed(7)  # the same new weights on every rank
    new = {k: (torch.randn(v.shape, generator=g) * 0.05).to(v.dtype) for k, v in ref.state_dict().items()}
    name = "single_transformer_blocks.0.proj_mlp.weight"  # random bits: codes larger, a re-shard
    new[name] = torch.randint(0, 2**14, new[name].shape, generator=g, dtype=torch.int32).to(
        torch.int16).view(torch.bfloat16)
    before = list(om._streamed.source.store.shard_bytes)
    written = om.update_weights(new)
    resharded = om._streamed.source.store.shard_bytes != before
    ref.load_state_dict(new)
    with torch.no_grad():
        want = _first(ref(**x))
        equal = [torch.equal(_first(om(**x)), want) for _ in range(2)]
    full = om.gather_state_dict()
    try:
        om.state_dict()
        sd_error = None
    except RuntimeError as e:
        sd_error = str(e)
    om.disable()
    return dict(written=len(written), expected=len(new), equal=equal, sd_error=sd_error, resharded=resharded,
                gathered=sorted(full) == sorted(new) and all(torch.equal(_bits(full[k]), _bits(new[k])) for k in new))


def _rank_failure_one(rank, world):
    """One rank raises inside a block: every rank raises at the step's end, the next forward runs."""
    import datetime

    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=15))
    parallel = ParallelConfig(dp=world, dp_group=group)
    model, x = _model("toy", seed_inputs=1 + rank)
    ref = copy.deepcopy(model)
    om = OffloadedTransformer(model, _coded_cfg(dlo_timeout_s=5.0), device="cpu", parallel=parallel)
    state = {"forward": 0}

    def boom(module, args):
        if rank == 1 and state["forward"] == 1:
            raise ValueError("injected failure inside single_blocks.0 on rank 1")

    handle = model.single_blocks[0].register_forward_pre_hook(boom)
    errors, equal = [], []
    for i in range(3):
        state["forward"] = i
        try:
            with torch.no_grad():
                equal.append(torch.equal(om(**x), ref(**x)))
            errors.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    handle.remove()
    return dict(errors=errors, equal=equal, usable=om._streamed.usable)


def _rank_collective_failure(parallel, rank):
    """A failed gather marks the backend unusable; local_state_dict() still gives every weight back."""
    from test_distributed import failing_gather

    model, x = _model("flux", seed_inputs=1 + rank)
    ref = copy.deepcopy(model)
    om = OffloadedTransformer(model, _coded_cfg(), device="cpu", parallel=parallel)
    with torch.no_grad():
        om(**x)
    with failing_gather(2):
        try:
            with torch.no_grad():
                om(**x)
            first = None
        except RuntimeError as e:
            first = str(e)
        try:
            om.gather_state_dict()
            gather = None
        except RuntimeError as e:
            gather = str(e)
        try:
            om.update_weights({k: v for k, v in ref.state_dict().items()})
            update = None
        except RuntimeError as e:
            update = str(e)
    return dict(first=first, gather=gather, update=update, usable=om._streamed.usable,
                local=om.local_state_dict(), ref={k: v.clone() for k, v in ref.state_dict().items()})


def _codec_differs(parallel, rank, other=None):
    """Rank 1 without the codec (or with ``other``): both ranks are told at setup (no gather
    of mismatched sizes)."""
    model, _ = _model("toy")
    if rank == 0:
        cfg = _coded_cfg()
    elif other is None:
        cfg = OffloadConfig.layerwise(weight_transfer="allgather", progress=False)
    else:
        cfg = _coded_cfg(codec=other)
    try:
        OffloadedTransformer(model, cfg, device="cpu", parallel=parallel)
    except ValueError as e:
        return str(e)
    return None


def _rank_auto(parallel, rank, *, fail_first=False, device="cpu"):
    """weight_codec='auto' where DLO resolves to AllGather (no weight_transfer given). The ranks
    measure differently (rank 0 a fast link, rank 1 a slow one, set as the planner's inputs): the
    joined, slowest, measurements code every block on both ranks. ``fail_first``: rank 1 raises
    inside a block in the first forward; both ranks raise, then plan after the next forward."""
    model, x = _model("flux", seed_inputs=1 + rank, device=device)
    ref = copy.deepcopy(model).to(device)
    om = OffloadedTransformer(model, OffloadConfig.layerwise(weight_codec="auto", progress=False), device=device,
                              parallel=parallel)
    planner = om._streamed.codec_planner
    planner.h2d_gbps = 1e6 if rank == 0 else 1e-6
    planner.decode_gbps = {"exp-k": 1e3, "exp-k2": 1e3 if rank == 0 else 2e2}
    state = {"forward": 0}

    def boom(module, args):
        if fail_first and rank == 1 and state["forward"] == 0:
            raise ValueError("injected failure on rank 1")

    handle = model.single_transformer_blocks[0].register_forward_pre_hook(boom)
    errors, equal, plans = [], [], []
    with torch.no_grad():
        want = _first(ref(**x))
        for i in range(3):
            state["forward"] = i
            try:
                equal.append(torch.equal(_first(om(**x)), want))
                errors.append(None)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
            plans.append(om.stats().get("codec_plan", {}).get("coded_blocks"))
    handle.remove()
    src = om._streamed.source
    out = dict(errors=errors, equal=equal, plans=plans, raw=list(src.raw), codec=src.codec,
               shards=list(src.store.shard_bytes), plan=om.stats().get("codec_plan"),
               usable=om._streamed.usable, ncoll=src.ncoll)
    local = om.local_state_dict()
    plain = om.disable()
    out["back"] = all(torch.equal(v.cpu(), ref.state_dict()[k].cpu()) for k, v in plain.state_dict().items())
    out["local"], out["ref"] = local, {k: v.cpu().clone() for k, v in ref.state_dict().items()}
    return out


def _rank_mixed(parallel, rank):
    """weight_codec='auto' with blocks 0 and 3 coded (exp-k, on both ranks at once) and the others raw:
    what a partial plan leaves. Outputs bit for bit; this rank's local_state_dict() (ShardPieces,
    CodedPieces, whole tensors) for the merge."""
    model, x = _model("toy", seed_inputs=1 + rank)
    ref = copy.deepcopy(model)
    om = OffloadedTransformer(model, _coded_cfg(codec="auto"), device="cpu", parallel=parallel)
    om._streamed.codec_planner.remove()  # no plan: the ranks code the same blocks themselves
    src = om._streamed.source
    with torch.no_grad():
        want = _first(ref(**x))
        equal = [torch.equal(_first(om(**x)), want)]
        src.code_blocks([0, 3], "exp-k")
        equal.append(torch.equal(_first(om(**x)), want))
    out = dict(equal=equal, raw=list(src.raw), local=om.local_state_dict(),
               ref={k: v.clone() for k, v in ref.state_dict().items()})
    om.disable()
    return out


def scenario_two(rank, world):
    from test_distributed import Checks

    par = ParallelConfig.data_parallel()
    c = Checks()
    c.run("equal_toy", _rank_equal, "toy", par, rank)
    c.run("equal_flux", _rank_equal, "flux", par, rank)
    c.run("rank_local", _rank_equal, "flux", par, rank, transfer="rank-local")
    c.run("codec_differs", _codec_differs, par, rank)
    c.run("equal_flux_k2", _rank_equal, "flux", par, rank, codec="exp-k2")
    c.run("equal_flux_kp", _rank_equal, "flux", par, rank, codec="exp-kp")
    c.run("equal_flux_none", _rank_equal, "flux", par, rank, codec="none")
    c.run("mixed", _rank_mixed, par, rank)
    c.run("rank_local_k2", _rank_equal, "flux", par, rank, transfer="rank-local", codec="exp-k2")
    c.run("rank_local_auto", _rank_equal, "flux", par, rank, transfer="rank-local", codec="auto", forwards=3)
    c.run("auto_allgather", _rank_auto, par, rank)
    c.run("auto_allgather_failure", _rank_auto, par, rank, fail_first=True)
    c.run("codec_differs_k2", _codec_differs, par, rank, "exp-k2")
    c.run("weights", _rank_weights, par, rank)
    c.run("failure_one", _rank_failure_one, rank, world)
    c.run("collective_failure", _rank_collective_failure, par, rank)
    return c.report


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    from test_distributed import run_ranks

    return run_ranks(2, tmp_path_factory.mktemp("dlo_coded2"), "test_dlo_coded:scenario_two", timeout=420)


def _merged_is_ref(merged, ref) -> bool:
    return sorted(merged) == sorted(ref) and all(
        merged[k].dtype == v.dtype and merged[k].shape == v.shape and torch.equal(merged[k], v) for k, v in ref.items())


@pytest.mark.parametrize("kind", ["flux_none", "flux", "flux_k2", "flux_kp", "mixed", "auto_allgather"])
def test_two_ranks_merge_shards_gives_the_weights_whatever_the_codec(two, kind):
    """merge_shards, the recovery after a DLO failure, over two ranks' local_state_dict()s: no codec,
    exp-k, exp-k2, exp-kp, auto with some blocks raw and some coded, auto with every block coded:
    the model's weights bit for bit (never coded bytes under a weight's name), in any order."""
    from test_distributed import get

    reps = get(two, f"equal_{kind}" if kind.startswith("flux") else kind)
    if kind == "mixed":
        assert reps[0]["equal"] == [True, True] and reps[0]["raw"][:5] == [False, True, True, False, True]
    locals_ = [r["local"] for r in reps]
    kinds = {type(v).__name__ for local in locals_ for v in local.values()}
    want = {"none": {"Tensor", "ShardPiece"}, "mixed": {"Tensor", "ShardPiece", "CodedPiece"}}
    assert want.get(kind.removeprefix("flux_"), {"Tensor", "CodedPiece"}) <= kinds, kinds
    assert _merged_is_ref(merge_shards(locals_), reps[0]["ref"])
    assert _merged_is_ref(merge_shards(locals_[::-1]), reps[0]["ref"])


def test_two_ranks_merge_shards_names_what_it_cannot_merge(two):
    """Pieces of one tensor from backends with different codecs (exp-k with none, exp-k with
    exp-k2, a coded block with a raw one), a corrupted coded piece, a missing rank: a named
    ShardMergeError (a ValueError) naming the tensor, never bytes under a weight's name."""
    from test_distributed import get

    from weightstream.offload.dlo.control import ShardMergeError

    k, k2, none, mixed, toy = (get(two, n) for n in ("equal_flux", "equal_flux_k2", "equal_flux_none", "mixed",
                                                      "equal_toy"))
    pairs = [(k[0], none[1]), (k[0], k2[1]), (mixed[0], toy[1]), (toy[0], mixed[1])]
    for a, b in pairs:
        with pytest.raises(ShardMergeError, match="do not belong to one tensor|a whole .* tensor"):
            merge_shards([a["local"], b["local"]])
    name, piece = next((n, v) for n, v in k[0]["local"].items() if isinstance(v, CodedPiece) and v.start == 0
                       and v.data.numel() > 16)
    bad = dict(k[0]["local"])
    bad[name] = dataclasses.replace(piece, data=torch.zeros_like(piece.data))  # the coded header is gone
    with pytest.raises(ShardMergeError, match=re.escape(repr(name)) + ".*do not decode"):
        merge_shards([bad, k[1]["local"]])
    with pytest.raises(ShardMergeError, match="misses bytes"):
        merge_shards([k[0]["local"]])
    assert issubclass(ShardMergeError, ValueError)


@pytest.mark.parametrize("kind", ["toy", "flux", "flux_k2", "flux_kp"])
def test_two_ranks_bit_exact_and_each_holds_half_the_coded_bytes(two, kind):
    from test_distributed import get

    reps = get(two, f"equal_{kind}")
    if kind != "toy":
        assert all((2 in r["stats"]["versions"]) == (kind == "flux_k2") for r in reps)
        assert all((3 in r["stats"]["versions"]) == (kind == "flux_kp") for r in reps)
    for r in reps:
        assert r["equal"] == [True, True] and r["restored"] and r["back"]
    s0, s1 = reps[0]["stats"], reps[1]["stats"]
    assert s0["coded_bytes"] == s1["coded_bytes"], "every rank encodes the same bytes"
    assert s0["shard_bytes"] == s1["shard_bytes"] < s0["coded_bytes"], (s0, s1)
    assert 2 * s0["shard_bytes"] >= s0["coded_bytes"] and s0["gathered_bytes_per_step"] == 2 * s0["shard_bytes"]
    merged = merge_shards([r["local"] for r in reps])
    assert all(torch.equal(merged[k], v) for k, v in reps[0]["ref"].items()) and sorted(merged) == sorted(reps[0]["ref"])
    with pytest.raises(ValueError, match="merge_shards"):
        merge_shards([reps[0]["local"]])  # one rank's share is not enough


def test_two_ranks_update_weights_and_gather_state_dict(two):
    from test_distributed import get

    for r in get(two, "weights"):
        assert r["written"] == r["expected"] and r["equal"] == [True, True] and r["gathered"] and r["resharded"]
        assert "gather_state_dict" in r["sd_error"]


@pytest.mark.parametrize("codec", ["exp-k", "exp-k2"])
def test_two_ranks_rank_local_streams_full_coded_blocks(two, codec):
    from test_distributed import get

    for r in get(two, "rank_local" if codec == "exp-k" else "rank_local_k2"):
        assert r["equal"] == [True, True] and r["restored"] and r["back"]
        assert r["stats"]["source"] == f"coded-{codec}" and r["stats"]["transfer"] == "rank-local"
        assert (2 in r["stats"]["versions"]) == (codec == "exp-k2")
        assert r["stats"]["h2d_bytes_per_step"] >= r["stats"]["coded_bytes"]
        assert not any(isinstance(v, CodedPiece) for v in r["local"].values())


def test_two_ranks_auto_with_allgather_plan_together_and_stay_exact(two):
    """Rank 0 measures a fast link, rank 1 a slow one: the joined (slowest) measurements give both
    ranks the same plan, every block coded (the link binds: the smaller bytes of exp-k2 win) after
    the first step; every output bit for bit, the coded shares merge back, disable() gives the weights back."""
    from test_distributed import get

    reps = get(two, "auto_allgather")
    for r in reps:
        assert r["errors"] == [None] * 3 and r["equal"] == [True] * 3 and r["usable"] and r["back"], r["errors"]
        assert r["plans"][0] == list(range(5)) and not any(r["raw"]) and r["codec"] == "exp-k2"
        assert "code 5 blocks with exp-k2" in r["plan"]["describe"] and r["plan"]["h2d_gbps"] == 1e-6
        assert r["plan"]["decode_gbps"] == {"exp-k": 1e3, "exp-k2": 2e2}  # rank 1's slower decode
    assert reps[0]["shards"] == reps[1]["shards"] and reps[0]["ncoll"] == reps[1]["ncoll"]
    merged = merge_shards([r["local"] for r in reps])
    assert all(torch.equal(merged[k], v) for k, v in reps[0]["ref"].items())


def test_two_ranks_auto_with_allgather_plans_after_a_step_every_rank_completed(two):
    """Rank 1 fails in the first (measured) step: both ranks raise, neither plans from it; the
    second step is measured and planned on both, alike."""
    from test_distributed import get

    reps = get(two, "auto_allgather_failure")
    for r in reps:
        assert r["errors"][0] is not None and r["errors"][1:] == [None, None], r["errors"]
        assert r["equal"] == [True, True] and r["usable"] and r["back"]
        assert r["plans"][0] is None and r["plans"][1] == list(range(5)) and not any(r["raw"])
    assert reps[0]["ncoll"] == reps[1]["ncoll"] and reps[0]["shards"] == reps[1]["shards"]


def test_two_ranks_rank_local_auto_codec_plans_per_rank(two):
    """weight_codec='auto' with rank-local DLO: each rank measures and plans its own stream (the
    CPU's measured rates decide what it codes); every output bit-exact, disable() gives back."""
    from test_distributed import get

    for r in get(two, "rank_local_auto"):
        assert r["equal"] == [True, True, True] and r["restored"] and r["back"]
        assert r["stats"]["source"].startswith("coded-auto") and r["stats"]["transfer"] == "rank-local"
        assert r["stats"]["coded_blocks"] >= 0 and r["plan"] is not None


@pytest.mark.parametrize("case", ["codec_differs", "codec_differs_k2"])  # exp-k vs none / vs exp-k2
def test_two_ranks_disagreeing_on_the_codec_are_told_at_setup(two, case):
    from test_distributed import get

    for msg in get(two, case):
        assert msg is not None and "weight_codec" in msg and "disagree" in msg, msg


def test_two_ranks_a_failure_on_one_rank_is_an_error_on_both_then_usable(two):
    from test_distributed import get

    reps = get(two, "failure_one")
    assert "injected failure" in reps[1]["errors"][1]
    assert reps[0]["errors"][1] is not None and "rank 1" in reps[0]["errors"][1], reps[0]
    for r in reps:
        assert r["errors"][0] is None and r["errors"][2] is None and r["usable"]
        assert r["equal"] == [True, True]


def test_two_ranks_collective_failure_loses_nothing(two):
    from test_distributed import get

    reps = get(two, "collective_failure")
    for r in reps:
        assert r["first"] is not None and not r["usable"]
        assert "merge_shards" in r["gather"] and "unusable" in r["update"]
    merged = merge_shards([r["local"] for r in reps])
    assert all(torch.equal(merged[k], v) for k, v in reps[0]["ref"].items())
