"""A live exporter's /metrics read back into the report `layerwatch replay` prints.

It reads the page like Prometheus would: per model, the verdict and the window statistics, mean / std /
zero ratio / skip ratio, the routing verdict, and the 20-bin histogram (counts since the exporter
started, from the `layerwatch_entropy` buckets). `layerwatch top` and `layerwatch demo` show it, with
whatever they put beside the histogram (the alert state).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from layerwatch import http_get
from layerwatch.exporter.report_text import format_report
from layerwatch.statistics import DECISIONS, Bimodality, EntropyTotals, report

CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, clear screen
SINCE = "since the exporter started"  # what the exported totals and the histogram count

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> [(labels, value)]


def render_samples(
    samples: Samples,
    url: str,
    clock: str,
    beside: Callable[[str], list[str]] | None = None,
    width: int = 0,
    *,
    expected_static: Callable[[str], Sequence[int] | None] | None = None,
    histogram_last: bool = False,
) -> str:
    """The exporter's view of every model, from its scraped page, read at `clock`. `beside(model)`:
    lines shown beside that model's histogram (the alert state, layerwatch/demo/alert_view.py) when `width`
    columns hold both, else below it (above it with `histogram_last`: a short terminal).
    `expected_static(model)`: the static layers the model's healthy profile expects, shown beside
    the routing verdict's."""
    models = sorted({labels["model_name"] for labels, _ in samples.get("layerwatch_entropy_count", [])})
    header = (
        f"layerwatch top  {url}  {clock}  "
        f"frames received {total(samples, 'layerwatch_exporter_frames_received_total'):,.0f}  "
        f"malformed {total(samples, 'layerwatch_exporter_frames_malformed_total'):,.0f}  "
        f"lost {total(samples, 'layerwatch_exporter_frames_lost_total'):,.0f}"
    )
    if not models:
        return terminal_text(header + "\n\nno gate frames received yet")
    return terminal_text(
        "\n\n".join(
            [header]
            + [
                format_report(
                    model_report(samples, model),
                    beside(model) if beside else (),
                    width,
                    since=SINCE,
                    expected_static=expected_static(model) if expected_static else None,
                    histogram_last=histogram_last,
                )
                for model in models
            ]
        )
    )


def terminal_text(text: str) -> str:
    """`text` with every character a terminal would act on, but the line break, shown as its escape
    (`\\x1b`): label values come from whatever answers at --url (and Prometheus), and an escape
    sequence in one would retitle or clear the reader's terminal."""
    return "\n".join(
        line if line.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
        for line in text.split("\n")
    )


