"""Do the gates still track how much their layer matters? Layer signals from the shadow check.

The shadow check (shadow.py) re-runs sampled requests (any temperature) at full depth in the engine thread.
On that pass the model also measures, for every layer and every decode-step position
(`layerwatch.inference_shim.runtime.agreement.LayerSignals`): the layer's relative residual update
||dh||/||h||, its gate score on the same token, and its attention discreteness (KL from uniform).
`LayerSignalStats` (layerwatch/gate_importance.py, shared with `layerwatch calibrate`) folds one
pass in; `LayerSignalsCollector` exposes at scrape time:

  - per layer, counters of measured tokens and sums of the relative update and attention KL:
    counters, so that PromQL's rate(sum) / rate(count) is the mean over any window and sums
    correctly across shims (a per-shim mean gauge cannot be averaged correctly);
  - per layer, `layerwatch_gate_layer_importance_correlation`: Spearman's rank correlation, over
    the layer's last GATE_LAYER_SAMPLES positions, of its gate score with its relative update at the
    next position (the token the score decides), absent until that many were measured and for a
    gate that barely varies; and the pairs held (`layerwatch_gate_layer_importance_samples`);
  - `layerwatch_gate_importance_correlation`, the headline: the mean of the per-layer correlations,
    with the layers behind it (`layerwatch_gate_importance_layers`) and the pairs held over all
    layers (`layerwatch_gate_importance_samples`);
  - `layerwatch_gate_layer_order_correlation`: whether the layers' mean gate scores rank like their
    mean updates (between layers).

Series are bounded by the layer count. Nothing here runs on the decode path: `observe` runs after a
shadow job (inside its duty cycle), the correlations at scrape time, once per new shadow job
(docs/service.md, "Layer signals", has their cost).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import Metric

from layerwatch.gate_importance import LayerSignalStats
from layerwatch.inference_shim.service.metrics import ShimCollector, family


class LayerSignalsCollector(ShimCollector):
    """Exposes `LayerSignalStats` at scrape time."""

    metric_names = (
        "layerwatch_layer_signal_tokens_total",
        "layerwatch_layer_relative_update_sum_total",
        "layerwatch_layer_attention_kl_sum_total",
        "layerwatch_gate_layer_importance_correlation",
        "layerwatch_gate_layer_importance_samples",
        "layerwatch_gate_importance_correlation",
        "layerwatch_gate_importance_samples",
        "layerwatch_gate_importance_layers",
        "layerwatch_gate_layer_order_correlation",
    )

    def __init__(self, stats: LayerSignalStats, model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name
        self._layers = [str(l) for l in range(stats.num_layers)]

    def collect(self) -> Iterator[Metric]:
        s = self._stats.snapshot()
        m = self._model_name
        for name, values in (
            ("layerwatch_layer_signal_tokens_total", s.tokens.tolist()),
            ("layerwatch_layer_relative_update_sum_total", s.relative_update_sum.tolist()),
            ("layerwatch_layer_attention_kl_sum_total", s.attention_kl_sum.tolist()),
            ("layerwatch_gate_layer_importance_correlation", s.layer_correlation.tolist()),
            ("layerwatch_gate_layer_importance_samples", s.layer_samples.tolist()),
        ):
            per_layer = family(name)
            for layer, value in zip(self._layers, values):
                if math.isfinite(value):  # a layer's correlation is NaN until measured: absent
                    per_layer.add_metric([m, layer], value)
            yield per_layer
        for name, value in (
            ("layerwatch_gate_importance_correlation", s.correlation),
            ("layerwatch_gate_importance_samples", s.samples),
            ("layerwatch_gate_importance_layers", s.counted_layers),
            ("layerwatch_gate_layer_order_correlation", s.layer_order_correlation),
        ):
            gauge = family(name)
            if value is not None and math.isfinite(value):
                gauge.add_metric([m], value)
            yield gauge
