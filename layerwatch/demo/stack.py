"""The processes of one demo run: the exporter and the engine (the shim, or `vllm serve` with layerwatch's
plugin: vllm_serve.py), then Prometheus and Alertmanager with the repository's own rendered configs when
their binaries are installed.

The monitoring side runs on a scaled timing (`StackTiming`; the demo model's is the end-to-end test's,
docs/end-to-end.md): the production rules with every window, `for:` and Alertmanager wait scaled,
scraped and evaluated every second, and a short exporter window, so that a fault pages within about a
minute or a few instead of 10 to 20.
Alertmanager delivers to a receiver in the demo's own process (layerwatch/demo/receiver.py).

Every process is started through ManagedProcess (its log in the run's workdir) and stopped, in
reverse order of starting, by `stop_all`, whatever the way out is.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from layerwatch.alerts.durations import Timing
from layerwatch.alerts.profile import Profile
from layerwatch.demo.frame_link import FrameLink
from layerwatch.demo.processes import LAYERWATCH_COMMAND, ManagedProcess, free_port
from layerwatch.demo.receiver import PAGER_PATH, TICKET_PATH, WebhookReceiver
from layerwatch.demo.vllm_serve import START_TIMEOUT_SECONDS, VLLM_ENV, VllmServe, plugin_drill
from layerwatch.deploy.render import Stack, render_stack
from layerwatch.mixin.config import LatencyObjectives

SCRAPE_INTERVAL = EVALUATION_INTERVAL = 1.0
# Alertmanager's repeat intervals stay production's (a page 1h, a ticket 4h): scaled, a page still
# firing came again every 36 s, five notifications of one alert in a minute and a quarter; a repeat
# is a reminder, not news, and a demo is over long before one.
REPEAT_TIME_SCALE = 1.0


@dataclass(frozen=True)
class StackTiming:
    """How fast the monitoring runs: the production rules with every window, `for:` and Alertmanager
    wait × `time_scale`, and the exporter's bimodality and routing window (its default: 300 s)."""

    time_scale: float
    exporter_window_seconds: float

    @property
    def rules(self) -> Timing:
        return Timing(self.time_scale)

    def note(self) -> str:
        """What the terminal says about it."""
        return (
            f"timing             rules' windows, for: and Alertmanager waits x {self.time_scale:g} "
            f"(5m -> {self.rules(300)}, 10m -> {self.rules(600)}), scrape and evaluation {SCRAPE_INTERVAL:g}s, "
            f"exporter window {self.exporter_window_seconds:g}s\n"
            "                   so that a fault pages within minutes (in production: 10-20 minutes)"
        )


# The embedded demo model's, the end-to-end test's: 5m -> 3s, 10m -> 6s, 1h -> 36s, a 10 s window.
DEMO_TIMING = StackTiming(time_scale=0.01, exporter_window_seconds=10.0)

# vLLM's latency objectives on the demo's machine: two cores shared by vLLM, its load and the whole stack.
# Production's (0.25 s between tokens) ticketed a healthy run at load average 7-8 (p99 0.48-0.54 s); at load
# average 5-20 a healthy 10-minute run's p99 over 15 s windows reached 2.47 s between tokens, and the first
# window after vLLM's start 10 s to the first token. Twice that: a stall tickets, a busy machine does not.
DEMO_LATENCY_OBJECTIVES = LatencyObjectives(time_to_first_token_max=20.0, inter_token_latency_max=5.0)


