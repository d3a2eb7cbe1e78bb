"""Reading and writing a profile file (layerwatch/alerts/profile.py is its schema).

`layerwatch calibrate` measures a healthy baseline run and writes one with `dump_profile`;
`load_profile` reads it back and refuses anything doubtful (unknown keys, wrong types, bands upside
down, fractions outside [0, 1], a `for:` of an alert that is not a per-model one) with an error that
names the file and the field, because a typo here would silently disable an alert.

The YAML keys are the dataclass field names, except `for` (Python keyword) for `for_durations`.
Durations are written in Prometheus notation ("10m") and held in seconds.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from layerwatch.alerts.durations import format_duration, parse_duration
from layerwatch.alerts.profile import BimodalityProfile, GateImportance, Profile, Seconds
from layerwatch.alerts.specs import PER_MODEL_ALERTS
from layerwatch.catalog import REQUEST_FRACTION_BUCKETS
from layerwatch.statistics import BINS, MAX_WINDOW_OBSERVATIONS
from layerwatch.wire import MAX_NAME_BYTES

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"  # the committed per-model profiles

# model_name ends up inside PromQL selectors and label values: keep it to safe characters, and to
# what a gate frame can carry (MAX_NAME_BYTES), or no series would ever match it. (fullmatch, not
# match: `$` also matches before a trailing newline, and "demo\n" would pass.)
_MODEL_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:-]{{0,{MAX_NAME_BYTES - 1}}}")

# The alerts whose `for:` a profile may override (layerwatch/alerts/specs.py).
_PER_MODEL_ALERT_NAMES = frozenset(spec.name for spec in PER_MODEL_ALERTS)


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


_RETIRED = {
    "gate_importance_correlation_min": "retired: the gate-importance correlation is now measured within each "
    "layer, and a floor calibrated for the old pooled one would page on healthy gates; run `layerwatch "
    "calibrate` (it writes gate_importance.correlation_min) or set gate_importance: {correlation_min: ...}",
}


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    return _validated(_read_yaml(path), f"{path}")


def load_profiles(directory: str | Path) -> list[Profile]:
    """Every *.yaml profile in `directory`, sorted by model name; one model, one file."""
    profiles = [load_profile(p) for p in sorted(Path(directory).glob("*.yaml"))]
    if not profiles:
        raise ProfileError(f"{directory}: no *.yaml profile found")
    seen: dict[str, int] = {}
    for profile in profiles:
        seen[profile.model_name] = seen.get(profile.model_name, 0) + 1
    duplicates = sorted(name for name, count in seen.items() if count > 1)
    if duplicates:
        raise ProfileError(f"{directory}: more than one profile for model_name {duplicates}")
    return sorted(profiles, key=lambda p: p.model_name)


def dump_profile(profile: Profile, path: str | Path) -> None:
    """Write `profile` so that `load_profile` reads it back: the text is read back through the checks
    `load_profile` applies before anything is written, so a profile it would refuse is never written."""
    path = Path(path)
    text = yaml.safe_dump(_to_yaml(profile), sort_keys=False, default_flow_style=None)
    _validated(yaml.safe_load(text), f"{path}")
    header = f"# Healthy profile of model {profile.model_name!r}: bands and limits for its alerts.\n"
    path.write_text(header + text)


# --- YAML -> dataclass --------------------------------------------------------------------------


def _validated(data: Any, where: str) -> Profile:
    """A profile from its parsed YAML, with every check a profile must pass: each field's own (types,
    finite numbers, fractions in [0, 1]) and those across fields. The one validation of reading and writing."""
    profile = _build(Profile, data, where)
    _check(profile, where)
    return profile


# A profile is a page of YAML: anything larger is not one (and is not read into memory).
MAX_PROFILE_BYTES = 1 << 20


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping: YAML requires keys to be unique,
    PyYAML keeps the last one silently, and a stale copy of a field further down would win unseen."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, typing.Hashable):
            continue  # construct_mapping refuses it
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"found key {key!r} twice", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_yaml(path: Path) -> Any:
    """The file's YAML; ProfileError naming the file for anything that keeps it from being read."""
    try:
        # O_NONBLOCK: a FIFO is refused below rather than waited on in open().
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise ProfileError(f"{path}: cannot read profile: not a regular file")
            raw = file.read(MAX_PROFILE_BYTES + 1)
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc}") from exc
    if len(raw) > MAX_PROFILE_BYTES:
        raise ProfileError(f"{path}: cannot read profile: larger than {MAX_PROFILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: cannot read profile: not UTF-8 text (byte {exc.start})") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only
    except yaml.MarkedYAMLError as exc:
        where = "" if exc.problem_mark is None else f"line {exc.problem_mark.line + 1}: "
        raise ProfileError(f"{path}: cannot read profile: {where}{exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ProfileError(f"{path}: cannot read profile: nested too deeply") from None
    except ValueError as exc:  # an integer of more than 4,300 digits (Python's int/str conversion limit)
        raise ProfileError(f"{path}: cannot read profile: {exc}") from None


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("yaml_key", f.name)


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - set(fields))
    retired = [key for key in unknown if cls is Profile and key in _RETIRED]
    if retired:
        raise ProfileError(f"{where}: {retired[0]}: {_RETIRED[retired[0]]}")
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    values = {}
    for key, f in fields.items():
        if key not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProfileError(f"{where}: {key}: missing (required)")
            continue
        values[f.name] = _convert(hints[f.name], data[key], f"{where}: {key}", f.metadata)
    return cls(**values)


