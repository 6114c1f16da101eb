"""weight_codec="auto" (offload/plan/auto.py, plan/coding.py): raw first, a measured step, then the planned blocks coded.

On the CPU the measured link and decode rates are noise, so the tests that need
a given plan set them (``h2d_gbps``, ``decode_gbps``) the way a slow or a fast
link would measure; every output is compared with the unwrapped model bit for bit.
"""
import copy
import time

import pytest
import torch

from layerwise_cases import first
from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import ToyDiT, flux_inputs, tiny_flux, tiny_wan, toy_inputs, wan_inputs
from weightstream.offload.pipeline import offload_pipeline
from weightstream.offload.codecs import CodedCaptureStaleError, codec_levels

DEV = "cpu"
FAST_DECODE = {"exp-k": 1e3, "exp-k2": 1e3}


@pytest.fixture(autouse=True)
def torch_decode(monkeypatch):
    """decode_torch on the CPU (the interpreted Triton decode is slow; tests/test_coded_source.py
    runs it); on CUDA the kernel runs whatever this says (tests/conftest.py imported triton first)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _wide(name, device=DEV):
    """Blocks of a few MB (the tiny models' tens of kB code to no gain once the copy slack is added):
    (model on the CPU, resident reference on ``device``, inputs), bf16."""
    if name == "flux":
        model = tiny_flux(dtype=torch.bfloat16, attention_head_dim=64, num_attention_heads=4, axes_dims_rope=(16, 24, 24))
        x = flux_inputs(model, device=device)
    elif name == "wan":
        model = tiny_wan(dtype=torch.bfloat16, attention_head_dim=64, num_attention_heads=4, ffn_dim=1024)
        x = wan_inputs(model, device=device)
    else:
        model = ToyDiT(width=256).to(torch.bfloat16)
        x = {k: v.to(device, torch.bfloat16) if v.is_floating_point() else v.to(device)
             for k, v in toy_inputs().items()}
    return model, copy.deepcopy(model).to(device), x


def _until_coded(wrapped, x, want, *, timeout_s: float = 60.0) -> int:
    """Steps (each output equal to ``want``) until the background coding finished; their count."""
    steps, t0 = 0, time.monotonic()
    while wrapped.stats().get("coding_in_background") is not None:
        assert time.monotonic() - t0 < timeout_s, wrapped.stats()["coding_in_background"]
        time.sleep(0.02)
        with torch.no_grad():
            assert torch.equal(first(wrapped(**x)), want)
        steps += 1
    return steps


def _auto(model, *, h2d_gbps=None, device=DEV, **kw):
    kw.setdefault("resident_layers", 0)  # the codec alone (not given, the residency is planned too on CUDA)
    cfg = OffloadConfig.layerwise(weight_codec="auto", progress=False, **kw)
    wrapped = OffloadedTransformer(model, cfg, device=device)
    planner = wrapped._streamed.codec_planner
    if h2d_gbps is not None:  # what a slow (transfer-bound) or fast (compute-bound) link would measure
        planner.h2d_gbps, planner.decode_gbps = h2d_gbps, FAST_DECODE
    return wrapped


@pytest.mark.parametrize("name", ["flux", "wan", "toy"])
def test_transfer_bound_codes_every_block_bit_exact(name):
    model, ref, x = _wide(name)
    wrapped = _auto(model, h2d_gbps=1e-6)
    assert wrapped.stats()["coded_blocks"] == 0 and "codec_plan" not in wrapped.stats()
    with torch.no_grad():
        want = first(ref(**x))
        outs = [first(wrapped(**x)) for _ in range(2)]
    assert all(torch.equal(o, want) for o in outs)
    _until_coded(wrapped, x, want)  # eager: coded on a thread while the steps stream raw blocks
    s = wrapped.stats()
    plan = s["codec_plan"]
    assert plan["codec"] == "exp-k2"  # equal decode rates: the smaller bytes win
    assert s["coded_blocks"] == s["blocks_streamed"] == len(plan["coded_blocks"])
    assert s["coded_bytes"] < s["raw_bytes"] and s["source"] == "coded-auto(exp-k2)"
    assert "code " in plan["describe"] and plan["plan_s"] > 0
    parts = plan["plan_parts_s"]
    assert set(parts) == {"sample_s", "decode_s", "apply_s"} and parts["sample_s"] > 0
    assert sum(parts.values()) <= plan["plan_s"]
    sd = wrapped.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    back = wrapped.disable()
    with torch.no_grad():
        assert torch.equal(first(back(**x)), want)


def test_with_resident_blocks_only_streamed_ones_are_planned():
    model, ref, x = _wide("flux")
    wrapped = _auto(model, h2d_gbps=1e-6, resident_layers=2)
    with torch.no_grad():
        want = first(ref(**x))
        assert all(torch.equal(first(wrapped(**x)), want) for _ in range(3))
    _until_coded(wrapped, x, want)
    s = wrapped.stats()
    plan = s["codec_plan"]
    assert s["blocks_resident"] == 2 and s["coded_blocks"] == s["blocks_streamed"] == 3
    assert plan["coded_blocks"] == [2, 3, 4]  # execution-order indices of the streamed blocks


def test_compute_bound_codes_nothing_and_streams_raw():
    model, ref, x = _wide("flux")
    wrapped = _auto(model, h2d_gbps=1e6)
    with torch.no_grad():
        want = first(ref(**x))
        assert all(torch.equal(first(wrapped(**x)), want) for _ in range(3))
    s = wrapped.stats()
    assert s["codec_plan"]["codec"] is None and s["coded_blocks"] == 0
    assert s["coded_bytes"] == s["raw_bytes"] and s["h2d_bytes_per_step"] == s["raw_bytes"]
    assert "nothing coded" in repr(wrapped._streamed.codec_planner)


def test_measured_rates_plan_without_overrides():
    """The real path: copy and compute records of the first step, sampled encodes, timed decodes."""
    model, ref, x = _wide("toy")
    wrapped = _auto(model)
    with torch.no_grad():
        want = first(ref(**x))
        for _ in range(2):
            assert torch.equal(first(wrapped(**x)), want)
    _until_coded(wrapped, x, want)
    plan = wrapped.stats()["codec_plan"]
    assert plan["h2d_gbps"] > 0 and all(g > 0 for g in plan["decode_gbps"].values())
    assert len(plan["candidates"]) == 2 and len(plan["coded_blocks"]) == wrapped.stats()["coded_blocks"]


def test_edits_and_updates_across_the_switch_are_kept():
    """A state_dict() edit and an update_weights while raw, then the plan codes every block: the
    edits stream coded; an update after it re-encodes; outputs follow the reference throughout."""
    model, ref, x = _wide("toy")
    wrapped = _auto(model, h2d_gbps=1e-6)
    key = "single_blocks.4.up.weight"
    with torch.no_grad():
        new = {k: (v * 1.5 if v.is_floating_point() else v) for k, v in ref.state_dict().items()}
        wrapped.update_weights(new)
        ref.load_state_dict(new)
        wrapped.state_dict()[key].mul_(-2.0)  # held by the caller across the switch
        ref.state_dict()[key].mul_(-2.0)
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))  # measured step: raw
        _until_coded(wrapped, x, first(ref(**x)))
        assert wrapped.stats()["coded_blocks"] > 0
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))  # coded
        newer = {k: (v + 0.25 if v.is_floating_point() else v) for k, v in ref.state_dict().items()}
        wrapped.update_weights(newer)
        ref.load_state_dict(newer)
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))
    sd = wrapped.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


def test_not_planned_after_a_failed_step():
    model, ref, x = _wide("toy")
    wrapped = _auto(model, h2d_gbps=1e-6)
    planner = wrapped._streamed.codec_planner

    def boom(module, args):
        raise RuntimeError("injected failure in a block")

    h = model.single_blocks[2].register_forward_pre_hook(boom)
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        wrapped(**x)
    h.remove()
    assert planner.plan is None and wrapped.stats()["coded_blocks"] == 0
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))
    assert planner.plan is not None and len(planner.plans) == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_new_signature_plans_again_and_only_adds(device):
    """Compute-bound at the first input signature (nothing coded), transfer-bound at a second (every
    block coded); back at the first, no new plan; a third signature with no raw block left plans
    nothing. Outputs equal the reference at every signature (on CUDA: the background job's blocks
    stored between steps that stream the rest raw)."""
    model, ref, x = _wide("toy", device)
    wrapped = _auto(model, h2d_gbps=1e6, device=device)
    planner = wrapped._streamed.codec_planner
    two = {k: torch.cat([v, v]) for k, v in x.items()}
    three = {k: torch.cat([v, v, v]) for k, v in x.items()}
    with torch.no_grad():
        want = {n: first(ref(**i)) for n, i in (("x", x), ("two", two), ("three", three))}
        assert torch.equal(first(wrapped(**x)), want["x"])
        assert planner.plan.codec is None and wrapped.stats()["coded_blocks"] == 0
        planner.h2d_gbps = 1e-6  # the second signature measures a slow link
        assert torch.equal(first(wrapped(**two)), want["two"])
        assert len(planner.plans) == 2 and planner.plan.added == planner.plan.coded != ()
        _until_coded(wrapped, two, want["two"])
        assert torch.equal(first(wrapped(**x)), want["x"])
        assert torch.equal(first(wrapped(**three)), want["three"])
    s = wrapped.stats()
    assert s["coded_blocks"] == s["blocks_streamed"] and s["codec_plan"]["signatures"] == 2
    assert len(planner.plans) == 2  # nothing raw left: the third signature is not measured


def test_code_blocks_mixes_raw_and_coded_blocks():
    """Blocks 0, 2 and 5 coded, the rest raw: the ring copies raw ones straight into the slot."""
    model, ref, x = _wide("toy")
    wrapped = _auto(model)
    src = wrapped._streamed.source
    wrapped._streamed.codec_planner.remove()  # no plan: the test picks the blocks
    assert repr(wrapped._streamed.codec_planner).endswith("not planned yet, removed)")
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))
        src.code_blocks([0, 2, 5], "exp-k")
        assert src.raw == [k not in (0, 2, 5) for k in range(len(src.raw))]
        for _ in range(3):
            assert torch.equal(first(wrapped(**x)), first(ref(**x)))
        src.code_blocks([1], "exp-k")
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))
    with pytest.raises(ValueError, match=r"blocks \[0\] are not raw"):
        src.code_blocks([0], "exp-k")
    with pytest.raises(ValueError, match="one codec per source"):
        src.code_blocks([3], "exp-k2")
    with pytest.raises(ValueError, match="weight_codec='nope'"):
        src.code_blocks([3], "nope")
    src.stage.captured = True
    with pytest.raises(CodedCaptureStaleError, match="CUDA graphs were captured"):
        src.code_blocks([3], "exp-k")


def test_rules_are_named():
    # planned together: the residency, then the codec (tests/test_auto_joint.py)
    assert OffloadConfig.layerwise(weight_codec="auto", resident_layers="auto").weight_codec == "auto"
    # AllGather: the ranks plan together (offload/plan/auto.py, gather=True; tests/test_dlo_coded.py)
    assert OffloadConfig.layerwise(weight_codec="auto", weight_transfer="allgather").weight_codec == "auto"
    with pytest.raises(ValueError, match="weight_codec='auto' is not allowed here.*exp-k, exp-k2"):
        codec_levels("auto")
    OffloadConfig.layerwise(weight_codec="auto", cuda_graphs="on")  # planned at the warm-up step
    from weightstream.offload.checkpoint_offload import offload_from_safetensors

    with pytest.raises(ValueError, match="weight_codec='auto' is not allowed with the mmap source"):
        offload_from_safetensors(ToyDiT(), "/nonexistent", OffloadConfig.layerwise(weight_codec="auto"))
    # AllGather (chosen by default, or given) and rank-local with auto over gloo: tests/test_dlo_coded.py


def test_module_mode_auto_stores_exp_k2():
    from test_module_coded import _flux_case, _versions, cfg  # noqa: PLC0415

    pipe, ids, kw, _, expected = _flux_case()
    handle = offload_pipeline(pipe, cfg(codec="auto"), device=DEV)
    assert 2 in _versions(handle)  # two-level tensors: exp-k2
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(pipe.run(ids, kw), expected))
    assert handle.stats()["weight_codec"] == "auto" and handle.coded.codec == "exp-k2"


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["off", "on"])
def test_auto_codec_on_cuda_equals_resident(graphs):
    """On the H200: the measured plan (a tiny Flux: compute-bound or not, whatever it says), then a
    forced transfer-bound plan: on CUDA the planned blocks are coded at once on the GPU (no
    background job, so no eager-settling steps under graphs): the capture after the planned
    warm-up sees them coded, replays bit-exact."""
    for h2d in (None, 1e-6):
        model, ref, x = _wide("flux", "cuda")
        wrapped = _auto(model, h2d_gbps=h2d, device="cuda", cuda_graphs=graphs)
        c = wrapped.graphs.counts if graphs == "on" else {}
        with torch.no_grad():
            want = first(ref(**x))
            captured_with = []  # coded blocks as each capture saw them (the job ends at a step start)
            for i in range(40):
                captures = c.get("capture", 0)
                assert torch.equal(first(wrapped(**x)), want), i
                s = wrapped.stats()
                if c.get("capture", 0) > captures:
                    captured_with.append((i, s["coded_blocks"], s.get("coding_in_background")))
                if i >= 6 and s.get("coding_in_background") is None:
                    break
                time.sleep(0.01)
            assert wrapped.stats().get("coding_in_background") is None
            assert all(torch.equal(first(wrapped(**x)), want) for _ in range(4))
        s = wrapped.stats()
        assert all(n == s["coded_blocks"] and left is None for _, n, left in captured_with), captured_with
        assert s["codec_plan"]["decode_gbps"]["exp-k"] > 0
        if h2d is not None:
            assert s["coded_blocks"] == s["blocks_streamed"]
        if graphs == "on":  # warm-up (planned), eager while coding, a capture per phase, replays
            assert c["replay"] >= 2 and c["eager-warmup"] == 1 and c["eager-fallback"] == 0, c
            if h2d is not None:  # coded on the GPU within the warm-up's plan: nothing left to settle
                assert c["eager-settling"] == 0 and c["capture"] >= 1, c
        wrapped.disable()


def _mapping_rss(addr: int) -> int:
    """Resident bytes of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_coding_gives_the_raw_pages_back():
    """Once coded, a block's host region holds its coded bytes only: the raw image's tail pages
    go back to the OS (host memory ends near the coded size, not the raw one)."""
    model, ref, x = _wide("flux")
    wrapped = _auto(model, h2d_gbps=1e-6)
    src = wrapped._streamed.source
    raw = sum(lay.nbytes for lay in src.layouts)
    before = _mapping_rss(src.arena.data_ptr())
    assert before >= raw
    with torch.no_grad():
        want = first(ref(**x))
        for _ in range(2):
            assert torch.equal(first(wrapped(**x)), want)
    _until_coded(wrapped, x, want)
    s = wrapped.stats()
    assert s["coded_blocks"] == s["blocks_streamed"]
    after = _mapping_rss(src.arena.data_ptr())  # the kernel may have merged neighbours into the mapping:
    assert s["host_bytes"] < 0.85 * raw  # compare what it lost with what coding freed
    assert before - after >= 0.9 * (raw - s["host_bytes"]), (before, after, s["host_bytes"], raw)


def test_background_coding_keeps_edits_made_while_it_runs():
    """code_blocks(background=True) started, then a state_dict() edit and an update_weights before
    the blocks are stored: the job's bytes for those blocks are stale and encoded again at the step
    start that stores them; every output follows the reference; all blocks end coded."""
    model, ref, x = _wide("toy")
    wrapped = _auto(model)
    wrapped._streamed.codec_planner.remove()  # the test starts the job
    src = wrapped._streamed.source
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(ref(**x)))
        src.code_blocks(range(len(src.raw)), "exp-k", background=True)
        assert wrapped.stats()["coding_in_background"] == len(src.raw)
        with pytest.raises(ValueError, match="still running"):
            src.code_blocks([0], "exp-k")
        key = "single_blocks.4.up.weight"
        wrapped.state_dict()[key].mul_(-2.0)
        ref.state_dict()[key].mul_(-2.0)
        new = {k: (v * 0.5 if k.startswith("double_blocks.1") else v) for k, v in ref.state_dict().items()}
        wrapped.update_weights(new)
        ref.load_state_dict(new)
        want = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), want)
    _until_coded(wrapped, x, want)
    assert not any(src.raw) and wrapped.stats()["coding_in_background"] is None
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), want)
    sd = wrapped.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


