"""The per-step accumulation behind the per-layer metrics, against a direct count."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from layerwatch.inference_shim.service.metrics import DecodeStats, DecodeStatsCollector


def test_collector_exposes_exact_per_layer_counts_and_the_executed_histogram():
    rng = np.random.default_rng(0)
    layers = 5
    stats = DecodeStats(layers)
    # More steps than DecodeStats.FOLD_STEPS, so that folding while observing is exercised too. What
    # ran differs from what the rule decided: layers run whole for some steps, voted off for others.
    steps = [rng.random((rows, layers)) < 0.4 for rows in rng.integers(1, 5, DecodeStats.FOLD_STEPS + 50)]
    ran = [np.where(rng.random(layers) < 0.3, True, np.where(rng.random(layers) < 0.2, False, ~s)) for s in steps]
    executed_steps = [~r for r in ran]
    fallbacks = [np.array([True] + [False] * (len(s) - 1)) for s in steps]
    for skipped, executed_skipped, fallback_started in zip(steps, executed_steps, fallbacks):
        stats.observe(skipped, executed_skipped, executed_skipped.all(axis=0), fallback_started)
    registry = CollectorRegistry()
    registry.register(DecodeStatsCollector(stats, "m"))
    value = lambda name, **labels: registry.get_sample_value(name, {"model_name": "m", **labels})  # noqa: E731

    decided, skipped_for_real = np.concatenate(steps), np.concatenate(executed_steps)
    assert (decided != skipped_for_real).any() and (decided & ~skipped_for_real).any()
    executed = layers - skipped_for_real.sum(axis=1)
    for layer in range(layers):
        assert value("layerwatch_layer_evaluations_total", layer=str(layer)) == len(decided)
        assert value("layerwatch_layer_skips_total", layer=str(layer)) == decided[:, layer].sum()
        executed_skips = value("layerwatch_layer_skips_executed_total", layer=str(layer))
        assert executed_skips == skipped_for_real[:, layer].sum()
        unneeded = value("layerwatch_layer_unneeded_runs_total", layer=str(layer))
        assert unneeded == (decided[:, layer] & ~skipped_for_real[:, layer]).sum()
        voted = (~decided[:, layer] & skipped_for_real[:, layer]).sum()  # skipped though the rule ran it
        assert executed_skips == decided[:, layer].sum() - unneeded + voted
        assert value("layerwatch_batch_layer_steps_total", layer=str(layer)) == len(steps)
        assert value("layerwatch_batch_layer_skips_total", layer=str(layer)) == sum(
            s[:, layer].all() for s in executed_steps
        )
    for bound in range(layers + 1):
        assert value("layerwatch_layers_executed_bucket", le=f"{bound}.0") == (executed <= bound).sum()
    assert value("layerwatch_layers_executed_bucket", le="+Inf") == len(decided)
    assert value("layerwatch_layers_executed_count") == len(decided)
    assert value("layerwatch_layers_executed_sum") == executed.sum()
    assert value("layerwatch_fallbacks_total", reason="high_skipping") == len(steps)
