"""Recording and alerting rules, generated from the per-model profiles.

Three kinds of rule group:
- `layerwatch.recording`: the derived series of CONTRACT (entropy mean/std/zero ratio, skip ratios,
  joules per token, shadow agreement, telemetry loss), model-agnostic, named `level:metric:operation`.
  They aggregate `by (job, instance, model_name[, decision | layer])`: the target labels stay so
  that an alert names the shim or exporter it comes from (Alertmanager groups and inhibits on them).
- `layerwatch.common`: alerts that need no model-specific number (target down, gate weights changed).
- `layerwatch.model.<name>`, one per profile: the profile's bands as constant series (for the
  dashboard) and every threshold alert, selected with model_name="<name>".

Every window and `for:` goes through `Timing`, so a test can render the same rules at, say, 1/100
of the production durations; recorded names follow their window (`mean_rate5m` -> `mean_rate3s`).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from alerts.durations import Timing
from alerts.profile import Profile
from alerts.recorded import BY_MODEL, BY_TARGET, Recorded
from layerwatch.catalog import ZERO_ENTROPY_LIMIT
from mixin import config

RATIO_FORMAT = "%.3f"


# The profile's bands as constant series `model_name:layerwatch_profile_<what>:<bound>`, so that the
# dashboard can draw the selected model's healthy band next to the measured value.
def profile_series(profile: Profile) -> dict[str, float]:
    p = profile
    return {
        "model_name:layerwatch_profile_entropy_mean:low": p.entropy_mean.low,
        "model_name:layerwatch_profile_entropy_mean:high": p.entropy_mean.high,
        "model_name:layerwatch_profile_entropy_std:low": p.entropy_std.low,
        "model_name:layerwatch_profile_entropy_std:high": p.entropy_std.high,
        "model_name:layerwatch_profile_zero_ratio:low": p.zero_ratio.low,
        "model_name:layerwatch_profile_zero_ratio:high": p.zero_ratio.high,
        "model_name:layerwatch_profile_zero_ratio:page": p.zero_ratio_page,
        "model_name:layerwatch_profile_skip_ratio:normal": p.skip_ratio_normal,
        "model_name:layerwatch_profile_skip_ratio:runaway": p.runaway_skip_ratio,
        "model_name:layerwatch_profile_shadow_agreement:min": p.shadow_agreement_min,
        "model_name:layerwatch_profile_threshold:value": p.threshold,
    }


# --- recording rules ----------------------------------------------------------------------------

def _rate(metric: str, selector: str, window: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{window}]))"


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
        (f"{BY_MODEL}, decision", r.entropy_mean_by_decision, r.entropy_std_by_decision,
         r.entropy_zero_ratio_by_decision),
    ):
        count = _rate("layerwatch_entropy_count", exp, w, by)
        record(mean, f"{_rate('layerwatch_entropy_sum', exp, w, by)}\n/\n{count}")
        record(std, f"sqrt(clamp_min(\n  {_rate('layerwatch_entropy_squares_total', exp, w, by)}\n"
                    f"  /\n  {count}\n  - {mean} ^ 2,\n  0\n))")
        record(zero, f"{_rate('layerwatch_entropy_zero_total', exp, w, by)}\n/\n{count}")

    # Skipping: share of decode-time layer evaluations that skipped, overall and per layer.
    for by, name in ((BY_MODEL, r.skip_ratio), (f"{BY_MODEL}, layer", r.skip_ratio_by_layer)):
        record(name, f"{_rate('layerwatch_layer_skips_total', shim, w, by)}\n/\n"
                     f"{_rate('layerwatch_layer_evaluations_total', shim, w, by)}")
    record(r.skip_ratio_baseline,
           f"avg_over_time({r.skip_ratio}[{timing(config.SKIP_BASELINE_WINDOW)}])")
    record(r.layers_executed_mean, f"{_rate('layerwatch_layers_executed_sum', shim, w, BY_MODEL)}\n/\n"
                                   f"{_rate('layerwatch_layers_executed_count', shim, w, BY_MODEL)}")
    record(r.fallbacks_rate, _rate("layerwatch_fallbacks_total", shim, w, BY_MODEL))

    # Energy has no model_name (it belongs to the host's GPUs or CPU packages): join it to the
    # tokens the shim on the same target generated. An idle shim has no joules per token (not +Inf).
    decode_tokens = _rate("layerwatch_tokens_total", f'{shim}, phase="decode"', w, BY_MODEL)
    decode_tokens = f"({decode_tokens} > 0)"
    for name, metric in ((r.gpu_joules_per_token, "layerwatch_gpu_energy_joules_total"),
                         (r.cpu_joules_per_token, "layerwatch_cpu_energy_joules_total")):
        record(name, f"{_rate(metric, shim, w, BY_TARGET)}\n/ on ({BY_TARGET}) group_right ()\n"
                     f"{decode_tokens}")

    record(r.shadow_agreement_ratio,
           f"{_rate('layerwatch_shadow_agreements_total', shim, w, BY_MODEL)}\n/\n"
           f"{_rate('layerwatch_shadow_tokens_total', shim, w, BY_MODEL)}")
    lost = _rate("layerwatch_exporter_frames_lost_total", exp, w, BY_MODEL)
    received = _rate("layerwatch_exporter_frames_received_total", exp, w, BY_MODEL)
    record(r.telemetry_loss_ratio, f"{lost}\n/\n(\n  {received}\n  +\n  {lost}\n)")
    return rules


# --- alert text helpers (Go templates, expanded by Prometheus) -------------------------------------

def _value(fmt: str = RATIO_FORMAT) -> str:
    return '{{ $value | printf "' + fmt + '" }}'


def _lookup(metric: str, fmt: str = RATIO_FORMAT, matchers: str = "") -> str:
    """The value of `metric` for the alert's target and model, or "n/a"."""
    selector = metric + "{" + matchers + "instance=%q,model_name=%q}"
    return ("{{ with printf `" + selector + "` $labels.instance $labels.model_name | query }}"
            "{{ . | first | value | printf \"" + fmt + "\" }}{{ else }}n/a{{ end }}")


