"""`layerwatch calibrate` writes a profile the alert generator accepts, measured from the decode run."""

from __future__ import annotations

import numpy as np
import pytest

from alerts.profile import load_profile
from inference_shim.offline.calibration import (
    CalibrationSettings,
    agreement_floor,
    ascii_histogram,
    build_profile,
    skip_collapse_fraction,
)
from layerwatch.routing import DEFAULT_MIN_ROUTING_TOKENS
from layerwatch.statistics import DEFAULT_MIN_WINDOW_OBSERVATIONS
from layerwatch_cli.main import build_parser, main
from tests.model.test_eval_decode import model_dir, text_file  # noqa: F401 (fixtures)


def test_calibrate_writes_a_loadable_profile(model_dir, text_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "tiny.yaml"
    code = main(
        [
            "calibrate",
            "--model",
            str(model_dir),
            "--data",
            str(text_file),
            "--out",
            str(out),
            "--prompts",
            "6",
            "--max-new-tokens",
            "12",
            "--threads",
            "1",
            "--chunk-tokens",
            "16",
            "--min-observations",
            "50",
            "--model-name",
            "tiny",
        ]
    )
    assert code == 0, capsys.readouterr().err
    profile = load_profile(out)
    assert profile.model_name == "tiny" and profile.threshold == 0.18 and profile.patience == 3
    # The tiny model's gates: layers 0, 1, 3 score ~0, layer 2 ~1. Only layer 1 is skippable and low,
    # and only after each sequence's first `patience` decode steps: at most (12 - 3) / 12 of a quarter.
    assert 0.0 < profile.skip_ratio_normal <= (12 - 3) / 12 / 4
    assert profile.zero_ratio.low <= 0.75 <= profile.zero_ratio.high
    assert profile.bimodality.min_observations == 50
    assert "6 prompts from heldout.txt" in profile.source
    out = capsys.readouterr().out
    assert "bimodal" in out and "shadow agreement (greedy, full-depth top-1)" in out
    assert 0.0 <= profile.shadow_agreement_min <= 1.0
    # Layers 0, 1 and 3 score ~0 on every token (static by their scores, protected or not), layer 2
    # ~1: no skipping depends on the token, so the share is 0 and its floor can never page.
    assert profile.routing.static_layers == (0, 1, 3)
    assert (profile.routing.token_dependent_share, profile.routing.share_floor) == (0.0, 0.0)
    assert "routing: static, token-dependent share 0.000" in out


def test_calibrate_flag_defaults_are_the_library_constants():
    parser = build_parser(["calibrate"], environ={})
    calibrate = parser._subparsers._group_actions[0].choices["calibrate"]
    args = calibrate.parse_args(["--data", "d.txt", "--out", "p.yaml"])
    assert args.min_observations == DEFAULT_MIN_WINDOW_OBSERVATIONS == CalibrationSettings("m").min_observations
    assert (args.chunk_tokens, args.margin, args.prompts) == (512, 0.03, 128)


def test_calibrate_refuses_a_text_without_prompts(model_dir, tmp_path, capsys):  # noqa: F811
    text = tmp_path / "words.txt"
    text.write_text("one\ntwo words\n")
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(model_dir),
                "--data",
                str(text),
                "--out",
                str(tmp_path / "p.yaml"),
                "--threads",
                "1",
            ]
        )
        == 2
    )
    assert "no line of three words" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()


def test_bands_cover_every_chunk_with_the_margin():
    rng = np.random.default_rng(0)
    # Layers 0-3 redundant (~0.1), layers 4-7 key (~0.3), 400 decoded tokens.
    entropies = np.concatenate([rng.normal(0.1, 0.02, (400, 4)), rng.normal(0.3, 0.02, (400, 4))], axis=1)
    skipped = entropies < 0.18
    profile, stats = build_profile(
        "m", 0.18, 3, 0.85, entropies, skipped, 0.8, chunk_tokens=100, margin=0.01, min_observations=100, source="test"
    )
    active_means = [entropies[i : i + 100][~skipped[i : i + 100]].mean() for i in range(0, 400, 100)]
    assert profile.entropy_mean.low == pytest.approx(min(active_means) - 0.01, abs=1e-4)
    assert profile.entropy_mean.high == pytest.approx(max(active_means) + 0.01, abs=1e-4)
    assert profile.skip_ratio_normal == pytest.approx(0.5, abs=0.01)
    assert stats.bimodality.bimodal and stats.bimodality.peaks == 2
    assert sum(stats.histogram) == entropies.size
    # Layers 0-3 below tau on every token: all of the skipping is static pruning.
    assert profile.routing.static_layers == (0, 1, 2, 3) and profile.routing.token_dependent_share == 0.0


