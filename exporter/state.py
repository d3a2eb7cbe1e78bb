"""What the exporter knows: per-model statistics fed by gate frames, and ingest health.

The UDP receiver thread calls `ingest_datagram`; scrapes read through `snapshot`, `bimodality` and
`routing`. One lock guards the counters; the bimodality check runs outside it, at scrape time, cached
(see `bimodality`), so frames keep flowing while a scrape computes the dip test. The routing
statistics are cached the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from exporter.routing_window import RoutingWindow
from exporter.sequences import SequenceTracker
from exporter.window import SlidingWindow
from layerwatch.routing import DEFAULT_MIN_ROUTING_TOKENS, DEFAULT_THRESHOLD, Routing, check_routing
from layerwatch.statistics import (
    DEFAULT_MIN_WINDOW_OBSERVATIONS,
    DEFAULT_WINDOW_OBSERVATIONS,
    MAX_WINDOW_OBSERVATIONS,
    Bimodality,
    EntropyTotals,
    LayerTotals,
    check_bimodality,
    le_bucket_index,
)
from layerwatch.wire import GateFrame, MalformedFrame, decode_frame

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExporterConfig:
    window_seconds: float = 300.0
    window_max_observations: int = DEFAULT_WINDOW_OBSERVATIONS
    min_window_observations: int = DEFAULT_MIN_WINDOW_OBSERVATIONS
    per_layer: bool = False  # per-layer histograms (20 buckets × layers × models series)
    max_models: int = 64  # frames naming further models are rejected: label cardinality
    statistics_cache_seconds: float = 2.0
    default_threshold: float = DEFAULT_THRESHOLD  # τ for frames that do not carry one (wire version 1)
    min_routing_tokens: int = DEFAULT_MIN_ROUTING_TOKENS  # below this the routing verdict is withheld

    def __post_init__(self) -> None:
        if not 0 < self.window_max_observations <= MAX_WINDOW_OBSERVATIONS:
            raise ValueError(
                f"--window-max-observations {self.window_max_observations} must be 1..{MAX_WINDOW_OBSERVATIONS}: "
                f"above, the dip test's p-values stop being valid"
            )
        if not 0 < self.min_window_observations <= self.window_max_observations:
            raise ValueError(
                f"--min-window-observations {self.min_window_observations} must be 1..--window-max-observations "
                f"({self.window_max_observations}): above, no verdict could ever be given"
            )


class ModelStatistics:
    """Everything kept for one model_name."""

    def __init__(self, config: ExporterConfig) -> None:
        self.totals = EntropyTotals()
        self.layers = LayerTotals(with_buckets=config.per_layer)
        self.window = SlidingWindow(config.window_max_observations, config.window_seconds)
        self.routing_window = RoutingWindow(config.window_max_observations, config.window_seconds)
        self.threshold: float | None = None  # τ of the latest frame (the default for a frame without one)
        self.frames_received = 0
        self.frames_lost = 0
        self.frames_interleaved = 0
        self.frames_without_threshold = 0

    def add(
        self,
        entropies: np.ndarray,
        skipped: np.ndarray,
        now: float,
        threshold: float = DEFAULT_THRESHOLD,
        model_name: str = "",
    ) -> None:
        """entropies float32 [rows, layers], skipped bool [rows, layers], the τ they were decided with."""
        buckets = le_bucket_index(entropies)
        self.totals.add(entropies.ravel(), skipped.ravel(), buckets.ravel())
        self.layers.add(entropies, buckets)
        self.window.add(entropies, now)
        self.routing_window.add(entropies, skipped, threshold, now, model_name)
        self.threshold = threshold


@dataclass(frozen=True)
class ModelSnapshot:
    """A consistent copy of one model's counters, taken under the lock, rendered outside it."""

    model_name: str
    buckets: np.ndarray  # [2, 20] not cumulative, decision run/skip
    sums: np.ndarray  # [2]
    squares: np.ndarray  # [2]
    zeros: np.ndarray  # [2]
    layer_sums: np.ndarray  # [layers]
    layer_counts: np.ndarray  # [layers]
    layer_buckets: np.ndarray | None  # [layers, 20] with --per-layer
    frames_received: int
    frames_lost: int
    frames_interleaved: int = 0
    frames_without_threshold: int = 0
    threshold: float | None = None  # τ of the latest frame


@dataclass
class _CachedBimodality:
    window_version: int
    computed_at: float
    result: Bimodality


@dataclass
class _CachedRouting:
    window_version: tuple[int, int]
    computed_at: float
    result: Routing


