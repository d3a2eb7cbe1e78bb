"""Every metric layerwatch exposes, in one place.

The shim and the exporter create their metrics from these specs, all through one adapter
(layerwatch/prometheus.py); docs/metrics.md is generated from them, and the dashboard generator
refuses a panel that queries a name not defined here or by a recording rule. A test compares each
live `/metrics` page against this catalog, so it cannot drift.

Names and labels are public (dashboards and rules read them): change none. A help text is one short
clause, its unit and bound; the detail lives in the docs page it names. Counter names carry their
`_total` suffix here, as exposed; `prometheus_client` wants it stripped when the metric object is
created (see `base_name`).
"""

from __future__ import annotations

from dataclasses import dataclass

SHIM = "shim"
EXPORTER = "exporter"

# 20 equal buckets over [0, 1]: le = 0.05, 0.10, ... 0.95, 1.0 (docs/metrics.md).
ENTROPY_BUCKETS: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(1, 21))
# The `edge` labels of layerwatch_entropy_window_below_ratio: the inner edges of the 20 bins.
ENTROPY_WINDOW_EDGES: tuple[str, ...] = tuple(f"{edge:g}" for edge in ENTROPY_BUCKETS[:-1])
# An entropy below this counts as a "zero-entropy" layer (docs/metrics.md: layerwatch_entropy_zero_total).
ZERO_ENTROPY_LIMIT = 0.01
# Each layer's gate-importance correlation is computed over the last this many (gate score, update)
# pairs of the shadow check, and exported once that many were measured (docs/service.md, "Layer
# signals": the size comes from the correlation's noise and the demo's shadow throughput).
GATE_LAYER_SAMPLES = 1024
# A layer's gate counts in the gate-importance correlation only if its scores over those pairs have at
# least this standard deviation: one that scores every token alike ranks none (docs/service.md).
MIN_GATE_SCORE_STD = 0.01
# The shim's audit-trail spans waiting for export, at most (the OTel SDK's default queue); beyond it
# a newly ended span is dropped and counted (docs/service.md, "Audit trail").
AUDIT_QUEUE_SPANS = 2048

LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# Per-request fractions (skip fraction, token-dependent share): le = 0, 0.05, ... 0.95, 1.0. Every
# cut-off a profile may use (layerwatch/alerts/profile.py: request_tail) is one of these edges, so the share of
# requests above it is read straight from one bucket: the default 0.5 (below), the field's fallback
# trigger 0.85 (docs/alerting.md, "The field's reports"), the demo model's 0.35, and 0.05 / 0.95
# (the routing statistics' static lines). le="0" holds the requests that skipped nothing (fewer
# decode tokens than the patience) or, for the share, whose skipping was all static.
REQUEST_FRACTION_BUCKETS: tuple[float, ...] = (0.0, *(round(0.05 * i, 2) for i in range(1, 21)))
# The shim's default cut-off of a runaway request (`layerwatch serve --request-runaway-fraction`,
# when the served model has no profile) and a profile's default: in the field's incident the skip
# ratio went from a healthy 21 % to 53 %, more than half (docs/alerting.md, "The field's reports").
DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION = 0.5
# How a shadow-sampled request ended (the shim's service/shadow.py, the vLLM guard): its `outcome` label.
SHADOW_OUTCOMES = ("checked", "queue_full", "failed", "full_depth", "no_output")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # exposed name; counters end in _total
    kind: str  # "counter" | "gauge" | "histogram"
    labels: tuple[str, ...]  # bounded labels only (no request ids, prompts or the like)
    help: str
    component: str  # SHIM or EXPORTER
    buckets: tuple[float, ...] | None = None  # histograms only; None = per-model (layers 0..L)

    @property
    def base_name(self) -> str:
        """The name prometheus_client wants: counters without `_total`."""
        if self.kind == "counter":
            return self.name.removesuffix("_total")
        return self.name

    @property
    def series_names(self) -> tuple[str, ...]:
        """Every sample name this metric produces on a /metrics page."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _m(name, kind, labels, help, component, buckets=None) -> MetricSpec:
    return MetricSpec(name, kind, tuple(labels), help, component, buckets)


METRICS: tuple[MetricSpec, ...] = (
    # --- shim: what is served --------------------------------------------------------------
    _m(
        "layerwatch_model_info",
        "gauge",
        (
            "model_name",
            "layers",
            "dtype",
            "quantization",
            "threshold",
            "patience",
            "skip_rule",
            "ewma_alpha",
            "kv_policy",
            "gates_sha256",
        ),
        "What is being served (always 1): serve's dtype, quantization, skip and KV policy (ewma_alpha empty under "
        "streak), the gate weights' hash.",
        SHIM,
    ),
    _m(
        "layerwatch_gate_file_reloads_total",
        "counter",
        ("model_name", "status"),
        "Gate file replacements judged while serving, by status: loaded, or rejected (the loaded gates keep serving).",
        SHIM,
    ),
    _m(
        "layerwatch_gate_file_rejected",
        "gauge",
        ("model_name",),
        "1 while the gate file on disk is one that was rejected (the previously loaded gates serve), else 0.",
        SHIM,
    ),
    _m(
        "layerwatch_requests_total",
        "counter",
        ("model_name", "status"),
        "Finished requests by status (ok, client_error, server_error, cancelled).",
        SHIM,
    ),
    _m(
        "layerwatch_http_connections_refused_total",
        "counter",
        ("model_name", "reason"),
        "Requests refused unread and connections closed, by reason: head_too_large (431), malformed_head (400), "
        "ambiguous_framing (400), head_timeout (408), evicted, too_many_connections (503), send_timeout "
        "(docs/service.md, Connections).",
        SHIM,
    ),
    _m(
        "layerwatch_requests_running",
        "gauge",
        ("model_name",),
        "Batch slots held by generation requests (decoding) right now: a sequence (prompt × choice) each.",
        SHIM,
    ),
    _m(
        "layerwatch_requests_waiting",
        "gauge",
        ("model_name",),
        "Batch slots admitted generation requests want but do not hold yet (429 at --max-batch-size + "
        "--max-waiting-requests).",
        SHIM,
    ),
    _m(
        "layerwatch_tokens_total",
        "counter",
        ("model_name", "phase"),
        "Prompt tokens (phase=prefill) and generated tokens (phase=decode).",
        SHIM,
    ),
    # --- shim: skipping ----------------------------------------------------------------------
    _m(
        "layerwatch_layer_evaluations_total",
        "counter",
        ("model_name", "layer"),
        "Decode-time gate decisions for the layer (one per decoded token).",
        SHIM,
    ),
    _m(
        "layerwatch_layer_skips_total",
        "counter",
        ("model_name", "layer"),
        "Decode-time gate decisions that skipped the layer.",
        SHIM,
    ),
    _m(
        "layerwatch_layer_skips_executed_total",
        "counter",
        ("model_name", "layer"),
        "Decode-time evaluations for which the layer did not run (what saves time and power); the gate decisions "
        "are layerwatch_layer_skips_total.",
        SHIM,
    ),
    _m(
        "layerwatch_layer_unneeded_runs_total",
        "counter",
        ("model_name", "layer"),
        "Decode-time evaluations whose gate decision skipped the layer but that ran it for the whole batch "
        "(docs/model.md, Depth execution).",
        SHIM,
    ),
    _m(
        "layerwatch_layers_executed",
        "histogram",
        ("model_name",),
        "Layers that ran, per decoded token (buckets 0..L).",
        SHIM,
    ),
    _m(
        "layerwatch_batch_layer_steps_total",
        "counter",
        ("model_name", "layer"),
        "Decode steps (whole batch) that evaluated the layer's gate.",
        SHIM,
    ),
    _m(
        "layerwatch_batch_layer_skips_total",
        "counter",
        ("model_name", "layer"),
        "Decode steps where every sequence of the batch skipped the layer (only these save weight reads).",
        SHIM,
    ),
    _m(
        "layerwatch_fallbacks_total",
        "counter",
        ("model_name", "reason"),
        "Forced full-depth episodes (reason=high_skipping).",
        SHIM,
    ),
    # --- shim: skipping per request (the tail a small category of traffic lives in) -----------
    _m(
        "layerwatch_request_skip_fraction",
        "histogram",
        ("model_name",),
        "Per finished request (ok or cancelled) with decode tokens: the share of its decode layer evaluations skipped.",
        SHIM,
        REQUEST_FRACTION_BUCKETS,
    ),
    _m(
        "layerwatch_request_token_dependent_share",
        "histogram",
        ("model_name",),
        "Per finished request of 32 decode tokens or more, a score below the threshold: the token-dependent share "
        "of its skipping (0 = all static).",
        SHIM,
        REQUEST_FRACTION_BUCKETS,
    ),
    _m(
        "layerwatch_request_runaway_layer_skips_total",
        "counter",
        ("model_name", "layer"),
        "Skipped decode evaluations of the layer in requests whose skip fraction exceeded the runaway "
        "cut-off (layerwatch_request_runaway_skip_fraction).",
        SHIM,
    ),
    _m(
        "layerwatch_request_runaway_tokens_total",
        "counter",
        ("model_name",),
        "Decode tokens of requests whose skip fraction exceeded the runaway cut-off.",
        SHIM,
    ),
    _m(
        "layerwatch_request_runaway_skip_fraction",
        "gauge",
        ("model_name",),
        "The runaway cut-off (serve --request-runaway-fraction): the skip fraction above which a request is runaway.",
        SHIM,
    ),
    # --- shim: the depth each request runs at (docs/service.md, "Depth per request") ------------------------
    _m(
        "layerwatch_depth_decisions_total",
        "counter",
        ("model_name", "mode", "reason"),
        "Requests that ran (ok or cancelled) by depth: mode=full, strict or gated; reason=override, rollout, "
        "request, prompt_length, complexity or default (docs/service.md, Depth per request).",
        SHIM,
    ),
    _m(
        "layerwatch_request_threshold",
        "histogram",
        ("model_name",),
        "Per request that ran (status ok or cancelled): the skip threshold it ran at (0 = full depth).",
        SHIM,
        REQUEST_FRACTION_BUCKETS,
    ),
    _m(
        "layerwatch_prompt_complexity",
        "histogram",
        ("model_name",),
        "Per prefilled request: its prompt's complexity score (docs/service.md, Depth per request), with or without "
        "--complexity-cutoff.",
        SHIM,
        REQUEST_FRACTION_BUCKETS,
    ),
    _m(
        "layerwatch_rollout_level",
        "gauge",
        ("model_name",),
        "The staged rollout's current level, from 1 (--rollout-levels); 0 without levels (skipping enabled "
        "for every request).",
        SHIM,
    ),
    _m(
        "layerwatch_rollout_demotions_total",
        "counter",
        ("model_name",),
        "Drops to the previous rollout level (DepthDecider.demote, e.g. on a paging alert).",
        SHIM,
    ),
    # --- shim: latency -----------------------------------------------------------------------
    _m(
        "layerwatch_time_to_first_token_seconds",
        "histogram",
        ("model_name",),
        "Time from request arrival to its first generated token.",
        SHIM,
        LATENCY_BUCKETS,
    ),
    _m(
        "layerwatch_inter_token_latency_seconds",
        "histogram",
        ("model_name",),
        "Time between consecutive generated tokens of a request.",
        SHIM,
        LATENCY_BUCKETS,
    ),
    _m(
        "layerwatch_request_duration_seconds",
        "histogram",
        ("model_name",),
        "Time from request arrival to its end.",
        SHIM,
        LATENCY_BUCKETS,
    ),
    # --- shim: power -------------------------------------------------------------------------
    _m(
        "layerwatch_gpu_energy_joules_total",
        "counter",
        ("gpu", "uuid"),
        "GPU energy from NVML, made monotonic across driver resets.",
        SHIM,
    ),
    _m("layerwatch_gpu_power_watts", "gauge", ("gpu", "uuid"), "GPU power draw from NVML.", SHIM),
    _m(
        "layerwatch_nvml_up",
        "gauge",
        (),
        "1 when NVML readings work on this host, 0 otherwise (no GPU is a normal state).",
        SHIM,
    ),
    # --- shim: GPU thermals and clocks, from NVML (docs/service.md, "Power and thermals") ---------
    _m(
        "layerwatch_gpu_temperature_celsius",
        "gauge",
        ("gpu", "uuid"),
        "GPU core temperature from NVML.",
        SHIM,
    ),
    _m(
        "layerwatch_gpu_fan_speed_ratio",
        "gauge",
        ("gpu", "uuid", "fan"),
        "Fan speed from NVML as a fraction of the fan's maximum (above 1 where the board allows it).",
        SHIM,
    ),
    _m(
        "layerwatch_gpu_sm_clock_hertz",
        "gauge",
        ("gpu", "uuid"),
        "Current streaming-multiprocessor clock from NVML.",
        SHIM,
    ),
    _m(
        "layerwatch_gpu_memory_used_bytes",
        "gauge",
        ("gpu", "uuid"),
        "GPU memory in use from NVML (every process on the device, not only the shim).",
        SHIM,
    ),
    _m(
        "layerwatch_gpu_reading_unsupported",
        "gauge",
        ("gpu", "uuid", "reading"),
        "1 when NVML says this GPU does not offer the reading (no fans on a passively cooled GPU), else 0.",
        SHIM,
    ),
    _m(
        "layerwatch_gpu_reading_errors_total",
        "counter",
        ("gpu", "uuid", "reading"),
        "Scrapes at which one NVML reading of a GPU failed while its other readings were exported.",
        SHIM,
    ),
    _m(
        "layerwatch_cpu_energy_joules_total",
        "counter",
        ("zone",),
        "CPU package energy from RAPL, where readable (wrap-around handled).",
        SHIM,
    ),
    # --- shim: quality and telemetry -----------------------------------------------------------
    _m(
        "layerwatch_shadow_tokens_total",
        "counter",
        ("model_name",),
        "Generated tokens compared with the full-depth model by the shadow quality check (teacher-forced, "
        "any sampling settings).",
        SHIM,
    ),
    _m(
        "layerwatch_shadow_agreements_total",
        "counter",
        ("model_name",),
        "Shadow-checked tokens at which the full-depth model's top-1 token equals the gated model's (argmax of its "
        "raw logits).",
        SHIM,
    ),
    _m(
        "layerwatch_shadow_kl_nats_total",
        "counter",
        ("model_name",),
        "Quality cost: sum over shadow-checked tokens of KL(gated || full) in nats over the gated top-K tokens and "
        "the rest (K = 16), a lower bound (docs/service.md, Quality guard).",
        SHIM,
    ),
    _m(
        "layerwatch_shadow_reverse_kl_nats_total",
        "counter",
        ("model_name",),
        "Sum over shadow-checked tokens of KL(full || gated) in nats, as the forward one; exp(its mean) - 1 "
        "estimates the perplexity increase.",
        SHIM,
    ),
    _m(
        "layerwatch_shadow_requests_total",
        "counter",
        ("model_name", "outcome"),
        "Requests sampled for the shadow check, by outcome: checked, queue_full (64 waiting), failed, full_depth "
        "(nothing gated to check), no_output.",
        SHIM,
    ),
    # --- shim: alert-driven mitigation (docs/service.md, "Alert-driven mitigation") --------------
    _m(
        "layerwatch_mitigation_webhook_requests_total",
        "counter",
        ("model_name", "outcome"),
        "Requests to the mitigation receiver by outcome: accepted, unauthorized, malformed, too_large, not_found, "
        "too_many_connections (503), shutting_down (503, not applied).",
        SHIM,
    ),
    _m(
        "layerwatch_mitigation_alerts_total",
        "counter",
        ("model_name", "outcome"),
        "Alerts in accepted webhook requests by outcome: started, ended, unchanged (a repeat), stale (out of "
        "order), other_model, not_mitigating.",
        SHIM,
    ),
    _m(
        "layerwatch_mitigations_started_total",
        "counter",
        ("model_name", "alertname"),
        "Mitigations started by an alert firing for this model.",
        SHIM,
    ),
    _m(
        "layerwatch_mitigations_ended_total",
        "counter",
        ("model_name", "reason"),
        "Mitigations ended, by reason: resolved, requests (budget spent), time, operator (DELETE /mitigations), "
        "evicted (over 1000 alerts known), shutdown.",
        SHIM,
    ),
    _m(
        "layerwatch_mitigations_active",
        "gauge",
        ("model_name",),
        "Mitigations in effect now (one per firing alert, until it resolves or its budget runs out).",
        SHIM,
    ),
    _m(
        "layerwatch_mitigation_shadow_rate",
        "gauge",
        ("model_name",),
        "The shadow check rate of new gated requests: 1 during a mitigation (0 when it forces full depth), else "
        "--shadow-rate.",
        SHIM,
    ),
    _m(
        "layerwatch_mitigation_full_depth",
        "gauge",
        ("model_name",),
        "1 while a mitigation forces new requests to full depth (--mitigation-full-depth), else 0.",
        SHIM,
    ),
    _m(
        "layerwatch_mitigated_requests_total",
        "counter",
        ("model_name",),
        "Requests admitted while a mitigation was in effect (each takes one from every active mitigation's budget).",
        SHIM,
    ),
    # --- shim: layer signals, measured on the shadow check's full-depth pass (docs/service.md) ---
    _m(
        "layerwatch_layer_signal_tokens_total",
        "counter",
        ("model_name", "layer"),
        "Shadow-checked tokens whose layer signals were measured (the count behind the update and attention KL sums).",
        SHIM,
    ),
    _m(
        "layerwatch_layer_relative_update_sum_total",
        "counter",
        ("model_name", "layer"),
        "Sum over shadow-checked tokens of the layer's relative residual update norm(dh) / norm(h).",
        SHIM,
    ),
    _m(
        "layerwatch_layer_attention_kl_sum_total",
        "counter",
        ("model_name", "layer"),
        "Sum over shadow-checked tokens of the layer's attention KL from uniform in nats, mean over heads.",
        SHIM,
    ),
    _m(
        "layerwatch_gate_importance_correlation",
        "gauge",
        ("model_name",),
        "Within-layer gate calibration: the mean of layerwatch_gate_layer_importance_correlation over the layers "
        "that have one; absent until one does.",
        SHIM,
    ),
    _m(
        "layerwatch_gate_importance_samples",
        "gauge",
        ("model_name",),
        "(gate score, next update) pairs held for the gate-importance correlations, all layers together "
        f"(at most {GATE_LAYER_SAMPLES} per layer).",
        SHIM,
    ),
    _m(
        "layerwatch_gate_importance_layers",
        "gauge",
        ("model_name",),
        "Layers behind layerwatch_gate_importance_correlation (full buffer, gate scores that vary).",
        SHIM,
    ),
    _m(
        "layerwatch_gate_layer_importance_correlation",
        "gauge",
        ("model_name", "layer"),
        "Spearman correlation of the layer's gate score with its relative update at the next position, over its "
        f"last {GATE_LAYER_SAMPLES} shadow-checked positions; absent before then or while the scores vary by less "
        f"than {MIN_GATE_SCORE_STD}.",
        SHIM,
    ),
    _m(
        "layerwatch_gate_layer_importance_samples",
        "gauge",
        ("model_name", "layer"),
        f"(gate score, next update) pairs held for the layer's correlation (at most {GATE_LAYER_SAMPLES}).",
        SHIM,
    ),
    _m(
        "layerwatch_gate_layer_order_correlation",
        "gauge",
        ("model_name",),
        "Between layers: Spearman correlation of the layers' mean gate score and mean relative update; absent with "
        "fewer than two full layers.",
        SHIM,
    ),
    _m(
        "layerwatch_scrape_collector_success",
        "gauge",
        ("collector",),
        "1 if the shim's collector produced its metrics in this scrape, else 0 (its metrics missing, the reason "
        "logged).",
        SHIM,
    ),
    _m(
        "layerwatch_scrape_collector_duration_seconds",
        "gauge",
        ("collector",),
        "Time the shim's collector took in this scrape.",
        SHIM,
    ),
    _m("layerwatch_telemetry_frames_sent_total", "counter", ("model_name",), "Gate frames sent to the exporter.", SHIM),
    _m(
        "layerwatch_telemetry_frames_dropped_total",
        "counter",
        ("model_name", "reason"),
        "Gate frames not sent (reason=send_error, too_large or invalid); sending never blocks decoding.",
        SHIM,
    ),
    _m(
        "layerwatch_trace_lines_written_total",
        "counter",
        ("model_name",),
        "Trace lines written to --trace-file (0 without one).",
        SHIM,
    ),
    _m(
        "layerwatch_trace_lines_dropped_total",
        "counter",
        ("model_name", "reason"),
        "Trace lines not written, by reason: max_bytes (--trace-max-bytes) or write_error; either stops tracing for "
        "good.",
        SHIM,
    ),
    _m(
        "layerwatch_audit_spans_total",
        "counter",
        ("model_name", "outcome"),
        "Audit spans (--otlp-endpoint) by outcome: exported, failed (spans lost), dropped (the queue full).",
        SHIM,
    ),
    _m(
        "layerwatch_audit_spans_queued",
        "gauge",
        ("model_name",),
        f"Audit-trail spans waiting for export or being exported (at most {AUDIT_QUEUE_SPANS}: beyond, new ones "
        "are dropped).",
        SHIM,
    ),
    # --- exporter: entropy statistics -----------------------------------------------------------
    _m(
        "layerwatch_entropy",
        "histogram",
        ("model_name", "decision"),
        "Every decode-time gate entropy, by decision (run or skip).",
        EXPORTER,
        ENTROPY_BUCKETS,
    ),
    _m(
        "layerwatch_entropy_squares_total",
        "counter",
        ("model_name", "decision"),
        "Sum of squared entropies, so PromQL can compute the standard deviation.",
        EXPORTER,
    ),
    _m(
        "layerwatch_entropy_zero_total",
        "counter",
        ("model_name", "decision"),
        f"Entropies below {ZERO_ENTROPY_LIMIT} (zero-entropy layers).",
        EXPORTER,
    ),
    _m(
        "layerwatch_entropy_bimodal",
        "gauge",
        ("model_name",),
        "Bimodality verdict on the sliding window (1 = two peaks); absent while the window is too small.",
        EXPORTER,
    ),
    _m(
        "layerwatch_entropy_bimodality_coefficient",
        "gauge",
        ("model_name",),
        "Sarle's bimodality coefficient on the sliding window.",
        EXPORTER,
    ),
    _m("layerwatch_entropy_dip", "gauge", ("model_name",), "Hartigan's dip statistic on the sliding window.", EXPORTER),
    _m(
        "layerwatch_entropy_dip_p_value",
        "gauge",
        ("model_name",),
        "p-value of Hartigan's dip test on the sliding window.",
        EXPORTER,
    ),
    _m(
        "layerwatch_entropy_peaks",
        "gauge",
        ("model_name",),
        "Peaks found in the sliding window's 20-bin histogram.",
        EXPORTER,
    ),
    _m(
        "layerwatch_entropy_window_below_ratio",
        "gauge",
        ("model_name", "edge"),
        "Share of the sliding window's entropies below the edge (0.05 to 0.95); absent while the window is too small.",
        EXPORTER,
    ),
    _m(
        "layerwatch_entropy_window_observations",
        "gauge",
        ("model_name",),
        "Entropies held by the sliding window.",
        EXPORTER,
    ),
    _m(
        "layerwatch_layer_entropy_sum_total",
        "counter",
        ("model_name", "layer"),
        "Sum of the layer's decode-time gate entropies (mean = rate of this / rate of the count).",
        EXPORTER,
    ),
    _m(
        "layerwatch_layer_entropy_count_total",
        "counter",
        ("model_name", "layer"),
        "Decode-time gate entropies observed for the layer.",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_layer_skips_total",
        "counter",
        ("model_name", "layer"),
        "Decode-time evaluations of the layer that received frames mark skipped: the skip ratio of a model no shim "
        "reports.",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_fallbacks_total",
        "counter",
        ("model_name",),
        "Fallback episodes (full depth forced by the skip policy's breaker) the received frames report: the "
        "fallbacks of a model no shim reports.",
        EXPORTER,
    ),
    _m(
        "layerwatch_entropy_per_layer",
        "histogram",
        ("model_name", "layer"),
        "Decode-time gate entropies of one layer (only with `layerwatch exporter --per-layer`).",
        EXPORTER,
        ENTROPY_BUCKETS,
    ),
    # --- exporter: self-health -----------------------------------------------------------------
    _m(
        "layerwatch_exporter_frames_received_total",
        "counter",
        ("model_name",),
        "Gate frames received and decoded.",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_frames_malformed_total",
        "counter",
        (),
        "Datagrams dropped because they did not decode as a gate frame.",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_frames_lost_total",
        "counter",
        ("model_name",),
        "Frames missing from a shim's sequence numbers (lost in transit; the shim counts what it did not send "
        "in layerwatch_telemetry_frames_dropped_total).",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_frames_interleaved_total",
        "counter",
        ("model_name",),
        "Frames that switched between two sequence numberings under one shim id: several shims share the id "
        "(never counted as lost).",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_frames_rejected_total",
        "counter",
        ("reason",),
        "Well-formed frames dropped, by reason: too_many_models (--max-models), too_many_layers (--max-layers), "
        "layer_count_changed, missing_tag or bad_tag (--frame-key-file), replayed, sequence_jump (over 2^20 past "
        "its shim's previous frame).",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_scrape_duration_seconds",
        "gauge",
        (),
        "Time this scrape spent collecting (and rendering) the exporter's metrics.",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_scrape_collector_success",
        "gauge",
        ("collector",),
        "1 if the exporter's collector produced its metrics in this scrape, else 0 (its metrics missing, the reason "
        "logged).",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_scrape_collector_duration_seconds",
        "gauge",
        ("collector",),
        "Time the collector took in this scrape.",
        EXPORTER,
    ),
    # --- exporter: routing (static pruning vs per-token routing; layerwatch/routing.py) ----------
    _m(
        "layerwatch_routing_window_tokens",
        "gauge",
        ("model_name",),
        "Decoded tokens (frame rows) in the routing window, the tokens behind the entropy window.",
        EXPORTER,
    ),
    _m(
        "layerwatch_routing_threshold",
        "gauge",
        ("model_name",),
        "Skip threshold tau of the model's latest frame (the exporter's --default-threshold for a frame without one).",
        EXPORTER,
    ),
    _m(
        "layerwatch_routing_dynamic",
        "gauge",
        ("model_name",),
        "Routing verdict on the window: 1 = skipping depends on the token, 0 = static pruning; absent while withheld.",
        EXPORTER,
    ),
    _m(
        "layerwatch_routing_token_dependent_share",
        "gauge",
        ("model_name",),
        "Share of the window's below-threshold layer evaluations outside static layers (0-1); absent while "
        "the routing verdict is withheld.",
        EXPORTER,
    ),
    _m(
        "layerwatch_routing_layer_low_ratio",
        "gauge",
        ("model_name", "layer"),
        "Share of the window's tokens whose gate score for the layer was below the threshold.",
        EXPORTER,
    ),
    _m(
        "layerwatch_routing_layer_skip_ratio",
        "gauge",
        ("model_name", "layer"),
        "Share of the window's tokens for which the layer was skipped (lags the low ratio by patience).",
        EXPORTER,
    ),
    _m(
        "layerwatch_routing_layer_static",
        "gauge",
        ("model_name", "layer"),
        "1 = static (below the threshold for >= 95% of tokens, 90% confidence), -1 = static-run (<= 5%), 0 = "
        "token-dependent; absent while withheld.",
        EXPORTER,
    ),
    _m(
        "layerwatch_exporter_frames_without_threshold_total",
        "counter",
        ("model_name",),
        "Gate frames without a threshold (wire version 1, an older shim): their routing statistics use "
        "the exporter's --default-threshold.",
        EXPORTER,
    ),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}


def for_component(component: str) -> tuple[MetricSpec, ...]:
    return tuple(m for m in METRICS if m.component == component)


def all_series_names() -> set[str]:
    """Every sample name any component can expose (for checking dashboard and rule queries)."""
    return {s for m in METRICS for s in m.series_names}


# vLLM's own series that the rules and the dashboard read, as `vllm serve` (vLLM 0.32, the V1 engine:
# vllm/v1/metrics/loggers.py) exposes them, labelled model_name (the served model name) and engine.
# vLLM owns them: tests/vllm_stack checks each against a real `vllm serve`'s /metrics.
VLLM_SERIES: frozenset[str] = frozenset(
    {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
    }
)
