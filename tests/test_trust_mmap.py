"""Trust items of the mmap source on the CPU: a changed checkpoint file is a named
error (never mixed weights, never SIGBUS), atomic replacement keeps the old mapping,
the ring is reloaded from the mapping after an interrupted step, and a block whose
pages are only partly registered stages."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from weightstream import OffloadConfig
from weightstream.models import ToyDiT, toy_inputs
from weightstream.offload.host.arena import PAGE
from weightstream.offload.host.checkpoint import CheckpointChangedError, on_meta
from weightstream.offload.host.registration import direct_after_registration, plan_registration
from weightstream.offload.checkpoint_offload import offload_from_safetensors

DEV = "cpu"
OLD_NS = 1_000_000_000 * 1_600_000_000  # 2020: any later write changes the mtime, however coarse its clock


class _ToyMmap(ToyDiT):
    _supports_mmap_loading = True
    boom_at = None  # raise before this block (index over all blocks), boom_times times
    boom_times = 0
    before_block = None  # (index, callable): called before that block runs
    sync_at = None  # a host sync before this block (cannot be captured in a CUDA graph)

    def forward(self, x):
        h = self.embed(x)
        for i, b in enumerate(list(self.double_blocks) + list(self.single_blocks)):
            if self.before_block is not None and self.before_block[0] == i:
                self.before_block[1]()
            if self.sync_at == i and h.sum().item() > 1e30:
                h = h * 2
            if self.boom_at == i and self.boom_times > 0:
                self.boom_times -= 1
                raise RuntimeError("boom")
            h = b(h)
        return self.head(h)


class _Mixed(_ToyMmap):
    """One block stages (a Python transform), the others copy directly."""

    def __init__(self):
        super().__init__()
        self.single_blocks[2].up.weight.mmap_weight_transform = lambda t: t.clone()


def _meta(cls=None):
    with on_meta():
        return (cls or _ToyMmap)().eval()


def _write(seed, path):
    model = ToyDiT(seed=seed).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    os.utime(path, ns=(OLD_NS, OLD_NS))
    return model


def _pair(tmp_path):
    """(path of checkpoint A, path of checkpoint B: same size, other weights, A, B)."""
    a = _write(0, tmp_path / "toy.safetensors")
    b = _write(7, tmp_path / "other.safetensors")
    assert os.path.getsize(tmp_path / "toy.safetensors") == os.path.getsize(tmp_path / "other.safetensors")
    return tmp_path / "toy.safetensors", tmp_path / "other.safetensors", a, b


def _source(wrapped):
    """The wrapper's weight source (an MmapSource)."""
    return wrapped.executor.source


def _quiet(wrapped):
    """Wait until the packer thread (staging) has packed ahead and reads nothing."""
    st = _source(wrapped).stager
    if st is not None:
        assert st.wait_idle(timeout=30), "the packer thread did not go idle"


def _wrap(path, copy_path, device=DEV, **cfg):
    """copy_path 'mixed': direct copies, but one block stages."""
    meta = _meta(_Mixed if copy_path == "mixed" else None)
    copy_path = "direct" if copy_path == "mixed" else copy_path
    return offload_from_safetensors(meta, path, OffloadConfig.layerwise(**cfg), device=device, copy_path=copy_path)


