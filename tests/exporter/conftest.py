"""Fixtures for the exporter tests: a real `layerwatch exporter` process on loopback."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.exporter.support import RunningExporter

_READY = re.compile(r"udp://127\.0\.0\.1:(\d+), serving http://127\.0\.0\.1:(\d+)/metrics")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite the golden files under tests/exporter/data instead of comparing",
    )


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden", default=False))


@pytest.fixture
def start_exporter(tmp_path: Path) -> Iterator[Callable[..., RunningExporter]]:
    """Starts `layerwatch exporter *args` and returns it once it has said where it listens."""
    running: list[RunningExporter] = []

    def start(*args: str) -> RunningExporter:
        log = tmp_path / f"exporter-{len(running)}.log"
        with open(log, "wb") as stderr:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "layerwatch.cli.main",
                    "exporter",
                    "--listen",
                    "127.0.0.1:0",
                    "--http",
                    "127.0.0.1:0",
                    *args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        deadline = time.monotonic() + 20
        while not (match := _READY.search(log.read_text())):
            assert process.poll() is None, f"exporter exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"exporter did not start:\n{log.read_text()}"
            time.sleep(0.05)
        exporter = RunningExporter(process, int(match[1]), int(match[2]))
        running.append(exporter)
        return exporter

    yield start
    for exporter in running:
        exporter.stop()
