"""The "layerwatch / Overview" dashboard, built with grafana-foundation-sdk (Grafana 11.6 flavour).

`layerwatch generate` writes it to layerwatch/dashboards/json/overview.json, which Grafana provisions. Every
query goes through `Panels.query`, so that generation can check that each metric it reads exists
(layerwatch.promql). Shim panels filter on $model and $instance; exporter panels on $model only:
the exporter is one target that aggregates every shim of a model. The Fleet row shows every instance
of the model at once, next to the fleet's roll-ups (docs/fleet.md). The Engine (vLLM) row puts a
vLLM-served model's skip ratio next to vLLM's own latency and throughput series.
"""

from __future__ import annotations

import json

from grafana_foundation_sdk.builders import (
    barchart,
    dashboard,
    heatmap,
    prometheus,
    stat,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import (
    common as common_builders,
)
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from layerwatch.alerts.durations import Timing
from layerwatch.alerts.recorded import GATE_LAYER_IMPORTANCE_FLOOR, Recorded
from layerwatch.alerts.rules import PROFILE_SERIES
from layerwatch.mixin import config

UID = "layerwatch-overview"
TITLE = "layerwatch / Overview"
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
SHIM = 'model_name=~"$model", instance=~"$instance"'
# Exporter series and the profile's series: the model only (the exporter is one target that
# aggregates every shim of a model).
MODEL = 'model_name=~"$model"'
# vLLM's own series (job vllm), labelled with the served model name, the name the plugin's frames carry.
VLLM = f"{config.VLLM_SELECTOR}, {MODEL}"
# NVML's GPU series: the host's devices, with no model_name (a GPU is not one model's).
GPU = 'instance=~"$instance"'
RATE = "[$__rate_interval]"
PROFILE = PROFILE_SERIES


def _in_words(seconds: float) -> str:
    """A window for a title, in words: 3600 -> "1 hour", 90 -> "90 seconds"."""
    for unit, size in (("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {unit}{'' if count == 1 else 's'}"
    return f"{seconds:g} seconds"


class Panels:
    """Panel helpers that record every PromQL query they place, for the metric check."""

    def __init__(self) -> None:
        self.queries: list[tuple[str, str]] = []  # (panel title, expr)
        self._next_id = 1

    def query(
        self,
        title: str,
        expr: str,
        legend: str = "",
        ref: str = "A",
        fmt: PromQueryFormat = PromQueryFormat.TIME_SERIES,
        instant: bool = False,
    ) -> prometheus.Dataquery:
        self.queries.append((title, expr))
        q = (
            prometheus.Dataquery()
            .expr(expr)
            .ref_id(ref)
            .datasource(DATASOURCE)
            .format(fmt)
            .legend_format(legend or "__auto")
        )
        return q.instant() if instant else q.range()

    def row(self, title: str) -> dashboard.Row:
        return dashboard.Row(title).id(self._id())

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _targets(self, title: str, targets: list[tuple[str, str]]) -> list[Builder[variants.Dataquery]]:
        return [self.query(title, expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)]

    def timeseries(
        self,
        title: str,
        description: str,
        unit: str,
        targets: list[tuple[str, str]],
        width: int = 12,
        limits: str = "",
        right_axis_ref: str | None = None,
        bars: bool = False,
    ) -> timeseries.Panel:
        """A time series; series whose legend starts with `limits` are drawn as dashed lines."""
        panel = (
            timeseries.Panel()
            .id(self._id())
            .title(title)
            .description(description)
            .datasource(DATASOURCE)
            .unit(unit)
            .span(width)
            .height(8)
            .targets(self._targets(title, targets))
            .legend(
                common_builders.VizLegendOptions()
                .show_legend(True)
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
            )
        )
        if bars:
            panel = panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(60)
        if limits:
            panel = panel.override_by_regexp(
                f"^{limits}.*",
                [
                    dashboard_models.DynamicConfigValue("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
                    dashboard_models.DynamicConfigValue("color", {"mode": "fixed", "fixedColor": "orange"}),
                ],
            )
        if right_axis_ref:
            panel = panel.override_by_query(
                right_axis_ref,
                [
                    dashboard_models.DynamicConfigValue("custom.axisPlacement", "right"),
                    dashboard_models.DynamicConfigValue("unit", "percentunit"),
                ],
            )
        return panel

    def heatmap(
        self,
        title: str,
        description: str,
        expr: str,
        legend: str,
        cell_unit: str,
        fmt: PromQueryFormat,
        width: int = 12,
    ) -> heatmap.Panel:
        return (
            heatmap.Panel()
            .id(self._id())
            .title(title)
            .description(description)
            .datasource(DATASOURCE)
            .span(width)
            .height(9)
            .with_target(self.query(title, expr, legend, fmt=fmt))
            .calculate(False)
            .color(
                heatmap.HeatmapColorOptions()
                .mode(heatmap_models.HeatmapColorMode.SCHEME)
                .scheme("Spectral")
                .scale(heatmap_models.HeatmapColorScale.EXPONENTIAL)
                .exponent(0.5)
                .steps(64)
            )
            .cell_values(heatmap.CellValues().unit(cell_unit))
            .y_axis(heatmap.YAxisConfig().axis_placement(common.AxisPlacement.LEFT))
            .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.AUTO))
        )

    def stat(
        self,
        title: str,
        description: str,
        targets: list[tuple[str, str]],
        unit: str = "none",
        width: int = 6,
        mappings: list[dashboard_models.ValueMapping] | None = None,
        no_value: str = "",
    ) -> stat.Panel:
        panel = (
            stat.Panel()
            .id(self._id())
            .title(title)
            .description(description)
            .datasource(DATASOURCE)
            .unit(unit)
            .span(width)
            .height(5)
            .targets(self._targets(title, targets))
            .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
            .color_mode(common.BigValueColorMode.VALUE)
            .graph_mode(common.BigValueGraphMode.NONE)
        )
        if mappings:
            panel = panel.mappings(mappings)
        if no_value:
            panel = panel.no_value(no_value)
        return panel


def _verdict_mappings() -> list[dashboard_models.ValueMapping]:
    return [
        dashboard_models.ValueMap(
            options={
                "1": dashboard_models.ValueMappingResult(text="bimodal", color="green", index=0),
                "0": dashboard_models.ValueMappingResult(text="single peak", color="orange", index=1),
            }
        )
    ]


def _routing_mappings() -> list[dashboard_models.ValueMapping]:
    return [
        dashboard_models.ValueMap(
            options={
                "1": dashboard_models.ValueMappingResult(text="dynamic (routes per token)", color="green", index=0),
                "0": dashboard_models.ValueMappingResult(text="static pruning", color="red", index=1),
            }
        )
    ]


def _verdict_column(healthy: str, unhealthy: str, unhealthy_value: str) -> list[dashboard_models.DynamicConfigValue]:
    """A table column of 0/1 verdicts shown as words, the unhealthy one in red."""
    healthy_value = "1" if unhealthy_value == "0" else "0"
    mappings = [
        {
            "type": "value",
            "options": {
                healthy_value: {"text": healthy, "color": "green", "index": 0},
                unhealthy_value: {"text": unhealthy, "color": "red", "index": 1},
            },
        }
    ]
    return [
        dashboard_models.DynamicConfigValue("mappings", mappings),
        dashboard_models.DynamicConfigValue("custom.cellOptions", {"type": "color-text"}),
    ]


def _fleet_verdicts_table(p: Panels, r: Recorded) -> table.Panel:
    """The verdicts of each exporter target of the model, merged into one row per instance."""
    exporter = f"{config.EXPORTER_SELECTOR}, {MODEL}"
    verdicts_title = "Verdicts by instance"
    columns = {"Value #A": "entropy", "Value #B": "routing", "Value #C": "unhealthy"}
    return (
        table.Panel()
        .id(p._id())
        .title(verdicts_title)
        .description(
            "Each exporter target's verdicts now: the entropy histogram's (two humps or a single peak), the "
            "routing verdict's (per-token routing or static pruning), and the flag the fleet count adds up. "
            "An empty cell is a withheld verdict (too little traffic in the window)."
        )
        .datasource(DATASOURCE)
        .span(18)
        .height(5)
        .targets(
            [
                p.query(verdicts_title, expr, ref=ref, fmt=PromQueryFormat.TABLE, instant=True)
                # By instance alone: the merge joins the three on it (a metric name would keep them apart).
                for ref, expr in (
                    ("A", f"max by (instance) (layerwatch_entropy_bimodal{{{exporter}}})"),
                    ("B", f"max by (instance) (layerwatch_routing_dynamic{{{exporter}}})"),
                    ("C", f"max by (instance) ({r.gating_unhealthy}{{{MODEL}}})"),
                )
            ]
        )
        .with_transformation(dashboard_models.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            dashboard_models.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": columns,
                },
            )
        )
        .override_by_name("entropy", _verdict_column("bimodal", "single peak", "0"))
        .override_by_name("routing", _verdict_column("dynamic", "static", "0"))
        .override_by_name("unhealthy", _verdict_column("healthy", "unhealthy", "1"))
        .no_value("no exporter reports the model")
    )


