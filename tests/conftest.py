"""Shared pytest set-up.

Triton kernels run under the interpreter on machines without a GPU; the
variable must be set before triton is first imported, so it is set here.
"""
import os
import sys


def _share_cores_between_workers() -> None:
    """Under pytest-xdist (``make test``: -n 2) each worker gets its share of the cores as
    intra-op threads: N workers with all the cores each oversubscribe the machine, and the
    many small CPU ops of the suite then take about twice as long (measured on 2 cores). Set
    through OMP_NUM_THREADS before torch loads, so that every thread of a test computes with
    the same count (torch.set_num_threads holds for the calling thread only, and a test that
    compares a second thread's output with the main thread's would differ in the last bit).
    OMP_NUM_THREADS, when set, wins; tests that set the thread count restore it themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ and "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))


_share_cores_between_workers()

# the checkout's root after site-packages (python -m pytest puts it first): its kernels/ folder is
# weightstream.kernels, and must not shadow the PyPI `kernels` that transformers imports
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from weightstream.checkout import root_last  # noqa: E402

root_last()


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error elsewhere
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402, F401  (now, under that setting: tests that set TRITON_INTERPRET=0 for a while to
# run decode_torch instead would otherwise leave triton imported with it -- diffusers imports triton --
# and the interpreter of later tests fails: "Cannot call @triton.jit'd outside of the scope of a kernel")


def pytest_runtest_setup(item):
    """`gpu` / `multigpu` tests are deselected by `make test`'s -m filter; selected
    explicitly on a machine without the hardware they fail, never pass or skip."""
    if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
        pytest.fail(f"{item.nodeid} needs >= 2 CUDA GPUs; torch sees {torch.cuda.device_count()}", pytrace=False)
    elif "gpu" in item.keywords and not torch.cuda.is_available():
        pytest.fail(f"{item.nodeid} needs a CUDA GPU; torch.cuda.is_available() is False", pytrace=False)
