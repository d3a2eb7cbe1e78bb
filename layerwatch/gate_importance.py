"""The gate-importance correlation: do the gates still rank (token, layer) pairs like their layers' updates?

The shadow check's full-depth pass measures, per decode-step position and layer, the layer's
relative residual update ||dh||/||h|| and its gate score on the same token
(`inference_shim.runtime.agreement.LayerSignals`). `LayerSignalStats` folds those passes in: per-layer
counters, and a ring buffer of the last GATE_IMPORTANCE_SAMPLES (gate score, relative update) pairs
whose Spearman rank correlation is `layerwatch_gate_importance_correlation` (absent until the buffer
is full). Healthy gates score high where the layer changes the residual stream a lot; gates that
were swapped, shuffled or trained for another model do not.

Torch-free, so that the shim's gauge (inference_shim/service/layer_signals.py exposes it) and
`layerwatch calibrate` (which sets the profile's floor from the values the gauge takes on a healthy
baseline, inference_shim/offline/calibration.py) run the same code.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from layerwatch.catalog import GATE_IMPORTANCE_SAMPLES


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


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (Pearson on average ranks), in [-1, 1].

    0 when either side has a single value (e.g. gates that score every token alike carry no rank
    information); NaN for fewer than two samples.
    """
    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"x and y differ in size: {x.size} vs {y.size}")
    if x.size < 2:
        return math.nan
    rx, ry = average_ranks(x), average_ranks(y)
    rx -= rx.mean()
    ry -= ry.mean()
    denominator = math.sqrt(float(rx @ rx) * float(ry @ ry))
    if denominator == 0.0:
        return 0.0
    return max(-1.0, min(1.0, float(rx @ ry) / denominator))


@dataclass(frozen=True)
class LayerSignalSnapshot:
    tokens: np.ndarray  # int64 [L]: measured tokens per layer
    relative_update_sum: np.ndarray  # float64 [L]
    attention_kl_sum: np.ndarray  # float64 [L]
    correlation: float | None  # None until the reservoir is full
    samples: int  # (token, layer) pairs in the reservoir


class LayerSignalStats:
    """Per-layer sums since start and a ring buffer of the last `reservoir` (gate, update) pairs.

    `observe` is called from the engine thread, `snapshot` from a scrape; a lock guards both.
    """

    def __init__(self, num_layers: int, reservoir: int = GATE_IMPORTANCE_SAMPLES) -> None:
        if reservoir < 2:
            raise ValueError(f"the reservoir must hold at least 2 samples, got {reservoir}")
        self.num_layers = num_layers
        self.reservoir = reservoir
        self._lock = threading.Lock()
        self._tokens = np.zeros(num_layers, dtype=np.int64)
        self._update_sum = np.zeros(num_layers, dtype=np.float64)
        self._kl_sum = np.zeros(num_layers, dtype=np.float64)
        self._gates = np.zeros(reservoir, dtype=np.float64)
        self._updates = np.zeros(reservoir, dtype=np.float64)
        self._filled = 0  # pairs held, up to `reservoir`
        self._next = 0  # where the next pair goes
        self._version = 0  # bumped by every observe; the correlation is cached per version
        self._cached: tuple[int, float | None] = (-1, None)

    def observe(self, signals: LayerSignalArrays) -> None:
        """One shadow pass: [G, L] arrays. Non-finite values (a broken model) are left out."""
        update = np.asarray(signals.relative_update, dtype=np.float64)
        kl = np.asarray(signals.attention_kl, dtype=np.float64)
        if update.ndim != 2 or update.shape[1] != self.num_layers or kl.shape != update.shape:
            raise ValueError(f"layer signals of shape {update.shape} / {kl.shape} for {self.num_layers} layers")
        finite = np.isfinite(update) & np.isfinite(kl)
        pairs = None
        if signals.gate_score is not None:
            gate = np.asarray(signals.gate_score, dtype=np.float64)
            paired = finite & np.isfinite(gate)
            pairs = (gate[paired], update[paired])  # row-major: token by token, layers in order
        with self._lock:
            self._tokens += finite.sum(axis=0)
            self._update_sum += np.where(finite, update, 0.0).sum(axis=0)
            self._kl_sum += np.where(finite, kl, 0.0).sum(axis=0)
            if pairs is not None:
                self._push(*pairs)
            self._version += 1

    def _push(self, gates: np.ndarray, updates: np.ndarray) -> None:
        n = len(gates)
        if n >= self.reservoir:  # only the last `reservoir` pairs matter
            gates, updates, n = gates[-self.reservoir :], updates[-self.reservoir :], self.reservoir
        end = self._next + n
        if end <= self.reservoir:
            self._gates[self._next : end], self._updates[self._next : end] = gates, updates
        else:
            split = self.reservoir - self._next
            self._gates[self._next :], self._updates[self._next :] = gates[:split], updates[:split]
            self._gates[: n - split], self._updates[: n - split] = gates[split:], updates[split:]
        self._next = end % self.reservoir
        self._filled = min(self.reservoir, self._filled + n)

    def snapshot(self) -> LayerSignalSnapshot:
        with self._lock:
            version, filled = self._version, self._filled
            tokens, update_sum, kl_sum = self._tokens.copy(), self._update_sum.copy(), self._kl_sum.copy()
            cached_version, correlation = self._cached
            stale = filled == self.reservoir and cached_version != version
            gates, updates = (self._gates.copy(), self._updates.copy()) if stale else (None, None)
        if filled < self.reservoir:
            correlation = None
        elif gates is not None and updates is not None:  # stale: sorted outside the lock, so the
            correlation = spearman(gates, updates)  # engine thread never waits for it
            self._cached = (version, correlation)
        return LayerSignalSnapshot(tokens, update_sum, kl_sum, correlation, filled)
