"""Errors that say what went wrong (issue 34): every numeric config key's bounds, byte counts
in messages, host allocations that fail, and raw Python errors of bad config input.

CPU only, except the few `gpu` tests at the end (cudaHostRegister, pinned allocation).
Host allocations are tested with sizes no machine maps (2**62 bytes, past the user address
space of any x86-64 or arm64 kernel, and past ssize_t): they fail at once, never touch memory.
"""
import datetime
import logging
import mmap
import sys
import warnings

import pytest
import torch

import weightstream
from weightstream import HostMemoryError, OffloadConfig, OffloadMisuseError
from weightstream.models import ToyDiT
from weightstream.offload.config import ConfigTypeError
from weightstream.offload.config_schema import MAX_BUDGET_GB, MAX_INT, MAX_TIMEOUT_S, MIN_BUDGET_GB, MIN_TIMEOUT_S
from weightstream.offload.discovery import discover_blocks
from weightstream.offload.host.registration import _cuda_register, _cuda_unregister, empty_host, map_anonymous
from weightstream.offload.host.arena import HostStore
from weightstream.offload.layout import block_tensors, build_layout
from weightstream.offload.progress import Progress, format_bytes

HUGE = 2**62  # bytes: more than any address space maps, less than sys.maxsize

# ------------------------------------------------------------- numeric config keys
BUDGETS = ("pinned_memory_budget_gb", "device_memory_budget_gb")
NAN, INF = float("nan"), float("inf")


def _config(path: str, value):
    if path.startswith("layer_options.dit."):
        return OffloadConfig.layerwise(layer_options={"dit": {path.rsplit(".", 1)[1]: value}})
    return OffloadConfig.layerwise(**{path: value})


# (key path, value) for every numeric key: non-finite, overflowing, bools, out of range
NUMERIC_REJECTIONS = (
    [(k, v) for k in BUDGETS for v in (INF, -INF, NAN, 1e308, 10**400, 9.3e9, True, False, 0, -1, 1e-10, 5e-324)]
    + [("dlo_timeout_s", v) for v in (INF, NAN, 1e308, 10**400, 1e10, True, 0, -1, 1e-4, 5e-324)]
    + [("num_slots", v) for v in (2**63, 10**400, True, 1, 0, -1, 2.0, INF, NAN)]
    + [("layer_options.dit.resident_layers", v) for v in (2**63, 10**400, True, -1, INF, NAN, 1.0)]
    + [("layer_options.dit.resident_layers", [1, v]) for v in (2**63, -1, True, NAN)]
)


def test_every_numeric_key_rejects_non_finite_overflowing_bool_and_out_of_range_values():
    """One test over the class (a value passing validation and overflowing later, e.g.
    int(1e308 * 1e9) or math.isfinite(10**400), was the bug); each rejection is a
    ValueError naming the key and the value, with what is allowed."""
    wrong = []
    for path, value in NUMERIC_REJECTIONS:
        try:
            _config(path, value)
        except ValueError as e:
            msg, named = str(e), repr(value)[:30]
            if isinstance(value, list) and msg.startswith(f"{path}[1]="):  # the element is named
                named = repr(value[1])
            if "is not allowed" not in msg or not msg.startswith(path) or named not in msg:
                wrong.append(f"{path}={value!r}: unclear message {msg!r}")
            items = value if isinstance(value, list) else [value]
            if any(isinstance(x, bool) for x in items) and not isinstance(e, ConfigTypeError):
                wrong.append(f"{path}={value!r}: a bool is a wrong type, got {type(e).__name__}")
        except Exception as e:  # noqa: BLE001 - the point: no raw error
            wrong.append(f"{path}={value!r}: raw {type(e).__name__}: {e}")
        else:
            wrong.append(f"{path}={value!r}: accepted")
    assert not wrong, "\n".join(wrong)


