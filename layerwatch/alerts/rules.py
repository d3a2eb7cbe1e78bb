"""Recording and alerting rules, generated from the per-model profiles and the alert specs.

Three kinds of rule group:
- `layerwatch.recording`: the derived series of docs/metrics.md (entropy mean/std/zero ratio, skip
  ratios, joules per token, shadow agreement and quality cost, telemetry loss and drops), model-agnostic, named
  `level:metric:operation`.
  They aggregate `by (job, instance, model_name[, decision | layer])`: the target labels stay so
  that an alert names the shim or exporter it comes from (Alertmanager groups and inhibits on them).
  The fleet roll-ups at its end (`job_model_name...`) drop the instance: one series per model
  (docs/fleet.md); no alert reads them.
- `layerwatch.common`: the alerts that need no model-specific number (layerwatch/alerts/specs.py).
- `layerwatch.model.<name>`, one per profile: the profile's bands as constant series (for the
  dashboard) and every per-model alert of layerwatch/alerts/specs.py, selected with model_name="<name>".

Every window and `for:` goes through `Timing`, so a test can render the same rules at, say, 1/100
of the production durations; recorded names follow their window (`mean_rate5m` -> `mean_rate3s`).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import numpy as np
import yaml

from layerwatch.alerts.durations import Timing
from layerwatch.alerts.profile import Profile
from layerwatch.alerts.recorded import (
    BY_FLEET,
    BY_MODEL,
    BY_TARGET,
    ENTROPY_BELOW_HEALTHY,
    GATE_LAYER_IMPORTANCE_FLOOR,
    Recorded,
)
from layerwatch.alerts.specs import (
    COMMON_ALERTS,
    PER_MODEL_ALERTS,
    AlertBuild,
    entropy_shape_changed,
    skip_collapse_limit,
)
from layerwatch.catalog import ENTROPY_WINDOW_EDGES
from layerwatch.mixin import config
from layerwatch.mixin.config import VLLM_LATENCY_OBJECTIVES, LatencyObjectives
from layerwatch.statistics import shares_below_edges


# The profile's bands as constant series `model_name:layerwatch_profile_<what>:<bound>`, so that the
# dashboard can draw the selected model's healthy band next to the measured value. The dashboard
# reads the names from PROFILE_SERIES.
def _profile_name(what: str, bound: str) -> str:
    return f"model_name:layerwatch_profile_{what}:{bound}"


@dataclass(frozen=True)
class ProfileSeries:
    """Names of the profile's constant series (one per value of `profile_series`)."""

    entropy_mean_low: str = _profile_name("entropy_mean", "low")
    entropy_mean_high: str = _profile_name("entropy_mean", "high")
    entropy_std_low: str = _profile_name("entropy_std", "low")
    entropy_std_high: str = _profile_name("entropy_std", "high")
    zero_ratio_low: str = _profile_name("zero_ratio", "low")
    zero_ratio_high: str = _profile_name("zero_ratio", "high")
    zero_ratio_page: str = _profile_name("zero_ratio", "page")
    skip_ratio_normal: str = _profile_name("skip_ratio", "normal")
    skip_ratio_runaway: str = _profile_name("skip_ratio", "runaway")
    skip_ratio_collapse: str = _profile_name("skip_ratio", "collapse")
    token_dependent_share_floor: str = _profile_name("token_dependent_share", "floor")
    shadow_agreement_min: str = _profile_name("shadow_agreement", "min")
    shadow_kl_nats_max: str = _profile_name("shadow_kl_nats", "max")
    gate_importance_min: str = _profile_name("gate_importance", "min")
    entropy_shape_distance_max: str = _profile_name("entropy_shape_distance", "max")
    threshold: str = _profile_name("threshold", "value")


PROFILE_SERIES = ProfileSeries()


