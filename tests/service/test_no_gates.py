"""`layerwatch serve --no-gates`: a checkpoint without a gate file served at full depth, honestly: every layer
runs, the metrics say so, and no gate frame claims scores or skips that do not exist (docs/service.md,
"Serving without gates")."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from layerwatch.demo.processes import LAYERWATCH_COMMAND, ManagedProcess, free_port
from layerwatch.inference_shim.runtime.gates import GATES_FILE
from layerwatch.inference_shim.service.shim import ServeSettings, ShimService
from tests.service.conftest import NUM_LAYERS, FrameCapture
from tests.support import sample_sum, scrape


@pytest.fixture(scope="module")
def ungated_folder(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint as a model comes before any gates are trained: without a gate file."""
    folder = tmp_path_factory.mktemp("ungated") / "tiny-ungated"
    shutil.copytree(tiny_checkpoint.path, folder, ignore=shutil.ignore_patterns(GATES_FILE))
    return folder


def test_without_a_gate_file_serve_exits_2_and_names_no_gates(ungated_folder):
    argv = ["serve", "--model", str(ungated_folder), "--exporter-address", "", "--port", "0"]
    result = subprocess.run([*LAYERWATCH_COMMAND, *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "cannot start" in line]
    assert line.endswith(
        f"cannot start: {ungated_folder / GATES_FILE}: gate file not found; train gates for this model with "
        f"`layerwatch train-gates --model DIR --data TEXT --out {ungated_folder / GATES_FILE}`; until then "
        "`layerwatch serve --no-gates` serves the model at full depth"
    )


def test_no_gates_serves_a_chat_completion_at_full_depth_and_sends_no_frames(ungated_folder, tmp_path):
    capture = FrameCapture()
    port = free_port()
    argv = [sys.executable, "-m", "layerwatch.cli.main", "serve", "--model", str(ungated_folder), "--no-gates"]
    shim = ManagedProcess(
        "serve",
        [*argv, "--port", str(port), "--exporter-address", capture.address],
        tmp_path / "serve.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        shim.wait_http(f"{base_url}/readyz", timeout=120)  # the readiness probe ran the model too
        body = {"model": ungated_folder.name, "messages": [{"role": "user", "content": "light"}], "max_tokens": 6}
        answer = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        tokens = usage["completion_tokens"]
        assert tokens >= 1 and (usage["layers_executed"], usage["layers_skipped"]) == (tokens * NUM_LAYERS, 0)
        metrics = scrape(base_url)
        (info,) = [dict(labels) for (name, labels), _ in metrics.items() if name == "layerwatch_model_info"]
        assert (info["gates_sha256"], info["threshold"], info["model_name"]) == ("none", "0.0", ungated_folder.name)
        # Counted as a full-depth request: the quality guard expects no shadow checks of it.
        full = sample_sum(metrics, "layerwatch_depth_decisions_total", mode="full", reason="default")
        assert full == sample_sum(metrics, "layerwatch_depth_decisions_total") == 1
        assert sample_sum(metrics, "layerwatch_layer_evaluations_total", decision="skip") == 0
        # No scores, no frames: nothing reaches the exporter, nothing counts as dropped.
        assert sample_sum(metrics, "layerwatch_telemetry_frames_sent_total") == 0
        assert sample_sum(metrics, "layerwatch_telemetry_frames_dropped_total") == 0
        assert sample_sum(metrics, "layerwatch_prompt_complexity_count") == 0
    finally:
        shim.stop()
        capture.close()
    assert capture.datagrams == []
    log = (tmp_path / "serve.log").read_text()
    assert "serving at full depth without gates (--no-gates)" in log
    assert "row-partial path up to" not in log  # nothing is skipped: no depth execution to measure


@pytest.mark.parametrize(
    "override, flags",
    [
        ({"threshold": 0.2}, "--threshold"),
        ({"reset_gates": True, "trace_file": Path("t.jsonl")}, "--reset-gates, --trace-file"),
        ({"shadow_rate": 0.5}, "--shadow-rate"),
    ],
)
def test_no_gates_refuses_the_settings_that_need_gates(ungated_folder, override, flags):
    settings = ServeSettings(model_dir=ungated_folder, no_gates=True, exporter_address="", **override)
    with pytest.raises(ValueError, match=f"^--no-gates serves no gates: {flags} need\\(s\\) them$"):
        ShimService.load(settings)
