"""The committed Overview dashboard: stable identity, the variables, every panel the issue asks for."""

from __future__ import annotations

import json

import pytest

from layerwatch.dashboards import overview
from layerwatch.mixin import config

from .conftest import REPO


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((REPO / "layerwatch" / "dashboards" / "json" / "overview.json").read_text())


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_identity_and_variables(dashboard: dict) -> None:
    assert (dashboard["uid"], dashboard["title"]) == ("layerwatch-overview", "layerwatch / Overview")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == ["datasource", "model", "instance"]
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == config.GRAFANA_DATASOURCE_UID
    # Served models, those only an exporter hears of (another engine's frames) and those vLLM serves.
    assert variables["model"]["query"] == (
        'label_values({__name__=~"layerwatch_model_info|layerwatch_exporter_frames_received_total'
        '|vllm:num_requests_running"}, model_name)'
    )
    assert "$model" in variables["instance"]["query"] and variables["instance"]["includeAll"]


def test_every_query_uses_the_datasource_variable_and_panel_ids_are_unique(dashboard: dict) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert (
                "$model" in target["expr"]
                or "ALERTS" in target["expr"]
                or "layerwatch_gpu_" in target["expr"]  # NVML's GPU series have no model_name
                or "malformed" in target["expr"]
                or "rejected" in target["expr"]  # the model of a refused frame is not known
            ), panel["title"]


@pytest.mark.parametrize(
    "title, kind, needle",
    [
        ("Skip ratio", "timeseries", "profile_skip_ratio:collapse"),
        ("Layers executed per token", "timeseries", "layers_executed"),
        ("Per-layer skip ratio (layer × time)", "heatmap", "model_name_layer:layerwatch_layer_skips"),
        ("Entropy mean vs healthy band", "timeseries", "profile_entropy_mean:low"),
        ("Entropy std vs healthy band", "timeseries", "profile_entropy_std:high"),
        ("Zero-entropy ratio", "timeseries", "profile_zero_ratio:page"),
        ("Bimodality verdict", "stat", "layerwatch_entropy_bimodal"),
        ("Bimodality statistics", "stat", "layerwatch_entropy_dip_p_value"),
        ("Routing verdict", "stat", "layerwatch_routing_dynamic"),
        ("Token-dependent share", "timeseries", "profile_token_dependent_share:floor"),
        ("Below-threshold rate per layer (layer × time)", "heatmap", "layerwatch_routing_layer_low_ratio"),
        ("Entropy distribution over time", "heatmap", "layerwatch_entropy_bucket"),
        ("Entropy histogram, last 5 minutes", "barchart", "layerwatch_entropy_bucket"),
        ("Joules per generated token", "timeseries", "joules_per_decode_token"),
        ("Power and skip ratio", "timeseries", "layerwatch_gpu_power_watts"),
        ("GPU temperature", "timeseries", "layerwatch_gpu_temperature_celsius"),
        ("GPU fan speed", "timeseries", "layerwatch_gpu_fan_speed_ratio"),
        ("GPU SM clock", "timeseries", "layerwatch_gpu_sm_clock_hertz"),
        ("GPU memory used", "timeseries", "layerwatch_gpu_memory_used_bytes"),
        ("Time to first token", "timeseries", "time_to_first_token"),
        ("Inter-token latency", "timeseries", "inter_token_latency"),
        # The alert's own series: a vLLM-served model's fallbacks come from its frames (the exporter's count).
        ("Fallbacks", "timeseries", "model_name:layerwatch_fallbacks:rate"),
        ("Shadow agreement and skip ratio", "timeseries", "model_name:layerwatch_shadow_agreements:ratio"),
        ("Quality cost per token", "timeseries", "model_name:layerwatch_shadow_kl_nats:per_token"),
        ("Estimated perplexity increase", "timeseries", "layerwatch_shadow_reverse_kl_nats:perplexity_increase"),
        ("Shadow check coverage", "timeseries", "layerwatch_shadow_requests_total"),
        ("Rejected gate frames", "timeseries", "layerwatch_exporter_frames_rejected_total"),
        ("Telemetry loss", "timeseries", "frames_lost"),
        ("Firing alerts", "table", "ALERTS"),
        ("Instances unhealthy", "stat", "job_model_name:layerwatch_gating_instances:count"),
        ("Verdicts by instance", "table", "model_name:layerwatch_gating_unhealthy:bool"),
        ("Skip ratio: instances and fleet", "timeseries", "job_model_name:layerwatch_layer_skips:ratio"),
        ("Fleet latency", "timeseries", "job_model_name_le:layerwatch_inter_token_latency_seconds_bucket"),
        ("Fleet quality", "timeseries", "job_model_name:layerwatch_shadow_agreements:ratio"),
        ("Fleet entropy distribution over time", "heatmap", "job_model_name_le:layerwatch_entropy_bucket"),
    ],
)
def test_panel_exists(dashboard: dict, title: str, kind: str, needle: str) -> None:
    (panel,) = [p for p in panels(dashboard) if p["title"] == title]
    assert panel["type"] == kind
    assert any(needle in t["expr"] for t in panel["targets"])