def _fleet_row(d: dashboard.Dashboard, p: Panels, r: Recorded) -> dashboard.Dashboard:
    """Every instance of the selected model at once (not filtered by $instance): the verdicts per
    exporter target, how many are unhealthy, and each shim's skip ratio against the fleet's."""
    d = d.with_row(p.row("Fleet"))
    d = d.with_panel(
        p.stat(
            "Instances unhealthy",
            "Exporter targets of the model whose entropy shape has left its healthy one or whose routing verdict "
            "is static (LayerwatchEntropyShapeChanged, LayerwatchRoutingStatic: those alerts name the instance), "
            "of every target reporting the model. A target whose verdicts are withheld counts as healthy.",
            [
                (f"{r.fleet_gating_unhealthy}{{{MODEL}}}", "unhealthy"),
                (f"{r.fleet_gating_instances}{{{MODEL}}}", "instances"),
            ],
            no_value="no exporter reports the model",
        ).override_by_query(
            "A",
            [
                dashboard_models.DynamicConfigValue(
                    "thresholds",
                    {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}]},
                )
            ],
        )
    )
    d = d.with_panel(_fleet_verdicts_table(p, r))
    d = d.with_panel(
        p.timeseries(
            "Skip ratio: instances and fleet",
            "Every shim's skip ratio next to the fleet's (all layer evaluations of the model's shims: "
            "a busy instance weighs more), with the profile's runaway limit. A model no shim reports: "
            "each exporter's count of the frames it received.",
            "percentunit",
            [
                (f"{r.skip_ratio}{{{MODEL}}}", "{{instance}}"),
                (f"{r.fleet_skip_ratio}{{{MODEL}}}", "fleet"),
                (f"{PROFILE.skip_ratio_runaway}{{{MODEL}}}", "limit: runaway"),
            ],
            width=8,
            limits="limit",
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Fleet latency",
            "p50 and p99 of time to first token and inter-token latency over every shim of the model "
            "(summed histogram buckets).",
            "s",
            [
                (f"histogram_quantile({q}, {buckets}{{{MODEL}}})", f"{what} p{round(q * 100)}")
                for what, buckets in (
                    ("time to first token", r.fleet_time_to_first_token_buckets),
                    ("inter-token", r.fleet_inter_token_latency_buckets),
                )
                for q in (0.5, 0.99)
            ],
            width=8,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Fleet quality",
            "The fleet's shadow agreement (with the profile's minimum) and the p99 of its finished requests' "
            "skip fractions.",
            "percentunit",
            [
                (f"{r.fleet_shadow_agreement_ratio}{{{MODEL}}}", "shadow agreement"),
                (
                    f"histogram_quantile(0.99, {r.fleet_request_skip_fraction_buckets}{{{MODEL}}})",
                    "p99 per-request skip fraction",
                ),
                (f"{PROFILE.shadow_agreement_min}{{{MODEL}}}", "limit: shadow agreement"),
            ],
            width=8,
            limits="limit",
        )
    )
    return d.with_panel(
        p.heatmap(
            "Fleet entropy distribution over time",
            "Gate entropies per 0.05-wide bin per second over every exporter of the model.",
            f"sum by (le) ({r.fleet_entropy_buckets}{{{MODEL}}})",
            "{{le}}",
            "none",
            PromQueryFormat.HEATMAP,
            width=24,
        )
    )