def test_numeric_bounds_are_what_the_code_computes():
    """The extremes allowed fit what is computed from them: an int64 of bytes, a timedelta
    and int64 milliseconds; the smallest budget is one byte, not zero."""
    top = OffloadConfig.layerwise(pinned_memory_budget_gb=MAX_BUDGET_GB, device_memory_budget_gb=MAX_BUDGET_GB,
                                  dlo_timeout_s=MAX_TIMEOUT_S, num_slots=MAX_INT)
    for n in (top.pinned_memory_budget_bytes, top.device_memory_budget_bytes):
        assert n <= MAX_INT and torch.tensor(n, dtype=torch.int64).item() == n
    assert datetime.timedelta(seconds=MAX_TIMEOUT_S) // datetime.timedelta(milliseconds=1) <= MAX_INT
    low = OffloadConfig.layerwise(pinned_memory_budget_gb=MIN_BUDGET_GB, dlo_timeout_s=MIN_TIMEOUT_S)
    assert low.pinned_memory_budget_bytes == 1 and low.device_memory_budget_bytes is None
    assert datetime.timedelta(seconds=MIN_TIMEOUT_S) // datetime.timedelta(milliseconds=1) == 1
    assert OffloadConfig.layerwise(pinned_memory_budget_gb=2.5).pinned_memory_budget_bytes == 2_500_000_000
    assert OffloadConfig.layerwise(device_memory_budget_gb=10**9).device_memory_budget_gb == 1e9  # an int, exactly


@pytest.mark.parametrize("key", BUDGETS)
def test_budget_messages_say_the_unit_of_the_key(key):
    """The keys are GB (1e9 bytes); the rejection said GiB."""
    for value in (-1, "8"):
        with pytest.raises(ValueError) as info:
            OffloadConfig.layerwise(**{key: value})
        assert "GiB" not in str(info.value) and "GB (1e9 bytes)" in str(info.value), str(info.value)


