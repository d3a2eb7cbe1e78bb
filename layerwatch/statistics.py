"""The entropy statistics, shared by the live exporter and `layerwatch replay`.

Two binnings of [0, 1] into 20 bins of width 0.05 exist, on purpose:
- Prometheus buckets are cumulative `x <= le` (le = 0.05 … 1.0), so the exported histogram puts a
  value that sits exactly on an edge into the lower bucket (`le_bucket_index`);
- the 20-bin histogram (replay's `histogram`, docs/interfaces.md; the window's peak count) is left-closed:
  [0, 0.05), [0.05, 0.10) … [0.95, 1.0] (`bin_index`).
They differ only for values exactly on an edge that float32 can represent (0.25, 0.5, 0.75).

The bimodality verdict (docs/exporter.md explains the choice of thresholds):
    bimodal  ⇔  peaks ≥ 2  and  Hartigan's dip test p-value < DIP_ALPHA
on the sliding window's raw values, withheld while the window holds fewer than the minimum.
Sarle's bimodality coefficient is reported but does not vote: flat and skewed single-hump shapes
sit near its 5/9 line.

The window's shape against a recorded healthy one (`shape_distance`): the largest gap between their
cumulative shares below the 20-bin edges 0.05 … 0.95, the Kolmogorov-Smirnov distance of the two
binned distributions (0: the same shape, 1: disjoint). A model whose healthy scores have one hump
is judged by it rather than by the bimodality verdict (docs/alerting.md, "The entropy shape").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import diptest
import numpy as np

from layerwatch.catalog import ENTROPY_BUCKETS, ZERO_ENTROPY_LIMIT

BINS = len(ENTROPY_BUCKETS)
_UPPER_EDGES = np.asarray(ENTROPY_BUCKETS, dtype=np.float64)

RUN, SKIP = 0, 1  # decision index in the per-decision arrays
DECISIONS = ("run", "skip")

# A histogram peak must hold at least this share of the window: smaller blips are noise.
MIN_PEAK_FRACTION = 0.03
# ... and the valley between it and any peak at least as tall must fall to at most half its height.
VALLEY_DEPTH = 0.5
# The dip test must reject unimodality at this level.
DIP_ALPHA = 0.05
# diptest's p-value table is valid up to n ≈ 72,000 (docs/exporter.md): a larger window gets wrong p-values.
MAX_WINDOW_OBSERVATIONS = 72_000
# The exporter's window: at most this many entropies per model, a verdict only from this many on.
DEFAULT_WINDOW_OBSERVATIONS = 50_000
DEFAULT_MIN_WINDOW_OBSERVATIONS = 1_000


def le_bucket_index(entropies: np.ndarray) -> np.ndarray:
    """Prometheus bucket of each value: the first `le` with value <= le (0..19)."""
    return np.searchsorted(_UPPER_EDGES, entropies, side="left")


def bin_index(entropies: np.ndarray) -> np.ndarray:
    """Replay's bin of each value (docs/interfaces.md): [0, 0.05) → 0 … [0.95, 1.0] → 19."""
    return np.minimum(np.searchsorted(_UPPER_EDGES, entropies, side="right"), BINS - 1)


def histogram20(entropies: np.ndarray) -> np.ndarray:
    return np.bincount(bin_index(entropies.ravel()), minlength=BINS)


