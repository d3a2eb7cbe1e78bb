"""End to end: real Prometheus and Alertmanager, configured by the repo's own deploy code,
scraping a real `layerwatch serve` and `layerwatch exporter` under generated load.

One stack per module (`stack` fixture); the tests are phases and run in file order:
1. a healthy baseline fires no layerwatch alert;
2. the shim restarted with `--static-gates` (gating degraded into static pruning, two entropy humps
   kept) pages LayerwatchRoutingStatic while LayerwatchEntropyShapeChanged stays silent;
3. the shim restarted with `--threshold 0.95` pages LayerwatchRunawaySkipping (the fallback
   breaker trips over and over);
   3a. the shim restarted with `--threshold 0.95 --protected-layers 0,1,15` (13 of 16 layers skipped
   on every token, under the breaker's line, so nothing limits the damage) pages
   LayerwatchShadowQualityCost;
   3b. the shim restarted with `--shadow-rate 0` (the demo profile expects checks) tickets
   LayerwatchQualityGuardBlind;
4. back to healthy, a small category of garbled transcripts (layerwatch.demo.loadgen.STUTTER) pages
   LayerwatchRequestTailRunaway while the global skip ratio barely moves;
5. every alert resolves (the static gates' hash leaves the gate change's window); then the shim
   restarted with `--reset-gates` (the field's "gate weights overwritten" incident) pages
   LayerwatchEntropyShapeChanged and tickets LayerwatchGateWeightsChanged; the fresh gates skip
   nothing, so the quality guard measures no cost and its pages stay silent;
6. the shim restarted with `--shuffle-gates` (every gate on another layer) pages
   LayerwatchGateMiscalibrated from the shadow check's layer signals;
7. the shim restarted with `--scramble-gates` (each gate on its layer, reading a permuted hidden
   state) pages LayerwatchGateMiscalibrated too, naming the layers below their floors;
8. every query of every dashboard panel returns data from this Prometheus.
The load is sampled only (temperature 1.0 and 0.7, layerwatch.demo.loadgen.TEMPERATURES): the shadow check
compares requests at any temperature.
Arrival is asserted through Alertmanager's API v2 and through the webhook receivers the rendered
alertmanager.yml routes to (a loopback HTTP server standing in for the pager and ticket bridges).

The configuration is `layerwatch.deploy.render.render_stack` with every window, `for:` and Alertmanager
wait scaled by TIME_SCALE. The time from each fault to its page is printed at the end (run with -s)
and recorded in docs/end-to-end.md.

The shim serves the embedded demo model; its alerts come from its committed, calibrated profile
(layerwatch/alerts/profiles/demo.yaml), rendered together with every other committed profile as in production.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from layerwatch.alerts.durations import Timing, parse_duration
from layerwatch.alerts.profile import Profile
from layerwatch.alerts.profile_file import load_profiles
from layerwatch.alerts.recorded import Recorded
from layerwatch.alerts.rules import PROFILE_SERIES
from layerwatch.alerts.specs import AGREEMENT_NOISE_Z
from layerwatch.demo.loadgen import STUTTER, Category, LoadReport, run_load
from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.demo.receiver import WebhookReceiver
from layerwatch.deploy.render import render_stack
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from layerwatch.inference_shim.service.power import NvmlReader, find_rapl_zones
from layerwatch.mixin import config

from .conftest import REPO
from .support import (
    EVALUATION_INTERVAL,
    EXPORTER_WINDOW_SECONDS,
    FAULT_TIMEOUT,
    SCRAPE_INTERVAL,
    TIME_SCALE,
    Load,
    alertmanager_alerts,
    alertmanager_argv,
    dashboard_expr,
    exporter_argv,
    prometheus_api,
    prometheus_argv,
    receiver,
    shim_argv,
    start_processes,
    values,
)

pytestmark = pytest.mark.e2e

PROFILES_DIR = REPO / "layerwatch" / "alerts" / "profiles"


# --- the stack -----------------------------------------------------------------------------------


@dataclass
class Page:
    """How long one fault took to reach Alertmanager and its receiver."""

    fault: str
    alertname: str
    severity: str
    for_seconds: float
    injected_at: float  # monotonic: the restart that injects the fault began
    serving_at: float  # the restarted shim answered /readyz
    in_alertmanager_at: float
    notified_at: float | None  # the receiver's webhook got it

    def row(self) -> str:
        notified = "-" if self.notified_at is None else f"{self.notified_at - self.injected_at:.1f}"
        return (
            f"| {self.fault} | {self.alertname} | {self.severity} | {self.for_seconds:g} | "
            f"{self.serving_at - self.injected_at:.1f} | {self.in_alertmanager_at - self.injected_at:.1f} "
            f"| {notified} |"
        )


@dataclass
class Stack:
    workdir: Path
    profile: Profile  # the served model's
    webhooks: WebhookReceiver
    rules: dict = field(default_factory=dict)  # the rendered rule file
    shim_port: int = field(default_factory=free_port)
    exporter_udp_port: int = field(default_factory=lambda: free_port(socket.SOCK_DGRAM))
    exporter_http_port: int = field(default_factory=free_port)
    prometheus_port: int = field(default_factory=free_port)
    alertmanager_port: int = field(default_factory=free_port)
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    load: Load | None = None
    load_started_at: float = 0.0  # monotonic
    pages: list[Page] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # (monotonic, what happened)
    shim_restarts: int = 0

    @property
    def model_name(self) -> str:
        return self.profile.model_name

    @property
    def shim_instance(self) -> str:
        return f"127.0.0.1:{self.shim_port}"

    @property
    def exporter_instance(self) -> str:
        return f"127.0.0.1:{self.exporter_http_port}"

    def shim(self, *extra: str) -> tuple[str, list[str], str]:
        """The shim's name, command line with `extra` and ready URL, for start_processes."""
        return "shim", shim_argv(self.shim_port, self.exporter_udp_port, *extra), f"http://{self.shim_instance}/readyz"

    def start_shim(self, *extra: str) -> None:
        start_processes(self.workdir, self.processes, self.shim(*extra))

    def restart_shim(self, *extra: str) -> tuple[float, float]:
        """Replace the shim by one started with `extra`, at the same address (the same target).

        Returns when the restart began and when the new shim was ready (monotonic)."""
        began = time.monotonic()
        self.events.append((began, f"shim restart with {' '.join(extra)} begins"))
        old = self.processes.pop("shim")
        old.stop()
        self.shim_restarts += 1
        old.log_path.rename(self.workdir / f"shim-{self.shim_restarts}.log")
        self.start_shim(*extra)
        ready = time.monotonic()
        self.events.append((ready, "restarted shim ready"))
        return began, ready

    def prometheus(self, path: str, **params: str) -> dict | list:
        return prometheus_api(f"http://127.0.0.1:{self.prometheus_port}", path, **params)

    def query(self, expr: str) -> list[dict]:
        return self.prometheus("/api/v1/query", query=expr)["result"]

    def alertmanager_alerts(self, alertname: str | None = None) -> list[dict]:
        return alertmanager_alerts(f"http://127.0.0.1:{self.alertmanager_port}", alertname)

    def alert_rules(self) -> list[dict]:
        """The rendered alerting rules that apply to the served model."""
        groups = ("layerwatch.common", f"layerwatch.model.{self.model_name}")
        return [
            rule
            for group in self.rules["groups"]
            if group["name"] in groups
            for rule in group["rules"]
            if "alert" in rule
        ]

    def for_seconds(self, alertname: str) -> float:
        (duration,) = {rule["for"] for rule in self.alert_rules() if rule["alert"] == alertname}
        return parse_duration(duration)

    def wait_for_pages(
        self, fault: str, alertnames: list[str], injected_at: float, serving_at: float
    ) -> dict[str, dict]:
        """Poll Alertmanager until every alert is active there (not inhibited) and its receiver was
        notified; record the times. Returns each alert as Alertmanager holds it."""
        deadline = time.monotonic() + FAULT_TIMEOUT
        arrived: dict[str, tuple[float, dict]] = {}
        while time.monotonic() < deadline:
            for name in alertnames:
                if name not in arrived:
                    active = [
                        a
                        for a in self.alertmanager_alerts(name)
                        if a["status"]["state"] == "active" and a["labels"].get("model_name") == self.model_name
                    ]
                    if active:
                        arrived[name] = (time.monotonic(), active[0])
            notified = {
                name: self.webhooks.first_firing(receiver(alert), name, injected_at)
                for name, (_, alert) in arrived.items()
            }
            if len(arrived) == len(alertnames) and all(t is not None for t in notified.values()):
                break
            time.sleep(0.2)
        for name, (at, alert) in arrived.items():
            self.pages.append(
                Page(
                    fault,
                    name,
                    alert["labels"]["severity"],
                    self.for_seconds(name),
                    injected_at,
                    serving_at,
                    at,
                    self.webhooks.first_firing(receiver(alert), name, injected_at),
                )
            )
        missing = sorted(set(alertnames) - set(arrived))
        assert not missing, (
            f"{missing} not active in Alertmanager {FAULT_TIMEOUT:.0f}s after {fault}\n{self.diagnostics()}"
        )
        return {name: alert for name, (_, alert) in arrived.items()}

    def layerwatch_alerts(self) -> list[dict]:
        """Every layerwatch alert Prometheus holds (pending or firing), as its API gives them."""
        return [
            a for a in self.prometheus("/api/v1/alerts")["alerts"] if a["labels"]["alertname"].startswith("Layerwatch")
        ]

    def diagnostics(self) -> str:
        """What each side holds, and the tail of every log."""
        prometheus = [(a["labels"]["alertname"], a["state"]) for a in self.layerwatch_alerts()]
        alertmanager = [(a["labels"]["alertname"], a["status"]["state"]) for a in self.alertmanager_alerts()]
        logs = "\n".join(f"--- {name} log:\n{process.log_tail(15)}" for name, process in self.processes.items())
        return f"Prometheus alerts: {prometheus}\nAlertmanager alerts: {alertmanager}\n{logs}"

    def timeline(self) -> str:
        """Restarts and every notification the receivers got, in seconds since the load started."""
        events = self.events + [
            (
                n.received_at,
                f"{n.receiver} {n.payload['status']}: "
                + ", ".join(sorted({f"{a['labels']['alertname']} ({a['status']})" for a in n.payload["alerts"]})),
            )
            for n in self.webhooks.notifications
        ]
        start = self.events[0][0]
        return "\n".join(f"{at - start:7.1f}s  {what}" for at, what in sorted(events))

    def stop(self) -> None:
        if self.load is not None:
            self.load.stop()
        for process in reversed(list(self.processes.values())):
            process.stop()
        self.webhooks.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, prometheus_binary: str, alertmanager_binary: str) -> Iterator[Stack]:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the embedded demo model is missing: {DEMO_MODEL_DIR}")
    workdir = tmp_path_factory.mktemp("e2e-stack")
    profiles = load_profiles(PROFILES_DIR)
    served = [p for p in profiles if p.model_name == DEMO_MODEL_NAME]
    if not served:
        pytest.fail(f"no profile for {DEMO_MODEL_NAME} in {PROFILES_DIR}")
    webhooks = WebhookReceiver()
    s = Stack(workdir, served[0], webhooks)
    rendered = render_stack(
        workdir / "config",
        profiles=profiles,
        shim_targets=[s.shim_instance],
        exporter_targets=[s.exporter_instance],
        alertmanager_target=f"127.0.0.1:{s.alertmanager_port}",
        pager_url=webhooks.url("/pager"),
        ticket_url=webhooks.url("/ticket"),
        scrape_interval=SCRAPE_INTERVAL,
        evaluation_interval=EVALUATION_INTERVAL,
        time_scale=TIME_SCALE,
    )
    s.rules = yaml.safe_load(rendered.rules.read_text())
    try:
        start_processes(
            workdir,
            s.processes,
            (
                "alertmanager",
                alertmanager_argv(alertmanager_binary, rendered.alertmanager_config, workdir, s.alertmanager_port),
                f"http://127.0.0.1:{s.alertmanager_port}/-/ready",
            ),
            (
                "exporter",
                exporter_argv(s.exporter_udp_port, s.exporter_instance),
                f"http://{s.exporter_instance}/healthz",
            ),
            s.shim(),
        )
        # Prometheus last: from its first scrape on, every target is up (no TargetDown at start).
        start_processes(
            workdir,
            s.processes,
            (
                "prometheus",
                prometheus_argv(prometheus_binary, rendered.prometheus_config, workdir, s.prometheus_port),
                f"http://127.0.0.1:{s.prometheus_port}/-/ready",
            ),
        )
        s.load = Load(f"http://{s.shim_instance}", s.model_name)
        s.load_started_at = time.monotonic()
        s.events.append((s.load_started_at, "load started"))
        yield s
    finally:
        s.stop()
        if s.pages:
            print(
                "\n\ntime to page (seconds after the restart that injected the fault; "
                f"time scale {TIME_SCALE}, scrape {SCRAPE_INTERVAL:g}s, evaluation {EVALUATION_INTERVAL:g}s, "
                f"exporter window {EXPORTER_WINDOW_SECONDS:g}s)\n"
                "| fault | alert | severity | scaled `for` (s) | shim serving | in Alertmanager "
                "| receiver notified |\n"
                "|---|---|---|---|---|---|---|\n" + "\n".join(p.row() for p in s.pages)
            )
        if s.events:
            print(f"\ntimeline:\n{s.timeline()}")
        if s.load is not None:
            print("load: " + "; ".join(r.summary() for r in s.load.reports))
        print(f"logs and rendered configuration: {workdir}")


