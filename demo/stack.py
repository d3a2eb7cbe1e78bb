"""The processes of one demo run: the exporter and the shim, then Prometheus and Alertmanager with
the repository's own rendered configs when their binaries are installed.

Every process is started through ManagedProcess (its log in the run's workdir) and stopped, in
reverse order of starting, by `stop_all`, whatever the way out is.
"""

from __future__ import annotations

import json
import shutil
import socket
import urllib.request
from pathlib import Path

from alerts.profile import PROFILES_DIR, load_profiles
from demo.processes import LAYERWATCH_COMMAND, ManagedProcess, free_port
from deploy.render import render_stack
from mixin import config


class DemoStack:
    """The processes of one demo run, stopped in reverse order of starting."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[ManagedProcess] = []
        self.model_name = ""

    def _start(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.workdir / f"{name}.log")
        self.processes.append(proc)
        return proc

    def start_core(self, *, port: int, exporter_port: int, shadow_rate: float, model: str | None) -> tuple[str, str]:
        cli = LAYERWATCH_COMMAND
        udp_port = free_port(socket.SOCK_DGRAM)
        exporter_url = f"http://127.0.0.1:{exporter_port}"
        exporter = self._start(
            "exporter", cli + ["exporter", "--listen", f"127.0.0.1:{udp_port}", "--http", f"127.0.0.1:{exporter_port}"]
        )
        shim_argv = cli + [
            "serve",
            "--port",
            str(port),
            "--exporter-address",
            f"127.0.0.1:{udp_port}",
            "--shadow-rate",
            str(shadow_rate),
        ]
        if model:
            shim_argv += ["--model", model]
        shim = self._start("shim", shim_argv)
        exporter.wait_http(exporter_url + "/healthz", timeout=30)
        shim_url = f"http://127.0.0.1:{port}"
        shim.wait_http(shim_url + "/readyz", timeout=180)
        self.model_name = served_model_name(shim_url)
        return shim_url, exporter_url

    def start_prometheus(
        self, shim_url: str, exporter_url: str, *, prometheus_port: int, alertmanager_port: int
    ) -> list[str]:
        if not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")):
            return ["prometheus         not installed: skipped (Debian packages prometheus, prometheus-alertmanager)"]
        paths = render_stack(
            self.workdir / "config",
            profiles=load_profiles(PROFILES_DIR),
            shim_targets=[host_port(shim_url)],
            exporter_targets=[host_port(exporter_url)],
            alertmanager_target=f"127.0.0.1:{alertmanager_port}",
            pager_url=config.PAGER_URL,
            ticket_url=config.TICKET_URL,
        )
        am_url = f"http://127.0.0.1:{alertmanager_port}"
        prom_url = f"http://127.0.0.1:{prometheus_port}"
        am = self._start(
            "alertmanager",
            [
                "prometheus-alertmanager",
                f"--config.file={paths.alertmanager_config}",
                f"--storage.path={self.workdir / 'alertmanager-data'}",
                f"--web.listen-address=127.0.0.1:{alertmanager_port}",
                "--cluster.listen-address=",
            ],
        )
        prom = self._start(
            "prometheus",
            [
                "prometheus",
                f"--config.file={paths.prometheus_config}",
                f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{prometheus_port}",
            ],
        )
        am.wait_http(am_url + "/-/ready", timeout=30)
        prom.wait_http(prom_url + "/-/ready", timeout=30)
        return [f"prometheus         {prom_url}/alerts", f"alertmanager       {am_url}"]

    def check_alive(self) -> None:
        for proc in self.processes:
            if not proc.running():
                raise RuntimeError(f"{proc.name} exited unexpectedly:\n{proc.log_tail()}")

    def stop_all(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()


def served_model_name(shim_url: str) -> str:
    with urllib.request.urlopen(shim_url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def host_port(url: str) -> str:
    return url.split("://", 1)[1]
