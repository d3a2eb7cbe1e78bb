"""The per-token window behind the routing statistics (layerwatch/routing.py).

Per token (frame row) and layer it keeps one byte: bit 0 = the score was below the frame's τ, bit 1
= the layer was skipped. τ is applied at ingest, so frames decided with different thresholds are
each judged by their own. The bytes live in a SlidingWindow (the one behind the bimodality check):
its capacity is the entropy window's, rounded down to whole tokens, and it forgets by the same
clock, so both statistics describe the same tokens. Every add and every expiry moves whole frames,
so the window always holds whole rows.

A frame with a different layer count than the window's starts the window over at that count (the
per-layer series follow the model's current shape; mixing shapes has no per-layer meaning).
"""

from __future__ import annotations

import logging

import numpy as np

from layerwatch.exporter.window import SlidingWindow
from layerwatch.routing import DEFAULT_MIN_ROUTING_TOKENS, Routing, below_threshold, check_routing

log = logging.getLogger(__name__)

_BELOW, _SKIPPED = 1, 2


class RoutingWindow:
    def __init__(self, max_observations: int, max_age_seconds: float) -> None:
        self.max_observations = max_observations
        self.max_age_seconds = max_age_seconds
        self.layers = 0
        self._window: SlidingWindow | None = None
        self._resets = 0  # layer-count changes, folded into `version`

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever the contents change (for caching the statistics)."""
        return self._resets, 0 if self._window is None else self._window.version

    @property
    def tokens(self) -> int:
        return 0 if self._window is None else len(self._window) // self.layers

    def add(
        self, entropies: np.ndarray, skipped: np.ndarray, threshold: float, now: float, model_name: str = ""
    ) -> None:
        """entropies float32 [rows, layers], skipped bool [rows, layers], the frame's τ."""
        layers = entropies.shape[1]
        if self._window is None or layers != self.layers:
            if self.layers:
                log.warning(
                    "model %r: frames now have %d layers instead of %d; the routing window starts over",
                    model_name,
                    layers,
                    self.layers,
                )
            tokens = max(1, self.max_observations // layers)
            self._window = SlidingWindow(tokens * layers, self.max_age_seconds, dtype=np.uint8)
            self.layers = layers
            self._resets += 1
        codes = below_threshold(entropies, threshold).astype(np.uint8)
        codes |= np.asarray(skipped, dtype=np.uint8) * np.uint8(_SKIPPED)
        self._window.add(codes, now)

    def expire(self, now: float) -> None:
        if self._window is not None:
            self._window.expire(now)

    def counts(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(tokens, below-τ count per layer, skip count per layer) over the window."""
        if self._window is None:
            return 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        codes = self._window.values().reshape(-1, self.layers)
        below = np.count_nonzero(codes & _BELOW, axis=0)
        skipped = np.count_nonzero(codes & _SKIPPED, axis=0)
        return codes.shape[0], below.astype(np.int64), skipped.astype(np.int64)

    def statistics(self, min_tokens: int = DEFAULT_MIN_ROUTING_TOKENS) -> Routing:
        return check_routing(*self.counts(), min_tokens=min_tokens)
