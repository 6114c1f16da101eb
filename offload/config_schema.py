"""The value schema of :class:`~.config.OffloadConfig`: what each key allows.

The choice tables, the numeric limits, vLLM-Omni's legacy flat flags, and the
per-value checks that ``OffloadConfig.__post_init__`` runs on each key alone
(the rules that tie two keys together stay in :mod:`.config`). Every check
raises a ``ValueError`` for a value that is not allowed and a
:class:`ConfigTypeError` (a ``TypeError`` and a ``ValueError``) for a wrong
Python type, naming the key as a dotted path, the value's repr and what is
allowed. Torch-free.
"""
from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Mapping
from typing import Any

MODES = ("module", "layer")
COMPONENTS = ("dit", "text_encoder", "vae")
LAYER_COMPONENTS = ("dit", "text_encoder")  # layer mode streams only these
WEIGHT_TRANSFERS = ("allgather", "rank-local")
CUDA_GRAPHS = ("off", "on")
GRAPH_BOUNDARY_LOADS = ("auto", "in-graph", "next-step")
CODEC_MODES = ("layer", "module")  # modes whose host images can be stored coded
COMPAT_COMPONENTS = ("dit", "text_encoder")  # what enable_cpu_offload=True selects
RESIDENT_AUTO = "auto"  # resident_layers="auto": the planner picks the resident set (offload/plan/placement.py)
# resident_layers / weight_codec not given (None, JSON null): the planned default (sources/select.py
# resolve_default), distinguishable from an explicit 0 / "none", which keep their meaning
UNSET = None

# numeric keys: what the code computes from them must stay representable
GB = 10**9  # the size keys are in GB (1e9 bytes), never GiB; messages say GB too
MAX_INT = 2**63 - 1  # ints, and byte counts made from sizes, must fit an int64 (torch, CUDA, C)
MIN_BUDGET_GB = 1e-9  # one byte: a smaller budget would be 0 bytes, and budgets are > 0
MAX_BUDGET_GB = MAX_INT // GB  # 9223372036 GB: int(budget * 1e9) bytes is still an int64
MIN_TIMEOUT_S = 1e-3  # collective waits take whole milliseconds, and 0 ms means "no timeout"
MAX_TIMEOUT_S = 1e9  # about 31.7 years; datetime.timedelta and int64 milliseconds both hold it

# vLLM-Omni's older flat flags (engine arguments before diffusion_offload_config).
# Mapped: the new spelling is unambiguous; a DeprecationWarning names it.
# Rejected: no exact equivalent; the message gives the new spelling to choose.
LEGACY_MAPPED = {
    "pin_cpu_memory": "pin_memory",
}
LEGACY_REJECTED = {
    "enable_layerwise_offload": "'mode': 'layer', 'components': ['dit']",
    "layerwise_num_gpu_layers": "'num_slots' (device block buffers, >= 2) and/or "
                                "'layer_options': {'dit': {'resident_layers': N}}",
    "layerwise_offload_blocks_attrs": "an OffloadPlan(block_containers=[...]) passed as plan=",
    "enable_sequential_cpu_offload": "'mode': 'module', 'components': [...]",
    "enable_model_cpu_offload": "'mode': 'module', 'components': [...]",
}


class ConfigTypeError(TypeError, ValueError):
    """A config value has the wrong Python type (also a ValueError, so callers
    that catch ValueError see every config rejection)."""


def _choices(options) -> str:
    return "choose from: " + ", ".join(options)


def closest_first(key: str, allowed) -> list[str]:
    """``allowed`` with the names closest to ``key`` first (difflib; for a typo's message)."""
    allowed = list(allowed)
    close = difflib.get_close_matches(key, allowed, n=len(allowed), cutoff=0.5)
    return close + [a for a in allowed if a not in close]


# the hint of a front end's unknown keyword: config fields are not keywords of the entry points
CONFIG_FIELDS_HINT = (" (config fields such as num_slots go in the config: OffloadConfig.layerwise(num_slots=3) "
                      "or {'mode': 'layer', 'num_slots': 3})")


def unknown_keyword(where: str, key: str, allowed, hint: str = "", tail: str = "") -> ConfigTypeError:
    """The named error for keyword ``key`` that ``where`` does not take: the allowed names, the
    closest first, and the closest one named (a TypeError, as Python's own, and a ValueError);
    ``hint`` before the names, ``tail`` after them."""
    ordered = closest_first(key, allowed)
    close = difflib.get_close_matches(key, ordered, n=1, cutoff=0.5)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigTypeError(f"{where} got unknown keyword {key!r}, which is not allowed{hint}; "
                           f"{_choices(ordered)}{guess}{tail}")


