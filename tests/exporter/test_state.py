"""The exporter's state: ingest accounting, sequence gaps, model limit, the statistics cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from layerwatch.exporter.sequences import (
    MAX_SEQUENCE_GAP,
    MAX_STREAMS_PER_SHIM,
    MAX_TRACKED_SHIMS,
    REORDER_WINDOW,
    SequenceTracker,
)
from layerwatch.exporter.state import ExporterConfig, ExporterState, ModelStatistics
from layerwatch.wire import GateFrame, encode_frame
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


def ingest_sequences(state: ExporterState, frames: list[tuple[str, int]]) -> None:
    rng = np.random.default_rng(0)
    for shim, sequence in frames:
        state.ingest(random_frame(rng, sequence, shim=shim))


def test_two_shims_under_one_id_are_reported_as_interleaved_not_as_lost() -> None:
    # One shim has sent 300 frames when a second starts under the same id; they alternate. A
    # sequence gap per switch (300 -> 0 -> 301 -> 1 ...) used to count ~300 lost frames per frame.
    state = make_state()
    first, second = range(300, 340), range(40)
    ingest_sequences(state, [("a", 299)] + [("a", n) for pair in zip(first, second) for n in pair])
    demo = by_model(state)["demo"]
    assert demo.frames_received == 81
    assert demo.frames_lost == 0
    assert demo.frames_interleaved == 78  # every frame after the second shim's first one switches


def test_two_shims_started_together_under_one_id_are_interleaved() -> None:
    state = make_state()  # lockstep, and one shim's frame 5 lost in transit
    ingest_sequences(state, [("a", n) for n in (0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 6, 7)])
    demo = by_model(state)["demo"]
    assert (demo.frames_lost, demo.frames_interleaved) == (1, 10)  # all but 0, 0, the first 1 and the first 6


def test_a_restart_is_neither_loss_nor_interleaving_even_after_the_new_numbering_overtakes() -> None:
    state = make_state()
    ingest_sequences(state, [("a", n) for n in range(50)] + [("a", n) for n in range(80)])
    demo = by_model(state)["demo"]
    assert (demo.frames_received, demo.frames_lost, demo.frames_interleaved) == (130, 0, 0)


@pytest.mark.parametrize(
    "sequences",
    [
        [0, 1, 2, 3, 4, 6, 5, 7, 8],  # one datagram overtaken by the next
        [0, 1, 2, 7, 3, 4, 5, 6, 8],  # four
        [0, 1, 2, 5, 4, 3, 6],  # two, arriving in reverse
    ],
)
def test_reordered_frames_are_late_neither_lost_nor_interleaved(sequences: list[int]) -> None:
    # 6 before 5 used to count 5 as lost, then 5 as a new stream and 7 as a switch back: 1 lost AND
    # 1 interleaved for a frame that arrived.
    state = make_state()
    ingest_sequences(state, [("a", n) for n in sequences])
    demo = by_model(state)["demo"]
    assert (demo.frames_received, demo.frames_lost, demo.frames_interleaved) == (len(sequences), 0, 0)


def test_a_late_frame_after_a_restart_does_not_continue_the_old_stream() -> None:
    state = make_state()  # restarted at 0; its 61 arrives after 62, above the old stream's last 49
    ingest_sequences(state, [("a", n) for n in range(50)] + [("a", n) for n in [*range(61), 62, 61, 63]])
    demo = by_model(state)["demo"]
    assert (demo.frames_lost, demo.frames_interleaved) == (0, 0)


def test_lost_frames_never_go_down_between_scrapes_and_late_frames_offset_later_losses() -> None:
    state = make_state()
    ingest_sequences(state, [("a", n) for n in (0, 1, 3)])
    assert by_model(state)["demo"].frames_lost == 1  # a scrape sees 2 as lost ...
    ingest_sequences(state, [("a", 2)])
    # ... so the counter stays at 1 after 2 arrives late (going down would read as a counter reset) ...
    assert by_model(state)["demo"].frames_lost == 1
    ingest_sequences(state, [("a", n) for n in (5, 7)])  # ... and the late frame offsets the next loss
    assert by_model(state)["demo"].frames_lost == 2


def test_late_frames_are_only_gaps_counted_as_lost_within_the_reorder_window() -> None:
    def after_a_gap() -> SequenceTracker:
        tracker = SequenceTracker()
        for sequence in (0, 1, 2, 3, 200):  # 4..199 lost
            tracker.observe("a", sequence)
        return tracker

    tracker = after_a_gap()
    oldest_remembered = 200 - REORDER_WINDOW
    assert tracker.observe("a", oldest_remembered) == (-1, False, None)  # late
    assert tracker.observe("a", oldest_remembered) == (0, False, None)  # again: it fills no gap, a new stream
    assert after_a_gap().observe("a", oldest_remembered - 1) == (0, False, None)  # too old: a new stream
    assert after_a_gap().observe("a", 2) == (0, False, None)  # never lost: a new stream (a restart)


def test_one_gap_counts_at_most_max_sequence_gap_lost_frames_and_a_longer_jump_is_refused() -> None:
    tracker = SequenceTracker()
    tracker.observe("a", 0)
    assert tracker.observe("a", MAX_SEQUENCE_GAP + 1) == (MAX_SEQUENCE_GAP, False, None)  # the longest gap
    assert tracker.observe("a", 2 * MAX_SEQUENCE_GAP + 3) == (0, False, "sequence_jump")  # one more: refused
    assert tracker.observe("a", 2 * MAX_SEQUENCE_GAP + 5) == (1, False, None)  # its next frames continue the jump
    tracker.observe("b", 0)
    assert tracker.observe("b", 2**64 - 1) == (0, False, "sequence_jump")  # no shift of 2**64 bits either


def test_two_forged_datagrams_cannot_inflate_the_loss_and_a_real_loss_stays_visible() -> None:
    # A made-up shim id sends 0 and then 2**64 - 1 for the real model: unbounded, 1.84e19
    # frames "lost", beyond which float64 cannot show the one frame really lost afterwards.
    state = make_state()
    ingest_sequences(state, [("real", n) for n in range(10)] + [("made-up", 0), ("made-up", 2**64 - 1)])
    ingest_sequences(state, [("real", n) for n in (11, 12)])  # 10 lost in transit
    demo = by_model(state)["demo"]
    assert (demo.frames_received, demo.frames_lost) == (13, 1)
    assert state.frames_rejected["sequence_jump"] == 1


def test_a_forged_jump_under_a_real_shim_id_does_not_carry_its_numbering_off() -> None:
    # Were the jump to move the real stream to 2**64 - 1, a forged 0 would start a stream the real
    # shim's next frame continued, counting its whole numbering (99 frames) as lost.
    state = make_state()
    forged = [("real", 2**64 - 1), ("real", 0)]
    ingest_sequences(state, [("real", n) for n in range(100)] + forged + [("real", 100), ("real", 102)])
    assert by_model(state)["demo"].frames_lost == 1  # 101, really lost


def test_with_a_frame_key_replayed_frames_are_rejected_and_late_ones_accepted_once() -> None:
    key = b"k" * 32
    state, rng = make_state(frame_key=key), np.random.default_rng(0)
    captured = [encode_frame(random_frame(rng, n), key) for n in range(10)]
    for _ in range(100):  # ten captured frames sent 100 times must count once each
        for datagram in captured:
            state.ingest_datagram(datagram)
    assert by_model(state)["demo"].frames_received == 10
    assert state.frames_rejected["replayed"] == 990
    newest = 10 + REORDER_WINDOW
    for sequence in (12, newest, 11, 11, 12, 13, 9):
        state.ingest_datagram(encode_frame(random_frame(rng, sequence), key))
    # 12 and 74 are new: 10, 11 and 13..73 were lost; 11 and 13 arrive late, in the window (10..73),
    # and take their loss back; the second 11 and 12 were received already, 9 is too old to tell.
    demo = by_model(state)["demo"]
    assert (demo.frames_received, demo.frames_lost) == (14, 2 + (newest - 13) - 2)
    assert state.frames_rejected["replayed"] == 990 + 3
    assert demo.frames_interleaved == 0


def test_with_a_frame_key_a_shim_that_starts_again_under_a_new_id_is_followed() -> None:
    key = b"k" * 32
    state, rng = make_state(frame_key=key), np.random.default_rng(0)
    for shim in ("host-1-1a2b3c4d", "host-1-5e6f7a8b"):  # default ids: new at every start
        for sequence in range(5):
            state.ingest_datagram(encode_frame(random_frame(rng, sequence, shim=shim), key))
    demo = by_model(state)["demo"]
    assert (demo.frames_received, demo.frames_lost, state.frames_rejected["replayed"]) == (10, 0, 0)


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
    assert state.frames_rejected["too_many_models"] == 1
    assert by_model(state)["a"].frames_received == 2


def test_a_model_keeps_the_layer_count_of_its_first_frame_and_wide_frames_are_refused() -> None:
    state, rng = make_state(max_layers=8), np.random.default_rng(0)
    for sequence, layers in enumerate([6, 7, 9, 6]):
        state.ingest(random_frame(rng, sequence, layers=layers))
    demo = by_model(state)["demo"]
    assert demo.frames_received == 2 and len(demo.layer_sums) == 6
    assert state.frames_rejected["layer_count_changed"] == 1 and state.frames_rejected["too_many_layers"] == 1
    state.ingest(random_frame(rng, 4, model="wide", layers=9))
    assert "wide" not in by_model(state)  # a refused frame takes no slot


def test_idle_models_are_forgotten_and_free_their_slot() -> None:
    clock = Clock()
    state, rng = make_state(clock, max_models=1, model_idle_seconds=60.0), np.random.default_rng(0)
    state.ingest(random_frame(rng, 0, model="a", layers=6))
    clock.now += 30
    state.ingest(random_frame(rng, 1, model="b"))
    assert state.frames_rejected["too_many_models"] == 1
    state.ingest(random_frame(rng, 2, model="a", layers=6))  # a frame keeps the model alive
    clock.now += 59
    assert list(by_model(state)) == ["a"]
    clock.now += 2
    state.ingest(random_frame(rng, 3, model="b"))
    assert list(by_model(state)) == ["b"] and state.model_names() == ["b"]
    assert state.bimodality("a").withheld and state.routing("a").withheld  # forgotten: an empty window
    clock.now += 61
    assert by_model(state) == {}  # a scrape forgets too, so idle series disappear
    state.ingest(random_frame(rng, 4, model="a", layers=9))  # forgotten: the layer count may change
    assert len(by_model(state)["a"].layer_sums) == 9


def test_with_a_frame_key_only_frames_tagged_under_it_are_counted() -> None:
    key = b"k" * 32
    state, rng = make_state(frame_key=key), np.random.default_rng(0)
    state.ingest_datagram(encode_frame(random_frame(rng, 0), key))
    state.ingest_datagram(encode_frame(random_frame(rng, 1)))
    state.ingest_datagram(encode_frame(random_frame(rng, 2), b"x" * 32))
    tampered = bytearray(encode_frame(random_frame(rng, 3), key))
    tampered[30] ^= 1
    state.ingest_datagram(bytes(tampered))
    assert by_model(state)["demo"].frames_received == 1
    assert state.frames_rejected["missing_tag"] == 1 and state.frames_rejected["bad_tag"] == 2
    assert state.frames_malformed == 0
    assert "k" * 32 not in repr(state.config)  # the key never reaches a log line through the config


def test_the_fallbacks_frames_report_add_up_per_model() -> None:
    state, rng = make_state(), np.random.default_rng(0)
    for sequence, fallbacks in enumerate((0, 2, 0, 1)):
        state.ingest(dataclasses.replace(random_frame(rng, sequence), fallbacks=fallbacks))
    state.ingest(random_frame(rng, 0, model="other"))
    assert {name: s.fallbacks for name, s in by_model(state).items()} == {"demo": 3, "other": 0}


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
    assert demo.layer_skips.tolist() == skipped.sum(axis=0).tolist()
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


# --- routing window ---------------------------------------------------------------------------


def _frame(
    rows: int, layers: int, low_layers: list[int], sequence: int, threshold: float | None = 0.18, model: str = "demo"
) -> GateFrame:
    entropies = np.full((rows, layers), 0.3, np.float32)
    entropies[:, low_layers] = 0.1
    return GateFrame(model, "shim", sequence, entropies, entropies < 0.18, threshold)


def test_the_routing_window_keeps_whole_recent_tokens() -> None:
    # 1,000 observations at 16 layers: the last 62 tokens (992 values), whole rows only.
    state = make_state(window_max_observations=1000, min_routing_tokens=50)
    for sequence in range(10):
        state.ingest(_frame(7, 16, [3], sequence))  # 70 tokens with layer 3 low ...
    for sequence in range(10, 20):
        state.ingest(_frame(7, 16, [9], sequence))  # ... then 70 with layer 9 low
    routing = state.routing("demo")
    assert routing.tokens == 62
    assert routing.low_counts.tolist() == [62 if layer == 9 else 0 for layer in range(16)]
    assert routing.static_layers == (9,) and routing.verdict == "static"


def test_a_new_layer_count_starts_the_routing_window_over_in_a_replay() -> None:
    # The live exporter refuses the second shape (layer_count_changed); a trace may hold both.
    model = ModelStatistics(ExporterConfig())
    for frame in (_frame(100, 16, [3], 0), _frame(60, 8, [5], 1)):
        model.add(frame.entropies, frame.skipped, now=0.0)
    routing = model.routing_window.statistics(min_tokens=5)
    assert routing.tokens == 60 and routing.layers == 8 and routing.static_layers == (5,)


def _stage(frame: GateFrame, first_layer: int, layers: int, shim: str) -> GateFrame:
    """The columns first_layer..+layers of a 16-layer frame, as a pipeline stage sends them (wire version 3)."""
    span = slice(first_layer, first_layer + layers)
    return GateFrame(
        frame.model_name, shim, frame.sequence, frame.entropies[:, span], frame.skipped[:, span], 0.18, first_layer, 16
    )


def test_two_stages_partial_frames_fold_into_one_model_as_its_whole_frames_would() -> None:
    clock = Clock()
    whole, staged = make_state(clock, min_routing_tokens=50), make_state(clock, min_routing_tokens=50)
    frames = [_frame(7, 16, [3, 12], sequence) for sequence in range(10)]
    for frame in frames:
        whole.ingest(frame)
        staged.ingest(_stage(frame, 0, 10, "stage-0"))
    assert staged.routing("demo").withheld and staged.routing("demo").tokens == 0  # layers 10-15 unheard
    for frame in frames:
        staged.ingest(_stage(frame, 10, 6, "stage-1"))
    clock.now += 10  # past the statistics cache
    (one,), (two,) = whole.snapshot(), staged.snapshot()
    for field in ("buckets", "sums", "zeros", "layer_sums", "layer_counts", "layer_skips"):
        np.testing.assert_allclose(getattr(two, field), getattr(one, field), err_msg=field)
    assert two.frames_received == 20 and two.frames_lost == 0
    expected, folded = whole.routing("demo"), staged.routing("demo")
    assert folded.tokens == expected.tokens == 70 and folded.static_layers == expected.static_layers == (3, 12)
    assert folded.low_counts.tolist() == expected.low_counts.tolist()
    np.testing.assert_array_equal(staged.bimodality("demo").histogram, whole.bimodality("demo").histogram)


def test_a_stage_that_lost_frames_leaves_the_routing_window_the_tokens_both_stages_sent() -> None:
    state = make_state(min_routing_tokens=5)
    for sequence in range(10):
        frame = _frame(1, 16, [3], sequence)
        state.ingest(_stage(frame, 0, 8, "stage-0"))
        if sequence not in (2, 5):  # lost in transit
            state.ingest(_stage(frame, 8, 8, "stage-1"))
    routing = state.routing("demo")
    assert routing.tokens == 8 and routing.low_counts.tolist() == [8 if layer == 3 else 0 for layer in range(16)]
    assert by_model(state)["demo"].frames_lost == 2


def test_a_partial_frame_of_another_model_size_is_refused() -> None:
    state = make_state()
    state.ingest(_stage(_frame(1, 16, [3], 0), 0, 8, "stage-0"))
    state.ingest(_frame(1, 8, [3], 0, model="demo"))  # 8 layers: a whole frame of another model
    assert state.frames_rejected["layer_count_changed"] == 1
    assert by_model(state)["demo"].layer_counts.tolist() == [1] * 8 + [0] * 8


def test_the_routing_window_expires_with_the_entropy_window() -> None:
    clock = Clock()
    state = make_state(clock, window_seconds=60, min_routing_tokens=5, statistics_cache_seconds=0)
    state.ingest(_frame(10, 4, [1], 0))
    assert state.routing("demo").tokens == 10
    clock.now += 61
    routing = state.routing("demo")
    assert routing.tokens == 0 and routing.withheld and routing.low_rates.size == 0
    assert state.bimodality("demo").observations == 0


def test_frames_without_a_threshold_use_the_default_and_are_counted() -> None:
    state = make_state(default_threshold=0.05, min_routing_tokens=5, statistics_cache_seconds=0)
    state.ingest(_frame(60, 4, [1], 0, threshold=None, model="old"))
    state.ingest(_frame(60, 4, [1], 0, threshold=0.18, model="new"))
    models = by_model(state)
    assert (models["old"].frames_without_threshold, models["old"].threshold) == (1, 0.05)
    assert (models["new"].frames_without_threshold, models["new"].threshold) == (0, pytest.approx(0.18))
    assert state.routing("old").withheld  # 0.1 is not below 0.05: nothing to judge
    assert state.routing("new").static_layers == (1,)
    # the window judges each frame by its own threshold
    state.ingest(_frame(10, 4, [1], 1, threshold=None, model="new"))
    routing = state.routing("new")
    assert routing.tokens == 70 and routing.low_counts.tolist() == [0, 60, 0, 0]
    assert by_model(state)["new"].frames_without_threshold == 1


def test_the_routing_statistics_are_cached_like_the_bimodality() -> None:
    clock = Clock()
    state = make_state(clock, min_routing_tokens=5, statistics_cache_seconds=2)
    state.ingest(_frame(10, 4, [1], 0))
    first = state.routing("demo")
    state.ingest(_frame(10, 4, [2], 1))
    assert state.routing("demo") is first  # changed, but younger than the cache time
    clock.now += 3
    assert state.routing("demo").tokens == 20


def test_sequence_tracking_is_bounded_in_shim_ids_and_streams() -> None:
    tracker = SequenceTracker()
    tracker.observe("a", 0)
    for shim in range(MAX_TRACKED_SHIMS):  # made-up ids push "a" out
        tracker.observe(f"made-up-{shim}", 0)
    assert tracker.observe("a", 10) == (0, False, None)  # forgotten: a new stream, no loss invented
    for start in range(MAX_STREAMS_PER_SHIM + 1):  # restarts, each a new stream at 100 - start
        tracker.observe("b", 100 - start)
    # The oldest stream (last 100) was forgotten: 101 continues the newest of those kept (99).
    assert tracker.observe("b", 101) == (1, True, None)
