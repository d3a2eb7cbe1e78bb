"""Profiles: the reference numbers load, round-trip through dump_profile, and bad files fail clearly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from layerwatch.alerts.durations import format_duration, parse_duration
from layerwatch.alerts.profile import GateImportance, Profile
from layerwatch.alerts.profile_file import ProfileError, dump_profile, load_profile, load_profiles
from layerwatch.alerts.specs import PER_MODEL_ALERTS

from .conftest import REPO

REFERENCE = REPO / "layerwatch" / "alerts" / "profiles" / "reference.yaml"


def reference_data() -> dict:
    return yaml.safe_load(REFERENCE.read_text())


def write(tmp_path: Path, data: dict, name: str = "model.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _for_seconds(p: Profile, alert_name: str) -> float:
    """The profile's `for:` of a per-model alert, as its rules get it."""
    return next(spec for spec in PER_MODEL_ALERTS if spec.name == alert_name).for_seconds(p)


def test_reference_profile_carries_the_field_numbers() -> None:
    p = load_profile(REFERENCE)
    assert (p.threshold, p.patience) == (0.18, 3)
    assert (p.entropy_mean.low, p.entropy_mean.high) == (0.25, 0.35)
    assert (p.entropy_std.low, p.entropy_std.high) == (0.08, 0.12)
    assert (p.zero_ratio.low, p.zero_ratio.high, p.zero_ratio_page) == (0.15, 0.25, 0.40)
    assert p.runaway_skip_ratio == 0.85
    assert (p.drift.limit, p.drift.window, _for_seconds(p, "LayerwatchEntropyDrift")) == (0.18, 600, 300)
    # Ours, not the field's: half the static verdict's line, and no layer static in a routed model.
    assert (p.routing.share_floor, p.routing.static_layers, p.routing.token_dependent_share) == (0.25, (), None)
    assert p.skip_collapse_fraction == 0.5


def test_demo_profile_holds_its_measured_routing_baseline() -> None:
    p = load_profile(REPO / "layerwatch" / "alerts" / "profiles" / "demo.yaml")
    assert p.routing.static_layers == (12, 13, 14)  # docs/exporter.md: the demo's static layers
    assert 0 < p.routing.share_floor < p.routing.token_dependent_share < 1


def test_dump_then_load_gives_the_same_profile(tmp_path: Path) -> None:
    original = load_profile(REFERENCE)
    path = tmp_path / "again.yaml"
    dump_profile(original, path)
    assert load_profile(path) == original


def test_demo_profile_holds_its_measured_gate_floors() -> None:
    """Per-layer floors for the layers whose gates vary: not the protected first and last layers."""
    g = load_profile(REPO / "layerwatch" / "alerts" / "profiles" / "demo.yaml").gate_importance
    assert g.correlation is not None and 0 < g.correlation_min < g.correlation
    assert g.layer_floors and set(g.layer_floors) == set(g.layer_baselines) and not {0, 15} & set(g.layer_floors)
    assert all(g.layer_floors[layer] < g.layer_baselines[layer] for layer in g.layer_floors)


def test_defaults_fill_optional_fields(tmp_path: Path) -> None:
    data = {
        k: v
        for k, v in reference_data().items()
        if k
        in (
            "model_name",
            "threshold",
            "patience",
            "entropy_mean",
            "entropy_std",
            "zero_ratio",
            "skip_ratio_normal",
            "bimodality",
            "routing",
        )
    }
    data["routing"] = {"share_floor": 0.25, "static_layers": []}
    p = load_profile(write(tmp_path, data))
    assert p.runaway_skip_ratio == 0.85 and p.zero_ratio_page == 0.40
    assert p.gate_importance == GateImportance(correlation_min=0.03)  # a correlation, not a fraction: [-1, 1]
    assert p.skip_collapse_fraction == 0.5 and p.routing.min_tokens == 200  # the exporter's minimum
    assert _for_seconds(p, "LayerwatchEntropyShapeChanged") == 600
    assert (p.request_tail.runaway_skip_fraction, p.request_tail.normal_share) == (0.5, 0.01)


def _shape(**change: object) -> dict:
    """A recorded healthy shape of one hump (bimodality's fields), with `change` applied."""
    shares = [0.0, 0.1, 0.2, 0.3, 0.2, 0.1, 0.1] + [0.0] * 13
    shape = {"min_observations": 1000, "peaks": 1, "histogram": shares, "shape_distance_max": 0.05}
    return shape | {"shape_min_observations": 15360} | change


def test_a_recorded_shape_of_one_hump_loads(tmp_path: Path) -> None:
    p = load_profile(write(tmp_path, reference_data() | {"bimodality": _shape()}))
    assert not p.bimodality.healthy_bimodal and p.bimodality.histogram[3] == 0.3
    assert (p.bimodality.shape_distance_max, p.bimodality.shape_min_observations) == (0.05, 15360)