_MODEL_ON_TARGET = "{{ $labels.model_name }} on {{ $labels.instance }}"
_WHERE = f"model {_MODEL_ON_TARGET}"


def _alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str,
           extra_labels: dict[str, str] | None = None) -> dict:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity, **(extra_labels or {})},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": config.runbook_url(name),
        },
    }


# --- alerts that need no profile --------------------------------------------------------------

def common_alerts(timing: Timing) -> list[dict]:
    jobs = "|".join((config.SHIM_JOB, config.EXPORTER_JOB))
    change_window = timing(config.GATE_CHANGE_WINDOW)
    served = f"max_over_time(layerwatch_model_info{{{config.SHIM_SELECTOR}}}[{change_window}])"
    hashes_query = (f"max by (instance, gates_sha256) (max_over_time(layerwatch_model_info"
                    f"{{{config.SHIM_SELECTOR},model_name=%q}}[{change_window}]))")
    return [
        _alert(
            "LayerwatchTargetDown",
            f'up{{job=~"{jobs}"}} == 0',
            timing(config.COMMON_ALERTS["LayerwatchTargetDown"]),
            config.SEVERITY_PAGE,
            "A layerwatch shim or exporter cannot be scraped.",
            "Prometheus cannot scrape {{ $labels.job }} at {{ $labels.instance }}; the other "
            "layerwatch alerts of this target are inhibited while it is down.",
        ),
        _alert(
            "LayerwatchGateWeightsChanged",
            # Counted across instances, so that a rolling deploy (new instances) is seen too; a
            # restart with the same weights keeps one gates_sha256 and does not fire.
            f"count by (model_name) (\n  count by (model_name, gates_sha256) ({served})\n) > 1",
            timing(config.COMMON_ALERTS["LayerwatchGateWeightsChanged"]),
            config.SEVERITY_TICKET,
            "The gate weights served for a model changed.",
            "Model {{ $labels.model_name }} served {{ $value }} different gate weights within "
            f"{change_window}: "
            "{{ range printf `" + hashes_query + "` $labels.model_name | query }}"
            "{{ .Labels.instance }}={{ .Labels.gates_sha256 }} {{ end }}"
            "- check that the change was intended.",
        ),
        _alert(
            "LayerwatchGateFileRejected",
            f"max by (job, instance, model_name) (layerwatch_gate_file_rejected{{{config.SHIM_SELECTOR}}}) == 1",
            timing(config.COMMON_ALERTS["LayerwatchGateFileRejected"]),
            config.SEVERITY_TICKET,
            "A replaced gate file was rejected; the shim keeps serving the gates it had.",
            "The gate file of model {{ $labels.model_name }} at {{ $labels.instance }} was replaced on "
            "disk with one the shim refused (incomplete, invalid, or for another model or policy); the "
            "previously loaded gates keep serving, and a restart would fail to start. See the shim's log.",
        ),
    ]


