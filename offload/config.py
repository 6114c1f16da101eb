"""The one configuration object of weightstream.

`OffloadConfig` accepts the vLLM-Omni ``diffusion_offload_config`` JSON schema
(``mode``, ``components``, ``layer_options``, ``pin_memory``, and the
``enable_cpu_offload=True`` compatibility entry point) plus weightstream's own
keys. It is frozen, and every check runs in ``OffloadConfig.__post_init__``: each
value alone against its schema (:mod:`.config_schema`: choice tables, limits,
legacy flags), then the rules that tie keys together (``_check_combinations``).

Errors: a value that is not allowed raises ``ValueError``; a value of the wrong
Python type raises ``ConfigTypeError``, which is both a ``TypeError`` and a
``ValueError`` (so ``except ValueError`` catches every rejection). Messages
name the key as a dotted path, the value's repr, and what is allowed, e.g.
``layer_options.dit.weight_transfer='rank_local' is not allowed; choose from:
allgather, rank-local``.
"""
from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping
from typing import Any

from .codecs import WEIGHT_CODECS  # every weight_codec value, from the codec registry
from .sources.select import check_config_cells, refusal_error
from .config_schema import (CODEC_MODES, COMPAT_COMPONENTS, COMPONENTS, CUDA_GRAPHS, GB, GRAPH_BOUNDARY_LOADS,
                            LAYER_COMPONENTS, LEGACY_MAPPED, LEGACY_REJECTED, MODES, RESIDENT_AUTO, UNSET,
                            WEIGHT_TRANSFERS, ConfigTypeError, _check_bool, _check_budget, _check_choice,
                            _check_int, _check_resident, _check_timeout, _choices, _keeps_resident, _map_legacy,
                            _reject, _short_repr, _unknown_key, _wrong_type, unknown_keyword)

__all__ = ["OffloadConfig", "LayerOptions", "ConfigTypeError"]

# resident_layers="auto" without device_memory_budget_gb, and the planned default (resident_layers
# and weight_codec not given): the weight budget is the device memory free after the first eager
# step (plus what weightstream already holds there), less this headroom in GB (1e9 bytes) for the
# allocator's fragmentation, other processes and larger later inputs (plan/measure.py auto_budget_bytes).
AUTO_DEVICE_MARGIN_GB = 2.0


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """Per-component options of layer mode (``layer_options.<component>``).

    weight_transfer: "allgather" (each rank pins 1/N of every block and
        all-gathers it on the device) or "rank-local" (full blocks, no
        collective); None lets the executor choose.
    resident_layers: dit blocks kept on the device instead of streamed (dit
        only; needs weight_transfer "rank-local" or None): an int N (the first N
        blocks; an explicit 0 streams every block), a list of block indices in
        discovery order (any subset; stored as a sorted tuple, ``[0, .., N-1]`` as
        the int N), "auto": after the first eager step of an input signature the
        planner picks the resident set and slot count under
        ``device_memory_budget_gb`` (or the free device memory less
        ``AUTO_DEVICE_MARGIN_GB``), or None (default, JSON null: not given): the
        planned default, "auto" where the support matrix and the device allow
        it, else 0 (``sources/select.py`` ``resolve_default``; docs/configuration.md).
        Indices beyond the model's blocks, or a set keeping every block, are
        rejected at setup.

    Checked when placed in an `OffloadConfig`, where errors can name the
    component (``layer_options.dit.resident_layers``).
    """

    weight_transfer: str | None = None
    resident_layers: int | str | tuple[int, ...] | None = UNSET

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON dict of the options that differ from their defaults."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


