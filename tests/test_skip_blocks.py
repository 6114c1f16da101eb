"""Blocks skipped by design: SD3 skip-layer guidance (``skip_layers`` of
SD3Transformer2DModel.forward) streams bit-exact under every schedule.

The executor counts a skipped block's position as computed without reading
(its slot-free event, its follow-up load); a step whose last blocks are skipped
is finished at the next forward's start, without the re-priming of an
interrupted step. Orderings are checked in tests/test_happens_before.py
(``test_skipped_blocks_are_ordered``); here: outputs against the resident model.
"""
from __future__ import annotations

import copy
import warnings

import pytest

from isolated import run_in_process
import torch

from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import sd3_inputs, tiny_sd3

DEV = torch.device("cpu")
LAYERS = 5
# first, two in the middle, the last, the last two, none; mixed with plain calls
CALLS = [None, [0], [1, 2], None, [4], [3, 4], [0, 4], None, [4], [0], [2], None]


def _sd3():
    model = tiny_sd3(num_layers=LAYERS)
    return model, copy.deepcopy(model), sd3_inputs(model)


def _run(wrapped, ref, x, calls=CALLS):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # an interrupted-step warning ("re-priming") fails the test
        for skip in calls:
            kw = dict(x) if skip is None else {**x, "skip_layers": skip}
            out, want = wrapped(**kw)[0], ref(**kw)[0]
            assert torch.equal(out, want), (skip, float((out - want).abs().max()))


def test_skip_layers_change_the_output():
    """The cases below are not trivially equal: every skip set changes the result."""
    model, _, x = _sd3()
    with torch.no_grad():
        plain = model(**x)[0]
        for skip in {tuple(c) for c in CALLS if c}:
            assert not torch.equal(model(**x, skip_layers=list(skip))[0], plain), skip


@pytest.mark.parametrize("resident", [0, 1, 2])
@pytest.mark.parametrize("num_slots", [2, 3, 4])
def test_sd3_skip_layers_bit_exact(num_slots, resident):
    model, ref, x = _sd3()
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(num_slots=num_slots, resident_layers=resident,
                                                                  progress=False), device=DEV)
    _run(wrapped, ref, x)
    n = LAYERS - resident
    assert wrapped.executor.position % n == 0  # the last call ran every block: at a step boundary


@pytest.mark.parametrize("mode", ["step_local", "defer_last"])
@pytest.mark.parametrize("num_slots", [2, 3])
def test_sd3_skip_layers_graph_schedules_bit_exact(mode, num_slots):
    """The CUDA-graph schedules (step-start loads, a deferred boundary load) run
    eagerly on the CPU with the same skipping."""
    from weightstream.offload.schedule import Schedule
    from weightstream.offload.build import streamed_blocks
    from weightstream.offload.streamed import StreamedBlocks

    class Sched(StreamedBlocks):
        def _schedule(self, num_blocks, resident):
            return Schedule(num_blocks, resident, num_slots, **{mode: True})

    model, ref, x = _sd3()
    resident = 1 if mode == "step_local" else 0
    cfg = OffloadConfig.layerwise(resident_layers=resident, progress=False)
    wrapped = OffloadedTransformer(model, cfg, device=DEV, streamed=streamed_blocks(model, cfg, DEV, None, cls=Sched))
    _run(wrapped, ref, x)


def test_sd3_skip_layers_dlo_world_of_one():
    """The DLO AllGather executor over the fake world-of-1 group of
    test_happens_before: a skipped tail is not a failed step."""
    from test_happens_before import _traced, fake_dlo
    from weightstream.offload.streams import RecordingStreams
    from weightstream.offload.streamed import StreamedBlocks

    model, ref, x = _sd3()
    cfg = OffloadConfig.layerwise(progress=False)
    streamed = fake_dlo(model, cfg, _traced(StreamedBlocks, RecordingStreams(), 2, "ring"))
    wrapped = OffloadedTransformer(model, cfg, device=DEV, streamed=streamed)
    _run(wrapped, ref, x)
    assert wrapped.executor.failure is None


def test_interrupted_step_still_reprimes():
    """An exception inside a block (a block left bound) is an interrupted step,
    not a skip: the next forward re-primes with the warning, and stays exact."""
    model, ref, x = _sd3()
    wrapped = OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device=DEV)
    attn = model.transformer_blocks[2].attn
    h = attn.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(KeyError("boom")))
    with torch.no_grad(), pytest.raises(KeyError):
        wrapped(**x)
    h.remove()
    with torch.no_grad(), pytest.warns(UserWarning, match="re-priming"):
        assert torch.equal(wrapped(**x)[0], ref(**x)[0])
    _run(wrapped, ref, x)


def test_block_called_outside_the_forward_is_still_out_of_order():
    model, _, _ = _sd3()
    OffloadedTransformer(model, OffloadConfig.layerwise(progress=False), device=DEV)
    blk = model.transformer_blocks[2]
    with pytest.raises(RuntimeError, match=r"'transformer_blocks.2' ran out of order.*skip_layers"):
        blk(torch.randn(1, 16, 16), torch.randn(1, 6, 16), torch.randn(1, 16))


# ----------------------------------------------------------------- GPU: CUDA graphs
def case_graphs_skip_layers():
    """cuda_graphs='on': skip_layers is part of the signature, so each skip set
    gets graphs of its own; every call equals the resident model bit for bit."""
    model = tiny_sd3(num_layers=LAYERS, dtype=torch.bfloat16)
    ref = copy.deepcopy(model).cuda()
    x = sd3_inputs(model, device="cuda")
    w = OffloadedTransformer(model, OffloadConfig.layerwise(cuda_graphs="on", weight_codec="none", progress=False),
                             device="cuda")
    calls = [None, [1, 2], None, [0], [1, 2], [4], None, [1, 2], [0], None] * 3
    with torch.no_grad():
        for skip in calls:
            kw = dict(x) if skip is None else {**x, "skip_layers": skip}
            out, want = w(**kw)[0], ref(**kw)[0]
            assert torch.equal(out, want), (skip, float((out.float() - want.float()).abs().max()))
    c = w.graphs.counts
    assert c["replay"] >= 10 and c["capture"] >= 3, c  # plain, [1, 2] and [0] (skipped head) replay
    print("counts", c)


@pytest.mark.gpu
def test_graphs_skip_layers_gpu():
    run_in_process("test_skip_blocks", "case_graphs_skip_layers()")