class DemoStack:
    """The processes of one demo run, stopped in reverse order of starting."""

    def __init__(self, workdir: Path, timing: StackTiming = DEMO_TIMING, *, frame_link: bool = False) -> None:
        """`frame_link`: the engine sends its gate frames through a FrameLink, which a drill can make lossy."""
        self.workdir = workdir
        self.timing = timing
        self._with_frame_link = frame_link
        self.frame_link: FrameLink | None = None
        self.processes: list[ManagedProcess] = []
        self.model_name = ""
        self.engine = "shim"  # the engine's process name and scrape job: "shim" or "vllm"
        self.engine_url = ""
        self.guard_url = ""  # vLLM's quality guard (`layerwatch vllm-guard`), where the load goes on vLLM
        self._ready_path = "/readyz"  # where the engine says it serves
        self._start_timeout = 180.0
        self._engine_env: dict[str, str] = {}
        # A drill's `serve` flags -> the argv of the engine serving them; set when the engine starts.
        self._drill_argv: Callable[[tuple[str, ...]], list[str]] | None = None
        self._engine_restarts = 0
        # A drill restarts the engine from a thread of its own (layerwatch/demo/drills.py): no process may
        # start once stop_all began, or it would outlive the demo.
        self._lock = threading.Lock()
        self._stopping = False
        self._retiring: list[ManagedProcess] = []  # an engine being replaced: stop_all stops it too

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"not starting {name}: the demo is stopping")
            proc = ManagedProcess(name, argv, self.workdir / f"{name}.log", env)
            self.processes.append(proc)
        return proc

    def _start_exporter(self, exporter_port: int) -> tuple[ManagedProcess, str, str]:
        """The exporter, where the engine sends its frames (the exporter's address, or the frame link's) and
        the exporter's URL."""
        frames = f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"
        exporter = self._start(
            "exporter",
            LAYERWATCH_COMMAND
            + ["exporter", "--listen", frames, "--http", f"127.0.0.1:{exporter_port}"]
            + ["--window-seconds", f"{self.timing.exporter_window_seconds:g}", "--statistics-cache-seconds", "0.5"],
        )
        if self._with_frame_link:
            self.frame_link = FrameLink(frames)
            frames = self.frame_link.address
        return exporter, frames, f"http://127.0.0.1:{exporter_port}"

    def lose_frames(self, *, every: int) -> None:
        """From now on the link to the exporter loses every `every`-th gate frame."""
        if self.frame_link is None:
            raise RuntimeError("the engine's frames go straight to the exporter: the stack was made without frame_link")
        self.frame_link.lose_every(every)

    def _start_engine(self, exporter: ManagedProcess, exporter_url: str, port: int, argv: list[str]) -> tuple[str, str]:
        engine = self._start(self.engine, argv, self._engine_env)
        exporter.wait_http(exporter_url + "/healthz", timeout=30)
        self.engine_url = f"http://127.0.0.1:{port}"
        engine.wait_http(self.engine_url + self._ready_path, timeout=self._start_timeout)
        self.model_name = served_model_name(self.engine_url)
        return self.engine_url, exporter_url

    def start_core(
        self, *, port: int, exporter_port: int, shadow_rate: float, model_flags: list[str]
    ) -> tuple[str, str]:
        """Start the exporter and the shim (`serve` with `model_flags`: the embedded model without any)."""
        exporter, frames, exporter_url = self._start_exporter(exporter_port)
        shim_argv = LAYERWATCH_COMMAND + ["serve", "--port", str(port), "--exporter-address", frames]
        shim_argv += ["--shadow-rate", str(shadow_rate), *model_flags]
        self._drill_argv = lambda flags: [*shim_argv, *flags]
        return self._start_engine(exporter, exporter_url, port, shim_argv)

    def start_vllm(self, *, port: int, exporter_port: int, serve: VllmServe, shadow_rate: float) -> tuple[str, str]:
        """Start the exporter, `vllm serve` with the plugin sending its frames there, and its quality guard
        checking `shadow_rate` of the answers (it outlives a drill's restart of vLLM: the same upstream)."""
        serve.check()
        self.engine, self._ready_path, self._start_timeout = "vllm", "/health", START_TIMEOUT_SECONDS
        self._engine_env = VLLM_ENV
        exporter, frames, exporter_url = self._start_exporter(exporter_port)

        def drill_argv(flags: tuple[str, ...]) -> list[str]:
            drill = plugin_drill(flags)
            gates = None
            if drill.export_flags:
                gates = self.workdir / "drill-gates.safetensors"
                serve.export_gates(drill.export_flags, gates)
            return serve.argv(port, frames, drill, gates)

        self._drill_argv = drill_argv
        engine_url, exporter_url = self._start_engine(exporter, exporter_url, port, serve.argv(port, frames))
        guard_port = free_port()
        guard_argv = [*LAYERWATCH_COMMAND, "vllm-guard", "--upstream", engine_url]
        guard_argv += ["--listen", f"127.0.0.1:{guard_port}", "--served-model-name", self.model_name]
        guard = self._start("vllm-guard", [*guard_argv, "--shadow-rate", str(shadow_rate)])
        self.guard_url = f"http://127.0.0.1:{guard_port}"
        guard.wait_http(self.guard_url + "/metrics", timeout=30)
        return engine_url, exporter_url

    def restart_engine(self, *flags: str) -> float:
        """Replace the engine by one serving a drill's `serve` flags at the same address (the same scrape
        target), as the end-to-end test injects its faults; returns when the new one was ready (monotonic).
        The new argv comes first: writing a drill's gates for vLLM takes seconds, while the old one serves."""
        if self._drill_argv is None:
            raise RuntimeError("no engine to restart: none was started")
        argv = self._drill_argv(flags)
        with self._lock:
            (old,) = [proc for proc in self.processes if proc.name == self.engine]
            self.processes.remove(old)  # before it stops: check_alive must not take it for a crash
            self._retiring.append(old)
        old.stop()
        with self._lock:
            self._retiring.remove(old)
        self._engine_restarts += 1
        old.log_path.rename(self.workdir / f"{self.engine}-{self._engine_restarts}.log")
        new = self._start(self.engine, argv, self._engine_env)
        new.wait_http(self.engine_url + self._ready_path, timeout=self._start_timeout)
        return time.monotonic()

    def start_prometheus(
        self,
        engine_url: str,
        exporter_url: str,
        *,
        profiles: list[Profile],
        receiver: WebhookReceiver,
        prometheus_port: int,
        alertmanager_port: int,
    ) -> str:
        """Start Alertmanager (routing to `receiver`) and Prometheus (evaluating the rules of
        `profiles`); returns Prometheus' URL."""
        paths = render_config(
            self.workdir / "config",
            profiles,
            engine_url,
            exporter_url,
            receiver,
            f"127.0.0.1:{alertmanager_port}",
            self.timing,
            self.engine,
            self.guard_url,
        )
        # A fresh store each run: a reused --workdir's old series (other ports, other gates) would
        # still answer queries for Prometheus' 5-minute lookback, and old alerts would fire again.
        for store in ("prometheus-data", "alertmanager-data"):
            shutil.rmtree(self.workdir / store, ignore_errors=True)
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
        return prom_url

    def check_alive(self) -> None:
        with self._lock:
            processes = list(self.processes)
        for proc in processes:
            if not proc.running():
                raise RuntimeError(f"{proc.name} exited unexpectedly:\n{proc.log_tail()}")

    def stop_all(self) -> None:
        with self._lock:
            self._stopping = True
            processes = self._retiring + self.processes
        for proc in reversed(processes):
            proc.stop()
        if self.frame_link is not None:
            self.frame_link.close()