def test_a_failed_background_job_leaves_blocks_raw_with_a_warning(monkeypatch):
    import weightstream.offload.host.background as bg  # noqa: PLC0415

    def broken(*a, **kw):
        raise OSError("injected: no memory for the encoder")
        yield  # a generator, as encoded_in_order

    monkeypatch.setattr(bg, "encoded_in_order", broken)
    model, ref, x = _wide("toy")
    wrapped = _auto(model, h2d_gbps=1e-6)
    with torch.no_grad():
        want = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), want)  # measured and planned: the job fails at once
        time.sleep(0.1)
        with pytest.warns(UserWarning, match="background coding.*failed.*injected"):
            assert torch.equal(first(wrapped(**x)), want)
        assert torch.equal(first(wrapped(**x)), want)
    s = wrapped.stats()
    assert s["coded_blocks"] == 0 and s["coding_in_background"] is None


def test_a_plan_adds_to_blocks_coded_before_with_their_codec():
    model, ref, x = _wide("toy")
    wrapped = _auto(model, h2d_gbps=1e-6)
    src = wrapped._streamed.source
    src.code_blocks([0, 2], "exp-k")  # coded before any plan (as an earlier signature's plan would)
    with torch.no_grad():
        want = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), want)
    plan = wrapped._streamed.codec_planner.plan
    idx = [lay.index for lay in src.layouts]
    assert plan.codec == "exp-k" and set(plan.coded) - set(plan.added) == {idx[0], idx[2]}
    assert list(plan.candidates) == ["exp-k"]  # the codec in use: the only option
    _until_coded(wrapped, x, want)
    assert not any(src.raw) and src.levels == 1