def _vllm_quantiles(metric: str) -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{VLLM}}}{RATE})))", f"p{label}")
        for q, label in ((0.5, "50"), (0.95, "95"), (0.99, "99"))
    ]


def _engine_row(d: dashboard.Dashboard, p: Panels, r: Recorded) -> dashboard.Dashboard:
    """A vLLM-served model: its skip ratio (from the plugin's gate frames) next to vLLM's latency and
    throughput, so that whether skipping made it faster or slower, and at what quality, is on one screen."""
    d = d.with_row(p.row("Engine (vLLM)"))
    d = d.with_panel(
        p.timeseries(
            "Inter-token latency and skip ratio",
            "vLLM's inter-token latency quantiles and the model's skip ratio (right axis, from the gate "
            "frames): more skipping should mean shorter gaps at the same load.",
            "s",
            [
                *_vllm_quantiles("vllm:inter_token_latency_seconds")[::2],
                (f"max({r.skip_ratio}{{{MODEL}}})", "skip ratio"),
            ],
            width=8,
            right_axis_ref="C",
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Time to first token (vLLM)",
            "Queueing plus prefill, which runs at full depth: skipping does not shorten it "
            "(LayerwatchVllmLatencyHigh).",
            "s",
            _vllm_quantiles("vllm:time_to_first_token_seconds"),
            width=8,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "End-to-end request latency (vLLM)",
            "From arrival to the last token; grows with the answer's length.",
            "s",
            _vllm_quantiles("vllm:e2e_request_latency_seconds"),
            width=8,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Quality of the gating",
            "The routing verdict's token-dependent share (LayerwatchRoutingStatic, with the profile's floor) "
            "and the entropy window's distance from the healthy shape (LayerwatchEntropyShapeChanged), from the "
            "plugin's gate frames.",
            "none",
            [
                (f"max(layerwatch_routing_token_dependent_share{{{MODEL}}})", "token-dependent share"),
                (f"max({r.entropy_shape_distance}{{{MODEL}}})", "shape distance"),
                (f"{PROFILE.token_dependent_share_floor}{{{MODEL}}}", "limit: share floor"),
                (f"{PROFILE.entropy_shape_distance_max}{{{MODEL}}}", "limit: shape distance"),
            ],
            width=8,
            limits="limit",
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Requests running and waiting (vLLM)",
            "Sequences in the running batch and in the queue: waiting requests add to the time to first token.",
            "none",
            [
                (f"sum(vllm:num_requests_running{{{VLLM}}})", "running"),
                (f"sum(vllm:num_requests_waiting{{{VLLM}}})", "waiting"),
            ],
            width=8,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Tokens generated (vLLM)",
            "Output tokens per second: the throughput skipping should raise.",
            "none",
            [(f"sum(rate(vllm:generation_tokens_total{{{VLLM}}}{RATE}))", "tokens/s")],
            width=8,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "KV-cache usage (vLLM)",
            "Share of the KV-cache blocks in use; near 1, vLLM preempts sequences.",
            "percentunit",
            [(f"max by (instance) (vllm:kv_cache_usage_perc{{{VLLM}}})", "{{instance}}")],
            width=12,
        )
    )
    return d.with_panel(
        p.timeseries(
            "Preemptions (vLLM)",
            "Sequences preempted per minute for want of KV-cache space (recomputed later, at a latency cost).",
            "none",
            [(f"sum(rate(vllm:num_preemptions_total{{{VLLM}}}{RATE})) * 60", "preemptions / min")],
            width=12,
            bars=True,
        )
    )