# ----------------------------------------------------------------- changed file


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
def test_overwrite_in_place_between_forwards_is_an_error(copy_path, tmp_path):
    path, other, a, b = _pair(tmp_path)
    x = toy_inputs()
    with torch.no_grad():
        want_a, want_b = a(**x), b(**x)
        wrapped = _wrap(path, copy_path)
        assert torch.equal(wrapped(**x), want_a)
        _quiet(wrapped)
        shutil.copyfile(other, path)  # what `cp other toy.safetensors` does: same inode, truncate, rewrite
        for _ in range(2):  # never a result: not mixed, not B, and it stays an error
            with pytest.raises(CheckpointChangedError) as e:
                wrapped(**x)
            msg = str(e.value)
            assert str(path) in msg and "atomically" in msg and "rename" in msg, msg
        with pytest.raises(CheckpointChangedError):
            wrapped.state_dict()
        with pytest.raises(CheckpointChangedError):
            wrapped.disable()
    assert not torch.equal(want_a, want_b)  # the test can tell the checkpoints apart


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
def test_atomic_replace_keeps_the_old_mapping(copy_path, tmp_path):
    path, other, a, b = _pair(tmp_path)
    x = toy_inputs()
    with torch.no_grad():
        want_a, want_b = a(**x), b(**x)
        wrapped = _wrap(path, copy_path)
        assert torch.equal(wrapped(**x), want_a)
        tmp = tmp_path / "toy.safetensors.tmp"
        shutil.copyfile(other, tmp)
        os.replace(tmp, path)  # the documented way: write elsewhere, then rename over the old path
        # this process keeps streaming the file it mapped, whole and consistent
        for _ in range(3):
            assert torch.equal(wrapped(**x), want_a)
        sd = wrapped.state_dict()
        for k, v in a.state_dict().items():
            assert torch.equal(sd[k], v), k
        # a new wrapper maps the new file
        fresh = _wrap(path, copy_path)
        assert torch.equal(fresh(**x), want_b) and not torch.equal(want_a, want_b)
        plain = wrapped.disable()
        assert torch.equal(plain(**x), want_a)


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
def test_in_place_rewrite_with_the_mtime_put_back_is_an_error(copy_path, tmp_path):
    """Same inode, same size, the old mtime put back (``os.utime``, ``cp -p``): only the ctime
    tells, and it is part of the identity the step start checks."""
    path, other, a, _ = _pair(tmp_path)
    x = toy_inputs()
    with torch.no_grad():
        wrapped = _wrap(path, copy_path)
        assert torch.equal(wrapped(**x), a(**x))
        _quiet(wrapped)
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.write(other.read_bytes())
        os.utime(path, ns=(OLD_NS, OLD_NS))
        now = os.stat(path)
        assert (now.st_ino, now.st_size, now.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
        assert now.st_ctime_ns != before.st_ctime_ns
        for call in (lambda: wrapped(**x), wrapped.state_dict, wrapped.disable):
            with pytest.raises(CheckpointChangedError, match=r"toy.safetensors' changed .*ctime_ns .*only its ctime"):
                call()


def test_change_is_found_between_setup_and_the_first_forward(tmp_path):
    path, other, a, _ = _pair(tmp_path)
    wrapped = _wrap(path, "direct")
    with open(path, "r+b") as f:  # same size, one byte flipped near the end (a weight byte)
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with torch.no_grad(), pytest.raises(CheckpointChangedError, match="mtime"):
        wrapped(**toy_inputs())


def test_the_packer_checks_before_it_reads(tmp_path):
    path, other, _, _ = _pair(tmp_path)
    wrapped = _wrap(path, "staging")
    with torch.no_grad():
        wrapped(**toy_inputs())
    _quiet(wrapped)
    store = _source(wrapped)
    buf = torch.empty(max(lay.nbytes for lay in store.layouts), dtype=torch.uint8)
    store.pack(0, buf)  # unchanged: packs
    shutil.copyfile(other, path)
    with pytest.raises(CheckpointChangedError, match="toy.safetensors"):
        store.pack(0, buf)


def test_a_write_during_a_step_is_found_by_the_packer(tmp_path):
    """The step-start check passed; the file is rewritten in place (same size, no
    truncation) while the step runs: the packer's check names the file."""
    path, other, _, _ = _pair(tmp_path)
    wrapped = _wrap(path, "staging")

    def rewrite():
        with open(path, "r+b") as f:
            f.write(other.read_bytes())

    x = toy_inputs()
    with torch.no_grad():
        wrapped(**x)
        wrapped.module.before_block = (1, rewrite)
        with pytest.raises(CheckpointChangedError, match="toy.safetensors") as e:
            wrapped(**x)
    assert "packing a staged block failed" not in str(e.value)


def test_reload_checks_the_file(tmp_path):
    path, other, _, _ = _pair(tmp_path)
    wrapped = _wrap(path, "direct")
    with torch.no_grad():
        wrapped(**toy_inputs())
    shutil.copyfile(other, path)
    with pytest.raises(CheckpointChangedError):
        wrapped.executor.reset()


_TRUNCATE = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {here!r})
    import test_trust_mmap as t
    from pathlib import Path
    from weightstream.offload.host.checkpoint import CheckpointChangedError
    tmp = Path({tmp!r})
    path, other, a, _ = t._pair(tmp)
    x = t.toy_inputs(device={device!r})
    with torch.no_grad():
        wrapped = t._wrap(path, {copy_path!r}, {device!r})
        assert torch.equal(wrapped(**x), a.to({device!r})(**x))
        if {device!r} == "cuda":
            torch.cuda.synchronize()
        t._quiet(wrapped)
        os.truncate(path, 64)
        for what, call in (("forward", lambda: wrapped(**x)), ("state_dict", wrapped.state_dict),
                           ("disable", wrapped.disable)):
            try:
                call()
            except CheckpointChangedError as e:
                print("NAMED", what, "size" in str(e), flush=True)
            else:
                print("NO ERROR", what, flush=True)
