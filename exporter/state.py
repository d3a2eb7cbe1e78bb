"""What the exporter knows: per-model statistics fed by gate frames, and ingest health.

The UDP receiver thread calls `ingest_datagram`; scrapes read through `snapshot` and `bimodality`.
One lock guards the counters; the bimodality check runs outside it, at scrape time, cached (see
`bimodality`), so frames keep flowing while a scrape computes the dip test.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from layerwatch.statistics import (DEFAULT_MIN_WINDOW_OBSERVATIONS, DEFAULT_WINDOW_OBSERVATIONS, Bimodality, EntropyTotals,
                                   LayerTotals, check_bimodality, le_bucket_index)
from exporter.window import SlidingWindow
from layerwatch.wire import GateFrame, MalformedFrame, decode_frame

log = logging.getLogger(__name__)

# Sequence numbers are remembered for this many shims (least recently heard from is forgotten first),
# so a stream of made-up shim ids cannot grow memory without bound.
MAX_TRACKED_SHIMS = 4096


@dataclass(frozen=True)
class ExporterConfig:
    window_seconds: float = 300.0
    window_max_observations: int = DEFAULT_WINDOW_OBSERVATIONS
    min_window_observations: int = DEFAULT_MIN_WINDOW_OBSERVATIONS
    per_layer: bool = False  # per-layer histograms (20 buckets × layers × models series)
    max_models: int = 64  # frames naming further models are rejected: label cardinality
    statistics_cache_seconds: float = 2.0


class ModelStatistics:
    """Everything kept for one model_name."""

    def __init__(self, config: ExporterConfig) -> None:
        self.totals = EntropyTotals()
        self.layers = LayerTotals(with_buckets=config.per_layer)
        self.window = SlidingWindow(config.window_max_observations, config.window_seconds)
        self.frames_received = 0
        self.frames_lost = 0

    def add(self, entropies: np.ndarray, skipped: np.ndarray, now: float) -> None:
        """entropies float32 [rows, layers], skipped bool [rows, layers]."""
        buckets = le_bucket_index(entropies)
        self.totals.add(entropies.ravel(), skipped.ravel(), buckets.ravel())
        self.layers.add(entropies, buckets)
        self.window.add(entropies, now)


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


@dataclass
class _CachedBimodality:
    window_version: int
    computed_at: float
    result: Bimodality


class ExporterState:
    def __init__(self, config: ExporterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._models: dict[str, ModelStatistics] = {}
        self._last_sequence: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.frames_malformed = 0
        self.frames_rejected = 0
        # One bimodality computation at a time: concurrent scrapes wait for it and reuse the result.
        self._bimodality_lock = threading.Lock()
        self._bimodality_cache: dict[str, _CachedBimodality] = {}

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
            model.frames_lost += self._sequence_gap(frame.shim_id, frame.sequence)
            model.add(frame.entropies, frame.skipped, now)

    def _sequence_gap(self, shim_id: str, sequence: int) -> int:
        """Frames missing since this shim's previous frame.

        A sequence that does not move forward means the shim restarted (or a duplicate): no loss,
        counting starts again from it. A gap is charged to the model of the frame that reveals it.
        """
        previous = self._last_sequence.pop(shim_id, None)
        self._last_sequence[shim_id] = sequence
        if len(self._last_sequence) > MAX_TRACKED_SHIMS:
            self._last_sequence.popitem(last=False)
        if previous is None or sequence <= previous:
            return 0
        return sequence - previous - 1

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
            model_name=name, buckets=totals.buckets.copy(), sums=totals.sums.copy(),
            squares=totals.squares.copy(), zeros=totals.zeros.copy(),
            layer_sums=layers.sums.copy(), layer_counts=layers.counts.copy(),
            layer_buckets=None if layers.buckets is None else layers.buckets.copy(),
            frames_received=model.frames_received, frames_lost=model.frames_lost)

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
                        or now - cached.computed_at < self.config.statistics_cache_seconds):
                    return cached.result
                version, values = window.version, window.values()
            result = check_bimodality(values, self.config.min_window_observations)
            self._bimodality_cache[model_name] = _CachedBimodality(version, now, result)
            return result