def _quality_cost_row(d: dashboard.Dashboard, p: Panels, r: Recorded) -> dashboard.Dashboard:
    """What skipping costs in answer quality, next to how much it skips: the shadow check's agreement,
    nats per token and estimated perplexity increase per shim and for the fleet, and its coverage
    (docs/service.md, "Quality guard")."""
    d = d.with_row(p.row("Quality cost of skipping"))
    d = d.with_panel(
        p.timeseries(
            "Shadow agreement and skip ratio",
            "Share of shadow-checked tokens whose full-depth top-1 token equals the gated model's own top-1 "
            "at generation time (any temperature; LayerwatchShadowAgreementLow), with the profile's minimum, "
            "and the skip ratio (right axis).",
            "percentunit",
            [
                (f"{r.shadow_agreement_ratio}{{{SHIM}}}", "agreement {{instance}}"),
                (f"{r.skip_ratio}{{{SHIM}}}", "skip ratio {{instance}}"),
                (f"{PROFILE.shadow_agreement_min}{{{MODEL}}}", "limit: minimum agreement"),
            ],
            width=6,
            limits="limit",
            right_axis_ref="B",
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Quality cost per token",
            "Nats of KL(gated || full) per shadow-checked token between the gated and the full-depth model's "
            "next-token distributions (a lower bound: the gated top-16 and one bucket for the rest), per shim "
            "and for the fleet, with the profile's limit (LayerwatchShadowQualityCost).",
            "none",
            [
                (f"{r.shadow_kl_per_token}{{{SHIM}}}", "nats/token {{instance}}"),
                (f"{r.fleet_shadow_kl_per_token}{{{MODEL}}}", "nats/token fleet"),
                (f"{PROFILE.shadow_kl_nats_max}{{{MODEL}}}", "limit: quality cost"),
            ],
            width=6,
            limits="limit",
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Estimated perplexity increase",
            "exp(mean KL(full || gated) per shadow-checked token) - 1: the perplexity increase of the gated "
            "model on text the full-depth model writes (a lower bound), per shim and for the fleet. "
            "`layerwatch eval` measures the offline figure on held-out text (docs/service.md).",
            "percentunit",
            [
                (f"{r.shadow_perplexity_increase}{{{SHIM}}}", "{{instance}}"),
                (f"{r.fleet_shadow_perplexity_increase}{{{MODEL}}}", "fleet"),
            ],
            width=6,
        )
    )
    return d.with_panel(
        p.timeseries(
            "Shadow check coverage",
            "Requests sampled for the shadow check per second by outcome (checked, queue_full, failed, "
            "full_depth, no_output), and the shadow rate new gated requests get (right axis): a guard that "
            "checks nothing is blind (LayerwatchQualityGuardBlind).",
            "reqps",
            [
                (f"sum by (outcome) (rate(layerwatch_shadow_requests_total{{{SHIM}}}{RATE}))", "{{outcome}}"),
                (f"max by (instance) (layerwatch_mitigation_shadow_rate{{{SHIM}}})", "shadow rate {{instance}}"),
            ],
            width=6,
            right_axis_ref="B",
        )
    )


def _gate_calibration_row(d: dashboard.Dashboard, p: Panels) -> dashboard.Dashboard:
    """Do the gates rank tokens by how much their layers matter (LayerwatchGateMiscalibrated)? From the
    shadow check's layer signals (docs/service.md, "Layer signals")."""
    d = d.with_row(p.row("Gate calibration"))
    d = d.with_panel(
        p.timeseries(
            "Gate calibration",
            "Within each layer, Spearman's correlation between the gate's score at a token and the layer's "
            "relative residual update on the token that score decides, averaged over the layers whose gates "
            "vary (LayerwatchGateMiscalibrated pages below the profile's floor); and between layers, whether "
            "the layers' mean scores rank like their mean updates (informational). From the shadow check's "
            "full-depth passes; absent until every layer has a full buffer of them.",
            "none",
            [
                (f"layerwatch_gate_importance_correlation{{{SHIM}}}", "within layers {{instance}}"),
                (f"layerwatch_gate_layer_order_correlation{{{SHIM}}}", "between layers {{instance}}"),
                (f"{PROFILE.gate_importance_min}{{{MODEL}}}", "limit: floor"),
            ],
            limits="limit",
        )
    )
    return d.with_panel(
        p.timeseries(
            "Gate calibration per layer",
            "Each layer's own correlation (absent for a gate that barely varies, such as a protected "
            "layer's), with the floor `layerwatch calibrate` measured for it: the alert's description names "
            "the layers below theirs, largest deficit first.",
            "none",
            [
                (f"layerwatch_gate_layer_importance_correlation{{{SHIM}}}", "layer {{layer}} {{instance}}"),
                (f"{GATE_LAYER_IMPORTANCE_FLOOR}{{{MODEL}}}", "limit: floor {{layer}}"),
            ],
            limits="limit",
        )
    )