""")


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
def test_truncation_is_a_named_error_not_sigbus(copy_path, tmp_path, device=DEV):
    here = os.path.dirname(os.path.abspath(__file__))
    code = _TRUNCATE.format(here=here, tmp=str(tmp_path), copy_path=copy_path, device=device)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"rc={r.returncode} (-7 is SIGBUS)\n{r.stdout}\n{r.stderr[-4000:]}"
    assert r.stdout.split("\n")[:3] == ["NAMED forward True", "NAMED state_dict True", "NAMED disable True"], r.stdout


# ----------------------------------------------------------------- reload after an interrupted step


@pytest.mark.parametrize("copy_path", ["direct", "staging", "mixed"])
@pytest.mark.parametrize("boom_at", [1, 4])
def test_interrupted_step_then_reset_is_bit_exact(copy_path, boom_at, tmp_path):
    """What the graph runner does before a replay or capture after an interrupted
    eager step (and after a failed capture): ``reset()``, which must reload the
    slots of the next step from the mapping."""
    path, _, a, _ = _pair(tmp_path)
    x = toy_inputs()
    with torch.no_grad():
        want = a(**x)
        wrapped = _wrap(path, copy_path)
        if copy_path == "mixed":
            s = wrapped.stats()
            assert s["staged_blocks"] == 1 and s["direct_blocks"] == s["blocks_streamed"] - 1
        assert torch.equal(wrapped(**x), want)
        wrapped.module.boom_at, wrapped.module.boom_times = boom_at, 1
        with pytest.raises(RuntimeError, match="boom"):
            wrapped(**x)
        wrapped.executor.reset()
        outs = [wrapped(**x) for _ in range(3)]
    for i, o in enumerate(outs):
        assert torch.equal(o, want), f"step {i} after the interrupted step: max diff {(o - want).abs().max()}"


def test_reset_between_steps_reloads_with_three_slots(tmp_path):
    path, _, a, _ = _pair(tmp_path)
    x = toy_inputs()
    with torch.no_grad():
        want = a(**x)
        wrapped = _wrap(path, "staging", num_slots=3)
        for _ in range(2):
            assert torch.equal(wrapped(**x), want)
            wrapped.executor.reset()  # at a step boundary: reloads what the ring already holds
        assert torch.equal(wrapped(**x), want)


# ----------------------------------------------------------------- partly registered blocks (pure)


def test_a_partly_registered_block_stages():
    # block 0: pages [0, 4); block 1: [4, 6) and [8, 10); block 2: [10, 13)
    pages = [[(0, 0, 4 * PAGE)], [(0, 4 * PAGE, 6 * PAGE), (0, 8 * PAGE, 10 * PAGE)], [(0, 10 * PAGE, 13 * PAGE)]]
    accepted, chunks = plan_registration(pages, None, chunk=2 * PAGE)
    assert accepted == [0, 1, 2]
    assert direct_after_registration(pages, accepted, chunks) == [True, True, True]
    # registration stopped after the chunk [8, 10) failed: block 1 has one of its two ranges
    done = [c for c in chunks if c[1] < 8 * PAGE]
    assert direct_after_registration(pages, accepted, done) == [True, False, False]
    # a chunk in the middle of block 2 missing: its range is only partly covered
    done = [c for c in chunks if c[1] != 10 * PAGE]
    assert (0, 12 * PAGE, PAGE) in done
    assert direct_after_registration(pages, accepted, done) == [True, True, False]
    # a block the budget left out stages even when its pages are registered for others
    assert direct_after_registration(pages, [0, 2], chunks) == [True, False, True]
    # the same page range registered under another file does not count
    other_file = [(1, s, n) for _, s, n in chunks]
    assert direct_after_registration(pages, accepted, other_file) == [False, False, False]


def test_direct_copies_name_why_a_graph_cannot_hold_them(tmp_path):
    """torch refuses, inside a capture, copies from host memory it does not count as
    pinned (registered file pages): the graph runner's precondition names it up front."""
    path, _, _, _ = _pair(tmp_path)
    wrapped = _wrap(path, "direct")
    assert "direct copies" in _source(wrapped).uncapturable()


