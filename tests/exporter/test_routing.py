"""Routing statistics (static pruning vs per-token routing): the core, and `layerwatch replay` on
constructed traces."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binomtest

from layerwatch.demo.processes import LAYERWATCH_COMMAND
from layerwatch.routing import (
    DYNAMIC,
    STATIC,
    WITHHELD,
    check_routing,
    routing_from_rows,
    token_dependent_share,
    wilson_bounds,
)
from tests.exporter.routing_traces import DEMO_LOW_RATES, scores_for_rates, static_rates, write_trace
from tests.exporter.support import GOLDEN_TRACE


def replay(*args: str) -> list[dict]:
    result = subprocess.run([*LAYERWATCH_COMMAND, "replay", *args, "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def replay_one(path: Path, *args: str) -> dict:
    (report,) = replay(str(path), *args)
    return report


# --- the core ---------------------------------------------------------------------------------


@pytest.mark.parametrize("successes, trials", [(200, 200), (194, 200), (970, 1000), (3, 1000), (0, 50), (25, 50)])
def test_wilson_bounds_are_the_one_sided_90_percent_wilson_interval(successes: int, trials: int) -> None:
    expected = binomtest(successes, trials).proportion_ci(confidence_level=0.80, method="wilson")
    lower, upper = wilson_bounds(np.array([successes]), trials)
    assert lower[0] == pytest.approx(expected.low, abs=1e-9)
    assert upper[0] == pytest.approx(expected.high, abs=1e-9)


def test_the_demo_numbers_give_three_static_layers_and_a_share_of_0_64() -> None:
    tokens = 10_000
    low = np.round(np.array(DEMO_LOW_RATES) * tokens).astype(int)
    routing = check_routing(tokens, low, low // 2)
    assert routing.verdict == DYNAMIC
    assert routing.static_layers == (12, 13, 14)
    assert routing.static_run_layers == (0, 15)
    assert routing.token_dependent_share == pytest.approx(1 - (1.0 + 0.97 + 0.99) / sum(DEMO_LOW_RATES))
    assert routing.token_dependent_share == pytest.approx(0.644, abs=0.001)
    assert routing.layer_states().tolist() == [-1] + [0] * 11 + [1, 1, 1, -1]


def test_a_layer_is_static_only_when_the_confidence_bound_says_so() -> None:
    # 0.96 below τ: not static on 200 tokens (lower bound 0.938), static on 2,000 (0.954).
    assert check_routing(200, [192, 0], [0, 0]).static_layers == ()
    assert check_routing(2000, [1920, 0], [0, 0]).static_layers == (0,)
    # 0.94 is never static, however many tokens.
    assert check_routing(10**6, [940_000, 0], [0, 0]).static_layers == ()
    # static-run: the upper bound at most 0.05
    assert check_routing(2000, [1940, 40], [0, 0]).static_run_layers == (1,)
    assert check_routing(2000, [1940, 95], [0, 0]).static_run_layers == ()


def test_withheld_below_the_minimum_tokens_or_without_any_score_below_the_threshold() -> None:
    assert check_routing(199, [199, 0], [0, 0], min_tokens=200).verdict == WITHHELD
    assert check_routing(200, [200, 0], [0, 0], min_tokens=200).verdict == STATIC
    nothing_below = check_routing(5000, [0, 0, 0], [0, 0, 0])
    assert nothing_below.verdict == WITHHELD and nothing_below.token_dependent_share is None
    assert nothing_below.low_rates.tolist() == [0, 0, 0]


def test_the_share_weighs_layers_by_their_below_threshold_mass() -> None:
    low = np.array([1000, 500, 100, 0])
    assert token_dependent_share(low, np.array([True, False, False, False])) == pytest.approx(600 / 1600)
    assert token_dependent_share(low, np.zeros(4, bool)) == 1.0
    assert token_dependent_share(np.zeros(4, int), np.zeros(4, bool)) == 0.0
    # 44 % of the below-τ mass in static layers: still dynamic; 75 %: static
    assert check_routing(1000, [1000, 1000, 500, 500, 500, 500, 500], [0] * 7).verdict == DYNAMIC
    assert check_routing(1000, [1000, 1000, 1000, 500, 500, 0, 0], [0] * 7).verdict == STATIC


def test_stray_low_scores_in_kept_layers_do_not_count_as_routing() -> None:
    """Thirty static-run layers (below τ on 4 % of tokens: noise) next to one static layer: no layer
    varies with the token, so the skipping is static, however much stray mass the kept layers add."""
    routing = check_routing(1000, [1000] + [40] * 30, [0] * 31)
    assert routing.static_layers == (0,) and len(routing.static_run_layers or ()) == 30
    assert routing.verdict == STATIC and routing.token_dependent_share == 0.0


def test_uniform_high_rates_are_routing_not_pruning() -> None:
    # Every skippable layer below τ for 70 % of tokens, varying with the token: all token-dependent.
    rng = np.random.default_rng(4)
    below = rng.random((3000, 16)) < np.r_[0, [0.7] * 14, 0]
    routing = routing_from_rows(below, np.zeros_like(below))
    assert routing.verdict == DYNAMIC and routing.token_dependent_share == 1.0


# --- replay on constructed traces ---------------------------------------------------------------


@pytest.mark.parametrize(
    "layers, static",
    [
        (16, [11, 12, 13, 14]),
        (16, [1]),
        (16, [2, 5, 6, 9]),
        (16, list(range(1, 15))),
        (8, [3, 4]),
        (32, [1, 7, 8, 20, 30]),
    ],
)
def test_static_pruning_at_any_set_of_layers_is_static(tmp_path: Path, layers: int, static: list[int]) -> None:
    rng = np.random.default_rng(layers * 100 + len(static))
    scores = scores_for_rates(rng, static_rates(layers, static), tokens=1500, sigma=0.035)
    report = replay_one(write_trace(tmp_path / "static.jsonl", {"m": scores}))
    assert report["routing_verdict"] == "static"
    assert report["static_layers"] == static
    assert report["static_run_layers"] == [l for l in range(layers) if l not in static]
    assert report["token_dependent_share"] < 0.02
    assert len(report["per_layer_low_rate"]) == layers
    assert all(report["per_layer_low_rate"][l] > 0.97 for l in static)


def test_the_pooled_histogram_calls_static_pruning_bimodal_the_routing_does_not(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    scores = scores_for_rates(rng, static_rates(16, [11, 12, 13, 14]), tokens=1500)
    report = replay_one(write_trace(tmp_path / "static.jsonl", {"m": scores}))
    assert report["bimodal"] is True and report["verdict"] == "bimodal"
    assert report["routing_verdict"] == "static"


def test_the_golden_trace_demo_is_bimodal_but_statically_pruned() -> None:
    reports = {r["model_name"]: r for r in replay(str(GOLDEN_TRACE))}
    demo, flat = reports["demo"], reports["flat"]
    assert demo["bimodal"] is True and demo["routing_verdict"] == "static"
    assert demo["static_layers"] == [1, 3, 4, 6, 7, 9, 10]  # make_golden_trace.py's redundant layers
    assert demo["token_dependent_share"] == 0.0
    # "flat" never scores below τ: nothing is skipped, so there is nothing to call static or dynamic
    assert flat["routing_verdict"] == "withheld" and flat["per_layer_low_rate"] == [0.0] * 8


def test_per_token_routing_is_dynamic(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    rates = np.r_[0, rng.uniform(0.15, 0.75, 14), 0]
    scores = scores_for_rates(rng, rates, tokens=2000)
    report = replay_one(write_trace(tmp_path / "dynamic.jsonl", {"m": scores}))
    assert report["routing_verdict"] == "dynamic"
    assert report["static_layers"] == [] and report["static_run_layers"] == [0, 15]
    assert report["token_dependent_share"] == 1.0
    np.testing.assert_allclose(report["per_layer_low_rate"], rates, atol=0.05)
    assert report["skip_ratio"] > 0


def test_a_mix_like_the_demo_model_is_dynamic_with_its_static_layers_named(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    scores = scores_for_rates(rng, DEMO_LOW_RATES, tokens=3000)
    report = replay_one(write_trace(tmp_path / "mix.jsonl", {"m": scores}))
    assert report["routing_verdict"] == "dynamic"
    assert report["static_layers"] == [12, 13, 14]
    assert 0.58 < report["token_dependent_share"] < 0.70  # 0.644 on the exact demo numbers
    np.testing.assert_allclose(report["per_layer_low_rate"], DEMO_LOW_RATES, atol=0.03)
    # per-layer skip rates lag the low rates (patience), never exceed them by much, and spare the ends
    skip = np.array(report["per_layer_skip_rate"])
    assert skip[0] == skip[-1] == 0 and (skip <= np.array(report["per_layer_low_rate"]) + 0.01).all()


def test_two_models_in_one_trace_get_their_own_verdicts(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    trace = write_trace(
        tmp_path / "two.jsonl",
        {
            "pruned": scores_for_rates(rng, static_rates(12, [4, 5, 6]), tokens=800),
            "routed": scores_for_rates(rng, np.r_[0, [0.4] * 10, 0], tokens=800),
        },
    )
    verdicts = {r["model_name"]: (r["routing_verdict"], r["static_layers"]) for r in replay(str(trace))}
    assert verdicts == {"pruned": ("static", [4, 5, 6]), "routed": ("dynamic", [])}


def test_too_short_a_trace_withholds_the_routing_verdict(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    trace = write_trace(tmp_path / "short.jsonl", {"m": scores_for_rates(rng, static_rates(16, [3]), tokens=150)})
    report = replay_one(trace)
    assert report["routing_verdict"] == "withheld" and report["routing_tokens"] == 150
    assert report["token_dependent_share"] is None and report["static_layers"] is None
    assert len(report["per_layer_low_rate"]) == 16 and report["per_layer_low_rate"][3] > 0.9
    # the same trace is judged once the minimum allows it
    assert replay_one(trace, "--min-routing-tokens", "100")["routing_verdict"] == "static"


def test_short_sequences_are_judged_by_their_scores_not_their_skips(tmp_path: Path) -> None:
    # 3-token sequences never leave the patience warm-up: nothing is ever skipped.
    rng = np.random.default_rng(7)
    scores = scores_for_rates(rng, static_rates(16, [6, 7]), tokens=900)
    report = replay_one(write_trace(tmp_path / "short-seqs.jsonl", {"m": scores}, sequence_length=3))
    assert report["skip_ratio"] == 0 and max(report["per_layer_skip_rate"]) == 0
    assert report["routing_verdict"] == "static" and report["static_layers"] == [6, 7]


def test_the_threshold_comes_from_the_trace_else_from_the_flag(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    scores = scores_for_rates(rng, static_rates(16, [2, 3]), tokens=600)  # static layers score ≈ 0.10
    plain = write_trace(tmp_path / "plain.jsonl", {"m": scores})
    report = replay_one(plain)
    assert report["threshold"] == 0.18 and report["routing_verdict"] == "static"
    # τ = 0.05: only the noisy tail of the layers near 0.10 is below it, not static
    report = replay_one(plain, "--threshold", "0.05")
    assert report["threshold"] == 0.05 and report["static_layers"] == []
    assert 0 < report["per_layer_low_rate"][2] < 0.15 and report["per_layer_low_rate"][4] == 0
    # τ = 0: no score is below it, nothing to judge
    assert replay_one(plain, "--threshold", "0")["routing_verdict"] == "withheld"
    # a trace that carries τ overrides the flag
    carried = write_trace(tmp_path / "carried.jsonl", {"m": scores}, threshold=0.18)
    report = replay_one(carried, "--threshold", "0.05")
    assert report["threshold"] == 0.18 and report["static_layers"] == [2, 3]
    # τ = 0.5 puts every layer below it on every token: all static
    assert replay_one(plain, "--threshold", "0.5")["static_layers"] == list(range(16))


def test_bad_threshold_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"model_name": "m", "scores": [0.1, 0.2], "skipped": [0, 0], "threshold": 1.5}\n')
    result = subprocess.run([*LAYERWATCH_COMMAND, "replay", str(path)], capture_output=True, text=True)
    assert result.returncode == 1 and f"{path}:1: threshold must be a number in [0, 1], got 1.5" in result.stderr
    result = subprocess.run(
        [*LAYERWATCH_COMMAND, "replay", str(GOLDEN_TRACE), "--threshold", "2"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "must be in [0, 1]" in result.stderr


def test_text_output_shows_the_routing_verdict(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    trace = write_trace(tmp_path / "mix.jsonl", {"m": scores_for_rates(rng, DEMO_LOW_RATES, tokens=1000)})
    text = subprocess.run(
        [*LAYERWATCH_COMMAND, "replay", str(trace)], capture_output=True, text=True, check=True
    ).stdout
    assert "  routing: dynamic  token-dependent share 0.6" in text
    assert "(1,000 tokens, τ 0.18)" in text
    assert (
        "static layers (below τ for ≥95% of tokens: skipped whatever the token) 12,13,14" in text
        and "static-run layers (below τ for ≤5% of tokens: run whatever the token) 0,15" in text
    )
    assert "  below τ per layer 0.00 0.4" in text
