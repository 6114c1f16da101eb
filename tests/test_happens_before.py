"""Stream/event ordering of the controller, checked on the CPU.

The executors run their CUDA code path (streams, events, waits) under
:class:`RecordingStreams` with CPU tensors; :mod:`stream_trace` checks the
happens-before order of the recorded stream operations. Outputs are compared
with the resident model too, but they cannot see an ordering mistake (CPU
copies are synchronous): the mutation tests below apply real one-line
mutations of the controller (the method's source with one line replaced,
compiled into a subclass) and show that the outputs still match while the
checker fails.
"""
from __future__ import annotations

import __future__
import copy
import inspect
import textwrap
import warnings

import pytest
import torch

from weightstream import OffloadConfig, OffloadedTransformer
from weightstream.models import ToyDiT, toy_inputs
from weightstream.offload.distributed import build_streamed
from weightstream.offload.dlo.topology import DLOPlan, ParallelConfig
from weightstream.offload.sources.dlo import ShardSource
from weightstream.offload.executor import LayerwiseExecutor
from weightstream.offload.ring_copies import RingCopies
from weightstream.offload.host.arena import PAGE, HostStore, copy_from_image
from weightstream.offload.host.registration import REGISTER_CHUNK
from weightstream.offload.layout import block_tensors, build_layout
from weightstream.offload.schedule import Schedule
from weightstream.offload.streams import CudaStreams, RecordingStreams, default_streams, resolve_streams
from weightstream.offload.build import streamed_blocks
from weightstream.offload.streamed import StreamedBlocks

import stream_trace
from stream_trace import RULES, check, counts

DEV = torch.device("cpu")
MODES = {"ring": {}, "step_local": {"step_local": True}, "defer_last": {"defer_last": True}}


# ----------------------------------------------------------------- building traced models
class _Done:
    def wait(self, timeout=None):
        return None


class FakeGatherSource(ShardSource):
    """AllGather source over a fake single-process group (world of 1): the
    gathered image is this rank's one shard. Everything else is the real source."""

    @staticmethod
    def gather_mode(dlo, timeout_s, device):
        return "tensor"

    def all_gather(self, out, inp, *, async_op=False):
        out.copy_(inp)
        return _Done()


def _schedule_fn(slots: int, mode: str):
    def _schedule(self, num_blocks, resident):
        return Schedule(num_blocks, resident, slots, **MODES[mode])

    return _schedule


def _traced(base, rec, slots, mode, executor_cls=None):
    attrs = {"streams": rec, "_schedule": _schedule_fn(slots, mode)}
    if executor_cls is not None:
        attrs["executor_cls"] = executor_cls
    return type(f"Traced{base.__name__}", (base,), attrs)


def fake_dlo(model, cfg, cls, source_cls=FakeGatherSource):
    """The DLO AllGather backend over the fake world-of-1 group."""
    dlo = DLOPlan("allgather", "allgather", None, 1, 0, "dp", "fake")
    return build_streamed(model, cfg, DEV, None, ParallelConfig(), dlo=dlo, cls=cls, source_cls=source_cls)


