"""Prometheus collectors: the exporter's state turned into metrics at scrape time.

One collector per concern, every metric built from its catalog spec by layerwatch/prometheus.py
(docs/metrics.md lists them), the registry injected (never the global one). Each collector
describes itself, so registering it checks its names for clashes. The collectors run isolated
from each other (`IsolatedCollectors`): a bug in one, say in the statistics, leaves its metrics
out of the scrape with `layerwatch_exporter_scrape_collector_success{collector}` 0, and the rest
of the page is served.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from layerwatch import prometheus
from layerwatch.catalog import ENTROPY_WINDOW_EDGES, EXPORTER
from layerwatch.exporter.state import ExporterState
from layerwatch.prometheus import HistogramArrays
from layerwatch.routing import DYNAMIC
from layerwatch.statistics import DECISIONS, shares_below_edges


def family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty metric family for an exporter counter or gauge of the catalog."""
    return prometheus.value_family(name, EXPORTER)


def histogram_family(name: str) -> HistogramArrays:
    """An empty metric family for an exporter histogram of the catalog."""
    return prometheus.histogram_family(name, EXPORTER)


class _StateCollector(prometheus.CatalogCollector):
    component = EXPORTER

    def __init__(self, state: ExporterState) -> None:
        self._state = state


class EntropyCollector(_StateCollector):
    """layerwatch_entropy{model_name,decision} with Σx² and the zero-entropy count."""

    metric_names = ("layerwatch_entropy", "layerwatch_entropy_squares_total", "layerwatch_entropy_zero_total")

    def collect(self) -> Iterator[Metric]:
        histogram, squares, zeros = histogram_family("layerwatch_entropy"), *map(family, self.metric_names[1:])
        for model in self._state.snapshot():
            labels = [(model.model_name, decision) for decision in DECISIONS]
            histogram.add_histograms(labels, model.buckets, model.sums)
            for index, decision_labels in enumerate(labels):
                squares.add_metric(decision_labels, float(model.squares[index]))
                zeros.add_metric(decision_labels, int(model.zeros[index]))
        yield from (histogram, squares, zeros)


class LayerCollector(_StateCollector):
    """Per-layer sums, counts and skips (means and skip ratios are always derivable), and the fallback
    episodes the frames report; per-layer histograms with --per-layer."""

    metric_names = (
        "layerwatch_layer_entropy_sum_total",
        "layerwatch_layer_entropy_count_total",
        "layerwatch_exporter_layer_skips_total",
        "layerwatch_exporter_fallbacks_total",
        "layerwatch_entropy_per_layer",
    )

    def collect(self) -> Iterator[Metric]:
        sums, counts, skips, fallbacks = map(family, self.metric_names[:4])
        histograms = histogram_family("layerwatch_entropy_per_layer")
        for model in self._state.snapshot():
            fallbacks.add_metric([model.model_name], model.fallbacks)
            labels = [(model.model_name, str(layer)) for layer in range(len(model.layer_sums))]
            per_layer = zip(labels, model.layer_sums.tolist(), model.layer_counts.tolist(), model.layer_skips.tolist())
            for layer_labels, total, count, skipped in per_layer:
                sums.add_metric(layer_labels, total)
                counts.add_metric(layer_labels, count)
                skips.add_metric(layer_labels, skipped)
            if model.layer_buckets is not None:
                histograms.add_histograms(labels, model.layer_buckets, model.layer_sums)
        yield from (sums, counts, skips, fallbacks)
        if histograms.label_values:
            yield histograms


class WindowCollector(_StateCollector):
    """The sliding window's bimodality statistics; withheld (absent) below the minimum window."""

    metric_names = (
        "layerwatch_entropy_window_observations",
        "layerwatch_entropy_bimodal",
        "layerwatch_entropy_bimodality_coefficient",
        "layerwatch_entropy_dip",
        "layerwatch_entropy_dip_p_value",
        "layerwatch_entropy_peaks",
        "layerwatch_entropy_window_below_ratio",
    )

    def collect(self) -> Iterator[Metric]:
        observations, bimodal, coefficient, dip, dip_p_value, peaks, below = map(family, self.metric_names)
        for name in self._state.model_names():
            result = self._state.bimodality(name)
            observations.add_metric([name], result.observations)
            if (
                result.withheld  # then all of these are None
                or result.bimodality_coefficient is None
                or result.dip is None
                or result.dip_p_value is None
                or result.peaks is None
                or result.histogram is None
            ):
                continue
            bimodal.add_metric([name], 1 if result.bimodal else 0)
            coefficient.add_metric([name], result.bimodality_coefficient)  # NaN if the window is constant
            dip.add_metric([name], result.dip)
            dip_p_value.add_metric([name], result.dip_p_value)
            peaks.add_metric([name], result.peaks)
            for edge, share in zip(ENTROPY_WINDOW_EDGES, shares_below_edges(np.asarray(result.histogram))):
                below.add_metric([name, edge], float(share))
        yield from (observations, bimodal, coefficient, dip, dip_p_value, peaks, below)


