"""The fleet end to end: two shims of the demo model, each sending its gate frames to its own exporter
(as a Kubernetes pod pairs them, docs/kubernetes.md), all scraped by one real Prometheus with the
production rules scaled by TIME_SCALE, a real Alertmanager routing to loopback receivers, and a real
VictoriaMetrics that Prometheus remote-writes to (the long-term store).

One stack per module (`fleet` fixture); the tests are phases and run in file order:
1. healthy: both exporters' verdicts are in and healthy, the fleet shows 0 of 2 instances unhealthy,
   and the fleet's skip ratio lies between the two shims' own;
2. shim b restarted with `--reset-gates`: LayerwatchEntropyShapeChanged pages naming b's exporter, the
   dashboard's "Instances unhealthy" panel (its queries as Grafana sends them) shows 1 of 2, and no
   alert about a's shim or exporter fires at any point of phases 1 and 2 (pending is allowed: on the
   scaled 3 s window LayerwatchShadowAgreementLow's ratio over a handful of greedy tokens dips below
   the demo floor now and then, as on the single-shim baseline; its `for:` keeps it from firing);
3. the fleet series are in VictoriaMetrics, read through its own query API: 1 of 2 unhealthy.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from layerwatch.alerts.durations import Timing
from layerwatch.alerts.profile_file import load_profiles
from layerwatch.alerts.recorded import Recorded
from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.demo.receiver import WebhookReceiver
from layerwatch.deploy.render import render_stack
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME

from .conftest import REPO
from .support import (
    EVALUATION_INTERVAL,
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
    shim_argv,
    start_processes,
    values,
)

pytestmark = pytest.mark.e2e

HEALTHY_TIMEOUT = 90.0  # start-up on a busy machine, then both exporters' windows filling
RECORDED = Recorded.for_timing(Timing(TIME_SCALE))
MODEL = f'model_name="{DEMO_MODEL_NAME}"'
# VictoriaMetrics hides the newest samples from queries for -search.latencyOffset (30 s by default,
# for stores fed by many clients at once); this test's only writer is its own Prometheus.
VICTORIA_LATENCY_OFFSET = "1s"
REMOTE_WRITE_TIMEOUT = 30.0  # Prometheus batches samples for up to 5 s before it sends them


@dataclass
class Member:
    """One shim and the exporter its frames go to."""

    name: str
    shim_port: int = field(default_factory=free_port)
    exporter_udp_port: int = field(default_factory=lambda: free_port(socket.SOCK_DGRAM))
    exporter_http_port: int = field(default_factory=free_port)

    @property
    def shim_instance(self) -> str:
        return f"127.0.0.1:{self.shim_port}"

    @property
    def exporter_instance(self) -> str:
        return f"127.0.0.1:{self.exporter_http_port}"

    @property
    def instances(self) -> set[str]:
        return {self.shim_instance, self.exporter_instance}


@dataclass
class Fleet:
    workdir: Path
    webhooks: WebhookReceiver
    a: Member = field(default_factory=lambda: Member("a"))
    b: Member = field(default_factory=lambda: Member("b"))
    prometheus_port: int = field(default_factory=free_port)
    alertmanager_port: int = field(default_factory=free_port)
    victoria_port: int = field(default_factory=free_port)
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    loads: list[Load] = field(default_factory=list)
    # Every layerwatch alert seen about a's targets (firing in Prometheus, in Alertmanager, received).
    healthy_member_alerts: set[tuple[str, str, str]] = field(default_factory=set)

    def shim(self, member: Member, *extra: str) -> tuple[str, list[str], str]:
        """The member's shim: its name, command line with `extra` and ready URL, for start_processes."""
        return (
            f"shim-{member.name}",
            shim_argv(member.shim_port, member.exporter_udp_port, *extra),
            f"http://{member.shim_instance}/readyz",
        )

    def start_shim(self, member: Member, *extra: str) -> None:
        start_processes(self.workdir, self.processes, self.shim(member, *extra))

    def prometheus(self, path: str, **params: str) -> dict | list:
        return prometheus_api(f"http://127.0.0.1:{self.prometheus_port}", path, **params)

    def query(self, expr: str) -> list[dict]:
        return self.prometheus("/api/v1/query", query=expr)["result"]

    def by_instance(self, expr: str) -> dict[str, float]:
        return {s["metric"]["instance"]: float(s["value"][1]) for s in self.query(expr)}

    def alertmanager_alerts(self, alertname: str | None = None) -> list[dict]:
        return alertmanager_alerts(f"http://127.0.0.1:{self.alertmanager_port}", alertname)

    @property
    def victoria_url(self) -> str:
        return f"http://127.0.0.1:{self.victoria_port}"

    def watch_healthy_member(self) -> None:
        """Record every firing alert that names one of a's targets, wherever it shows up."""
        prometheus = [
            (a["labels"], "firing")
            for a in self.alerts()
            if a["labels"]["alertname"].startswith("Layerwatch") and a["state"] == "firing"
        ]
        alertmanager = [(a["labels"], "alertmanager") for a in self.alertmanager_alerts()]
        received = [(a["labels"], n.receiver) for n in self.webhooks.notifications for a in n.payload["alerts"]]
        self.healthy_member_alerts |= {
            (labels["alertname"], labels["instance"], where)
            for labels, where in prometheus + alertmanager + received
            if labels.get("instance") in self.a.instances
        }

    def alerts(self) -> list[dict]:
        return self.prometheus("/api/v1/alerts")["alerts"]

    def diagnostics(self) -> str:
        alerts = [(a["labels"]["alertname"], a["labels"].get("instance"), a["state"]) for a in self.alerts()]
        logs = "\n".join(f"--- {name} log:\n{process.log_tail(15)}" for name, process in self.processes.items())
        return f"Prometheus alerts: {alerts}\n{logs}"

    def stop(self) -> None:
        for load in self.loads:
            load.stop()
        for process in reversed(list(self.processes.values())):
            process.stop()
        self.webhooks.close()


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory, prometheus_binary: str, alertmanager_binary: str, victoria_metrics_binary: str
) -> Iterator[Fleet]:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the embedded demo model is missing: {DEMO_MODEL_DIR}")
    workdir = tmp_path_factory.mktemp("fleet")
    f = Fleet(workdir, WebhookReceiver())
    members = (f.a, f.b)
    rendered = render_stack(
        workdir / "config",
        profiles=load_profiles(REPO / "layerwatch" / "alerts" / "profiles"),
        shim_targets=[m.shim_instance for m in members],
        exporter_targets=[m.exporter_instance for m in members],
        alertmanager_target=f"127.0.0.1:{f.alertmanager_port}",
        pager_url=f.webhooks.url("/pager"),
        ticket_url=f.webhooks.url("/ticket"),
        scrape_interval=SCRAPE_INTERVAL,
        evaluation_interval=EVALUATION_INTERVAL,
        time_scale=TIME_SCALE,
        remote_write_urls=[f"{f.victoria_url}/api/v1/write"],
    )
    try:
        start_processes(
            workdir,
            f.processes,
            (
                "victoria-metrics",
                [
                    victoria_metrics_binary,
                    f"-httpListenAddr=127.0.0.1:{f.victoria_port}",
                    f"-storageDataPath={workdir / 'victoria-metrics-data'}",
                    f"-search.latencyOffset={VICTORIA_LATENCY_OFFSET}",
                ],
                f"{f.victoria_url}/health",
            ),
            (
                "alertmanager",
                alertmanager_argv(alertmanager_binary, rendered.alertmanager_config, workdir, f.alertmanager_port),
                f"http://127.0.0.1:{f.alertmanager_port}/-/ready",
            ),
            *(
                (
                    f"exporter-{m.name}",
                    exporter_argv(m.exporter_udp_port, m.exporter_instance),
                    f"http://{m.exporter_instance}/healthz",
                )
                for m in members
            ),
            *(f.shim(m) for m in members),
        )
        # Prometheus last: from its first scrape on, every target is up (no TargetDown at start).
        start_processes(
            workdir,
            f.processes,
            (
                "prometheus",
                prometheus_argv(prometheus_binary, rendered.prometheus_config, workdir, f.prometheus_port),
                f"http://127.0.0.1:{f.prometheus_port}/-/ready",
            ),
        )
        f.loads = [Load(f"http://{m.shim_instance}", DEMO_MODEL_NAME) for m in members]
        yield f
    finally:
        f.stop()
        print(f"\nlogs and rendered configuration: {workdir}")