def profile_series(profile: Profile) -> dict[str, float]:
    p, n = profile, PROFILE_SERIES
    return {
        n.entropy_mean_low: p.entropy_mean.low,
        n.entropy_mean_high: p.entropy_mean.high,
        n.entropy_std_low: p.entropy_std.low,
        n.entropy_std_high: p.entropy_std.high,
        n.zero_ratio_low: p.zero_ratio.low,
        n.zero_ratio_high: p.zero_ratio.high,
        n.zero_ratio_page: p.zero_ratio_page,
        n.skip_ratio_normal: p.skip_ratio_normal,
        n.skip_ratio_runaway: p.runaway_skip_ratio,
        n.skip_ratio_collapse: skip_collapse_limit(p),
        n.token_dependent_share_floor: p.routing.share_floor,
        n.shadow_agreement_min: p.shadow_agreement_min,
        n.shadow_kl_nats_max: p.shadow_kl_nats_max,
        n.gate_importance_min: p.gate_importance.correlation_min,
        n.threshold: p.threshold,
        # Only where the profile records the healthy shape (layerwatch/alerts/profile.py).
        **(
            {}
            if p.bimodality.shape_distance_max is None
            else {n.entropy_shape_distance_max: p.bimodality.shape_distance_max}
        ),
    }


# --- recording rules ----------------------------------------------------------------------------


def _rate(metric: str, selector: str, window: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{window}]))"


def _skip_ratio(window: str, by: str) -> str:
    """Skipped share of the decode-time layer evaluations, `by` the given labels: from the shim's
    exact counts, or, for a model no shim reports (another engine sending frames: docs/instrument.md),
    from the exporter's counts of the frames it received. The exporter's side is left out for every
    model a shim exports counters for (`unless`), and for every model the shim's side has a ratio for
    (`or on`: also in the rate window after the shim's series ended), so that a served model keeps the
    shim's values alone and its series keep the shim's job and instance. A window without evaluations has
    no ratio (absent, not 0/0's NaN: one NaN would make the surge baseline's average NaN for its hour)."""
    exp, shim = config.EXPORTER_SELECTOR, config.SHIM_SELECTOR
    served = (
        f"{_rate('layerwatch_layer_skips_total', shim, window, by)}\n  /\n  "
        f"({_rate('layerwatch_layer_evaluations_total', shim, window, by)} > 0)"
    )
    frames = (
        f"{_rate('layerwatch_exporter_layer_skips_total', exp, window, by)}\n  /\n  "
        f"({_rate('layerwatch_layer_entropy_count_total', exp, window, by)} > 0)"
    )
    return (
        f"(\n  {served}\n)\nor on (model_name)\n(\n  {frames}\n"
        f"  unless on (model_name)\n  layerwatch_layer_evaluations_total{{{shim}}}\n)"
    )


def _fallbacks_rate(window: str) -> str:
    """Fallback episodes per second: the shim's count, or, for a model no shim reports (vLLM's plugin), the
    count its frames carry to the exporter; `or on` / `unless` as in _skip_ratio."""
    exp, shim = config.EXPORTER_SELECTOR, config.SHIM_SELECTOR
    served = _rate("layerwatch_fallbacks_total", shim, window, BY_MODEL)
    frames = _rate("layerwatch_exporter_fallbacks_total", exp, window, BY_MODEL)
    return (
        f"(\n  {served}\n)\nor on (model_name)\n(\n  {frames}\n"
        f"  unless on (model_name)\n  layerwatch_fallbacks_total{{{shim}}}\n)"
    )


