"""Stream/event ordering of the coded source (H2D of coded bytes on the copy stream, decode on
the decode stream), checked on the CPU with RecordingStreams and tests/stream_trace.py, as
tests/test_happens_before.py does for the pinned and DLO sources: every schedule is clean,
and one-line mutations of CodedSource (the pinned transport) and of its DecodeStage keep the CPU
outputs bit-exact but break the rules."""
import dataclasses
import copy
import warnings

import pytest
import torch
from stream_trace import RULES, accesses, check, counts
from test_happens_before import MODES, SKIPS, SkippingToyDiT, _traced, mutant

from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import toy_inputs
from weightstream.offload.sources.decode import DecodeStage
from weightstream.offload.sources.pinned import CodedSource, coded_source
from weightstream.offload.build import streamed_blocks
from weightstream.offload.streamed import StreamedBlocks
from weightstream.offload.streams import RecordingStreams

DEV = torch.device("cpu")


class CodedCase:
    """A wrapped SkippingToyDiT (7 blocks, fp32 and bf16) streamed from coded images, traced."""

    def __init__(self, *, slots=2, resident=0, mode="ring", source_cls=CodedSource, stage_cls=DecodeStage,
                 decode_at="load", decode_stream=True, coded=None):
        """``coded``: weight_codec="auto" with these streamed blocks coded (exp-k), the rest raw."""
        self.rec = RecordingStreams()
        model = SkippingToyDiT()
        self.ref = copy.deepcopy(model)
        self.x = toy_inputs()
        codec = "exp-k" if coded is None else "auto"
        cfg = OffloadConfig.layerwise(resident_layers=resident, weight_codec=codec, progress=False)
        cls = _traced(StreamedBlocks, self.rec, slots, mode)

        def factory(req):
            src = coded_source(req)
            src.__class__ = source_cls  # the same object, with the (mutated) methods of source_cls
            src.stage.__class__ = stage_cls  # ... and its stage, with those of stage_cls
            src.stage.decode_at, src.stage.decode_stream = decode_at, decode_stream  # before the executor attaches it
            src.caps = dataclasses.replace(src.caps, writes_at_use=decode_at == "use")
            return src

        streamed = streamed_blocks(model, cfg, DEV, None, source=factory, cls=cls)
        self.wrapped = OffloadedTransformer(streamed.module, cfg, device=DEV, streamed=streamed)
        if coded is not None:
            streamed.codec_planner.remove()  # the test picks the coded blocks
            streamed.source.code_blocks(coded, "exp-k")

    def forward(self, skip=()):
        with torch.no_grad():
            assert torch.equal(self.wrapped(self.x["x"], skip=skip), self.ref(self.x["x"], skip=skip))

    def violations(self):
        return check(self.rec.trace)


def _assert_clean(case, min_reads, waive=()):
    c = counts(case.rec.trace)
    assert c["reads"] >= min_reads and c["writes"] >= min_reads, c
    bad = {r: v[:3] for r, v in case.violations().items() if v and r not in waive}
    assert not bad, bad
    coded = [s for s in accesses(case.rec.trace).reads if isinstance(s, tuple) and s[0] == "coded"]
    assert coded, "the decodes note their reads of the coded buffers"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("slots,resident", [(1, 0), (2, 1), (3, 3)])
def test_coded_schedules_are_ordered(slots, resident, mode):
    """Skipped blocks, a weight update and an edit of a state_dict() tensor between forwards."""
    case = CodedCase(slots=slots, resident=resident, mode=mode)
    _exercise(case)
    _assert_clean(case, min_reads=3 * (7 - resident))
    assert case.wrapped.stats()["source"].startswith("coded")


