"""The shim's /metrics: every SHIM metric of layerwatch/catalog.py, in an injected registry.

Two update paths, chosen so that the decode loop does no label lookups or string formatting:
  - per decode step, `DecodeStats.observe` queues the step's skip masks; they are summed into
    per-layer numpy totals in bulk, and `DecodeStatsCollector` turns those into samples only when
    /metrics is scraped;
  - per finished request, `RequestMetrics.finish` updates counters and latency histograms whose
    children were bound once at start-up, from the same numbers the client got in `usage`, and the
    request's own skipping (skip fraction, token-dependent share, the layers a runaway request skipped).
Every metric is built from its catalog spec by layerwatch/prometheus.py (docs/metrics.md lists them);
every custom collector describes itself, so registering it checks its names for clashes. The
custom collectors run `isolated` from each other: one that fails leaves the rest of /metrics served.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from layerwatch import prometheus
from layerwatch.catalog import DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION, REQUEST_FRACTION_BUCKETS, SHADOW_OUTCOMES, SHIM
from layerwatch.inference_shim.service.records import FinishedRequest
from layerwatch.prometheus import HistogramArrays
from layerwatch.request_tail import RequestLayers, request_skipping

if TYPE_CHECKING:
    from layerwatch.inference_shim.runtime.agreement import ShadowResult

log = logging.getLogger(__name__)

REQUEST_STATUSES = ("ok", "client_error", "server_error", "cancelled")
FALLBACK_REASON = "high_skipping"


def make_metric(name: str, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    """A prometheus_client metric object for a shim metric of the catalog, in `registry`."""
    return prometheus.instrument(name, registry, SHIM)


def make_counter(name: str, registry: CollectorRegistry) -> Counter:
    return prometheus.counter(name, registry, SHIM)


def make_gauge(name: str, registry: CollectorRegistry) -> Gauge:
    return prometheus.gauge(name, registry, SHIM)


def make_histogram(name: str, registry: CollectorRegistry) -> Histogram:
    return prometheus.histogram(name, registry, SHIM)


def family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty metric family for a shim counter or gauge of the catalog, filled at scrape time."""
    return prometheus.value_family(name, SHIM)


def histogram_family(name: str, bounds: Sequence[float] | None = None) -> HistogramArrays:
    """An empty metric family for a shim histogram of the catalog, filled at scrape time."""
    return prometheus.histogram_family(name, SHIM, bounds)


class ShimCollector(prometheus.CatalogCollector):
    """A custom collector of shim metrics (describes itself from `metric_names`)."""

    component = SHIM


def isolated(collectors: Mapping[str, ShimCollector]) -> prometheus.IsolatedCollectors:
    """The shim's custom collectors, each isolated from the others (layerwatch_scrape_collector_*)."""
    return prometheus.IsolatedCollectors(
        collectors,
        SHIM,
        success="layerwatch_scrape_collector_success",
        duration="layerwatch_scrape_collector_duration_seconds",
    )


# --- decode-step statistics -----------------------------------------------------------------------