class EntropyTotals:
    """Running totals per decision (run, skip): Prometheus buckets, Σx, Σx², zero-entropy count."""

    def __init__(self) -> None:
        self.buckets = np.zeros((2, BINS), dtype=np.int64)  # not cumulative; index = le_bucket_index
        self.sums = np.zeros(2)
        self.squares = np.zeros(2)
        self.zeros = np.zeros(2, dtype=np.int64)

    def add(self, entropies: np.ndarray, skipped: np.ndarray, buckets: np.ndarray) -> None:
        """Flat arrays of equal length; `buckets` = le_bucket_index(entropies), computed once by the caller."""
        decision = skipped.view(np.uint8)
        values = entropies.astype(np.float64)
        self.buckets += np.bincount(decision * BINS + buckets, minlength=2 * BINS).reshape(2, BINS)
        self.sums += np.bincount(decision, weights=values, minlength=2)
        self.squares += np.bincount(decision, weights=values * values, minlength=2)
        self.zeros += np.bincount(decision[entropies < ZERO_ENTROPY_LIMIT], minlength=2)

    @property
    def counts(self) -> np.ndarray:
        return self.buckets.sum(axis=1)

    def summary(self) -> dict[str, float | None]:
        """mean, std, zero_ratio and skip_ratio over both decisions (None before any observation)."""
        n = int(self.counts.sum())
        if n == 0:
            return {"mean": None, "std": None, "zero_ratio": None, "skip_ratio": None}
        mean = float(self.sums.sum()) / n
        variance = max(0.0, float(self.squares.sum()) / n - mean * mean)
        return {
            "mean": mean,
            "std": math.sqrt(variance),
            "zero_ratio": int(self.zeros.sum()) / n,
            "skip_ratio": int(self.counts[SKIP]) / n,
        }


class LayerTotals:
    """Per-layer Σx, count (evaluations) and skips (always), per-layer Prometheus buckets (only when
    enabled: cardinality)."""

    def __init__(self, with_buckets: bool) -> None:
        self.sums = np.zeros(0)
        self.counts = np.zeros(0, dtype=np.int64)
        self.skips = np.zeros(0, dtype=np.int64)
        self.buckets = np.zeros((0, BINS), dtype=np.int64) if with_buckets else None

    def add(
        self,
        entropies: np.ndarray,
        buckets: np.ndarray,
        skipped: np.ndarray,
        first_layer: int = 0,
        model_layers: int = 0,
    ) -> None:
        """entropies, their le_bucket_index and the skip bits, all [rows, layers], of the model's layers
        first_layer.. of model_layers (a partial frame's, docs/wire-format.md; 0: as many as the frame's)."""
        rows, layers = entropies.shape
        span = slice(first_layer, first_layer + layers)
        if max(span.stop, model_layers) > len(self.sums):
            self._grow(max(span.stop, model_layers))
        self.sums[span] += entropies.sum(axis=0, dtype=np.float64)
        self.counts[span] += rows
        self.skips[span] += np.add.reduce(skipped, axis=0, dtype=np.int64)
        if self.buckets is not None:
            flat = (buckets + np.arange(layers) * BINS).ravel()
            self.buckets[span] += np.bincount(flat, minlength=layers * BINS).reshape(layers, BINS)

    def _grow(self, layers: int) -> None:
        extra = layers - len(self.sums)
        self.sums = np.concatenate((self.sums, np.zeros(extra)))
        self.counts = np.concatenate((self.counts, np.zeros(extra, dtype=np.int64)))
        self.skips = np.concatenate((self.skips, np.zeros(extra, dtype=np.int64)))
        if self.buckets is not None:
            self.buckets = np.concatenate((self.buckets, np.zeros((extra, BINS), dtype=np.int64)))


@dataclass(frozen=True)
class Bimodality:
    """The window's bimodality statistics; all but `observations` are None while withheld."""

    observations: int
    bimodal: bool | None
    bimodality_coefficient: float | None  # NaN when undefined (zero variance)
    dip: float | None
    dip_p_value: float | None
    peaks: int | None
    histogram: tuple[int, ...] | None = None  # the window's 20 bins (histogram20)

    @property
    def withheld(self) -> bool:
        return self.bimodal is None


def check_bimodality(values: np.ndarray, min_observations: int) -> Bimodality:
    """The verdict on a window of raw entropies (see the module docstring for the rule)."""
    n = len(values)
    if n < max(min_observations, 4):  # BC needs n > 3
        return Bimodality(n, None, None, None, None, None)
    dip, p_value = diptest.diptest(values.astype(np.float64))
    histogram = histogram20(values)
    peaks = count_peaks(histogram)
    bimodal = peaks >= 2 and p_value < DIP_ALPHA
    counts = tuple(int(c) for c in histogram)
    return Bimodality(n, bimodal, bimodality_coefficient(values), float(dip), float(p_value), peaks, counts)