def recording_rules(timing: Timing) -> list[dict]:
    r = Recorded.for_timing(timing)
    w = timing(config.RATE_WINDOW)
    exp, shim = config.EXPORTER_SELECTOR, config.SHIM_SELECTOR
    rules: list[dict] = []

    def record(name: str, expr: str) -> None:
        rules.append({"record": name, "expr": expr})

    # Entropy moments, all layers and by decision (the bands are about decision="run": the layers
    # that ran). std from the exporter's Σx², Σx and count: Var = E[x²] − E[x]², clamped at 0
    # against rounding.
    for by, mean, std, zero in (
        (BY_MODEL, r.entropy_mean, r.entropy_std, r.entropy_zero_ratio),
        (
            f"{BY_MODEL}, decision",
            r.entropy_mean_by_decision,
            r.entropy_std_by_decision,
            r.entropy_zero_ratio_by_decision,
        ),
    ):
        count = _rate("layerwatch_entropy_count", exp, w, by)
        record(mean, f"{_rate('layerwatch_entropy_sum', exp, w, by)}\n/\n{count}")
        record(
            std,
            f"sqrt(clamp_min(\n  {_rate('layerwatch_entropy_squares_total', exp, w, by)}\n"
            f"  /\n  {count}\n  - {mean} ^ 2,\n  0\n))",
        )
        record(zero, f"{_rate('layerwatch_entropy_zero_total', exp, w, by)}\n/\n{count}")

    # Skipping: share of decode-time layer evaluations that skipped, overall and per layer.
    for by, name in ((BY_MODEL, r.skip_ratio), (f"{BY_MODEL}, layer", r.skip_ratio_by_layer)):
        record(name, _skip_ratio(w, by))
    record(r.skip_ratio_baseline, f"avg_over_time({r.skip_ratio}[{timing(config.SKIP_BASELINE_WINDOW)}])")
    record(
        r.layers_executed_mean,
        f"{_rate('layerwatch_layers_executed_sum', shim, w, BY_MODEL)}\n/\n"
        f"{_rate('layerwatch_layers_executed_count', shim, w, BY_MODEL)}",
    )
    record(r.fallbacks_rate, _fallbacks_rate(w))

    # Energy has no model_name (it belongs to the host's GPUs or CPU packages): join it to the
    # tokens the shim on the same target generated. An idle shim has no joules per token (not +Inf).
    decode_tokens = _rate("layerwatch_tokens_total", f'{shim}, phase="decode"', w, BY_MODEL)
    decode_tokens = f"({decode_tokens} > 0)"
    for name, metric in (
        (r.gpu_joules_per_token, "layerwatch_gpu_energy_joules_total"),
        (r.cpu_joules_per_token, "layerwatch_cpu_energy_joules_total"),
    ):
        record(name, f"{_rate(metric, shim, w, BY_TARGET)}\n/ on ({BY_TARGET}) group_right ()\n{decode_tokens}")

    rules += shadow_rules(r, w, BY_MODEL, r.shadow_agreement_ratio, r.shadow_kl_per_token, r.shadow_perplexity_increase)
    lost = _rate("layerwatch_exporter_frames_lost_total", exp, w, BY_MODEL)
    received = _rate("layerwatch_exporter_frames_received_total", exp, w, BY_MODEL)
    record(r.telemetry_loss_ratio, f"{lost}\n/\n(\n  {received}\n  +\n  {lost}\n)")
    # The shim's own drops: those frames take no sequence number, so they are not in the gaps above.
    dropped = _rate("layerwatch_telemetry_frames_dropped_total", shim, w, BY_MODEL)
    sent = _rate("layerwatch_telemetry_frames_sent_total", shim, w, BY_MODEL)
    record(r.telemetry_drop_ratio, f"{dropped}\n/\n(\n  {sent}\n  +\n  {dropped}\n)")

    # Per-request skipping: the share of finished requests whose skip fraction is above each bucket
    # edge (1 - the cumulative bucket share), and how often the runaway requests skipped each layer.
    # Both are absent without requests (no 0/0 NaN): the tail alert is silent without traffic.
    finished = _rate("layerwatch_request_skip_fraction_count", shim, w, BY_MODEL)
    at_or_below = _rate("layerwatch_request_skip_fraction_bucket", shim, w, f"{BY_MODEL}, le")
    record(
        r.request_skip_tail_ratio,
        f"1 - (\n  {at_or_below}\n  / ignoring (le) group_left ()\n  ({finished} > 0)\n)",
    )
    runaway_tokens = _rate("layerwatch_request_runaway_tokens_total", shim, w, BY_MODEL)
    record(
        r.runaway_skip_ratio_by_layer,
        f"{_rate('layerwatch_request_runaway_layer_skips_total', shim, w, f'{BY_MODEL}, layer')}\n"
        f"/ ignoring (layer) group_left ()\n({runaway_tokens} > 0)",
    )
    return rules + fleet_rules(timing)