def _reject(path: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{path}={value!r} is not allowed; {allowed}")


def _wrong_type(path: str, value: Any, expected: str) -> ConfigTypeError:
    return ConfigTypeError(
        f"{path}={value!r} is not allowed; expected {expected} (got {type(value).__name__})"
    )


def _unknown_key(path: str, key: Any, allowed) -> ValueError:
    return ValueError(f"{path} has unknown key {key!r}, which is not allowed; {_choices(allowed)}")


def _check_bool(path: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _wrong_type(path, value, "a bool (true or false)")


def _check_int(path: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(path, value, f"an int >= {minimum}")
    if not minimum <= value <= MAX_INT:
        raise _reject(path, value, f"expected an int >= {minimum} (at most {MAX_INT}, an int64)")


def _check_real(path: str, value: Any, low: float, high: float, allowed: str) -> float:
    """A finite int or float in [low, high], as a float (``allowed`` says so in words). Ints
    are compared exactly: one too large for a float fails here, not as an OverflowError later."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(path, value, allowed)
    if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        raise _reject(path, value, f"expected {allowed}")
    return float(value)


def _check_timeout(path: str, value: Any) -> float:
    return _check_real(path, value, MIN_TIMEOUT_S, MAX_TIMEOUT_S,
                       f"a finite number of seconds > 0, from {MIN_TIMEOUT_S:g} (one millisecond) "
                       f"to {MAX_TIMEOUT_S:g}")


def _check_budget(path: str, value: Any) -> float | None:
    """GB (1e9 bytes): at least one byte, at most what an int64 of bytes holds; or None."""
    if value is None:
        return None
    return _check_real(path, value, MIN_BUDGET_GB, MAX_BUDGET_GB,
                       f"a finite number > 0 of GB (1e9 bytes), from {MIN_BUDGET_GB:g} (one byte) to "
                       f"{MAX_BUDGET_GB} (an int64 of bytes), or null")


_RESIDENT_ALLOWED = "an int >= 0, 'auto', a list of block indices (ints >= 0), or null (the planned default)"


def _check_resident(path: str, value: Any) -> int | str | tuple[int, ...]:
    """``resident_layers``: an int N (the first N blocks), "auto", or block indices
    (returned as a sorted tuple; ``[0, .., N-1]`` as the int N, the same set); None (``UNSET``):
    not given, the planned default."""
    if value is UNSET:
        return value
    if isinstance(value, str):
        if value != RESIDENT_AUTO:
            raise _wrong_type(path, value, _RESIDENT_ALLOWED)
        return value
    if isinstance(value, (list, tuple, frozenset, set)):
        for i, b in enumerate(value):
            if isinstance(b, bool) or not isinstance(b, int):
                raise _wrong_type(f"{path}[{i}]" if not isinstance(value, (set, frozenset)) else path, b,
                                  "a block index (an int >= 0)")
            if not 0 <= b <= MAX_INT:
                raise _reject(path, value, f"block indices are ints >= 0 (at most {MAX_INT}, an int64)")
        out = tuple(sorted(set(value)))
        if len(out) != len(value):
            raise _reject(path, value, "each block index at most once")
        return len(out) if out == tuple(range(len(out))) else out
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(path, value, _RESIDENT_ALLOWED)
    if not 0 <= value <= MAX_INT:
        raise _reject(path, value, f"expected {_RESIDENT_ALLOWED}; ints at most {MAX_INT} (an int64)")
    return value


def _keeps_resident(value: int | str | tuple[int, ...]) -> bool:
    """Whether a checked resident_layers value, given explicitly, may keep blocks resident
    (``UNSET``: no; the planned default keeps blocks resident only where the matrix allows it)."""
    return value == RESIDENT_AUTO or bool(value)


def _check_choice(path: str, value: Any, options, *, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, str):
        extra = " or null" if nullable else ""
        raise _wrong_type(path, value, f"a str{extra}; {_choices(options)}")
    if value not in options:
        raise _reject(path, value, _choices(options))


def _short_repr(s: Any, limit: int = 200) -> str:
    """``repr(s)``, cut to about ``limit`` characters (a config string may be megabytes)."""
    text = repr(s)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(s)} characters)"


def _map_legacy(d: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM-Omni's older flat flags: mapped with a DeprecationWarning where the
    new spelling is exact, else rejected with the new spelling in the message."""
    out = dict(d)
    for old, new in LEGACY_MAPPED.items():
        if old not in out:
            continue
        if new in out and out[new] != out[old]:
            raise _reject(old, out[old], f"it is the old spelling of {new!r}, which is also given "
                          f"as {out[new]!r}; give only {new!r}")
        warnings.warn(f"OffloadConfig key {old!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=4)
        out[new] = out.pop(old)
    for old, new in LEGACY_REJECTED.items():
        if old in out:
            raise _reject(old, out[old], f"it is a legacy vLLM-Omni flag; write {new} instead")
    return out
