"""The routing statistics (layerwatch/routing.py) as metrics, computed at scrape time over each
model's window like the bimodality statistics.

Per-layer series are bounded by the model's layer count (the routing window follows the layer count
of the model's frames). The verdict, the share and the per-layer states are absent while the routing
verdict is withheld, so an alert on `layerwatch_routing_dynamic == 0` cannot fire on a quiet model.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from exporter.collectors import family
from exporter.state import ExporterState
from layerwatch.routing import DYNAMIC


class RoutingCollector:
    def __init__(self, state: ExporterState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        tokens = family("layerwatch_routing_window_tokens")
        threshold = family("layerwatch_routing_threshold")
        dynamic = family("layerwatch_routing_dynamic")
        share = family("layerwatch_routing_token_dependent_share")
        low = family("layerwatch_routing_layer_low_ratio")
        skip = family("layerwatch_routing_layer_skip_ratio")
        static = family("layerwatch_routing_layer_static")
        without_threshold = family("layerwatch_exporter_frames_without_threshold_total")
        for model in self._state.snapshot():
            name = model.model_name
            without_threshold.add_metric([name], model.frames_without_threshold)
            if model.threshold is not None:
                threshold.add_metric([name], model.threshold)
            routing = self._state.routing(name)
            tokens.add_metric([name], routing.tokens)
            layers = [(name, str(layer)) for layer in range(len(routing.low_rates))]
            for labels, low_rate, skip_rate in zip(layers, routing.low_rates.tolist(), routing.skip_rates.tolist()):
                low.add_metric(labels, low_rate)
                skip.add_metric(labels, skip_rate)
            if routing.withheld:
                continue
            dynamic.add_metric([name], 1 if routing.verdict == DYNAMIC else 0)
            share.add_metric([name], routing.token_dependent_share)
            for labels, state in zip(layers, routing.layer_states().tolist()):
                static.add_metric(labels, state)
        yield from (tokens, threshold, dynamic, share, low, skip, static, without_threshold)
