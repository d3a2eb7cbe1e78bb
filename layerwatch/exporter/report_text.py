"""Text rendering of a per-model report, shared by `layerwatch replay` and `layerwatch top`."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import zip_longest
from typing import Any

from layerwatch.routing import STATIC_LOW_RATE, STATIC_RUN_LOW_RATE
from layerwatch.statistics import BINS

BAR_WIDTH = 40
GAP = 4  # columns between the histogram and what is shown beside it


def format_report(
    report: dict[str, object],
    beside: Sequence[str] = (),
    width: int = 0,
    *,
    since: str | None = None,
    expected_static: Sequence[int] | None = None,
    histogram_last: bool = False,
) -> str:
    """A few lines per model: verdict, statistics, then the 20-bin histogram as bars, with the lines
    `beside` to the right of the bars when `width` columns hold both, else below them (above them with
    `histogram_last`, for a short terminal). `since` says what the totals count from (a live view:
    "since the exporter started"), `expected_static` the static layers the healthy profile expects."""
    totals = f"  ({since})" if since else ""
    lines = [
        f"{report['model_name']}: {report['verdict']}  "
        f"({report['observations']:,} observations, window {report['window_observations']:,})",
        f"  mean {_number(report['mean'])}  std {_number(report['std'])}  "
        f"zero ratio {_number(report['zero_ratio'])}  skip ratio {_number(report['skip_ratio'])}{totals}",
        f"  dip {_number(report['dip'], 4)} (p {_number(report['dip_p_value'], 4)})  "
        f"bimodality coefficient {_number(report['bimodality_coefficient'])}  "
        f"peaks {'-' if report['peaks'] is None else report['peaks']}  (window)",
    ]
    if "routing_verdict" in report:
        lines += routing_lines(report, expected_static)
    bars = histogram_bars(_list(report["histogram"]))
    title = [f"  entropy histogram {since} (cumulative); the verdict reads the window"] if since else []
    left = max(len(bar) for bar in bars)
    if histogram_last:
        lines += list(beside) + title + bars
        return "\n".join(lines)
    lines += title  # a live view: the bars keep counting while the verdict reads a sliding window
    if beside and left + GAP + max(map(len, beside)) <= width:
        lines += [f"{bar:<{left}}{' ' * GAP}{line}".rstrip() for bar, line in zip_longest(bars, beside, fillvalue="")]
    else:
        lines += bars + ([""] + list(beside) if beside else [])
    return "\n".join(lines)


def routing_lines(report: dict[str, object], expected_static: Sequence[int] | None = None) -> list[str]:
    """The routing verdict (layerwatch/routing.py): static pruning or per-token routing."""
    tokens = report.get("routing_tokens")
    threshold = report.get("threshold")
    lines = [
        f"  routing: {report['routing_verdict']}  "
        f"token-dependent share {_number(report.get('token_dependent_share'))}  "
        f"({'-' if tokens is None else f'{tokens:,}'} tokens, τ {_number(threshold, 2)})"
    ]
    if report.get("static_layers") is not None:
        expected = "" if expected_static is None else f"  (healthy profile: {_layers(list(expected_static))})"
        lines += [
            f"  static layers (below τ for ≥{STATIC_LOW_RATE:.0%} of tokens: skipped whatever the token) "
            f"{_layers(_list(report['static_layers']))}{expected}",
            f"  static-run layers (below τ for ≤{STATIC_RUN_LOW_RATE:.0%} of tokens: run whatever the token) "
            f"{_layers(_list(report.get('static_run_layers') or []))}",
        ]
    rates = _list(report.get("per_layer_low_rate") or [])
    if rates:
        lines.append("  below τ per layer " + " ".join(f"{rate:.2f}" for rate in rates))
    return lines


def _layers(layers: list[int]) -> str:
    return ",".join(map(str, layers)) if layers else "none"


def histogram_bars(counts: list[int], width: int = BAR_WIDTH) -> list[str]:
    tallest = max(max(counts), 1)
    rows = []
    for index, count in enumerate(counts):
        low, high = index / BINS, (index + 1) / BINS
        bar = "█" * round(width * count / tallest)
        rows.append(f"  {low:4.2f}-{high:4.2f} {bar:<{width}} {count:,}")
    return rows


def _list(value: object) -> list[Any]:
    """A list-valued key of a report (reports are JSON-shaped: their values are typed `object`)."""
    if not isinstance(value, list):
        raise TypeError(f"expected a list in the report, got {type(value).__name__}")
    return value


def _number(value: object, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
