"""The picture `layerwatch replay TRACE --plot OUT.png` draws: per model, what the gates did.

One band per model, in the order of the reports, for the first MAX_PLOT_MODELS of them:
- the layer × token heat map of the gate scores of the trace's last `tokens` tokens of that model,
  on a colour scale that turns at the skip threshold τ (blue below: skip candidates, red above),
  with a dot on every cell whose layer was skipped. Static pruning is a set of uniform rows; per-token
  routing is a speckled map;
- the per-layer share of tokens below τ (the routing statistics' low rate), each bar coloured by the
  layer's class, with the static line (STATIC_LOW_RATE) and the static-run line;
- the pooled 20-bin entropy histogram with τ;
- the verdicts: bimodality and routing, with their statistics.

matplotlib is optional (`pip install 'layerwatch[plot]'`) and imported only here, on its Agg
(file-only) canvas; without it `MissingPlotLibrary` says what to install.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from layerwatch.routing import STATIC_LOW_RATE, STATIC_RUN_LOW_RATE
from layerwatch.skip_policy import DEFAULT_THRESHOLD
from layerwatch.statistics import BINS
from layerwatch.trace import read_trace_batches

DEFAULT_PLOT_TOKENS = 160
# Bands in one picture: each is a model's 6.2 inches, drawn in seconds. 64 models (replay's default
# limit) drew for 203 s into a 39,680-pixel-high image whose panels overlapped.
MAX_PLOT_MODELS = 8
WIDTH_INCHES, BAND_INCHES, DPI = 12.0, 6.2, 100
SCALE_TOP = 0.5  # the heat map's colour scale: 0 .. τ .. SCALE_TOP
CLASS_COLOURS = {"static": "#c0392b", "token-dependent": "#2e86c1", "static-run": "#a6acaf"}


class MissingPlotLibrary(RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class HeatMapBox:
    """Where a model's heat map lies in the written image: pixels, from the top-left corner."""

    left: float
    top: float
    right: float
    bottom: float
    layers: int
    tokens: int


