"""The alert state as the demo and `top --prometheus` write it (demo/alert_view.py, alerts/signals.py):
every trigger that can page has its figure on screen, marked when past its limit, and the figures say
what they are, so that a newcomer can tell which figure crossed which limit."""

from __future__ import annotations

import pytest
import yaml

from layerwatch.alerts.durations import Timing
from layerwatch.alerts.profile_file import PROFILES_DIR, load_profile, load_profiles
from layerwatch.alerts.recorded import Recorded
from layerwatch.alerts.rules import model_rules, recorded_names, rule_groups
from layerwatch.alerts.signals import figures_for
from layerwatch.demo.alert_view import PAST, RESTART_NOTE, PrometheusAlert, Snapshot
from layerwatch.demo.receiver import Notification, WebhookReceiver
from layerwatch.demo.stack import DEMO_LATENCY_OBJECTIVES, DEMO_TIMING, render_config
from layerwatch.mixin import config
from layerwatch.promql import check_queries, known_series

PROFILE = load_profile(PROFILES_DIR / "demo.yaml")
MODEL = PROFILE.model_name
NOW = 1_000.0


def snapshot(figures: dict[str, float], alerts: list[PrometheusAlert] = (), **extra: object) -> Snapshot:
    return Snapshot(
        "http://127.0.0.1:9090",
        alerts=list(alerts),
        figures={(MODEL, label): value for label, value in figures.items()},
        profiles={MODEL: PROFILE},
        taken_at=NOW,
        window=DEMO_TIMING.rules(config.RATE_WINDOW),
        **extra,  # type: ignore[arg-type]
    )


def figure_line(lines: list[str], label: str) -> str:
    (line,) = [line for line in lines if line.startswith(f"  {label} ")]
    return line


@pytest.mark.parametrize("profile", load_profiles(PROFILES_DIR), ids=lambda p: p.model_name)
def test_every_rule_that_pages_has_its_figure_on_screen(profile):
    rules = [rule for rule in model_rules(profile, Timing()) if "alert" in rule]
    paging = {
        (rule["alert"], rule["labels"].get("trigger"))
        for rule in rules
        if rule["labels"]["severity"] == config.SEVERITY_PAGE
    }
    shown = {(figure.alert, figure.trigger) for figure in figures_for(profile) if figure.alert}
    # Every page has its figure, and every figure shown reads a rule of this profile's (the single-peak
    # figures only where the healthy shape has two humps, the shape distance where it is recorded).
    assert paging - shown == set()
    assert shown - {(rule["alert"], rule["labels"].get("trigger")) for rule in rules} == set()
    # The collapse floor pages nobody (a ticket) but is the skip ratio's other limit.
    assert ("LayerwatchSkippingCollapsed", None) in shown


def test_every_figure_reads_series_that_exist():
    recorded = Recorded.for_timing(DEMO_TIMING.rules)
    known = known_series(recorded_names(rule_groups(load_profiles(PROFILES_DIR), DEMO_TIMING.rules)))
    for profile in load_profiles(PROFILES_DIR):
        check_queries([(figure.label, figure.query(recorded, profile)) for figure in figures_for(profile)], known)


def test_the_runaway_drill_shows_its_fallbacks_past_the_limit_and_a_low_skip_ratio_unmarked():
    """The runaway drill paged on fallbacks while the screen showed a skip ratio of 0.164, unmarked, and
    no fallback figure at all."""
    firing = PrometheusAlert(
        "LayerwatchRunawaySkipping",
        "firing",
        {"model_name": MODEL, "severity": "critical", "trigger": "fallbacks"},
        12.0,
    )
    figures = {"skip ratio": 0.164, "fallbacks per minute": 41.5, "skip ratio, collapse floor": 0.164}
    lines = snapshot(figures, [firing]).lines(MODEL)
    assert figure_line(lines, "fallbacks per minute").endswith(
        f"41.5  ≤ 0.0    {PAST}LayerwatchRunawaySkipping (fallbacks)"
    )
    assert figure_line(lines, "skip ratio").endswith("0.164  ≤ 0.850  LayerwatchRunawaySkipping (skip_ratio)")
    # Above the collapse floor (0.5 of the healthy 0.2534) too: skipping has not collapsed.
    assert figure_line(lines, "skip ratio, collapse floor").endswith("0.164  ≥ 0.127  LayerwatchSkippingCollapsed")
    # Its mark within 80 columns: after the alert's name (up to 108) it was cut off the edge.
    assert figure_line(lines, "fallbacks per minute").index(PAST) + len(PAST) < 80


def test_a_short_terminal_shows_the_figures_past_their_limit_first_and_the_notifications_last():
    """In 80 × 24 the runaway drill's screen ended at the table's heading: five notifications above it,
    and the fallbacks, the figure that paged, sixth in the table."""
    firing = PrometheusAlert("LayerwatchRunawaySkipping", "firing", {"model_name": MODEL, "trigger": "fallbacks"}, 9.0)
    page = Notification(NOW - 5.0, "/pager", {"alerts": [{"labels": firing.labels, "status": "firing"}]})
    figures = {"skip ratio": 0.164, "fallbacks per minute": 41.5, "token-dependent share": 0.0}
    view = snapshot(figures, [firing], notifications=[page])
    compact = view.compact_lines(MODEL)
    heading = compact.index("what the pages read (rates: last 3s; routing, peaks: the exporter's window)")
    past = [figure_line(compact, "token-dependent share"), figure_line(compact, "fallbacks per minute")]
    assert compact[heading + 2 : heading + 4] == past and all(PAST in line for line in past), compact
    assert compact[heading + 4] == figure_line(compact, "newly static layers"), compact  # then the table's order
    assert compact[-2:] == ["notifications delivered (Alertmanager → this demo's receiver)", compact[-1]]
    assert sorted(compact) == sorted(view.lines(MODEL))  # the same lines, reordered