# --- per-model alerts ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Model:
    """What every per-model alert needs: the profile, the recorded names, the timing."""
    profile: Profile
    recorded: Recorded
    timing: Timing

    @property
    def selector(self) -> str:
        return f'model_name="{self.profile.model_name}"'

    @property
    def ran(self) -> str:
        return f'{self.selector}, decision="run"'

    def for_(self, alert_name: str) -> str:
        return self.timing(self.profile.for_duration(alert_name))


def _profile_series_rules(m: _Model) -> list[dict]:
    return [{"record": name, "expr": f"vector({value})", "labels": {"model_name": m.profile.model_name}}
            for name, value in profile_series(m.profile).items()]


def _single_peak(m: _Model) -> list[dict]:
    b = m.profile.bimodality
    exporter = f"{config.EXPORTER_SELECTOR}, {m.selector}"
    baseline = ", ".join(
        f"{label} {value}" for label, value in (
            ("peaks", b.peaks), ("bimodality coefficient", b.bimodality_coefficient),
            ("dip", b.dip), ("dip p-value", b.dip_p_value)) if value is not None
    ) or "not recorded in the profile"
    return [_alert(
        "LayerwatchEntropySinglePeak",
        # The exporter withholds the verdict below its own minimum window; the profile may ask for more.
        f"layerwatch_entropy_bimodal{{{exporter}}} == 0\n"
        f"and on ({BY_MODEL})\n"
        f"layerwatch_entropy_window_observations{{{exporter}}} >= {b.min_observations}",
        m.for_("LayerwatchEntropySinglePeak"), config.SEVERITY_PAGE,
        "The gate entropy distribution is no longer bimodal (a single peak).",
        f"The entropy window of {_WHERE} holds "
        + _lookup("layerwatch_entropy_window_observations", "%.0f")
        + " entropies and is not bimodal: bimodality coefficient "
        + _lookup("layerwatch_entropy_bimodality_coefficient")
        + ", dip " + _lookup("layerwatch_entropy_dip")
        + " (p = " + _lookup("layerwatch_entropy_dip_p_value") + "), "
        + _lookup("layerwatch_entropy_peaks", "%.0f")
        + f" peak(s). Healthy baseline: {baseline}. Gating has degraded into static "
        "pruning or noise; the usual cause is gate weights overwritten or not loaded.",
    )]


def _most_skipped_layers(m: _Model) -> str:
    return ("{{ range printf `topk(3, " + m.recorded.skip_ratio_by_layer
            + "{instance=%q,model_name=%q})` $labels.instance $labels.model_name | query }}"
            "{{ .Labels.layer }} ({{ .Value | printf \"" + RATIO_FORMAT + "\" }}) {{ end }}")