def last_rows(path: str | os.PathLike[str], tokens: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per model, the scores [tokens, layers] and skip masks of its last `tokens` trace lines
    (fewer if the trace holds fewer; a torn last line is left out, as replay leaves it out)."""
    kept: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for batch in read_trace_batches(path, on_torn_line=lambda error: None):
        batches = kept.setdefault(batch.model_name, [])  # one layer count per model: replay refused others
        batches.append((batch.entropies, batch.skipped))
        while sum(len(scores) for scores, _ in batches[1:]) >= tokens:
            batches.pop(0)
    return {
        model: (
            np.concatenate([scores for scores, _ in batches])[-tokens:],
            np.concatenate([skipped for _, skipped in batches])[-tokens:],
        )
        for model, batches in kept.items()
    }


def plot_reports(
    path: str | os.PathLike[str],
    reports: list[dict[str, object]],
    out: str | os.PathLike[str],
    tokens: int = DEFAULT_PLOT_TOKENS,
) -> dict[str, HeatMapBox]:
    """Draw the trace at `path` with its `reports` (layerwatch.exporter.replay.replay_trace) into `out` (PNG,
    or any format matplotlib knows by the extension), the first MAX_PLOT_MODELS of them; returns where
    each drawn model's heat map is."""
    figure_class = _figure_class()
    reports = reports[:MAX_PLOT_MODELS]
    rows = last_rows(path, tokens)
    figure = figure_class(figsize=(WIDTH_INCHES, BAND_INCHES * len(reports)), dpi=DPI, layout="constrained")
    bands = figure.subfigures(len(reports), 1, squeeze=False)[:, 0]
    heat_maps = {}
    for band, report in zip(bands, reports):
        model = str(report["model_name"])
        scores, skipped = rows[model]
        heat_maps[model] = _draw_model(band, report, scores, skipped)
    figure.savefig(out, dpi=DPI)
    height = figure.bbox.height
    return {
        model: HeatMapBox(box.x0, height - box.y1, box.x1, height - box.y0, *rows[model][0].shape[::-1])
        for model, box in ((model, ax.get_window_extent()) for model, ax in heat_maps.items())
    }


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingPlotLibrary(
            "drawing needs matplotlib, an optional dependency: pip install 'layerwatch[plot]'"
        ) from None
    return Figure


def _draw_model(band: Any, report: dict[str, object], scores: np.ndarray, skipped: np.ndarray) -> Any:
    from matplotlib.colors import TwoSlopeNorm

    tau = report.get("threshold")
    threshold = float(tau) if isinstance(tau, int | float) else DEFAULT_THRESHOLD
    grid = band.add_gridspec(2, 3, height_ratios=(1.15, 1), width_ratios=(1.2, 1, 0.9))
    band.suptitle(_title(report), fontsize=13, fontweight="bold", color=_title_colour(report))

    heat = band.add_subplot(grid[0, :])
    image = heat.imshow(
        scores.T,
        aspect="auto",
        interpolation="nearest",  # one colour per cell: a static layer is one uniform row
        cmap="RdBu_r",
        # Gate scores mostly lie below 0.5: the scale ends there, higher ones take its darkest red.
        norm=TwoSlopeNorm(vcenter=threshold, vmin=0.0, vmax=max(SCALE_TOP, threshold + 0.01)),
    )
    token_index, layer_index = np.nonzero(skipped)
    heat.scatter(token_index, layer_index, s=2.5, c="black", marker="o", linewidths=0, antialiased=False)
    heat.set_xlim(-0.5, scores.shape[0] - 0.5)
    heat.set_ylim(scores.shape[1] - 0.5, -0.5)
    heat.set_xlabel(f"token (the trace's last {scores.shape[0]} of this model)")
    heat.set_ylabel("layer")
    heat.set_title(f"gate scores per layer and token (blue: below τ = {threshold:g}; dot: layer skipped)")
    band.colorbar(image, ax=heat, label="gate score", pad=0.01, fraction=0.03, extend="max")

    _draw_low_rates(band.add_subplot(grid[1, 0]), report)
    _draw_histogram(band.add_subplot(grid[1, 1]), report, threshold)
    _draw_verdicts(band.add_subplot(grid[1, 2]), report)
    return heat


def _draw_low_rates(ax: Any, report: dict[str, object]) -> None:
    from matplotlib.patches import Patch

    rates = list(report.get("per_layer_low_rate") or [])  # type: ignore[call-overload]
    static = set(report.get("static_layers") or [])  # type: ignore[call-overload]
    static_run = set(report.get("static_run_layers") or [])  # type: ignore[call-overload]
    classes = [
        "static" if l in static else "static-run" if l in static_run else "token-dependent" for l in range(len(rates))
    ]
    ax.bar(range(len(rates)), rates, color=[CLASS_COLOURS[c] for c in classes])
    static_line = ax.axhline(STATIC_LOW_RATE, color=CLASS_COLOURS["static"], linestyle="--", linewidth=1)
    ax.axhline(STATIC_RUN_LOW_RATE, color="#7f8c8d", linestyle=":", linewidth=1)
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(len(rates)))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of tokens below τ")
    handles = [Patch(color=colour, label=name) for name, colour in CLASS_COLOURS.items()]
    handles.append(static_line)
    static_line.set_label(f"static line {STATIC_LOW_RATE:g}")
    ax.legend(handles=handles, fontsize=7, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.set_title("below-τ rate per layer", fontsize=10, pad=16)


def _draw_histogram(ax: Any, report: dict[str, object], threshold: float) -> None:
    counts = _items(report, "histogram")
    edges = np.linspace(0.0, 1.0, BINS + 1)
    ax.bar(edges[:-1], counts, width=1 / BINS, align="edge", color="#5d6d7e", edgecolor="white")
    ax.axvline(threshold, color="black", linestyle="--", linewidth=1)
    ax.text(threshold, max(counts or [1]), f" τ {threshold:g}", va="top", fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("gate score (all layers, all tokens)")
    ax.set_ylabel("count")
    ax.set_title("pooled 20-bin histogram", fontsize=10)


def _draw_verdicts(ax: Any, report: dict[str, object]) -> None:
    ax.axis("off")
    share = report.get("token_dependent_share")
    static = report.get("static_layers")
    lines = [
        f"bimodality: {report['verdict']}",
        f"  dip p {_number(report.get('dip_p_value'))}, coefficient {_number(report.get('bimodality_coefficient'))},",
        f"  peaks {report.get('peaks') if report.get('peaks') is not None else '-'},"
        f" {report.get('window_observations', 0):,} scores",
        "",
        f"routing: {report.get('routing_verdict', '-')}",
        f"  token-dependent share {_number(share)}",
        f"  static layers {_layers(static)}",
        f"  {report.get('routing_tokens', 0):,} tokens",
        "",
        f"skip ratio {_number(report.get('skip_ratio'))}, mean score {_number(report.get('mean'))}",
    ]
    ax.text(0.0, 1.0, "\n".join(lines), va="top", ha="left", family="monospace", fontsize=9.5, transform=ax.transAxes)
    ax.set_title("verdicts", fontsize=10)


def _title(report: dict[str, object]) -> str:
    return f"{report['model_name']}: histogram {report['verdict']}, routing {report.get('routing_verdict', '-')}"


def _title_colour(report: dict[str, object]) -> str:
    unhealthy = report.get("routing_verdict") == "static" or report["verdict"] == "single-peak"
    return CLASS_COLOURS["static"] if unhealthy else "black"


def _items(report: dict[str, object], key: str) -> list[Any]:
    """A list-valued key of a report; empty when absent or withheld (None)."""
    value = report.get(key)
    return list(value) if isinstance(value, list) else []


def _layers(layers: object) -> str:
    if not isinstance(layers, list):
        return "-"
    return ", ".join(map(str, layers)) or "none"


def _number(value: object) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.3f}"