# ----------------------------------------------------------------- handed-out tensors


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
def test_an_edit_of_a_state_dict_tensor_is_refused_by_name_not_a_crash(copy_path, tmp_path):
    """state_dict() of the raw mmap source hands out views of a copy-on-write mapping of the file:
    an in-place edit lands in a private page (it killed the process with SIGSEGV on the read-only
    mapping), and the next step or state_dict() raises StreamedWriteError, drops the edit and
    streams on from the file, bit-exact."""
    from weightstream.offload.misuse import StreamedWriteError  # noqa: PLC0415

    path, _, a, _ = _pair(tmp_path)
    x = toy_inputs()
    with torch.no_grad():
        want = a(**x)
        wrapped = _wrap(path, copy_path, resident_layers=0, weight_codec="none")
        key = next(k for k in wrapped.state_dict() if k.startswith("double_blocks.0."))
        for then in ("forward", "state_dict"):
            wrapped.state_dict()[key].mul_(2)
            with pytest.raises(StreamedWriteError, match="edited in place.*read-only checkpoint mapping"):
                wrapped(**x) if then == "forward" else wrapped.state_dict()
            assert torch.equal(wrapped(**x), want)
            assert torch.equal(wrapped.state_dict()[key], a.state_dict()[key])
        assert torch.equal(wrapped.disable()(**x), want)


def test_a_failed_pack_on_the_packer_thread_fails_one_step_then_streams_on(tmp_path):
    """A transient failure of the staging packer (a read error) fails the forward that needed the
    block, named; the packer starts again and every later step is bit-exact (it was sticky: every
    later forward raised the same error)."""
    from weightstream.offload.host.staging import StagingError  # noqa: PLC0415

    path, _, a, _ = _pair(tmp_path)
    x = toy_inputs()
    with torch.no_grad():
        want = a(**x)
        wrapped = _wrap(path, "staging", resident_layers=0, weight_codec="none")
        stager = _source(wrapped).stager
        pack, calls = stager._pack, []

        def failing(*args):
            calls.append(1)
            if len(calls) == 7:
                raise OSError("injected: a transient read error")
            return pack(*args)

        stager._pack = failing
        results = []
        for _ in range(5):
            try:
                results.append(torch.equal(wrapped(**x), want))
            except StagingError as e:
                assert "injected" in str(e) and "the next one packs again" in str(e)
                results.append("error")
        assert results.count("error") == 1 and all(r is True for r in results if r != "error"), results