def _dashboard(p: Panels) -> dashboard.Dashboard:
    """The dashboard's identity, time settings and variables (data source, model, instance)."""
    d = (
        dashboard.Dashboard(TITLE)
        .uid(UID)
        .tags(["layerwatch"])
        .editable()
        .description(
            "Dynamic layer skipping: how much is skipped, whether the gates still decide "
            "(two entropy humps), what it saves and what it costs."
        )
        .time("now-3h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
    )
    d = d.with_variable(
        dashboard.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(dashboard_models.VariableOption(text="Prometheus", value=config.GRAFANA_DATASOURCE_UID))
    )
    # The models a shim serves, those only an exporter hears of (another engine's frames:
    # docs/instrument.md) and those a vLLM serves. Such a model has no shim instance: $instance is then All (".*").
    model_series = ("layerwatch_model_info", "layerwatch_exporter_frames_received_total", "vllm:num_requests_running")
    model_query = f'label_values({{__name__=~"{"|".join(model_series)}"}}, model_name)'
    instance_query = f"label_values(layerwatch_model_info{{{MODEL}}}, instance)"
    p.queries += [
        *(("variable model", name) for name in model_series),
        ("variable instance", f"layerwatch_model_info{{{MODEL}}}"),
    ]
    d = d.with_variable(
        dashboard.QueryVariable("model")
        .label("Model")
        .datasource(DATASOURCE)
        .query(model_query)
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
    )
    return d.with_variable(
        dashboard.QueryVariable("instance")
        .label("Shim instance")
        .datasource(DATASOURCE)
        .query(instance_query)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dashboard_models.VariableOption(text="All", value="$__all"))
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
    )


def _skipping_row(d: dashboard.Dashboard, p: Panels, r: Recorded) -> dashboard.Dashboard:
    """How much the shims skip, per request and per layer, and the forced full-depth episodes."""
    d = d.with_row(p.row("Skipping"))
    d = d.with_panel(
        p.timeseries(
            "Skip ratio",
            "Share of decode-time layer evaluations that skipped the layer (the shims' counts; for a "
            "model no shim reports, the exporter's count of the frames it received), its 1h "
            "baseline (LayerwatchSkipRateSurge), and the runaway limit (LayerwatchRunawaySkipping), "
            "normal ratio and collapse limit (LayerwatchSkippingCollapsed) of the model's profile.",
            "percentunit",
            [
                (f"{r.skip_ratio}{{{SHIM}}}", "{{instance}}"),
                (f"{r.skip_ratio_baseline}{{{SHIM}}}", "1h baseline {{instance}}"),
                (f"{PROFILE.skip_ratio_runaway}{{{MODEL}}}", "limit: runaway"),
                (f"{PROFILE.skip_ratio_normal}{{{MODEL}}}", "limit: normal"),
                (f"{PROFILE.skip_ratio_collapse}{{{MODEL}}}", "limit: collapse"),
            ],
            width=8,
            limits="limit",
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Layers executed per token",
            "Mean and p95 of the layers that ran per decoded token.",
            "none",
            [
                (f"{r.layers_executed_mean}{{{SHIM}}}", "mean {{instance}}"),
                (
                    f"histogram_quantile(0.95, sum by (instance, le) (rate(layerwatch_layers_executed_bucket"
                    f"{{{SHIM}}}{RATE})))",
                    "p95 {{instance}}",
                ),
            ],
            width=8,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Fallbacks",
            "Forced full-depth episodes per minute (LayerwatchRunawaySkipping): the shims' counts; for a model no "
            "shim reports, the count its gate frames carry to the exporter.",
            "none",
            [(f"{r.fallbacks_rate}{{{SHIM}}} * 60", "{{instance}} / min")],
            width=8,
            bars=True,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Per-request skip fraction",
            "Quantiles of the finished requests' skip fractions (each request's skipped share of its decode "
            "layer evaluations) and the shim's runaway cut-off (LayerwatchRequestTailRunaway). A category of "
            "inputs that the gates prune alike shows in p99 long before it moves the model's skip ratio.",
            "percentunit",
            [
                (
                    f"histogram_quantile({q}, sum by (instance, le) (rate(layerwatch_request_skip_fraction_bucket"
                    f"{{{SHIM}}}{RATE})))",
                    f"p{round(q * 100)} {{{{instance}}}}",
                )
                for q in (0.5, 0.9, 0.99)
            ]
            + [(f"max by (instance) (layerwatch_request_runaway_skip_fraction{{{SHIM}}})", "limit: runaway cut-off")],
            width=24,
            limits="limit",
        )
    )
    return d.with_panel(
        p.heatmap(
            "Per-layer skip ratio (layer × time)",
            "Skip ratio of every layer over time. An incident "
            "shows as a few layers (rows) lighting up, like layers 8, 11 and 16 in the field's 21 % → "
            "53 % surge. Layer numbers are zero-padded so that rows sort numerically.",
            f'avg by (layer) (label_replace({r.skip_ratio_by_layer}{{{SHIM}}}, "layer", "0$1", "layer", "([0-9])"))',
            "{{layer}}",
            "percentunit",
            PromQueryFormat.TIME_SERIES,
            width=24,
        )
    )


