"""The shim's custom collectors describe themselves from the catalog, so registering one checks its
names: a clash with a metric already in the registry is refused, not exposed twice."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from layerwatch import catalog
from layerwatch.client import GateFrameSender
from layerwatch.gate_importance import LayerSignalStats
from layerwatch.inference_shim.runtime.agreement import LayerSignals
from layerwatch.inference_shim.service.depth import DepthMetrics
from layerwatch.inference_shim.service.http_protocol import ConnectionRefusals
from layerwatch.inference_shim.service.layer_signals import LayerSignalsCollector
from layerwatch.inference_shim.service.metrics import (
    AuditCollector,
    AuditSpanCounts,
    DecodeStats,
    DecodeStatsCollector,
    GateReloadMetrics,
    ModelInfo,
    ModelInfoCollector,
    RequestMetrics,
    RequestQueueCollector,
    ShadowMetrics,
    isolated,
    make_metric,
)
from layerwatch.inference_shim.service.mitigation import MitigationMetrics
from layerwatch.inference_shim.service.power import GpuReading, NvmlCollector, RaplCollector
from layerwatch.inference_shim.service.telemetry import FrameSenderCollector, TraceCollector


def shim_collectors() -> list:
    stats = DecodeStats(3)
    skipped = np.array([[True, False, False]])
    stats.observe(skipped, skipped, np.array([True, False, False]), np.array([False]))
    signals = LayerSignalStats(3, reservoir=3)
    signals.observe(LayerSignals(np.ones((1, 3)), np.zeros((1, 3)), np.array([[0.1, 0.2, 0.3]])))
    collectors = [
        LayerSignalsCollector(signals, "m"),
        DecodeStatsCollector(stats, "m"),
        ModelInfoCollector(lambda: ModelInfo("m", 3, "float32", "none", 0.18, 3, "streak", 0.5, "project", "0" * 64)),
        FrameSenderCollector(None, "m"),
        TraceCollector(None, "m"),
        NvmlCollector(reader=lambda: [GpuReading(0, "GPU-0", 120.0, 5.0)]),
        RaplCollector(zones=[]),
        RequestQueueCollector(lambda: 2, lambda: 3, "m"),
        AuditCollector(AuditSpanCounts(), "m"),
    ]
    return [*collectors, isolated({})]  # the isolation's own success and duration gauges


@pytest.mark.parametrize("index", range(len(shim_collectors())))
def test_each_collector_describes_what_it_collects(index):
    collector = shim_collectors()[index]
    described = [(m.name, m.type) for m in collector.describe()]
    collected = [(m.name, m.type) for m in collector.collect()]
    assert set(collected) <= set(described) and len(described) == len(set(described))


def test_a_full_shim_registry_covers_the_catalog_and_refuses_clashes():
    registry = CollectorRegistry()
    collectors = shim_collectors()
    for collector in collectors:
        registry.register(collector)
    RequestMetrics(registry, "m")
    ShadowMetrics(registry, "m")
    GateReloadMetrics(registry, "m")
    MitigationMetrics(registry, "m")
    DepthMetrics(registry, "m")
    ConnectionRefusals(registry, "m")
    exposed = {m.name for m in registry.collect()}
    assert exposed == {spec.base_name for spec in catalog.for_component(catalog.SHIM)}

    for collector in shim_collectors():  # a second copy of any collector
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            registry.register(collector)
    with pytest.raises(ValueError, match="Duplicated timeseries"):  # an instrument named like a collector's metric
        make_metric("layerwatch_fallbacks_total", registry)
    fresh = CollectorRegistry()
    make_metric("layerwatch_telemetry_frames_sent_total", fresh)
    with pytest.raises(ValueError, match="Duplicated timeseries"):  # and the other way round
        fresh.register(FrameSenderCollector(None, "m"))


def test_the_frame_sender_refuses_port_zero():
    """A destination needs a real port (the exporter may listen on port 0, the shim cannot send there)."""
    with pytest.raises(ValueError, match="exporter address '127.0.0.1:0'"):
        GateFrameSender("127.0.0.1:0", "m", 4, 0.18, shim_id="shim")


def test_a_failing_collector_leaves_the_rest_of_the_shims_scrape_served(in_process) -> None:
    server = in_process()

    def broken() -> None:
        raise FloatingPointError("injected: the gate-importance correlation failed")

    server.service.layer_signals.snapshot = broken  # the statistic behind LayerSignalsCollector
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200  # the target stays up
    samples = server.metrics()
    success = {
        dict(labels)["collector"]: value
        for (name, labels), value in samples.items()
        if name == "layerwatch_scrape_collector_success"
    }
    assert success == {
        "model_info": 1,
        "decode_stats": 1,
        "frame_sender": 1,
        "trace": 1,
        "nvml": 1,
        "rapl": 1,
        "layer_signals": 0,
        "request_queue": 1,
        "audit": 1,
    }
    names = {name for name, _ in samples}
    assert "layerwatch_gate_importance_samples" not in names
    assert {"layerwatch_model_info", "layerwatch_layer_evaluations_total", "layerwatch_nvml_up"} <= names
