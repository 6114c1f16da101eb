"""weight_codec="auto"'s policy (offload/plan/codec.py): pure, on the CPU."""
import itertools
import random

import pytest

from weightstream.offload.plan import placement as planner
from weightstream.offload.plan.codec import (DECODE_ON, CodecOption, CodecPlanInputs, plan_codec, predict_ms)
from weightstream.offload.config import ConfigTypeError

GB = 10**9


def _flux_like(compute_total: float, n: int = 57, total: float = 23.7e9, ratios=(0.71, 0.69),
               rates=(777.0, 317.0), **kw) -> CodecPlanInputs:
    raw = [int(total / n)] * n
    opts = tuple(CodecOption(name, [int(r * q) for r in raw], g)
                 for name, q, g in zip(("exp-k", "exp-k2"), ratios, rates))
    return CodecPlanInputs([compute_total / n] * n, raw, 55.0, 2, opts, **kw)


@pytest.mark.parametrize("decode_on", DECODE_ON)
def test_transfer_bound_codes_every_block(decode_on):
    """Flux-1024 on the H200 (compute 172 ms, 23.7 GB streamed at 55 GB/s): code everything."""
    inputs = _flux_like(172.0, decode_on=decode_on)
    p = plan_codec(inputs)
    assert p.codec is not None and p.coded == tuple(range(57))
    assert p.predicted_ms < 0.72 * p.uncoded_ms
    assert p.predicted_ms == pytest.approx(predict_ms(inputs, inputs.options[[o.name for o in inputs.options]
                                                                            .index(p.codec)], p.coded))
    assert "code 57 blocks" in p.describe() and p.stats()["codec"] == p.codec


@pytest.mark.parametrize("decode_on", DECODE_ON)
def test_compute_bound_codes_nothing(decode_on):
    """Wan-14B-480p (compute 3150 ms, 28.1 GB): the raw stream hides; any decode only costs."""
    p = plan_codec(_flux_like(3150.0, n=40, total=28.1e9, decode_on=decode_on))
    assert p.codec is None and p.coded == () and p.predicted_ms == p.uncoded_ms == pytest.approx(3150.0)
    assert "code no block" in p.describe()


def test_between_the_two_codes_part_of_the_step():
    """Compute near the transfer: some blocks coded, spread over the step, faster than both ends."""
    inputs = _flux_like(350.0)
    p = plan_codec(inputs)
    assert 0 < len(p.coded) < 57
    everything = min(predict_ms(inputs, o, range(57)) for o in inputs.options)
    assert p.predicted_ms < min(p.uncoded_ms, everything)
    gaps = [b - a for a, b in zip(p.coded, p.coded[1:])]
    assert max(gaps) <= 2, p.coded  # spread, not the first N


def test_min_gain_keeps_a_marginal_code_out():
    inputs = _flux_like(420.0, min_gain=0.0)
    p = plan_codec(inputs)
    assert p.codec is not None and p.predicted_ms < p.uncoded_ms
    gain = 1 - p.predicted_ms / p.uncoded_ms
    strict = plan_codec(_flux_like(420.0, min_gain=gain * 1.01))
    assert strict.codec is None and strict.predicted_ms == strict.uncoded_ms


def test_the_slower_decoder_wins_only_where_its_bytes_pay():
    """Eager (side stream): exp-k2's smaller bytes win while the link binds; under graphs (decode on
    the compute stream) the same holds at 172 ms, and a faster link makes exp-k's cheap decode win."""
    assert plan_codec(_flux_like(172.0)).codec == "exp-k2"
    fast = _flux_like(172.0, decode_on="compute", rates=(777.0, 100.0))
    assert plan_codec(fast).codec == "exp-k"


def test_uncoded_prediction_is_the_planners_ring():
    random.seed(3)
    for _ in range(20):
        n = random.randint(2, 9)
        raw = [random.choice([None, 1000, 4000]) for _ in range(n)]
        raw[random.randrange(n)] = 2000
        comp = [random.uniform(0, 4) for _ in range(n)]
        slots = random.choice([1, 2, 3])
        inputs = CodecPlanInputs(comp, raw, 1.0, slots, ())
        res = [i for i, r in enumerate(raw) if r is None]
        link = [r or 1 for r in raw]
        pi = planner.PlanInputs(link_bytes=link, device_bytes=link, compute_ms=comp, h2d_gbps=1.0, budget_bytes=GB)
        assert predict_ms(inputs, None, ()) == pytest.approx(planner.step_ms(pi, res, slots))


def test_plan_is_near_the_exhaustive_best_on_small_cases():
    """Prefix search over the gain order: within 0.1% of every subset of every codec (seeded)."""
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(2, 7)
        raw = [rng.choice([None, 1000, 2000, 5000]) for _ in range(n)]
        raw[0] = raw[0] or 3000
        opts = tuple(CodecOption(name, [None if r is None else int(r * rng.uniform(0.5, 0.9)) for r in raw],
                                 rng.uniform(0.5, 50)) for name in ("a", "b"))
        inputs = CodecPlanInputs([rng.uniform(0, 5) for _ in range(n)], raw, 1.0, rng.choice([1, 2, 3]), opts,
                                 decode_on=rng.choice(DECODE_ON), min_gain=0.0)
        p = plan_codec(inputs)
        streamed = [i for i in range(n) if raw[i]]
        best = min(predict_ms(inputs, o, c) for o in opts for r in range(len(streamed) + 1)
                   for c in itertools.combinations(streamed, r))
        assert p.predicted_ms <= best * 1.001
        assert set(p.coded) <= set(streamed)