class ExporterState:
    def __init__(self, config: ExporterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._models: dict[str, ModelStatistics] = {}
        self._sequences = SequenceTracker()
        self.frames_malformed = 0
        self.frames_rejected = 0
        # One bimodality computation at a time: concurrent scrapes wait for it and reuse the result.
        self._bimodality_lock = threading.Lock()
        self._bimodality_cache: dict[str, _CachedBimodality] = {}
        self._routing_lock = threading.Lock()
        self._routing_cache: dict[str, _CachedRouting] = {}

    def ingest_datagram(self, data: bytes) -> None:
        try:
            frame = decode_frame(data)
        except MalformedFrame as exc:
            log.debug("dropped a malformed datagram: %s", exc)
            with self._lock:
                self.frames_malformed += 1
            return
        self.ingest(frame)

    def ingest(self, frame: GateFrame) -> None:
        now = self._clock()
        with self._lock:
            model = self._models.get(frame.model_name)
            if model is None:
                if len(self._models) >= self.config.max_models:
                    self.frames_rejected += 1
                    return
                model = self._models[frame.model_name] = ModelStatistics(self.config)
            model.frames_received += 1
            verdict = self._sequences.observe(frame.shim_id, frame.sequence)
            model.frames_lost += verdict.lost
            if verdict.interleaved:
                if model.frames_interleaved == 0:
                    log.warning(
                        "model %r: gate frames under shim id %r interleave two sequence numberings: several "
                        "shims send under this id (a shared --shim-id or LAYERWATCH_SHIM_ID?); counted in "
                        "layerwatch_exporter_frames_interleaved_total, not as loss",
                        frame.model_name,
                        frame.shim_id,
                    )
                model.frames_interleaved += 1
            threshold = frame.threshold
            if threshold is None:  # wire version 1: an older shim that does not send τ
                threshold = self.config.default_threshold
                if model.frames_without_threshold == 0:
                    log.warning(
                        "model %r: gate frames without a threshold (wire version 1, shim %r); routing "
                        "statistics assume the default threshold %g",
                        frame.model_name,
                        frame.shim_id,
                        threshold,
                    )
                model.frames_without_threshold += 1
            model.add(frame.entropies, frame.skipped, now, threshold, frame.model_name)

    def model_names(self) -> list[str]:
        with self._lock:
            return sorted(self._models)

    def snapshot(self) -> list[ModelSnapshot]:
        with self._lock:
            return [self._snapshot(name, model) for name, model in sorted(self._models.items())]

    @staticmethod
    def _snapshot(name: str, model: ModelStatistics) -> ModelSnapshot:
        totals, layers = model.totals, model.layers
        return ModelSnapshot(
            model_name=name,
            buckets=totals.buckets.copy(),
            sums=totals.sums.copy(),
            squares=totals.squares.copy(),
            zeros=totals.zeros.copy(),
            layer_sums=layers.sums.copy(),
            layer_counts=layers.counts.copy(),
            layer_buckets=None if layers.buckets is None else layers.buckets.copy(),
            frames_received=model.frames_received,
            frames_lost=model.frames_lost,
            frames_interleaved=model.frames_interleaved,
            frames_without_threshold=model.frames_without_threshold,
            threshold=model.threshold,
        )

    def bimodality(self, model_name: str) -> Bimodality:
        """The window's statistics, recomputed only when the window changed and the cached result
        is older than `statistics_cache_seconds`: a scrape storm costs one computation."""
        with self._bimodality_lock:
            now = self._clock()
            with self._lock:
                window = self._models[model_name].window
                window.expire(now)
                cached = self._bimodality_cache.get(model_name)
                if cached is not None and (
                    cached.window_version == window.version
                    or now - cached.computed_at < self.config.statistics_cache_seconds
                ):
                    return cached.result
                version, values = window.version, window.values()
            result = check_bimodality(values, self.config.min_window_observations)
            self._bimodality_cache[model_name] = _CachedBimodality(version, now, result)
            return result

    def routing(self, model_name: str) -> Routing:
        """The routing statistics over the model's window (layerwatch/routing.py), cached like
        `bimodality`: recomputed only when the window changed and the result is older than
        `statistics_cache_seconds`."""
        with self._routing_lock:
            now = self._clock()
            with self._lock:
                window = self._models[model_name].routing_window
                window.expire(now)
                cached = self._routing_cache.get(model_name)
                if cached is not None and (
                    cached.window_version == window.version
                    or now - cached.computed_at < self.config.statistics_cache_seconds
                ):
                    return cached.result
                version, counts = window.version, window.counts()
            result = check_routing(*counts, min_tokens=self.config.min_routing_tokens)
            self._routing_cache[model_name] = _CachedRouting(version, now, result)
            return result
