"""A model's healthy profile: the bands and limits its alerts are generated from.

One YAML file per model in alerts/profiles/. `layerwatch calibrate` measures a healthy baseline run
and writes one with `dump_profile`; `load_profile` reads it back and refuses anything doubtful
(unknown keys, wrong types, bands upside down, fractions outside [0, 1]) with an error that names
the file and the field, because a typo here would silently disable an alert.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NewType

import yaml

from alerts.durations import format_duration, parse_duration
from alerts.specs import PER_MODEL_ALERTS
from layerwatch.catalog import DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION, REQUEST_FRACTION_BUCKETS
from layerwatch.routing import DEFAULT_MIN_ROUTING_TOKENS
from layerwatch.statistics import MAX_WINDOW_OBSERVATIONS
from layerwatch.wire import MAX_NAME_BYTES

Seconds = NewType("Seconds", float)  # written as a Prometheus duration in YAML

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"  # the committed per-model profiles

# Fields whose values are fractions of something and must lie in [0, 1].
_FRACTION = {"fraction": True}
# model_name ends up inside PromQL selectors and label values: keep it to safe characters, and to
# what a gate frame can carry (MAX_NAME_BYTES), or no series would ever match it. (fullmatch, not
# match: `$` also matches before a trailing newline, and "demo\n" would pass.)
_MODEL_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:-]{{0,{MAX_NAME_BYTES - 1}}}")
# Defaults of optional fields that `layerwatch calibrate` also starts from.
DEFAULT_ZERO_RATIO_PAGE = 0.40  # the field's "a jump above 40 % means over-pruning"
DEFAULT_SKIP_COLLAPSE_FRACTION = 0.5  # collapsed: skipping below half of its healthy ratio
DEFAULT_RUNAWAY_SKIP_RATIO = 0.85  # the field's fallback trigger: more than 85 % of layers skipped
DEFAULT_SHADOW_KL_NATS_MAX = 0.05  # exp(0.05) - 1: about a 5 % perplexity-scale cost per token
# The alerts whose `for:` a profile may override, and their defaults (alerts/specs.py).
_DEFAULT_FOR = {spec.name: spec.default_for for spec in PER_MODEL_ALERTS}


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Band:
    """A healthy range [low, high]."""

    low: float = field(metadata=_FRACTION)
    high: float = field(metadata=_FRACTION)


@dataclass(frozen=True)
class BimodalityProfile:
    """When the exporter's bimodality verdict counts, and what the healthy baseline looked like.

    Not the verdict itself (that is layerwatch.statistics.Bimodality): the profile's expectations of it.
    """

    # The single-peak alert waits until the exporter's window holds at least this many entropies
    # (the exporter itself withholds the verdict below its own, possibly smaller, minimum).
    min_observations: int
    # Statistics of the healthy baseline, for the alert text and the dashboard; informational.
    peaks: int | None = None
    dip: float | None = field(default=None, metadata=_FRACTION)
    dip_p_value: float | None = field(default=None, metadata=_FRACTION)
    bimodality_coefficient: float | None = field(default=None, metadata=_FRACTION)


@dataclass(frozen=True)
class RoutingProfile:
    """The healthy baseline's routing statistics (layerwatch/routing.py) and when they page.

    LayerwatchRoutingStatic pages when the exporter's token-dependent share falls below
    `share_floor`, or when a layer outside `static_layers` becomes static (below τ on almost every
    token); both wait for the exporter's window to hold `min_tokens` tokens.
    """

    # Page below this token-dependent share ("well below" the baseline; calibrate: half of the
    # lowest chunk's share).
    share_floor: float = field(metadata=_FRACTION)
    # Layers static in the healthy baseline (skipped whatever the token): expected, not paged.
    static_layers: tuple[int, ...]
    # The routing alerts wait until the exporter's window holds this many tokens (the exporter
    # itself withholds the verdict below its own --min-routing-tokens).
    min_tokens: int = DEFAULT_MIN_ROUTING_TOKENS
    # The healthy baseline's share, for the alert text; informational.
    token_dependent_share: float | None = field(default=None, metadata=_FRACTION)


@dataclass(frozen=True)
class Drift:
    """The field's drift alarm: stddev of the entropy mean over `window` above `limit`."""

    limit: float = field(default=0.18, metadata=_FRACTION)
    window: Seconds = Seconds(600.0)


@dataclass(frozen=True)
class RequestTail:
    """The tail of the per-request skip fractions (layerwatch_request_skip_fraction): a small category
    of traffic that skips far more than the rest shows here long before it moves the global ratio.

    `runaway_skip_fraction` must be a bucket edge of the histogram (layerwatch/catalog.py), and the
    shim counts the layers of runaway requests at the same cut-off (`layerwatch serve` reads it from
    this profile unless --request-runaway-fraction says otherwise).
    """

    # A request skipping more than this share of its decode layer evaluations is runaway.
    runaway_skip_fraction: float = field(default=DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION, metadata=_FRACTION)
    # The share of requests above it that healthy traffic shows (with a margin): the alert fires above.
    # `layerwatch calibrate` measures both (docs/alerting.md, "What calibrate measures").
    normal_share: float = field(default=0.01, metadata=_FRACTION)


