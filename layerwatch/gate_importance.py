"""The gate-importance correlation: within each layer, do the gates rank tokens like the layer's updates?

The shadow check's full-depth pass measures, per decode-step position and layer, the layer's
relative residual update ||dh||/||h|| and its gate score (`layerwatch.inference_shim.runtime.agreement.LayerSignals`).
`LayerSignalStats` folds those passes in:

- per layer, counters: measured tokens, sums of the relative update and of the attention KL;
- per layer, a ring buffer of the last GATE_LAYER_SAMPLES (gate score, relative update) pairs. A pair
  is the gate's score at one position and the update at the next position of the same pass: the
  token that score decides, since the skip policy decides a token from the scores of the tokens
  before it (layerwatch/inference_shim/runtime/skip_policy.py), and gate training scales a token's update by
  the earlier tokens' scores (layerwatch/inference_shim/offline/gate_training.py);
- per layer, Spearman's rank correlation over its buffer, once full, for a layer whose gate scores
  vary there (standard deviation at least MIN_GATE_SCORE_STD): `layer_correlation`;
- the headline, `correlation`: the mean of those per-layer correlations (each over a full buffer,
  so it is also their sample-weighted mean), None while no layer has one;
- `layer_order_correlation`: Spearman's correlation, across the layers with a full buffer, of the
  layer's mean gate score and mean update (does the gate bank rank the layers like their updates?).

Why within each layer: a correlation over pooled (token, layer) pairs is dominated by *which
layers* score low, so gates that rank each layer's tokens at random but keep the layers' levels
(their between-layer ordering) kept it at its healthy value. Why the gates that barely vary are
left out: a gate that scores every token alike makes the same decision for each (protected and
always-skipped layers), and the ranks of its tiny variations are noise. docs/service.md ("Layer
signals") has the measurements behind each choice.

Torch-free, so that the shim's gauges (layerwatch/inference_shim/service/layer_signals.py) and `layerwatch
calibrate` (which sets the profile's floors from the values they take on a healthy baseline,
layerwatch/inference_shim/offline/calibration.py) run the same code.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from layerwatch.catalog import GATE_LAYER_SAMPLES, MIN_GATE_SCORE_STD


class LayerSignalArrays(Protocol):
    """One shadow pass's signals, [G, L] per position and layer (inference_shim.runtime.agreement.LayerSignals)."""

    @property
    def relative_update(self) -> np.ndarray: ...

    @property
    def attention_kl(self) -> np.ndarray: ...

    @property
    def gate_score(self) -> np.ndarray | None: ...


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 of `values`, ties sharing their average rank."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))  # rank of each distinct value's first copy
    return (first + (counts - 1) / 2.0)[inverse]