# --- phase 1: a healthy baseline -----------------------------------------------------------------


def _baseline_until(stack: Stack) -> float:
    """When the healthy baseline has been watched long enough (monotonic), asked once its last signal,
    the gate-importance correlation, is measured: every alert's scaled `for:` has passed over full
    windows of the load, and since that signal too."""
    longest_for = max(parse_duration(rule["for"]) for rule in stack.alert_rules())
    longest_window = max(
        TIME_SCALE * config.RATE_WINDOW, TIME_SCALE * stack.profile.drift.window, EXPORTER_WINDOW_SECONDS
    )
    settle = longest_for + 3 * EVALUATION_INTERVAL
    return max(stack.load_started_at + longest_window + settle, time.monotonic() + settle)


def test_healthy_baseline_fires_no_alert(stack: Stack) -> None:
    # The gate-importance correlation needs a full buffer per layer (GATE_LAYER_SAMPLES shadow-checked
    # positions, about 20 s of this load): the baseline is watched once it is measured.
    headline = f'layerwatch_gate_importance_correlation{{model_name="{stack.model_name}"}}'
    assert _wait_for_data(stack, headline, FAULT_TIMEOUT), f"no {headline} within {FAULT_TIMEOUT:.0f}s"
    deadline = _baseline_until(stack)
    fired: dict[str, str] = {}  # alertname -> its description (the evidence)
    while time.monotonic() < deadline:
        fired.update(
            (a["labels"]["alertname"], a["annotations"]["description"])
            for a in stack.layerwatch_alerts()
            if a["state"] == "firing"
        )
        time.sleep(EVALUATION_INTERVAL)

    # The baseline was really watched: both targets up, every rule evaluates, traffic and skipping
    # are measured, and the exporter's window is full enough for a verdict, which is "bimodal".
    targets = stack.prometheus("/api/v1/targets")["activeTargets"]
    assert sorted((t["labels"]["job"], t["health"]) for t in targets) == [
        (config.EXPORTER_JOB, "up"),
        (config.SHIM_JOB, "up"),
    ], targets
    rules = [rule for group in stack.prometheus("/api/v1/rules")["groups"] for rule in group["rules"]]
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    model = f'model_name="{stack.model_name}"'
    recorded = Recorded.for_timing(Timing(TIME_SCALE))
    skip_ratio = values(stack.query(f"{recorded.skip_ratio}{{{model}}}"))
    assert skip_ratio and 0 < skip_ratio[0] < stack.profile.runaway_skip_ratio, skip_ratio
    assert (
        values(stack.query(f"layerwatch_entropy_window_observations{{{model}}}"))[0]
        >= stack.profile.bimodality.min_observations
    )
    assert values(stack.query(f"layerwatch_entropy_bimodal{{{model}}}")) == [1.0]
    # The shadow check measured the gates against their layers, and they track them.
    correlation = values(stack.query(f"layerwatch_gate_importance_correlation{{{model}}}"))
    assert correlation and correlation[0] > stack.profile.gate_importance.correlation_min, correlation
    print(f"\nhealthy gates: gate-importance correlation {correlation[0]:.3f}")
    # ... and the sampled traffic against the full-depth model, within the profile's limits.
    quality = _shadow_quality(stack)
    # Within the agreement's sampling noise as the alert judges it (a few hundred tokens a window).
    a, n = quality["agreement"], quality["tokens"]
    assert n > 0 and a + AGREEMENT_NOISE_Z * math.sqrt(a * (1 - a) / n) >= stack.profile.shadow_agreement_min, quality
    assert 0 < quality["nats per token"] < stack.profile.shadow_kl_nats_max, quality
    print(f"healthy shadow check: {_quality_text(quality)}")

    assert fired == {}, f"alerts fired on the healthy baseline: {fired}"
    assert stack.layerwatch_alerts() == []
    assert stack.alertmanager_alerts() == []
    assert stack.webhooks.notifications == []