def test_resident_blocks_are_never_coded_and_step_local_is_modelled():
    raw = [None, 5 * 10**6, 5 * 10**6, None, 5 * 10**6]  # 5 ms per load against 0.1 ms of compute
    opts = (CodecOption("exp-k", [None if r is None else r // 2 for r in raw], 1000.0),)
    local = CodecPlanInputs([0.1] * 5, raw, 1.0, 2, opts, decode_on="compute", step_local=True)
    ring = CodecPlanInputs([0.1] * 5, raw, 1.0, 2, opts, decode_on="compute")
    p = plan_codec(local)
    assert p.coded == (1, 2, 4)
    assert predict_ms(local, None, ()) > predict_ms(ring, None, ())  # nothing crosses the step boundary


def test_a_later_plan_adds_to_the_blocks_coded_already():
    """A new input signature (another resolution) plans with the blocks coded before fixed: a
    transfer-bound one codes more of them with the same codec, a compute-bound one none."""
    base = _flux_like(172.0)
    one = (base.options[0],)  # exp-k, the codec in use
    half = tuple(range(0, 57, 2))
    p = plan_codec(CodecPlanInputs(base.compute_ms, base.raw_bytes, 55.0, 2, one, fixed=half))
    assert p.codec == "exp-k" and p.coded == tuple(range(57)) and set(p.added) == set(range(1, 57, 2))
    assert p.predicted_ms < p.current_ms < p.uncoded_ms
    assert "29 blocks coded already with exp-k; code 28 more" in p.describe()
    slow = _flux_like(3150.0)
    q = plan_codec(CodecPlanInputs(slow.compute_ms, slow.raw_bytes, 55.0, 2, one, fixed=half))
    assert q.codec == "exp-k" and q.coded == half and q.added == () and q.predicted_ms == q.current_ms
    assert "code no more" in q.describe()


@pytest.mark.parametrize("kw,match", [
    (dict(raw_bytes=[1000]), "one per block"),
    (dict(raw_bytes=[None, None]), "no streamed block"),
    (dict(raw_bytes=[0, 1000]), r"raw_bytes\[0\]=0"),
    (dict(h2d_gbps=0.0), "h2d_gbps=0.0"),
    (dict(decode_on="copy"), "decode_on='copy'"),
    (dict(num_slots=0), "num_slots=0"),
    (dict(options=(CodecOption("x", [700, None], 1.0),)), "exactly where raw_bytes"),
    (dict(compute_ms=[1.0, float("nan")]), r"compute_ms\[1\]=nan"),
    (dict(fixed=(0,)), r"fixed=\(0,\) is not allowed"),  # no option to say their codec
    (dict(fixed=(2,), options=(CodecOption("x", [700, 700], 1.0),)), r"fixed=\(2,\)"),
    (dict(decoded_bytes=[2000]), "decoded_bytes=\\[2000\\] is not allowed"),
    (dict(decoded_bytes=[2000, 0]), "decoded_bytes"),
    (dict(decoded_bytes=[2000, None]), "decoded_bytes"),
])
def test_bad_inputs_are_named(kw, match):
    base = dict(compute_ms=[1.0, 1.0], raw_bytes=[1000, 1000], h2d_gbps=1.0, num_slots=2, options=())
    with pytest.raises(ValueError, match=match):
        CodecPlanInputs(**{**base, **kw})


def test_bad_option_types_are_named():
    with pytest.raises(ConfigTypeError, match="decode_gbps"):
        CodecOption("exp-k", [1], "fast")
    with pytest.raises(ConfigTypeError, match="CodecOption"):
        CodecPlanInputs([1.0], [10], 1.0, 2, ("exp-k",))


def _dlo_like(decoded: bool, n: int = 10) -> CodecPlanInputs:
    """A DLO AllGather rank (2 ranks): its link moves a 1 GB share per block (20 ms at 50 GB/s),
    coded 0.75 of it; its decode writes the whole 2 GB block (2 ms at 1000 GB/s); 17 ms compute."""
    share = [GB] * n
    opt = CodecOption("exp-k", [int(0.75 * GB)] * n, 1000.0)
    return CodecPlanInputs([17.0] * n, share, 50.0, 2, (opt,),
                           decoded_bytes=[2 * GB] * n if decoded else None)


def test_decoded_bytes_price_a_dlo_rank_decoding_whole_blocks():
    """With each decode writing the whole block (twice the rank's share), the plan codes only part
    of the step: until the link hides under the compute plus the decodes. Pricing the decode by
    the share instead codes more (and predicts a step it would not reach)."""
    whole, share = plan_codec(_dlo_like(True)), plan_codec(_dlo_like(False))
    assert 0 < len(whole.coded) < 10, whole.describe()
    assert len(share.coded) > len(whole.coded)
    inputs = _dlo_like(True)
    opt = inputs.options[0]
    k = len(whole.coded)
    # the model: link = 20 ms a raw block, 15 a coded one; compute 170 + 1.15 x 2 ms a coded block
    assert predict_ms(inputs, opt, range(10)) == pytest.approx(170 + 10 * 2.0 * 1.15)
    assert whole.predicted_ms == pytest.approx(max(170 + 2.3 * k, 200 - 5 * k), rel=0.05)
    assert whole.predicted_ms < whole.uncoded_ms == pytest.approx(200.0, rel=0.05)
