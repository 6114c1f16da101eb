"""Which host tensors of an mmap-source copy does torch consider pinned (a capture
refuses copies from unpinned host memory)? Prints one line per copy source kind."""
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_trust_mmap import _pair, _wrap  # noqa: E402

tmp = Path(tempfile.mkdtemp())
path, _, _, _ = _pair(tmp)
w = _wrap(path, "auto", "cuda", cuda_graphs="off")
ex = w.executor
srcs = [src for per_slot in ex._copies for pairs in per_slot for _, src in pairs] if hasattr(ex, "_copies") else []
print("direct copy sources:", len(srcs), "pinned:", sorted({bool(s.is_pinned()) for s in srcs}))
if srcs:
    s = srcs[0]
    err = torch.cuda.cudart().cudaPointerGetAttributes if hasattr(torch.cuda.cudart(), "cudaPointerGetAttributes") else None
    print("first source ptr", hex(s.data_ptr()), "numel", s.numel(), "register_flags", w.stats().get("register_flags"))
g = torch.cuda.CUDAGraph()
dst = torch.empty(srcs[0].numel(), dtype=torch.uint8, device="cuda") if srcs else None
if srcs:
    try:
        with torch.cuda.graph(g):
            dst.copy_(srcs[0], non_blocking=True)
        print("capture of one direct copy: ok")
    except Exception as e:
        print("capture of one direct copy failed:", type(e).__name__, str(e)[:200])
