"""`layerwatch replay TRACE.jsonl`: the exporter's statistics, offline, over a trace file.

The statistics are layerwatch/exporter/replay.py's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from layerwatch import argtypes
from layerwatch.exporter.replay import REPLAY_FLAGS, REPLAY_SETTINGS, replay_trace
from layerwatch.exporter.replay_plot import DEFAULT_PLOT_TOKENS, MAX_PLOT_MODELS, MissingPlotLibrary, plot_reports
from layerwatch.exporter.report_text import format_report
from layerwatch.exporter.state import ExporterConfig
from layerwatch.settings import add_flags, from_flags, setting
from layerwatch.trace import TraceError


@dataclass(frozen=True, kw_only=True)
class ReplaySettings:
    """The trace and what is made of it; the statistics' settings are ExporterConfig's REPLAY_SETTINGS."""

    trace: str = setting(
        positional=True, metavar="TRACE.jsonl", help="trace file (JSON Lines, as serve --trace-file writes it)"
    )
    json: bool = setting(False, help="print one JSON object per model")
    plot: str | None = setting(
        None,
        metavar="OUT.png",
        help="also draw, per model, the layer x token heat map of the gate scores (skipped cells marked), "
        "the per-layer below-threshold rate with the static line, the histogram and the verdicts, for the first "
        f"{MAX_PLOT_MODELS} models of the trace (needs matplotlib: pip install 'layerwatch[plot]')",
    )
    plot_tokens: int = setting(
        DEFAULT_PLOT_TOKENS,
        type=argtypes.positive(int),
        help="the heat map shows each model's last this-many tokens (default %(default)s)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ReplaySettings)
    add_flags(parser, ExporterConfig, REPLAY_SETTINGS, flags=REPLAY_FLAGS)


def run(args: argparse.Namespace) -> int:
    settings = from_flags(ReplaySettings, args)
    try:
        config = from_flags(ExporterConfig, args, REPLAY_SETTINGS, window_seconds=math.inf)
    except ValueError as exc:
        print(f"layerwatch replay: {exc}", file=sys.stderr)
        return 2
    torn: list[TraceError] = []
    try:
        reports = replay_trace(settings.trace, config, on_torn_line=torn.append)
    except (TraceError, OSError) as exc:
        print(f"layerwatch replay: {exc}", file=sys.stderr)
        return 1
    for line in torn:  # at most one: the last line
        print(
            f"layerwatch replay: warning: 1 torn last line skipped (no newline: a write cut short, e.g. "
            f"by a full disk); the lines before it were replayed: {line}",
            file=sys.stderr,
        )
    if not reports:
        print(f"layerwatch replay: {settings.trace} holds no trace lines", file=sys.stderr)
        return 1
    for model_report in reports:
        print(json.dumps(model_report) if settings.json else format_report(model_report) + "\n")
    return 0 if settings.plot is None else _plot(settings, settings.plot, reports)


def _plot(settings: ReplaySettings, out: str, reports: list[dict[str, object]]) -> int:
    try:
        plot_reports(settings.trace, reports, out, settings.plot_tokens)
    except MissingPlotLibrary as exc:
        print(f"layerwatch replay: --plot: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # an unwritable path, an extension matplotlib does not know
        print(f"layerwatch replay: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    left_out = len(reports) - MAX_PLOT_MODELS
    more = f" (the first {MAX_PLOT_MODELS} models of {len(reports)}: a band each; the report has them all)"
    print(f"layerwatch replay: drew {out}{more if left_out > 0 else ''}", file=sys.stderr)
    return 0
