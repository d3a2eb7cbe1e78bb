"""What the tests and benchmarks share to read a metrics page and to wait for something to happen."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

Sample = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, its labels sorted)
T = TypeVar("T")


def page_samples(text: str) -> dict[Sample, float]:
    """Every sample of a Prometheus text page as {(name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(base_url: str, timeout: float = 10.0) -> dict[Sample, float]:
    """The samples of `base_url`/metrics (a shim's or an exporter's page)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as response:
        return page_samples(response.read().decode())


def collector_samples(collector: Collector) -> dict[Sample, float]:
    """A collector's samples as a scrape would read them: through a registry's text exposition."""
    registry = CollectorRegistry()
    registry.register(collector)
    return page_samples(generate_latest(registry).decode())


def sample_sum(samples: dict[Sample, float], name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, labels[k]) in ls for k in labels))


def wait_for(condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> T:
    """Polls `condition` until it returns something truthy, and returns that; fails the test after
    `timeout` seconds, naming `what` was awaited."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'the condition'} not reached in {timeout:g} s")
        time.sleep(interval)
    return value