def _runaway_skipping(m: _Model) -> list[dict]:
    p, r = m.profile, m.recorded
    summary = "Almost every layer is being skipped."
    return [
        _alert(
            "LayerwatchRunawaySkipping",
            f"{r.skip_ratio}{{{m.selector}}} > {p.runaway_skip_ratio}",
            m.for_("LayerwatchRunawaySkipping"), config.SEVERITY_PAGE, summary,
            f"The skip ratio of {_WHERE} is {_value()}, above the runaway limit "
            f"{p.runaway_skip_ratio}. Most skipped layers: {_most_skipped_layers(m)}",
            {"trigger": "skip_ratio"},
        ),
        _alert(
            "LayerwatchRunawaySkipping",
            f"{r.fallbacks_rate}{{{m.selector}}} * 60 > {p.runaway_fallbacks_per_minute}",
            m.for_("LayerwatchRunawaySkipping"), config.SEVERITY_PAGE, summary,
            f"Model {_MODEL_ON_TARGET} keeps falling back to full depth: {_value('%.2f')} "
            f"fallbacks per minute (limit {p.runaway_fallbacks_per_minute}), sustained for "
            f"{m.for_('LayerwatchRunawaySkipping')}. Skip ratio: " + _lookup(r.skip_ratio) + ".",
            {"trigger": "fallbacks"},
        ),
    ]


def _skip_rate_surge(m: _Model) -> list[dict]:
    p, r = m.profile, m.recorded
    # The floor at the normal skip ratio keeps a jump from 1 % to 3 % (3x, but harmless) quiet.
    return [_alert(
        "LayerwatchSkipRateSurge",
        f"{r.skip_ratio}{{{m.selector}}}\n> {p.skip_surge_factor} * {r.skip_ratio_baseline}{{{m.selector}}}\n"
        f"and\n{r.skip_ratio}{{{m.selector}}} > {p.skip_ratio_normal}",
        m.for_("LayerwatchSkipRateSurge"), config.SEVERITY_TICKET,
        "The skip ratio jumped far above its own recent baseline.",
        f"The skip ratio of {_WHERE} is {_value()}, more than {p.skip_surge_factor}x its "
        f"{m.timing(config.SKIP_BASELINE_WINDOW)} baseline " + _lookup(r.skip_ratio_baseline)
        + f" (healthy: {p.skip_ratio_normal}). Most skipped layers: {_most_skipped_layers(m)}",
    )]


def _entropy_bands(m: _Model) -> list[dict]:
    p, r = m.profile, m.recorded
    return [
        _alert(
            name,
            f"{series}{{{m.ran}}} < {band.low}\nor\n{series}{{{m.ran}}} > {band.high}",
            m.for_(name), config.SEVERITY_TICKET,
            f"The {what} of active-layer gate entropy left the model's healthy band.",
            f"The entropy {what} of the layers that ran, {_WHERE}, is {_value()}; "
            f"healthy band {band.low}-{band.high}.",
        )
        for name, series, band, what in (
            ("LayerwatchEntropyMeanOutOfBand", r.entropy_mean_by_decision, p.entropy_mean, "mean"),
            ("LayerwatchEntropySpreadOutOfBand", r.entropy_std_by_decision, p.entropy_std,
             "standard deviation"),
        )
    ]


def _zero_entropy_ratio(m: _Model) -> list[dict]:
    # Two tiers of one alert: Alertmanager's critical-inhibits-warning rule keeps one notification.
    p = m.profile
    return [
        _alert(
            "LayerwatchZeroEntropyRatioHigh",
            f"{m.recorded.entropy_zero_ratio}{{{m.selector}}} > {limit}",
            m.for_("LayerwatchZeroEntropyRatioHigh"), severity,
            "Too many layers have zero gate entropy.",
            f"{_value()} of the gate entropies of {_WHERE} are below {ZERO_ENTROPY_LIMIT}, above "
            f"{limit} ({meaning}; healthy band {p.zero_ratio.low}-{p.zero_ratio.high}).",
        )
        for severity, limit, meaning in (
            (config.SEVERITY_TICKET, p.zero_ratio.high, "above the healthy band"),
            (config.SEVERITY_PAGE, p.zero_ratio_page, "over-pruning"),
        )
    ]


