"""A transformers model instrumented in a few lines is, to the stack, a served model.

A tiny Llama behind per-token routers (examples/router_llama.py) generates sampled text (temperature
0.8, top-p 0.95, batch 8) through layerwatch.integrations.transformers, which sends gate frames to a
real `layerwatch exporter` over loopback UDP and writes a trace:

1. the exporter's histogram is the trace's, its bimodality and routing verdicts are what
   `layerwatch replay` says of the trace;
2. `layerwatch calibrate-trace` makes the model's profile from that trace, and the rules generated
   from it run in a real Prometheus scraping the exporter (time scale 0.01: 5m windows are 3 s):
   healthy traffic keeps every alert of the model silent, not even pending, its skip ratio recorded
   from the exporter's counts (no shim reports the model); routers collapsing to zero scores skip
   (almost) every layer and page LayerwatchZeroEntropyRatioHigh and LayerwatchRunawaySkipping, the
   latter naming the exporter and the most skipped layers;
3. the dashboard, queried as Grafana would, lists the model and draws its skip panels.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from examples.router_llama import MODEL_NAME, THRESHOLD, RoutedDecoderLayer, prompts, routed_llama
from layerwatch.alerts.durations import Timing
from layerwatch.alerts.profile_file import load_profile
from layerwatch.alerts.recorded import Recorded
from layerwatch.cli.main import main
from layerwatch.client import GateFrameSender
from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.deploy.render import render_stack
from layerwatch.integrations.transformers import observe, read_attributes
from layerwatch.statistics import le_bucket_index
from layerwatch.trace import TraceWriter, read_trace
from tests.stack.conftest import REPO
from tests.stack.support import dashboard_expr, prometheus_api, prometheus_argv
from tests.support import wait_for

TIME_SCALE = 0.01
READ_ROUTERS = read_attributes("router_score", "router_ran")
BATCH, NEW_TOKENS = 8, 48


def sampled_batch(model, seed: int) -> None:
    batch = prompts(BATCH, 6, seed)
    model.generate(
        batch,
        attention_mask=torch.ones_like(batch),
        max_new_tokens=NEW_TOKENS,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        pad_token_id=1,
    )


class Traffic:
    """Batches generated in a thread, one after another, until stopped."""

    def __init__(self, model) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(model,), daemon=True)
        self._thread.start()

    def _run(self, model) -> None:
        seed = 1000
        while not self._stop.is_set():
            sampled_batch(model, seed)
            seed += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def samples(exporter, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (sample, labels), v in exporter.samples().items() if sample == name}


def test_an_instrumented_transformers_model_is_seen_as_a_served_one(
    start_exporter, prometheus_binary, tmp_path: Path, capsys
):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = routed_llama()
    layers = model.config.num_hidden_layers
    exporter = start_exporter("--window-seconds", "600", "--statistics-cache-seconds", "0.2")
    address = f"127.0.0.1:{exporter.frames_address[1]}"

    # The instrumentation: a sender, an adapter, a context around generate().
    sender = GateFrameSender(address, MODEL_NAME, layers, THRESHOLD)
    trace = TraceWriter(tmp_path / "healthy.jsonl", 1 << 24, threshold=THRESHOLD)
    with observe(model, READ_ROUTERS, sender=sender, trace=trace):
        for seed in range(3):
            sampled_batch(model, seed)

    # 1. The exporter holds the trace's entropies, and judges them as replay does.
    wait_for(lambda: exporter.received_frames() == sender.sent)
    assert (
        sum(sender.dropped.values()) == 0
        and sum(samples(exporter, "layerwatch_exporter_frames_lost_total").values()) == 0
    )
    rows = list(read_trace(trace.path))
    scores = np.stack([r.scores for r in rows])
    cumulative: dict[str, float] = {}  # le -> count, both decisions
    for labels, value in samples(exporter, "layerwatch_entropy_bucket").items():
        cumulative[dict(labels)["le"]] = cumulative.get(dict(labels)["le"], 0) + value
    expected = np.cumsum(np.bincount(le_bucket_index(scores).ravel(), minlength=20))
    assert [cumulative[le] for le in sorted(cumulative, key=float)] == [*expected.tolist(), scores.size]
    assert main(["replay", str(trace.path), "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["verdict"] == "bimodal" and replayed["routing_verdict"] == "dynamic"
    assert replayed["observations"] == scores.size == sum(samples(exporter, "layerwatch_entropy_count").values())
    gauges = {
        "bimodal": "layerwatch_entropy_bimodal",
        "dip": "layerwatch_entropy_dip",
        "bimodality_coefficient": "layerwatch_entropy_bimodality_coefficient",
        "token_dependent_share": "layerwatch_routing_token_dependent_share",
    }

    def judged() -> dict[str, float]:
        return {key: value for key, name in gauges.items() for value in samples(exporter, name).values()}

    # The statistics are computed at most --statistics-cache-seconds before a scrape: a scrape right after the
    # last frame may still read a judgement without it.
    expected = {key: float(replayed[key]) for key in gauges}
    with contextlib.suppress(AssertionError):
        wait_for(lambda: judged() == pytest.approx(expected, abs=1e-9), timeout=10)
    assert judged() == pytest.approx(expected, abs=1e-9)
    (dynamic,) = samples(exporter, "layerwatch_routing_dynamic").values()
    static = samples(exporter, "layerwatch_routing_layer_static")
    assert dynamic == 1.0
    assert sorted(int(dict(labels)["layer"]) for labels, v in static.items() if v == 1) == replayed["static_layers"]

    # 2. Its profile from the trace, its rules in Prometheus.
    profile_path = tmp_path / f"{MODEL_NAME}.yaml"
    assert main(["calibrate-trace", str(trace.path), "--out", str(profile_path), "--chunk-tokens", "256"]) == 0
    profile = load_profile(profile_path)
    rendered = render_stack(
        tmp_path / "config",
        profiles=[profile],
        shim_targets=[],
        exporter_targets=[exporter.url.removeprefix("http://")],
        alertmanager_target=f"127.0.0.1:{free_port()}",  # nobody: the alerts are read from Prometheus
        pager_url="http://127.0.0.1:9/pager",
        ticket_url="http://127.0.0.1:9/ticket",
        scrape_interval=1.0,
        evaluation_interval=1.0,
        time_scale=TIME_SCALE,
    )
    port = free_port()
    prometheus = ManagedProcess(
        "prometheus", prometheus_argv(prometheus_binary, rendered.prometheus_config, tmp_path, port), tmp_path / "p.log"
    )
    base = f"http://127.0.0.1:{port}"
    recorded = Recorded.for_timing(Timing(TIME_SCALE))
    model_alerts = f'ALERTS{{model_name="{MODEL_NAME}"}}'
    traffic = None
    try:
        prometheus.wait_http(f"{base}/-/ready")
        with observe(model, READ_ROUTERS, sender=sender):
            traffic = Traffic(model)
            mean = f'{recorded.entropy_mean_by_decision}{{model_name="{MODEL_NAME}", decision="run"}}'
            skip_ratio = f'{recorded.skip_ratio}{{model_name="{MODEL_NAME}"}}'
            wait_for_result(base, mean, timeout=30)
            wait_for_result(base, skip_ratio, timeout=10)
            for _ in range(8):  # healthy: every band holds, nothing pending
                assert prometheus_api(base, "/api/v1/query", query=model_alerts)["result"] == []
                time.sleep(1.0)
            (sample,) = prometheus_api(base, "/api/v1/query", query=mean)["result"]
            assert profile.entropy_mean.low <= float(sample["value"][1]) <= profile.entropy_mean.high
            (sample,) = prometheus_api(base, "/api/v1/query", query=skip_ratio)["result"]
            exporter_target = {"job": "layerwatch-exporter", "instance": exporter.url.removeprefix("http://")}
            assert {k: sample["metric"][k] for k in exporter_target} == exporter_target
            assert abs(float(sample["value"][1]) - profile.skip_ratio_normal) < 0.1
            check_dashboard_skip_panels(base)

            routers = [layer for layer in model.model.layers if isinstance(layer, RoutedDecoderLayer)]
            with torch.no_grad():  # the routers collapse: every score near 0
                for router in routers:
                    router.router.bias.fill_(-8.0)
            pages = (
                'ALERTS{alertname=~"LayerwatchZeroEntropyRatioHigh|LayerwatchRunawaySkipping", '
                f'alertstate="firing", severity="critical", model_name="{MODEL_NAME}"}}'
            )
            deadline = time.monotonic() + 45
            while len(firing := prometheus_api(base, "/api/v1/query", query=pages)["result"]) < 2:
                assert time.monotonic() < deadline, f"firing within 45s: {firing}"
                time.sleep(0.5)
            (runaway,) = [
                a
                for a in prometheus_api(base, "/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] == "LayerwatchRunawaySkipping"
            ]
            assert runaway["labels"]["trigger"] == "skip_ratio"
            assert {k: runaway["labels"][k] for k in exporter_target} == exporter_target
            assert re.search(r"Most skipped layers: (\d+ \(\d\.\d{3}\) ){3}", runaway["annotations"]["description"])
    finally:
        if traffic is not None:
            traffic.stop()
        prometheus.stop()
        sender.close()


SKIP_PANELS = ("Skip ratio", "Skip ratio: instances and fleet", "Per-layer skip ratio (layer × time)")


def check_dashboard_skip_panels(base: str) -> None:
    """The Overview dashboard for a model no shim serves, as Grafana would query it: the model list
    has it, the shim instance list is empty (so $instance takes its All value), and every target of
    the skip panels returns a number."""
    dashboard = json.loads((REPO / "layerwatch" / "dashboards" / "json" / "overview.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}

    def label_values(query: str) -> list[str]:
        found = re.fullmatch(r"label_values\((.*), (\w+)\)", query)
        assert found, query
        selector = found[1].replace("$model", MODEL_NAME)
        return prometheus_api(base, f"/api/v1/label/{found[2]}/values", **{"match[]": selector})

    assert MODEL_NAME in label_values(variables["model"]["query"])
    assert label_values(variables["instance"]["query"]) == []
    panels = [panel for panel in dashboard["panels"] if panel["title"] in SKIP_PANELS]
    assert len(panels) == len(SKIP_PANELS)
    for panel in panels:
        for target in panel["targets"]:
            expr = dashboard_expr(target["expr"], MODEL_NAME, variables["instance"]["allValue"])
            result = prometheus_api(base, "/api/v1/query", query=expr)["result"]
            assert any(math.isfinite(float(s["value"][1])) for s in result), (panel["title"], expr)


def wait_for_result(base: str, query: str, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not (result := prometheus_api(base, "/api/v1/query", query=query)["result"]):
        assert time.monotonic() < deadline, f"no result for {query} within {timeout:.0f}s"
        time.sleep(0.5)
    return result
