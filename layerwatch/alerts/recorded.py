"""Names of the recorded series (the recording rules of layerwatch/alerts/rules.py), for one timing.

The alerts (layerwatch/alerts/specs.py) and the dashboard read the derived series under these names; a name
follows its window, so a scaled rendering renames them (`mean_rate5m` -> `mean_rate3s`).
"""

from __future__ import annotations

from dataclasses import dataclass

from layerwatch.alerts.durations import Timing
from layerwatch.mixin import config

# Recording rules aggregate by the target labels and the model: an alert then names the shim or
# exporter it comes from (Alertmanager groups and inhibits on them).
BY_TARGET = ", ".join(config.TARGET_LABELS)
BY_MODEL = f"{BY_TARGET}, model_name"
# Fleet roll-ups drop the instance: one series per model across every shim (or exporter) of it. The
# job stays, so the shim's and the exporter's sides of a model stay apart.
BY_FLEET = "job, model_name"
# A profile's per-layer gate-importance floors, one constant series per layer (labels model_name and
# layer; layerwatch/alerts/rules.py records them, LayerwatchGateMiscalibrated and the dashboard read them).
GATE_LAYER_IMPORTANCE_FLOOR = "model_name_layer:layerwatch_profile_gate_layer_importance:floor"
# A profile's healthy entropy shape: the share of its entropies below each edge, one constant series per
# edge (labels model_name and edge, as layerwatch_entropy_window_below_ratio's).
ENTROPY_BELOW_HEALTHY = "model_name_edge:layerwatch_profile_entropy_below:healthy"


@dataclass(frozen=True)
class Recorded:
    """Names of the recorded series for one timing."""

    entropy_mean: str
    entropy_std: str
    entropy_zero_ratio: str
    entropy_mean_by_decision: str
    entropy_std_by_decision: str
    entropy_zero_ratio_by_decision: str
    skip_ratio: str
    skip_ratio_by_layer: str
    skip_ratio_baseline: str
    layers_executed_mean: str
    fallbacks_rate: str
    gpu_joules_per_token: str
    cpu_joules_per_token: str
    shadow_agreement_ratio: str
    shadow_kl_per_token: str  # nats of KL(gated || full) per shadow-checked token: the quality cost
    shadow_perplexity_increase: str  # exp(mean KL(full || gated)) - 1
    telemetry_loss_ratio: str  # frames lost in transit, at the exporter
    telemetry_drop_ratio: str  # frames the shim could not send
    request_skip_tail_ratio: str  # by le: share of finished requests whose skip fraction is above le
    runaway_skip_ratio_by_layer: str  # skipped share of the runaway requests' tokens, per layer
    # The exporter window's shape distance from the profile's healthy shape (models with a recorded one).
    entropy_shape_distance: str
    # Per exporter target: 1 while a LayerwatchEntropyShapeChanged rule's condition holds (before its `for:`).
    entropy_shape_changed: str
    # Verdicts per exporter target: 1 = shape changed or static routing, 0 = neither (or withheld).
    gating_unhealthy: str
    # The fleet (BY_FLEET): how many exporter targets of a model are unhealthy, of how many.
    fleet_gating_unhealthy: str
    fleet_gating_instances: str
    fleet_skip_ratio: str
    fleet_shadow_agreement_ratio: str
    fleet_shadow_kl_per_token: str
    fleet_shadow_perplexity_increase: str
    # Summed histogram buckets (rates by le), for fleet-wide quantiles and distributions.
    fleet_entropy_buckets: str
    fleet_request_skip_fraction_buckets: str
    fleet_time_to_first_token_buckets: str
    fleet_inter_token_latency_buckets: str

    @classmethod
    def for_timing(cls, timing: Timing) -> Recorded:
        rate = "rate" + timing(config.RATE_WINDOW)
        baseline = "avg_over_time" + timing(config.SKIP_BASELINE_WINDOW)
        return cls(
            entropy_mean=f"model_name:layerwatch_entropy:mean_{rate}",
            entropy_std=f"model_name:layerwatch_entropy:stddev_{rate}",
            entropy_zero_ratio=f"model_name:layerwatch_entropy_zero:ratio_{rate}",
            entropy_mean_by_decision=f"model_name_decision:layerwatch_entropy:mean_{rate}",
            entropy_std_by_decision=f"model_name_decision:layerwatch_entropy:stddev_{rate}",
            entropy_zero_ratio_by_decision=f"model_name_decision:layerwatch_entropy_zero:ratio_{rate}",
            skip_ratio=f"model_name:layerwatch_layer_skips:ratio_{rate}",
            skip_ratio_by_layer=f"model_name_layer:layerwatch_layer_skips:ratio_{rate}",
            skip_ratio_baseline=f"model_name:layerwatch_layer_skips:ratio_{rate}_{baseline}",
            layers_executed_mean=f"model_name:layerwatch_layers_executed:mean_{rate}",
            fallbacks_rate=f"model_name:layerwatch_fallbacks:{rate}",
            gpu_joules_per_token=f"model_name:layerwatch_gpu_energy_joules_per_decode_token:ratio_{rate}",
            cpu_joules_per_token=f"model_name:layerwatch_cpu_energy_joules_per_decode_token:ratio_{rate}",
            shadow_agreement_ratio=f"model_name:layerwatch_shadow_agreements:ratio_{rate}",
            shadow_kl_per_token=f"model_name:layerwatch_shadow_kl_nats:per_token_{rate}",
            shadow_perplexity_increase=f"model_name:layerwatch_shadow_reverse_kl_nats:perplexity_increase_{rate}",
            telemetry_loss_ratio=f"model_name:layerwatch_exporter_frames_lost:ratio_{rate}",
            telemetry_drop_ratio=f"model_name:layerwatch_telemetry_frames_dropped:ratio_{rate}",
            request_skip_tail_ratio=f"model_name_le:layerwatch_request_skip_fraction:tail_ratio_{rate}",
            runaway_skip_ratio_by_layer=f"model_name_layer:layerwatch_request_runaway_layer_skips:ratio_{rate}",
            entropy_shape_distance="model_name:layerwatch_entropy_window_below:shape_distance",
            entropy_shape_changed="model_name:layerwatch_entropy_shape:changed",
            gating_unhealthy="model_name:layerwatch_gating_unhealthy:bool",
            fleet_gating_unhealthy="job_model_name:layerwatch_gating_unhealthy:sum",
            fleet_gating_instances="job_model_name:layerwatch_gating_instances:count",
            fleet_skip_ratio=f"job_model_name:layerwatch_layer_skips:ratio_{rate}",
            fleet_shadow_agreement_ratio=f"job_model_name:layerwatch_shadow_agreements:ratio_{rate}",
            fleet_shadow_kl_per_token=f"job_model_name:layerwatch_shadow_kl_nats:per_token_{rate}",
            fleet_shadow_perplexity_increase=(
                f"job_model_name:layerwatch_shadow_reverse_kl_nats:perplexity_increase_{rate}"
            ),
            fleet_entropy_buckets=f"job_model_name_le:layerwatch_entropy_bucket:{rate}",
            fleet_request_skip_fraction_buckets=f"job_model_name_le:layerwatch_request_skip_fraction_bucket:{rate}",
            fleet_time_to_first_token_buckets=f"job_model_name_le:layerwatch_time_to_first_token_seconds_bucket:{rate}",
            fleet_inter_token_latency_buckets=f"job_model_name_le:layerwatch_inter_token_latency_seconds_bucket:{rate}",
        )
