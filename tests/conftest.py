"""Shared pytest set-up.

Triton kernels run under the interpreter on machines without a GPU; the
variable must be set before triton is first imported, so it is set here.
"""
import os


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


def pytest_collection_modifyitems(config, items):
    """`gpu` / `multigpu` tests are deselected by `make test`'s -m filter; if
    they are selected explicitly on a machine without the hardware they fail
    loudly instead of silently skipping."""
    for item in items:
        if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(pytest.mark.xfail(reason="needs >= 2 CUDA GPUs", run=False, strict=True))
        elif "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.xfail(reason="needs a CUDA GPU", run=False, strict=True))
