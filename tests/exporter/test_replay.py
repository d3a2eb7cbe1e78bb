"""`layerwatch replay`: the keys of docs/interfaces.md per model, and clear errors for bad traces."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from layerwatch import trace
from layerwatch.demo.processes import LAYERWATCH_COMMAND
from layerwatch.trace import MAX_LINE_BYTES, read_trace, read_trace_batches
from tests.exporter.support import GOLDEN_TRACE

DOCUMENTED_KEYS = {
    "model_name",
    "observations",
    "histogram",
    "mean",
    "std",
    "zero_ratio",
    "skip_ratio",
    "bimodal",
    "bimodality_coefficient",
    "dip",
    "dip_p_value",
    "peaks",
}


def replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LAYERWATCH_COMMAND, "replay", *args], capture_output=True, text=True)


def test_json_has_the_documented_keys_and_matches_the_trace() -> None:
    result = replay(str(GOLDEN_TRACE), "--json")
    assert result.returncode == 0, result.stderr
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["model_name"] for r in reports] == ["demo", "flat"]
    records = list(read_trace(GOLDEN_TRACE))
    for report in reports:
        assert set(report) >= DOCUMENTED_KEYS
        scores = np.concatenate([r.scores for r in records if r.model_name == report["model_name"]])
        skipped = np.concatenate([r.skipped for r in records if r.model_name == report["model_name"]])
        assert report["observations"] == scores.size == sum(report["histogram"])
        assert len(report["histogram"]) == 20
        exact = scores.astype(np.float64)
        assert report["histogram"] == np.histogram(exact, bins=20, range=(0, 1))[0].tolist()
        assert abs(report["mean"] - exact.mean()) < 1e-12
        assert abs(report["std"] - exact.std()) < 1e-9
        assert report["zero_ratio"] == (scores < 0.01).mean()
        assert report["skip_ratio"] == skipped.mean()
    assert reports[0]["bimodal"] is True and reports[0]["peaks"] == 2
    assert reports[1]["bimodal"] is False and reports[1]["peaks"] == 1


def test_text_output_shows_verdict_and_histogram() -> None:
    result = replay(str(GOLDEN_TRACE))
    assert result.returncode == 0
    assert "demo: bimodal  (6,000 observations, window 6,000)" in result.stdout
    assert "flat: single-peak" in result.stdout
    assert result.stdout.count("0.95-1.00") == 2


def test_small_traces_withhold_the_verdict(tmp_path: Path) -> None:
    path = tmp_path / "small.jsonl"
    path.write_text("".join(GOLDEN_TRACE.read_text().splitlines(keepends=True)[:10]))
    (report, *_) = [json.loads(line) for line in replay(str(path), "--json").stdout.splitlines()]
    assert report["bimodal"] is None and report["verdict"] == "withheld"
    assert report["observations"] > 0 and report["dip"] is None


def test_a_bad_line_is_reported_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    lines = GOLDEN_TRACE.read_text().splitlines(keepends=True)[:5]
    lines[3] = '{"model_name": "demo", "scores": [0.5, 2.0], "skipped": [0, 0]}\n'
    path.write_text("".join(lines))
    result = replay(str(path), "--json")
    assert result.returncode == 1 and result.stdout == ""
    assert f"{path}:4: scores outside [0, 1]" in result.stderr


@pytest.mark.parametrize(
    "line, reason",
    [
        ("[" * 100_000, "not valid JSON (nested too deeply)"),  # was a RecursionError traceback
        ('{"model_name": "demo", "scores": [0.5], "skipped": [0], "threshold": ' + "1" * 5000 + "}", "not valid JSON"),
    ],
)
def test_a_line_the_json_parser_cannot_take_is_a_bad_line_not_a_crash(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(GOLDEN_TRACE.read_text().splitlines(keepends=True)[0] + line + "\n")
    result = replay(str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{path}:2: {reason}" in result.stderr


def test_missing_and_empty_traces_are_errors(tmp_path: Path) -> None:
    assert "No such file" in replay(str(tmp_path / "absent.jsonl")).stderr
    (tmp_path / "empty.jsonl").write_text("\n")
    empty = replay(str(tmp_path / "empty.jsonl"))
    assert empty.returncode == 1 and "holds no trace lines" in empty.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--window-max-observations", "100000"], "must be 1..72000"),
        (["--window-max-observations", "500", "--min-window-observations", "600"], "no verdict could ever be given"),
        (["--min-window-observations", "0"], "argument --min-window-observations: must be positive, got 0"),
    ],
)
def test_impossible_windows_are_refused_like_the_exporter_does(flags: list[str], message: str) -> None:
    result = replay(str(GOLDEN_TRACE), *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def trace_line(model: str, layers: int = 4) -> str:
    return json.dumps({"model_name": model, "scores": [0.5] * layers, "skipped": [0] * layers}) + "\n"


# Unbounded, replay's memory grows with its input (a 160 MB line: 2.53 GB, 200,000 model names:
# 3.2 GB and, under an 8 GB limit, a numpy MemoryError traceback). The bounds, each naming the line;
# the figures are in docs/reliability.md ("Profiles, traces and oversized inputs").
def test_a_line_over_the_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text(trace_line("demo") + "[" * MAX_LINE_BYTES + "\n")
    result = replay(str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{path}:2: longer than {MAX_LINE_BYTES} bytes" in result.stderr


def test_models_beyond_max_models_are_refused_naming_the_first_line_past_it(tmp_path: Path) -> None:
    path = tmp_path / "models.jsonl"
    path.write_text("".join(trace_line(f"model-{i}") for i in range(65)))
    result = replay(str(path))
    assert result.returncode == 1, result.stderr
    assert f"{path}:65: model 'model-64' is one more than the 64 models replay keeps (--max-models)" in result.stderr
    assert replay(str(path), "--max-models", "65").returncode == 0


def test_lines_wider_than_max_layers_are_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "wide.jsonl"
    path.write_text(trace_line("demo") + trace_line("wide", 257))
    result = replay(str(path))
    assert result.returncode == 1, result.stderr
    assert f"{path}:2: 257 layers, more than the 256 replay takes (--max-layers)" in result.stderr
    assert replay(str(path), "--max-layers", "257").returncode == 0


def test_a_model_whose_layer_count_changes_is_refused_naming_the_line(tmp_path: Path) -> None:
    """Unguarded, replay warns and then reports both widths mixed (the per-layer rates
    of the last only), where the exporter refuses such frames (layer_count_changed)."""
    path = tmp_path / "widths.jsonl"
    path.write_text(trace_line("demo") * 2 + trace_line("other", 6) + trace_line("demo", 6))
    result = replay(str(path))
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert f"{path}:4: model 'demo' has 6 layers here, 4 on its first line" in result.stderr, result.stderr
    assert "layer_count_changed" in result.stderr and "Traceback" not in result.stderr


def test_batches_hold_at_most_max_batch_values_entropies(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(trace, "MAX_BATCH_VALUES", 100)  # 1 Mi in the code: a cheap stand-in
    path = tmp_path / "wide.jsonl"
    path.write_text(trace_line("demo", 34) * 7)  # three such rows are two values too many
    batches = list(read_trace_batches(path))
    assert [len(b.entropies) for b in batches] == [2, 2, 2, 1]
    assert [b.first_line for b in batches] == [1, 3, 5, 7]
