"""The exporter's state: ingest accounting, sequence gaps, model limit, the statistics cache."""

from __future__ import annotations

import numpy as np
import pytest

from exporter.state import ExporterConfig, ExporterState
from layerwatch.wire import encode_frame

from tests.exporter.support import random_frame


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_state(clock: Clock | None = None, **config: object) -> ExporterState:
    return ExporterState(ExporterConfig(**({"min_window_observations": 10} | config)), clock or Clock())


def by_model(state: ExporterState) -> dict:
    return {s.model_name: s for s in state.snapshot()}


def test_sequence_gaps_count_as_lost_and_a_restart_does_not() -> None:
    state, rng = make_state(), np.random.default_rng(0)
    for shim, sequences in {"a": [0, 1, 2, 5, 6], "b": [10, 12], "c": [7, 8, 0, 1]}.items():
        for sequence in sequences:
            state.ingest(random_frame(rng, sequence, shim=shim))
    demo = by_model(state)["demo"]
    assert demo.frames_received == 11
    assert demo.frames_lost == 2 + 1  # a: 3, 4; b: 11; c restarted at 0


def test_malformed_datagrams_are_counted_and_dropped() -> None:
    state, rng = make_state(), np.random.default_rng(0)
    state.ingest_datagram(b"junk")
    state.ingest_datagram(encode_frame(random_frame(rng, 0))[:-1])
    state.ingest_datagram(encode_frame(random_frame(rng, 1)))
    assert state.frames_malformed == 2
    assert by_model(state)["demo"].frames_received == 1


def test_models_beyond_the_limit_are_rejected() -> None:
    state, rng = make_state(max_models=2), np.random.default_rng(0)
    for sequence, model in enumerate(["a", "b", "c", "a"]):
        state.ingest(random_frame(rng, sequence, model=model))
    assert sorted(by_model(state)) == ["a", "b"]
    assert state.frames_rejected == 1
    assert by_model(state)["a"].frames_received == 2


def test_ingest_feeds_totals_layers_and_window() -> None:
    state, rng = make_state(per_layer=True), np.random.default_rng(0)
    frames = [random_frame(rng, i, rows=3, layers=5) for i in range(4)]
    for frame in frames:
        state.ingest(frame)
    demo = by_model(state)["demo"]
    entropies = np.concatenate([f.entropies for f in frames])
    skipped = np.concatenate([f.skipped for f in frames])
    assert demo.buckets.sum() == entropies.size
    assert demo.buckets[1].sum() == skipped.sum()
    assert demo.layer_counts.tolist() == [12] * 5
    np.testing.assert_allclose(demo.layer_sums, entropies.sum(axis=0, dtype=np.float64))
    assert demo.layer_buckets.sum(axis=1).tolist() == [12] * 5
    assert state.bimodality("demo").observations == entropies.size


def test_bimodality_is_cached_until_the_window_changes_and_the_cache_ages() -> None:
    clock = Clock()
    state, rng = make_state(clock, statistics_cache_seconds=5.0), np.random.default_rng(0)
    state.ingest(random_frame(rng, 0, rows=4, layers=8))
    first = state.bimodality("demo")
    assert first.observations == 32 and not first.withheld
    assert state.bimodality("demo") is first  # unchanged window
    state.ingest(random_frame(rng, 1, rows=4, layers=8))
    clock.now += 1.0
    assert state.bimodality("demo") is first  # changed, but the result is younger than 5 s
    clock.now += 5.0
    assert state.bimodality("demo").observations == 64


def test_the_window_expires_at_scrape_time_without_new_frames() -> None:
    clock = Clock()
    state, rng = make_state(clock, window_seconds=60.0, statistics_cache_seconds=0.0), np.random.default_rng(0)
    state.ingest(random_frame(rng, 0, rows=4, layers=8))
    assert state.bimodality("demo").observations == 32
    clock.now += 61.0
    result = state.bimodality("demo")
    assert result.observations == 0 and result.withheld
    assert by_model(state)["demo"].buckets.sum() == 32  # counters are not windowed


@pytest.mark.parametrize("rows, layers", [(1, 1), (16, 80)])
def test_any_frame_shape_is_accepted(rows: int, layers: int) -> None:
    state = make_state()
    state.ingest(random_frame(np.random.default_rng(0), 0, rows=rows, layers=layers))
    assert by_model(state)["demo"].layer_counts.tolist() == [rows] * layers