def _fleet_counts(fleet: Fleet) -> tuple[list[float], list[float]]:
    """(instances unhealthy, instances) of the demo model, as recorded."""
    return (
        values(fleet.query(f"{RECORDED.fleet_gating_unhealthy}{{{MODEL}}}")),
        values(fleet.query(f"{RECORDED.fleet_gating_instances}{{{MODEL}}}")),
    )


def _panel_targets(title: str) -> list[dict]:
    """The panel's targets, their queries as Grafana sends them (every instance of the demo model)."""
    dashboard = json.loads((REPO / "layerwatch" / "dashboards" / "json" / "overview.json").read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"] == title]
    return [{**t, "expr": dashboard_expr(t["expr"], DEMO_MODEL_NAME, ".*")} for t in panel["targets"]]


def test_healthy_fleet_shows_no_instance_unhealthy(fleet: Fleet) -> None:
    exporters = {fleet.a.exporter_instance, fleet.b.exporter_instance}
    deadline = time.monotonic() + HEALTHY_TIMEOUT
    while True:
        fleet.watch_healthy_member()
        verdicts = [
            fleet.by_instance(f"{verdict}{{{MODEL}}}")
            for verdict in ("layerwatch_entropy_bimodal", "layerwatch_routing_dynamic")
        ]
        if all(v == dict.fromkeys(exporters, 1.0) for v in verdicts) and _fleet_counts(fleet) == ([0.0], [2.0]):
            break
        assert time.monotonic() < deadline, f"verdicts {verdicts}, fleet {_fleet_counts(fleet)}\n{fleet.diagnostics()}"
        time.sleep(EVALUATION_INTERVAL)

    # The fleet's skip ratio is the two shims' layer evaluations pooled: between their own ratios
    # (recorded in the same evaluation). A scaled 3 s rate window on a busy machine may miss a
    # scrape, so the three are read until they come from one evaluation.
    shims = {fleet.a.shim_instance, fleet.b.shim_instance}
    deadline = time.monotonic() + 15 * EVALUATION_INTERVAL
    while True:
        per_shim = fleet.by_instance(f"{RECORDED.skip_ratio}{{{MODEL}}}")
        pooled = values(fleet.query(f"{RECORDED.fleet_skip_ratio}{{{MODEL}}}"))
        if (set(per_shim) == shims and pooled) or time.monotonic() > deadline:
            break
        time.sleep(EVALUATION_INTERVAL / 4)
    assert set(per_shim) == shims and pooled, (per_shim, pooled, fleet.query("up"))
    assert min(per_shim.values()) <= pooled[0] <= max(per_shim.values()), (per_shim, pooled)
    print(f"\nhealthy fleet: skip ratio per shim {per_shim}, fleet {pooled[0]:.3f}")
    assert fleet.healthy_member_alerts == set()


def test_reset_gates_on_one_instance_pages_it_and_the_fleet_shows_one_of_two(fleet: Fleet) -> None:
    injected = time.monotonic()
    fleet.processes.pop("shim-b").stop()
    fleet.start_shim(fleet.b, "--reset-gates")
    serving = time.monotonic()

    deadline = time.monotonic() + FAULT_TIMEOUT
    while True:
        fleet.watch_healthy_member()
        pages = [
            a
            for a in fleet.alertmanager_alerts("LayerwatchEntropyShapeChanged")
            if a["status"]["state"] == "active" and a["labels"].get("model_name") == DEMO_MODEL_NAME
        ]
        paged_at = fleet.webhooks.first_firing("/pager", "LayerwatchEntropyShapeChanged", injected)
        if pages and paged_at is not None:
            break
        assert time.monotonic() < deadline, (
            f"no single-peak page {FAULT_TIMEOUT:.0f}s after the reset\n{fleet.diagnostics()}"
        )
        time.sleep(0.2)
    in_alertmanager = time.monotonic()

    assert [a["labels"]["instance"] for a in pages] == [fleet.b.exporter_instance], pages
    assert fleet.by_instance(f"{RECORDED.gating_unhealthy}{{{MODEL}}}") == {
        fleet.a.exporter_instance: 0.0,
        fleet.b.exporter_instance: 1.0,
    }
    # The dashboard's fleet panels, queried as Grafana queries them: 1 of 2, and which one.
    shown = {t["legendFormat"]: values(fleet.query(t["expr"])) for t in _panel_targets("Instances unhealthy")}
    assert shown == {"unhealthy": [1.0], "instances": [2.0]}, shown
    table = {t["refId"]: fleet.by_instance(t["expr"]) for t in _panel_targets("Verdicts by instance")}
    a, b = fleet.a.exporter_instance, fleet.b.exporter_instance
    assert table["A"] == {a: 1.0, b: 0.0} and table["C"] == {a: 0.0, b: 1.0}, table  # entropy; the flag
    fleet.watch_healthy_member()
    assert fleet.healthy_member_alerts == set(), fleet.healthy_member_alerts
    print(
        f"\nreset gates on b: serving again {serving - injected:.1f}s, LayerwatchEntropyShapeChanged active in "
        f"Alertmanager {in_alertmanager - injected:.1f}s, at the pager {paged_at - injected:.1f}s after the restart"
    )


def test_victoria_metrics_holds_the_fleet_series(fleet: Fleet) -> None:
    """Prometheus remote-wrote the recorded fleet series: VictoriaMetrics' own API answers with them."""
    started = time.monotonic()
    deadline = started + REMOTE_WRITE_TIMEOUT
    while True:
        stored = {
            name: values(prometheus_api(fleet.victoria_url, "/api/v1/query", query=f"{name}{{{MODEL}}}")["result"])
            for name in (RECORDED.fleet_gating_unhealthy, RECORDED.fleet_gating_instances)
        }
        if stored == {RECORDED.fleet_gating_unhealthy: [1.0], RECORDED.fleet_gating_instances: [2.0]}:
            break
        assert time.monotonic() < deadline, f"VictoriaMetrics holds {stored}\n{fleet.diagnostics()}"
        time.sleep(EVALUATION_INTERVAL)
    flags = prometheus_api(fleet.victoria_url, "/api/v1/query", query=f"{RECORDED.gating_unhealthy}{{{MODEL}}}")
    assert {s["metric"]["instance"]: float(s["value"][1]) for s in flags["result"]} == {
        fleet.a.exporter_instance: 0.0,
        fleet.b.exporter_instance: 1.0,
    }
    print(f"\nVictoriaMetrics: the fleet series showed 1 of 2 after {time.monotonic() - started:.1f}s of polling")