def shares_below_edges(histogram: np.ndarray) -> np.ndarray:
    """The share of a 20-bin histogram's values below each inner edge 0.05 … 0.95 (19 values)."""
    counts = np.asarray(histogram, dtype=np.float64)
    return np.cumsum(counts)[:-1] / max(counts.sum(), 1.0)


def shape_distance(histogram: np.ndarray, healthy: np.ndarray) -> float:
    """The Kolmogorov-Smirnov distance between two 20-bin histograms (counts or shares): the largest
    gap between their shares below an edge (see the module docstring)."""
    return float(np.abs(shares_below_edges(histogram) - shares_below_edges(healthy)).max())


def bimodality_coefficient(values: np.ndarray) -> float:
    """Sarle's BC = (g1² + 1) / (g2 + 3(n−1)² / ((n−2)(n−3))), sample skewness g1, excess kurtosis g2."""
    n = len(values)
    x = values.astype(np.float64)
    d = x - x.mean()
    d2 = d * d
    m2 = d2.mean()
    if m2 < 1e-12:  # constant window: skewness and kurtosis are undefined
        return math.nan
    m3 = (d2 * d).mean()
    m4 = (d2 * d2).mean()
    g1 = m3 / m2**1.5 * math.sqrt(n * (n - 1)) / (n - 2)
    g2 = ((n + 1) * (m4 / m2**2 - 3) + 6) * (n - 1) / ((n - 2) * (n - 3))
    return (g1 * g1 + 1) / (g2 + 3 * (n - 1) ** 2 / ((n - 2) * (n - 3)))


def count_peaks(histogram: np.ndarray) -> int:
    """Peaks of a 20-bin histogram with a minimum height and a valley-depth rule.

    A peak is a local maximum (a flat top counts once) holding at least MIN_PEAK_FRACTION of the
    total. Besides the tallest, a peak counts only if, on its way to every peak at least as tall
    (or to the border), the histogram falls to at most (1 − VALLEY_DEPTH) × its height: its
    prominence is at least VALLEY_DEPTH × its height. Without these rules noise makes peaks.
    """
    total = histogram.sum()
    if total == 0:
        return 0
    # Zero padding lets the first and last bins be peaks (all-zero or all-one windows).
    h = np.concatenate(([0.0], histogram / total, [0.0])).tolist()
    tallest = h.index(max(h))
    peaks = 0
    start = 1
    while start < len(h) - 1:
        end = start
        while end + 1 < len(h) - 1 and h[end + 1] == h[start]:
            end += 1  # a flat top spans start..end
        height = h[start]
        is_local_maximum = h[start - 1] < height > h[end + 1] and height >= MIN_PEAK_FRACTION
        if is_local_maximum and (start <= tallest <= end or _prominence(h, start, end) >= VALLEY_DEPTH * height):
            peaks += 1
        start = end + 1
    return peaks


def _prominence(h: list[float], start: int, end: int) -> float:
    """Height above the higher of the two valleys towards the nearest peak at least as tall."""
    height = h[start]
    left_low = right_low = height
    i = start - 1
    while i >= 0 and h[i] < height:
        left_low = min(left_low, h[i])
        i -= 1
    i = end + 1
    while i < len(h) and h[i] < height:
        right_low = min(right_low, h[i])
        i += 1
    return height - max(left_low, right_low)


def report(model_name: str, totals: EntropyTotals, histogram: np.ndarray, bimodality: Bimodality) -> dict[str, object]:
    """The per-model keys of docs/interfaces.md, as printed by `layerwatch replay --json`."""
    bc = bimodality.bimodality_coefficient
    return {
        "model_name": model_name,
        "observations": int(totals.counts.sum()),
        "histogram": [int(c) for c in histogram],
        **totals.summary(),
        "bimodal": bimodality.bimodal,
        "verdict": verdict_word(bimodality),
        "bimodality_coefficient": None if bc is None or math.isnan(bc) else bc,
        "dip": bimodality.dip,
        "dip_p_value": bimodality.dip_p_value,
        "peaks": bimodality.peaks,
        "window_observations": bimodality.observations,
    }


def verdict_word(bimodality: Bimodality) -> str:
    if bimodality.withheld:
        return "withheld"
    return "bimodal" if bimodality.bimodal else "single-peak"
