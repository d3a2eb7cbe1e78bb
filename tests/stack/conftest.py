"""Fixtures for the stack tests: the real promtool, amtool, Alertmanager, VictoriaMetrics and docker-compose."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} not found on PATH: install the Debian packages prometheus, "
            "prometheus-alertmanager, victoria-metrics and docker-compose (scripts/test.sh does)"
        )
    return path


def run_tool(*argv: str | Path, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture(scope="session")
def amtool() -> str:
    return require_binary("amtool")


@pytest.fixture(scope="session")
def alertmanager_binary() -> str:
    return require_binary("prometheus-alertmanager")


@pytest.fixture(scope="session")
def docker_compose() -> str:
    return require_binary("docker-compose")


@pytest.fixture(scope="session")
def reference_profiles():
    from layerwatch.alerts.profile_file import load_profiles

    return load_profiles(REPO / "layerwatch" / "alerts" / "profiles")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return require_binary("prometheus")


@pytest.fixture(scope="session")
def victoria_metrics_binary() -> str:
    return require_binary("victoria-metrics")