class Case:
    """A wrapped ToyDiT (7 blocks: odd; with resident blocks 6 or 4 streamed), its
    resident reference and the recording backend."""

    def __init__(self, source="host", *, slots=2, resident=0, mode="ring", executor_cls=None, tmp_path=None,
                 model_cls=ToyDiT, source_cls=FakeGatherSource):
        self.rec = RecordingStreams()
        model = model_cls()
        self.ref = copy.deepcopy(model)
        self.x = toy_inputs()
        self.expected = None
        cfg = OffloadConfig.layerwise(resident_layers=resident, record_events=True, progress=False)
        if source == "host":
            cls = _traced(StreamedBlocks, self.rec, slots, mode, executor_cls)
            streamed = streamed_blocks(model, cfg, DEV, None, cls=cls)
        elif source == "dlo":
            cls = _traced(StreamedBlocks, self.rec, slots, mode, executor_cls)
            streamed = fake_dlo(model, cfg, cls, source_cls)
        else:  # "mmap-direct" | "mmap-staging"
            streamed = self._mmap(model, cfg, source.split("-")[1], slots, mode, tmp_path)
        self.wrapped = OffloadedTransformer(streamed.module, cfg, device=DEV, streamed=streamed)
        self.executor = self.wrapped.executor

    def _mmap(self, model, cfg, copy_path, slots, mode, tmp_path):
        from safetensors.torch import save_file

        from weightstream.offload.host.checkpoint import Checkpoint, as_sources, on_meta
        from weightstream.offload.checkpoint_offload import mmap_streamed_blocks

        class MmapToy(ToyDiT):
            _supports_mmap_loading = True

        path = tmp_path / "toy.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        with on_meta():
            meta = MmapToy().eval()
        ckpt = Checkpoint(as_sources(path, meta))
        cls = _traced(StreamedBlocks, self.rec, slots, mode)
        return mmap_streamed_blocks(meta, cfg, DEV, None, ckpt, copy_path, 1, cls=cls)

    def forward(self, **extra):
        with torch.no_grad():
            if extra:
                assert torch.equal(self.wrapped(**self.x, **extra), self.ref(**self.x, **extra))
                return
            if self.expected is None:
                self.expected = self.ref(**self.x)
            assert torch.equal(self.wrapped(**self.x), self.expected)

    def interrupt(self, block: int):
        """A forward that raises inside streamed block ``block`` (after its
        parameters were bound and its read began)."""

        def boom(module, args):
            raise RuntimeError("boom")

        mod = self.executor.blocks[block].module
        handle = next(iter(mod.children())).register_forward_pre_hook(boom)
        try:
            with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
                self.wrapped(**self.x)
        finally:
            handle.remove()

    def violations(self) -> dict[str, list[str]]:
        return check(self.rec.trace)


def _assert_clean(case: Case, min_reads: int):
    c = counts(case.rec.trace)
    assert c["reads"] >= min_reads and c["writes"] >= min_reads, c
    bad = {r: v[:3] for r, v in case.violations().items() if v}
    assert not bad, bad