@dataclass(frozen=True)
class GateImportance:
    """LayerwatchGateMiscalibrated's limits: the within-layer gate-importance correlation
    (layerwatch_gate_importance_correlation, Spearman's correlation in [-1, 1] of each layer's gate
    score with its layer's update, averaged over the layers; docs/service.md, "Layer signals").

    `layerwatch calibrate` measures all of it; the default floor only catches gates whose token
    ranking is unrelated to their layers' updates (those read about 0; the demo's healthy gates
    0.07-0.14).
    """

    # Page below this headline correlation (calibrate: half the lowest healthy reading, at least the
    # margin below it).
    correlation_min: float = 0.03
    # The healthy baseline's headline, for the alert text; informational.
    correlation: float | None = None
    # Per layer (the layers whose healthy gates vary): the healthy baseline's correlation
    # (informational) and the floor below which the alert names the layer (calibrate: as the headline's).
    layer_baselines: dict[int, float] = field(default_factory=dict)
    layer_floors: dict[int, float] = field(default_factory=dict)


# Keys a profile may no longer carry, and why (the loader says so instead of "unknown key").
_RETIRED = {
    "gate_importance_correlation_min": "retired: the gate-importance correlation is now measured within each "
    "layer, and a floor calibrated for the old pooled one would page on healthy gates; run `layerwatch "
    "calibrate` (it writes gate_importance.correlation_min) or set gate_importance: {correlation_min: ...}",
}


@dataclass(frozen=True)
class Profile:
    model_name: str
    threshold: float = field(metadata=_FRACTION)  # gate threshold the model is served with
    patience: int  # consecutive low-score tokens before a layer is skipped
    entropy_mean: Band  # mean entropy of the layers that ran (decision="run")
    entropy_std: Band  # standard deviation of the same
    zero_ratio: Band  # share of entropies below 0.01, all layers
    skip_ratio_normal: float = field(metadata=_FRACTION)  # healthy share of skipped layer evaluations
    bimodality: BimodalityProfile
    routing: RoutingProfile  # token-dependent share floor and the baseline's static layers
    zero_ratio_page: float = field(default=DEFAULT_ZERO_RATIO_PAGE, metadata=_FRACTION)  # page above this
    skip_surge_factor: float = 2.0  # surge: skip ratio above factor x its own 1h baseline
    # collapse: skip ratio below this fraction of skip_ratio_normal (cost and power up)
    skip_collapse_fraction: float = field(default=DEFAULT_SKIP_COLLAPSE_FRACTION, metadata=_FRACTION)
    runaway_skip_ratio: float = field(default=DEFAULT_RUNAWAY_SKIP_RATIO, metadata=_FRACTION)
    runaway_fallbacks_per_minute: float = 0.0  # fallbacks above this rate, sustained, are runaway
    drift: Drift = Drift()
    shadow_agreement_min: float = field(default=0.90, metadata=_FRACTION)
    # Page above this quality cost: nats of KL(gated || full) per shadow-checked token, the gated
    # model's raw distributions (docs/service.md, "Quality guard"). `layerwatch calibrate` measures it;
    # the default (a perplexity-scale cost of about 5 %) is ours, not a measurement.
    shadow_kl_nats_max: float = DEFAULT_SHADOW_KL_NATS_MAX
    # The shadow rate this model's shims must run at (LayerwatchQualityGuardBlind tickets a shim serving
    # gated traffic below it); 0: no checks expected.
    shadow_rate_min: float = field(default=0.0, metadata=_FRACTION)
    gate_importance: GateImportance = GateImportance()  # LayerwatchGateMiscalibrated
    telemetry_loss_max: float = field(default=0.01, metadata=_FRACTION)
    request_tail: RequestTail = RequestTail()
    # Per-alert `for:` overrides of per-model alerts; the others use their spec's default.
    for_durations: dict[str, Seconds] = field(default_factory=dict, metadata={"yaml_key": "for"})
    source: str = ""  # where the numbers come from (a paper, a calibration run and its date)

    def for_duration(self, alert_name: str) -> float:
        """Seconds: this profile's `for:` of a per-model alert."""
        return self.for_durations.get(alert_name, _DEFAULT_FOR[alert_name])


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    data = _read_yaml(path)
    profile = _build(Profile, data, f"{path}")
    _check(profile, f"{path}")
    return profile


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
    """Write `profile` so that `load_profile` reads back an equal one (checked before writing)."""
    path = Path(path)
    _check(profile, f"{path}")
    text = yaml.safe_dump(_to_yaml(profile), sort_keys=False, default_flow_style=None)
    header = f"# Healthy profile of model {profile.model_name!r}: bands and limits for its alerts.\n"
    path.write_text(header + text)


# --- YAML -> dataclass --------------------------------------------------------------------------

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
        value = float(value)
        if not math.isfinite(value):  # NaN compares false with every limit: it would pass every check
            raise ProfileError(f"{where}: {value} is not a finite number")
        if metadata.get("fraction") and not 0.0 <= value <= 1.0:
            raise ProfileError(f"{where}: {value} is outside [0, 1]")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProfileError(f"{where}: expected an integer, got {value!r}")
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
    return key


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
    unknown = sorted(set(p.for_durations) - set(_DEFAULT_FOR))
    if unknown:
        fail("for", f"unknown alert(s) {unknown}; per-model alerts: {sorted(_DEFAULT_FOR)}")


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