# ------------------------------------------------------------------ byte counts
@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (812, "812 B"), (999, "999 B"), (1000, "1.00 KB"), (812_000, "812 KB"), (999_499, "999 KB"),
    (999_500, "1.00 MB"), (3_410_000, "3.41 MB"), (12_400_000_000, "12.4 GB"), (99_950_000_000, "100 GB"),
    (4_096, "4.10 KB"), (2**62, "4.61 EB"), (-5_000_000, "-5.00 MB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_host_store_repr_and_progress_lines_show_small_sizes():
    """A sub-MB store printed as "0.000 GB"; progress lines as "0.00 GB"."""
    model = ToyDiT()
    blocks = discover_blocks(model, None)
    layouts = [build_layout(b.index, b.name, block_tensors(b.module)) for b in blocks]
    store = HostStore(layouts, pin=False)
    assert store.nbytes < 10**6
    assert repr(store) == f"HostStore({len(layouts)} blocks, {format_bytes(store.nbytes)}, pinned 0 B)"
    store.close()

    log = logging.getLogger("weightstream")
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        bar = Progress("packing", 1500, True, min_bytes=0)
        bar.update(1500)
        bar.close()
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    lines = [r.getMessage() for r in records]
    assert lines and all("GB" not in s for s in lines) and any("1.50 KB" in s for s in lines), lines


# ------------------------------------------------------------ host allocations
def _huge_layouts(sizes):
    """Layouts of blocks of ``sizes`` bytes (meta tensors: nothing is allocated)."""
    return [build_layout(i, f"blocks.{i}", [("weight", "parameter", torch.empty(n, dtype=torch.uint8, device="meta"))])
            for i, n in enumerate(sizes)]


def _check_host_memory_error(e: BaseException, nbytes: int, what: str) -> None:
    assert isinstance(e, HostMemoryError) and isinstance(e, MemoryError) and isinstance(e, OffloadMisuseError)
    msg = str(e)
    for part in (what, format_bytes(nbytes), f"({nbytes} bytes)", "already holds", "resident_layers",
                 "weight_codec", "pinned_memory_budget_gb", "smaller model"):
        assert part in msg, f"{part!r} missing from {msg!r}"


@pytest.mark.parametrize("sizes", [[HUGE], [HUGE, HUGE]], ids=["enomem", "over-ssize_t"])
def test_host_store_arena_that_cannot_be_mapped_is_a_named_error(sizes):
    """mmap's bare ENOMEM (or OverflowError past ssize_t) said no size; the error names the
    bytes, what the process holds and what to do."""
    assert sum(sizes) > mmap.PAGESIZE and (len(sizes) == 1) == (sum(sizes) <= sys.maxsize)
    with pytest.raises(HostMemoryError) as info:
        HostStore(_huge_layouts(sizes), pin=False)
    _check_host_memory_error(info.value, sum(sizes), f"the host store of {len(sizes)} blocks")


def test_host_buffer_helpers_name_the_failure():
    with pytest.raises(HostMemoryError) as info:
        map_anonymous(HUGE, "a test arena")
    _check_host_memory_error(info.value, HUGE, "a test arena")
    with pytest.raises(HostMemoryError) as info:
        empty_host(HUGE, "a test buffer")  # torch's CPU allocator: RuntimeError, at once
    _check_host_memory_error(info.value, HUGE, "a test buffer (pageable)")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert empty_host(16, "a small buffer").shape == (16,)
    assert weightstream.HostMemoryError is HostMemoryError and "HostMemoryError" in weightstream.__all__


# ------------------------------------------------------ raw errors of bad config input
def test_compat_components_of_a_wrong_type_are_named():
    """enable_cpu_offload sorted the components first: TypeError "'<' not supported"."""
    with pytest.raises(ConfigTypeError, match=r"components\[1\]=1 is not allowed; expected a component name"):
        OffloadConfig(enable_cpu_offload=True, components=["dit", 1])


@pytest.mark.parametrize("build,parts", [
    (lambda: OffloadConfig.layerwise(num_slot=3), ["OffloadConfig.layerwise()", "'num_slot'", "num_slots"]),
    (lambda: OffloadConfig.layerwise(pin_cpu_memory=False), ["'pin_cpu_memory'", "write pin_memory instead"]),
    (lambda: OffloadConfig.layerwise(mode="module"), ["OffloadConfig.layerwise()", "mode='module'", "sets mode"]),
    (lambda: OffloadConfig.module(mode="layer"), ["OffloadConfig.module()", "mode='layer'", "sets mode"]),
    (lambda: OffloadConfig.layerwise().replace(slots=3), ["OffloadConfig.replace()", "'slots'", "num_slots"]),
], ids=["layerwise-unknown", "layerwise-legacy", "layerwise-mode", "module-mode", "replace-unknown"])
def test_constructor_keywords_are_named(build, parts):
    """Python's own "__init__() got an unexpected keyword argument" named no allowed key."""
    with pytest.raises(ConfigTypeError) as info:
        build()
    msg = str(info.value)
    assert isinstance(info.value, TypeError) and "is not allowed" in msg
    for part in parts:
        assert part in msg, f"{part!r} missing from {msg!r}"


@pytest.mark.parametrize("s,cause", [
    ('{"mode": "layer", "components": ["dit"], "num_slots": 1' + "0" * 5000 + "}", "ValueError"),
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
    (b"\xff\xfe\x00", "UnicodeDecodeError"),
], ids=["int-over-4300-digits", "deep-nesting", "bad-utf"])
def test_json_that_python_cannot_read_is_named(s, cause):
    """json.loads' ValueError (int digits), RecursionError and UnicodeDecodeError escaped
    unnamed (only JSONDecodeError was caught); the message is short however long the input."""
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_json(s)
    msg = str(info.value)
    assert msg.startswith("OffloadConfig=") and "expected a JSON object" in msg and cause in msg, msg
    assert len(msg) < 1000


# ------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_cuda_register_failure_names_size_and_error():
    """cudaHostRegister's failure was "returned CUDA error 712": no size, no meaning."""
    torch.cuda.init()
    m = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
    assert _cuda_register(base, 1 << 16) is None
    try:
        err = _cuda_register(base, 1 << 16)  # registered twice: cudaErrorHostMemoryAlreadyRegistered
    finally:
        _cuda_unregister(base)
    assert err is not None and format_bytes(1 << 16) in err and "712" in err, err
    assert err.split("(")[-1].strip(")").strip() and "no description" not in err, err
    # the failure is handled: it is not left as the runtime's last error for torch's next kernel
    # launch to raise (it once surfaced as a later test's GELU failing with "already mapped")
    assert float(torch.ones(4, device="cuda").mul(2).sum()) == 8.0


@pytest.mark.gpu
def test_pinned_allocation_failure_is_a_named_error():
    torch.cuda.init()
    with pytest.raises(HostMemoryError) as info:
        empty_host(HUGE, "a pinned test buffer", pin=True)
    _check_host_memory_error(info.value, HUGE, "a pinned test buffer (pinned)")


@pytest.mark.gpu
def test_pin_budget_warning_shows_small_sizes():
    """The budget warning printed a 1-byte budget as "0.00 GB"."""
    model = ToyDiT()
    blocks = discover_blocks(model, None)
    layouts = [build_layout(b.index, b.name, block_tensors(b.module)) for b in blocks]
    store = HostStore(layouts, pin=True, budget_bytes=1)
    try:
        with pytest.warns(UserWarning) as warned:
            store.pin(0)
    finally:
        store.close()
    msg = str(warned[0].message)
    assert "budget of 1 B reached" in msg and "0.00 GB" not in msg, msg
