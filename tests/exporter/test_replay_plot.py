"""`layerwatch replay TRACE --plot OUT.png`: the picture of what the gates did, read back from the
written image. Static pruning (every layer's score a constant, as `serve --static-gates` serves it)
is a heat map of uniform rows; per-token routing is not. The served demo model's own traces are
drawn in tests/service/test_demo_trace_routing.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from layerwatch.cli.main import main
from layerwatch.demo.processes import LAYERWATCH_COMMAND
from layerwatch.exporter.replay import replay_trace
from layerwatch.exporter.replay_plot import BAND_INCHES, DPI, MAX_PLOT_MODELS, WIDTH_INCHES, plot_reports
from layerwatch.exporter.state import ExporterConfig
from tests.exporter.routing_traces import DEMO_LOW_RATES, scores_for_rates, write_trace
from tests.exporter.support import heat_map_row_colours

LAYERS = len(DEMO_LOW_RATES)
# The demo model's constant gates (`--static-gates`): layers 11-14 below τ, the others above it.
STATIC_SCORES = np.where(np.isin(np.arange(LAYERS), [11, 12, 13, 14]), 0.105, 0.30)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("plot-traces")
    routed = scores_for_rates(np.random.default_rng(3), DEMO_LOW_RATES, tokens=600)
    static = np.tile(STATIC_SCORES, (600, 1)).astype(np.float32)
    return {
        "routed": write_trace(folder / "routed.jsonl", {"routed": routed}, threshold=0.18),
        "static": write_trace(folder / "static.jsonl", {"static": static}, threshold=0.18),
        "both": write_trace(folder / "both.jsonl", {"routed": routed, "static": static}, threshold=0.18),
    }


def draw(trace: Path, out: Path, tokens: int = 120):
    config = ExporterConfig(window_seconds=float("inf"), min_window_observations=100)
    return plot_reports(trace, replay_trace(trace, config), out, tokens)


def test_static_pruning_is_a_heat_map_of_uniform_rows(traces, tmp_path) -> None:
    boxes = draw(traces["static"], tmp_path / "static.png")
    rows = heat_map_row_colours(tmp_path / "static.png", boxes["static"])
    assert rows == [1] * LAYERS, rows
    assert boxes["static"].tokens == 120 and boxes["static"].layers == LAYERS


def test_per_token_routing_is_not(traces, tmp_path) -> None:
    boxes = draw(traces["routed"], tmp_path / "routed.png")
    rows = heat_map_row_colours(tmp_path / "routed.png", boxes["routed"])
    # Every layer's scores vary from token to token (the constructed noise): no row is uniform,
    # and the layers that are below τ for some tokens only change colour across τ.
    assert min(rows) > 5, rows


def test_one_band_per_model_of_the_documented_size(traces, tmp_path) -> None:
    out = tmp_path / "both.png"
    boxes = draw(traces["both"], out)
    height, width, _ = imread(out).shape
    assert (width, height) == (WIDTH_INCHES * DPI, 2 * BAND_INCHES * DPI)
    assert list(boxes) == ["routed", "static"]
    assert boxes["routed"].bottom < boxes["static"].top  # the trace's order, top to bottom
    assert heat_map_row_colours(out, boxes["static"]) == [1] * LAYERS
    assert min(heat_map_row_colours(out, boxes["routed"])) > 5


def test_the_command_draws_and_says_so(traces, tmp_path) -> None:
    out = tmp_path / "cli.png"
    result = subprocess.run(
        [*LAYERWATCH_COMMAND, "replay", str(traces["static"]), "--plot", str(out), "--min-window-observations", "100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "routing: static" in result.stdout  # the report is printed as without --plot
    assert f"drew {out}" in result.stderr
    assert imread(out).shape[:2] == (BAND_INCHES * DPI, WIDTH_INCHES * DPI)


def test_a_trace_of_many_models_draws_a_bounded_readable_picture(tmp_path, capsys) -> None:
    """Before: a band per model whatever their number; 64 models drew for 203 s and 1.0 GB into a
    1200 x 39,680 picture of overlapping panels, with a matplotlib warning naming its source file."""
    rng = np.random.default_rng(5)
    models = {f"m{i:02d}": scores_for_rates(rng, DEMO_LOW_RATES[:4], tokens=40) for i in range(MAX_PLOT_MODELS + 2)}
    trace = write_trace(tmp_path / "many.jsonl", models, threshold=0.18)
    out = tmp_path / "many.png"
    assert main(["replay", str(trace), "--plot", str(out), "--plot-tokens", "20"]) == 0
    err = capsys.readouterr().err
    assert f"drew {out} (the first {MAX_PLOT_MODELS} models of {MAX_PLOT_MODELS + 2}: a band each" in err
    assert "Warning" not in err and ".py" not in err
    assert imread(out).shape[:2] == (MAX_PLOT_MODELS * BAND_INCHES * DPI, WIDTH_INCHES * DPI)


def test_without_matplotlib_the_error_says_what_to_install(traces, tmp_path) -> None:
    out = tmp_path / "none.png"
    code = (
        "import sys; sys.modules['matplotlib'] = None; from layerwatch.cli.main import main; "
        f"sys.exit(main(['replay', {str(traces['static'])!r}, '--plot', {str(out)!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "pip install 'layerwatch[plot]'" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_an_unwritable_output_is_a_clear_error(traces, tmp_path) -> None:
    out = tmp_path / "missing-folder" / "x.png"
    result = subprocess.run(
        [*LAYERWATCH_COMMAND, "replay", str(traces["static"]), "--plot", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and f"cannot write {out}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