# --- phase 2: static pruning (the gates stop routing per token) --------------------------------------


def _watch_alerts(stack: Stack, until: float) -> set[str]:
    """Poll Prometheus every evaluation until `until` (monotonic): the layerwatch alerts seen firing."""
    firing: set[str] = set()
    while time.monotonic() < until:
        firing |= {a["labels"]["alertname"] for a in stack.layerwatch_alerts() if a["state"] == "firing"}
        time.sleep(EVALUATION_INTERVAL)
    return firing


def _wait_until_quiet(stack: Stack, timeout: float) -> None:
    """Until neither Prometheus nor Alertmanager holds a layerwatch alert (all resolved)."""
    deadline = time.monotonic() + timeout
    while stack.layerwatch_alerts() or stack.alertmanager_alerts():
        assert time.monotonic() < deadline, f"alerts did not resolve within {timeout:.0f}s\n{stack.diagnostics()}"
        time.sleep(EVALUATION_INTERVAL)


def test_static_gates_page_routing_static_while_single_peak_stays_silent(stack: Stack) -> None:
    _wait_for_data(stack, f'layerwatch_model_info{{instance="{stack.shim_instance}"}}')  # run alone: first scrape
    (healthy_sha,) = _served_hashes(stack)
    injected, serving = stack.restart_shim("--static-gates")
    alerts = stack.wait_for_pages("static gates (`--static-gates`)", ["LayerwatchRoutingStatic"], injected, serving)
    routing = alerts["LayerwatchRoutingStatic"]
    assert routing["labels"]["severity"] == "critical"
    assert routing["labels"]["instance"] == stack.exporter_instance  # the exporter's routing statistics

    # The single-peak alert stays silent: the constants keep the two humps. Watched until its own
    # `for:` has run on a window that holds nothing but the static gates' entropies.
    watch_until = serving + EXPORTER_WINDOW_SECONDS + stack.for_seconds("LayerwatchEntropyShapeChanged")
    fired = _watch_alerts(stack, watch_until + 3 * EVALUATION_INTERVAL)
    assert "LayerwatchEntropyShapeChanged" not in fired, stack.diagnostics()
    assert "LayerwatchRoutingStatic" in fired
    assert not stack.alertmanager_alerts("LayerwatchEntropyShapeChanged")
    model = f'model_name="{stack.model_name}"'
    assert values(stack.query(f"layerwatch_entropy_bimodal{{{model}}}")) == [1.0]  # two humps ...
    assert values(stack.query(f"layerwatch_routing_dynamic{{{model}}}")) == [0.0]  # ... but static
    assert values(stack.query(f"layerwatch_routing_token_dependent_share{{{model}}}")) == [0.0]
    (static_sha,) = _served_hashes(stack)
    assert static_sha != healthy_sha

    # Both triggers: the share fell below the floor, and layers outside the baseline's static ones
    # (12, 13, 14 for the demo model) turned static, named in the description.
    deadline = time.monotonic() + FAULT_TIMEOUT
    while True:
        by_trigger = {a["labels"]["trigger"]: a for a in stack.alertmanager_alerts("LayerwatchRoutingStatic")}
        if set(by_trigger) == {"share", "new_static_layers"} or time.monotonic() > deadline:
            break
        time.sleep(EVALUATION_INTERVAL)
    assert set(by_trigger) == {"share", "new_static_layers"}, stack.diagnostics()
    description = by_trigger["new_static_layers"]["annotations"]["description"]
    named = {int(layer) for layer in re.findall(r"(\d+) \(\d\.\d{3}\)", description.split("(static in the")[0])}
    static_now = {int(s["metric"]["layer"]) for s in stack.query(f"layerwatch_routing_layer_static{{{model}}} == 1")}
    assert named and named <= static_now - set(stack.profile.routing.static_layers), (named, static_now)
    stack.events.append((time.monotonic(), f"static layers {sorted(static_now)}"))