# ----------------------------------------------------------------- the real controller is clean
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("resident", [0, 1, 3])
@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_host_store_schedules_are_ordered(slots, resident, mode):
    """Every schedule of the host-store ring: several steps, an interrupted step
    (re-primed by the next forward), a weight update between forwards."""
    case = Case("host", slots=slots, resident=resident, mode=mode)
    n = 7 - resident
    case.forward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the re-priming warning
        case.interrupt(resident + n // 2)
        case.forward()
    case.wrapped.update_weights(case.ref.state_dict())
    case.forward()
    _assert_clean(case, min_reads=3 * n)
    assert {e["lane"] for e in case.wrapped.events()} == {"copy", "compute"}  # the CPU event log still works


class SkippingToyDiT(ToyDiT):
    """ToyDiT whose forward skips the blocks (global indices) named in ``skip``,
    as SD3's ``skip_layers`` does."""

    def forward(self, x, skip=()):
        h = self.embed(x)
        for i, b in enumerate([*self.double_blocks, *self.single_blocks]):
            if i not in skip:
                h = b(h)
        return self.head(h)


# first, middle, last, last two, first and last, none; with and without skipping in a row
SKIPS = [(), (0,), (1, 2), (6,), (5, 6), (), (0, 6), (3,), (6,), (0,), ()]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("resident", [0, 1, 3])
@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_skipped_blocks_are_ordered(slots, resident, mode):
    """Blocks skipped by design (SD3 skip_layers): the positions in between, and
    a step's skipped tail, count as computed without reading; every schedule
    stays ordered, bit-exact, and never re-primes (no warning)."""
    case = Case("host", slots=slots, resident=resident, mode=mode, model_cls=SkippingToyDiT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for skip in SKIPS:
            case.forward(skip=skip)
    n = 7 - resident
    assert case.executor.position == len(SKIPS) * n  # the last call ran every block: a step boundary
    _assert_clean(case, min_reads=3 * n)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_dlo_skipped_blocks_are_ordered(slots, mode):
    case = Case("dlo", slots=slots, mode=mode, model_cls=SkippingToyDiT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for skip in SKIPS:
            case.forward(skip=skip)
    assert case.executor.failure is None
    _assert_clean(case, min_reads=3 * 7)


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_dlo_allgather_ring_is_ordered(slots):
    case = Case("dlo", slots=slots)
    for _ in range(3):
        case.forward()
    _assert_clean(case, min_reads=3 * 7)
    shards = [s for s in stream_trace.accesses(case.rec.trace).reads if isinstance(s, tuple)]
    assert shards, "the gathers note their reads of the shard slots"
    lanes = [e["lane"] for e in case.wrapped.events()]
    assert lanes.count("gather") == lanes.count("copy") > 0, "every load logs its copy and its gather"


def gloo_trace_rank(rank: int, world: int) -> dict:
    """One rank of a real gloo group: DLO AllGather traced over three forwards."""
    from weightstream.offload.dlo.topology import plan_dlo

    rec = RecordingStreams()
    model = ToyDiT()
    ref = copy.deepcopy(model)
    x = toy_inputs(seed=1 + rank)
    cfg = OffloadConfig.layerwise(weight_transfer="allgather", progress=False)
    par = ParallelConfig.data_parallel()
    cls = _traced(StreamedBlocks, rec, 2, "ring")
    streamed = build_streamed(model, cfg, DEV, None, par, dlo=plan_dlo(cfg, par, DEV), cls=cls)
    wrapped = OffloadedTransformer(model, cfg, device=DEV, streamed=streamed)
    with torch.no_grad():
        expected = ref(**x)
        equal = [torch.equal(wrapped(**x), expected) for _ in range(3)]
    return {"equal": equal, "world": wrapped.stats()["shard_group_size"], "counts": counts(rec.trace),
            "violations": {r: v[:3] for r, v in check(rec.trace).items() if v}}


def test_dlo_allgather_gloo_world_of_two_is_ordered(tmp_path):
    from test_distributed import run_ranks

    for rep in run_ranks(2, tmp_path, "test_happens_before:gloo_trace_rank"):
        assert rep["equal"] == [True] * 3 and rep["world"] == 2
        assert rep["counts"]["reads"] >= 3 * 7 and rep["violations"] == {}, rep


@pytest.mark.parametrize("mode", ["ring", "defer_last"])
@pytest.mark.parametrize("copy_path", ["direct", "staging"])
@pytest.mark.parametrize("slots", [2, 3])
def test_mmap_source_is_ordered(copy_path, slots, mode, tmp_path):
    case = Case(f"mmap-{copy_path}", slots=slots, mode=mode, tmp_path=tmp_path)
    assert case.wrapped.stats()["blocks_streamed"] == 7
    for _ in range(3):
        case.forward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case.interrupt(2)
        case.forward()
    _assert_clean(case, min_reads=3 * 7)
    case.wrapped.disable()


# ----------------------------------------------------------------- the checker itself
def _trace(build):
    rec = RecordingStreams()
    build(rec, rec.new_stream(), rec.new_event())
    return rec.trace


def test_checker_sees_a_write_racing_a_read():
    def build(rec, side, ev):
        with rec.stream(side):
            rec.access("write", 0, "a")
            ev.record(side)
        rec.compute.wait_event(ev)
        rec.access("read_begin", 0, "a")
        with rec.stream(side):
            rec.access("write", 0, "b")  # no wait for the read's end
        rec.access("read_end", 0, "a")

    v = check(_trace(build))
    assert v["no_concurrent_write"] and v["write_after_previous_read"]
    assert not v["read_after_load"] and not v["reads_expected_block"]


def test_checker_event_wait_uses_the_latest_record_before_it():
    """A wait sees the record issued last before it, not a later one; an event
    never recorded orders nothing."""

    def build(rec, side, ev):
        never = rec.new_event()
        rec.compute.wait_event(never)
        with rec.stream(side):
            rec.access("write", 0, "a")
        rec.compute.wait_event(ev)  # ev is recorded only below
        ev.record(side)
        rec.access("read_begin", 0, "a")
        rec.access("read_end", 0, "a")

    v = check(_trace(build))
    assert v["read_after_load"] and v["reads_expected_block"]


def test_checker_host_sync_and_wait_stream_order_work():
    def build(rec, side, ev):
        with rec.stream(side):
            rec.access("write", 0, "a")
        side.synchronize()  # the host waits: everything issued later is ordered after
        rec.access("read_begin", 0, "a")
        rec.access("read_end", 0, "a")
        side.wait_stream(rec.compute)
        with rec.stream(side):
            rec.access("write", 0, "b")
        ev.record(side)
        rec.compute.wait_event(ev)
        rec.access("read_begin", 0, "b")
        rec.access("read_end", 0, "b")

    assert not any(check(_trace(build)).values())


def test_checker_sees_two_unordered_writes_before_a_read():
    def build(rec, side, ev):
        other = rec.new_stream()
        with rec.stream(side):
            rec.access("write", 0, "a")
            ev.record(side)
        with rec.stream(other):
            rec.access("write", 0, "a")
        rec.compute.wait_stream(other)
        rec.compute.wait_event(ev)
        rec.access("read_begin", 0, "a")
        rec.access("read_end", 0, "a")

    v = check(_trace(build))
    assert v["reads_expected_block"] and not v["read_after_load"]


def test_recording_backend_validates():
    rec = RecordingStreams()
    with pytest.raises(ValueError, match="access\\(kind='copy'\\) is not allowed; choose from: write"):
        rec.access("copy", 0, 0)
    with pytest.raises(TypeError, match="expected a RecStream"):
        rec.compute.wait_stream(object())
    with pytest.raises(TypeError, match="expected a RecEvent"):
        rec.compute.wait_event(object())
    assert default_streams(torch.device("cpu")) is None
    cuda = CudaStreams()
    assert cuda.new_event is torch.cuda.Event and cuda.stream is torch.cuda.stream
    assert cuda.access("write", 0, 0) is None


def test_streams_must_match_the_device():
    with pytest.raises(ValueError, match="streams=RecordingStreams.* not allowed on device='cuda:0'; allowed: CudaStreams"):
        resolve_streams(RecordingStreams(), torch.device("cuda", 0))
    with pytest.raises(ValueError, match="streams=CudaStreams.* not allowed on device='cpu'; allowed: RecordingStreams"):
        resolve_streams(CudaStreams(), DEV)
    rec = RecordingStreams()
    assert resolve_streams(rec, DEV) is rec and resolve_streams(None, DEV) is None


@pytest.mark.gpu
@pytest.mark.parametrize("num_slots, resident", [(2, 0), (3, 1), (4, 3)])
def test_cuda_backend_is_a_pass_through(num_slots, resident):
    """On CUDA the executor gets CudaStreams by default: its streams and events
    are torch's own objects, and the streamed outputs stay bit-exact."""
    from layerwise_cases import check_equal_outputs

    wrapped, _, _ = check_equal_outputs("toy", "cuda", num_slots=num_slots, resident_layers=resident)
    ex = wrapped.executor
    assert isinstance(ex.streams, CudaStreams)
    cp = ex.copies
    assert isinstance(cp.copy_stream, torch.cuda.Stream) and cp.copy_stream != torch.cuda.current_stream()
    assert all(isinstance(e, torch.cuda.Event) for e in cp.loaded + cp.freed)
    assert ex.side_streams() == [cp.copy_stream]


# ----------------------------------------------------------------- mutations of the real code
def mutant(cls, method: str, line: str, replacement: str = "pass"):
    """A subclass of ``cls`` whose ``method`` is the real one with ``line``
    (which must occur exactly once) replaced: a one-line mutation of our code."""
    fn = getattr(cls, method)
    src = textwrap.dedent(inspect.getsource(fn))
    if src.count(line) != 1:
        raise AssertionError(f"{cls.__name__}.{method} has {src.count(line)} copies of {line!r}; update the mutation")
    code = compile(src.replace(line, replacement), f"<mutant of {fn.__qualname__}>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    ns: dict = {}
    exec(code, fn.__globals__, ns)
    return type(f"Mutant{cls.__name__}", (cls,), {method: ns[method]})


MUTATIONS = {
    # compute does not wait for its block's copy
    "no-wait-loaded": (RingCopies, "wait_loaded", "stream.wait_event(self.loaded[slot])",
                       {"read_after_load", "reads_expected_block", "no_concurrent_write"}, "host", "ring", 0),
    # the copy issued on the compute stream
    "copy-on-compute": (RingCopies, "_issue_load", ("with self.streams.stream(cs):", "if True:"), {"overlap"},
                        "host", "ring", 0),
    # the slot-free event never recorded
    "no-freed-record": (LayerwiseExecutor, "_after_block", "self.copies.freed[slot].record(self._compute_stream)",
                        {"write_after_previous_read", "no_concurrent_write"}, "host", "ring", 0),
    # the copy does not wait for the slot to be free
    "copy-no-wait-freed": (RingCopies, "_issue_load", "cs.wait_event(after)",
                           {"write_after_previous_read", "no_concurrent_write"}, "host", "ring", 0),
    # step-start loads not ordered after the previous step's compute
    "step-start-no-wait": (RingCopies, "step_start", "side.wait_stream(compute)",
                           {"write_after_previous_read", "no_concurrent_write"}, "host", "step_local", 3),
    # the deferred boundary load not ordered after the step start
    "late-no-wait": (RingCopies, "issue_late", "side.wait_event(ev)",
                     {"write_after_previous_read", "no_concurrent_write"}, "host", "defer_last", 0),
    # the DLO gather does not wait for the block slot to be free
    "dlo-gather-no-wait-freed": (FakeGatherSource, "load",
                                 "comm.wait_event(after)",
                                 {"write_after_previous_read", "no_concurrent_write"}, "dlo", "ring", 0),
    # the DLO shard copy does not wait for the gather that last read the shard slot
    "dlo-shard-no-wait-read": (FakeGatherSource, "load",
                               "cs.wait_event(self.shard_read[slot])",
                               {"no_concurrent_write"}, "dlo", "ring", 0),
    # the DLO gather does not wait for its shard's copy
    "dlo-gather-no-wait-shard": (FakeGatherSource, "load", "comm.wait_event(self.shard_loaded[slot])",
                                 {"read_after_load"}, "dlo", "ring", 0),
}


def _mutated_case(cls, source, resident, mode, mutated) -> Case:
    if issubclass(cls, ShardSource):
        return Case(source, slots=2, resident=resident, mode=mode, source_cls=mutated)
    if issubclass(cls, RingCopies):  # the executor composes its copies from copies_cls
        mutated = type("MutantCopiesExecutor", (LayerwiseExecutor,), {"copies_cls": mutated})
    return Case(source, slots=2, resident=resident, mode=mode, executor_cls=mutated)


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(name):
    """Each mutation keeps the CPU outputs bit-exact (no output test can see it)
    and breaks the rules it is listed with."""
    cls, method, line, rules, source, mode, resident = MUTATIONS[name]
    line, replacement = line if isinstance(line, tuple) else (line, "pass")
    case = _mutated_case(cls, source, resident, mode, mutant(cls, method, line, replacement))
    for _ in range(3):
        case.forward()  # outputs still equal the resident model's
    v = case.violations()
    broken = {r for r in RULES if v[r]}
    assert rules <= broken, f"{name}: expected {sorted(rules)} broken, got {sorted(broken)}"


@pytest.mark.parametrize("name", ["copy-on-compute", "dlo-gather-no-wait-freed"])
def test_unmutated_twin_is_clean(name):
    """The same case with the line left in (``mutant`` with an identical
    replacement) passes: the failures above come from the one line."""
    cls, method, line, rules, source, mode, resident = MUTATIONS[name]
    line = line[0] if isinstance(line, tuple) else line
    case = _mutated_case(cls, source, resident, mode, mutant(cls, method, line, line))
    for _ in range(3):
        case.forward()
    _assert_clean(case, min_reads=3 * (7 - resident))


# ----------------------------------------------------------------- copies and host images
class _CopyLog(torch.overrides.TorchFunctionMode):
    """Records every ``Tensor.copy_`` as (destination, source) while active."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.copies.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


def _crosses(start: int, length: int, chunk: int) -> bool:
    return start // chunk != (start + length - 1) // chunk


@pytest.mark.parametrize("offset, n", [
    (0, 100), (0, REGISTER_CHUNK), (0, REGISTER_CHUNK + 1), (5, REGISTER_CHUNK),
    (REGISTER_CHUNK - 7, 7), (REGISTER_CHUNK - 7, 8), (REGISTER_CHUNK + 3, 2 * REGISTER_CHUNK + 11),
])
def test_copy_from_image_never_crosses_a_registration_chunk(offset, n):
    """Real REGISTER_CHUNK (1 GiB) on meta tensors (no memory): every copy's
    (source offset, length) stays inside one chunk of the image, the pieces
    tile the destination in order, and no more pieces are used than chunks touched."""
    image = torch.empty(4 * REGISTER_CHUNK, dtype=torch.uint8, device="meta")
    dst = torch.empty(n, dtype=torch.uint8, device="meta")
    log = _CopyLog()
    with log:
        copy_from_image(dst, image, offset)
    pieces = [(s.storage_offset() - image.storage_offset(), d.storage_offset(), s.numel()) for d, s in log.copies]
    assert [p for p in pieces if _crosses(p[0], p[2], REGISTER_CHUNK)] == []
    assert [(src - offset, ln) for src, _, ln in pieces] == [(d, ln) for _, d, ln in pieces]
    assert [d for _, d, _ in pieces] == [sum(p[2] for p in pieces[:i]) for i in range(len(pieces))]
    assert sum(p[2] for p in pieces) == n
    assert len(pieces) == (offset + n - 1) // REGISTER_CHUNK - offset // REGISTER_CHUNK + 1


def _arena_copies(log: _CopyLog, store: HostStore) -> list[tuple[int, int, int]]:
    """(block, offset in its image, length) of every copy read from the store's arena."""
    base = store.arena.untyped_storage().data_ptr()
    out = []
    for _, src in log.copies:
        if src.untyped_storage().data_ptr() != base:
            continue
        s = src.storage_offset()
        k = max(i for i, off in enumerate(store.offsets) if off <= s)
        out.append((k, s - store.offsets[k], src.numel()))
    return out


def _share_copies(log: _CopyLog, shares) -> list[tuple[int, int, int]]:
    """(block, offset in its share, length) of every copy read from a DLO share (one mapping each)."""
    bases = {shares.image(k).untyped_storage().data_ptr(): k for k in range(len(shares.layouts))}
    return [(bases[src.untyped_storage().data_ptr()], src.storage_offset(), src.numel())
            for _, src in log.copies if src.untyped_storage().data_ptr() in bases]


@pytest.mark.parametrize("source", ["host", "dlo"])
def test_block_loads_split_at_registration_chunks(source, monkeypatch):
    """Each block load from the host arena (executor and DLO shard copies) is
    cut where the block's registrations meet (chunks counted from the image
    start), checked on the copies themselves, not on outputs."""
    from weightstream.offload.host import arena

    chunk = 1000  # a tiny chunk (not a multiple of 512) so the toy blocks span several
    monkeypatch.setattr(arena, "REGISTER_CHUNK", chunk)
    case = Case(source, slots=2)
    log = _CopyLog()
    with log:
        case.forward()
        case.forward()
    store = case.wrapped._streamed.source.store
    copies = _share_copies(log, store) if source == "dlo" else _arena_copies(log, store)  # DLO: the shares
    assert len({k for k, _, _ in copies}) == 7 and any(ln == chunk for _, _, ln in copies)
    assert [c for c in copies if _crosses(c[1], c[2], chunk)] == []


def test_block_images_are_page_aligned():
    """Every block image starts on a page boundary (registrations are whole pages
    from the image start) and images do not overlap."""
    model = ToyDiT()
    blocks = [b for c in (model.double_blocks, model.single_blocks) for b in c]
    layouts = [build_layout(i, f"b{i}", block_tensors(b)) for i, b in enumerate(blocks)]
    assert any(lay.nbytes % PAGE for lay in layouts), "some image size must not be a page multiple"
    store = HostStore(layouts, pin=False)
    try:
        for i, lay in enumerate(layouts):
            assert store.offsets[i] % PAGE == 0 and store.image(i).data_ptr() % PAGE == 0, (i, store.offsets[i])
            assert store.image(i).numel() == lay.nbytes
            if i:
                assert store.offsets[i - 1] + layouts[i - 1].nbytes <= store.offsets[i]
        assert store.offsets[-1] + layouts[-1].nbytes <= store.nbytes
    finally:
        store.close()


# ----------------------------------------------------------------- mmap registration
def test_mmap_blocks_copied_direct_only_from_registered_pages(tmp_path, monkeypatch):
    """A block whose checkpoint pages were only partly registered (one file's
    registration failed) must stage; every block left on the direct path reads
    only registered pages. The CUDA registration call is replaced by a stand-in
    that accepts the first file's pages and refuses the second's."""
    from safetensors.torch import save_file

    from weightstream.offload.host import checkpoint as ms
    from weightstream.offload.checkpoint_offload import mmap_streamed_blocks
    from weightstream.offload.host import copy_plans
    from weightstream.offload.host import registration

    class MmapToy(ToyDiT):
        _supports_mmap_loading = True

    sd = {k: v.contiguous() for k, v in ToyDiT().state_dict().items()}
    keys = sorted(sd)
    second = {k for k in keys if k.startswith("single_blocks.3") or k.startswith("single_blocks.4")}
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    save_file({k: sd[k] for k in keys if k not in second}, str(files[0]))
    save_file({k: sd[k] for k in keys if k in second}, str(files[1]))
    with ms.on_meta():
        meta = MmapToy().eval()
    ckpt = ms.Checkpoint(ms.as_sources([str(f) for f in files], meta))
    cfg = OffloadConfig.layerwise()
    sb = mmap_streamed_blocks(meta, cfg, DEV, None, ckpt, "direct", 1)
    store = sb.executor.source
    b_base = ckpt.files[1].base
    b_end = b_base + ckpt.files[1].u8.numel()
    accepted: list[tuple[int, int]] = []

    def register(ptr, size, flags=0):  # stand-in for cudaHostRegister: file b's pages are refused
        if ptr < b_end and ptr + size > b_base:
            return "refused"
        accepted.append((ptr, ptr + size))
        return None

    monkeypatch.setattr(registration, "_cuda_register", register)  # the one caller of cudaHostRegister
    try:
        with pytest.warns(UserWarning, match="stage"):
            store.pages.register([p for p in store.plans if p.direct], cfg)
        assert store.staged_blocks and store.direct_blocks, (store.staged_blocks, store.direct_blocks)
        bases = [f.base for f in ckpt.files]
        for p in store.plans:
            if p.direct:
                pages = copy_plans._pages(p.ranges(), bases, PAGE)
                assert all(any(a <= s and e <= b for a, b in accepted) for _, s, e in pages), p.name
    finally:
        store.pages._reg.ptrs.clear()  # nothing was really registered: nothing to unregister
        store.pages._reg.bytes = 0
        sb.restore()
        ckpt.close()


@pytest.mark.parametrize("line, rules", [
    # a skipped position issues no load: a later block reads a slot nobody filled for it
    ("self._issue(nxt)", {"reads_expected_block"}),
])
def test_skip_mutation_is_caught(line, rules):
    """A one-line mutation of the skipping path breaks the rules listed; the real
    code is clean above. (Leaving out the skipped position's slot-free record
    orders nothing differently outside a capture, where the previous record still
    stands; inside a CUDA graph it keeps the next load's wait inside the capture.)"""
    case = Case("host", slots=2, model_cls=SkippingToyDiT,
                executor_cls=mutant(LayerwiseExecutor, "_skip_position", line))
    for skip in SKIPS:
        try:
            case.forward(skip=skip)
        except AssertionError:
            pass  # a missing load may also show in the outputs; the checker must see it regardless
    v = case.violations()
    assert rules <= {r for r in RULES if v[r]}, {r: v[r][:1] for r in RULES}
