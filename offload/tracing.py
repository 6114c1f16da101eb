"""``not_traced``: keep a function out of torch.compile graphs, lazily.

``torch.compiler.disable`` imports ``torch._dynamo`` (about 1 s) at decoration
time; applied at import it made ``import weightstream`` cost that much. This
decorator builds the disabled function at its first call instead.
"""
from __future__ import annotations

import functools

import torch


def not_traced(fn):
    """``torch.compiler.disable(fn)``, built when ``fn`` is first called."""
    disabled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return wrapper