def _served_hashes(stack: Stack) -> set[str]:
    return {
        s["metric"]["gates_sha256"] for s in stack.query(f'layerwatch_model_info{{instance="{stack.shim_instance}"}}')
    }


def _shadow_quality(stack: Stack) -> dict[str, float]:
    """The shim's shadow check over the scaled rate window, from the recorded series."""
    recorded, shim = Recorded.for_timing(Timing(TIME_SCALE)), f'instance="{stack.shim_instance}"'
    window = f"{TIME_SCALE * config.RATE_WINDOW:g}s"
    queries = {
        "agreement": f"{recorded.shadow_agreement_ratio}{{{shim}}}",
        "nats per token": f"{recorded.shadow_kl_per_token}{{{shim}}}",
        "perplexity increase": f"{recorded.shadow_perplexity_increase}{{{shim}}}",
        "tokens": f"sum(increase(layerwatch_shadow_tokens_total{{{shim}}}[{window}]))",
    }
    return {what: next(iter(values(_wait_for_data(stack, expr))), math.nan) for what, expr in queries.items()}


def _quality_text(quality: dict[str, float]) -> str:
    return ", ".join(f"{what} {value:.4g}" for what, value in quality.items())


# --- phase 3: a threshold misconfigured to 0.95 -------------------------------------------------------


