"""The generated rules: promtool accepts them, the promtool unit tests pass (and depend on the
profile's numbers), and every CONTRACT alert is complete and tested."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import yaml

from mixin import config
from alerts.durations import Timing
from alerts.recorded import Recorded
from alerts.rules import render_rules, rule_groups

from .conftest import REPO, run_tool

RULES = REPO / "alerts" / "generated" / "layerwatch.rules.yaml"
TESTS = sorted((REPO / "alerts" / "tests").glob("*.test.yaml"))
CONTRACT_ALERTS = {
    "LayerwatchEntropySinglePeak", "LayerwatchRunawaySkipping", "LayerwatchSkipRateSurge",
    "LayerwatchEntropyMeanOutOfBand", "LayerwatchEntropySpreadOutOfBand",
    "LayerwatchZeroEntropyRatioHigh", "LayerwatchEntropyDrift", "LayerwatchGateWeightsChanged",
    "LayerwatchShadowAgreementLow", "LayerwatchTelemetryLoss", "LayerwatchTargetDown",
}


def all_alerts(groups: dict) -> list[dict]:
    return [r for g in groups["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules_is_clean(promtool: str) -> None:
    result = run_tool(promtool, "check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "WARNING" not in result.stdout + result.stderr


def test_promtool_unit_tests_pass(promtool: str) -> None:
    assert TESTS, "no promtool tests in alerts/tests"
    result = run_tool(promtool, "test", "rules", *TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_unit_tests_depend_on_the_profile_numbers(promtool: str, tmp_path: Path,
                                                  reference_profiles) -> None:
    """Rules generated with another runaway limit must fail the same promtool tests."""
    (tmp_path / "generated").mkdir()
    shutil.copytree(REPO / "alerts" / "tests", tmp_path / "tests")
    # The copy finds its rule file: the profile's own numbers pass there.
    (tmp_path / "generated" / RULES.name).write_text(render_rules(reference_profiles))
    result = run_tool(promtool, "test", "rules", tmp_path / "tests" / "alerts.test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    shifted = [dataclasses.replace(p, runaway_skip_ratio=0.87) for p in reference_profiles]
    (tmp_path / "generated" / RULES.name).write_text(render_rules(shifted))
    result = run_tool(promtool, "test", "rules", tmp_path / "tests" / "alerts.test.yaml")
    assert result.returncode != 0
    assert "LayerwatchRunawaySkipping" in result.stdout + result.stderr


def test_every_contract_alert_is_complete(reference_profiles) -> None:
    alerts = all_alerts(rule_groups(reference_profiles))
    assert {a["alert"] for a in alerts} == set(config.ALERT_NAMES)
    assert CONTRACT_ALERTS <= set(config.ALERT_NAMES)
    for alert in alerts:
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning"), name
        assert re.fullmatch(r"(\d+[hms])+", alert["for"]), name
        annotations = alert["annotations"]
        assert annotations["summary"] and "{{" not in annotations["summary"], name  # static
        assert "{{" in annotations["description"], name  # templated evidence
        assert annotations["runbook_url"] == f"{config.RUNBOOK_BASE_URL}#{name.lower()}"


def test_every_runbook_anchor_exists() -> None:
    headings = {line[3:].strip().lower() for line in
                (REPO / "docs" / "runbooks.md").read_text().splitlines() if line.startswith("## ")}
    assert {name.lower() for name in config.ALERT_NAMES} <= headings


def test_every_alert_has_firing_and_silent_promtool_cases() -> None:
    firing, silent = set(), set()
    for path in TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    every_alert = set(config.ALERT_NAMES)
    assert firing == every_alert, every_alert - firing
    assert silent == every_alert, every_alert - silent


def test_per_model_rules_use_that_models_numbers(reference_profiles) -> None:
    other = dataclasses.replace(reference_profiles[0], model_name="other", runaway_skip_ratio=0.7)
    groups = rule_groups([*reference_profiles, other])
    by_name = {g["name"]: g for g in groups["groups"]}
    runaway = [r["expr"] for r in by_name["layerwatch.model.other"]["rules"]
               if r.get("alert") == "LayerwatchRunawaySkipping"]
    assert any('model_name="other"' in e and "> 0.7" in e for e in runaway), runaway
    assert all('model_name="reference"' not in r["expr"]
               for r in by_name["layerwatch.model.other"]["rules"])


def test_scaled_rendering_is_valid_and_renames_windows(promtool: str, tmp_path: Path,
                                                       reference_profiles) -> None:
    timing = Timing(0.01)
    text = render_rules(reference_profiles, timing)
    path = tmp_path / "scaled.rules.yaml"
    path.write_text(text)
    result = run_tool(promtool, "check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    names = Recorded.for_timing(timing)
    assert names.entropy_mean == "model_name:layerwatch_entropy:mean_rate3s"
    assert f"record: {names.entropy_mean}" in text and "[5m]" not in text
    assert "for: 6s" in text  # SinglePeak's 10m
