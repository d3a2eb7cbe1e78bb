"""Text rendering of a per-model report, shared by `layerwatch replay` and `layerwatch top`."""

from __future__ import annotations

from layerwatch.statistics import BINS

BAR_WIDTH = 40


def format_report(report: dict[str, object]) -> str:
    """A few lines per model: verdict, statistics, then the 20-bin histogram as bars."""
    lines = [f"{report['model_name']}: {report['verdict']}  "
             f"({report['observations']:,} observations, window {report['window_observations']:,})",
             f"  mean {_number(report['mean'])}  std {_number(report['std'])}  "
             f"zero ratio {_number(report['zero_ratio'])}  skip ratio {_number(report['skip_ratio'])}",
             f"  dip {_number(report['dip'], 4)} (p {_number(report['dip_p_value'], 4)})  "
             f"bimodality coefficient {_number(report['bimodality_coefficient'])}  "
             f"peaks {'-' if report['peaks'] is None else report['peaks']}"]
    lines += histogram_bars(report["histogram"])
    return "\n".join(lines)


def histogram_bars(counts: list[int], width: int = BAR_WIDTH) -> list[str]:
    tallest = max(max(counts), 1)
    rows = []
    for index, count in enumerate(counts):
        low, high = index / BINS, (index + 1) / BINS
        bar = "█" * round(width * count / tallest)
        rows.append(f"  {low:4.2f}-{high:4.2f} {bar:<{width}} {count:,}")
    return rows


def _number(value: object, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
