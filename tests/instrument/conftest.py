"""The instrumentation tests reuse the exporter tests' real `layerwatch exporter` process and the stack
tests' Prometheus binary (imported fixtures, as tests/reliability/conftest.py does)."""

from __future__ import annotations

from tests.exporter.conftest import start_exporter  # noqa: F401
from tests.stack.conftest import prometheus_binary  # noqa: F401
