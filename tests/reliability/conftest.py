"""Real processes on loopback for the reliability tests: `layerwatch serve`, `layerwatch exporter`
and Prometheus, each restartable on the same ports so that a test can kill one mid-load and bring
it back. The tiny checkpoint is the service tests' one (tests/service/conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml

from layerwatch.demo.loadgen import LoadReport, run_load
from layerwatch.demo.processes import LAYERWATCH_COMMAND, ManagedProcess, free_port
from tests.service.conftest import MODEL_NAME, TinyCheckpoint, in_process, tiny_checkpoint  # noqa: F401
from tests.support import sample_sum, scrape

LAYERWATCH = LAYERWATCH_COMMAND
# One torch thread per process: the tests run on a shared 2-core machine.
QUIET_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class _Restartable:
    """A process on fixed loopback ports that a test may kill, stop and start again."""

    process: ManagedProcess | None
    url: str

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def metrics(self) -> dict:
        return scrape(self.url)


class Exporter(_Restartable):
    """`layerwatch exporter` on fixed loopback ports (UDP frames, HTTP metrics); restartable."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.udp_port = free_port(socket.SOCK_DGRAM)
        self.http_port = free_port()
        self.frames_address = f"127.0.0.1:{self.udp_port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.process: ManagedProcess | None = None

    def start(self) -> Exporter:
        argv = [
            *LAYERWATCH,
            "exporter",
            "--listen",
            self.frames_address,
            "--http",
            f"127.0.0.1:{self.http_port}",
            "--min-window-observations",
            "100",
        ]
        self.process = ManagedProcess("exporter", argv, self.workdir / "exporter.log", env=QUIET_ENV)
        self.process.wait_http(f"{self.url}/healthz", timeout=30)
        return self


def wait_for_metrics(shim: Shim, condition: Callable[[dict], bool], timeout: float = 30.0) -> dict:
    """Scrape the shim until `condition(samples)` holds; the samples that satisfied it."""
    deadline = time.monotonic() + timeout
    while True:
        samples = shim.metrics()
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, "the shim did not reach the expected state"
        time.sleep(0.05)


class Shim(_Restartable):
    """`layerwatch serve` on the tiny checkpoint, on a fixed loopback port; restartable. A `launcher`
    (e.g. `prlimit --fsize=N`) runs the command with a changed environment."""

    def __init__(
        self,
        workdir: Path,
        checkpoint: TinyCheckpoint,
        *extra_args: str,
        exporter: Exporter | None = None,
        launcher: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.launcher = launcher
        self.checkpoint = checkpoint
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.exporter_address = exporter.frames_address if exporter else ""
        self.extra_args = extra_args
        self.process: ManagedProcess | None = None
        self.starts = 0

    def start(self, *more_args: str) -> Shim:
        self.starts += 1
        argv = [
            *self.launcher,
            *LAYERWATCH,
            "serve",
            "--model",
            str(self.checkpoint.path),
            "--model-name",
            MODEL_NAME,
            "--port",
            str(self.port),
            "--exporter-address",
            self.exporter_address,
            "--log-level",
            "warning",
            *self.extra_args,
            *more_args,
        ]
        self.process = ManagedProcess("serve", argv, self.workdir / f"serve-{self.starts}.log", env=QUIET_ENV)
        self.process.wait_http(f"{self.url}/healthz", timeout=90)
        return self

    def complete(self, prompt: str = "In the beginning", max_tokens: int = 4, **fields) -> httpx.Response:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, **fields}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)


class Prometheus(_Restartable):
    """The Debian `prometheus` binary scraping given targets every second, its data in a temp dir."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "layerwatch", "static_configs": [{"targets": targets}]}],
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.process: ManagedProcess | None = None

    def start(self) -> Prometheus:
        argv = [
            "prometheus",
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.process = ManagedProcess("prometheus", argv, self.workdir / "prometheus.log")
        self.process.wait_http(f"{self.url}/-/ready", timeout=30)
        return self

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        response = httpx.get(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=10)
        response.raise_for_status()
        return response.json()["data"]["result"]

    def wait_scraped(self, after: float, timeout: float = 15.0) -> None:
        """Until every target has a successful scrape that started after `after` (unix time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            targets = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            if targets and all(t["health"] == "up" and _unix(t["lastScrape"]) > after for t in targets):
                return
            time.sleep(0.2)
        raise TimeoutError(f"Prometheus did not scrape its targets successfully after {after}")


def _unix(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


class BackgroundLoad:
    """run_load in a thread; `result()` joins it."""

    def __init__(self, url: str, duration: float, **kwargs) -> None:
        self._report: LoadReport | None = None
        self.started = time.monotonic()

        def work() -> None:
            self._report = run_load(url, MODEL_NAME, duration=duration, **kwargs)

        self._thread = threading.Thread(target=work, daemon=True)
        self._thread.start()

    def sleep_until(self, seconds_after_start: float) -> None:
        time.sleep(max(0.0, self.started + seconds_after_start - time.monotonic()))

    def result(self, timeout: float = 60.0) -> LoadReport:
        self._thread.join(timeout)
        assert self._report is not None, "the load generator did not finish"
        return self._report


def exporter_entropy_count(exporter_samples: dict, model: str = MODEL_NAME) -> float:
    """Entropies the exporter observed for `model`, over both decisions."""
    return sample_sum(exporter_samples, "layerwatch_entropy_count", model_name=model)


def require_binary(name: str) -> None:
    if shutil.which(name) is None:
        pytest.fail(f"{name} not found on PATH: install the Debian package `{name}`")


@pytest.fixture
def exporter(tmp_path) -> Iterator[Exporter]:
    running = Exporter(tmp_path).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def make_shim(tmp_path, tiny_checkpoint) -> Iterator:
    """Factory: make_shim(*args, exporter=None, start=True) -> a Shim, started unless `start` is False
    (stopped after the test)."""
    shims: list[Shim] = []

    def make(*args: str, exporter: Exporter | None = None, start: bool = True) -> Shim:
        shim = Shim(tmp_path, tiny_checkpoint, *args, exporter=exporter)
        shims.append(shim)
        return shim.start() if start else shim

    yield make
    for shim in shims:
        shim.stop()


# --- generations long enough to still be running while a test acts ------------------------------

LONG_CONTEXT = 4096
LONG_TOKENS = 4000  # a generation that is still decoding whatever the test does meanwhile
LONG_GENERATION = ("--max-tokens-cap", str(LONG_TOKENS), "--max-prompt-tokens", "32")


@pytest.fixture(scope="session")
def long_context_checkpoint(tiny_checkpoint, tmp_path_factory) -> TinyCheckpoint:
    """The tiny checkpoint with a 4096-token context (RoPE positions are computed, not weights, and
    the gates' base-model fingerprint leaves the context out): generations that last seconds."""
    folder = tmp_path_factory.mktemp("long-context") / MODEL_NAME
    shutil.copytree(tiny_checkpoint.path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LONG_CONTEXT}))
    return dataclasses.replace(tiny_checkpoint, path=folder, gates_path=folder / "gates.safetensors")


@pytest.fixture
def make_long_shim(tmp_path, long_context_checkpoint) -> Iterator[Callable[..., Shim]]:
    """Factory: make_long_shim(*args) -> a started Shim on the long-context checkpoint."""
    shims: list[Shim] = []

    def make(*args: str) -> Shim:
        shim = Shim(tmp_path, long_context_checkpoint, *LONG_GENERATION, *args)
        shims.append(shim)
        return shim.start()

    yield make
    for shim in shims:
        shim.stop()
