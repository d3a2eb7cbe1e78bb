"""What the exporter knows: per-model statistics fed by gate frames, and ingest health.

The UDP receiver thread calls `ingest_datagram`; scrapes read through `snapshot`, `bimodality` and
`routing`. What a forged frame can cost is bounded: a model's layer count is fixed by its first
accepted frame, frames wider than `max_layers` are refused, at most `max_models` models are kept and
a model that sends nothing for `model_idle_seconds` is forgotten (its slot and series freed); one
pair of frames counts at most MAX_SEQUENCE_GAP lost frames (a longer jump is refused); with a frame
key, untagged and mistagged frames are refused before decoding, and replayed ones by the sequence
numbers (layerwatch/exporter/sequences.py). Each refusal is counted by reason. One lock guards the counters;
the bimodality check and the routing statistics run outside it, at scrape time, cached
(`_WindowStatistic`), so frames keep flowing while a scrape computes the dip test.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import numpy as np

from layerwatch import argtypes
from layerwatch.exporter.routing_window import RoutingWindow
from layerwatch.exporter.sequences import REJECT_REASONS as SEQUENCE_REJECT_REASONS
from layerwatch.exporter.sequences import SequenceTracker
from layerwatch.exporter.window import SlidingWindow
from layerwatch.routing import DEFAULT_MIN_ROUTING_TOKENS, Routing, check_routing
from layerwatch.settings import setting
from layerwatch.skip_policy import DEFAULT_THRESHOLD
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
from layerwatch.wire import GateFrame, MalformedFrame, UnauthenticatedFrame, decode_frame, load_frame_key

log = logging.getLogger(__name__)

W = TypeVar("W", bound="_Window")
D = TypeVar("D")  # what a statistic is computed from: a copy of the window's contents
R = TypeVar("R")

# Why a well-formed frame was dropped (layerwatch_exporter_frames_rejected_total{reason}).
REJECT_REASONS = (
    "too_many_models",
    "too_many_layers",
    "layer_count_changed",
    "missing_tag",
    "bad_tag",
    *SEQUENCE_REJECT_REASONS,
)


@dataclass(frozen=True)
class ExporterConfig:
    """The exporter's settings, each declared once with its flag (layerwatch/settings.py): `layerwatch
    exporter` derives its flags from them, `layerwatch replay` those of replay.py's REPLAY_SETTINGS."""

    window_seconds: float = setting(
        300.0,
        type=argtypes.positive(float),
        help="the bimodality window forgets entropies older than this (default %(default)s)",
    )
    window_max_observations: int = setting(
        DEFAULT_WINDOW_OBSERVATIONS,
        type=argtypes.positive(int),
        help=f"most entropies per model in the bimodality window, at most {MAX_WINDOW_OBSERVATIONS} "
        "(default %(default)s)",
    )
    min_window_observations: int = setting(
        DEFAULT_MIN_WINDOW_OBSERVATIONS,
        type=argtypes.positive(int),
        help="below this many entropies in the window the verdict is withheld (default %(default)s)",
    )
    per_layer: bool = setting(  # 20 buckets × layers × models series
        False, help="also export a 20-bucket histogram per layer (layers x models x 23 series)"
    )
    max_models: int = setting(  # label cardinality
        64,
        type=argtypes.positive(int),
        help="most distinct models; more are rejected, in replay naming the line (default %(default)s)",
    )
    max_layers: int = setting(  # per-layer series per model
        256,
        type=argtypes.positive(int),
        help="most layers a frame or trace line may have (default %(default)s)",
    )
    model_idle_seconds: float = setting(  # a model silent this long is forgotten (slot and series freed)
        900.0,
        type=argtypes.positive(float),
        help="seconds after a model's last frame that its series and slot are freed (default %(default)s)",
    )
    frame_key: bytes | None = setting(  # only frames tagged under it are accepted
        None,
        flag="--frame-key-file",
        type=Path,
        metavar="FILE",
        convert=load_frame_key,
        repr=False,
        help='accept only gate frames tagged with the key in FILE (docs/wire-format.md, "Key file"; default: '
        "untagged frames)",
    )
    statistics_cache_seconds: float = setting(
        2.0,
        type=argtypes.non_negative,
        help="reuse the window statistics for this long across scrapes (default %(default)s)",
    )
    default_threshold: float = setting(  # τ for frames that do not carry one (wire version 1)
        DEFAULT_THRESHOLD,
        type=argtypes.fraction,
        metavar="TAU",
        help="skip threshold assumed for frames (wire version 1) and trace lines that carry none (default %(default)s)",
    )
    min_routing_tokens: int = setting(
        DEFAULT_MIN_ROUTING_TOKENS,
        type=argtypes.positive(int),
        help="below this many tokens in the window the routing verdict is withheld (default %(default)s)",
    )

    def __post_init__(self) -> None:
        if not 0 < self.max_layers <= 0xFFFF:
            raise ValueError(f"--max-layers {self.max_layers} must be 1..65535 (the frame's layer field is a u16)")
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

    def __init__(self, config: ExporterConfig, layers: int = 0, now: float = 0.0) -> None:
        self.num_layers = layers  # fixed by the model's first frame, or first trace line in replay (0: unchecked)
        self.last_seen = now  # when the model's latest frame was accepted
        self.totals = EntropyTotals()
        self.layers = LayerTotals(with_buckets=config.per_layer)
        self.window = SlidingWindow(config.window_max_observations, config.window_seconds)
        self.routing_window = RoutingWindow(config.window_max_observations, config.window_seconds)
        self.threshold: float | None = None  # τ of the latest frame (the default for a frame without one)
        self.frames_received = 0
        self.frames_lost = 0  # sequence gaps, less the late frames that filled some
        # The highest frames_lost a snapshot has reported: a counter must not go down (rate() would read
        # a late frame after a scrape as a counter reset), so until new losses pass it, this is exported.
        self.frames_lost_reported = 0
        self.frames_interleaved = 0
        self.frames_without_threshold = 0
        self.fallbacks = 0  # fallback episodes the frames report (their senders' breakers)

    def add(
        self,
        entropies: np.ndarray,
        skipped: np.ndarray,
        now: float,
        threshold: float = DEFAULT_THRESHOLD,
        model_name: str = "",
        first_layer: int = 0,
    ) -> None:
        """entropies float32 [rows, layers], skipped bool [rows, layers], the τ they were decided with; the
        columns are the model's layers first_layer.. (a partial frame's: a pipeline stage's layers). The
        pooled statistics (histograms, bimodality window) take a partial frame's scores as they come; the
        per-layer ones file each column under its model layer."""
        buckets = le_bucket_index(entropies)
        self.totals.add(entropies.ravel(), skipped.ravel(), buckets.ravel())
        model_layers = self.num_layers or entropies.shape[1]
        self.layers.add(entropies, buckets, skipped, first_layer, model_layers)
        self.window.add(entropies, now)
        self.routing_window.add(entropies, skipped, threshold, now, model_name, first_layer, model_layers)
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
    layer_skips: np.ndarray  # [layers]
    layer_buckets: np.ndarray | None  # [layers, 20] with --per-layer
    frames_received: int
    frames_lost: int
    frames_interleaved: int = 0
    frames_without_threshold: int = 0
    threshold: float | None = None  # τ of the latest frame
    fallbacks: int = 0


class _Window(Protocol):
    @property
    def version(self) -> object: ...  # changes whenever the contents change

    def expire(self, now: float) -> None: ...


@dataclass
class _Cached(Generic[R]):
    window_version: object
    computed_at: float
    result: R


class _WindowStatistic(Generic[W, D, R]):
    """One statistic of every model's window (the bimodality check, the routing statistics), computed
    at scrape time outside the state's lock and cached per model: recomputed only when the window
    changed and the cached result is older than `statistics_cache_seconds`, so a scrape storm costs
    one computation. One computation at a time: concurrent scrapes wait for it and reuse the result."""

    def __init__(
        self,
        window_of: Callable[[ModelStatistics], W],
        contents: Callable[[W], D],
        compute: Callable[[D], R],
        empty: D,  # a forgotten model's: nothing in its window
    ) -> None:
        self.window_of, self.contents, self.compute, self.empty = window_of, contents, compute, empty
        self.lock = threading.Lock()
        self.cached: dict[str, _Cached[R]] = {}


class ExporterState:
    def __init__(self, config: ExporterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._models: dict[str, ModelStatistics] = {}
        # With the frame key every frame reaching the tracker is authenticated: replays are told apart.
        self._sequences = SequenceTracker(authenticated=config.frame_key is not None)
        self.frames_malformed = 0
        self.frames_rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._bimodality = _WindowStatistic(
            lambda model: model.window,
            SlidingWindow.values,
            lambda values: check_bimodality(values, config.min_window_observations),
            np.empty(0, np.float32),
        )
        self._routing = _WindowStatistic(
            lambda model: model.routing_window,
            RoutingWindow.counts,
            lambda counts: check_routing(*counts, min_tokens=config.min_routing_tokens),
            (0, np.zeros(0), np.zeros(0)),
        )

    def ingest_datagram(self, data: bytes) -> None:
        try:
            frame = decode_frame(data, self.config.frame_key)
        except UnauthenticatedFrame as exc:
            log.debug("dropped an unauthenticated datagram: %s", exc)
            with self._lock:
                self.frames_rejected[exc.reason] += 1
            return
        except MalformedFrame as exc:
            log.debug("dropped a malformed datagram: %s", exc)
            with self._lock:
                self.frames_malformed += 1
            return
        self.ingest(frame)

    def ingest(self, frame: GateFrame) -> None:
        now = self._clock()
        layers = frame.total_layers  # the model's (a partial frame holds some of them)
        with self._lock:
            # A refused frame did arrive: it moves its shim's sequence on, so it is not counted as lost
            # (a gap it reveals is not charged: its statistics are not counted either).
            verdict = self._sequences.observe(frame.shim_id, frame.sequence)
            refusal = verdict.rejected or self._admit(frame.model_name, layers, now)
            if refusal is not None:
                if verdict.rejected is not None:
                    log.debug("dropped frame %d of shim %r: %s", frame.sequence, frame.shim_id, refusal)
                self.frames_rejected[refusal] += 1
                return
            model = self._models[frame.model_name]
            model.last_seen = now
            model.frames_received += 1
            model.frames_lost += verdict.lost
            model.fallbacks += frame.fallbacks
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
            model.add(frame.entropies, frame.skipped, now, threshold, frame.model_name, frame.first_layer)

    def _admit(self, model_name: str, layers: int, now: float) -> str | None:
        """Why a frame of this model and width is refused (a REJECT_REASONS entry), else None with the
        model's slot in place: a new model takes a free slot, or one an idle model leaves.

        Called under the lock.
        """
        if layers > self.config.max_layers:
            return "too_many_layers"
        model = self._models.get(model_name)
        if model is not None:
            return "layer_count_changed" if layers != model.num_layers else None
        if len(self._models) >= self.config.max_models and not self._forget_idle_models(now):
            return "too_many_models"
        self._models[model_name] = ModelStatistics(self.config, layers, now)
        return None

    def _forget_idle_models(self, now: float) -> int:
        """Drops the models that sent nothing for `model_idle_seconds` (with their series); how many.

        Called under the lock, by scrapes and when a new model finds every slot taken.
        """
        idle = [name for name, model in self._models.items() if now - model.last_seen > self.config.model_idle_seconds]
        for name in idle:
            del self._models[name]
            self._bimodality.cached.pop(name, None)
            self._routing.cached.pop(name, None)
            log.info("model %r: no frame for %gs, forgotten", name, self.config.model_idle_seconds)
        return len(idle)

    def model_names(self) -> list[str]:
        with self._lock:
            self._forget_idle_models(self._clock())
            return sorted(self._models)

    def snapshot(self) -> list[ModelSnapshot]:
        with self._lock:
            self._forget_idle_models(self._clock())
            return [self._snapshot(name, model) for name, model in sorted(self._models.items())]

    @staticmethod
    def _snapshot(name: str, model: ModelStatistics) -> ModelSnapshot:
        totals, layers = model.totals, model.layers
        model.frames_lost_reported = max(model.frames_lost_reported, model.frames_lost)
        return ModelSnapshot(
            model_name=name,
            buckets=totals.buckets.copy(),
            sums=totals.sums.copy(),
            squares=totals.squares.copy(),
            zeros=totals.zeros.copy(),
            layer_sums=layers.sums.copy(),
            layer_counts=layers.counts.copy(),
            layer_skips=layers.skips.copy(),
            layer_buckets=None if layers.buckets is None else layers.buckets.copy(),
            frames_received=model.frames_received,
            frames_lost=model.frames_lost_reported,
            frames_interleaved=model.frames_interleaved,
            frames_without_threshold=model.frames_without_threshold,
            threshold=model.threshold,
            fallbacks=model.fallbacks,
        )

    def bimodality(self, model_name: str) -> Bimodality:
        """The window's bimodality statistics, cached (_WindowStatistic)."""
        return self._statistic(self._bimodality, model_name)

    def routing(self, model_name: str) -> Routing:
        """The routing statistics over the model's window (layerwatch/routing.py), cached (_WindowStatistic)."""
        return self._statistic(self._routing, model_name)

    def _statistic(self, statistic: _WindowStatistic[W, D, R], model_name: str) -> R:
        with statistic.lock:
            now = self._clock()
            with self._lock:
                model = self._models.get(model_name)
                if model is None:  # forgotten (idle) since the caller listed it: nothing in its window
                    return statistic.compute(statistic.empty)
                window = statistic.window_of(model)
                window.expire(now)
                cached = statistic.cached.get(model_name)
                if cached is not None and (
                    cached.window_version == window.version
                    or now - cached.computed_at < self.config.statistics_cache_seconds
                ):
                    return cached.result
                version, contents = window.version, statistic.contents(window)
            result = statistic.compute(contents)
            statistic.cached[model_name] = _Cached(version, now, result)
            return result
