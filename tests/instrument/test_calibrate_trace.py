"""`layerwatch calibrate-trace`: a profile from a trace of any engine's healthy traffic, cut by the code
`layerwatch calibrate` uses (layerwatch/alerts/baseline.py), and trace problems refused with exit 2."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from layerwatch.alerts.baseline import build_profile
from layerwatch.alerts.profile import GateImportance
from layerwatch.alerts.profile_file import load_profile
from layerwatch.cli.main import main
from layerwatch.demo.processes import LAYERWATCH_COMMAND
from layerwatch.trace import TraceWriter

LAYERS = 6


def healthy_rows(tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two humps of router scores, low ones skipped at τ 0.5, a per-token mix in every layer."""
    rng = np.random.default_rng(seed)
    low = rng.random((tokens, LAYERS)) < np.linspace(0.2, 0.7, LAYERS)
    scores = np.where(low, rng.normal(0.1, 0.04, (tokens, LAYERS)), rng.normal(0.8, 0.06, (tokens, LAYERS)))
    scores = np.clip(scores, 0, 1).astype(np.float32)
    return scores, scores < 0.5


def write_trace(path: Path, model_name: str, scores: np.ndarray, skipped: np.ndarray, threshold=0.5) -> Path:
    writer = TraceWriter(path, 1 << 24, threshold=threshold)
    for start in range(0, len(scores), 8):  # steps of a batch of 8, as an engine writes them
        writer.write_rows(model_name, scores[start : start + 8], skipped[start : start + 8])
    return path


def test_the_profile_is_calibrates_own_on_the_traced_rows(tmp_path, capsys):
    scores, skipped = healthy_rows(1600)
    trace = write_trace(tmp_path / "healthy.jsonl", "my-engine", scores, skipped)
    out = tmp_path / "my-engine.yaml"
    assert main(["calibrate-trace", str(trace), "--out", str(out), "--chunk-tokens", "400"]) == 0
    printed = capsys.readouterr().out
    assert "baseline: 1600 decoded tokens of my-engine (6 layers, threshold 0.5)" in printed
    assert "bimodality: bimodal" in printed and "routing: dynamic" in printed and f"wrote {out}" in printed
    profile = load_profile(out)
    expected, _ = build_profile(
        "my-engine",
        0.5,
        1,
        0.85,
        scores,
        skipped,
        None,
        chunk_tokens=400,
        margin=0.03,
        min_observations=1000,
        source=profile.source,
    )
    assert profile == expected
    assert "1600 decoded tokens from healthy.jsonl" in profile.source and "not measured" in profile.source
    assert profile.shadow_agreement_min == 0.9 and profile.gate_importance == GateImportance()  # defaults
    assert profile.entropy_mean.low < scores[~skipped].mean() < profile.entropy_mean.high


@pytest.mark.parametrize(
    "lines, extra, message",
    [
        ([("a", 0.5), ("b", 0.5)], [], "lines of several models (a, b): name the one to calibrate"),
        ([("a", 0.5), ("b", 0.5)], ["--model-name", "c"], "no trace line of model 'c'"),
        ([("a", 0.5), ("a", 0.25)], [], "the lines (and --threshold) give 0.25, 0.5"),
        ([("a", None)], [], "the lines (and --threshold) give none"),
        ([("a", 0.5)], ["--threshold", "0.3"], "give 0.3, 0.5"),
        # The message says what to do.
        (
            [("a", 0.5)],
            ["--chunk-tokens", "5000"],
            "600 decoded tokens of a, fewer than one chunk of 5000 (--chunk-tokens): record more of its healthy "
            "traffic (a few thousand tokens give bands that hold for the live 5-minute windows), or give a smaller "
            "--chunk-tokens",
        ),
    ],
)
def test_a_trace_that_makes_no_single_baseline_is_refused(tmp_path, capsys, lines, extra, message):
    trace = tmp_path / "t.jsonl"
    for i, (name, threshold) in enumerate(lines):
        write_trace(trace, name, *healthy_rows(600, seed=i), threshold=threshold)
    assert main(["calibrate-trace", str(trace), "--out", str(tmp_path / "p.yaml"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("scores", ["all-zero", "healthy"])
def test_a_trace_whose_every_layer_was_skipped_is_refused_in_one_line(tmp_path, scores):
    # Unguarded, numpy's "RuntimeWarning: All-NaN axis encountered", with a
    # source path, comes before the exit-2 message.
    rows = np.zeros((600, LAYERS), np.float32) if scores == "all-zero" else healthy_rows(600)[0]
    trace = write_trace(tmp_path / "t.jsonl", "a", rows, np.ones(rows.shape, bool))
    refused = subprocess.run(
        [*LAYERWATCH_COMMAND, "calibrate-trace", str(trace), "--out", str(tmp_path / "p.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert refused.stderr == (
        "layerwatch calibrate-trace: every gate entropy of the baseline was skipped: "
        "the entropy bands need layers that ran\n"
    )


def test_a_trace_without_a_threshold_takes_the_flags(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", "a", *healthy_rows(600), threshold=None)
    out = tmp_path / "a.yaml"
    assert main(["calibrate-trace", str(trace), "--out", str(out), "--threshold", "0.5"]) == 0
    assert load_profile(out).threshold == 0.5


def test_a_bad_line_names_the_file_and_line(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", "a", *healthy_rows(600))
    with open(trace, "a") as file:
        file.write('{"model_name": "a", "scores": [2.0], "skipped": [0]}\n')
    assert main(["calibrate-trace", str(trace), "--out", str(tmp_path / "p.yaml")]) == 2
    assert f"{trace}:601: scores outside [0, 1]" in capsys.readouterr().err  # 600 good lines before it