def _convert(hint: Any, value: Any, where: str, metadata: typing.Mapping[str, Any]) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `X | None`
        if value is None:
            return None
        (hint,) = [h for h in typing.get_args(hint) if h is not type(None)]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if hint is Seconds:
        if not isinstance(value, str):
            raise ProfileError(f"{where}: expected a duration like '5m', got {value!r}")
        try:
            return Seconds(parse_duration(value))
        except ValueError as exc:
            raise ProfileError(f"{where}: {exc}") from None
    if typing.get_origin(hint) is tuple:  # tuple[int, ...]: a YAML list
        if not isinstance(value, list):
            raise ProfileError(f"{where}: expected a list, got {value!r}")
        (item_hint, _) = typing.get_args(hint)
        return tuple(_convert(item_hint, item, f"{where}[{i}]", {}) for i, item in enumerate(value))
    if typing.get_origin(hint) is dict:
        if not isinstance(value, dict):
            raise ProfileError(f"{where}: expected a mapping, got {value!r}")
        key_hint, value_hint = typing.get_args(hint)
        return {_key(key_hint, k, where): _convert(value_hint, v, f"{where}.{k}", {}) for k, v in value.items()}
    if hint is float:
        # YAML reads 1 as int; bool is an int subclass but never a number here.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProfileError(f"{where}: expected a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer of 309 digits or more
            raise ProfileError(f"{where}: {_digits(value)} is not a finite number") from None
        if not math.isfinite(value):  # NaN compares false with every limit: it would pass every check
            raise ProfileError(f"{where}: {value} is not a finite number")
        if metadata.get("fraction") and not 0.0 <= value <= 1.0:
            raise ProfileError(f"{where}: {value} is outside [0, 1]")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProfileError(f"{where}: expected an integer, got {value!r}")
        if abs(value) > MAX_EXACT_INTEGER:
            raise ProfileError(f"{where}: {_digits(value)} {_INEXACT}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ProfileError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: no converter for {hint!r}")  # a schema bug, not a user error


def _key(hint: Any, key: Any, where: str) -> Any:
    """A mapping's key: any key as text for `str`; a layer number (an integer >= 0) for `int`."""
    if hint is str:
        return str(key)
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise ProfileError(f"{where}: key {key!r} is not a layer number (an integer >= 0)")
    if key > MAX_EXACT_INTEGER:
        raise ProfileError(f"{where}: key {_digits(key)} {_INEXACT}")
    return key


# Prometheus holds every number as a float64, which holds integers exactly up to 2**53 only: a
# larger one would not be the number written (and 401 digits were an OverflowError traceback).
MAX_EXACT_INTEGER = 2**53
_INEXACT = f"is more than a float64 holds exactly ({MAX_EXACT_INTEGER})"


def _digits(value: int) -> str:
    return f"an integer of {len(str(abs(value)))} digits"  # (not its hundreds of digits in one line)


# --- checks across fields -----------------------------------------------------------------------


