"""The routing gauges of a real `layerwatch exporter` over UDP: the same numbers as `replay`, from
version-2 frames (threshold carried) and version-1 frames (the default threshold, counted)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from layerwatch.demo.processes import LAYERWATCH_COMMAND
from tests.exporter.routing_traces import DEMO_LOW_RATES, scores_for_rates, static_rates, write_trace
from tests.exporter.support import trace_frames


def replay(path: Path, *args: str) -> dict:
    result = subprocess.run(
        [*LAYERWATCH_COMMAND, "replay", str(path), "--json", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    (report,) = map(json.loads, result.stdout.splitlines())
    return report


def per_layer(exporter, name: str, model: str, layers: int) -> list[float | None]:
    return [exporter.value(name, model_name=model, layer=str(layer)) for layer in range(layers)]


@pytest.fixture
def traces(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(12)
    return {
        "mix": write_trace(tmp_path / "mix.jsonl", {"mix": scores_for_rates(rng, DEMO_LOW_RATES, tokens=2000)}),
        "pruned": write_trace(
            tmp_path / "pruned.jsonl", {"pruned": scores_for_rates(rng, static_rates(16, [11, 12, 13, 14]), tokens=600)}
        ),
    }


def test_routing_gauges_match_replay_for_new_and_old_shims(start_exporter, traces: dict[str, Path]) -> None:
    exporter = start_exporter("--statistics-cache-seconds", "0")
    mix_frames = trace_frames(traces["mix"], shim_id="new-shim", threshold=0.18)  # wire version 2
    pruned_frames = trace_frames(traces["pruned"], shim_id="old-shim")  # no threshold: version 1
    assert mix_frames[0][4] == 2 and pruned_frames[0][4] == 1
    exporter.send_frames(mix_frames + pruned_frames)

    expected_states = {"mix": [-1] + [0] * 11 + [1, 1, 1, -1], "pruned": [-1] * 11 + [1] * 4 + [-1]}
    for model, dynamic in (("mix", 1), ("pruned", 0)):
        report = replay(traces[model])
        assert report["routing_verdict"] == ("dynamic" if dynamic else "static")
        labels = {"model_name": model}
        assert exporter.value("layerwatch_routing_dynamic", **labels) == dynamic
        assert exporter.value("layerwatch_routing_token_dependent_share", **labels) == pytest.approx(
            report["token_dependent_share"], abs=1e-12
        )
        assert exporter.value("layerwatch_routing_window_tokens", **labels) == report["routing_tokens"]
        assert per_layer(exporter, "layerwatch_routing_layer_low_ratio", model, 16) == pytest.approx(
            report["per_layer_low_rate"], abs=1e-12
        )
        assert per_layer(exporter, "layerwatch_routing_layer_skip_ratio", model, 16) == pytest.approx(
            report["per_layer_skip_rate"], abs=1e-12
        )
        assert per_layer(exporter, "layerwatch_routing_layer_static", model, 16) == expected_states[model]
        assert exporter.value("layerwatch_routing_layer_low_ratio", model_name=model, layer="16") is None
        assert exporter.value("layerwatch_routing_threshold", **labels) == pytest.approx(0.18)
    mix_share = exporter.value("layerwatch_routing_token_dependent_share", model_name="mix")
    assert 0.58 < mix_share < 0.70
    assert exporter.value("layerwatch_exporter_frames_without_threshold_total", model_name="mix") == 0
    assert exporter.value("layerwatch_exporter_frames_without_threshold_total", model_name="pruned") == len(
        pruned_frames
    )


def test_old_frames_are_judged_by_the_default_threshold(start_exporter, traces: dict[str, Path]) -> None:
    exporter = start_exporter("--statistics-cache-seconds", "0", "--default-threshold", "0.05")
    exporter.send_frames(trace_frames(traces["pruned"], shim_id="old-shim"))
    exporter.send_frames(trace_frames(traces["pruned"], shim_id="new-shim", threshold=0.18)[:1])
    labels = {"model_name": "pruned"}
    # the last frame carried 0.18, the 75 before it were judged against 0.05
    assert exporter.value("layerwatch_routing_threshold", **labels) == pytest.approx(0.18)
    assert exporter.value("layerwatch_exporter_frames_without_threshold_total", **labels) == 75
    low = per_layer(exporter, "layerwatch_routing_layer_low_ratio", "pruned", 16)
    assert all(low[layer] < 0.2 for layer in (11, 12, 13, 14))  # 0.10-ish scores are not below 0.05
    assert 1 not in per_layer(exporter, "layerwatch_routing_layer_static", "pruned", 16)


def test_routing_gauges_are_withheld_on_a_short_window(start_exporter, traces: dict[str, Path]) -> None:
    exporter = start_exporter("--statistics-cache-seconds", "0")
    exporter.send_frames(trace_frames(traces["pruned"], threshold=0.18)[:10])  # 80 tokens < 200
    labels = {"model_name": "pruned"}
    assert exporter.value("layerwatch_routing_window_tokens", **labels) == 80
    assert exporter.value("layerwatch_routing_dynamic", **labels) is None
    assert exporter.value("layerwatch_routing_token_dependent_share", **labels) is None
    assert per_layer(exporter, "layerwatch_routing_layer_static", "pruned", 16) == [None] * 16
    assert per_layer(exporter, "layerwatch_routing_layer_low_ratio", "pruned", 16)[12] == 1.0
    exporter.send_frames(trace_frames(traces["pruned"], threshold=0.18)[10:])
    assert exporter.value("layerwatch_routing_dynamic", **labels) == 0


def test_top_shows_the_routing_verdict(start_exporter, traces: dict[str, Path]) -> None:
    exporter = start_exporter("--statistics-cache-seconds", "0")
    exporter.send_frames(trace_frames(traces["mix"], threshold=0.18))
    top = subprocess.run(
        [*LAYERWATCH_COMMAND, "top", "--url", exporter.url, "--once"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "  routing: dynamic  token-dependent share 0.6" in top.stdout
    assert "(2,000 tokens, τ 0.18)" in top.stdout
    assert (
        "static layers (below τ for ≥95% of tokens: skipped whatever the token) 12,13,14" in top.stdout
        and "static-run layers (below τ for ≤5% of tokens: run whatever the token) 0,15" in top.stdout
    )
