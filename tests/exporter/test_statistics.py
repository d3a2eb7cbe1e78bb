"""The bimodality verdict on reference distributions, and the pieces it is built from."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from layerwatch.statistics import (
    EntropyTotals,
    LayerTotals,
    bimodality_coefficient,
    bin_index,
    check_bimodality,
    count_peaks,
    histogram20,
    le_bucket_index,
    shape_distance,
)

N = 20_000
MIN_WINDOW = 1_000


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _clip(values: np.ndarray) -> np.ndarray:
    return np.clip(values, 0, 1).astype(np.float32)


def two_humps(seed: int, low_share: float = 0.6, spread: float = 0.03) -> np.ndarray:
    rng = _rng(seed)
    low = rng.random(N) < low_share
    return _clip(np.where(low, rng.normal(0.1, spread, N), rng.normal(0.3, spread, N)))


BIMODAL = {
    "humps at 0.1 and 0.3 (60/40)": two_humps(1),
    "humps at 0.1 and 0.3 (50/50, wider)": two_humps(2, 0.5, 0.045),
    "humps at 0.1 and 0.3 (80/20)": two_humps(3, 0.8),
    "zero-entropy pile and a hump at 0.3": _clip(np.where(_rng(4).random(N) < 0.2, 0.0, _rng(5).normal(0.3, 0.05, N))),
}

SINGLE_PEAK = {
    "normal": _clip(_rng(10).normal(0.5, 0.1, N)),
    "wide normal": _clip(_rng(11).normal(0.4, 0.2, N)),
    "lognormal": _clip(_rng(12).lognormal(math.log(0.2), 0.5, N)),
    "uniform": _clip(_rng(13).random(N)),
    "all zeros": np.zeros(N, np.float32),
    "all ones": np.ones(N, np.float32),
    **{
        f"hump at {centre:.2f}": _clip(_rng(20 + i).normal(centre, 0.04, N))
        for i, centre in enumerate(np.linspace(0.0, 1.0, 11))
    },
}


@pytest.mark.parametrize("name", BIMODAL)
def test_two_humps_are_bimodal(name: str) -> None:
    result = check_bimodality(BIMODAL[name], MIN_WINDOW)
    assert result.bimodal is True, result
    assert result.peaks >= 2 and result.dip_p_value < 0.05


@pytest.mark.parametrize("name", SINGLE_PEAK)
def test_single_peaks_are_not_bimodal(name: str) -> None:
    result = check_bimodality(SINGLE_PEAK[name], MIN_WINDOW)
    assert result.bimodal is False, result
    assert result.observations == N


@pytest.mark.parametrize("n", [MIN_WINDOW, 5 * MIN_WINDOW])
def test_uniform_noise_never_makes_two_peaks_across_seeds(n: int) -> None:
    # The uniform is the dip test's least favourable null (p ~ U(0, 1)): the peak rule must hold.
    verdicts = [check_bimodality(_clip(_rng(seed).random(n)), MIN_WINDOW) for seed in range(100, 140)]
    assert not any(v.bimodal for v in verdicts)


def test_the_verdict_is_withheld_below_the_minimum_window() -> None:
    result = check_bimodality(two_humps(1)[: MIN_WINDOW - 1], MIN_WINDOW)
    assert result.withheld and result.bimodal is None
    assert result.observations == MIN_WINDOW - 1
    assert (result.dip, result.bimodality_coefficient, result.peaks) == (None, None, None)
    assert check_bimodality(two_humps(1)[:MIN_WINDOW], MIN_WINDOW).bimodal is True


def test_shape_distance_is_the_kolmogorov_smirnov_distance_of_the_binned_distributions() -> None:
    """A healthy shape of one hump (SmolLM2's kind) has no second peak to lose: the shape alert reads how far
    a window's distribution lies from the recorded one. Two samples of one shape lie close, a shifted hump or
    a collapse to one spike far; on binned data the distance is scipy's two-sample KS statistic evaluated
    at the bin edges, which for values off the edges equals the largest gap of the empirical CDFs there."""
    healthy = histogram20(SINGLE_PEAK["lognormal"])
    assert shape_distance(healthy, healthy) == 0.0
    again = histogram20(_clip(_rng(40).lognormal(math.log(0.2), 0.5, N)))
    assert shape_distance(again, healthy) < 0.02
    # The same 20,000 values: counts or shares, either way round.
    assert shape_distance(healthy / healthy.sum(), healthy) == pytest.approx(0.0, abs=1e-12)
    shifted = SINGLE_PEAK["hump at 0.50"]
    edges = np.arange(1, 20) / 20
    expected = np.abs(
        np.searchsorted(np.sort(shifted), edges, side="left") / N
        - np.searchsorted(np.sort(SINGLE_PEAK["lognormal"]), edges, side="left") / N
    ).max()
    assert shape_distance(histogram20(shifted), healthy) == pytest.approx(expected)
    assert expected > 0.9
    # Every entropy in one bin that held none of the healthy mass: disjoint.
    assert shape_distance(histogram20(SINGLE_PEAK["all ones"]), histogram20(SINGLE_PEAK["all zeros"])) == 1.0
    # A collapse onto the healthy mode still moves most of the mass below and above it.
    collapsed = histogram20(_clip(_rng(41).normal(0.2, 0.005, N)))
    assert shape_distance(collapsed, healthy) > 0.25


def test_bimodality_coefficient_matches_sarles_formula_and_the_brief() -> None:
    values = SINGLE_PEAK["lognormal"].astype(np.float64)
    n = len(values)
    g1, g2 = stats.skew(values, bias=False), stats.kurtosis(values, bias=False)
    expected = (g1**2 + 1) / (g2 + 3 * (n - 1) ** 2 / ((n - 2) * (n - 3)))
    assert bimodality_coefficient(values) == pytest.approx(expected, rel=1e-9)
    # docs/exporter.md: mixture 0.77, normal 0.34 (the theoretical normal value is 1/3), uniform 0.55.
    assert bimodality_coefficient(two_humps(1)) == pytest.approx(0.77, abs=0.02)
    assert bimodality_coefficient(SINGLE_PEAK["normal"]) == pytest.approx(0.335, abs=0.02)
    assert bimodality_coefficient(SINGLE_PEAK["uniform"]) == pytest.approx(0.555, abs=0.02)
    assert math.isnan(bimodality_coefficient(np.zeros(100)))


@pytest.mark.parametrize(
    "histogram, peaks",
    [
        ([0] * 20, 0),
        ([100] + [0] * 19, 1),  # all zeros
        ([0] * 19 + [100], 1),  # all ones
        ([50] * 20, 1),  # flat top counts once
        ([0, 30, 30, 0, 0, 0, 20, 20, 0] + [0] * 11, 2),  # flat-topped humps
        ([0, 40, 10, 30, 0] + [0] * 15, 2),  # valley 10 ≤ half of 30
        ([0, 40, 20, 30, 0] + [0] * 15, 1),  # valley 20 > half of 30: a shoulder, not a peak
        ([0, 40, 10, 40, 0] + [0] * 15, 2),  # equal peaks with a deep valley
        ([0, 40, 39, 40, 0] + [0] * 15, 1),  # equal peaks with a shallow valley: one hump
        ([0, 97, 0, 2] + [0] * 16, 1),  # a second peak below the minimum height is noise
        ([0, 94, 0, 3, 0, 3] + [0] * 14, 3),  # at the minimum height
    ],
)
def test_count_peaks(histogram: list[int], peaks: int) -> None:
    assert count_peaks(np.asarray(histogram)) == peaks


def test_binnings_differ_only_on_edges() -> None:
    values = np.array([0.0, 0.05, 0.0999, 0.25, 0.5, 0.75, 0.9999, 1.0], dtype=np.float32)
    # Prometheus: value <= le. float32(0.05) is slightly above 0.05, so it is not in le=0.05.
    assert le_bucket_index(values).tolist() == [0, 1, 1, 4, 9, 14, 19, 19]
    # replay's bins (docs/interfaces.md): left-closed, the last one closed: 0.25 starts bin 5.
    assert bin_index(values).tolist() == [0, 1, 1, 5, 10, 15, 19, 19]
    assert histogram20(values).sum() == len(values)


def test_entropy_totals_per_decision() -> None:
    entropies = np.array([0.005, 0.09, 0.3, 0.95, 1.0], dtype=np.float32)
    skipped = np.array([True, True, False, False, False])
    totals = EntropyTotals()
    totals.add(entropies, skipped, le_bucket_index(entropies))
    totals.add(entropies, skipped, le_bucket_index(entropies))
    assert totals.counts.tolist() == [6, 4]
    assert totals.buckets[1].tolist() == [2, 2] + [0] * 18
    assert totals.sums == pytest.approx([2 * (0.3 + 0.95 + 1.0), 2 * (0.005 + 0.09)], rel=1e-6)
    assert totals.squares[0] == pytest.approx(2 * (0.09 + 0.9025 + 1.0), rel=1e-6)
    assert totals.zeros.tolist() == [0, 2]
    summary = totals.summary()
    assert summary["mean"] == pytest.approx(np.mean(entropies.astype(float)), rel=1e-6)
    assert summary["std"] == pytest.approx(np.std(entropies.astype(float)), rel=1e-5)
    assert summary["zero_ratio"] == pytest.approx(0.2) and summary["skip_ratio"] == pytest.approx(0.4)
    assert EntropyTotals().summary()["mean"] is None


def test_layer_totals_grow_with_the_layer_count() -> None:
    layers = LayerTotals(with_buckets=True)
    small = np.array([[0.1, 0.9]], dtype=np.float32)
    wide = np.array([[0.2, 0.2, 0.6], [0.4, 0.4, 0.6]], dtype=np.float32)
    layers.add(small, le_bucket_index(small), np.array([[True, False]]))
    layers.add(wide, le_bucket_index(wide), np.array([[True, True, False], [False, True, True]]))
    assert layers.counts.tolist() == [3, 3, 2]
    assert layers.skips.tolist() == [2, 2, 1]
    assert layers.sums == pytest.approx([0.7, 1.5, 1.2], rel=1e-6)
    assert layers.buckets[2, le_bucket_index(np.float32(0.6))] == 2
    assert layers.buckets.sum() == 8
    assert LayerTotals(with_buckets=False).buckets is None
