"""The per-token window behind the routing statistics (layerwatch/routing.py).

Per token (frame row) and layer it keeps one byte: bit 0 = the score was below the frame's τ, bit 1
= the layer was skipped. τ is applied at ingest, so frames decided with different thresholds are
each judged by their own. The bytes live in a SlidingWindow (the one behind the bimodality check):
its capacity is the entropy window's, rounded down to whole tokens, and it forgets by the same
clock, so both statistics describe the same tokens. Every add and every expiry moves whole frames,
so the window always holds whole rows.

A frame with a different layer count than the window's starts the window over at that count (the
per-layer series follow the model's current shape; mixing shapes has no per-layer meaning).

Partial frames (a pipeline stage's layers, docs/wire-format.md) fill a window per span of layers, each
holding as many tokens as a whole window would. Every stage sends a row for the same tokens, in the
same order, so the statistics read the newest T tokens of every span, T the fewest any span holds: a
token lost in transit from one stage only shifts which tokens those are. Until the spans cover every
layer (one stage heard, not the other), the window holds no whole token and the verdict is withheld.
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
        self.layers = 0  # the model's
        self._spans: dict[int, tuple[int, SlidingWindow]] = {}  # first layer -> (layers, their window)
        self._resets = 0  # layer-count changes, folded into `version`

    @property
    def version(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """Changes whenever the contents change (for caching the statistics)."""
        return self._resets, tuple((first, window.version) for first, (_, window) in sorted(self._spans.items()))

    @property
    def tokens(self) -> int:
        """Whole tokens (rows of every layer) in the window."""
        if not self._covered():
            return 0
        return min(len(window) // width for width, window in self._spans.values())

    def add(
        self,
        entropies: np.ndarray,
        skipped: np.ndarray,
        threshold: float,
        now: float,
        model_name: str = "",
        first_layer: int = 0,
        model_layers: int | None = None,
    ) -> None:
        """entropies float32 [rows, layers], skipped bool [rows, layers], the frame's τ; the columns are the
        model's layers first_layer.. of `model_layers` (None: the frame's own count, a whole frame)."""
        width = entropies.shape[1]
        model_layers = width if model_layers is None else model_layers
        if model_layers != self.layers:
            if self.layers:
                log.warning(
                    "model %r: frames now have %d layers instead of %d; the routing window starts over",
                    model_name,
                    model_layers,
                    self.layers,
                )
            self._spans.clear()
            self.layers = model_layers
            self._resets += 1
        span = self._spans.get(first_layer)
        if span is None or span[0] != width:
            for first, (other, _) in list(self._spans.items()):  # a span the new one overlaps is gone
                if first < first_layer + width and first_layer < first + other:
                    del self._spans[first]
            tokens = max(1, self.max_observations // model_layers)
            window = SlidingWindow(tokens * width, self.max_age_seconds, dtype=np.uint8)
            span = self._spans[first_layer] = (width, window)
        codes = below_threshold(entropies, threshold).astype(np.uint8)
        codes |= np.asarray(skipped, dtype=np.uint8) * np.uint8(_SKIPPED)
        span[1].add(codes, now)

    def expire(self, now: float) -> None:
        for _, window in self._spans.values():
            window.expire(now)

    def counts(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(tokens, below-τ count per layer, skip count per layer) over the window."""
        tokens = self.tokens
        below = np.zeros(self.layers, dtype=np.int64)
        skipped = np.zeros(self.layers, dtype=np.int64)
        if tokens == 0:
            return 0, below, skipped
        for first, (width, window) in self._spans.items():
            codes = window.values().reshape(-1, width)[-tokens:]
            below[first : first + width] = np.count_nonzero(codes & _BELOW, axis=0)
            skipped[first : first + width] = np.count_nonzero(codes & _SKIPPED, axis=0)
        return tokens, below, skipped

    def statistics(self, min_tokens: int = DEFAULT_MIN_ROUTING_TOKENS) -> Routing:
        return check_routing(*self.counts(), min_tokens=min_tokens)

    def _covered(self) -> bool:
        """The spans tile the model's layers."""
        end = 0
        for first, (width, _) in sorted(self._spans.items()):
            if first != end:
                return False
            end += width
        return bool(self._spans) and end == self.layers