def _exercise(case) -> None:
    """Forwards with skipped blocks, a weight update and an edit of a state_dict() tensor between
    them, no warning (no re-prime); every output bit-exact."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for skip in SKIPS[:6]:
            case.forward(skip=skip)
        case.wrapped.update_weights(case.ref.state_dict())
        case.forward()
        key = "single_blocks.4.up.weight"
        with torch.no_grad():
            case.wrapped.state_dict()[key].mul_(0.5)
            case.ref.state_dict()[key].mul_(0.5)
        case.forward()
        case.forward(skip=(6,))


CODED_MUTATIONS = {
    # the decode does not wait for the H2D of its coded bytes
    "decode-no-wait-copied": ("written", "ds.wait_event(self._copied[slot])", {"read_after_load"}, "ring"),
    # the H2D into a coded buffer does not wait for the decode that last read it (a skipped
    # block's slot is freed without anyone waiting for its decode)
    "copy-no-wait-read": ("before_write", "cs.wait_event(self._read[slot])", {"no_concurrent_write"}, "ring"),
}


def _broken_rules(case) -> set:
    """Run every skip pattern (the outputs must still equal the resident model's); the rules broken."""
    for skip in SKIPS:
        case.forward(skip=skip)
    v = case.violations()
    return {r for r in RULES if v[r]}


# decode_at="use": (method, line, rules broken, decode_stream)
USE_MUTATIONS = {
    # the decode (issued at use, on the decode stream) does not wait for its H2D
    "use-decode-no-wait-copied": ("before_use", "ds.wait_event(self._copied[slot])", {"read_after_load"}, True),
    # ... nor for the slot's release by the block computed from it before
    "use-decode-no-wait-free": ("before_use", "ds.wait_event(self._free[slot])", {"no_concurrent_write"}, True),
    # the H2D into a coded buffer does not wait for the decode that last read it
    "use-copy-no-wait-read": ("before_write", "cs.wait_event(self._read[slot])", {"no_concurrent_write"}, False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("slots,resident", [(1, 0), (2, 1)])
@pytest.mark.parametrize("decode_stream", [True, False])
def test_decode_at_use_is_ordered(decode_stream, slots, resident, mode):
    """decode_at="use" (the decode issued by the executor just before the block computes, on the
    decode stream or the compute stream): every schedule stays ordered and bit-exact, skipped
    blocks, a weight update and a state_dict() edit included. The ``overlap`` rule (no read waits for a write issued
    after the write it reads) is waived: issued at use, a block's decode is queued behind the
    previous block's decode (or compute), which were issued after its H2D -- the order the
    blocks are used in, by design."""
    case = CodedCase(slots=slots, resident=resident, mode=mode, decode_at="use", decode_stream=decode_stream)
    _exercise(case)
    _assert_clean(case, min_reads=3 * (7 - resident), waive=("overlap",))


@pytest.mark.parametrize("name", list(USE_MUTATIONS))
def test_decode_at_use_mutation_is_caught(name):
    method, line, rules, decode_stream = USE_MUTATIONS[name]
    case = CodedCase(stage_cls=mutant(DecodeStage, method, line), decode_at="use", decode_stream=decode_stream)
    broken = _broken_rules(case)
    assert rules <= broken, f"{name}: expected {sorted(rules)} broken, got {sorted(broken)}"


def test_decode_at_use_needs_the_executor_call():
    """A source whose before_use does nothing leaves the slots coded: the outputs differ."""
    line = 'if self.decode_at != "use" or self._streams is None:'
    case = CodedCase(stage_cls=mutant(DecodeStage, "before_use", line, "if True:"), decode_at="use")
    with pytest.raises(AssertionError):
        case.forward()


@pytest.mark.parametrize("name", list(CODED_MUTATIONS))
def test_coded_mutation_is_caught(name):
    method, line, rules, mode = CODED_MUTATIONS[name]
    case = CodedCase(mode=mode, stage_cls=mutant(DecodeStage, method, line))
    broken = _broken_rules(case)
    assert rules <= broken, f"{name}: expected {sorted(rules)} broken, got {sorted(broken)}"


def test_coded_unmutated_twin_is_clean():
    method, line = CODED_MUTATIONS["copy-no-wait-read"][:2]
    case = CodedCase(stage_cls=mutant(DecodeStage, method, line, line))
    for skip in SKIPS:
        case.forward(skip=skip)
    _assert_clean(case, min_reads=3 * 7)


# weight_codec="auto": raw blocks (copied straight into the slot) between coded ones
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("slots,resident", [(1, 0), (2, 1)])
@pytest.mark.parametrize("decode_at,decode_stream", [("load", True), ("load", False), ("use", True), ("use", False)])
def test_mixed_raw_and_coded_blocks_are_ordered(decode_at, decode_stream, slots, resident, mode):
    case = CodedCase(slots=slots, resident=resident, mode=mode, decode_at=decode_at, decode_stream=decode_stream,
                     coded=(0, 2, 3))
    assert case.wrapped._streamed.source.raw.count(False) == 3
    _exercise(case)
    _assert_clean(case, min_reads=3 * (7 - resident), waive=("overlap",) if decode_at == "use" else ())


RAW_MUTATIONS = {
    # nobody waits for the slot's release before a raw block's copy into it (the source claims it does)
    "raw-no-wait-free": (CodedSource, "waits_for_free_of", "return not self.images.raw[k]", "return True", "use"),
    # the copy does not wait for the decode a skipped coded block left running into the same slot
    "raw-no-wait-decode": (DecodeStage, "before_raw", "cs.wait_stream(self._dstream)", "pass", "load"),
}


@pytest.mark.parametrize("name", list(RAW_MUTATIONS))
def test_raw_load_mutation_is_caught(name):
    cls, method, line, replacement, decode_at = RAW_MUTATIONS[name]
    kind = "stage_cls" if cls is DecodeStage else "source_cls"
    case = CodedCase(**{kind: mutant(cls, method, line, replacement)}, decode_at=decode_at, coded=(0, 2, 3))
    assert "no_concurrent_write" in _broken_rules(case)


@pytest.mark.parametrize("mode", list(MODES))
def test_background_coding_switch_is_ordered(mode):
    """Blocks coded in the background and stored at step starts (the slots loaded raw re-copied
    coded): every step bit-exact and ordered, skipped blocks included."""
    import time  # noqa: PLC0415

    case = CodedCase(slots=2, mode=mode, coded=())
    src = case.wrapped._streamed.source
    case.forward()
    src.code_blocks(range(len(src.raw)), "exp-k", background=True)
    t0 = time.monotonic()
    for i in range(400):
        case.forward(skip=SKIPS[i % len(SKIPS)])
        if src.images._coding is None:
            break
        assert time.monotonic() - t0 < 60
        time.sleep(0.01)
    assert not any(src.raw)
    for skip in SKIPS[:4]:
        case.forward(skip=skip)
    _assert_clean(case, min_reads=3 * 7)