def test_threshold_095_pages_runaway_skipping(stack: Stack) -> None:
    injected, serving = stack.restart_shim("--threshold", "0.95")
    alerts = stack.wait_for_pages(
        "threshold 0.95 (`--threshold 0.95`)", ["LayerwatchRunawaySkipping"], injected, serving
    )
    runaway = alerts["LayerwatchRunawaySkipping"]
    assert runaway["labels"]["severity"] == "critical"
    assert runaway["labels"]["instance"] == stack.shim_instance
    # Every unprotected layer below 0.95 is 14 of 16 layers skipped, over the breaker's 85 %: it trips
    # every 22 tokens or so (its figure: fallbacks per minute, against the demo profile's 0).
    assert runaway["labels"]["trigger"] == "fallbacks"
    assert stack.query(f'layerwatch_model_info{{instance="{stack.shim_instance}", threshold="0.95"}}')


# --- phase 3a: skipping whose damage nothing limits ---------------------------------------------------


def test_breaker_out_of_reach_pages_quality_cost(stack: Stack) -> None:
    """At 0.95 with the default protection the breaker forces full depth on most tokens (offline 0.14
    of layer evaluations skipped, 84 fallbacks in 1,500 tokens), and the quality cost per token comes
    out near its limit (0.0775 nats against 0.0693 in a loaded run, 0.128 offline): a coin toss.
    Protecting a third layer keeps the skipped share (13 of 16) under the breaker's 85 %, so every
    token after the first three skips 13 layers: 0.67 nats per token offline (`layerwatch eval`'s
    teacher-forced loss, 9.7 times the limit)."""
    flags = ("--threshold", "0.95", "--protected-layers", "0,1,15")
    injected, serving = stack.restart_shim(*flags)
    fault = f"threshold 0.95, three protected layers (`{' '.join(flags)}`)"
    alerts = stack.wait_for_pages(fault, ["LayerwatchShadowQualityCost"], injected, serving)
    cost = alerts["LayerwatchShadowQualityCost"]
    assert cost["labels"]["severity"] == "critical" and cost["labels"]["instance"] == stack.shim_instance
    quality = _shadow_quality(stack)
    assert quality["nats per token"] > stack.profile.shadow_kl_nats_max, quality
    print(f"\n{fault}: shadow check {_quality_text(quality)}")


# --- phase 3b: the quality guard turned off ------------------------------------------------------------


def test_shadow_rate_zero_tickets_quality_guard_blind(stack: Stack) -> None:
    """The demo profile expects shadow checks (shadow_rate_min); a shim serving without them is blind."""
    assert stack.profile.shadow_rate_min > 0
    injected, serving = stack.restart_shim("--shadow-rate", "0")
    alerts = stack.wait_for_pages(
        "shadow rate 0 (`--shadow-rate 0`)", ["LayerwatchQualityGuardBlind"], injected, serving
    )
    blind = alerts["LayerwatchQualityGuardBlind"]
    assert blind["labels"]["severity"] == "warning" and blind["labels"]["trigger"] == "rate"
    assert blind["labels"]["instance"] == stack.shim_instance


# --- phase 4: a small category of traffic runs away ---------------------------------------------------


def _tail_ratio(stack: Stack, recorded: Recorded, since: float | None = None) -> list[float]:
    """The share of requests above the cut-off now, or its highest value since `since` (monotonic)."""
    cutoff = stack.profile.request_tail.runaway_skip_fraction
    series = (
        f'{recorded.request_skip_tail_ratio}{{model_name="{stack.model_name}", '
        f'instance="{stack.shim_instance}", le="{cutoff:g}"}}'
    )
    if since is not None:
        series = f"max_over_time({series}[{math.ceil(time.monotonic() - since)}s])"
    return values(stack.query(series))