def test_the_fleet_row_shows_every_instance_of_the_model(dashboard: dict) -> None:
    titles = [p["title"] for p in dashboard["panels"]]
    fleet = dashboard["panels"][titles.index("Fleet") + 1 : titles.index("Skipping")]
    assert [p["title"] for p in fleet][:2] == ["Instances unhealthy", "Verdicts by instance"]
    for panel in fleet:
        for target in panel["targets"]:
            assert "$model" in target["expr"] and "$instance" not in target["expr"], panel["title"]


def test_the_engine_view_puts_skipping_beside_vllms_latency_and_throughput(dashboard: dict) -> None:
    """One row answers "did skipping make the vLLM-served model faster or slower, and at what quality?":
    the skip ratio on the inter-token latency panel, the gating's quality, and every vLLM series the issue
    names, each filtered on vLLM's job and the model."""
    titles = [p["title"] for p in dashboard["panels"]]
    start = titles.index("Engine (vLLM)") + 1
    end = next(i for i in range(start, len(titles)) if dashboard["panels"][i]["type"] == "row")
    engine = dashboard["panels"][start:end]
    exprs = [t["expr"] for panel in engine for t in panel["targets"]]
    for series in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
    ):
        (expr, *_) = [e for e in exprs if series in e]
        assert f'job="{config.VLLM_JOB}", model_name=~"$model"' in expr, expr
    latency = next(p for p in engine if "vllm:inter_token_latency_seconds_bucket" in p["targets"][0]["expr"])
    assert any("model_name:layerwatch_layer_skips:ratio" in t["expr"] for t in latency["targets"])
    assert any("layerwatch_routing_token_dependent_share" in e for e in exprs)


def test_routing_sits_beside_the_bimodality_verdict(dashboard: dict) -> None:
    titles = [p["title"] for p in dashboard["panels"]]
    verdict = titles.index("Bimodality verdict")
    assert titles[verdict + 1] == "Routing verdict"
    (routing,) = [p for p in panels(dashboard) if p["title"] == "Routing verdict"]
    (bimodality,) = [p for p in panels(dashboard) if p["title"] == "Bimodality verdict"]
    assert routing["gridPos"]["y"] == bimodality["gridPos"]["y"]  # the same row of panels


def test_windows_and_profile_series_are_not_typed_out() -> None:
    """The histogram's window follows the rate window; profile series names come from the rules."""
    source = (REPO / "layerwatch" / "dashboards" / "overview.py").read_text()
    assert "[5m]" not in source and "5 minutes" not in source and "model_name:layerwatch_profile" not in source


def test_entropy_heatmap_reads_the_histogram_as_buckets(dashboard: dict) -> None:
    (panel,) = [p for p in panels(dashboard) if p["title"] == "Entropy distribution over time"]
    assert panel["targets"][0]["format"] == "heatmap" and panel["options"]["calculate"] is False


def test_build_is_deterministic_and_matches_the_committed_json() -> None:
    first, _ = overview.render()
    second, queries = overview.render()
    assert first == second == (REPO / "layerwatch" / "dashboards" / "json" / "overview.json").read_text()
    assert len(queries) >= 30