def render_config(
    dest: Path,
    profiles: list[Profile],
    engine_url: str,
    exporter_url: str,
    receiver: WebhookReceiver,
    alertmanager_target: str,
    timing: StackTiming = DEMO_TIMING,
    engine: str = "shim",
    guard_url: str = "",
) -> Stack:
    """The demo's Prometheus and Alertmanager configs and rules, on `timing`, into `dest`; the engine
    scraped as the shim's job or vLLM's, and vLLM's guard (`guard_url`) as its own."""
    engine_targets = [host_port(engine_url)]
    return render_stack(
        dest,
        profiles=profiles,
        shim_targets=engine_targets if engine == "shim" else [],
        vllm_targets=engine_targets if engine == "vllm" else [],
        vllm_guard_targets=[host_port(guard_url)] if guard_url else [],
        exporter_targets=[host_port(exporter_url)],
        alertmanager_target=alertmanager_target,
        pager_url=receiver.url(PAGER_PATH),
        ticket_url=receiver.url(TICKET_PATH),
        scrape_interval=SCRAPE_INTERVAL,
        evaluation_interval=EVALUATION_INTERVAL,
        time_scale=timing.time_scale,
        repeat_time_scale=REPEAT_TIME_SCALE,
        latency_objectives=DEMO_LATENCY_OBJECTIVES,
    )


def monitoring_installed() -> bool:
    return bool(shutil.which("prometheus") and shutil.which("prometheus-alertmanager"))


def served_model_name(shim_url: str) -> str:
    with urllib.request.urlopen(shim_url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def host_port(url: str) -> str:
    return url.split("://", 1)[1]