class DecodeStats:
    """Per-layer decode counters since start, exact, at almost no cost per decode step.

    `observe` (engine thread, once per step) only queues the step's arrays; they are folded into
    the totals with a few vectorised operations over many steps at once, when a scrape asks for a
    snapshot or every FOLD_STEPS steps. Counted per decoded token (row of a step): every layer's
    gate is evaluated once, so every layer's evaluations equal `rows`; `skips[l]` counts rows whose
    skip rule skipped layer l (decided), `executed_skips[l]` rows that did not run it, and
    `unneeded_runs[l]` rows that ran it though their rule skipped it (the depth execution's; a batch
    consensus may also skip a layer a rule kept: executed = decided - unneeded + those).
    """

    FOLD_STEPS = 256  # bounds the queue when nobody scrapes

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._totals = DecodeStatsSnapshot(
            rows=0,
            steps=0,
            skips=np.zeros(num_layers, dtype=np.int64),
            executed_skips=np.zeros(num_layers, dtype=np.int64),
            unneeded_runs=np.zeros(num_layers, dtype=np.int64),
            batch_skips=np.zeros(num_layers, dtype=np.int64),
            executed_counts=np.zeros(num_layers + 1, dtype=np.int64),
            executed_sum=0,
            fallbacks=0,
        )

    def observe(
        self,
        skipped: np.ndarray,
        executed_skipped: np.ndarray,
        batch_skipped: np.ndarray,
        fallback_started: np.ndarray,
    ) -> None:
        """skipped (decided), executed_skipped bool [B, L]; batch_skipped bool [L]; fallback_started
        bool [B] (a StepRecord's). Not modified later."""
        with self._lock:
            self._pending.append((skipped, executed_skipped, batch_skipped, fallback_started))
            if len(self._pending) >= self.FOLD_STEPS:
                self._fold()

    def snapshot(self) -> DecodeStatsSnapshot:
        with self._lock:
            self._fold()
            return self._totals

    def _fold(self) -> None:
        if not self._pending:
            return
        skipped = np.concatenate([p[0] for p in self._pending])
        executed_skipped = np.concatenate([p[1] for p in self._pending])
        batch_skipped = np.stack([p[2] for p in self._pending])
        fallbacks = sum(int(p[3].sum()) for p in self._pending)
        executed = self.num_layers - executed_skipped.sum(axis=1)
        t = self._totals
        self._totals = DecodeStatsSnapshot(
            rows=t.rows + len(skipped),
            steps=t.steps + len(self._pending),
            skips=t.skips + skipped.sum(axis=0),
            executed_skips=t.executed_skips + executed_skipped.sum(axis=0),
            unneeded_runs=t.unneeded_runs + (skipped & ~executed_skipped).sum(axis=0),
            batch_skips=t.batch_skips + batch_skipped.sum(axis=0),
            executed_counts=t.executed_counts + np.bincount(executed, minlength=self.num_layers + 1),
            executed_sum=t.executed_sum + int(executed.sum()),
            fallbacks=t.fallbacks + fallbacks,
        )
        self._pending = []


@dataclass(frozen=True)
class DecodeStatsSnapshot:
    rows: int
    steps: int
    skips: np.ndarray
    executed_skips: np.ndarray
    unneeded_runs: np.ndarray
    batch_skips: np.ndarray
    executed_counts: np.ndarray
    executed_sum: int
    fallbacks: int


