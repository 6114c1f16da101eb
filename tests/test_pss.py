"""Rank-local sharing: processes streaming one mmap checkpoint share its page cache.

Two processes stream the same ~200 MB checkpoint through the mmap source
(CPU device, two-buffer staging) while two others load private copies
(ordinary loading: safetensors.load_file + load_state_dict) and run the
resident model. The proportional set size (PSS, /proc/<pid>/smaps_rollup)
each process gained from loading to serving is summed per pair: the mmap
pair's pages of the checkpoint are shared (each process is charged half),
only the staging buffers and slots are private.
"""
import os
import selectors
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

BLOCKS, WIDTH, HIDDEN = 40, 1024, 1280  # 40 x 5.2 MB fp32 = 210 MB

CHILD = textwrap.dedent(
    f"""
    import sys
    import torch
    from torch import nn

    class Net(nn.Module):
        _supports_mmap_loading = True
        _layerwise_offload_blocks_attrs = ["blocks"]

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear({WIDTH}, {HIDDEN}, bias=False) for _ in range({BLOCKS}))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)[..., :{WIDTH}]
            return x

    mode, path = sys.argv[1], sys.argv[2]
    from safetensors.torch import load_file  # both modes import the same modules
    from weightstream.offload.checkpoint_offload import offload_from_safetensors
    from weightstream.offload.host.checkpoint import on_meta
    torch.set_num_threads(1)
    print("imported", flush=True)
    sys.stdin.readline()
    x = torch.ones(1, 4, {WIDTH}) * 1e-3
    with torch.no_grad():
        if mode == "mmap":
            with on_meta():
                net = Net()
            net = offload_from_safetensors(net, path, device="cpu")
        else:
            net = Net()
            net.load_state_dict(load_file(path))
        for _ in range(2):
            y = net(x)
    print("ready", float(y.sum()), flush=True)
    sys.stdin.readline()
    """
)


def pss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss line for pid {pid}")


def _expect(proc, word: str, timeout: float = 120.0) -> str:
    """The child's next stdout line, which must start with ``word``, within ``timeout``."""
    t0 = time.monotonic()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            proc.kill()
            raise AssertionError(f"child said nothing within {timeout:.0f} s (waiting for {word!r})")
    finally:
        sel.close()
    line = proc.stdout.readline()
    if not line.startswith(word):
        proc.wait(timeout=30)
        proc.err_file.seek(0)
        raise AssertionError(
            f"child said {line!r} instead of {word!r} after {time.monotonic() - t0:.1f} s: {proc.err_file.read()[-4000:]}"
        )
    return line


def growth(modes: list[str], script: Path, ckpt: Path) -> tuple[list[int], list[int], list[str]]:
    """(PSS after import, PSS when serving, outputs) in kB of concurrent processes, one per mode."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    for mode in modes:  # stderr to a file: a child writing much to an unread pipe would block
        err = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen([sys.executable, str(script), mode, str(ckpt)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        p.err_file = err
        procs.append(p)
    try:
        for p in procs:
            _expect(p, "imported")
        before = [pss_kb(p.pid) for p in procs]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [_expect(p, "ready").split()[1] for p in procs]
        after = [pss_kb(p.pid) for p in procs]
        for p in procs:
            p.stdin.write("exit\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.err_file.close()
    return before, after, outs


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc/<pid>/smaps_rollup")
def test_mmap_processes_share_the_checkpoint_pages(tmp_path):
    torch.manual_seed(0)
    ckpt = tmp_path / "net.safetensors"
    save_file({f"blocks.{i}.weight": torch.randn(HIDDEN, WIDTH) * 0.01 for i in range(BLOCKS)}, str(ckpt))
    size_kb = ckpt.stat().st_size // 1024
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    # all four at once (the private ones never keep the file mapped, so the mmap
    # pair alone shares its pages); shared libraries are split four ways for all
    before, after, outs = growth(["mmap", "mmap", "private", "private"], script, ckpt)
    mb, ma, pb, pa = before[:2], after[:2], before[2:], after[2:]
    assert len(set(outs)) == 1  # same model, same output
    mmap_growth = sum(a - b for a, b in zip(ma, mb))
    private_growth = sum(a - b for a, b in zip(pa, pb))
    report = (f"checkpoint {size_kb / 1024:.0f} MB; PSS growth of 2 processes: mmap {mmap_growth / 1024:.0f} MB "
              f"(totals {sum(ma) / 1024:.0f} MB), private {private_growth / 1024:.0f} MB "
              f"(totals {sum(pa) / 1024:.0f} MB)")
    print(report)
    # private copies cost about one checkpoint per process; the shared mapping about one in all
    assert private_growth > 1.8 * size_kb, report
    assert mmap_growth < 0.75 * private_growth, report
    assert sum(ma) < sum(pa), report
