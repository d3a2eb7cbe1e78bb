"""Prometheus collectors: the exporter's state turned into metrics at scrape time.

One collector per concern, every metric built from its spec in layerwatch/catalog.py, the registry
injected (never the global one).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from exporter.exposition import HistogramArrays
from exporter.state import ExporterState
from layerwatch.statistics import DECISIONS
from layerwatch.catalog import BY_NAME


def family(name: str) -> Metric:
    """An empty metric family for a catalog entry."""
    spec = BY_NAME[name]
    if spec.kind == "histogram":
        return HistogramArrays(spec.name, spec.help, spec.labels, [floatToGoString(b) for b in spec.buckets])
    kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
    return kinds[spec.kind](spec.base_name, spec.help, labels=spec.labels)


class EntropyCollector:
    """layerwatch_entropy{model_name,decision} with Σx² and the zero-entropy count."""

    def __init__(self, state: ExporterState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        histogram = family("layerwatch_entropy")
        squares = family("layerwatch_entropy_squares_total")
        zeros = family("layerwatch_entropy_zero_total")
        for model in self._state.snapshot():
            labels = [(model.model_name, decision) for decision in DECISIONS]
            histogram.add_histograms(labels, model.buckets, model.sums)
            for index, decision_labels in enumerate(labels):
                squares.add_metric(decision_labels, float(model.squares[index]))
                zeros.add_metric(decision_labels, int(model.zeros[index]))
        yield from (histogram, squares, zeros)


class LayerCollector:
    """Per-layer sums and counts (means are always derivable); per-layer histograms with --per-layer."""

    def __init__(self, state: ExporterState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        sums = family("layerwatch_layer_entropy_sum_total")
        counts = family("layerwatch_layer_entropy_count_total")
        histograms = family("layerwatch_entropy_per_layer")
        for model in self._state.snapshot():
            labels = [(model.model_name, str(layer)) for layer in range(len(model.layer_sums))]
            for layer_labels, total, count in zip(labels, model.layer_sums.tolist(), model.layer_counts.tolist()):
                sums.add_metric(layer_labels, total)
                counts.add_metric(layer_labels, count)
            if model.layer_buckets is not None:
                histograms.add_histograms(labels, model.layer_buckets, model.layer_sums)
        yield from (sums, counts)
        if histograms.label_values:
            yield histograms


class WindowCollector:
    """The sliding window's bimodality statistics; withheld (absent) below the minimum window."""

    def __init__(self, state: ExporterState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        observations = family("layerwatch_entropy_window_observations")
        bimodal = family("layerwatch_entropy_bimodal")
        coefficient = family("layerwatch_entropy_bimodality_coefficient")
        dip = family("layerwatch_entropy_dip")
        dip_p_value = family("layerwatch_entropy_dip_p_value")
        peaks = family("layerwatch_entropy_peaks")
        for name in self._state.model_names():
            result = self._state.bimodality(name)
            observations.add_metric([name], result.observations)
            if result.withheld:
                continue
            bimodal.add_metric([name], 1 if result.bimodal else 0)
            coefficient.add_metric([name], result.bimodality_coefficient)  # NaN if the window is constant
            dip.add_metric([name], result.dip)
            dip_p_value.add_metric([name], result.dip_p_value)
            peaks.add_metric([name], result.peaks)
        yield from (observations, bimodal, coefficient, dip, dip_p_value, peaks)


class IngestCollector:
    """Frames received, malformed, lost (sequence gaps) and rejected (too many models)."""

    def __init__(self, state: ExporterState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        received = family("layerwatch_exporter_frames_received_total")
        lost = family("layerwatch_exporter_frames_lost_total")
        for model in self._state.snapshot():
            received.add_metric([model.model_name], model.frames_received)
            lost.add_metric([model.model_name], model.frames_lost)
        malformed = family("layerwatch_exporter_frames_malformed_total")
        malformed.add_metric([], self._state.frames_malformed)
        rejected = family("layerwatch_exporter_frames_rejected_total")
        rejected.add_metric([], self._state.frames_rejected)
        yield from (received, malformed, lost, rejected)


class TimedCollectors:
    """Runs the given collectors and reports how long that took, as part of the same scrape."""

    def __init__(self, collectors: Iterable[Collector]) -> None:
        self._collectors = list(collectors)

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        for collector in self._collectors:
            yield from collector.collect()
        duration = family("layerwatch_exporter_scrape_duration_seconds")
        duration.add_metric([], time.perf_counter() - start)
        yield duration


def build_registry(state: ExporterState) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(TimedCollectors([
        EntropyCollector(state), LayerCollector(state), WindowCollector(state), IngestCollector(state)]))
    ProcessCollector(registry=registry)  # process_resident_memory_bytes etc.
    return registry