def _check(p: Profile, where: str) -> None:
    def fail(key: str, problem: str) -> typing.NoReturn:
        raise ProfileError(f"{where}: {key}: {problem}")

    if not _MODEL_NAME.fullmatch(p.model_name):
        fail("model_name", f"{p.model_name!r} must match {_MODEL_NAME.pattern}")
    for name in ("entropy_mean", "entropy_std", "zero_ratio"):
        band = getattr(p, name)
        if band.low > band.high:
            fail(name, f"low {band.low} is above high {band.high}")
    if p.patience < 1:
        fail("patience", f"{p.patience} must be at least 1")
    if not 1 <= p.bimodality.min_observations <= MAX_WINDOW_OBSERVATIONS:  # (and a number PromQL can read)
        fail(
            "bimodality.min_observations",
            f"{p.bimodality.min_observations} must be at least 1 and at most {MAX_WINDOW_OBSERVATIONS} "
            f"(what a window can hold)",
        )
    _check_shape(p.bimodality, fail)
    if p.zero_ratio_page < p.zero_ratio.high:
        fail("zero_ratio_page", f"{p.zero_ratio_page} is below the healthy band's high end {p.zero_ratio.high}")
    if p.runaway_skip_ratio <= p.skip_ratio_normal:
        fail("runaway_skip_ratio", f"{p.runaway_skip_ratio} is not above skip_ratio_normal {p.skip_ratio_normal}")
    if p.skip_surge_factor <= 1.0:
        fail("skip_surge_factor", f"{p.skip_surge_factor} must be above 1 (a factor over the baseline)")
    if p.runaway_fallbacks_per_minute < 0:
        fail("runaway_fallbacks_per_minute", f"{p.runaway_fallbacks_per_minute} is negative")
    if not p.shadow_kl_nats_max > 0:
        fail("shadow_kl_nats_max", f"{p.shadow_kl_nats_max} must be above 0 (nats per token)")
    _check_gate_importance(p.gate_importance, fail)
    if p.drift.window <= 0:
        fail("drift.window", "must be longer than 0s")
    if not 0.0 < p.skip_collapse_fraction < 1.0:
        fail("skip_collapse_fraction", f"{p.skip_collapse_fraction} must lie strictly between 0 and 1")
    r = p.routing
    if list(r.static_layers) != sorted(set(r.static_layers)) or any(layer < 0 for layer in r.static_layers):
        fail("routing.static_layers", f"{list(r.static_layers)} must be distinct layer numbers >= 0, ascending")
    if not 1 <= r.min_tokens <= MAX_WINDOW_OBSERVATIONS:
        fail("routing.min_tokens", f"{r.min_tokens} must be 1..{MAX_WINDOW_OBSERVATIONS} (what a window can hold)")
    # A floor at or above the baseline would page on the healthy baseline (0 and 0: a model that
    # prunes statically by design, whose share never pages).
    if r.token_dependent_share is not None and 0 < r.share_floor >= r.token_dependent_share:
        fail(
            "routing.share_floor",
            f"{r.share_floor} is not below the baseline token_dependent_share {r.token_dependent_share}",
        )
    tail = p.request_tail
    if tail.runaway_skip_fraction not in REQUEST_FRACTION_BUCKETS:
        edges = ", ".join(f"{b:g}" for b in REQUEST_FRACTION_BUCKETS)
        fail(
            "request_tail.runaway_skip_fraction",
            f"{tail.runaway_skip_fraction} is not a bucket edge of layerwatch_request_skip_fraction ({edges})",
        )
    if tail.runaway_skip_fraction <= p.skip_ratio_normal:
        fail(
            "request_tail.runaway_skip_fraction",
            f"{tail.runaway_skip_fraction} is not above skip_ratio_normal {p.skip_ratio_normal}",
        )
    if tail.runaway_skip_fraction >= 1.0:
        fail("request_tail.runaway_skip_fraction", "must be below 1 (no request can skip more than all layers)")
    if tail.normal_share >= 1.0:
        fail("request_tail.normal_share", f"{tail.normal_share} must be below 1 (a share of requests)")
    unknown = sorted(set(p.for_durations) - _PER_MODEL_ALERT_NAMES)
    if unknown:
        fail("for", f"unknown alert(s) {unknown}; per-model alerts: {sorted(_PER_MODEL_ALERT_NAMES)}")