def average_ranks_rows(values: np.ndarray) -> np.ndarray:
    """`average_ranks` of each row of a 2-D array, in one sort (any sort: tied values share one rank)."""
    values = np.asarray(values, dtype=np.float64)
    rows, n = values.shape
    order = np.argsort(values, axis=1)
    ordered = np.take_along_axis(values, order, axis=1)
    # A tie group starts at every row start and wherever the sorted value changes.
    starts = np.ones((rows, n), dtype=bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    flat_starts = np.flatnonzero(starts)
    sizes = np.diff(np.append(flat_starts, rows * n))
    first_rank = flat_starts % n  # a group never crosses a row: every row start is a group start
    ranks_in_order = np.repeat(first_rank + (sizes - 1) / 2.0, sizes).reshape(rows, n)
    ranks = np.empty_like(ranks_in_order)
    np.put_along_axis(ranks, order, ranks_in_order, axis=1)
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (Pearson on average ranks), in [-1, 1].

    0 when either side has a single value (e.g. gates that score every token alike carry no rank
    information); NaN for fewer than two samples.
    """
    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"x and y differ in size: {x.size} vs {y.size}")
    return float(spearman_rows(x[None], y[None])[0])


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's rank correlation of each row of x with the same row of y: [R, n] -> [R].

    Per row as `spearman`: 0 where either side is constant, NaN for fewer than two columns.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or x.shape != y.shape:
        raise ValueError(f"x and y must be 2-D arrays of one shape, got {x.shape} and {y.shape}")
    if x.shape[1] < 2:
        return np.full(x.shape[0], math.nan)
    rx, ry = average_ranks_rows(x), average_ranks_rows(y)
    rx -= rx.mean(axis=1, keepdims=True)
    ry -= ry.mean(axis=1, keepdims=True)
    denominator = np.sqrt((rx * rx).sum(axis=1) * (ry * ry).sum(axis=1))
    numerator = (rx * ry).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        correlation = np.where(denominator > 0, numerator / denominator, 0.0)
    return np.clip(correlation, -1.0, 1.0)


@dataclass(frozen=True)
class LayerSignalSnapshot:
    tokens: np.ndarray  # int64 [L]: measured tokens per layer
    relative_update_sum: np.ndarray  # float64 [L]
    attention_kl_sum: np.ndarray  # float64 [L]
    layer_samples: np.ndarray  # int64 [L]: (gate, next update) pairs in each layer's buffer
    layer_correlation: np.ndarray  # float64 [L]: NaN until the buffer is full, and for a gate that barely varies
    correlation: float | None  # the headline: mean of the finite layer correlations; None without any
    layer_order_correlation: float | None  # across the layers with a full buffer; None with fewer than two

    @property
    def samples(self) -> int:
        """Pairs held over all layers (what the shadow check has measured of the gates, up to L x the buffer)."""
        return int(self.layer_samples.sum())

    @property
    def counted_layers(self) -> int:
        """Layers behind the headline."""
        return int(np.isfinite(self.layer_correlation).sum())


class LayerSignalStats:
    """Per-layer sums since start and per-layer ring buffers of the last `reservoir` (gate, next
    update) pairs.

    `observe` is called from the engine thread, `snapshot` from a scrape; a lock guards both, and the
    correlations are computed outside it, once per new pass (cached by version).
    """

    def __init__(self, num_layers: int, reservoir: int = GATE_LAYER_SAMPLES) -> None:
        if reservoir < 2:
            raise ValueError(f"the reservoir must hold at least 2 samples per layer, got {reservoir}")
        self.num_layers = num_layers
        self.reservoir = reservoir
        self._lock = threading.Lock()
        self._tokens = np.zeros(num_layers, dtype=np.int64)
        self._update_sum = np.zeros(num_layers, dtype=np.float64)
        self._kl_sum = np.zeros(num_layers, dtype=np.float64)
        self._gates = np.zeros((num_layers, reservoir), dtype=np.float64)
        self._updates = np.zeros((num_layers, reservoir), dtype=np.float64)
        self._filled = np.zeros(num_layers, dtype=np.int64)  # pairs held per layer, up to `reservoir`
        self._next = np.zeros(num_layers, dtype=np.int64)  # where each layer's next pair goes
        self._version = 0  # bumped by every observe; the correlations are cached per version
        self._cached: tuple[int, np.ndarray, float | None, float | None] | None = None

    def observe(self, signals: LayerSignalArrays) -> None:
        """One shadow pass: [G, L] arrays, positions in order. Non-finite values (a broken model) are left out."""
        update = np.asarray(signals.relative_update, dtype=np.float64)
        kl = np.asarray(signals.attention_kl, dtype=np.float64)
        if update.ndim != 2 or update.shape[1] != self.num_layers or kl.shape != update.shape:
            raise ValueError(f"layer signals of shape {update.shape} / {kl.shape} for {self.num_layers} layers")
        finite = np.isfinite(update) & np.isfinite(kl)
        pairs = None
        if signals.gate_score is not None:
            gate = np.asarray(signals.gate_score, dtype=np.float64)
            if gate.shape != update.shape:
                raise ValueError(f"gate scores of shape {gate.shape} for updates of shape {update.shape}")
            # Position i's score with position i + 1's update: the token that score decides.
            scores, decided = gate[:-1], update[1:]
            pairs = (scores, decided, np.isfinite(scores) & finite[1:])
        with self._lock:
            self._tokens += finite.sum(axis=0)
            self._update_sum += np.where(finite, update, 0.0).sum(axis=0)
            self._kl_sum += np.where(finite, kl, 0.0).sum(axis=0)
            if pairs is not None:
                self._push(*pairs)
            self._version += 1

    def _push(self, scores: np.ndarray, decided: np.ndarray, keep: np.ndarray) -> None:
        for layer in range(self.num_layers):
            kept = keep[:, layer]
            gates, updates = scores[kept, layer], decided[kept, layer]
            n = len(gates)
            if n >= self.reservoir:  # only the last `reservoir` pairs matter
                gates, updates, n = gates[-self.reservoir :], updates[-self.reservoir :], self.reservoir
            slots = (self._next[layer] + np.arange(n)) % self.reservoir
            self._gates[layer, slots], self._updates[layer, slots] = gates, updates
            self._next[layer] = (self._next[layer] + n) % self.reservoir
            self._filled[layer] = min(self.reservoir, self._filled[layer] + n)

    def snapshot(self) -> LayerSignalSnapshot:
        with self._lock:
            version, filled = self._version, self._filled.copy()
            tokens, update_sum, kl_sum = self._tokens.copy(), self._update_sum.copy(), self._kl_sum.copy()
            cached = self._cached
            stale = cached is None or cached[0] != version
            full = filled == self.reservoir
            # Copied only when stale: sorted outside the lock, so the engine thread never waits for it.
            gates, updates = (self._gates[full].copy(), self._updates[full].copy()) if stale else (None, None)
        if gates is not None and updates is not None:
            cached = (version, *_correlations(full, gates, updates))
            self._cached = cached
        assert cached is not None
        _, layer_correlation, correlation, order = cached
        return LayerSignalSnapshot(tokens, update_sum, kl_sum, filled, layer_correlation, correlation, order)


def _correlations(
    full: np.ndarray, gates: np.ndarray, updates: np.ndarray
) -> tuple[np.ndarray, float | None, float | None]:
    """Per-layer correlations [L] (NaN where not measured), the headline and the between-layer
    ordering, from the buffers of the `full` layers."""
    layer_correlation = np.full(len(full), math.nan)
    if not full.any():
        return layer_correlation, None, None
    varying = gates.std(axis=1) >= MIN_GATE_SCORE_STD
    measured = np.flatnonzero(full)[varying]
    layer_correlation[measured] = spearman_rows(gates[varying], updates[varying])
    correlation = float(layer_correlation[measured].mean()) if measured.size else None
    order = spearman(gates.mean(axis=1), updates.mean(axis=1)) if len(gates) >= 2 else None
    return layer_correlation, correlation, order
