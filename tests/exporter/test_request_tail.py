"""layerwatch/request_tail.py: one request's skip fraction and token-dependent share, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from layerwatch.catalog import BY_NAME, DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION, REQUEST_FRACTION_BUCKETS
from layerwatch.request_tail import MIN_REQUEST_ROUTING_TOKENS, RequestLayers, request_skipping
from layerwatch.routing import STATIC_LOW_RATE, wilson_bounds


def layers(tokens: int, skipped: list[int], below: list[int]) -> RequestLayers:
    return RequestLayers(tokens, np.array(skipped), np.array(below))


def test_the_minimum_is_the_fewest_tokens_at_which_a_layer_can_be_static():
    assert MIN_REQUEST_ROUTING_TOKENS == 32
    n = MIN_REQUEST_ROUTING_TOKENS
    # Below tau on every one of n tokens: static from 32 tokens on, never before.
    assert wilson_bounds(np.array([n]), n)[0][0] >= STATIC_LOW_RATE
    assert wilson_bounds(np.array([n - 1]), n - 1)[0][0] < STATIC_LOW_RATE
    assert f"{n} decode tokens or more" in BY_NAME["layerwatch_request_token_dependent_share"].help


def test_skip_fraction_is_skipped_over_evaluated_layer_evaluations():
    # 4 layers, 10 tokens: 7 + 3 = 10 of 40 evaluations skipped.
    s = request_skipping(layers(10, [0, 7, 3, 0], [0, 9, 5, 1]))
    assert s.tokens == 10 and s.skip_fraction == 10 / 40 == 0.25
    assert s.token_dependent_share is None  # 10 tokens: too few to judge


def test_a_request_without_decode_tokens_has_no_statistics():
    assert request_skipping(layers(0, [0, 0], [0, 0])) is None


def test_share_of_a_request_that_prunes_the_same_layers_on_every_token_is_zero():
    # 40 tokens, 6 layers: layers 2 and 3 below tau on every token (static), nothing else below.
    s = request_skipping(layers(40, [0, 0, 37, 37, 0, 0], [0, 0, 40, 40, 0, 0]))
    assert s.token_dependent_share == 0.0
    assert s.skip_fraction == 74 / 240


def test_share_counts_the_below_threshold_mass_outside_static_layers():
    # 40 tokens: layer 1 below tau on all 40 (static), layer 2 on 20, layer 3 on 10 (token-dependent).
    s = request_skipping(layers(40, [0, 37, 12, 4, 0], [0, 40, 20, 10, 0]))
    assert s.token_dependent_share == pytest.approx(1 - 40 / 70)
    # 38 of 40 is not static at 40 tokens (the Wilson lower bound is below 0.95): all of it counts.
    assert wilson_bounds(np.array([38]), 40)[0][0] < STATIC_LOW_RATE
    assert request_skipping(layers(40, [0, 35, 0], [0, 38, 0])).token_dependent_share == 1.0


def test_share_is_judged_from_scores_not_decisions():
    # Patience: a layer below tau on all 32 tokens is skipped on at most 29; it is still static.
    s = request_skipping(layers(32, [0, 29, 0], [0, 32, 0]))
    assert s.token_dependent_share == 0.0


def test_share_is_undefined_without_any_score_below_threshold():
    assert request_skipping(layers(64, [0, 0, 0], [0, 0, 0])).token_dependent_share is None


def test_runaway_is_strictly_above_the_cutoff_like_a_histogram_bucket():
    # 16 layers, 20 tokens: 112 of 320 = 0.35 exactly is in the le="0.35" bucket, not above it.
    at = request_skipping(layers(20, [0] * 8 + [14] * 8, [0] * 16))
    assert at.skip_fraction == 0.35 and not at.runaway(0.35)
    above = request_skipping(layers(20, [0] * 7 + [1] + [14] * 8, [0] * 16))
    assert above.runaway(0.35) and not above.runaway(0.4)


@pytest.mark.parametrize(
    "tokens, skipped, below",
    [(3, [4, 0], [0, 0]), (3, [-1, 0], [0, 0]), (3, [0, 0], [0, 4]), (3, [0, 0], [0, 0, 0])],
)
def test_counts_outside_their_range_are_refused(tokens, skipped, below):
    with pytest.raises(ValueError):
        layers(tokens, skipped, below)


def test_buckets_hold_the_cutoffs_that_matter():
    for cutoff in (DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION, 0.35, 0.85, STATIC_LOW_RATE, 0.05, 0.0, 1.0):
        assert cutoff in REQUEST_FRACTION_BUCKETS
    assert list(REQUEST_FRACTION_BUCKETS) == sorted(REQUEST_FRACTION_BUCKETS)
    for name in ("layerwatch_request_skip_fraction", "layerwatch_request_token_dependent_share"):
        assert BY_NAME[name].buckets == REQUEST_FRACTION_BUCKETS and BY_NAME[name].labels == ("model_name",)
    assert BY_NAME["layerwatch_request_runaway_layer_skips_total"].labels == ("model_name", "layer")