# The shares of a recorded histogram are rounded (calibrate: 4 decimals); they must still sum to about 1.
HISTOGRAM_SUM_TOLERANCE = 0.01


def _check_shape(b: BimodalityProfile, fail: Callable[[str, str], typing.NoReturn]) -> None:
    """A healthy shape LayerwatchEntropyShapeChanged can page on a departure from: two humps, or a
    recorded histogram with its limit (layerwatch/alerts/profile.py)."""
    parts = {"histogram": bool(b.histogram), "shape_distance_max": b.shape_distance_max is not None}
    parts["shape_min_observations"] = b.shape_min_observations is not None
    if any(parts.values()) and not all(parts.values()):
        missing = ", ".join(name for name, given in parts.items() if not given)
        fail("bimodality", f"{missing} missing: histogram, shape_distance_max and shape_min_observations go together")
    if not b.histogram:
        if not b.healthy_bimodal:
            fail(
                "bimodality",
                f"the healthy shape is not bimodal (peaks {b.peaks}, dip_p_value {b.dip_p_value}) and no histogram "
                "is recorded: LayerwatchEntropyShapeChanged would have no shape to compare with (`layerwatch "
                "calibrate` records it)",
            )
        return
    if len(b.histogram) != BINS:
        fail("bimodality.histogram", f"{len(b.histogram)} shares, not one per bin ({BINS})")
    if any(not 0.0 <= share <= 1.0 for share in b.histogram):
        fail("bimodality.histogram", "every share must lie in [0, 1]")
    if abs(sum(b.histogram) - 1.0) > HISTOGRAM_SUM_TOLERANCE:
        fail("bimodality.histogram", f"the shares sum to {sum(b.histogram):.4f}, not 1")
    if b.shape_distance_max is not None and not 0.0 < b.shape_distance_max < 1.0:
        fail("bimodality.shape_distance_max", f"{b.shape_distance_max} must lie strictly between 0 and 1")
    if b.shape_min_observations is not None and not 1 <= b.shape_min_observations <= MAX_WINDOW_OBSERVATIONS:
        fail(
            "bimodality.shape_min_observations",
            f"{b.shape_min_observations} must be 1..{MAX_WINDOW_OBSERVATIONS} (what a window can hold)",
        )


def _check_gate_importance(g: GateImportance, fail: Callable[[str, str], typing.NoReturn]) -> None:
    """Correlations in [-1, 1]; a floor below the healthy value it belongs to (at or above it, the
    alert would fire, or name the layer, on the healthy baseline); a floor for each layer with a baseline."""
    values = {"gate_importance.correlation_min": g.correlation_min}
    if g.correlation is not None:
        values["gate_importance.correlation"] = g.correlation
    for name in ("layer_baselines", "layer_floors"):
        values |= {f"gate_importance.{name}.{layer}": v for layer, v in getattr(g, name).items()}
    for key, value in values.items():
        if not -1.0 <= value <= 1.0:
            fail(key, f"{value} is outside [-1, 1] (a correlation)")
    if g.correlation is not None and g.correlation_min >= g.correlation:
        fail(
            "gate_importance.correlation_min",
            f"{g.correlation_min} is not below the baseline correlation {g.correlation}",
        )
    if set(g.layer_floors) != set(g.layer_baselines):
        fail(
            "gate_importance.layer_floors",
            f"layers {sorted(g.layer_floors)} differ from the layers of layer_baselines {sorted(g.layer_baselines)}",
        )
    for layer, floor in g.layer_floors.items():
        if floor >= g.layer_baselines[layer]:
            fail(
                f"gate_importance.layer_floors.{layer}",
                f"{floor} is not below the layer's baseline {g.layer_baselines[layer]}",
            )


# --- dataclass -> YAML --------------------------------------------------------------------------


def _to_yaml(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        hints = typing.get_type_hints(type(obj))
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None:
                continue
            out[_yaml_key(f)] = _duration_or(hints[f.name], value)
        return out
    if isinstance(obj, tuple):
        return list(obj)
    return obj


def _duration_or(hint: Any, value: Any) -> Any:
    if hint is Seconds:
        return format_duration(value)
    if typing.get_origin(hint) is dict and typing.get_args(hint)[1] is Seconds:
        return {k: format_duration(v) for k, v in value.items()}
    return _to_yaml(value)