def test_routing_baseline_floor_and_static_layers():
    rng = np.random.default_rng(1)
    tokens, chunk = 2000, 500
    # Layers 0-1 always low (static), 2-3 low on a random half of the tokens, 4-5 high; layer 4 is
    # low on every token of the second chunk only (static there: expected, not paged).
    low = np.zeros((tokens, 6), dtype=bool)
    low[:, :2] = True
    low[:, 2:4] = rng.random((tokens, 2)) < 0.5
    low[chunk : 2 * chunk, 4] = True
    entropies = np.where(low, rng.normal(0.1, 0.02, low.shape), rng.normal(0.3, 0.02, low.shape))
    profile, stats = build_profile(
        "m", 0.18, 3, 0.85, entropies, low, 0.8, chunk_tokens=chunk, margin=0.03, min_observations=100, source=""
    )
    routing = profile.routing
    assert routing.static_layers == (0, 1, 4)
    whole = 1 - 2 * tokens / low.sum()  # static mass: layers 0-1 (layer 4 is not static over the whole)
    assert routing.token_dependent_share == pytest.approx(whole, abs=1e-4)
    chunk_shares = [
        1 - low[i : i + chunk][:, [0, 1, 4] if i == chunk else [0, 1]].sum() / low[i : i + chunk].sum()
        for i in range(0, tokens, chunk)
    ]
    assert routing.share_floor == round(0.5 * min(chunk_shares), 3)
    assert routing.min_tokens == DEFAULT_MIN_ROUTING_TOKENS
    assert stats.routing.verdict == "static" and stats.routing.static_layers == (0, 1)  # share 0.38 < 0.5


def test_skip_collapse_fraction_keeps_every_healthy_chunk_above_the_limit():
    assert skip_collapse_fraction(0.3, [0.28, 0.31], margin=0.03) == 0.5  # the default
    assert skip_collapse_fraction(0.3, [0.1, 0.31], margin=0.03) == round(0.07 / 0.3, 3)  # lowered
    assert skip_collapse_fraction(0.3, [0.02], margin=0.03) == 0.01  # never 0 or below
    assert skip_collapse_fraction(0.0, [0.0], margin=0.03) == 0.5  # nothing skipped: no limit to place


def test_too_short_a_baseline_is_refused():
    with pytest.raises(ValueError, match="fewer than one chunk"):
        build_profile(
            "m",
            0.18,
            3,
            0.85,
            np.zeros((5, 4)),
            np.zeros((5, 4), bool),
            0.9,
            chunk_tokens=10,
            margin=0.0,
            min_observations=1,
            source="",
        )


def test_ascii_histogram_scales_bars_to_the_tallest_bin():
    counts = [0] * 20
    counts[2], counts[6] = 10, 5
    lines = ascii_histogram(counts, width=10).splitlines()
    assert len(lines) == 20
    assert lines[2].startswith("[0.10, 0.15) ##########") and lines[2].endswith(" 10")
    assert lines[6].count("#") == 5 and lines[19].startswith("[0.95, 1.00]")


def test_agreement_floor_is_the_worst_chunk_minus_the_margin():
    # (tokens, agreements) per request; chunks close once they hold >= 20 tokens.
    checks = [(10, 10), (10, 9), (12, 6), (10, 10), (5, 5)]  # chunks: 19/20, 16/22; the 5-token tail is dropped
    assert agreement_floor(checks, chunk_tokens=20, margin=0.05) == round(16 / 22 - 0.05, 3)
    with pytest.raises(ValueError, match="fewer than one chunk"):
        agreement_floor([(5, 5)], chunk_tokens=20, margin=0.0)
