"""``not_traced``: keep a function out of torch.compile graphs, lazily.

``torch.compiler.disable`` imports ``torch._dynamo`` (about 1 s, tens of MB) at
decoration time; applied at import it made ``import weightstream`` cost that
much. This decorator builds the disabled function only once dynamo has been
imported by someone: before that, nothing can be tracing the call, and it runs
the function as it is.
"""
from __future__ import annotations

import functools
import sys

import torch


def not_traced(fn):
    """``torch.compiler.disable(fn)``, built when ``fn`` is first called."""
    disabled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:  # no compiler loaded: no trace to keep out of
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return wrapper