def test_the_figures_say_their_unit_window_and_what_the_profile_expects():
    lines = snapshot(
        {
            "est. perplexity increase": 0.029,
            "newly static layers": 1.0,
            "entropy peaks": 1.0,
            "dip test p-value": 0.41,
            "token-dependent share": 0.62,
        }
    ).lines(MODEL)
    assert "what the pages read (rates: last 3s; routing, peaks: the exporter's window)" in lines
    assert figure_line(lines, "est. perplexity increase").endswith("+2.9 %  none     (no alert reads it: context)")
    assert figure_line(lines, "newly static layers").endswith(
        f"1  ≤ 0      {PAST}LayerwatchRoutingStatic (new_static_layers)"
    )
    single_peak = "LayerwatchEntropyShapeChanged (single_peak)"
    assert figure_line(lines, "entropy peaks").endswith(f"1  ≥ 2      {PAST}{single_peak}")
    assert figure_line(lines, "dip test p-value").endswith(f"0.410  ≤ 0.050  {PAST}{single_peak}")
    assert PAST not in figure_line(lines, "token-dependent share")
    assert figure_line(lines, "shadow agreement").endswith("-  ≥ 0.796  LayerwatchShadowAgreementLow")


def test_the_drills_own_restart_of_the_shim_is_marked_expected_on_the_alert_and_the_page():
    shim = "127.0.0.1:8000"
    down = {"alertname": "LayerwatchTargetDown", "instance": shim, "job": "layerwatch-shim", "severity": "critical"}
    page = Notification(NOW - 5.0, "/pager", {"alerts": [{"labels": down, "status": "firing"}]})
    restart = (shim, NOW - 20.0)
    alerts = [
        PrometheusAlert("LayerwatchTargetDown", "firing", down, 15.0),
        PrometheusAlert("LayerwatchTargetDown", "firing", down | {"instance": "127.0.0.1:9411"}, 15.0),
    ]
    lines = snapshot({}, alerts, notifications=[page], restart=restart).lines(MODEL)
    marked = [line for line in lines if RESTART_NOTE in line]
    assert len(marked) == 2, lines  # the shim's alert and its page; not the exporter's
    assert "critical (expected: the drill's restart) 127.0.0.1:8000" in marked[0]
    assert marked[0].index("(expected") < 70  # in sight in 80 columns (after the target, it began at 76)
    assert "pager  LayerwatchTargetDown (expected: the drill's restart)" in marked[1]
    # A target down that began before the restart is news.
    lines = snapshot({}, alerts[:1], restart=(shim, NOW - 10.0)).lines(MODEL)
    assert not [line for line in lines if RESTART_NOTE in line]


def test_the_demos_alertmanager_repeats_a_page_after_production_hours_not_every_36_seconds(tmp_path):
    receiver = WebhookReceiver()
    try:
        stack = render_config(tmp_path, [PROFILE], "http://127.0.0.1:1", "http://127.0.0.1:2", receiver, "127.0.0.1:3")
    finally:
        receiver.close()
    route = yaml.safe_load(stack.alertmanager_config.read_text())["route"]
    pager = next(r for r in route["routes"] if r["receiver"] == "pager")
    assert (pager["repeat_interval"], route["repeat_interval"]) == ("1h", "4h")
    assert (route["group_wait"], route["group_interval"]) == ("300ms", "3s")  # the rest stays scaled


def test_the_demos_rules_judge_vllms_latency_by_the_demos_objectives_and_production_by_its_own(tmp_path):
    receiver = WebhookReceiver()
    try:
        stack = render_config(
            tmp_path, [PROFILE], "http://127.0.0.1:1", "http://127.0.0.1:2", receiver, "127.0.0.1:3", engine="vllm"
        )
    finally:
        receiver.close()

    def limits(groups: dict) -> dict[str, float]:
        rules = [r for g in groups["groups"] for r in g["rules"] if r.get("alert") == "LayerwatchVllmLatencyHigh"]
        return {r["labels"]["trigger"]: float(r["expr"].rsplit(">", 1)[1]) for r in rules}

    demo = DEMO_LATENCY_OBJECTIVES
    assert limits(yaml.safe_load(stack.rules.read_text())) == {
        "time_to_first_token": demo.time_to_first_token_max,
        "inter_token": demo.inter_token_latency_max,
    }
    production = config.VLLM_LATENCY_OBJECTIVES
    assert limits(rule_groups([PROFILE])) == {
        "time_to_first_token": production.time_to_first_token_max,
        "inter_token": production.inter_token_latency_max,
    }
    assert demo.inter_token_latency_max > production.inter_token_latency_max
