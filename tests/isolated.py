"""A test body run in a fresh interpreter (CUDA graph captures, process-wide CUDA state): one
helper for every test file that needs it."""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_in_process(module: str, call: str, *, timeout: float = 300, what: str | None = None) -> subprocess.CompletedProcess:
    """Run ``<module>.<call>`` (``module``: a test module beside this file; ``call``: an expression
    on it, such as ``case("flux", 2)``) in a fresh interpreter and assert it exited 0, showing the
    ends of its output otherwise. The checkout's root goes after site-packages in the child
    (:func:`weightstream.checkout.root_last`): ``python -c`` in the checkout puts it first."""
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from weightstream.checkout import root_last; root_last(); "
            f"import pathlib, {module} as t; t.{call}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{what or call} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r