class RoutingCollector(_StateCollector):
    """The routing statistics (layerwatch/routing.py) over each model's window, like the bimodality
    statistics. Per-layer series are bounded by the model's layer count. The verdict, the share and
    the per-layer states are absent while the verdict is withheld, so an alert on
    `layerwatch_routing_dynamic == 0` cannot fire on a quiet model."""

    metric_names = (
        "layerwatch_routing_window_tokens",
        "layerwatch_routing_threshold",
        "layerwatch_routing_dynamic",
        "layerwatch_routing_token_dependent_share",
        "layerwatch_routing_layer_low_ratio",
        "layerwatch_routing_layer_skip_ratio",
        "layerwatch_routing_layer_static",
    )

    def collect(self) -> Iterator[Metric]:
        tokens, threshold, dynamic, share, low, skip, static = map(family, self.metric_names)
        for model in self._state.snapshot():
            name = model.model_name
            if model.threshold is not None:
                threshold.add_metric([name], model.threshold)
            routing = self._state.routing(name)
            tokens.add_metric([name], routing.tokens)
            layers = [(name, str(layer)) for layer in range(len(routing.low_rates))]
            for labels, low_rate, skip_rate in zip(layers, routing.low_rates.tolist(), routing.skip_rates.tolist()):
                low.add_metric(labels, low_rate)
                skip.add_metric(labels, skip_rate)
            states = routing.layer_states()
            if routing.withheld or routing.token_dependent_share is None or states is None:  # None when withheld
                continue
            dynamic.add_metric([name], 1 if routing.verdict == DYNAMIC else 0)
            share.add_metric([name], routing.token_dependent_share)
            for labels, state in zip(layers, states.tolist()):
                static.add_metric(labels, state)
        yield from (tokens, threshold, dynamic, share, low, skip, static)


class IngestCollector(_StateCollector):
    """Frames received, malformed, lost (sequence gaps), interleaved (two shims under one id),
    rejected (by reason: REJECT_REASONS) and received without a threshold (version 1: judged against
    the exporter's default)."""

    metric_names = (
        "layerwatch_exporter_frames_received_total",
        "layerwatch_exporter_frames_malformed_total",
        "layerwatch_exporter_frames_lost_total",
        "layerwatch_exporter_frames_interleaved_total",
        "layerwatch_exporter_frames_rejected_total",
        "layerwatch_exporter_frames_without_threshold_total",
    )

    def collect(self) -> Iterator[Metric]:
        received, malformed, lost, interleaved, rejected, without_threshold = map(family, self.metric_names)
        for model in self._state.snapshot():
            received.add_metric([model.model_name], model.frames_received)
            lost.add_metric([model.model_name], model.frames_lost)
            interleaved.add_metric([model.model_name], model.frames_interleaved)
            without_threshold.add_metric([model.model_name], model.frames_without_threshold)
        malformed.add_metric([], self._state.frames_malformed)
        for reason, count in self._state.frames_rejected.copy().items():
            rejected.add_metric([reason], count)
        yield from (received, malformed, lost, interleaved, rejected, without_threshold)


class TimedCollector(prometheus.CatalogCollector):
    """Another collector's metrics, then how long collecting them took, as part of the same scrape.

    Exceptions are the wrapped collector's to handle: `exporter_collectors` wraps the isolated ones.
    """

    component = EXPORTER
    metric_names = ("layerwatch_exporter_scrape_duration_seconds",)

    def __init__(self, collector: prometheus.CatalogCollector) -> None:
        self._collector = collector

    def describe(self) -> list[Metric]:
        return self._collector.describe() + super().describe()

    def collect(self) -> Iterator[Metric]:
        start = time.perf_counter()
        yield from self._collector.collect()
        duration = family("layerwatch_exporter_scrape_duration_seconds")
        duration.add_metric([], time.perf_counter() - start)
        yield duration


def exporter_collectors(state: ExporterState) -> TimedCollector:
    """Every exporter metric of the catalog: the collectors, isolated from each other, and timed."""
    isolated = prometheus.IsolatedCollectors(
        {
            "entropy": EntropyCollector(state),
            "layer": LayerCollector(state),
            "window": WindowCollector(state),
            "routing": RoutingCollector(state),
            "ingest": IngestCollector(state),
        },
        EXPORTER,
        success="layerwatch_exporter_scrape_collector_success",
        duration="layerwatch_exporter_scrape_collector_duration_seconds",
    )
    return TimedCollector(isolated)


def build_registry(state: ExporterState, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """The exporter's collectors in `registry` (a new one by default; never the global one)."""
    registry = CollectorRegistry() if registry is None else registry
    registry.register(exporter_collectors(state))
    ProcessCollector(registry=registry)  # process_resident_memory_bytes etc.
    return registry