@pytest.mark.parametrize(
    "change, field, problem",
    [
        ({"entropy_mean": {"low": 0.4, "high": 0.3}}, "entropy_mean", "above high"),
        ({"threshold": 1.5}, "threshold", "outside [0, 1]"),
        ({"zero_ratio": {"low": -0.1, "high": 0.2}}, "zero_ratio: low", "outside [0, 1]"),
        ({"patience": "three"}, "patience", "expected an integer"),
        ({"patience": 2.5}, "patience", "expected an integer"),
        ({"threshold": True}, "threshold", "expected a number"),
        ({"entropy_std": [0.08, 0.12]}, "entropy_std", "expected a mapping"),
        ({"treshold": 0.18}, "unknown key(s) ['treshold']", "known:"),
        ({"drift": {"limit": 0.18, "window": "ten minutes"}}, "drift: window", "not a duration"),
        ({"for": {"LayerwatchNoSuchAlert": "5m"}}, "for", "unknown alert"),
        ({"for": {"LayerwatchTargetDown": "5m"}}, "for", "unknown alert"),  # common: no override
        ({"for": {"LayerwatchEntropyDrift": 300}}, "for.LayerwatchEntropyDrift", "expected a duration"),
        ({"zero_ratio_page": 0.2}, "zero_ratio_page", "below the healthy band"),
        ({"runaway_skip_ratio": 0.1}, "runaway_skip_ratio", "not above skip_ratio_normal"),
        ({"skip_surge_factor": 1.0}, "skip_surge_factor", "must be above 1"),
        ({"model_name": 'demo"} or vector(1)'}, "model_name", "must match"),
        ({"bimodality": {"min_observations": 0}}, "bimodality.min_observations", "at least 1"),
        ({"bimodality": {"min_observations": 72_001}}, "bimodality.min_observations", "at most 72000"),
        ({"model_name": "demo\n"}, "model_name", "must match"),
        # A healthy shape the shape alert can use: two humps, or a recorded histogram with its limit.
        ({"bimodality": {"min_observations": 1000, "peaks": 1}}, "bimodality", "no histogram is recorded"),
        (
            {"bimodality": {"min_observations": 1000, "peaks": 2, "dip_p_value": 0.4}},
            "bimodality",
            "the healthy shape is not bimodal",
        ),
        (
            {"bimodality": {"min_observations": 1000, "peaks": 1, "histogram": [0.05] * 20}},
            "bimodality",
            "shape_distance_max, shape_min_observations missing",
        ),
        ({"bimodality": _shape(histogram=[0.05] * 19)}, "bimodality.histogram", "19 shares, not one per bin (20)"),
        ({"bimodality": _shape(histogram=[0.025] * 20)}, "bimodality.histogram", "sum to 0.5000, not 1"),
        ({"bimodality": _shape(histogram=[1.5] + [0.0] * 19)}, "bimodality.histogram", "must lie in [0, 1]"),
        ({"bimodality": _shape(shape_distance_max=0.0)}, "bimodality.shape_distance_max", "strictly between 0 and 1"),
        ({"bimodality": _shape(shape_min_observations=0)}, "bimodality.shape_min_observations", "must be 1.."),
        # A floor for the pooled correlation of old would page on healthy gates: named, not "unknown".
        ({"gate_importance_correlation_min": 0.178}, "gate_importance_correlation_min", "retired"),
        ({"gate_importance": {"correlation_min": -1.5}}, "gate_importance.correlation_min", "outside [-1, 1]"),
        ({"gate_importance": {"correlation_min": "high"}}, "gate_importance: correlation_min", "expected a number"),
        (
            {"gate_importance": {"correlation_min": 0.1, "correlation": 0.1}},
            "gate_importance.correlation_min",
            "not below the baseline",
        ),
        (
            {"gate_importance": {"layer_baselines": {3: 0.1}, "layer_floors": {3: 0.2}}},
            "gate_importance.layer_floors.3",
            "not below the layer's baseline",
        ),
        (
            {"gate_importance": {"layer_baselines": {3: 0.1}, "layer_floors": {4: 0.0}}},
            "gate_importance.layer_floors",
            "differ from the layers",
        ),
        ({"gate_importance": {"layer_floors": {"x": 0.0}}}, "gate_importance: layer_floors", "not a layer number"),
        ({"gate_importance": {"layer_floors": {-1: 0.0}}}, "gate_importance: layer_floors", "not a layer number"),
        (
            {"gate_importance": {"layer_baselines": {2: 1.5}, "layer_floors": {2: 0.0}}},
            "gate_importance.layer_baselines.2",
            "outside [-1, 1]",
        ),
        ({"skip_collapse_fraction": 0.0}, "skip_collapse_fraction", "strictly between 0 and 1"),
        ({"skip_collapse_fraction": 1.0}, "skip_collapse_fraction", "strictly between 0 and 1"),
        ({"routing": {"static_layers": []}}, "routing: share_floor", "missing"),
        ({"routing": {"share_floor": 1.2, "static_layers": []}}, "routing: share_floor", "outside [0, 1]"),
        ({"routing": {"share_floor": 0.2, "static_layers": "12"}}, "routing: static_layers", "expected a list"),
        ({"routing": {"share_floor": 0.2, "static_layers": [1.5]}}, "routing: static_layers[0]", "expected an integer"),
        ({"routing": {"share_floor": 0.2, "static_layers": [13, 12]}}, "routing.static_layers", "ascending"),
        ({"routing": {"share_floor": 0.2, "static_layers": [3, 3]}}, "routing.static_layers", "distinct"),
        ({"routing": {"share_floor": 0.2, "static_layers": [-1]}}, "routing.static_layers", ">= 0"),
        ({"routing": {"share_floor": 0.2, "static_layers": [], "min_tokens": 0}}, "routing.min_tokens", "must be 1.."),
        (
            {"routing": {"share_floor": 0.2, "static_layers": [], "min_tokens": 10**9}},
            "routing.min_tokens",
            "must be 1..",
        ),
        ({"skip_surge_factor": float("nan")}, "skip_surge_factor", "not a finite number"),
        # Unguarded, float() raises OverflowError, past serve's and generate's ProfileError.
        ({"threshold": 10**400}, "threshold", "an integer of 401 digits is not a finite number"),
        ({"patience": 10**400}, "patience", "an integer of 401 digits is more than a float64 holds exactly"),
        (
            {"gate_importance": {"layer_baselines": {2**53 + 1: 0.1}, "layer_floors": {2**53 + 1: 0.0}}},
            "gate_importance: layer_baselines: key an integer of 16 digits",
            "more than a float64 holds exactly",
        ),
        ({"runaway_fallbacks_per_minute": float("inf")}, "runaway_fallbacks_per_minute", "not a finite number"),
        (
            {"routing": {"share_floor": 0.7, "static_layers": [], "token_dependent_share": 0.6}},
            "routing.share_floor",
            "not below the baseline",
        ),
        ({"request_tail": {"runaway_skip_fraction": 0.33}}, "request_tail.runaway_skip_fraction", "bucket edge"),
        ({"request_tail": {"runaway_skip_fraction": 0.2}}, "request_tail.runaway_skip_fraction", "not above"),
        ({"request_tail": {"runaway_skip_fraction": 1.0}}, "request_tail.runaway_skip_fraction", "below 1"),
        ({"request_tail": {"normal_share": 1.0}}, "request_tail.normal_share", "below 1"),
        ({"request_tail": {"normal_share": -0.01}}, "request_tail: normal_share", "outside [0, 1]"),
        ({"request_tail": {"cutoff": 0.5}}, "request_tail: unknown key(s) ['cutoff']", "known:"),
    ],
)
def test_broken_profile_names_file_and_field(tmp_path: Path, change: dict, field: str, problem: str) -> None:
    path = write(tmp_path, {**reference_data(), **change})
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    message = str(err.value)
    assert str(path) in message and field in message and problem in message, message


