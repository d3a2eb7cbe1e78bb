"""Do the gates still track how much their layer matters? Layer signals from the shadow check.

The shadow check (shadow.py) re-runs sampled greedy requests at full depth in the engine thread.
On that pass the model also measures, for every layer and every decode-step position
(`inference_shim.runtime.agreement.LayerSignals`): the layer's relative residual update
||dh||/||h||, its gate score on the same token, and its attention discreteness (KL from uniform).
`LayerSignalStats.observe` folds one pass in; `LayerSignalsCollector` exposes at scrape time:

  - per layer, counters of measured tokens and sums of the relative update and attention KL:
    counters, so that PromQL's rate(sum) / rate(count) is the mean over any window and sums
    correctly across shims (a per-shim mean gauge cannot be averaged correctly);
  - `layerwatch_gate_importance_correlation`: Spearman's rank correlation between gate score and
    relative update over the last GATE_IMPORTANCE_SAMPLES (token, layer) samples, absent until that
    many were measured. Healthy gates score high where the layer changes the residual stream a
    lot; gates that were swapped, shuffled or trained for another model do not.

Nothing here runs on the decode path: `observe` runs after a shadow job (inside its duty cycle),
the correlation (two sorts of 4096 values, about a millisecond) at scrape time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from prometheus_client.core import Metric

from inference_shim.runtime.agreement import LayerSignals
from inference_shim.service.metrics import ShimCollector, family
from layerwatch.catalog import GATE_IMPORTANCE_SAMPLES


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

    def observe(self, signals: LayerSignals) -> None:
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


class LayerSignalsCollector(ShimCollector):
    """Exposes `LayerSignalStats` at scrape time."""

    metric_names = (
        "layerwatch_layer_signal_tokens_total",
        "layerwatch_layer_relative_update_sum_total",
        "layerwatch_layer_attention_kl_sum_total",
        "layerwatch_gate_importance_correlation",
        "layerwatch_gate_importance_samples",
    )

    def __init__(self, stats: LayerSignalStats, model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name
        self._layers = [str(l) for l in range(stats.num_layers)]

    def collect(self) -> Iterator[Metric]:
        s = self._stats.snapshot()
        m = self._model_name
        for name, values in (
            ("layerwatch_layer_signal_tokens_total", s.tokens.tolist()),
            ("layerwatch_layer_relative_update_sum_total", s.relative_update_sum.tolist()),
            ("layerwatch_layer_attention_kl_sum_total", s.attention_kl_sum.tolist()),
        ):
            counter = family(name)
            for layer, value in zip(self._layers, values):
                counter.add_metric([m, layer], value)
            yield counter
        correlation = family("layerwatch_gate_importance_correlation")
        if s.correlation is not None and math.isfinite(s.correlation):
            correlation.add_metric([m], s.correlation)
        yield correlation
        samples = family("layerwatch_gate_importance_samples")
        samples.add_metric([m], s.samples)
        yield samples