def _gate_entropy_row(d: dashboard.Dashboard, p: Panels, r: Recorded) -> dashboard.Dashboard:
    """Whether the gates still decide: the entropy bands, the exporter's verdicts and its statistics."""
    d = d.with_row(p.row("Gate entropy"))
    d = d.with_panel(
        p.timeseries(
            "Entropy mean vs healthy band",
            "Mean gate entropy of the layers that ran (the band of "
            "LayerwatchEntropyMeanOutOfBand) and of all layers, with the profile's band.",
            "none",
            [
                (f'{r.entropy_mean_by_decision}{{{MODEL}, decision="run"}}', "mean (ran)"),
                (f"{r.entropy_mean}{{{MODEL}}}", "mean (all layers)"),
                (f"{PROFILE.entropy_mean_low}{{{MODEL}}}", "band low"),
                (f"{PROFILE.entropy_mean_high}{{{MODEL}}}", "band high"),
            ],
            width=8,
            limits="band",
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Entropy std vs healthy band",
            "Standard deviation of the gate entropy of the layers that "
            "ran (LayerwatchEntropySpreadOutOfBand), with the profile's band.",
            "none",
            [
                (f'{r.entropy_std_by_decision}{{{MODEL}, decision="run"}}', "std (ran)"),
                (f"{r.entropy_std}{{{MODEL}}}", "std (all layers)"),
                (f"{PROFILE.entropy_std_low}{{{MODEL}}}", "band low"),
                (f"{PROFILE.entropy_std_high}{{{MODEL}}}", "band high"),
            ],
            width=8,
            limits="band",
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Zero-entropy ratio",
            "Share of gate entropies below 0.01, all layers "
            "(LayerwatchZeroEntropyRatioHigh: warning above the band, page above the page limit).",
            "percentunit",
            [
                (f"{r.entropy_zero_ratio}{{{MODEL}}}", "zero-entropy ratio"),
                (f"{PROFILE.zero_ratio_low}{{{MODEL}}}", "band low"),
                (f"{PROFILE.zero_ratio_high}{{{MODEL}}}", "band high"),
                (f"{PROFILE.zero_ratio_page}{{{MODEL}}}", "band page"),
            ],
            width=8,
            limits="band",
        )
    )
    d = d.with_panel(
        p.stat(
            "Bimodality verdict",
            "The exporter's verdict on its sliding window: two humps or one. For a model whose healthy shape "
            "has two humps (its profile's bimodality), a single peak means gating degraded into static pruning "
            "or noise (LayerwatchEntropyShapeChanged); a model whose healthy shape has one is judged by the shape "
            "distance instead. No value while the window is too small.",
            [(f"layerwatch_entropy_bimodal{{{MODEL}}}", "")],
            mappings=_verdict_mappings(),
            no_value="collecting (window too small)",
            width=6,
        )
    )
    d = d.with_panel(
        p.stat(
            "Routing verdict",
            "Whether skipping still depends on the token (docs/exporter.md, routing): static means most "
            "of the below-threshold scores lie in layers skipped for every token, which the bimodality "
            "verdict cannot see (LayerwatchRoutingStatic). No value while withheld: too few tokens in "
            "the window, or no score below the threshold at all.",
            [(f"layerwatch_routing_dynamic{{{MODEL}}}", "")],
            mappings=_routing_mappings(),
            no_value="withheld",
            width=6,
        )
    )
    d = d.with_panel(
        p.stat(
            "Bimodality statistics",
            "Sarle's bimodality coefficient (above 5/9 suggests two humps), "
            "Hartigan's dip and its p-value, peaks in the 20-bin histogram, entropies in the window.",
            [
                (f"layerwatch_entropy_bimodality_coefficient{{{MODEL}}}", "BC"),
                (f"layerwatch_entropy_dip{{{MODEL}}}", "dip"),
                (f"layerwatch_entropy_dip_p_value{{{MODEL}}}", "dip p-value"),
                (f"layerwatch_entropy_peaks{{{MODEL}}}", "peaks"),
                (f"layerwatch_entropy_window_observations{{{MODEL}}}", "window"),
            ],
            width=12,
        )
    )
    return _entropy_distribution_panels(d, p, r)


