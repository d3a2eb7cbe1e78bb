"""What the end-to-end stacks share (tests/stack/test_end_to_end.py, test_fleet.py): the scaled timing,
the command lines of the layerwatch processes, load, where an alert is routed (the pager and ticket
receivers are layerwatch/demo/receiver.py's), and the queries a test sends to Prometheus as Grafana would."""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import urllib.parse
import urllib.request
from dataclasses import astuple
from pathlib import Path

from layerwatch.alerts.durations import Timing
from layerwatch.alerts.recorded import Recorded
from layerwatch.demo.loadgen import LoadReport, run_load
from layerwatch.demo.processes import ManagedProcess
from layerwatch.demo.receiver import PAGER_PATH, TICKET_PATH

TIME_SCALE = 0.01  # 5m -> 3s, 10m -> 6s, 1h -> 36s
SCRAPE_INTERVAL = 1.0
EVALUATION_INTERVAL = 1.0
# The exporter's bimodality window. After a fault the window must forget the healthy entropies
# before the verdict can change, so this is part of the single-peak alert's time to page.
EXPORTER_WINDOW_SECONDS = 10.0
LOAD_CONCURRENCY = 3
LOAD_MAX_TOKENS = 24
FAULT_TIMEOUT = 90.0  # seconds from a fault to its page before the test gives up
LAYERWATCH = str(Path(sys.executable).with_name("layerwatch"))


def shim_argv(port: int, exporter_udp_port: int, *extra: str) -> list[str]:
    """`layerwatch serve` on the demo model, every request shadow-checked."""
    return [
        LAYERWATCH,
        "serve",
        "--port",
        str(port),
        "--exporter-address",
        f"127.0.0.1:{exporter_udp_port}",
        "--shadow-rate",
        "1.0",
        "--log-level",
        "warning",
        *extra,
    ]


def exporter_argv(udp_port: int, http_address: str) -> list[str]:
    return [
        LAYERWATCH,
        "exporter",
        "--listen",
        f"127.0.0.1:{udp_port}",
        "--http",
        http_address,
        "--window-seconds",
        str(EXPORTER_WINDOW_SECONDS),
        "--statistics-cache-seconds",
        "0.5",
    ]


def alertmanager_argv(binary: str, config: Path, workdir: Path, port: int) -> list[str]:
    return [
        binary,
        f"--config.file={config}",
        f"--storage.path={workdir / 'alertmanager-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",  # no gossip
    ]


def prometheus_argv(binary: str, config: Path, workdir: Path, port: int) -> list[str]:
    return [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]


def start_processes(
    workdir: Path, processes: dict[str, ManagedProcess], *specs: tuple[str, list[str], str], timeout: float = 120.0
) -> None:
    """Start every (name, argv, ready URL) at once, its log in workdir, then wait until each answers
    its URL: their start-ups overlap (a shim's imports and model load take seconds)."""
    for name, argv, _ in specs:
        processes[name] = ManagedProcess(name, argv, workdir / f"{name}.log")
    for name, _, ready_url in specs:
        processes[name].wait_http(ready_url, timeout)


def get_json(url: str) -> dict | list:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def prometheus_api(base_url: str, path: str, **params: str) -> dict | list:
    """The `data` of a Prometheus HTTP API answer (VictoriaMetrics answers the same API)."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    body = get_json(f"{base_url}{path}{query}")
    assert isinstance(body, dict) and body["status"] == "success", body
    return body["data"]


def alertmanager_alerts(base_url: str, alertname: str | None = None) -> list[dict]:
    """The alerts Alertmanager holds (API v2), all or those named `alertname`."""
    query = f"?{urllib.parse.urlencode({'filter': f'alertname={json.dumps(alertname)}'})}" if alertname else ""
    alerts = get_json(f"{base_url}/api/v2/alerts{query}")
    assert isinstance(alerts, list), alerts
    return alerts


def values(result: list[dict]) -> list[float]:
    """The numbers of an instant query's samples."""
    return [float(sample["value"][1]) for sample in result]


# --- routing ----------------------------------------------------------------------------------


def receiver(alert: dict) -> str:
    """Where the rendered alertmanager.yml routes an alert: critical pages, warning opens a ticket."""
    return {"critical": PAGER_PATH, "warning": TICKET_PATH}[alert["labels"]["severity"]]


# --- load ----------------------------------------------------------------------------------------


class Load:
    """Sampled completions in the background, at temperature 1.0 and 0.7 (layerwatch.demo.loadgen.TEMPERATURES)."""

    def __init__(self, base_url: str, model_name: str) -> None:
        self.stop_event = threading.Event()
        self.reports: list[LoadReport] = []
        self._threads = [
            threading.Thread(
                target=lambda: self.reports.append(
                    run_load(
                        base_url,
                        model_name,
                        duration=math.inf,
                        concurrency=LOAD_CONCURRENCY,
                        max_tokens=LOAD_MAX_TOKENS,
                        stop=self.stop_event,
                        timeout=30.0,
                    )
                ),
                daemon=True,
            )
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self._threads:
            thread.join(60)


# --- the dashboard's queries ------------------------------------------------------------------------


def dashboard_expr(expr: str, model_name: str, instance: str) -> str:
    """The query Grafana would send: variables filled in, recorded series named for this time scale."""
    production = astuple(Recorded.for_timing(Timing()))
    scaled = astuple(Recorded.for_timing(Timing(TIME_SCALE)))
    for name, scaled_name in zip(production, scaled):
        expr = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])", scaled_name, expr)
    for variable, value in (
        ("$__rate_interval", f"{4 * SCRAPE_INTERVAL:g}s"),  # Grafana's: 4 scrapes
        ("$model", model_name),
        ("$instance", instance),
    ):
        expr = expr.replace(variable, value)
    assert not re.search(r"\$[A-Za-z_{]", expr), f"a dashboard variable this test does not know: {expr}"
    return expr