def _requests_above_cutoff(stack: Stack) -> float:
    """Finished requests the shim has counted with a skip fraction above the profile's cut-off."""
    cutoff = stack.profile.request_tail.runaway_skip_fraction
    series = f'model_name="{stack.model_name}", instance="{stack.shim_instance}"'
    total = values(stack.query(f"layerwatch_request_skip_fraction_count{{{series}}}"))
    below = values(stack.query(f'layerwatch_request_skip_fraction_bucket{{{series}, le="{cutoff:g}"}}'))
    assert len(total) == len(below) == 1, (total, below)
    return total[0] - below[0]


def test_request_tail_category_pages_while_the_skip_ratio_barely_moves(stack: Stack) -> None:
    """Three more clients, started 0.7 s apart, sending the garbled transcripts of layerwatch.demo.loadgen.STUTTER
    back to back next to the healthy load, each request skipping about 0.38 of its layer evaluations.
    Not the benchmark's 5 % of traffic (benchmarks/request_tail.py, over real 5-minute windows): at
    this time scale the rate window is 3 s and holds about a dozen requests, and the tail must be in
    every window for the whole scaled `for:`."""
    if stack.shim_restarts:  # after phase 3b: healthy settings again
        stack.restart_shim()
    recorded = Recorded.for_timing(Timing(TIME_SCALE))
    alertname = "LayerwatchRequestTailRunaway"
    # Healthy first: the tail is measured (the series exists) and empty, and the alert stays silent
    # for longer than its scaled window plus `for:`.
    deadline = time.monotonic() + TIME_SCALE * config.RATE_WINDOW + stack.for_seconds(alertname) + 3
    tails = []
    while time.monotonic() < deadline:
        assert alertname not in {a["labels"]["alertname"] for a in stack.layerwatch_alerts()}
        tails += _tail_ratio(stack, recorded)
        time.sleep(EVALUATION_INTERVAL)
    assert tails and max(tails) == 0.0, tails
    healthy_ratio = values(stack.query(f'{recorded.skip_ratio}{{model_name="{stack.model_name}"}}'))
    above_before = _requests_above_cutoff(stack)

    stop = threading.Event()
    reports: list[LoadReport] = []

    def category_client(delay: float) -> None:
        # The engine decodes its sequences in lockstep and every transcript is 64 greedy tokens, so
        # clients started together finish together, and 3 s windows without a finished transcript
        # make the tail flap; started apart, their completions stay spread over every window.
        if stop.wait(delay):
            return
        reports.append(
            run_load(
                f"http://{stack.shim_instance}",
                stack.model_name,
                duration=math.inf,
                concurrency=1,
                stop=stop,
                timeout=30.0,
                category=Category(STUTTER.prompts, 1.0, STUTTER.max_tokens, STUTTER.greedy),
            )
        )

    clients = [threading.Thread(target=category_client, args=(i * 0.7,), daemon=True) for i in range(3)]
    started = time.monotonic()
    stack.events.append((started, "garbled transcripts start (three staggered clients, greedy, 64 tokens)"))
    for client in clients:
        client.start()
    try:
        alerts = stack.wait_for_pages("a category of garbled transcripts", [alertname], started, started)
        # Its highest value since the start: a 3 s window read just after the page can hold no finished
        # transcript (the clients' requests end in lockstep with the healthy load's).
        tail = _tail_ratio(stack, recorded, since=started)
        skip_ratio = values(stack.query(f'{recorded.skip_ratio}{{model_name="{stack.model_name}"}}'))
        firing = {a["labels"]["alertname"] for a in stack.layerwatch_alerts() if a["state"] == "firing"}
        above = _requests_above_cutoff(stack) - above_before
    finally:
        stop.set()
        for client in clients:
            client.join(60)

    page = alerts[alertname]
    assert page["labels"]["severity"] == "critical" and page["labels"]["instance"] == stack.shim_instance
    description = page["annotations"]["description"]
    cutoff = stack.profile.request_tail.runaway_skip_fraction
    assert f"skipped more than {cutoff:g}" in description and f"requests above {cutoff:g})" in description
    # The category's fingerprint: layer 9, skipped on almost every token of the transcripts and on
    # about half of the rest, is among the layers most above the model's own ratios. (Not always
    # first: in one of three runs since the depth execution landed, layers 3 and 5 led; a row's
    # scores follow the layers its batch ran, docs/model.md, "Depth execution".)
    most_above = description.split("most above the model's own per-layer skip ratios: ")[1].split(" - ")[0]
    assert "9" in most_above.split(" ")[::2], description
    # The tail shows it; the model-wide signals do not.
    assert tail and tail[0] > stack.profile.request_tail.normal_share, tail
    assert skip_ratio and skip_ratio[0] < 1.5 * stack.profile.skip_ratio_normal, (healthy_ratio, skip_ratio)
    assert not firing & {"LayerwatchSkipRateSurge", "LayerwatchRunawaySkipping"}, firing
    assert len(reports) == len(clients)
    requests = sum(r.requests for r in reports)
    assert all(r.category_requests == r.requests > 0 and r.server_errors == 0 for r in reports), reports
    # The requests above the cut-off are the category's: the healthy load put none there (above),
    # and each client's requests ran one at a time, so at most its finished ones are counted. (The
    # clients' usage counts the layers that ran, which a batch's consensus may run for a request
    # whose rule skipped them: docs/model.md, "Depth execution"; the tail reads the decisions.)
    assert 0 < above <= requests, (above, requests)
    skipped_evaluations = sum(r.category_layers_skipped for r in reports)
    executed = skipped_evaluations / (skipped_evaluations + sum(r.category_layers_executed for r in reports))
    print(
        f"\nrequest tail: skip ratio {healthy_ratio} -> {skip_ratio}, share above {cutoff:g} {tail}, "
        f"{above:.0f} of the category's {requests} requests above it (their executed skip fraction {executed:.3f})"
    )


