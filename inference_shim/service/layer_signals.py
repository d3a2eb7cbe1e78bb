"""Do the gates still track how much their layer matters? Layer signals from the shadow check.

The shadow check (shadow.py) re-runs sampled requests (any temperature) at full depth in the engine thread.
On that pass the model also measures, for every layer and every decode-step position
(`inference_shim.runtime.agreement.LayerSignals`): the layer's relative residual update
||dh||/||h||, its gate score on the same token, and its attention discreteness (KL from uniform).
`LayerSignalStats` (layerwatch/gate_importance.py, shared with `layerwatch calibrate`) folds one
pass in; `LayerSignalsCollector` exposes at scrape time:

  - per layer, counters of measured tokens and sums of the relative update and attention KL:
    counters, so that PromQL's rate(sum) / rate(count) is the mean over any window and sums
    correctly across shims (a per-shim mean gauge cannot be averaged correctly);
  - `layerwatch_gate_importance_correlation`: Spearman's rank correlation between gate score and
    relative update over the last GATE_IMPORTANCE_SAMPLES (token, layer) samples, absent until that
    many were measured. Healthy gates score high where the layer changes the residual stream a
    lot; gates that were swapped, shuffled or trained for another model do not.

Nothing here runs on the decode path: `observe` runs after a shadow job (inside its duty cycle),
the correlation (two sorts of 4096 values, about a millisecond) at scrape time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import Metric

from inference_shim.service.metrics import ShimCollector, family
from layerwatch.gate_importance import LayerSignalStats


class LayerSignalsCollector(ShimCollector):
    """Exposes `LayerSignalStats` at scrape time."""

    metric_names = (
        "layerwatch_layer_signal_tokens_total",
        "layerwatch_layer_relative_update_sum_total",
        "layerwatch_layer_attention_kl_sum_total",
        "layerwatch_gate_importance_correlation",
        "layerwatch_gate_importance_samples",
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
        ):
            counter = family(name)
            for layer, value in zip(self._layers, values):
                counter.add_metric([m, layer], value)
            yield counter
        correlation = family("layerwatch_gate_importance_correlation")
        if s.correlation is not None and math.isfinite(s.correlation):
            correlation.add_metric([m], s.correlation)
        yield correlation
        samples = family("layerwatch_gate_importance_samples")
        samples.add_metric([m], s.samples)
        yield samples
