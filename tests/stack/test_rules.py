"""The generated rules: promtool accepts them, the promtool unit tests pass (and depend on the
profile's numbers), and every alert spec is complete: its rules, runbook section and promtool cases."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from layerwatch.alerts.durations import Timing
from layerwatch.alerts.profile import GateImportance, Profile
from layerwatch.alerts.profile_file import PROFILES_DIR, load_profiles
from layerwatch.alerts.recorded import GATE_LAYER_IMPORTANCE_FLOOR, Recorded
from layerwatch.alerts.rules import PROFILE_SERIES, profile_series, render_rules, rule_groups
from layerwatch.alerts.specs import ALERT_NAMES, ALERTS, AlertBuild, AlertSpec
from layerwatch.mixin import config

from .conftest import REPO, run_tool

RULES = REPO / "layerwatch" / "alerts" / "generated" / "layerwatch.rules.yaml"
TESTS = sorted((REPO / "layerwatch" / "alerts" / "tests").glob("*.test.yaml"))
# The alert names docs/alerting.md promises. They are an interface (silences, routes, inhibitions
# elsewhere match on them): renaming or dropping one must be deliberate.
PROMISED_ALERTS = {
    "LayerwatchEntropyShapeChanged",
    "LayerwatchRunawaySkipping",
    "LayerwatchSkipRateSurge",
    "LayerwatchEntropyMeanOutOfBand",
    "LayerwatchEntropySpreadOutOfBand",
    "LayerwatchZeroEntropyRatioHigh",
    "LayerwatchEntropyDrift",
    "LayerwatchGateWeightsChanged",
    "LayerwatchShadowAgreementLow",
    "LayerwatchTelemetryLoss",
    "LayerwatchTargetDown",
    "LayerwatchRoutingStatic",
    "LayerwatchSkippingCollapsed",
}
# Read by the rule machinery for every per-model alert, not by a builder's thresholds.
_PROFILE_PLUMBING = {"model_name", "for_durations"}


def all_alerts(groups: dict) -> list[dict]:
    return [r for g in groups["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules_is_clean(promtool: str) -> None:
    result = run_tool(promtool, "check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "WARNING" not in result.stdout + result.stderr


def test_promtool_unit_tests_pass(promtool: str) -> None:
    assert TESTS, "no promtool tests in layerwatch/alerts/tests"
    result = run_tool(promtool, "test", "rules", *TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def _cases_of(alertname: str, tmp_path: Path) -> Path:
    """A copy of alerts.test.yaml holding only the groups that expect something of `alertname`,
    beside an empty generated/ folder for the rules under test (promtool runs the whole file in
    ~5 s, these groups in well under one)."""
    cases = yaml.safe_load((REPO / "layerwatch" / "alerts" / "tests" / "alerts.test.yaml").read_text())
    cases["tests"] = [
        group
        for group in cases["tests"]
        if any(test["alertname"] == alertname for test in group.get("alert_rule_test", []))
    ]
    assert cases["tests"], f"no promtool case of {alertname}"
    (tmp_path / "generated").mkdir()
    (tmp_path / "tests").mkdir()
    path = tmp_path / "tests" / "alerts.test.yaml"
    path.write_text(yaml.safe_dump(cases, sort_keys=False))
    return path


@pytest.mark.parametrize(
    "change, alertname",
    [
        ({"runaway_skip_ratio": 0.87}, "LayerwatchRunawaySkipping"),
        ({"skip_collapse_fraction": 0.55}, "LayerwatchSkippingCollapsed"),  # 0.1155: the 11 % shim fires
        ({"routing": {"share_floor": 0.26, "static_layers": ()}}, "LayerwatchRoutingStatic"),  # 0.25 fires
        ({"routing": {"share_floor": 0.25, "static_layers": (1,)}}, "LayerwatchRoutingStatic"),  # 1 is expected
    ],
)
def test_unit_tests_depend_on_the_profile_numbers(
    promtool: str, tmp_path: Path, reference_profiles, change: dict, alertname: str
) -> None:
    """Rules generated with another number in the profile fail the alert's promtool cases, which
    the profile's own numbers pass."""
    cases = _cases_of(alertname, tmp_path)
    rules = tmp_path / "generated" / RULES.name
    rules.write_text(render_rules(reference_profiles))
    result = run_tool(promtool, "test", "rules", cases)
    assert result.returncode == 0, result.stdout + result.stderr

    def shift(p: Profile) -> Profile:
        if "routing" in change:
            return dataclasses.replace(p, routing=dataclasses.replace(p.routing, **change["routing"]))
        return dataclasses.replace(p, **change)

    rules.write_text(render_rules([shift(p) for p in reference_profiles]))
    result = run_tool(promtool, "test", "rules", cases)
    assert result.returncode != 0
    assert alertname in result.stdout + result.stderr


