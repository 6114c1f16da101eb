"""One support matrix, one pure ``select(config, topology, checkpoint)``.

Every front end (the wrapper and the in-place handle, DLO, the mmap source, module
offload) asks :func:`select` which transport streams its weights, with which codec,
residency and graph mode. The answer is a :class:`Selection`, or the refusal of the
cell from :data:`SUPPORT`: an :class:`~..misuse.UnsupportedCombinationError` naming
the key, the value, the cell, why, and what to use instead. The config's own
validation asks the same table (:func:`check_config_cells`) for the cells it can
decide alone, so a refused cell fails when the config is built.

The planned default (``resident_layers`` / ``weight_codec`` not given, ``OffloadConfig.unset_keys``)
is resolved here, per transport and device (:func:`resolve_default`): each key not given
becomes "auto" where its cell is supported and the device has memory to plan in, else today's
value (0 / "none"). An explicit value keeps its meaning; the default never refuses a config that
today's values would run.

Torch-free: reads the config's attributes only. docs/architecture.md prints the
matrix from :func:`support_table_markdown` (tests/test_matrix.py keeps them equal).
"""
from __future__ import annotations

import dataclasses
import itertools
import types

from ..codecs import AUTO, NONE, WEIGHT_CODECS
from ..misuse import UnsupportedCombinationError