def fleet_rules(timing: Timing) -> list[dict]:
    """Roll-ups across the instances of a model (`job_model_name...`), after the per-target rules
    they read. Ratios are sums over the fleet divided by sums (each instance weighs by its traffic),
    not means of the instances' ratios."""
    r = Recorded.for_timing(timing)
    w = timing(config.RATE_WINDOW)
    exp, shim = config.EXPORTER_SELECTOR, config.SHIM_SELECTOR
    # Per exporter target: 1 when either verdict says unhealthy (the entropy shape changed, as the
    # model's profile judges it, or static routing), else 0, also while both verdicts are withheld, so
    # that every target reporting the model (its window size is always exported) counts in the fleet's total.
    unhealthy = (
        f"max by ({BY_MODEL}) (\n"
        f"  (\n    {r.entropy_shape_changed}\n    or\n    layerwatch_routing_dynamic{{{exp}}} == 0\n"
        "  ) * 0 + 1\n"
        f"  or\n  layerwatch_entropy_window_observations{{{exp}}} * 0\n)"
    )
    buckets = (
        (r.fleet_entropy_buckets, "layerwatch_entropy_bucket", exp),
        (r.fleet_request_skip_fraction_buckets, "layerwatch_request_skip_fraction_bucket", shim),
        (r.fleet_time_to_first_token_buckets, "layerwatch_time_to_first_token_seconds_bucket", shim),
        (r.fleet_inter_token_latency_buckets, "layerwatch_inter_token_latency_seconds_bucket", shim),
    )
    return [
        {"record": r.gating_unhealthy, "expr": unhealthy},
        {"record": r.fleet_gating_unhealthy, "expr": f"sum by ({BY_FLEET}) ({r.gating_unhealthy})"},
        {"record": r.fleet_gating_instances, "expr": f"count by ({BY_FLEET}) ({r.gating_unhealthy})"},
        {"record": r.fleet_skip_ratio, "expr": _skip_ratio(w, BY_FLEET)},
        *shadow_rules(
            r,
            w,
            BY_FLEET,
            r.fleet_shadow_agreement_ratio,
            r.fleet_shadow_kl_per_token,
            r.fleet_shadow_perplexity_increase,
        ),
        *({"record": name, "expr": _rate(metric, sel, w, f"{BY_FLEET}, le")} for name, metric, sel in buckets),
    ]


def shadow_rules(r: Recorded, window: str, by: str, agreement: str, kl_per_token: str, perplexity: str) -> list[dict]:
    """The shadow check's ratios per shadow-checked token, aggregated `by` (a target, or the fleet):
    agreement, the quality cost KL(gated || full) in nats, and the perplexity increase estimated from
    KL(full || gated) as exp(mean) - 1 (docs/service.md, "Quality guard"), from a shim or a vLLM guard.
    Absent without checks."""
    guard = config.QUALITY_GUARD_SELECTOR
    tokens = _rate("layerwatch_shadow_tokens_total", guard, window, by)
    reverse = _rate("layerwatch_shadow_reverse_kl_nats_total", guard, window, by)
    return [
        {"record": agreement, "expr": f"{_rate('layerwatch_shadow_agreements_total', guard, window, by)}\n/\n{tokens}"},
        {"record": kl_per_token, "expr": f"{_rate('layerwatch_shadow_kl_nats_total', guard, window, by)}\n/\n{tokens}"},
        {"record": perplexity, "expr": f"exp(\n  {reverse}\n  /\n  {tokens}\n) - 1"},
    ]


# --- alerts ----------------------------------------------------------------------------------------


def common_alerts(timing: Timing, objectives: LatencyObjectives = VLLM_LATENCY_OBJECTIVES) -> list[dict]:
    """The alerts that need no profile (layerwatch/alerts/specs.py), once for every model."""
    recorded = Recorded.for_timing(timing)
    return [
        rule for spec in COMMON_ALERTS for rule in spec.build(AlertBuild(spec, timing, recorded, objectives=objectives))
    ]