def _entropy_drift(m: _Model) -> list[dict]:
    p, r = m.profile, m.recorded
    window = m.timing(p.drift.window)
    return [_alert(
        "LayerwatchEntropyDrift",
        f"stddev_over_time({r.entropy_mean_by_decision}{{{m.ran}}}[{window}]) > {p.drift.limit}",
        m.for_("LayerwatchEntropyDrift"), config.SEVERITY_TICKET,
        "The active-layer entropy mean is drifting.",
        f"The {window} standard deviation of the entropy mean of {_WHERE} is {_value()}, "
        f"above {p.drift.limit}. Current mean: "
        + _lookup(r.entropy_mean_by_decision, matchers='decision="run",') + ".",
    )]


def _shadow_agreement_low(m: _Model) -> list[dict]:
    p, r = m.profile, m.recorded
    return [_alert(
        "LayerwatchShadowAgreementLow",
        f"{r.shadow_agreement_ratio}{{{m.selector}}} < {p.shadow_agreement_min}",
        m.for_("LayerwatchShadowAgreementLow"), config.SEVERITY_PAGE,
        "Full-depth re-checks disagree with the gated output too often.",
        f"Only {_value()} of the shadow-checked tokens of {_WHERE} had the same top-1 token at "
        f"full depth (minimum {p.shadow_agreement_min}). Skip ratio: " + _lookup(r.skip_ratio) + ".",
    )]


def _telemetry_loss(m: _Model) -> list[dict]:
    p = m.profile
    return [_alert(
        "LayerwatchTelemetryLoss",
        f"{m.recorded.telemetry_loss_ratio}{{{m.selector}}} > {p.telemetry_loss_max}",
        m.for_("LayerwatchTelemetryLoss"), config.SEVERITY_TICKET,
        "Gate frames are lost between the shim and the exporter.",
        "The exporter at {{ $labels.instance }} missed " + _value() + " of the gate frames of "
        f"model {{{{ $labels.model_name }}}} (limit {p.telemetry_loss_max}); entropy statistics "
        "are incomplete.",
    )]


_MODEL_RULES = (_profile_series_rules, _single_peak, _runaway_skipping, _skip_rate_surge,
                _entropy_bands, _zero_entropy_ratio, _entropy_drift, _shadow_agreement_low,
                _telemetry_loss)


def model_rules(profile: Profile, timing: Timing) -> list[dict]:
    """The profile's bands as series, then every alert with this model's numbers."""
    m = _Model(profile, Recorded.for_timing(timing), timing)
    rules = [rule for make in _MODEL_RULES for rule in make(m)]
    # The model as a static label as well: the series carry the same value, and it keeps the alerts
    # of two profiles apart for promtool's duplicate-rule check (same name and static labels).
    for rule in rules:
        if "alert" in rule:
            rule["labels"]["model_name"] = profile.model_name
    return rules


def rule_groups(profiles: list[Profile], timing: Timing = Timing()) -> dict:
    """The whole rule file, as data. Groups are evaluated in order: recording rules first."""
    return {"groups": [
        {"name": "layerwatch.recording", "rules": recording_rules(timing)},
        {"name": "layerwatch.common", "rules": common_alerts(timing)},
        *({"name": f"layerwatch.model.{p.model_name}", "rules": model_rules(p, timing)}
          for p in profiles),
    ]}


def recorded_names(groups: dict) -> set[str]:
    return {rule["record"] for group in groups["groups"] for rule in group["rules"] if "record" in rule}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (long PromQL) as literal blocks, so the rule file reads like PromQL."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(data: dict, header: str) -> str:
    return header + yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)


def render_rules(profiles: list[Profile], timing: Timing = Timing()) -> str:
    names = ", ".join(p.model_name for p in profiles)
    header = (f"# Generated by `layerwatch generate` from alerts/profiles ({names}). Do not edit:\n"
              "# change a profile or alerts/rules.py and regenerate.\n")
    return to_yaml(rule_groups(profiles, timing), header)
