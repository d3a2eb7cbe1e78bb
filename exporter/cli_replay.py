"""`layerwatch replay TRACE.jsonl`: the exporter's statistics, offline, over a trace file.

The trace is fed through the same per-model statistics the live exporter keeps; the window is
bounded by `--window-max-observations` only (a trace has no clock), so the verdict is the one a
live exporter would give after receiving the whole trace within one window.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from exporter.render import format_report
from exporter.state import ExporterConfig, ModelStatistics
from exporter.statistics import BINS, MAX_WINDOW_OBSERVATIONS, check_bimodality, histogram20, report
from layerwatch.trace import TraceError, read_trace_batches


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ExporterConfig()
    parser.add_argument("trace", metavar="TRACE.jsonl", help="trace file (JSON Lines, CONTRACT format)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per model")
    parser.add_argument("--window-max-observations", type=int, default=defaults.window_max_observations,
                        help="the bimodality check uses the last this-many entropies (default %(default)s)")
    parser.add_argument("--min-window-observations", type=int, default=defaults.min_window_observations,
                        help="below this the verdict is withheld (default %(default)s)")


def replay_trace(path: str | os.PathLike[str], config: ExporterConfig) -> list[dict[str, object]]:
    """One report per model, in order of first appearance; raises TraceError for a bad line."""
    models: dict[str, ModelStatistics] = {}
    histograms: dict[str, np.ndarray] = {}
    for batch in read_trace_batches(path):
        if batch.model_name not in models:
            models[batch.model_name] = ModelStatistics(config)
            histograms[batch.model_name] = np.zeros(BINS, dtype=np.int64)
        models[batch.model_name].add(batch.entropies, batch.skipped, now=0.0)
        histograms[batch.model_name] += histogram20(batch.entropies)
    return [report(name, model.totals, histograms[name],
                   check_bimodality(model.window.values(), config.min_window_observations))
            for name, model in models.items()]


def run(args: argparse.Namespace) -> int:
    if not 0 < args.window_max_observations <= MAX_WINDOW_OBSERVATIONS:
        print(f"layerwatch replay: --window-max-observations must be 1..{MAX_WINDOW_OBSERVATIONS} "
              f"(the dip test's p-values are not valid beyond)", file=sys.stderr)
        return 2
    config = ExporterConfig(window_seconds=math.inf, window_max_observations=args.window_max_observations,
                            min_window_observations=args.min_window_observations)
    try:
        reports = replay_trace(args.trace, config)
    except (TraceError, OSError) as exc:
        print(f"layerwatch replay: {exc}", file=sys.stderr)
        return 1
    if not reports:
        print(f"layerwatch replay: {args.trace} holds no trace lines", file=sys.stderr)
        return 1
    for model_report in reports:
        print(json.dumps(model_report) if args.json else format_report(model_report) + "\n")
    return 0
