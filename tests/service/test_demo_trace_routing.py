"""The demo model's own served trace: `layerwatch serve --trace-file` under the load generator's
traffic, replayed with `layerwatch replay --json`, routes per token (verdict dynamic), although some
of its layers are static; the static-gates drill's trace of the same traffic is judged static.

This is the routing statistic on real gates rather than constructed traces (tests/exporter/
test_routing.py covers those). `replay --plot` draws both traces: the static one is a heat map of
uniform rows, the served one is not (tests/exporter/test_replay_plot.py covers constructed traces)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from layerwatch.demo.loadgen import run_load
from layerwatch.demo.processes import LAYERWATCH_COMMAND, ManagedProcess, free_port
from layerwatch.exporter.replay_plot import plot_reports
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_NAME, demo_model_present
from tests.exporter.support import heat_map_row_colours

pytestmark = pytest.mark.skipif(not demo_model_present(), reason="the demo model is not in this checkout")

REQUESTS = 24  # x 32 tokens: about 750 decode tokens, well past the routing verdict's 200


def served_trace(tmp_path: Path, *flags: str) -> Path:
    trace = tmp_path / "trace.jsonl"
    port = free_port()
    argv = [*LAYERWATCH_COMMAND, "serve", "--port", str(port), "--exporter-address", "", "--trace-file", str(trace)]
    shim = ManagedProcess("shim", [*argv, *flags], tmp_path / "shim.log")
    try:
        shim.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=180)
        report = run_load(
            f"http://127.0.0.1:{port}",
            DEMO_MODEL_NAME,
            duration=300.0,
            concurrency=2,
            max_tokens=32,
            max_requests=REQUESTS,
            seed=7,
        )
        assert report.requests == REQUESTS and report.server_errors == 0, report
    finally:
        shim.stop()
    return trace


def replay(trace: Path) -> dict:
    result = subprocess.run(
        [*LAYERWATCH_COMMAND, "replay", str(trace), "--json"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    (report,) = [json.loads(line) for line in result.stdout.splitlines()]
    return report


def drawn_rows(trace: Path, report: dict, out: Path) -> list[int]:
    """The distinct colours of each layer's row in the heat map `replay --plot` draws."""
    (box,) = plot_reports(trace, [report], out).values()
    return heat_map_row_colours(out, box)


def test_the_demo_models_served_trace_routes_per_token(tmp_path: Path) -> None:
    trace = served_trace(tmp_path)
    report = replay(trace)
    assert report["threshold"] == pytest.approx(0.18)  # the trace carries the served tau
    assert report["routing_tokens"] >= 500
    assert report["routing_verdict"] == "dynamic", report
    # Token-dependent layers carry most of the skipping, but not all of it: the demo model's deepest
    # layers are already static (layerwatch/inference_shim/demo_model/README.md), and the statistic says so.
    assert 0.5 <= report["token_dependent_share"] < 1.0, report
    assert report["static_layers"], report
    low = report["per_layer_low_rate"]
    assert len(low) == 16 and low[0] <= 0.01 and low[-1] <= 0.01  # the protected first and last layers
    rows = drawn_rows(trace, report, tmp_path / "healthy.png")
    token_dependent = set(range(16)) - set(report["static_layers"]) - set(report["static_run_layers"])
    assert all(rows[layer] > 5 for layer in token_dependent), rows


def test_the_static_gates_drill_is_judged_static_on_the_same_traffic(tmp_path: Path) -> None:
    trace = served_trace(tmp_path, "--static-gates")
    report = replay(trace)
    assert report["routing_verdict"] == "static", report
    assert report["token_dependent_share"] < 0.1, report
    # The pooled histogram cannot tell: the drill keeps two humps (docs/exporter.md).
    assert report["bimodal"] is True, report
    # ... the picture can: every gate is a constant, every row of the heat map one colour.
    assert drawn_rows(trace, report, tmp_path / "static.png") == [1] * 16