_LAYER_KEYS = tuple(f.name for f in dataclasses.fields(LayerOptions))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """How to offload a diffusion pipeline or transformer.

    vLLM-Omni ``diffusion_offload_config`` keys:

    mode: "module" (model-level: one selected component group on the device at
        a time) or "layer" (stream transformer blocks through device slots).
        Required unless ``enable_cpu_offload=True``.
    components: non-empty selection from "dit", "text_encoder", "vae" (a list
        is stored as a tuple; no duplicates). Layer mode streams only "dit" and
        "text_encoder".
    layer_options: layer mode only; component -> `LayerOptions` (or a dict
        with keys ``weight_transfer``, ``resident_layers``), one entry per
        selected component at most. Stored as a read-only mapping.
    pin_memory: pin (page-lock) host copies of offloaded weights.
    enable_cpu_offload: compatibility entry point; True means mode "module"
        over components ("dit", "text_encoder"). A contradicting mode or
        component list is rejected.

    weightstream's own keys:

    cuda_graphs: "off" | "on" (or a bool: True = "on"). "on" captures each denoising step as a CUDA
        graph and replays it (layer mode only; rejected in module mode).
    graph_boundary_loads: "auto" | "in-graph" | "next-step" (CUDA graphs
        without resident layers). Where the copy that waits for a step's last
        block runs: "in-graph" keeps it at the end of the step's graph, so the
        graph ends when it does and the copy engine idles while the next graph's
        first block computes; "next-step" issues it at the start of the next
        step's graph, overlapping that step's first block as the eager ring
        does. "auto" (default): "next-step" where it applies (cuda_graphs="on",
        resident_layers=0, no DLO), else "in-graph". Measured on one H200
        (flux-12b-1024): next-step 1.00x the eager step, in-graph 1.007x;
        wan-14b-480p 1.000x / 1.006x. "next-step" given explicitly needs
        cuda_graphs="on", resident_layers=0 and no DLO.
    num_slots: int >= 2. Device block buffers used by layer mode; more slots
        let copies run further ahead of compute at the cost of device memory.
    pinned_memory_budget_gb: number > 0 or None (no cap). Cap on pinned /
        registered host memory in GB (1e9 bytes); host weights beyond it stay pageable
        (warning about that is the caller's job). Both budgets lie in [MIN_BUDGET_GB
        (one byte), MAX_BUDGET_GB] (their byte count, ``*_budget_bytes``, is an int64).
    device_memory_budget_gb: number > 0 or None (no cap). Cap on device memory
        for weights (resident modules + slots) in GB (1e9 bytes); checked at setup.
        With resident_layers="auto" it is the planner's budget; without it the
        planner takes the free device memory less AUTO_DEVICE_MARGIN_GB (2 GB).
    record_events: the executor records a per-block copy/compute event log
        (for telemetry and the overlap dashboard).
    progress: print progress while pinning large host stores.
    debug_graph_addresses: CUDA-graph debug mode; at each replay check that
        static input addresses did not move.
    dlo_timeout_s: number > 0 in [0.001, 1e9], default 60. Distributed layerwise offload (DLO):
        bound, in seconds, of every wait on a DLO collective (setup checks,
        gathers, agreements); a failure on any rank becomes an error on every
        rank within it instead of the process group's own timeout.
    dlo_verify_weights: bool, default true. DLO: at setup compare an exact
        digest (every byte) of every streamed block and resident tensor across
        the ranks; a mismatch names the first differing tensor and the ranks.
    weight_codec: None (default: not given) | "none" | "exp-k" | "exp-k2" | "exp-kp" | "auto". None is
        the planned default: "auto" where the support matrix and the device allow it, else "none"
        (``sources/select.py`` ``resolve_default``; with resident_layers not given either, the
        residency and the coding are planned from the first step within the free device memory
        less ``AUTO_DEVICE_MARGIN_GB``, capped by ``device_memory_budget_gb``; on the CPU without
        a budget, and in mode='module', it is "none"). "none": raw images. "exp-k" stores streamed
        block images losslessly coded in host memory (16-bit weights: the exponent
        byte as k-bit table codes with escapes, the sign/mantissa byte raw;
        other dtypes raw), copies the coded bytes H2D and decodes them into the
        slot: eagerly on a decode stream beside the copies, with cuda_graphs="on"
        on the compute stream just before the block runs (offload/sources/decode.py,
        decode_placement). "exp-k2" codes the escapes again at a second level
        (about 0.69 instead of 0.71 of the bytes on Student-t bf16 weights; a
        tensor it does not shrink keeps the "exp-k" bytes). "exp-kp" stores each
        escape as a patch (its position in the tile and its symbol), applied
        after the tile: about 0.75 of the bytes, decoded ~1.45x faster than
        "exp-k" (for compute-bound models). Both work wherever "exp-k" does. With DLO AllGather
        every rank keeps 1/N of each coded image and the gather moves coded
        bytes (offload/sources/dlo.py); rank-local DLO streams full coded
        blocks per rank. In mode='module' each offloaded component's image is
        stored coded; an arrival copies the coded bytes H2D and decodes them
        into the component's device buffer (VAEs once, at setup). The mmap source
        (offload_from_safetensors) codes with "exp-k" / "exp-k2" and can keep a
        coded sidecar file. "auto" (offload/plan/auto.py) stores the streamed
        blocks raw, measures the first eager step (with cuda_graphs="on": the
        warm-up step, before any capture), then codes the blocks a plan predicts
        faster to code, with the codec predicted fastest (offload/plan/codec.py:
        a transfer-bound step codes every block, a compute-bound one none);
        printed, in stats()["codec_plan"]; eager, the blocks are coded in the
        background while steps stream them raw, and a new input signature is
        planned again (adding coded blocks only). Host memory stays that
        of the raw images. In mode='module' "auto" is "exp-k2" (an arrival is a
        bare transfer). With rank-local DLO each rank plans its own stream; with
        DLO AllGather the ranks plan together (the slowest rank's measurements,
        the same plan everywhere) after the first step every rank completed, and
        code the chosen blocks at once (offload/plan/coding.py). With
        resident_layers="auto" the residency is planned first, then the codec for the
        blocks that still stream. Not with the mmap source.

    Errors: ValueError for values that are not allowed, `ConfigTypeError`
    (a TypeError and a ValueError) for wrong Python types; each message names
    the key, the value's repr, and what is allowed.
    """

    mode: str | None = None
    components: tuple[str, ...] = ()
    layer_options: Mapping[str, LayerOptions] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )
    pin_memory: bool = True
    enable_cpu_offload: bool = False
    # weightstream's own keys
    cuda_graphs: str = "off"
    graph_boundary_loads: str = "auto"
    num_slots: int = 2
    pinned_memory_budget_gb: float | None = None
    device_memory_budget_gb: float | None = None
    record_events: bool = False
    progress: bool = True
    debug_graph_addresses: bool = False
    dlo_timeout_s: float = 60.0
    dlo_verify_weights: bool = True
    weight_codec: str | None = UNSET

    # ------------------------------------------------------------------ checks
    def __post_init__(self) -> None:
        for name in ("pin_memory", "enable_cpu_offload", "record_events", "progress",
                     "debug_graph_addresses", "dlo_verify_weights"):
            _check_bool(name, getattr(self, name))
        mode, components = self._check_mode_components()
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "components", components)
        object.__setattr__(self, "layer_options", self._check_layer_options())
        if isinstance(self.cuda_graphs, bool):  # JSON true/false
            object.__setattr__(self, "cuda_graphs", "on" if self.cuda_graphs else "off")
        _check_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPHS)
        _check_choice("graph_boundary_loads", self.graph_boundary_loads, GRAPH_BOUNDARY_LOADS)
        _check_choice("weight_codec", self.weight_codec, WEIGHT_CODECS, nullable=True)
        _check_int("num_slots", self.num_slots, 2)
        for name in ("pinned_memory_budget_gb", "device_memory_budget_gb"):
            object.__setattr__(self, name, _check_budget(name, getattr(self, name)))
        object.__setattr__(self, "dlo_timeout_s", _check_timeout("dlo_timeout_s", self.dlo_timeout_s))
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Every rule that ties two keys together, in one place (each value alone
        was checked above)."""
        check_config_cells(self)  # the support matrix (sources/select.py SUPPORT)
        if self.graph_boundary_loads == "next-step":
            if self.cuda_graphs != "on":
                raise _reject("graph_boundary_loads", "next-step",
                              "it only changes CUDA-graph captures; set cuda_graphs='on' or choose: in-graph")
            if _keeps_resident(self.resident_layers):
                raise _reject("graph_boundary_loads", "next-step",
                              f"with resident_layers={self.resident_layers!r} every boundary load already "
                              "starts with its step (behind the resident blocks); choose: in-graph")
        if self.weight_codec not in (UNSET, "none"):
            self._check_codec()
        for comp, opts in self.layer_options.items():
            path = f"layer_options.{comp}"
            if _keeps_resident(opts.resident_layers) and comp != "dit":
                raise _reject(f"{path}.resident_layers", opts.resident_layers,
                              "resident layers apply only to dit; expected 0 here")

    def _check_codec(self) -> None:
        """weight_codec codes host images: streamed blocks in layer mode (DLO included:
        AllGather gathers coded shards, rank-local streams full coded blocks) and whole
        components in module mode (sources that cannot code refuse it themselves)."""
        if self.mode not in CODEC_MODES:
            raise _reject("weight_codec", self.weight_codec,
                          f"coded weights need mode in {list(CODEC_MODES)} (got mode={self.mode!r}); "
                          "choose from: none")

    def _check_mode_components(self) -> tuple[str, tuple[str, ...]]:
        mode, components = self.mode, self.components
        if isinstance(components, str) or not isinstance(components, (list, tuple)):
            raise _wrong_type("components", components,
                              f"a list of component names; {_choices(COMPONENTS)}")
        components = tuple(components)
        for i, comp in enumerate(components):  # before any sort or lookup of them
            if not isinstance(comp, str):
                raise _wrong_type(f"components[{i}]", comp, f"a component name; {_choices(COMPONENTS)}")
        if self.enable_cpu_offload:
            if mode not in (None, "module"):
                raise _reject("mode", mode, "enable_cpu_offload=True maps to mode='module'; "
                              "choose from: module (or leave mode unset)")
            if components and sorted(components) != sorted(COMPAT_COMPONENTS):
                raise _reject("components", components,
                              "enable_cpu_offload=True maps to components "
                              f"{list(COMPAT_COMPONENTS)}; give exactly those or leave unset")
            mode, components = "module", components or COMPAT_COMPONENTS
        if mode is None:
            raise _reject("mode", mode, f"mode is required ({_choices(MODES)}) "
                          "unless enable_cpu_offload=True")
        _check_choice("mode", mode, MODES)
        if not components:
            raise _reject("components", components,
                          f"select at least one component; {_choices(COMPONENTS)}")
        allowed = COMPONENTS if mode == "module" else LAYER_COMPONENTS
        for i, comp in enumerate(components):
            path = f"components[{i}]"
            if comp not in COMPONENTS:
                raise _reject(path, comp, _choices(COMPONENTS))
            if comp not in allowed:
                raise _reject(path, comp, f"mode={mode!r} streams only dit and text_encoder "
                              f"(use mode='module' for {comp}); {_choices(allowed)}")
            if comp in components[:i]:
                raise _reject("components", components,
                              f"duplicate {comp!r}; list each component at most once")
        return mode, components

    def _check_layer_options(self) -> Mapping[str, LayerOptions]:
        raw = self.layer_options
        if not isinstance(raw, Mapping):
            raise _wrong_type("layer_options", raw,
                              "a dict of component -> {weight_transfer, resident_layers}")
        if raw and self.mode != "layer":
            raise refusal_error(("module", "none", "fixed", "off"), dict(raw))  # the support matrix
        out: dict[str, LayerOptions] = {}
        for comp, opts in raw.items():
            if comp not in COMPONENTS:
                raise _unknown_key("layer_options", comp, self.components)
            if comp not in self.components:
                raise ValueError(
                    f"layer_options has key {comp!r}, which is not allowed: {comp!r} is not in "
                    f"components={list(self.components)}; {_choices(self.components)}")
            out[comp] = self._check_layer_entry(comp, opts)
        return types.MappingProxyType(out)

    @staticmethod
    def _check_layer_entry(comp: str, opts: Any) -> LayerOptions:
        path = f"layer_options.{comp}"
        if isinstance(opts, Mapping):
            for key in opts:
                if key not in _LAYER_KEYS:
                    raise _unknown_key(path, key, _LAYER_KEYS)
            opts = LayerOptions(**opts)
        elif not isinstance(opts, LayerOptions):
            raise _wrong_type(path, opts, "a dict with keys weight_transfer, resident_layers "
                              "or a LayerOptions")
        _check_choice(f"{path}.weight_transfer", opts.weight_transfer, WEIGHT_TRANSFERS,
                      nullable=True)
        resident = _check_resident(f"{path}.resident_layers", opts.resident_layers)
        return dataclasses.replace(opts, resident_layers=resident)

    # ------------------------------------------------------------ constructors
    @classmethod
    def layerwise(cls, *, resident_layers: int | str | list[int] | None = None,
                  weight_transfer: str | None = None, **kw: Any) -> "OffloadConfig":
        """Layer mode over ("dit",) (override with ``components=``).

        ``resident_layers`` (an int, a list of block indices or "auto"; None: not given, the
        planned default) / ``weight_transfer`` build ``layer_options["dit"]``;
        other keyword arguments are config fields (``num_slots=3``, ...). With no arguments the
        residency and the coding are planned from the first step (docs/configuration.md, "The
        default").
        """
        if resident_layers is not None or weight_transfer is not None:
            if "layer_options" in kw:
                raise ValueError(
                    "layerwise(): give either layer_options or resident_layers/weight_transfer, "
                    f"not both (layer_options={kw['layer_options']!r})")
            kw["layer_options"] = {"dit": LayerOptions(weight_transfer=weight_transfer,
                                                       resident_layers=resident_layers)}
        _check_keywords("OffloadConfig.layerwise()", kw, fixed=("mode",), own=("resident_layers", "weight_transfer"))
        kw.setdefault("components", ("dit",))
        return cls(mode="layer", **kw)

    @classmethod
    def module(cls, components=("dit", "text_encoder"), **kw: Any) -> "OffloadConfig":
        """Module (model-level) mode over ``components``."""
        _check_keywords("OffloadConfig.module()", kw, fixed=("mode",))
        return cls(mode="module", components=components, **kw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OffloadConfig":
        """Build from a ``diffusion_offload_config`` dict (plus our keys)."""
        if not isinstance(d, Mapping):
            raise _wrong_type("OffloadConfig", d, "a dict")
        names = [f.name for f in dataclasses.fields(cls)]
        d = _map_legacy(d)
        for key in d:
            if key not in names:
                raise _unknown_key("OffloadConfig", key, names)
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "OffloadConfig":
        """Build from a JSON object string."""
        from .misuse import DuplicateKeyError

        if not isinstance(s, (str, bytes, bytearray)):
            raise _wrong_type("OffloadConfig", s, "a JSON string")

        def no_duplicates(pairs: list) -> dict:
            # every JSON object, at any depth (json would keep the last value silently)
            out: dict = {}
            for key, value in pairs:
                if key in out:
                    raise DuplicateKeyError(
                        f"OffloadConfig JSON names the key {key!r} twice in one object (values "
                        f"{json.dumps(out[key])} and {json.dumps(value)}); allowed: each key once. "
                        f"Keys of that object: {[k for k, _ in pairs]}")
                out[key] = value
            return out

        try:
            d = json.loads(s, object_pairs_hook=no_duplicates)
        except DuplicateKeyError:
            raise
        except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an int of > 4300 digits, deep nesting
            raise ValueError(f"OffloadConfig={_short_repr(s)} is not allowed; expected a JSON object "
                             f"({type(e).__name__}: {e})") from e
        if not isinstance(d, dict):
            raise _wrong_type("OffloadConfig", d, "a JSON object")
        return cls.from_dict(d)

    @classmethod
    def coerce(cls, obj: Any) -> "OffloadConfig":
        """An OffloadConfig as is; a dict or JSON string parsed; None -> layerwise()."""
        if isinstance(obj, OffloadConfig):
            return obj
        if obj is None:
            return cls.layerwise()
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        if isinstance(obj, str):
            return cls.from_json(obj)
        raise _wrong_type("config", obj, "an OffloadConfig, a dict, a JSON string, or None")

    def encoder_config(self) -> "OffloadConfig":
        """The config a text encoder streams with in layer mode over a pipeline: its own layer
        options as dit's, and where this config leaves a key to the planned default, today's value
        instead (resident_layers 0, weight_codec "none"): an encoder runs once per prompt, and the
        device memory is the DiT's to plan in."""
        opts = self.layer_option("text_encoder")
        if opts.resident_layers is UNSET:
            opts = dataclasses.replace(opts, resident_layers=0)
        codec = "none" if self.weight_codec is UNSET else self.weight_codec
        return self.replace(components=("dit",), layer_options={"dit": opts}, weight_codec=codec)

    def replace(self, **changes: Any) -> "OffloadConfig":
        """A new, validated config with ``changes`` applied."""
        _check_keywords("OffloadConfig.replace()", changes)
        return dataclasses.replace(self, **changes)

    # -------------------------------------------------------------- serialise
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; omits keys at their defaults except mode and components."""
        out: dict[str, Any] = {"mode": self.mode, "components": list(self.components)}
        for f in dataclasses.fields(self):
            if f.name in out:
                continue
            value = getattr(self, f.name)
            if f.name == "layer_options":
                if value:
                    out[f.name] = {comp: opts.to_dict() for comp, opts in value.items()}
            elif value != f.default:
                out[f.name] = value
        return out

    def to_json(self, **json_kw: Any) -> str:
        return json.dumps(self.to_dict(), **json_kw)

    def __reduce__(self):
        # mappingproxy cannot be pickled; rebuild (and re-validate) from the dict.
        return (type(self).from_dict, (self.to_dict(),))

    def __hash__(self) -> int:
        return hash(tuple(
            tuple(sorted(getattr(self, f.name).items())) if f.name == "layer_options"
            else getattr(self, f.name)
            for f in dataclasses.fields(self)))

    # -------------------------------------------------------------- accessors
    @property
    def pinned_memory_budget_bytes(self) -> int | None:
        """``pinned_memory_budget_gb`` in bytes (None: no cap); the one conversion of it
        (checked to fit an int64)."""
        return _budget_bytes(self.pinned_memory_budget_gb)

    @property
    def device_memory_budget_bytes(self) -> int | None:
        """``device_memory_budget_gb`` in bytes (None: no cap); the one conversion of it."""
        return _budget_bytes(self.device_memory_budget_gb)

    def layer_option(self, component: str) -> LayerOptions:
        """Options of ``component`` (defaults when it has none)."""
        if component not in COMPONENTS:
            raise _reject("component", component, _choices(COMPONENTS))
        return self.layer_options.get(component, LayerOptions())

    @property
    def resident_layers(self) -> int | str | tuple[int, ...]:
        """dit's resident layers as given: an int N (the first N), a sorted tuple of block
        indices, or "auto" (see `LayerOptions`); 0 where not given (what the planned default
        starts from and falls back to: ``unset_keys`` says whether it was given)."""
        value = self.layer_option("dit").resident_layers
        return 0 if value is UNSET else value

    @property
    def unset_keys(self) -> tuple[str, ...]:
        """The planned keys left to the default: "resident_layers" (dit's not given) and
        "weight_codec" (not given), in that order. ``sources/select.py`` ``resolve_default``
        turns them into a cell of the support matrix."""
        out = ("resident_layers",) if self.layer_option("dit").resident_layers is UNSET else ()
        return out + (("weight_codec",) if self.weight_codec is UNSET else ())

    @property
    def resident_auto(self) -> bool:
        """Whether the planner picks dit's resident set (resident_layers="auto")."""
        return self.resident_layers == RESIDENT_AUTO

    @property
    def weight_transfer(self) -> str | None:
        """dit's weight transfer ("allgather" | "rank-local" | None)."""
        return self.layer_option("dit").weight_transfer


def _budget_bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * GB)


def _check_keywords(where: str, kw: Mapping[str, Any], *, fixed: tuple[str, ...] = (),
                    own: tuple[str, ...] = ()) -> None:
    """Keyword arguments that become config fields: a named ConfigTypeError (a TypeError, as
    Python's own, and a ValueError) for one that is not a field or that ``where`` sets itself,
    naming the allowed ones (``own``: ``where``'s own keywords, then the fields), the closest first."""
    names = [*own, *(f.name for f in dataclasses.fields(OffloadConfig) if f.name not in fixed)]
    for key, value in kw.items():
        if key in fixed:
            raise ConfigTypeError(
                f"{where} got {key}={value!r}, which is not allowed: it sets {key} itself; build "
                f"OffloadConfig({key}=...) or use OffloadConfig.from_dict for another {key}")
        if key not in names:
            legacy = LEGACY_MAPPED.get(key) or LEGACY_REJECTED.get(key)
            hint = f"; it is a legacy vLLM-Omni flag: write {legacy} instead" if legacy else ""
            raise unknown_keyword(where, key, names, hint)
