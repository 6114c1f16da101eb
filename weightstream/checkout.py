"""Running from a source checkout without its folders shadowing installed packages.

The checkout's top-level folders ``kernels/``, ``offload/`` and ``graphs/`` are this package's
subpackages on disk (``weightstream.kernels`` ...: pyproject's ``package-dir``), never top-level
modules. ``python -m ...`` and ``python -c`` started in the checkout put its root first on
``sys.path``, so a top-level ``import kernels`` would find our folder instead of the PyPI
``kernels`` package (transformers >= 5.25 imports it whenever a diffusers model loads, and fails
with ``cannot import name 'CUDAProperties' from 'kernels'``). The entry points that run from a
checkout (the CLI, ``python -m perf``, the test suite) call :func:`root_last` first: the root stays
importable (``perf``, ``weightstream``) but after the installed packages.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

__all__ = ["ROOT", "is_checkout", "root_last", "safe_path"]

ROOT = Path(__file__).resolve().parent.parent


def _is_root(entry: str) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == ROOT
    except OSError:
        return False


def is_checkout() -> bool:
    """This package runs from a source checkout (not from an installed copy in site-packages)."""
    return (ROOT / "pyproject.toml").is_file() and (ROOT / "kernels" / "__init__.py").is_file()


def root_last(path: list[str] | None = None) -> list[str]:
    """Move every entry of ``path`` (``sys.path`` by default, changed in place) that names the
    checkout's root to its end, once; returns the list."""
    path = sys.path if path is None else path
    if is_checkout() and any(_is_root(p) for p in path):
        path[:] = [p for p in path if not _is_root(p)] + [str(ROOT)]
    return path


@contextlib.contextmanager
def safe_path():
    """Python processes started inside the block do not put their working folder first on
    ``sys.path`` (``PYTHONSAFEPATH=1``, Python >= 3.11): for a multiprocessing forkserver, which
    starts as ``python -c`` in the checkout and imports its preload list (diffusers among them)
    before it learns the parent's ``sys.path``."""
    old = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = old