def _entropy_distribution_panels(d: dashboard.Dashboard, p: Panels, r: Recorded) -> dashboard.Dashboard:
    """The rest of the Gate entropy row: routing's token-dependent share and the entropy's distribution."""
    d = d.with_panel(
        p.timeseries(
            "Token-dependent share",
            "Share of the window's below-threshold gate scores in layers whose decision varies with the "
            "token (1: all routing, 0: static pruning), with the profile's floor (LayerwatchRoutingStatic). "
            "No value while the routing verdict is withheld.",
            "percentunit",
            [
                (f"layerwatch_routing_token_dependent_share{{{MODEL}}}", "share {{instance}}"),
                (f"{PROFILE.token_dependent_share_floor}{{{MODEL}}}", "limit: floor"),
            ],
            width=8,
            limits="limit",
        )
    )
    d = d.with_panel(
        p.heatmap(
            "Below-threshold rate per layer (layer × time)",
            "Share of the exporter window's tokens whose gate score for the layer was below the "
            "threshold. Routing shows as intermediate rates that move; static pruning as rows stuck at "
            "1 (skipped for every token) next to rows at 0. Layer numbers are zero-padded so that rows "
            "sort numerically.",
            f'avg by (layer) (label_replace(layerwatch_routing_layer_low_ratio{{{MODEL}}}, "layer", "0$1", '
            '"layer", "([0-9])"))',
            "{{layer}}",
            "percentunit",
            PromQueryFormat.TIME_SERIES,
            width=16,
        )
    )
    d = d.with_panel(
        p.heatmap(
            "Entropy distribution over time",
            "Gate entropies per 0.05-wide bin over time. Healthy: the model's recorded shape (the field's: "
            "two bands, redundant layers near 0.05–0.15, key layers near 0.25–0.35).",
            f"sum by (le) (increase(layerwatch_entropy_bucket{{{MODEL}}}{RATE}))",
            "{{le}}",
            "none",
            PromQueryFormat.HEATMAP,
            width=8,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Entropy shape distance",
            "How far the exporter window's entropy distribution lies from the healthy shape the model's profile "
            "records: the largest gap between their shares below a bin edge (0: the same shape, 1: disjoint), with "
            "the profile's limit, the most a healthy window moved (LayerwatchEntropyShapeChanged, trigger shape). "
            "No value for a model whose profile records no histogram, or while the window is too small.",
            "percentunit",
            [
                (f"{r.entropy_shape_distance}{{{MODEL}}}", "distance {{instance}}"),
                (f"{PROFILE.entropy_shape_distance_max}{{{MODEL}}}", "limit: max"),
            ],
            width=8,
            limits="limit",
        )
    )
    shape_title = f"Entropy histogram, last {_in_words(config.RATE_WINDOW)}"
    shape_window = Timing()(config.RATE_WINDOW)
    return d.with_panel(
        barchart.Panel()
        .id(p._id())
        .title(shape_title)
        .description("The latest 20-bin shape of the gate entropy (bin upper bounds on the x axis).")
        .datasource(DATASOURCE)
        .span(8)
        .height(9)
        .with_target(
            p.query(
                shape_title,
                f'sum by (le) (increase(layerwatch_entropy_bucket{{{MODEL}, le!="+Inf"}}[{shape_window}]))',
                "{{le}}",
                fmt=PromQueryFormat.HEATMAP,
                instant=True,
            )
        )
        .with_transformation(
            dashboard_models.DataTransformerConfig(
                id_val="reduce", options={"reducers": ["lastNotNull"], "mode": "seriesToRows"}
            )
        )
        .x_field("Field")
        .show_value(common.VisibilityMode.NEVER)
        .unit("none")
    )


def _energy_row(d: dashboard.Dashboard, p: Panels, r: Recorded) -> dashboard.Dashboard:
    """What skipping saves: energy per token, power next to the skip ratio."""
    d = d.with_row(p.row("Energy"))
    d = d.with_panel(
        p.timeseries(
            "Joules per generated token",
            "Energy of the host's GPUs (NVML) and CPU packages (RAPL), "
            "divided by the tokens the shim generated. Empty where the host exposes neither.",
            "J",
            [
                (f"{r.gpu_joules_per_token}{{{SHIM}}}", "GPU {{instance}}"),
                (f"{r.cpu_joules_per_token}{{{SHIM}}}", "CPU {{instance}}"),
            ],
        )
    )
    return d.with_panel(
        p.timeseries(
            "Power and skip ratio",
            "GPU power draw next to the skip ratio (right axis): skipping "
            "should lower the energy per token, not only the layer count.",
            "watt",
            [
                (f"sum by (instance) (layerwatch_gpu_power_watts{{{GPU}}})", "GPU W {{instance}}"),
                (f"{r.skip_ratio}{{{SHIM}}}", "skip ratio {{instance}}"),
            ],
            right_axis_ref="B",
        )
    )


def _gpu_thermals_row(d: dashboard.Dashboard, p: Panels) -> dashboard.Dashboard:
    """The host's GPUs from NVML: temperature, fans, SM clock, memory."""
    d = d.with_row(p.row("GPU thermals"))
    for title, description, unit, metric, legend in (
        (
            "GPU temperature",
            "Core temperature of each GPU.",
            "celsius",
            "layerwatch_gpu_temperature_celsius",
            "{{instance}} GPU {{gpu}}",
        ),
        (
            "GPU fan speed",
            "Each fan as a share of its maximum; the field reports the fan-speed spread as a benefit of skipping, "
            "so read it next to the skip ratio. Empty for a passively cooled GPU "
            '(layerwatch_gpu_reading_unsupported{reading="fan_speed"} is 1).',
            "percentunit",
            "layerwatch_gpu_fan_speed_ratio",
            "{{instance}} GPU {{gpu}} fan {{fan}}",
        ),
        (
            "GPU SM clock",
            "Streaming-multiprocessor clock: a drop under load at a high temperature or power is throttling.",
            "hertz",
            "layerwatch_gpu_sm_clock_hertz",
            "{{instance}} GPU {{gpu}}",
        ),
        (
            "GPU memory used",
            "Memory in use on each GPU, by every process on it.",
            "bytes",
            "layerwatch_gpu_memory_used_bytes",
            "{{instance}} GPU {{gpu}}",
        ),
    ):
        d = d.with_panel(
            p.timeseries(
                title,
                f"{description} From NVML; empty where the host has no GPU (layerwatch_nvml_up is 0).",
                unit,
                [(f"{metric}{{{GPU}}}", legend)],
                width=6,
            )
        )
    return d


