"""Alert-driven mitigation with the real Alertmanager: the generated alertmanager.yml, with the
optional mitigation route on, delivers to a live `layerwatch serve` (the demo model) with the
shim's bearer token read from a credentials_file.

An alert posted to Alertmanager's API (as Prometheus would post it) reaches the shim; the shim's
mitigation metrics change and greedy requests get shadow-checked (the shim runs at --shadow-rate
0); the pager still gets its page (the mitigation route continues). The alert resolved in
Alertmanager ends the mitigation, and requests are no longer checked. docs/service.md,
"Alert-driven mitigation", and docs/end-to-end.md.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from layerwatch.alerts.durations import Timing
from layerwatch.alerts.rules import to_yaml
from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.demo.receiver import WebhookReceiver
from layerwatch.deploy.render import HEADER, MitigationWebhook, alertmanager_config
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from tests.stack.conftest import run_tool
from tests.stack.support import TIME_SCALE, alertmanager_alerts, alertmanager_argv
from tests.support import sample_sum, scrape

ALERTNAME = "LayerwatchRoutingStatic"
TOKEN = "e2e-mitigation-token-" + "0123456789abcdef" * 2
MAX_TOKENS = 8
DELIVERY_TIMEOUT = 60.0


@dataclass
class MitigationStack:
    shim_url: str
    alertmanager_url: str
    webhooks: WebhookReceiver
    shim: ManagedProcess
    config: Path

    def metric(self, name: str, **labels: str) -> float:
        return sample_sum(scrape(self.shim_url), name, **labels)

    def wait_metric(self, name: str, value: float, **labels: str) -> float:
        """Seconds until the shim's metric reached `value`."""
        began = time.monotonic()
        while (current := self.metric(name, **labels)) != value:
            if time.monotonic() > began + DELIVERY_TIMEOUT:
                raise AssertionError(f"{name}{labels} stayed {current}, expected {value}:\n{self.shim.log_tail()}")
            time.sleep(0.05)
        return time.monotonic() - began

    def post_alert(self, starts_at: datetime, ends_at: datetime | None = None) -> None:
        """As Prometheus posts an alert: firing, or resolved once its endsAt has passed."""
        alert = {
            "labels": {
                "alertname": ALERTNAME,
                "model_name": DEMO_MODEL_NAME,
                "severity": "critical",
                "instance": "127.0.0.1:9411",
                "trigger": "token_dependent_share",
            },
            "annotations": {"summary": "Skipping no longer depends on the token."},
            "startsAt": starts_at.isoformat(),
            **({"endsAt": ends_at.isoformat()} if ends_at else {}),
        }
        request = urllib.request.Request(
            f"{self.alertmanager_url}/api/v2/alerts",
            data=json.dumps([alert]).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200

    def greedy(self) -> None:
        body = {"model": DEMO_MODEL_NAME, "prompt": "The river", "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(f"{self.shim_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text

    def checked_tokens_after_idle(self) -> float:
        """Shadow-checked tokens once the shadow queue has drained (jobs run while the engine idles)."""
        last, deadline = -1.0, time.monotonic() + 30
        while (current := self.metric("layerwatch_shadow_tokens_total")) != last and time.monotonic() < deadline:
            last = current
            time.sleep(1.0)
        return current


@pytest.fixture(scope="module")
def stack(tmp_path_factory, alertmanager_binary: str) -> Iterator[MitigationStack]:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"the embedded demo model is missing: {DEMO_MODEL_DIR}")
    workdir = tmp_path_factory.mktemp("mitigation-stack")
    token_file = workdir / "mitigation.token"  # one file, read by both (Alertmanager strips the newline too)
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    shim_port, receiver_port, alertmanager_port = free_port(), free_port(), free_port()
    webhooks = WebhookReceiver()
    config = workdir / "alertmanager.yml"
    rendered = alertmanager_config(
        pager_url=webhooks.url("/pager"),
        ticket_url=webhooks.url("/ticket"),
        timing=Timing(TIME_SCALE),  # group_interval 60s -> 0.6s: a resolution is delivered at once
        mitigation=MitigationWebhook(f"http://127.0.0.1:{receiver_port}/alerts", str(token_file)),
    )
    config.write_text(HEADER + to_yaml(rendered, ""))
    processes: list[ManagedProcess] = []
    try:
        alertmanager = ManagedProcess(
            "alertmanager",
            alertmanager_argv(alertmanager_binary, config, workdir, alertmanager_port),
            workdir / "alertmanager.log",
        )
        processes.append(alertmanager)
        alertmanager.wait_http(f"http://127.0.0.1:{alertmanager_port}/-/ready")
        shim = ManagedProcess(
            "shim",
            [
                sys.executable,
                "-m",
                "layerwatch.cli.main",
                "serve",
                "--port",
                str(shim_port),
                "--exporter-address",
                "",
                "--mitigation-address",
                f"127.0.0.1:{receiver_port}",
                "--mitigation-token-file",
                str(token_file),
                "--mitigation-requests",
                "100",
                "--log-level",
                "warning",
            ],
            workdir / "shim.log",
            env={"OMP_NUM_THREADS": "1"},
        )
        processes.append(shim)
        shim.wait_http(f"http://127.0.0.1:{shim_port}/readyz", timeout=120)
        yield MitigationStack(
            f"http://127.0.0.1:{shim_port}", f"http://127.0.0.1:{alertmanager_port}", webhooks, shim, config
        )
    finally:
        for process in reversed(processes):
            process.stop()
        webhooks.close()


def test_the_generated_config_with_the_mitigation_route_is_valid(stack, amtool):
    result = run_tool(amtool, "check-config", stack.config)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alertmanager_delivers_an_alert_to_the_shim_which_mitigates_until_it_resolves(stack):
    assert stack.metric("layerwatch_mitigations_active") == 0
    stack.greedy()
    assert stack.checked_tokens_after_idle() == 0  # --shadow-rate 0: nothing is checked

    starts_at = datetime.now(UTC)
    stack.post_alert(starts_at)
    to_start = stack.wait_metric("layerwatch_mitigations_active", 1)
    assert stack.metric("layerwatch_mitigations_started_total", alertname=ALERTNAME) == 1
    assert stack.metric("layerwatch_mitigation_shadow_rate") == 1
    assert stack.metric("layerwatch_mitigation_webhook_requests_total", outcome="accepted") >= 1
    assert stack.metric("layerwatch_mitigation_webhook_requests_total", outcome="unauthorized") == 0
    assert f"MITIGATION_START alertname={ALERTNAME}" in stack.shim.log_tail(50)
    # The route continues: the page still goes out.
    deadline = time.monotonic() + DELIVERY_TIMEOUT
    while stack.webhooks.first_firing("/pager", ALERTNAME) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stack.webhooks.first_firing("/pager", ALERTNAME) is not None

    for _ in range(3):
        stack.greedy()
    assert stack.checked_tokens_after_idle() == 3 * MAX_TOKENS  # every mitigated greedy request
    assert stack.metric("layerwatch_mitigated_requests_total") == 3

    stack.post_alert(starts_at, ends_at=datetime.now(UTC) - timedelta(seconds=1))
    to_end = stack.wait_metric("layerwatch_mitigations_active", 0)
    # Printed, not asserted (-s shows it): group_wait 0 and, scaled, group_interval 0.6 s.
    print(f"\nalert posted -> mitigation in effect: {to_start:.2f} s; resolved -> ended: {to_end:.2f} s")
    assert stack.metric("layerwatch_mitigations_ended_total", reason="resolved") == 1
    assert stack.metric("layerwatch_mitigation_shadow_rate") == 0
    assert f"MITIGATION_END alertname={ALERTNAME}" in stack.shim.log_tail(50)
    assert not [a for a in alertmanager_alerts(stack.alertmanager_url, ALERTNAME) if a["status"]["state"] == "active"]
    stack.greedy()
    assert stack.checked_tokens_after_idle() == 3 * MAX_TOKENS  # no longer checked
    assert stack.metric("layerwatch_mitigated_requests_total") == 3