TRANSPORTS = ("pinned", "mmap", "dlo-allgather", "dlo-rank-local", "module")
LAYER_TRANSPORTS = TRANSPORTS[:4]
RESIDENCIES = ("none", "fixed", "auto")  # resident_layers 0 / an int > 0 or a list / "auto"
GRAPHS = ("off", "on")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where the weights go: ``world``/``rank`` of the DLO sharding group, its
    ``transfer`` ("allgather" | "rank-local"; None without DLO), the device type."""
    world: int = 1
    rank: int = 0
    transfer: str | None = None
    device_type: str = "cpu"


@dataclasses.dataclass(frozen=True)
class Selection:
    """One supported cell of :data:`SUPPORT` and what the builder needs of it."""
    transport: str  # one of TRANSPORTS
    codec: str  # a weight_codec value ("none", a codec, "auto")
    residency: str  # one of RESIDENCIES
    graphs: bool
    topology: Topology = Topology()
    planned: tuple[str, ...] = ()  # the keys the planned default set to "auto" (resolve_default)

    @property
    def cell(self) -> tuple[str, str, str, str]:
        return (self.transport, self.codec, self.residency, "on" if self.graphs else "off")

    def for_source(self, caps) -> "Selection":
        """This selection over a source with ``caps`` (its ``SourceCaps``): a codec the planned
        default chose that the source cannot apply (``codes_blocks`` False: a source factory the
        caller gave) is dropped, as before the default; an explicit "auto" stays (and is refused)."""
        if self.codec != AUTO or "weight_codec" not in self.planned or caps.codes_blocks:
            return self
        planned = tuple(k for k in self.planned if k != "weight_codec")
        return dataclasses.replace(self, codec=NONE, planned=planned)

    @property
    def coded(self) -> bool:
        """Whether the source keeps coded images (a codec, or "auto": raw until planned)."""
        return self.codec != NONE


# (config key, why, what to use instead) of each rule; the first rule that matches a cell refuses it
_RULES = (
    (lambda t, c, r, g: t == "module" and g == "on", "cuda_graphs", "on",
     "CUDA graphs need mode='layer'; with mode='module' choose from: off"),
    (lambda t, c, r, g: t == "module" and r != "none", "layer_options", None,
     "layer_options apply only to mode='layer' (got mode='module'); remove them (module offload moves whole "
     "components: leave 'dit' out of components to keep it resident)"),
    (lambda t, c, r, g: t == "dlo-allgather" and r != "none", "layer_options.dit.resident_layers", None,
     "resident layers require rank-local (layer_options.dit.weight_transfer='rank-local'), not 'allgather'; "
     "or set resident_layers to 0"),
    (lambda t, c, r, g: t == "mmap" and c == AUTO, "weight_codec", AUTO,
     "weight_codec='auto' is not allowed with the mmap source (offload_from_safetensors): it plans from the "
     "pinned raw images of OffloadedTransformer; choose from: exp-k, exp-k2, exp-kp (each with a coded sidecar), none"),
    (lambda t, c, r, g: t == "mmap" and r == "auto", "layer_options.dit.resident_layers", "auto",
     "layer_options.dit.resident_layers='auto' is not allowed for the mmap source (auto placement writes a "
     "demoted block back into its source, and the checkpoint mapping is read-only); choose from: an int >= 0, "
     "or a list of block indices"),
    (lambda t, c, r, g: t == "mmap" and c == NONE and g == "on", "cuda_graphs", "on",
     "cuda_graphs='on' cannot capture the mmap source's direct copies: torch refuses copies from the registered "
     "checkpoint pages inside a CUDA graph (they do not count as pinned), and staged copies are a host thread's; "
     "use cuda_graphs='off' with this source, weight_codec='exp-k' (coded images in pinned memory), or load the "
     "weights into memory and use OffloadedTransformer (pinned host store) for CUDA graphs"),
    (lambda t, c, r, g: r == "auto" and g == "on", "layer_options.dit.resident_layers", "auto",
     "the automatic placement re-plans between eager steps and does not run under CUDA graphs yet; with "
     "cuda_graphs='on' give an int or a list of block indices (`python -m weightstream plan` prints one)"),
)


def _refusal(cell) -> tuple[str, object, str] | None:
    for rule, key, value, why in _RULES:
        if rule(*cell):
            return key, value, why
    return None


def refusals(cell) -> list[tuple[str, object, str]]:
    """Every rule that refuses ``cell`` (SUPPORT names the first; a front end that checks before it
    knows the transport, the config's validation, may raise another of them)."""
    return [(key, value, why) for rule, key, value, why in _RULES if rule(*cell)]


# the matrix: (transport, codec, residency, graphs) -> None (supported) or (key, value, why)
SUPPORT = types.MappingProxyType({
    cell: _refusal(cell) for cell in itertools.product(TRANSPORTS, WEIGHT_CODECS, RESIDENCIES, GRAPHS)})


def _residency(resident) -> str:
    if resident == "auto":
        return "auto"
    if isinstance(resident, int):
        return "fixed" if resident > 0 else "none"
    return "fixed" if len(resident) else "none"


def _raise(cell, refusal, actual) -> None:
    raise refusal_error(cell, actual)


def refusal_error(cell, actual) -> UnsupportedCombinationError:
    """The named error of the refused ``cell`` of :data:`SUPPORT` (``actual``: the value the
    caller gave, where the rule names no single value)."""
    key, value, why = SUPPORT[cell]
    transport, codec, residency, graphs = cell
    return UnsupportedCombinationError(
        f"{key}={actual if value is None else value!r} is not allowed; {why} (support matrix cell: "
        f"transport={transport}, weight_codec={codec}, residency={residency}, cuda_graphs={graphs})")


def transport_of(config, topology: Topology, checkpoint) -> str:
    """The transport a config, topology and checkpoint ask for."""
    if config.mode == "module":
        return "module"
    if topology.transfer == "allgather":
        return "dlo-allgather"
    if topology.transfer == "rank-local":
        return "dlo-rank-local"
    return "mmap" if checkpoint is not None else "pinned"


def plans_in(config, transport: str, device_type: str) -> bool:
    """Whether the planned default plans on ``device_type`` for ``transport``: on CUDA (the free
    device memory is the budget), and on the CPU for the pinned transport when
    ``device_memory_budget_gb`` is given (the budget to plan in; without one the CPU has no device
    memory to plan in). Never in mode='module' (its "auto" codec is exp-k2, encoded at setup: a
    cost the default must not add), nor under DLO on the CPU (every rank must resolve alike)."""
    if transport == "module":
        return False
    if device_type == "cuda":
        return True
    return device_type == "cpu" and transport == "pinned" and config.device_memory_budget_gb is not None


def resolve_default(config, transport: str, device_type: str) -> tuple[tuple[str, str], tuple[str, ...]]:
    """((codec, residency), planned keys) of ``config``'s cell on ``transport`` and ``device_type``.

    A key given keeps its value. Each key not given (``config.unset_keys``) is "auto" where the
    default plans (:func:`plans_in`) and the cell with it is supported, else its value before the
    default (weight_codec "none", resident_layers 0): candidates in order both planned, the
    residency alone, the codec alone, neither. The codec stays "none" with a pinned-memory cap or
    pin_memory=False (the coded images keep no bounce buffers for the blocks left pageable). With
    no candidate supported, today's cell (its refusal is the error, as before the default)."""
    unset = config.unset_keys
    codec = NONE if "weight_codec" in unset else config.weight_codec
    residency = _residency(config.resident_layers)
    graphs = "on" if config.cuda_graphs == "on" else "off"
    if not unset or not plans_in(config, transport, device_type):
        return (codec, residency), ()
    plan_codec = "weight_codec" in unset and config.pinned_memory_budget_gb is None and config.pin_memory
    plan_res = "resident_layers" in unset
    options = [(plan_res, plan_codec), (plan_res, False), (False, plan_codec)]
    for res_on, codec_on in options:
        if not (res_on or codec_on):
            continue
        cell = (AUTO if codec_on else codec, "auto" if res_on else residency)
        if SUPPORT[(transport, *cell, graphs)] is None:
            planned = (("resident_layers",) if res_on else ()) + (("weight_codec",) if codec_on else ())
            return cell, planned
    return (codec, residency), ()


def select(config, topology: Topology = Topology(), checkpoint=None) -> Selection:
    """The :class:`Selection` for ``config`` (an OffloadConfig) over ``topology``, streaming
    from ``checkpoint`` (a mapped checkpoint; None: the weights in the module), or the
    refusal of its cell from :data:`SUPPORT`. Keys not given take the planned default
    (:func:`resolve_default`). Pure: reads attributes, touches no tensor."""
    resident = config.resident_layers
    transport = transport_of(config, topology, checkpoint)
    (codec, residency), planned = resolve_default(config, transport, topology.device_type)
    cell = (transport, codec, residency, "on" if config.cuda_graphs == "on" else "off")
    refusal = SUPPORT[cell]
    if refusal is not None:
        _raise(cell, refusal, resident)
    return Selection(cell[0], cell[1], cell[2], cell[3] == "on", topology, planned)


def check_config_cells(config) -> None:
    """At config validation: refuse the cells every transport this config can run on refuses
    (mode='module': module; weight_transfer='allgather': DLO AllGather; else any layer transport)."""
    if config.mode == "module":
        transports = ("module",)
    elif config.weight_transfer == "allgather":
        transports = ("dlo-allgather",)
    else:
        transports = LAYER_TRANSPORTS
    resident = config.resident_layers
    codec = NONE if config.weight_codec is None else config.weight_codec  # not given: today's cell (the default
    rest = (codec, _residency(resident), "on" if config.cuda_graphs == "on" else "off")  # never refuses more)
    refused = [(t, *rest) for t in transports if SUPPORT[(t, *rest)] is not None]
    if len(refused) == len(transports):
        _raise(refused[0], SUPPORT[refused[0]], resident)


def support_table_markdown() -> str:
    """The matrix as markdown (docs/architecture.md prints it): a row per transport and
    residency, a column per codec and graph mode; "yes" or the refused key."""
    cols = [(c, g) for g in GRAPHS for c in WEIGHT_CODECS]
    head = "| transport | resident layers | " + " | ".join(f"{c}, graphs {g}" for c, g in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for t in TRANSPORTS:
        for r in RESIDENCIES:
            cells = []
            for c, g in cols:
                ref = SUPPORT[(t, c, r, g)]
                cells.append("yes" if ref is None else f"no ({ref[0].rsplit('.', 1)[-1]})")
            lines.append(f"| {t} | {r} | " + " | ".join(cells) + " |")
    reasons = sorted({(ref[0], ref[2]) for ref in SUPPORT.values() if ref is not None})
    lines += ["", "Refusals (the named error is `UnsupportedCombinationError`):", ""]
    lines += [f"- `{key}`: {why}" for key, why in reasons]
    return "\n".join(lines) + "\n"


# -- quantized weights (docs/quantized.md): a second axis, the format of the model's tensors ------------
# "none": plain tensors; the rest as offload/host/quantized.py detects them
QUANTIZED_FORMATS = ("none", "layerwise-casting", "gguf", "torchao", "bitsandbytes")

_INTO_MEMORY = ("; load the model (quantized) into memory and wrap it with OffloadedTransformer (pinned host "
                "images of the quantized bytes)")
# why the mmap source cannot bind each format's tensors to a checkpoint's (GGUF can: a .gguf file maps like a
# safetensors file, and gguf_on_meta builds the GGUFLinears its quantized entries bind to; layerwise casting can:
# save_pretrained of the cast model writes its float8 tensors, which bind by dtype like any others; a checkpoint
# of another dtype is a CheckpointFormatError at binding, offload/host/binding.py; docs/checkpoints.md)
_MMAP_QUANTIZED = {
    "torchao": "torchao's tensor subclasses are made by quantize_ from weights in memory, and no checkpoint file "
               "maps to their inner tensors (qdata, scale) by key",
    "bitsandbytes": "bitsandbytes quantizes a weight when it moves to the device and keeps a quant-state object "
                    "beside it, which no checkpoint file maps to",
}
# (rule, key, why) over (format, transport); the first rule that matches refuses the pair
_QUANTIZED_RULES = tuple(
    (lambda f, t, fmt=fmt: f == fmt and t == "mmap", "checkpoint", why + _INTO_MEMORY)
    for fmt, why in _MMAP_QUANTIZED.items())

QUANTIZED_SUPPORT = types.MappingProxyType({
    (f, t): next(((key, why) for rule, key, why in _QUANTIZED_RULES if rule(f, t)), None)
    for f in QUANTIZED_FORMATS for t in TRANSPORTS})


def check_quantized(fmt: str, transport: str) -> None:
    """Raise the named refusal of a quantized ``fmt`` (one of :data:`QUANTIZED_FORMATS`) over
    ``transport`` from :data:`QUANTIZED_SUPPORT`; nothing for a supported pair."""
    refusal = QUANTIZED_SUPPORT[(fmt, transport)]
    if refusal is not None:
        key, why = refusal
        raise UnsupportedCombinationError(
            f"{key}: a {fmt} quantized model is not allowed with transport={transport}; {why} (quantized "
            f"support matrix cell: format={fmt}, transport={transport})")


def quantized_table_markdown() -> str:
    """The quantized support matrix as markdown (docs/quantized.md prints it): a row per
    quantized format, a column per transport; "yes" or the refused key."""
    lines = ["| format | " + " | ".join(TRANSPORTS) + " |", "|" + "---|" * (len(TRANSPORTS) + 1)]
    for f in QUANTIZED_FORMATS[1:]:
        cells = ["yes" if QUANTIZED_SUPPORT[(f, t)] is None else f"no ({QUANTIZED_SUPPORT[(f, t)][0]})"
                 for t in TRANSPORTS]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    reasons = sorted({ref for ref in QUANTIZED_SUPPORT.values() if ref is not None})
    lines += ["", "Refusals (the named error is `UnsupportedCombinationError`):", ""]
    lines += [f"- `{key}`: {why}" for key, why in reasons]
    return "\n".join(lines) + "\n"