def test_a_background_job_waits_while_its_blocks_are_not_taken(monkeypatch):
    """No step comes: the job prepares at most MAX_WAITING blocks and waits (host memory stays
    bounded); the next steps swap them in and let it go on; the raw regions go back to the OS."""
    import weightstream.offload.host.background as bg  # noqa: PLC0415

    monkeypatch.setattr(bg, "MAX_WAITING", 1)
    model, ref, x = _wide("toy")
    wrapped = _auto(model)
    wrapped._streamed.codec_planner.remove()  # the test starts the job
    src = wrapped._streamed.source
    with torch.no_grad():
        want = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), want)
        src.code_blocks(range(len(src.raw)), "exp-k", background=True)
        job = src.images._coding
        t0 = time.monotonic()
        while not job._done:
            assert time.monotonic() - t0 < 30
            time.sleep(0.01)
        time.sleep(0.3)  # time for several more blocks, were the job not waiting
        assert len(job._done) == 1 and job.running and all(src.raw)
        assert torch.equal(first(wrapped(**x)), want)  # swaps the one in, the job goes on
        assert sum(src.raw) < len(src.raw)
    assert _until_coded(wrapped, x, want) >= 1
    assert not any(src.raw) and not job.running and not src.images._retiring
    assert all(src.region(k).data_ptr() != src.arena[src.offsets[k]:].data_ptr() for k in range(len(src.raw)))