# --- phase 5: gate weights overwritten ---------------------------------------------------------------


def test_reset_gates_page_single_peak_and_gate_weights_changed(stack: Stack) -> None:
    # The healthy gates of phase 4 (the gate file's own hash) and every earlier alert resolved, so that
    # this drill's pages are new ones. The static drill's hash leaves the gate change's window (1h,
    # 36 s scaled) only that long after it; phases 3 and 4 keep the gate file and run meanwhile.
    _wait_until_quiet(stack, FAULT_TIMEOUT)
    (healthy_sha,) = _served_hashes(stack)
    assert healthy_sha == hashlib.sha256((DEMO_MODEL_DIR / "gates.safetensors").read_bytes()).hexdigest()
    injected, serving = stack.restart_shim("--reset-gates")
    alerts = stack.wait_for_pages(
        "gates reset (`--reset-gates`)",
        ["LayerwatchEntropyShapeChanged", "LayerwatchGateWeightsChanged"],
        injected,
        serving,
    )

    single_peak = alerts["LayerwatchEntropyShapeChanged"]
    assert single_peak["labels"]["severity"] == "critical"
    assert single_peak["labels"]["instance"] == stack.exporter_instance  # the exporter's verdict
    (reset_sha,) = _served_hashes(stack) - {healthy_sha}
    description = alerts["LayerwatchGateWeightsChanged"]["annotations"]["description"]
    assert healthy_sha in description and reset_sha in description, description
    # Fresh gates score about 0.5 everywhere, above tau: nothing is skipped, so the gated model is the
    # full-depth one and the quality guard, measuring on the same traffic, sees no cost.
    quality = _shadow_quality(stack)
    assert quality["agreement"] > 0.99 and quality["nats per token"] < 1e-4, quality
    firing = {a["labels"]["alertname"] for a in stack.layerwatch_alerts() if a["state"] == "firing"}
    assert not firing & {"LayerwatchShadowAgreementLow", "LayerwatchShadowQualityCost"}, firing
    print(f"\nreset gates: shadow check {_quality_text(quality)}")


# --- phase 6: gates on the wrong layers ---------------------------------------------------------------


def _named_layers(description: str) -> list[int]:
    """The layers LayerwatchGateMiscalibrated's description names below their floors, in its order."""
    named = description.split("largest deficit first: ")[1].split("- shadow agreement")[0]
    return [int(layer) for layer in re.findall(r"(\d+) \(\d\.\d{3} below\)", named)]


def _layers_below_their_floors(stack: Stack) -> dict[int, float]:
    """Layer -> its floor minus its correlation now, for the layers of the served shim below their floors."""
    floors = stack.profile.gate_importance.layer_floors
    now = stack.query(f'layerwatch_gate_layer_importance_correlation{{instance="{stack.shim_instance}"}}')
    by_layer = {int(s["metric"]["layer"]): float(s["value"][1]) for s in now}
    return {
        layer: floors[layer] - value for layer, value in by_layer.items() if layer in floors and value < floors[layer]
    }


def _assert_gate_page(stack: Stack, alert: dict, drill: str) -> float:
    """The page comes from the shim, the headline is below its floor, and the layers the description
    names are layers below their own floors, largest deficit first. Returns the headline."""
    assert alert["labels"]["severity"] == "critical"
    assert alert["labels"]["instance"] == stack.shim_instance  # the shim's own shadow check
    correlation = values(stack.query(f'layerwatch_gate_importance_correlation{{instance="{stack.shim_instance}"}}'))
    assert correlation and correlation[0] < stack.profile.gate_importance.correlation_min, correlation
    named = _named_layers(alert["annotations"]["description"])
    below = _layers_below_their_floors(stack)  # now, a little later than the description was written
    assert named and set(named) & set(below), (named, below, alert["annotations"]["description"])
    assert set(named) <= set(stack.profile.gate_importance.layer_floors)
    print(f"\n{drill}: gate-importance correlation {correlation[0]:.3f}; layers named {named}")
    return correlation[0]


def test_shuffled_gates_page_gate_miscalibrated(stack: Stack) -> None:
    file_sha = hashlib.sha256((DEMO_MODEL_DIR / "gates.safetensors").read_bytes()).hexdigest()
    injected, serving = stack.restart_shim("--shuffle-gates")
    alerts = stack.wait_for_pages(
        "gates on the wrong layers (`--shuffle-gates`)", ["LayerwatchGateMiscalibrated"], injected, serving
    )
    _assert_gate_page(stack, alerts["LayerwatchGateMiscalibrated"], "shuffled gates")
    served = _served_hashes(stack)
    assert served and file_sha not in served, served


# --- phase 7: gates reading the wrong features -----------------------------------------------------------


