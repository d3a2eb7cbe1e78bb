"""The exporter's statistics, offline, over a trace file.

The trace is fed through the same per-model statistics the live exporter keeps; the window is
bounded by `window_max_observations` only (a trace has no clock), so the verdict is the one a
live exporter would give after receiving the whole trace within one window. Lines without a
"threshold" key are judged against `config.default_threshold` (`replay --threshold`), as the
exporter judges frames without one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from layerwatch.exporter.state import ExporterConfig, ModelStatistics
from layerwatch.routing import routing_report
from layerwatch.statistics import BINS, check_bimodality, histogram20, report
from layerwatch.trace import TraceError, read_trace_batches

# The exporter's settings that `layerwatch replay` takes as flags, in the order of its --help (τ's
# flag is --threshold); the window has no time bound, a trace having no clock.
REPLAY_SETTINGS = (
    "window_max_observations",
    "min_window_observations",
    "default_threshold",
    "max_models",
    "max_layers",
    "min_routing_tokens",
)
REPLAY_FLAGS = {"default_threshold": "--threshold"}


def replay_trace(
    path: str | os.PathLike[str], config: ExporterConfig, on_torn_line: Callable[[TraceError], None] | None = None
) -> list[dict[str, object]]:
    """One report per model, in order of first appearance; raises TraceError for a bad line (a torn
    last line goes to `on_torn_line` when given, see read_trace), and, as the exporter refuses such
    frames, for the first line of a model beyond `config.max_models`, of more layers than
    `config.max_layers` (what is kept per model and per layer stays in memory to the end: a trace
    of 200,000 made-up model names took 3.2 GB), or of another layer count than the model's first
    line (its statistics would mix both shapes)."""
    models: dict[str, ModelStatistics] = {}
    histograms: dict[str, np.ndarray] = {}
    for batch in read_trace_batches(path, on_torn_line=on_torn_line):
        layers = batch.entropies.shape[1]
        if layers > config.max_layers:
            raise TraceError(
                f"{path}:{batch.first_line}: {layers} layers, more than the {config.max_layers} replay takes "
                f"(--max-layers)"
            )
        if batch.model_name not in models:
            if len(models) == config.max_models:
                raise TraceError(
                    f"{path}:{batch.first_line}: model {batch.model_name!r} is one more than the "
                    f"{config.max_models} models replay keeps (--max-models)"
                )
            models[batch.model_name] = ModelStatistics(config, layers)
            histograms[batch.model_name] = np.zeros(BINS, dtype=np.int64)
        elif layers != models[batch.model_name].num_layers:  # a trace has no clock to idle the model out by
            raise TraceError(
                f"{path}:{batch.first_line}: model {batch.model_name!r} has {layers} layers here, "
                f"{models[batch.model_name].num_layers} on its first line; the exporter refuses such frames "
                "(layer_count_changed)"
            )
        threshold = config.default_threshold if batch.threshold is None else batch.threshold
        models[batch.model_name].add(
            batch.entropies, batch.skipped, now=0.0, threshold=threshold, model_name=batch.model_name
        )
        histograms[batch.model_name] += histogram20(batch.entropies)
    return [
        {
            **report(
                name,
                model.totals,
                histograms[name],
                check_bimodality(model.window.values(), config.min_window_observations),
            ),
            **routing_report(model.routing_window.statistics(config.min_routing_tokens), model.threshold),
        }
        for name, model in models.items()
    ]
