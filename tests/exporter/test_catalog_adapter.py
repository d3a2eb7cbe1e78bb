"""layerwatch/prometheus.py: catalog specs as prometheus_client objects, and collectors that describe
themselves (so a registry refuses a second collector of the same names)."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from layerwatch import catalog, prometheus
from layerwatch.exporter.collectors import (
    EntropyCollector,
    IngestCollector,
    LayerCollector,
    RoutingCollector,
    WindowCollector,
    build_registry,
    exporter_collectors,
)
from layerwatch.exporter.state import ExporterConfig, ExporterState
from tests.exporter.support import random_frame

EXPORTER_COLLECTORS = (EntropyCollector, LayerCollector, WindowCollector, RoutingCollector, IngestCollector)


@pytest.mark.parametrize("spec", catalog.METRICS, ids=lambda s: s.name)
def test_every_spec_becomes_a_family_with_its_name_type_labels_and_help(spec: catalog.MetricSpec) -> None:
    bounds = (0, 1, 2) if spec.kind == "histogram" and spec.buckets is None else None
    family = prometheus.family(spec.name, spec.component, bounds)
    registry = CollectorRegistry()
    registry.register(_Fixed(family, spec, bounds))
    [parsed] = text_string_to_metric_families(generate_latest(registry).decode())
    assert (parsed.name, parsed.type, parsed.documentation) == (spec.base_name, spec.kind, spec.help)
    assert {s.name for s in parsed.samples} == set(spec.series_names)
    assert {k for s in parsed.samples for k in s.labels} - {"le"} == set(spec.labels)
    if spec.buckets is not None:
        assert [float(s.labels["le"]) for s in parsed.samples if s.name.endswith("_bucket")][:-1] == list(spec.buckets)


class _Fixed(prometheus.CatalogCollector):
    """One family with one series, for the test above."""

    def __init__(self, family, spec: catalog.MetricSpec, bounds) -> None:
        self.metric_names = (spec.name,)
        self._family = family
        self._spec = spec
        self._buckets = len(bounds or spec.buckets or ())

    def collect(self):
        values = ["x"] * len(self._spec.labels)
        if self._spec.kind == "histogram":
            self._family.add_histograms([values], np.ones((1, self._buckets), dtype=np.int64), np.array([1.5]))
        else:
            self._family.add_metric(values, 1)
        yield self._family


def test_instruments_are_registered_in_the_given_registry_only() -> None:
    registry = CollectorRegistry()
    requests = prometheus.instrument("layerwatch_requests_total", registry, catalog.SHIM)
    rejected = prometheus.instrument("layerwatch_gate_file_rejected", registry, catalog.SHIM)
    latency = prometheus.instrument("layerwatch_time_to_first_token_seconds", registry, catalog.SHIM)
    assert (type(requests), type(rejected), type(latency)) == (Counter, Gauge, Histogram)
    requests.labels("m", "ok").inc()
    assert registry.get_sample_value("layerwatch_requests_total", {"model_name": "m", "status": "ok"}) == 1
    latency.labels("m").observe(0.003)
    assert (
        registry.get_sample_value("layerwatch_time_to_first_token_seconds_bucket", {"model_name": "m", "le": "0.005"})
        == 1
    )  # the catalog's buckets
    with pytest.raises(ValueError, match="per-model buckets"):
        prometheus.instrument("layerwatch_layers_executed", registry, catalog.SHIM)


def test_a_component_cannot_build_the_other_components_metrics() -> None:
    with pytest.raises(ValueError, match="exporter metric"):
        prometheus.family("layerwatch_entropy", catalog.SHIM)
    with pytest.raises(ValueError, match="shim metric"):
        prometheus.instrument("layerwatch_requests_total", CollectorRegistry(), catalog.EXPORTER)
    with pytest.raises(KeyError, match="catalog"):
        prometheus.family("layerwatch_no_such_metric")


def _state() -> ExporterState:
    state = ExporterState(ExporterConfig(per_layer=True, min_window_observations=10, statistics_cache_seconds=0))
    rng = np.random.default_rng(1)
    for sequence in range(4):
        state.ingest(random_frame(rng, sequence, model="demo", rows=5, layers=6))
    return state


@pytest.mark.parametrize("collector_class", EXPORTER_COLLECTORS, ids=lambda c: c.__name__)
def test_exporter_collectors_describe_what_they_collect(collector_class) -> None:
    collector = collector_class(_state())
    described = [(m.name, m.type) for m in collector.describe()]
    collected = [(m.name, m.type) for m in collector.collect()]
    assert set(collected) <= set(described) and len(described) == len(set(described))
    assert {name for name, _ in described} <= {s.base_name for s in catalog.for_component(catalog.EXPORTER)}


def test_the_exporter_registry_describes_every_exporter_metric_and_refuses_duplicates() -> None:
    state = _state()
    assert {m.name for m in exporter_collectors(state).describe()} == {
        s.base_name for s in catalog.for_component(catalog.EXPORTER)
    }
    registry = build_registry(state)
    for collector in (EntropyCollector(state), IngestCollector(state)):
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            registry.register(collector)
    with pytest.raises(ValueError, match="Duplicated timeseries"):  # an instrument of a taken name too
        Gauge("layerwatch_entropy_dip", "clash", registry=registry)