@pytest.mark.parametrize("fill", ["init", "student-t"])
def test_a_sampled_block_estimates_its_coded_bytes(monkeypatch, fill):
    """sample() of a block larger than max_bytes encodes every m-th run of each tensor: its
    estimate of the block's coded bytes is within 2% of the whole block's, and the sample itself
    decodes to the sampled elements bit for bit."""
    import weightstream.offload.host.recode as ca  # noqa: PLC0415

    monkeypatch.setattr(ca, "SAMPLE_RUN", 4096)
    model, _, _ = _wide("wan")
    if fill == "student-t":
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype == torch.bfloat16 and p.dim() == 2:
                    t = torch.distributions.StudentT(4.0).sample(p.shape) * 0.02
                    p.copy_(t.to(p.dtype))
    wrapped = _auto(model)
    src = wrapped._streamed.source
    k = max(range(len(src.layouts)), key=lambda i: src.layouts[i].nbytes)
    lay = src.layouts[k]
    for codec in ("exp-k", "exp-k2"):
        whole, *_ = src.sample(k, (codec,), max_bytes=None)[codec]
        est, data, table, nbytes = src.sample(k, (codec,), max_bytes=lay.nbytes // 8)[codec]
        assert lay.nbytes // 12 < nbytes < lay.nbytes // 4
        assert abs(est - whole) <= 0.02 * whole, (codec, est, whole)
        sub, tensors, _ = ca._sampled(lay, src.region(k), -(-lay.nbytes // (lay.nbytes // 8)))
        out = torch.zeros(nbytes, dtype=torch.uint8)
        src.decode_table(data, out, table)
        for spec, t in zip(sub.tensors, tensors):
            assert torch.equal(spec.view_of(out).view(torch.int16), t.reshape(-1).view(torch.int16))
    wrapped.disable()


@pytest.mark.gpu
def test_a_block_the_job_cannot_pin_streams_pageable_with_a_warning(monkeypatch):
    """cudaHostRegister fails for the buffers the background job prepares: each such block is
    swapped in pageable (one warning naming the cause), the outputs stay bit-exact and the source
    says why CUDA graphs could not hold its loads. (On CUDA blocks up to WHOLE_ON_DEVICE are coded
    by the GPU encoder in their pinned regions, which registers nothing; larger ones go to the CPU
    job: here every block does.)"""
    import threading  # noqa: PLC0415

    import weightstream.offload.host.recode as recode  # noqa: PLC0415
    import weightstream.offload.host.registration as hm  # noqa: PLC0415

    monkeypatch.setattr(recode, "WHOLE_ON_DEVICE", 0)
    real = hm._cuda_register

    def failing_on_the_job(ptr, size, flags=0):
        if threading.current_thread().name == "weightstream-auto-codec":
            return "injected: cudaHostRegister failed"
        return real(ptr, size, flags)

    monkeypatch.setattr(hm, "_cuda_register", failing_on_the_job)
    model, ref, x = _wide("toy", "cuda")
    wrapped = _auto(model, h2d_gbps=1e-6, device="cuda")
    with torch.no_grad():
        want = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), want)  # measured and planned: the job starts
        with pytest.warns(UserWarning, match="injected: cudaHostRegister failed.*stay pageable"):
            _until_coded(wrapped, x, want)
        assert torch.equal(first(wrapped(**x)), want)
    s, src = wrapped.stats(), wrapped._streamed.source
    assert s["coded_blocks"] == s["blocks_streamed"] and not s["pinned"]
    assert "injected" in src.uncapturable()
    wrapped.disable()


def test_a_raw_region_not_given_back_is_named_and_teardown_goes_on(monkeypatch):
    """The thread giving swapped-in blocks' raw regions back fails: a warning names it (memory
    stays in use, no weight changes), the steps go on exact, an update after it is kept, and
    disable() hands back every weight bit for bit."""
    import threading  # noqa: PLC0415

    import weightstream.offload.host.registration as hm  # noqa: PLC0415

    real = hm.BlockRegistration.release

    def release(self):
        if threading.current_thread().name == "weightstream-retire":
            raise OSError("injected: cudaHostUnregister failed")
        real(self)

    monkeypatch.setattr(hm.BlockRegistration, "release", release)
    model, ref, x = _wide("toy")
    wrapped = _auto(model, h2d_gbps=1e-6)
    with torch.no_grad():
        want = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), want)
        with pytest.warns(UserWarning, match="giving a raw block region back after coding failed.*injected"):
            _until_coded(wrapped, x, want)  # the job's end waits for the retirements: it warns there
        assert torch.equal(first(wrapped(**x)), want)
        new = {k: (v * 0.5 if v.is_floating_point() else v) for k, v in ref.state_dict().items()}
        wrapped.update_weights(new)  # rewrites the regions whose retirement failed
        ref.load_state_dict(new)
        want = first(ref(**x))
        assert torch.equal(first(wrapped(**x)), want)
        back = wrapped.disable()
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ref.state_dict().values()))
        assert torch.equal(first(back(**x)), want)
