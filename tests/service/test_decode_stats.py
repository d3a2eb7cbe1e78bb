"""The per-step accumulation behind the per-layer metrics, against a direct count."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from inference_shim.service.metrics import DecodeStats, DecodeStatsCollector


def test_collector_exposes_exact_per_layer_counts_and_the_executed_histogram():
    rng = np.random.default_rng(0)
    layers = 5
    stats = DecodeStats(layers)
    # More steps than DecodeStats.FOLD_STEPS, so that folding while observing is exercised too.
    steps = [rng.random((rows, layers)) < 0.4 for rows in rng.integers(1, 5, DecodeStats.FOLD_STEPS + 50)]
    fallbacks = [np.array([True] + [False] * (len(s) - 1)) for s in steps]
    for skipped, fallback_started in zip(steps, fallbacks):
        stats.observe(skipped, skipped.all(axis=0), fallback_started)
    registry = CollectorRegistry()
    registry.register(DecodeStatsCollector(stats, "m"))
    value = lambda name, **labels: registry.get_sample_value(name, {"model_name": "m", **labels})  # noqa: E731

    rows = np.concatenate(steps)
    executed = layers - rows.sum(axis=1)
    for layer in range(layers):
        assert value("layerwatch_layer_evaluations_total", layer=str(layer)) == len(rows)
        assert value("layerwatch_layer_skips_total", layer=str(layer)) == rows[:, layer].sum()
        assert value("layerwatch_batch_layer_steps_total", layer=str(layer)) == len(steps)
        assert value("layerwatch_batch_layer_skips_total", layer=str(layer)) == sum(s[:, layer].all() for s in steps)
    for bound in range(layers + 1):
        assert value("layerwatch_layers_executed_bucket", le=f"{bound}.0") == (executed <= bound).sum()
    assert value("layerwatch_layers_executed_bucket", le="+Inf") == len(rows)
    assert value("layerwatch_layers_executed_count") == len(rows)
    assert value("layerwatch_layers_executed_sum") == executed.sum()
    assert value("layerwatch_fallbacks_total", reason="high_skipping") == len(steps)