def test_missing_required_field(tmp_path: Path) -> None:
    data = reference_data()
    del data["entropy_mean"]
    with pytest.raises(ProfileError, match="entropy_mean: missing"):
        load_profile(write(tmp_path, data))


def test_not_yaml_or_not_a_mapping(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name: [unclosed\n")
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ProfileError, match="expected a mapping"):
        load_profile(bad)


def test_two_profiles_for_one_model_are_refused(tmp_path: Path) -> None:
    write(tmp_path, reference_data(), "a.yaml")
    write(tmp_path, reference_data(), "b.yaml")
    with pytest.raises(ProfileError, match="more than one profile"):
        load_profiles(tmp_path)


def test_dump_refuses_an_inconsistent_profile(tmp_path: Path) -> None:
    broken = dataclasses.replace(load_profile(REFERENCE), zero_ratio_page=0.1)
    with pytest.raises(ProfileError, match="zero_ratio_page"):
        dump_profile(broken, tmp_path / "x.yaml")
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("shadow_rate_min", [5.0, float("nan"), float("inf")])
def test_dump_refuses_every_value_load_would_refuse(tmp_path: Path, shadow_rate_min: float) -> None:
    """Before: `calibrate --shadow-rate-min 5` (or nan) wrote a profile, exit 0, that load_profile refused
    (outside [0, 1], not finite): generate exited 2 on it and serve skipped it."""
    broken = dataclasses.replace(load_profile(REFERENCE), shadow_rate_min=shadow_rate_min)
    with pytest.raises(ProfileError, match="shadow_rate_min"):
        dump_profile(broken, tmp_path / "x.yaml")
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("text, seconds", [("30s", 30), ("5m", 300), ("1h30m", 5400), ("500ms", 0.5), ("1d", 86400)])
def test_durations_parse_and_format_back(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize(
    "text",
    ["", "5", "m", "5 m", "1.5h", "-5m", "5m1h", "5m\n", "\u0663m", "106752d", "2562047h47m16s855ms", "1" * 5000 + "s"],
)
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)