def _latency_row(d: dashboard.Dashboard, p: Panels) -> dashboard.Dashboard:
    """Quantiles of time to first token and inter-token latency."""
    d = d.with_row(p.row("Latency"))
    for title, metric in (
        ("Time to first token", "layerwatch_time_to_first_token_seconds"),
        ("Inter-token latency", "layerwatch_inter_token_latency_seconds"),
    ):
        d = d.with_panel(
            p.timeseries(
                title,
                f"p50, p95 and p99 of {metric}.",
                "s",
                [
                    (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SHIM}}}{RATE})))", f"p{label}")
                    for q, label in ((0.5, "50"), (0.95, "95"), (0.99, "99"))
                ],
            )
        )
    return d


def _telemetry_row(d: dashboard.Dashboard, p: Panels, r: Recorded) -> dashboard.Dashboard:
    """Whether the gate frames arrive, and the alerts firing now."""
    d = d.with_row(p.row("Quality and telemetry"))
    d = d.with_panel(
        p.timeseries(
            "Telemetry loss",
            "Share of gate frames lost in transit (the exporter's sequence gaps) and dropped by the shims "
            "(never sent); LayerwatchTelemetryLoss.",
            "percentunit",
            [
                (f"{r.telemetry_loss_ratio}{{{MODEL}}}", "lost {{instance}}"),
                (f"{r.telemetry_drop_ratio}{{{MODEL}}}", "dropped {{instance}}"),
            ],
            width=8,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Gate frames",
            "Frames per second sent by the shims, received, lost, malformed and interleaved (two shims "
            "under one shim id; LayerwatchShimIdCollision) at the exporter, and dropped by the shims "
            "(never blocking decoding).",
            "none",
            [
                (f"sum(rate(layerwatch_telemetry_frames_sent_total{{{SHIM}}}{RATE}))", "sent"),
                (f"sum(rate(layerwatch_exporter_frames_received_total{{{MODEL}}}{RATE}))", "received"),
                (f"sum(rate(layerwatch_exporter_frames_lost_total{{{MODEL}}}{RATE}))", "lost"),
                (
                    f"sum by (reason) (rate(layerwatch_telemetry_frames_dropped_total{{{SHIM}}}{RATE}))",
                    "dropped: {{reason}}",
                ),
                (f"sum(rate(layerwatch_exporter_frames_malformed_total{RATE}))", "malformed"),
                (f"sum(rate(layerwatch_exporter_frames_interleaved_total{{{MODEL}}}{RATE}))", "interleaved"),
            ],
            width=8,
        )
    )
    d = d.with_panel(
        p.timeseries(
            "Rejected gate frames",
            "Frames per second each exporter decoded but refused, by reason (bad or missing tag, a changed "
            "layer count, beyond --max-models or --max-layers): counted in no statistic of any model, "
            "hence not filtered by model; LayerwatchFramesRejected.",
            "none",
            [
                (
                    f"sum by (instance, reason) (rate(layerwatch_exporter_frames_rejected_total{RATE}))",
                    "{{reason}} {{instance}}",
                )
            ],
            width=8,
        )
    )
    alerts_title = "Firing alerts"
    return d.with_panel(
        table.Panel()
        .id(p._id())
        .title(alerts_title)
        .description("layerwatch alerts firing now; see docs/runbooks.md for each.")
        .datasource(DATASOURCE)
        .span(24)
        .height(7)
        .with_target(
            p.query(
                alerts_title,
                'ALERTS{alertstate="firing", alertname=~"Layerwatch.+"}',
                fmt=PromQueryFormat.TABLE,
                instant=True,
            )
        )
        .with_transformation(
            dashboard_models.DataTransformerConfig(
                id_val="organize",
                options={"excludeByName": {"Time": True, "Value": True, "__name__": True, "alertstate": True}},
            )
        )
        .no_value("nothing firing")
    )


def build() -> tuple[dict, list[tuple[str, str]]]:
    """The dashboard as JSON-ready data, and every (panel, query) it holds."""
    r = Recorded.for_timing(Timing())
    p = Panels()
    d = _dashboard(p)
    d = _fleet_row(d, p, r)
    d = _skipping_row(d, p, r)
    d = _engine_row(d, p, r)
    d = _quality_cost_row(d, p, r)
    d = _gate_entropy_row(d, p, r)
    d = _energy_row(d, p, r)
    d = _gpu_thermals_row(d, p)
    d = _latency_row(d, p)
    d = _gate_calibration_row(d, p)
    d = _telemetry_row(d, p, r)

    data = json.loads(JSONEncoder(sort_keys=True).encode(d.build()))
    return data, p.queries


def render() -> tuple[str, list[tuple[str, str]]]:
    data, queries = build()
    return json.dumps(data, indent=2, sort_keys=True) + "\n", queries
