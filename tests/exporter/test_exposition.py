"""The fast /metrics encoder writes exactly what prometheus_client's generate_latest writes."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from layerwatch.exporter.collectors import EntropyCollector, IngestCollector, LayerCollector, WindowCollector
from layerwatch.exporter.exposition import TextEncoder
from layerwatch.exporter.state import ExporterConfig, ExporterState
from layerwatch.prometheus import HistogramArrays
from tests.exporter.support import random_frame


def registry_for(state: ExporterState) -> CollectorRegistry:
    """The exporter's collectors without the volatile ones (scrape duration, process)."""
    registry = CollectorRegistry()
    for collector in (EntropyCollector, LayerCollector, WindowCollector, IngestCollector):
        registry.register(collector(state))
    return registry


def test_output_is_identical_to_generate_latest() -> None:
    state = ExporterState(ExporterConfig(per_layer=True, min_window_observations=10, statistics_cache_seconds=0))
    rng = np.random.default_rng(0)
    hostile_name = 'we"ird\\model\nname'  # label values must be escaped
    for sequence, model in enumerate(["demo", hostile_name, "demo"]):
        state.ingest(random_frame(rng, sequence, model=model, rows=5, layers=7))
    constant = random_frame(rng, 9, model="constant", rows=4, layers=5)
    constant.entropies[:] = 0.5  # zero variance: the bimodality coefficient is NaN
    state.ingest(constant)
    registry = registry_for(state)
    encoder = TextEncoder()
    for _ in range(2):  # the second pass renders from the cached series text
        assert encoder.encode(registry) == generate_latest(registry)
        state.ingest(random_frame(rng, 3, model="demo", rows=2, layers=7))
    assert b'model_name="we\\"ird\\\\model\\nname"' in encoder.encode(registry)
    assert b'layerwatch_entropy_bimodality_coefficient{model_name="constant"} NaN' in encoder.encode(registry)


def test_histogram_arrays_expose_the_same_samples_to_generic_consumers() -> None:
    metric = HistogramArrays("h", "help", ("a",), ["0.5", "1.0"])
    metric.add_histograms([("x",), ("y",)], np.array([[1, 2], [0, 3]]), np.array([1.5, 2.25]))
    assert [(s.name, s.labels, s.value) for s in metric.samples] == [
        ("h_bucket", {"a": "x", "le": "0.5"}, 1.0),
        ("h_bucket", {"a": "x", "le": "1.0"}, 3.0),
        ("h_bucket", {"a": "x", "le": "+Inf"}, 3.0),
        ("h_count", {"a": "x"}, 3.0),
        ("h_sum", {"a": "x"}, 1.5),
        ("h_bucket", {"a": "y", "le": "0.5"}, 0.0),
        ("h_bucket", {"a": "y", "le": "1.0"}, 3.0),
        ("h_bucket", {"a": "y", "le": "+Inf"}, 3.0),
        ("h_count", {"a": "y"}, 3.0),
        ("h_sum", {"a": "y"}, 2.25),
    ]
    with pytest.raises(AttributeError):
        metric.samples = [metric.samples[0]]
