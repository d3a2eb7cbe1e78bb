"""A faster Prometheus text-format (0.0.4) encoder for the exporter's /metrics page.

prometheus_client's `generate_latest` validates and escapes every label of every sample, and the
collectors build one `Sample` object per bucket: with per-layer histograms at 80 layers × 4 models
(8,000 samples) that is ~50 ms of CPU per scrape. Two things make it fast here:
- `HistogramArrays` (layerwatch/prometheus.py, what the catalog adapter makes of every histogram)
  holds many histograms with the same buckets as arrays; `TextEncoder` renders them without building
  samples (generic consumers still get `.samples`, built on demand);
- the text of each series' name and labels repeats from scrape to scrape, so it is rendered once and
  remembered; a scrape only formats values.
The output is byte-for-byte what `generate_latest` writes for the same metrics (a test holds it to that).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from concurrent.futures import Future

from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from layerwatch.prometheus import HistogramArrays

# Series are bounded (models are capped by --max-models), but a long-lived process could still see
# many come and go: start over rather than grow without bound.
MAX_CACHED_SERIES = 100_000


class TextEncoder:
    def __init__(self) -> None:
        self._series_text: dict[tuple, str] = {}
        self._histogram_text: dict[tuple, list[str]] = {}

    def encode(self, registry: Collector) -> bytes:
        if len(self._series_text) + len(self._histogram_text) > MAX_CACHED_SERIES:
            self._series_text.clear()
            self._histogram_text.clear()
        output: list[str] = []
        for metric in registry.collect():
            if metric.type not in ("counter", "gauge", "histogram"):
                raise ValueError(f"{metric.name}: metric type {metric.type} is not supported here")
            name = metric.name + "_total" if metric.type == "counter" else metric.name
            help_text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            output.append(f"# HELP {name} {help_text}\n# TYPE {name} {metric.type}\n")
            if isinstance(metric, HistogramArrays):
                self._encode_histograms(metric, output)
                continue
            for sample in metric.samples:
                if sample.timestamp is not None or sample.name.endswith("_created"):
                    raise ValueError(f"{sample.name}: timestamps and _created samples are not supported here")
                output.append(self._series(sample.name, sample.labels))
                output.append(floatToGoString(sample.value) + "\n")
        return "".join(output).encode("utf-8")

    def _encode_histograms(self, metric: HistogramArrays, output: list[str]) -> None:
        for values, cumulative, total in metric.series():
            prefixes = self._histogram_prefixes(metric, values)
            texts = [_count_text(count) for count in cumulative]
            texts.append(texts[-1])  # _count = the +Inf bucket
            texts.append(floatToGoString(total) + "\n")
            output += map(operator.add, prefixes, texts)

    def _histogram_prefixes(self, metric: HistogramArrays, values: tuple[str, ...]) -> list[str]:
        """The `name{labels} ` text of each sample of one histogram: buckets, _count, _sum."""
        key = (metric.name, metric.label_names, values)
        prefixes = self._histogram_text.get(key)
        if prefixes is None:
            labels = dict(zip(metric.label_names, values))
            prefixes = [self._series(metric.name + "_bucket", {**labels, "le": le}) for le in metric.le]
            prefixes += [self._series(metric.name + "_count", labels), self._series(metric.name + "_sum", labels)]
            self._histogram_text[key] = prefixes
        return prefixes

    def _series(self, name: str, labels: dict[str, str]) -> str:
        """`name{a="x",b="y"} ` with labels sorted and values escaped, as generate_latest writes it."""
        key = (name, tuple(labels.items()))
        text = self._series_text.get(key)
        if text is None:
            pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            text = f"{name}{{{pairs}}} " if pairs else f"{name} "
            self._series_text[key] = text
        return text


def _count_text(count: int) -> str:
    # floatToGoString(float(count)) for the counts a histogram reaches, without the float detour.
    return f"{count}.0\n" if count < 10**15 else floatToGoString(count) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class SharedRender:
    """The page rendered once for every scrape that asks while a render is in flight.

    A scrape that arrives while the page is being rendered waits for that render and gets its bytes;
    one that arrives when none is in flight starts one. So concurrent scrapes cost one render's CPU
    and hold one page in memory whatever their number (in the state forged frames can fill, a render
    per GET would let 60 GETs that are never read queue 60 renders ahead of Prometheus' scrape), and a
    page is never older than the render in flight when its scrape came.
    """

    def __init__(self, render: Callable[[], bytes]) -> None:
        self._render = render
        self._lock = threading.Lock()
        self._in_flight: Future[bytes] | None = None

    def page(self) -> bytes:
        with self._lock:
            shared, renders = self._in_flight, self._in_flight is None
            if shared is None:
                shared = self._in_flight = Future()
        if renders:
            try:
                page = self._render()
            except BaseException as exc:  # every scrape waiting on this render gets the error (a 500)
                self._finish(shared, exc)
                raise
            self._finish(shared, page)
        return shared.result()

    def _finish(self, shared: Future[bytes], outcome: bytes | BaseException) -> None:
        with self._lock:
            self._in_flight = None  # a scrape from now on starts a new render
        if isinstance(outcome, BaseException):
            shared.set_exception(outcome)
        else:
            shared.set_result(outcome)
