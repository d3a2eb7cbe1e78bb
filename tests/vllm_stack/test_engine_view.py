"""The monitoring stack on a vLLM deployment, end to end: a real `vllm serve` (conftest.py), a real exporter
and a real Prometheus scraping both with the rendered configuration and rules, under sampled chat load.
Every query of the dashboard that reads vLLM's series is answered with data, every vLLM series layerwatch
reads is on vLLM's /metrics page, and Prometheus evaluates every rule, vLLM's included, without error."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from layerwatch import catalog
from layerwatch.alerts.profile_file import load_profiles
from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.deploy.render import render_stack
from layerwatch.mixin import config
from tests.stack.conftest import require_binary
from tests.stack.support import (
    EVALUATION_INTERVAL,
    SCRAPE_INTERVAL,
    TIME_SCALE,
    Load,
    dashboard_expr,
    exporter_argv,
    prometheus_api,
    prometheus_argv,
    start_processes,
)
from tests.support import scrape, wait_for
from tests.vllm_engine import VllmEngine

from .conftest import REPO, SERVED_MODEL_NAME

pytestmark = pytest.mark.e2e

DATA_TIMEOUT_SECONDS = 90.0  # from the load's start to a query's first answer (a few scrapes and requests)


@dataclass
class VllmStack:
    vllm_url: str
    prometheus_url: str
    exporter_url: str
    processes: dict[str, ManagedProcess] = field(default_factory=dict)

    def query(self, expr: str) -> list[dict]:
        result = prometheus_api(self.prometheus_url, "/api/v1/query", query=expr)
        assert isinstance(result, dict)
        return result["result"]

    def answered(self, expr: str) -> list[dict] | None:
        """The samples of `expr` once it has at least one finite one (NaN: a quantile of no observations)."""
        samples = self.query(expr)
        return samples if any(math.isfinite(float(s["value"][1])) for s in samples) else None


@pytest.fixture(scope="module")
def stack(vllm_engine: VllmEngine, tmp_path_factory) -> Iterator[VllmStack]:
    vllm_base_url = vllm_engine.base_url
    workdir = tmp_path_factory.mktemp("vllm-stack")
    exporter_http = f"127.0.0.1:{free_port()}"
    exporter_udp, prometheus_port = vllm_engine.frame_port, free_port()  # the plugin's frames reach the exporter
    rendered = render_stack(
        workdir / "config",
        profiles=load_profiles(REPO / "layerwatch/alerts/profiles"),
        shim_targets=[],
        exporter_targets=[exporter_http],
        vllm_targets=[vllm_base_url.removeprefix("http://")],
        alertmanager_target=f"127.0.0.1:{free_port()}",  # alerts are not this test's: none runs there
        pager_url="http://127.0.0.1:1/pager",
        ticket_url="http://127.0.0.1:1/ticket",
        scrape_interval=SCRAPE_INTERVAL,
        evaluation_interval=EVALUATION_INTERVAL,
        time_scale=TIME_SCALE,
    )
    s = VllmStack(vllm_base_url, f"http://127.0.0.1:{prometheus_port}", f"http://{exporter_http}")
    load = None
    try:
        start_processes(
            workdir,
            s.processes,
            ("exporter", exporter_argv(exporter_udp, exporter_http), f"http://{exporter_http}/healthz"),
            (
                "prometheus",
                prometheus_argv(require_binary("prometheus"), rendered.prometheus_config, workdir, prometheus_port),
                f"{s.prometheus_url}/-/ready",
            ),
        )
        load = Load(vllm_base_url, SERVED_MODEL_NAME)  # chat, sampled at temperature 1.0 and 0.7
        yield s
    finally:
        if load is not None:
            load.stop()
            print("load: " + "; ".join(r.summary() for r in load.reports))
        for process in s.processes.values():
            process.stop()


def test_every_vllm_series_layerwatch_reads_is_on_vllms_page(vllm_base_url: str) -> None:
    exposed = {name for name, _ in scrape(vllm_base_url)}
    assert not catalog.VLLM_SERIES - exposed, f"vLLM does not expose {sorted(catalog.VLLM_SERIES - exposed)}"


def test_every_dashboard_query_of_vllm_series_is_answered(stack: VllmStack) -> None:
    from layerwatch.dashboards import overview

    _, queries = overview.build()
    engine = [(title, expr) for title, expr in queries if "vllm:" in expr and not title.startswith("variable")]
    assert len(engine) >= 7, engine  # latency, requests, tokens, KV cache, preemptions
    started = time.monotonic()
    for title, expr in engine:
        query = dashboard_expr(expr, SERVED_MODEL_NAME, ".*")
        wait_for(
            lambda q=query: stack.answered(q),
            timeout=max(5.0, DATA_TIMEOUT_SECONDS - (time.monotonic() - started)),
            interval=1.0,
            what=f"data for {title!r}: {query}",
        )
    # The model variable lists the vLLM-served model.
    models = prometheus_api(
        stack.prometheus_url, "/api/v1/label/model_name/values", **{"match[]": "vllm:num_requests_running"}
    )
    assert SERVED_MODEL_NAME in models


def test_prometheus_scrapes_vllm_and_evaluates_every_rule(stack: VllmStack) -> None:
    up = wait_for(lambda: stack.answered(f"up{{{config.VLLM_SELECTOR}}}"), timeout=30.0, interval=1.0, what="vllm's up")
    assert [float(s["value"][1]) for s in up] == [1.0]

    def evaluated_rules() -> list[dict] | None:
        data = prometheus_api(stack.prometheus_url, "/api/v1/rules")
        assert isinstance(data, dict)
        rules = [rule for group in data["groups"] for rule in group["rules"]]
        return rules if all(rule["lastEvaluation"] != "0001-01-01T00:00:00Z" for rule in rules) else None

    rules = wait_for(evaluated_rules, timeout=30.0, interval=1.0, what="every rule evaluated once")
    broken = {rule["name"]: rule.get("lastError") for rule in rules if rule["health"] != "ok"}
    assert not broken


def test_the_exporter_reads_the_plugins_gate_frames_from_inside_vllm(stack: VllmStack) -> None:
    """The plugin's frames, one per decode step from vLLM's worker, reach the exporter under the served model's
    name with every layer's scores, and its skips among them, as the shim's frames do."""

    def per_layer(name: str) -> dict[str, float]:
        return {
            dict(labels)["layer"]: value
            for (sample, labels), value in scrape(stack.exporter_url).items()
            if sample == name and dict(labels)["model_name"] == SERVED_MODEL_NAME
        }

    counts = wait_for(
        lambda: (c := per_layer("layerwatch_layer_entropy_count_total")) and all(v > 0 for v in c.values()) and c,
        timeout=DATA_TIMEOUT_SECONDS,
        interval=1.0,
        what="the exporter's per-layer entropy counts for the served model",
    )
    assert set(counts) == {str(layer) for layer in range(30)}
    wait_for(
        lambda: sum(per_layer("layerwatch_exporter_layer_skips_total").values()) > 0,
        timeout=DATA_TIMEOUT_SECONDS,
        interval=1.0,
        what="a skip in the plugin's frames",
    )