def _profile_series_rules(profile: Profile, recorded: Recorded) -> list[dict]:
    model = {"model_name": profile.model_name}
    histogram = profile.bimodality.histogram
    below: list[float] = shares_below_edges(np.asarray(histogram)).tolist() if histogram else []
    # The window's shape distance from the recorded healthy shape (layerwatch/statistics.py,
    # shape_distance): the largest gap between their shares below an edge.
    selector = f'{config.EXPORTER_SELECTOR}, model_name="{profile.model_name}"'
    distance = {
        "record": recorded.entropy_shape_distance,
        "expr": f"max by ({BY_MODEL}) (\n  abs(\n    layerwatch_entropy_window_below_ratio{{{selector}}}\n"
        f"    - on (model_name, edge) group_left ()\n    {ENTROPY_BELOW_HEALTHY}\n  )\n)",
        "labels": model,  # as on the series: it keeps the groups' rules of one name apart (promtool)
    }
    return (
        [
            {"record": name, "expr": f"vector({value})", "labels": model}
            for name, value in profile_series(profile).items()
        ]
        + [
            {"record": GATE_LAYER_IMPORTANCE_FLOOR, "expr": f"vector({floor})", "labels": model | {"layer": str(layer)}}
            for layer, floor in sorted(profile.gate_importance.layer_floors.items())
        ]
        + [
            {
                "record": ENTROPY_BELOW_HEALTHY,
                "expr": f"vector({round(float(share), 4)})",
                "labels": model | {"edge": edge},
            }
            for edge, share in zip(ENTROPY_WINDOW_EDGES, below)
        ]
        + ([distance] if histogram else [])
    )


def _shape_changed_rule(profile: Profile, alerts: list[dict], recorded: Recorded) -> dict:
    """1 per exporter target while a rule of LayerwatchEntropyShapeChanged holds (the fleet's verdict)."""
    conditions = [rule["expr"] for rule in alerts if rule["alert"] == entropy_shape_changed.name]
    either = "\nor\n".join(f"(\n{textwrap.indent(condition, '  ')}\n)" for condition in conditions)
    return {
        "record": recorded.entropy_shape_changed,
        "expr": f"(\n{textwrap.indent(either, '  ')}\n) * 0 + 1",
        "labels": {"model_name": profile.model_name},
    }


def model_rules(profile: Profile, timing: Timing) -> list[dict]:
    """The profile's bands as series, then every per-model alert with this model's numbers."""
    recorded = Recorded.for_timing(timing)
    alerts = [rule for spec in PER_MODEL_ALERTS for rule in spec.build(AlertBuild(spec, timing, recorded, profile))]
    # The model as a static label as well: the series carry the same value, and it keeps the alerts
    # of two profiles apart for promtool's duplicate-rule check (same name and static labels).
    for rule in alerts:
        rule["labels"]["model_name"] = profile.model_name
    return _profile_series_rules(profile, recorded) + [_shape_changed_rule(profile, alerts, recorded)] + alerts


def rule_groups(
    profiles: list[Profile], timing: Timing = Timing(), objectives: LatencyObjectives = VLLM_LATENCY_OBJECTIVES
) -> dict:
    """The whole rule file, as data. Groups are evaluated in order: recording rules first."""
    return {
        "groups": [
            {"name": "layerwatch.recording", "rules": recording_rules(timing)},
            {"name": "layerwatch.common", "rules": common_alerts(timing, objectives)},
            *({"name": f"layerwatch.model.{p.model_name}", "rules": model_rules(p, timing)} for p in profiles),
        ]
    }


def recorded_names(groups: dict) -> set[str]:
    return {rule["record"] for group in groups["groups"] for rule in group["rules"] if "record" in rule}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (long PromQL) as literal blocks, so the rule file reads like PromQL; a value
    used twice is written twice (no &anchors: generated files are read by people and many tools)."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(data: dict, header: str) -> str:
    return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)


def render_rules(
    profiles: list[Profile], timing: Timing = Timing(), objectives: LatencyObjectives = VLLM_LATENCY_OBJECTIVES
) -> str:
    names = ", ".join(p.model_name for p in profiles)
    header = (
        f"# Generated by `layerwatch generate` from layerwatch/alerts/profiles ({names}). Do not edit:\n"
        "# change a profile, layerwatch/alerts/specs.py or layerwatch/alerts/rules.py and regenerate.\n"
    )
    return to_yaml(rule_groups(profiles, timing, objectives), header)
