"""Catalog specs as prometheus_client objects: the one place a spec becomes a metric.

Both the shim and the exporter build every metric through this module, so a name, help text,
label set, type or bucket layout can only come from layerwatch/catalog.py (docs/metrics.md):

- `instrument(name, registry)`: a Counter, Gauge or Histogram object registered in the given
  (injected) registry, for values updated as things happen (per request, per gate reload);
- `family(name)`: an empty metric family, filled by a custom collector at scrape time. Histograms
  come as `HistogramArrays`, which takes per-bucket counts as arrays;
- `counter`, `gauge`, `histogram`, `value_family` and `histogram_family`: the same, typed by
  kind, for callers that know what they asked for (a spec of another kind is a TypeError);
- `describe(names)`: the families a custom collector will yield, without samples: what its
  `describe()` returns, so that registering it checks its names against the registry's;
- `CatalogCollector`: a base class for custom collectors that declares their catalog names once
  and describes itself from them;
- `IsolatedCollectors`: custom collectors run as node_exporter runs its collectors, each on its
  own: one that raises leaves its metrics out of the scrape and reports it, the rest is served.

Every function takes an optional `component` (catalog.SHIM or catalog.EXPORTER) and refuses a
spec of another component, so neither side can expose the other's metrics by mistake.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from layerwatch.catalog import BY_NAME, MetricSpec

log = logging.getLogger(__name__)

_M = TypeVar("_M")


def spec(name: str, component: str | None = None) -> MetricSpec:
    """The catalog entry for `name` (its exposed name, counters with `_total`)."""
    try:
        found = BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in layerwatch/catalog.py") from None
    if component is not None and found.component != component:
        raise ValueError(f"{name} is a {found.component} metric, not a {component} one")
    return found


def instrument(name: str, registry: CollectorRegistry, component: str | None = None) -> Counter | Gauge | Histogram:
    """A prometheus_client metric object for a spec, registered in `registry` (never the global one)."""
    s = spec(name, component)
    if s.kind == "counter":
        return Counter(name=s.base_name, documentation=s.help, labelnames=s.labels, registry=registry)
    if s.kind == "gauge":
        return Gauge(name=s.base_name, documentation=s.help, labelnames=s.labels, registry=registry)
    if s.buckets is None:
        raise ValueError(f"{name} has per-model buckets: expose it from a collector with family(name, bounds=...)")
    return Histogram(name=s.base_name, documentation=s.help, labelnames=s.labels, registry=registry, buckets=s.buckets)


def counter(name: str, registry: CollectorRegistry, component: str | None = None) -> Counter:
    """instrument() for a counter spec, typed as such."""
    return _of_kind(Counter, name, instrument(name, registry, component))


def gauge(name: str, registry: CollectorRegistry, component: str | None = None) -> Gauge:
    """instrument() for a gauge spec, typed as such."""
    return _of_kind(Gauge, name, instrument(name, registry, component))


def histogram(name: str, registry: CollectorRegistry, component: str | None = None) -> Histogram:
    """instrument() for a histogram spec, typed as such."""
    return _of_kind(Histogram, name, instrument(name, registry, component))


def family(name: str, component: str | None = None, bounds: Sequence[float] | None = None) -> Metric:
    """An empty metric family for a spec, for a collector to fill at scrape time.

    Counters and gauges are Counter/GaugeMetricFamily (add_metric(label_values, value)); histograms
    are HistogramArrays with the spec's buckets, or `bounds` where the spec leaves them per model.
    """
    s = spec(name, component)
    if s.kind == "counter":
        return CounterMetricFamily(s.base_name, s.help, labels=s.labels)
    if s.kind == "gauge":
        return GaugeMetricFamily(s.name, s.help, labels=s.labels)
    bounds = s.buckets if bounds is None else bounds
    if bounds is None:
        raise ValueError(f"{name} has per-model buckets: pass bounds")
    return HistogramArrays(s.name, s.help, s.labels, [floatToGoString(b) for b in bounds])


def value_family(name: str, component: str | None = None) -> CounterMetricFamily | GaugeMetricFamily:
    """family() for a counter or gauge spec, typed as such."""
    metric = family(name, component)
    if not isinstance(metric, CounterMetricFamily | GaugeMetricFamily):
        raise TypeError(f"{name} is a {metric.type} metric, not a counter or gauge")
    return metric


def histogram_family(name: str, component: str | None = None, bounds: Sequence[float] | None = None) -> HistogramArrays:
    """family() for a histogram spec, typed as such."""
    return _of_kind(HistogramArrays, name, family(name, component, bounds))


def _of_kind(kind: type[_M], name: str, metric: object) -> _M:
    if not isinstance(metric, kind):
        raise TypeError(f"{name} is a {spec(name).kind} metric, not a {kind.__name__}")
    return metric


def describe(names: Iterable[str], component: str | None = None) -> list[Metric]:
    """The families named, without samples: enough for a registry to check names for clashes."""
    return [Metric(s.base_name, s.help, s.kind) for s in (spec(name, component) for name in names)]


class CatalogCollector(Collector):
    """A custom collector that yields only the catalog metrics listed in `metric_names`.

    `describe()` returns them (from the catalog), so `registry.register(collector)` refuses a
    collector whose names are already taken instead of exposing duplicates.
    """

    component: str | None = None
    metric_names: tuple[str, ...] = ()

    def describe(self) -> list[Metric]:
        return describe(self.metric_names, self.component)


class IsolatedCollectors(CatalogCollector):
    """Named custom collectors, each run on its own as node_exporter runs its collectors.

    A collector's metrics are gathered in full before any is yielded: one that raises contributes
    nothing to the scrape (no half-built families), its exception is logged, and the gauge `success`
    says so with 0 for its `collector` label. Every other metric is still served, so the target stays
    `up` and the alerts that read other metrics keep working; `duration` is each collector's time.
    """

    def __init__(self, collectors: Mapping[str, CatalogCollector], component: str, success: str, duration: str) -> None:
        self.component = component
        self.metric_names = (success, duration)
        self._collectors = dict(collectors)

    def describe(self) -> list[Metric]:
        return [
            metric for collector in self._collectors.values() for metric in collector.describe()
        ] + super().describe()

    def collect(self) -> Iterator[Metric]:
        success, duration = (value_family(name, self.component) for name in self.metric_names)
        for name, collector in self._collectors.items():
            start = time.perf_counter()
            try:
                metrics = list(collector.collect())
            except Exception:
                log.exception("collector %s failed: its metrics are left out of this scrape", name)
                metrics = []
                success.add_metric([name], 0)
            else:
                success.add_metric([name], 1)
            duration.add_metric([name], time.perf_counter() - start)
            yield from metrics
        yield success
        yield duration


class HistogramArrays(Metric):
    """A histogram family whose series are added as arrays: per-bucket (not cumulative) counts.

    Every histogram has the same upper bounds `le` (the last one is the largest value seen, so the
    +Inf bucket equals the last bucket). The exporter's text encoder renders these without building
    samples; generic consumers (generate_latest) get `.samples`, built on demand.
    """

    def __init__(self, name: str, documentation: str, label_names: Sequence[str], le: Sequence[str]) -> None:
        super().__init__(name, documentation, "histogram")
        self.label_names = tuple(label_names)
        self.le = tuple(le) + ("+Inf",)
        self.label_values: list[tuple[str, ...]] = []
        self._cumulative: list[list[int]] = []  # per series, with the +Inf bucket
        self._sums: list[float] = []

    def add_histograms(self, label_values: Sequence[Sequence[str]], buckets: np.ndarray, sums: np.ndarray) -> None:
        """label_values: one tuple per series; buckets [series, len(le)]; sums [series]."""
        cumulative = np.cumsum(buckets, axis=1)
        self._cumulative += np.concatenate((cumulative, cumulative[:, -1:]), axis=1).tolist()
        self.label_values += [tuple(v) for v in label_values]
        self._sums += np.asarray(sums).tolist()

    def series(self) -> zip:
        """(label values, cumulative counts incl. +Inf, sum) per histogram."""
        return zip(self.label_values, self._cumulative, self._sums)

    @property
    def samples(self) -> list[Sample]:
        samples = []
        for values, cumulative, total in self.series():
            labels = dict(zip(self.label_names, values))
            samples += [
                Sample(self.name + "_bucket", {**labels, "le": le}, float(count))
                for le, count in zip(self.le, cumulative)
            ]
            samples.append(Sample(self.name + "_count", labels, float(cumulative[-1])))
            samples.append(Sample(self.name + "_sum", labels, total))
        return samples

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:  # Metric.__init__ sets an empty list; anything else would be lost
            raise AttributeError("HistogramArrays takes series through add_histograms")