def test_baseline_static_layers_do_not_page_but_others_do(promtool: str, tmp_path: Path, reference_profiles) -> None:
    """A profile's static layers may stay static; any other layer turning static pages, by name."""
    (reference,) = [p for p in reference_profiles if p.model_name == "reference"]
    profile = dataclasses.replace(reference, routing=dataclasses.replace(reference.routing, static_layers=(12, 13)))
    (tmp_path / "rules.yaml").write_text(render_rules([profile]))
    exporter = 'job="layerwatch-exporter", model_name="reference"'
    series = [
        {"series": f'layerwatch_routing_token_dependent_share{{{exporter}, instance="{i}"}}', "values": "0.6x20"}
        for i in ("a", "b")
    ] + [
        {"series": f'layerwatch_routing_window_tokens{{{exporter}, instance="{i}"}}', "values": "3000x20"} for i in "ab"
    ]
    for instance, static in (("a", (12, 13)), ("b", (2, 12, 13))):  # b: layer 2 turned static
        for layer in (2, 12, 13):
            state = 1 if layer in static else 0
            labels = f'{exporter}, instance="{instance}", layer="{layer}"'
            series += [
                {"series": f"layerwatch_routing_layer_static{{{labels}}}", "values": f"{state}x20"},
                {"series": f"layerwatch_routing_layer_low_ratio{{{labels}}}", "values": f"{0.99 if state else 0.5}x20"},
            ]
    description = (
        "1 layer(s) of model reference on b that route per token in the healthy baseline are now static (below "
        "the threshold for almost every token): 2 (0.990) (static in the baseline: 12, 13). Token-dependent "
        "share 0.600 (floor 0.25). Window: 3000 tokens."
    )
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {
                        "alertname": "LayerwatchRoutingStatic",
                        "eval_time": "15m",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "critical",
                                    "trigger": "new_static_layers",
                                    "job": "layerwatch-exporter",
                                    "instance": "b",
                                    "model_name": "reference",
                                },
                                "exp_annotations": {
                                    "summary": "Layer skipping has turned into static pruning.",
                                    "description": description,
                                    "runbook_url": f"{config.RUNBOOK_BASE_URL}#layerwatchroutingstatic",
                                },
                            }
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "static.test.yaml").write_text(yaml.safe_dump(test))
    result = run_tool(promtool, "test", "rules", tmp_path / "static.test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_gate_miscalibrated_names_the_layers_below_their_own_floors_largest_deficit_first(
    promtool: str, tmp_path: Path, reference_profiles
) -> None:
    """With per-layer floors (what `layerwatch calibrate` writes), the description lists exactly the
    layers below their own floor, ordered by how far below; a layer at its floor, or one without a
    floor, is not named."""
    (reference,) = [p for p in reference_profiles if p.model_name == "reference"]
    floors = {1: 0.05, 3: 0.1, 5: -0.05, 8: 0.02}
    gate = GateImportance(
        correlation_min=0.04,
        correlation=0.11,
        layer_baselines={1: 0.15, 3: 0.2, 5: 0.05, 8: 0.1},
        layer_floors=floors,
    )
    (tmp_path / "rules.yaml").write_text(render_rules([dataclasses.replace(reference, gate_importance=gate)]))
    shim = 'job="layerwatch-shim", instance="s", model_name="reference"'
    # Layer 1 is 0.02 below its floor, 3 is 0.15 below, 5 exactly at it, 8 0.001 above; 9 has no floor.
    now = {1: 0.03, 3: -0.05, 5: -0.05, 8: 0.021, 9: -0.5}
    series = [{"series": f"layerwatch_gate_importance_correlation{{{shim}}}", "values": "0.12x4 0.01x16"}]
    series += [
        {"series": f'layerwatch_gate_layer_importance_correlation{{{shim}, layer="{layer}"}}', "values": f"{v}x20"}
        for layer, v in now.items()
    ]
    description = (
        "On the full-depth shadow checks of model reference on s, the rank correlation between a layer's gate "
        "score and its relative residual update on the token the score decides, averaged over n/a layers, is "
        "0.010 (floor 0.04; healthy baseline 0.11): skip decisions no longer follow which tokens each layer "
        "matters for. Layers below their own healthy floor, largest deficit first: 3 (0.150 below) 1 (0.020 "
        "below) - shadow agreement n/a. Usual causes: gates for another model, layer order or hidden-state "
        "layout, or edited gate weights."
    )
    labels = {"severity": "critical", "job": "layerwatch-shim", "instance": "s", "model_name": "reference"}
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"alertname": "LayerwatchGateMiscalibrated", "eval_time": "14m", "exp_alerts": []},
                    {
                        "alertname": "LayerwatchGateMiscalibrated",
                        "eval_time": "15m",
                        "exp_alerts": [
                            {
                                "exp_labels": labels,
                                "exp_annotations": {
                                    "summary": "The gates no longer rank tokens by how much their layers matter.",
                                    "description": description,
                                    "runbook_url": f"{config.RUNBOOK_BASE_URL}#layerwatchgatemiscalibrated",
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "gate.test.yaml").write_text(yaml.safe_dump(test))
    result = run_tool(promtool, "test", "rules", tmp_path / "gate.test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr

    # The floors are the profile's own, one constant series per layer; a profile without any has none.
    def floor_rules(groups: dict) -> set[tuple[str, str]]:
        rules = [r for g in groups["groups"] for r in g["rules"] if r.get("record") == GATE_LAYER_IMPORTANCE_FLOOR]
        return {(r["labels"]["layer"], r["expr"]) for r in rules}

    rendered = yaml.safe_load((tmp_path / "rules.yaml").read_text())
    assert floor_rules(rendered) == {(str(layer), f"vector({floor})") for layer, floor in floors.items()}
    assert floor_rules(rule_groups([reference])) == set()


def test_profile_series_names_are_the_ones_rendered(reference_profiles) -> None:
    """The dashboard reads PROFILE_SERIES: every name there is a rendered series (the shape limit for the
    profiles that record a healthy shape), and vice versa."""
    rendered = set().union(*(profile_series(p) for p in reference_profiles))
    assert rendered == set(dataclasses.astuple(PROFILE_SERIES))


def test_alert_names_are_unique_and_promised_ones_exist() -> None:
    assert len(set(ALERT_NAMES)) == len(ALERT_NAMES)
    assert set(ALERT_NAMES) >= PROMISED_ALERTS


def test_every_alert_is_complete(reference_profiles) -> None:
    alerts = all_alerts(rule_groups(reference_profiles))
    assert {a["alert"] for a in alerts} == set(ALERT_NAMES)
    for alert in alerts:
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning"), name
        assert re.fullmatch(r"(\d+[hms])+", alert["for"]), name
        annotations = alert["annotations"]
        assert annotations["summary"] and "{{" not in annotations["summary"], name  # static
        assert "{{" in annotations["description"], name  # templated evidence
        assert annotations["runbook_url"] == f"{config.RUNBOOK_BASE_URL}#{name.lower()}"


class _ReadLog:
    """A profile that logs which of its fields are read."""

    def __init__(self, profile: Profile) -> None:
        self._profile = profile
        self.read: set[str] = set()

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self._profile, name)


@pytest.mark.parametrize("spec", ALERTS, ids=ALERT_NAMES)
def test_spec_builds_its_own_rules_as_declared(spec: AlertSpec, reference_profiles) -> None:
    profile = _ReadLog(reference_profiles[0]) if spec.per_model else None
    timing = Timing()
    rules = spec.build(AlertBuild(spec, timing, Recorded.for_timing(timing), profile))
    assert rules and {r["alert"] for r in rules} == {spec.name}
    assert {r["labels"]["severity"] for r in rules} == set(spec.severities)
    default = spec.for_seconds(reference_profiles[0] if spec.per_model else None)
    assert {r["for"] for r in rules} == {timing(default)}
    if spec.per_model:  # the declared profile fields are exactly the ones it reads
        assert profile.read - _PROFILE_PLUMBING == set(spec.reads), spec.name
        assert set(spec.reads) <= {f.name for f in dataclasses.fields(Profile)} - _PROFILE_PLUMBING


def test_every_runbook_anchor_exists() -> None:
    headings = {
        line[3:].strip().lower()
        for line in (REPO / "docs" / "runbooks.md").read_text().splitlines()
        if line.startswith("## ")
    }
    missing = {spec.name for spec in ALERTS if spec.runbook_anchor not in headings}
    assert not missing, f"no section in docs/runbooks.md for {sorted(missing)}"


def test_every_alert_has_firing_and_silent_promtool_cases() -> None:
    firing, silent = set(), set()
    for path in TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    every_alert = set(ALERT_NAMES)
    assert firing == every_alert, every_alert - firing
    assert silent == every_alert, every_alert - silent


VLLM_DOC_SECTION = "## A model served by vLLM"


def _reads_job(expr: str, job: str) -> bool:
    """Whether a selector of `expr` (`job="x"` or `job=~"x|y"`) matches the scrape job `job`."""
    return any(job in re.split(r"[|()]", alternatives) for alternatives in re.findall(r'job=~?"([^"]*)"', expr))


def _alert_key(alert: dict) -> str:
    """`Name`, or `Name{trigger="t"}` for one trigger of an alert that has several."""
    trigger = alert["labels"].get("trigger")
    return alert["alert"] if trigger is None else f'{alert["alert"]}{{trigger="{trigger}"}}'


def _vllm_model_alerts() -> dict[str, bool]:
    """Each alert (by trigger) that can judge the vLLM-served model, in the generated rules: True when its
    expression, recording rules expanded, reads a series a vLLM deployment has (the plugin's frames
    through the exporter's job, vLLM's own through job vllm, the quality guard's through its job; there is
    no shim). Common alerts on the
    exporter alone are left out: their cases in alerts.test.yaml hold whichever engine sends the frames."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    wanted = {"layerwatch.recording", "layerwatch.common", f"layerwatch.model.{config.VLLM_SERVED_MODEL_NAME}"}
    rules = [rule for group in groups if group["name"] in wanted for rule in group["rules"]]
    recorded = {rule["record"]: rule["expr"] for rule in rules if "record" in rule}

    def expanded(expr: str) -> str:
        seen, text = set(), expr
        while names := {name for name in recorded if name not in seen and re.search(rf"{re.escape(name)}\b", text)}:
            seen |= names
            text += "".join(recorded[name] for name in names)
        return text

    verdicts: dict[str, bool] = {}
    for rule in rules:
        if "alert" not in rule:
            continue
        text = expanded(rule["expr"])
        exporter = _reads_job(text, config.EXPORTER_JOB)
        vllm = _reads_job(text, config.VLLM_JOB) or _reads_job(text, config.VLLM_GUARD_JOB)
        if "model_name" not in rule["labels"] and exporter and not vllm:
            continue  # the exporter's own health, the same whichever engine sends its frames
        key = _alert_key(rule)
        verdicts[key] = verdicts.get(key, False) or exporter or vllm
    return verdicts


def test_every_alert_a_vllm_deployment_can_raise_has_vllm_cases_and_the_others_are_named_in_the_docs() -> None:
    """For the vLLM-served model (no shim series): every alert whose rule reads the exporter's or vLLM's
    series has a promtool case firing on that model's series and one staying silent on them; every
    alert that reads only the shim's is named in docs/alerting.md's vLLM section, so that its silence
    on vLLM is documented, not mistaken for health."""
    model = config.VLLM_SERVED_MODEL_NAME
    fired, silent = set(), set()
    for path in TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            series = [s["series"] for s in test.get("input_series", [])]
            if not any(f'model_name="{model}"' in s or config.VLLM_SELECTOR in s for s in series):
                continue
            if any(config.SHIM_SELECTOR in s for s in series):
                continue  # a deployment with a shim
            for case in test.get("alert_rule_test", []):
                if not case.get("exp_alerts"):
                    silent.add(case["alertname"])
                for alert in case.get("exp_alerts") or []:
                    labels = alert["exp_labels"]
                    if labels.get("model_name", model) == model:
                        fired.add(_alert_key({"alert": case["alertname"], "labels": labels}))
    verdicts = _vllm_model_alerts()
    on_vllm = {key for key, reads_vllm_deployment in verdicts.items() if reads_vllm_deployment}
    # A limit of 0 on a ratio no series can take below 0 never fires: served at full depth, the model's
    # profile records a routing share floor and a normal skip ratio of 0 (docs/alerting.md).
    (profile,) = [p for p in load_profiles(PROFILES_DIR) if p.model_name == model]
    unfireable = {'LayerwatchRoutingStatic{trigger="share"}'} if profile.routing.share_floor == 0 else set()
    unfireable |= {"LayerwatchSkippingCollapsed"} if profile.skip_ratio_normal == 0 else set()
    assert on_vllm - unfireable - fired == set(), "no firing case on the vLLM-served model's series"
    assert {key.split("{")[0] for key in on_vllm} - silent == set(), "no silent case on its series"
    docs = (REPO / "docs" / "alerting.md").read_text().split(VLLM_DOC_SECTION, 1)[1].split("\n## ", 1)[0]
    shim_only = set(verdicts) - on_vllm
    named = set(re.findall(r"`(Layerwatch\w+(?:\{trigger=\"\w+\"\})?)`", docs))
    unnamed = {key for key in shim_only if key not in named and key.split("{")[0] not in named}
    assert unnamed == set(), "shim-only on vLLM, but not named as such in docs/alerting.md"
    assert shim_only, "every alert reads a vLLM deployment's series: the docs' shim-only list is stale"


def test_per_model_rules_use_that_models_numbers(reference_profiles) -> None:
    other = dataclasses.replace(reference_profiles[0], model_name="other", runaway_skip_ratio=0.7)
    groups = rule_groups([*reference_profiles, other])
    by_name = {g["name"]: g for g in groups["groups"]}
    runaway = [
        r["expr"] for r in by_name["layerwatch.model.other"]["rules"] if r.get("alert") == "LayerwatchRunawaySkipping"
    ]
    assert any('model_name="other"' in e and "> 0.7" in e for e in runaway), runaway
    assert all('model_name="reference"' not in r["expr"] for r in by_name["layerwatch.model.other"]["rules"])


def test_scaled_rendering_is_valid_and_renames_windows(promtool: str, tmp_path: Path, reference_profiles) -> None:
    timing = Timing(0.01)
    text = render_rules(reference_profiles, timing)
    path = tmp_path / "scaled.rules.yaml"
    path.write_text(text)
    result = run_tool(promtool, "check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    names = Recorded.for_timing(timing)
    assert names.entropy_mean == "model_name:layerwatch_entropy:mean_rate3s"
    assert f"record: {names.entropy_mean}" in text and "[5m]" not in text
    assert "for: 6s" in text  # ShapeChanged's 10m