class DecodeStatsCollector(ShimCollector):
    """Exposes `DecodeStats` at scrape time: the only place per-layer label values are formatted."""

    metric_names = (
        "layerwatch_layer_evaluations_total",
        "layerwatch_layer_skips_total",
        "layerwatch_layer_skips_executed_total",
        "layerwatch_layer_unneeded_runs_total",
        "layerwatch_batch_layer_steps_total",
        "layerwatch_batch_layer_skips_total",
        "layerwatch_layers_executed",
        "layerwatch_fallbacks_total",
    )

    def __init__(self, stats: DecodeStats, model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name
        self._layers = [str(l) for l in range(stats.num_layers)]
        self._executed_bounds = range(stats.num_layers + 1)  # 0..L layers ran

    def collect(self) -> Iterator[Metric]:
        s = self._stats.snapshot()
        m = self._model_name
        per_layer = {
            "layerwatch_layer_evaluations_total": [s.rows] * len(self._layers),
            "layerwatch_layer_skips_total": s.skips.tolist(),
            "layerwatch_layer_skips_executed_total": s.executed_skips.tolist(),
            "layerwatch_layer_unneeded_runs_total": s.unneeded_runs.tolist(),
            "layerwatch_batch_layer_steps_total": [s.steps] * len(self._layers),
            "layerwatch_batch_layer_skips_total": s.batch_skips.tolist(),
        }
        for name, values in per_layer.items():
            counter = family(name)
            for layer, value in zip(self._layers, values):
                counter.add_metric([m, layer], value)
            yield counter
        # Every decoded row ran 0..L layers, so the last bucket holds all rows (= the +Inf bucket).
        executed = histogram_family("layerwatch_layers_executed", bounds=self._executed_bounds)
        executed.add_histograms([(m,)], s.executed_counts[np.newaxis, :], np.array([s.executed_sum]))
        yield executed
        fallbacks = family("layerwatch_fallbacks_total")
        fallbacks.add_metric([m, FALLBACK_REASON], s.fallbacks)
        yield fallbacks


# --- per-request metrics ----------------------------------------------------------------------------


# Requests whose own skipping is observed: those the engine finished (their tokens were decoded and
# are in the per-layer counters too), not those it refused or failed.
SKIPPING_STATUSES = ("ok", "cancelled")


def check_runaway_fraction(cutoff: float) -> float:
    """The runaway cut-off, refused unless it is a bucket edge of the skip-fraction histogram: then
    the histogram's share of requests above it and the runaway layer counts describe the same requests."""
    if cutoff not in REQUEST_FRACTION_BUCKETS:
        edges = ", ".join(f"{b:g}" for b in REQUEST_FRACTION_BUCKETS)
        raise ValueError(f"the request runaway fraction must be a bucket edge ({edges}), got {cutoff:g}")
    return cutoff


class RequestMetrics:
    """Counters and histograms updated once per finished request (children bound once).

    Besides the request counts and latency: the request's skip fraction and token-dependent share
    (layerwatch/request_tail.py), and, for a request whose skip fraction exceeds `runaway_fraction`,
    its skipped layer evaluations per layer and its tokens: which layers the runaway tail skips.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        num_layers: int = 0,
        runaway_fraction: float = DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION,
    ) -> None:
        requests = make_counter("layerwatch_requests_total", registry)
        self._requests = {status: requests.labels(model_name, status) for status in REQUEST_STATUSES}
        tokens = make_counter("layerwatch_tokens_total", registry)
        self._prefill_tokens = tokens.labels(model_name, "prefill")
        self._decode_tokens = tokens.labels(model_name, "decode")
        self._ttft = make_histogram("layerwatch_time_to_first_token_seconds", registry).labels(model_name)
        self._itl = make_histogram("layerwatch_inter_token_latency_seconds", registry).labels(model_name)
        self._duration = make_histogram("layerwatch_request_duration_seconds", registry).labels(model_name)
        self.runaway_fraction = check_runaway_fraction(runaway_fraction)
        self.num_layers = num_layers
        self._skip_fraction = make_histogram("layerwatch_request_skip_fraction", registry).labels(model_name)
        self._token_dependent_share = make_histogram("layerwatch_request_token_dependent_share", registry).labels(
            model_name
        )
        runaway_skips = make_counter("layerwatch_request_runaway_layer_skips_total", registry)
        self._runaway_layer_skips = [runaway_skips.labels(model_name, str(l)) for l in range(num_layers)]
        self._runaway_tokens = make_counter("layerwatch_request_runaway_tokens_total", registry).labels(model_name)
        make_gauge("layerwatch_request_runaway_skip_fraction", registry).labels(model_name).set(runaway_fraction)

    def finish(self, request: FinishedRequest) -> None:
        self._requests[request.status].inc()
        self._prefill_tokens.inc(request.prompt_tokens)
        self._decode_tokens.inc(request.completion_tokens)
        if request.layers is not None and request.status in SKIPPING_STATUSES:
            self._observe_skipping(request.layers)
        if request.status != "ok":
            return  # latency describes served requests only
        if request.time_to_first_token is not None:
            self._ttft.observe(request.time_to_first_token)
        for gap in request.inter_token_latencies:
            self._itl.observe(gap)
        if request.duration is not None:
            self._duration.observe(request.duration)

    def _observe_skipping(self, layers: RequestLayers) -> None:
        if layers.layers != self.num_layers:  # cannot happen with one engine per model; never fail a response
            log.error("a request with %d layers on a %d-layer model: not observed", layers.layers, self.num_layers)
            return
        skipping = request_skipping(layers)
        if skipping is None:  # no decode token: nothing was skipped or kept
            return
        self._skip_fraction.observe(skipping.skip_fraction)
        if skipping.token_dependent_share is not None:
            self._token_dependent_share.observe(skipping.token_dependent_share)
        if skipping.runaway(self.runaway_fraction):
            self._runaway_tokens.inc(layers.tokens)
            for child, skips in zip(self._runaway_layer_skips, np.asarray(layers.skipped).tolist()):
                if skips:
                    child.inc(skips)


class ShadowMetrics:
    """The shadow check's counters: one `observe` per job, nothing per token."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.tokens = make_counter("layerwatch_shadow_tokens_total", registry).labels(model_name)
        self.agreements = make_counter("layerwatch_shadow_agreements_total", registry).labels(model_name)
        self.kl_nats = make_counter("layerwatch_shadow_kl_nats_total", registry).labels(model_name)
        self.reverse_kl_nats = make_counter("layerwatch_shadow_reverse_kl_nats_total", registry).labels(model_name)
        requests = make_counter("layerwatch_shadow_requests_total", registry)
        self.requests = {outcome: requests.labels(model_name, outcome) for outcome in SHADOW_OUTCOMES}

    def observe(self, result: ShadowResult) -> None:
        """One checked request."""
        self.tokens.inc(result.tokens)
        self.agreements.inc(result.agreements)
        self.kl_nats.inc(result.kl_nats)
        self.reverse_kl_nats.inc(result.reverse_kl_nats)
        self.requests["checked"].inc()


class AuditSpanCounts:
    """The audit trail's spans by outcome, and how many wait for export (layerwatch/inference_shim/service/
    audit.py; all zero while spans are off). Updated from the request path, the engine thread
    (shadow spans) and the SDK's export thread, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.exported = 0  # the collector accepted them
        self.failed = 0  # their export failed: lost
        self.dropped = 0  # ended while the queue was full: never sent
        self.queued = 0  # waiting for export or being exported

    def enqueue(self, capacity: int) -> bool:
        """An ended span: True when it may join the queue, False (and counted) when it is dropped."""
        with self._lock:
            if self.queued >= capacity:
                self.dropped += 1
                return False
            self.queued += 1
            return True

    def settle(self, spans: int, ok: bool) -> None:
        """An export of `spans` spans finished."""
        with self._lock:
            self.queued -= spans
            if ok:
                self.exported += spans
            else:
                self.failed += spans


class AuditCollector(ShimCollector):
    """layerwatch_audit_spans_total{outcome} and layerwatch_audit_spans_queued, at scrape time."""

    metric_names = ("layerwatch_audit_spans_total", "layerwatch_audit_spans_queued")

    def __init__(self, counts: AuditSpanCounts, model_name: str) -> None:
        self._counts = counts
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        spans, queued = map(family, self.metric_names)
        c = self._counts
        for outcome, value in (("exported", c.exported), ("failed", c.failed), ("dropped", c.dropped)):
            spans.add_metric([self._model_name, outcome], value)
        yield spans
        queued.add_metric([self._model_name], c.queued)
        yield queued


class RequestQueueCollector(ShimCollector):
    """Requests running (holding a batch slot) and waiting for one, at scrape time."""

    metric_names = ("layerwatch_requests_running", "layerwatch_requests_waiting")

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int], model_name: str) -> None:
        self._counts = {"layerwatch_requests_running": running, "layerwatch_requests_waiting": waiting}
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for name, count in self._counts.items():
            gauge = family(name)
            gauge.add_metric([self._model_name], count())
            yield gauge


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    layers: int
    dtype: str  # a DTYPES name (serve --dtype)
    quantization: str  # a QUANTIZATIONS name (serve --quantization)
    threshold: float
    patience: int
    skip_rule: str
    ewma_alpha: float  # exported only under the ewma rule (the streak rule does not read it)
    kv_policy: str
    gates_sha256: str


class ModelInfoCollector(ShimCollector):
    """layerwatch_model_info from what is served at scrape time (a gate file reload changes it)."""

    metric_names = ("layerwatch_model_info",)

    def __init__(self, current: Callable[[], ModelInfo]) -> None:
        self._current = current

    def collect(self) -> Iterator[Metric]:
        info = self._current()
        gauge = family("layerwatch_model_info")
        gauge.add_metric(
            [
                info.model_name,
                str(info.layers),
                info.dtype,
                info.quantization,
                floatToGoString(info.threshold),
                str(info.patience),
                info.skip_rule,
                floatToGoString(info.ewma_alpha) if info.skip_rule == "ewma" else "",
                info.kv_policy,
                info.gates_sha256,
            ],
            1,
        )
        yield gauge


class GateReloadMetrics:
    """What the gate file watch decided: replacements loaded or rejected, and whether the file on disk
    is a rejected one right now (the previously loaded gates serve meanwhile)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        reloads = make_counter("layerwatch_gate_file_reloads_total", registry)
        self.loaded = reloads.labels(model_name, "loaded")
        self.rejected = reloads.labels(model_name, "rejected")
        self.file_rejected = make_gauge("layerwatch_gate_file_rejected", registry).labels(model_name)