def test_scrambled_gates_page_gate_miscalibrated(stack: Stack) -> None:
    """Each gate on its own layer, reading a permuted hidden state: the gates still react to every token,
    but to the wrong features, so within each layer their ranking of tokens is gone (docs/service.md,
    "Layer signals", has what the pooled correlation this alert used to read made of such gates)."""
    (shuffled_sha,) = _served_hashes(stack)
    injected, serving = stack.restart_shim("--scramble-gates")
    alerts = stack.wait_for_pages(
        "gates reading permuted features (`--scramble-gates`)", ["LayerwatchGateMiscalibrated"], injected, serving
    )
    _assert_gate_page(stack, alerts["LayerwatchGateMiscalibrated"], "scrambled gates")
    file_sha = hashlib.sha256((DEMO_MODEL_DIR / "gates.safetensors").read_bytes()).hexdigest()
    assert _served_hashes(stack).isdisjoint({file_sha, shuffled_sha})


# --- phase 8: the dashboard ----------------------------------------------------------------------------

DASHBOARD = json.loads((REPO / "layerwatch" / "dashboards" / "json" / "overview.json").read_text())
# The engine view reads vLLM's own series: this stack serves on layerwatch's engine, so those panels are
# answered by tests/vllm_stack/test_engine_view.py, against a real `vllm serve`.
PANELS = [
    panel
    for panel in DASHBOARD["panels"]
    if panel["type"] != "row" and not any("vllm:" in target["expr"] for target in panel["targets"])
]
# Series that exist only where the host exposes them: NVML's (a GPU and its driver, and a GPU that
# offers the reading: a passively cooled one has no fans) and RAPL's. Needle in a query -> reading.
NVML_READINGS = {
    "gpu_energy": "energy",
    "gpu_power": "power",
    "gpu_temperature": "temperature",
    "gpu_fan_speed": "fan_speed",
    "gpu_sm_clock": "sm_clock",
    "gpu_memory_used": "memory_used",
}
RAPL_SERIES = "cpu_energy"


def _wait_for_data(stack: Stack, expr: str, timeout: float = 15.0) -> list[dict]:
    """The query's samples with a number (not NaN), polled for a while: ratios over a few seconds
    can be momentarily 0/0."""
    deadline = time.monotonic() + timeout
    while True:
        result = [s for s in stack.query(expr) if math.isfinite(float(s["value"][1]))]
        if result or time.monotonic() > deadline:
            return result
        time.sleep(EVALUATION_INTERVAL)


def _host_has_nvml_gpu() -> bool:
    """Whether NVML lists a GPU on this host, where the stack's shim runs."""
    try:
        return bool(NvmlReader()())
    except Exception:  # no nvidia-ml-py, no driver, no GPU
        return False


def _missing_hardware(expr: str, stack: Stack) -> str | None:
    """What the host lacks for `expr` to have data, if `expr` reads hardware-only series it lacks;
    None when the series should be there. The host itself is asked, not only the shim's series: a
    shim that exports nothing on a host that has the hardware is a failure, not a missing reading."""
    shim = f'instance="{stack.shim_instance}"'
    for needle, reading in NVML_READINGS.items():
        if needle in expr and not stack.query(f'{{__name__=~"layerwatch_{needle}.*", {shim}}}'):
            if not _host_has_nvml_gpu():
                return "a GPU with NVML"
            if values(stack.query(f'min(layerwatch_gpu_reading_unsupported{{reading="{reading}", {shim}}})')) == [1.0]:
                return f"a GPU that offers the {reading} reading (NVML: not supported)"
            return None
    if RAPL_SERIES in expr and not find_rapl_zones():
        return "readable RAPL counters (/sys/class/powercap)"
    return None


def test_dashboard_variables_list_the_served_model_and_shim(stack: Stack) -> None:
    models = stack.prometheus("/api/v1/label/model_name/values", **{"match[]": "layerwatch_model_info"})
    instances = stack.prometheus(
        "/api/v1/label/instance/values", **{"match[]": f'layerwatch_model_info{{model_name=~"{stack.model_name}"}}'}
    )
    assert stack.model_name in models and instances == [stack.shim_instance]


@pytest.mark.parametrize("panel", PANELS, ids=[panel["title"] for panel in PANELS])
def test_dashboard_panel_has_data(stack: Stack, panel: dict) -> None:
    lacking, unrecorded = [], []
    shape_series = (
        Recorded.for_timing(Timing(TIME_SCALE)).entropy_shape_distance,
        PROFILE_SERIES.entropy_shape_distance_max,
    )
    for target in panel["targets"]:
        expr = dashboard_expr(target["expr"], stack.model_name, stack.shim_instance)
        # A reading the host cannot give never arrives: no point polling for it.
        needs = _missing_hardware(expr, stack)
        if needs is not None:
            lacking.append(f"target {target['refId']} needs {needs}")
            continue
        # The distance from a recorded healthy histogram and its limit: the demo's profile records none
        # (its shape has two humps, which the single_peak trigger reads); layerwatch/alerts/tests/shape.test.yaml
        # computes them for SmolLM2's, which does.
        if any(name in expr for name in shape_series) and not stack.profile.bimodality.histogram:
            unrecorded.append(f"target {target['refId']} needs a profile that records the healthy histogram")
            continue
        assert _wait_for_data(stack, expr), f"no data for target {target['refId']}: {expr}"
    if lacking:
        pytest.xfail(f"this host lacks hardware readings: {'; '.join(lacking)}")
    if unrecorded:
        pytest.xfail(f"{stack.model_name}'s profile records no healthy histogram: {'; '.join(unrecorded)}")