def fit_view(whole: str, compact: Callable[[], str], columns: int, rows: int) -> str:
    """`whole` when a terminal of `columns` × `rows` shows it without scrolling (its last row is the
    cursor's); else `compact()` (the alert state above the histogram) without blank lines, cut at the
    bottom with the count of what was left out, and each line cut at the right edge (a wrapped line
    would push the top, the verdict and a drill's status, out of sight): htop's way."""
    if sum(max(1, -(-len(line) // columns)) for line in whole.split("\n")) <= rows - 1:
        return whole
    lines = [line if len(line) <= columns else line[: columns - 1] + "…" for line in compact().split("\n")]
    lines = [line for line in lines if line.strip()]
    if len(lines) > rows - 1:
        hidden = len(lines) - (rows - 2)
        lines = lines[: rows - 2] + [f"… {hidden} more lines: a taller terminal shows them"[:columns]]
    return "\n".join(lines)


# An exporter's page holds at most its --max-models x --max-layers series: megabytes, not this.
MAX_PAGE_BYTES = 64 << 20


class ScrapeError(ValueError):
    """The server answered, but not with a whole metrics page: a status other than 200, or not a whole
    HTTP answer (layerwatch/http_get.py's BadAnswer)."""


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """Every sample of `url`/metrics (a shim or an exporter), by sample name. The whole exchange, head
    included, must end within `timeout` seconds and `MAX_PAGE_BYTES` (layerwatch/http_get.py)."""
    try:
        page = http_get.get(url.rstrip("/") + "/metrics", timeout, MAX_PAGE_BYTES, "text/plain", what="page")
    except http_get.BadAnswer as exc:
        raise ScrapeError(str(exc)) from None
    if page.status != 200:
        raise ScrapeError(f"HTTP {page.status} {page.reason}")
    return parse_samples(page.body.decode("utf-8"))


def parse_samples(text: str) -> Samples:
    samples: Samples = collections.defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def model_report(samples: Samples, model: str) -> dict[str, object]:
    """The same report `layerwatch replay` prints, rebuilt from one model's exported series."""
    totals = EntropyTotals()
    for index, decision in enumerate(DECISIONS):
        labels = {"model_name": model, "decision": decision}
        cumulative = [
            value
            for le, value in sorted(
                (float(l["le"]), v) for l, v in _matching(samples, "layerwatch_entropy_bucket", labels)
            )
            if le <= 1.0
        ]
        totals.buckets[index] = np.diff(cumulative, prepend=0)
        totals.sums[index] = _value(samples, "layerwatch_entropy_sum", labels)
        totals.squares[index] = _value(samples, "layerwatch_entropy_squares_total", labels)
        zeros = _value(samples, "layerwatch_entropy_zero_total", labels)
        if zeros is None:  # exported alongside every layerwatch_entropy series
            raise ValueError(f"{model}: no layerwatch_entropy_zero_total for decision {decision!r}")
        totals.zeros[index] = zeros
    window = {"model_name": model}
    bimodal = _value(samples, "layerwatch_entropy_bimodal", window)
    peaks = _value(samples, "layerwatch_entropy_peaks", window)
    bimodality = Bimodality(
        observations=int(_value(samples, "layerwatch_entropy_window_observations", window) or 0),
        bimodal=None if bimodal is None else bimodal == 1,
        bimodality_coefficient=_value(samples, "layerwatch_entropy_bimodality_coefficient", window),
        dip=_value(samples, "layerwatch_entropy_dip", window),
        dip_p_value=_value(samples, "layerwatch_entropy_dip_p_value", window),
        peaks=None if peaks is None else int(peaks),
    )
    return report(model, totals, totals.buckets.sum(axis=0), bimodality) | routing_from_samples(samples, model)


def routing_from_samples(samples: Samples, model: str) -> dict[str, object]:
    """The routing keys of `layerwatch replay --json`, from the `layerwatch_routing_*` gauges
    (empty when the exporter does not export them)."""
    window = {"model_name": model}
    tokens = _value(samples, "layerwatch_routing_window_tokens", window)
    if tokens is None:
        return {}

    def per_layer(name: str) -> list[float]:
        found = sorted((int(l["layer"]), v) for l, v in _matching(samples, name, window))
        return [v for _, v in found]

    dynamic = _value(samples, "layerwatch_routing_dynamic", window)
    states = per_layer("layerwatch_routing_layer_static")
    withheld = dynamic is None
    return {
        "routing_verdict": "withheld" if withheld else "dynamic" if dynamic == 1 else "static",
        "token_dependent_share": _value(samples, "layerwatch_routing_token_dependent_share", window),
        "static_layers": None if withheld else [l for l, s in enumerate(states) if s == 1],
        "static_run_layers": None if withheld else [l for l, s in enumerate(states) if s == -1],
        "per_layer_low_rate": per_layer("layerwatch_routing_layer_low_ratio"),
        "per_layer_skip_rate": per_layer("layerwatch_routing_layer_skip_ratio"),
        "routing_tokens": int(tokens),
        "threshold": _value(samples, "layerwatch_routing_threshold", window),
    }


def _matching(samples: Samples, name: str, labels: dict[str, str]) -> list[tuple[dict[str, str], float]]:
    return [(l, v) for l, v in samples.get(name, []) if all(l.get(k) == w for k, w in labels.items())]


def _value(samples: Samples, name: str, labels: dict[str, str]) -> float | None:
    found = _matching(samples, name, labels)
    return found[0][1] if found else None


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(value for _, value in _matching(samples, name, labels))
