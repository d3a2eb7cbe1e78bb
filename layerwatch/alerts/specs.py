"""The alerts, one spec each: everything about an alert but its runbook section and promtool cases.

A spec (`AlertSpec`) is the alert's name, severities, default `for:`, the profile fields it reads
and the builder that writes its Prometheus rule(s) from a profile and a timing; its runbook is the
section `## <name>` of docs/runbooks.md. The rest derives from the specs: `ALERTS` (in rendering
order), the `for:` a profile may override (profile_file.py), the rule groups (rules.py),
and the checks that every alert has a runbook section and promtool cases (tests/stack/test_rules.py).

Adding an alert: a builder decorated with `@alert(...)` below, its section in docs/runbooks.md, and
its firing and silent cases in layerwatch/alerts/tests/alerts.test.yaml.

An alert that reads no profile field is common: one rule set for every model, in the group
`layerwatch.common`. One that reads profile fields is built once per profile, in the group of that
model, and the profile may override its `for:`.

Builders only read the profile they are given: this module imports layerwatch.alerts.profile for types only,
so that the profile can validate its `for:` overrides against the specs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from layerwatch.alerts.durations import Timing, parse_duration
from layerwatch.alerts.profile import Profile
from layerwatch.alerts.recorded import BY_MODEL, ENTROPY_BELOW_HEALTHY, GATE_LAYER_IMPORTANCE_FLOOR, Recorded
from layerwatch.catalog import ZERO_ENTROPY_LIMIT
from layerwatch.mixin import config

PAGE = config.SEVERITY_PAGE
TICKET = config.SEVERITY_TICKET
RATIO_FORMAT = "%.3f"


@dataclass(frozen=True)
class AlertSpec:
    """One alert. Its rules are `build(AlertBuild(spec, timing, recorded, profile))`."""

    name: str
    severities: tuple[str, ...]  # one; or the tiers of a tiered alert, lowest first
    default_for: float  # seconds; a profile may override it for a per-model alert
    build: Callable[[AlertBuild], list[dict]]
    # Profile fields the builder reads (besides model_name, for the selector, and the `for:`
    # overrides); none for a common alert.
    reads: tuple[str, ...] = ()

    @property
    def per_model(self) -> bool:
        return bool(self.reads)

    def for_seconds(self, profile: Profile | None) -> float:
        """This alert's `for:` in seconds: the profile's override of a per-model alert, else the default."""
        if self.per_model and profile is not None:
            return profile.for_durations.get(self.name, self.default_for)
        return self.default_for

    @property
    def runbook_anchor(self) -> str:
        # The runbook heading is the alert name; GitHub's heading anchor is it in lower case.
        return self.name.lower()

    @property
    def runbook_url(self) -> str:
        return f"{config.RUNBOOK_BASE_URL}#{self.runbook_anchor}"


@dataclass(frozen=True)
class AlertBuild:
    """What a builder gets: its own spec, the timing, the recorded names and, for a per-model
    alert, the model's profile. `rule` fills in what the spec fixes (name, `for:`, runbook)."""

    spec: AlertSpec
    timing: Timing
    recorded: Recorded
    model_profile: Profile | None = None  # None for a common alert
    objectives: config.LatencyObjectives = config.VLLM_LATENCY_OBJECTIVES

    @property
    def profile(self) -> Profile:
        if self.model_profile is None:
            raise TypeError(f"{self.spec.name} is built without a profile")
        return self.model_profile

    @property
    def selector(self) -> str:
        return f'model_name="{self.profile.model_name}"'

    @property
    def ran(self) -> str:
        return f'{self.selector}, decision="run"'

    @property
    def for_(self) -> str:
        return self.timing(self.spec.for_seconds(self.profile if self.spec.per_model else None))

    def rule(
        self,
        expr: str,
        summary: str,
        description: str,
        *,
        severity: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> dict:
        spec = self.spec
        if severity is None:
            if len(spec.severities) != 1:
                raise ValueError(f"{spec.name} is tiered {spec.severities}: name the tier")
            severity = spec.severities[0]
        elif severity not in spec.severities:
            raise ValueError(f"{spec.name}: severity {severity!r} is not one of {spec.severities}")
        return {
            "alert": spec.name,
            "expr": expr,
            "for": self.for_,
            "labels": {"severity": severity, **(labels or {})},
            "annotations": {
                "summary": summary,
                "description": description,
                "runbook_url": spec.runbook_url,
            },
        }


_SPECS: list[AlertSpec] = []


def alert(
    name: str, *, severities: tuple[str, ...], default_for: str, reads: tuple[str, ...] = ()
) -> Callable[[Callable[[AlertBuild], list[dict]]], AlertSpec]:
    """Declare an alert: the decorated builder becomes its spec, registered in definition order."""

    def register(build: Callable[[AlertBuild], list[dict]]) -> AlertSpec:
        if any(spec.name == name for spec in _SPECS):
            raise ValueError(f"alert {name} is declared twice")
        spec = AlertSpec(name, severities, parse_duration(default_for), build, reads)
        _SPECS.append(spec)
        return spec

    return register


# --- alert text helpers (Go templates, expanded by Prometheus) -------------------------------------


def _value(fmt: str = RATIO_FORMAT) -> str:
    return '{{ $value | printf "' + fmt + '" }}'


def _lookup(metric: str, fmt: str = RATIO_FORMAT, matchers: str = "") -> str:
    """The value of `metric` for the alert's target and model, or "n/a"."""
    selector = metric + "{" + matchers + "instance=%q,model_name=%q}"
    return (
        "{{ with printf `" + selector + "` $labels.instance $labels.model_name | query }}"
        '{{ . | first | value | printf "' + fmt + '" }}{{ else }}n/a{{ end }}'
    )


_MODEL_ON_TARGET = "{{ $labels.model_name }} on {{ $labels.instance }}"
_WHERE = f"model {_MODEL_ON_TARGET}"


def _most_skipped_layers(b: AlertBuild) -> str:
    return (
        "{{ range printf `topk(3, "
        + b.recorded.skip_ratio_by_layer
        + "{instance=%q,model_name=%q})` $labels.instance $labels.model_name | query }}"
        '{{ .Labels.layer }} ({{ .Value | printf "' + RATIO_FORMAT + '" }}) {{ end }}'
    )


def _static_layers(b: AlertBuild, matchers: str = "") -> str:
    """The layers static now, with the share of tokens whose score was below the threshold (ordered by
    the layer label, as text: an `and` has no order of its own)."""
    low = "layerwatch_routing_layer_low_ratio{instance=%q,model_name=%q" + matchers + "}"
    static = "layerwatch_routing_layer_static{instance=%q,model_name=%q} == 1"
    return (
        "{{ range printf `" + low + " and on (layer) " + static + "` $labels.instance $labels.model_name "
        '$labels.instance $labels.model_name | query | sortByLabel "layer" }}'
        '{{ .Labels.layer }} ({{ .Value | printf "' + RATIO_FORMAT + '" }}) {{ end }}'
    )


def _lowest_layers() -> str:
    """The three layers most often below the threshold in the exporter's window (any exporter)."""
    return (
        "{{ range printf `topk(3, layerwatch_routing_layer_low_ratio{model_name=%q})` $labels.model_name | query }}"
        '{{ .Labels.layer }} ({{ .Value | printf "' + RATIO_FORMAT + '" }}) {{ end }}'
    )


# --- common alerts (no profile) -------------------------------------------------------------------


@alert("LayerwatchTargetDown", severities=(PAGE,), default_for="2m")
def target_down(b: AlertBuild) -> list[dict]:
    jobs = "|".join((config.SHIM_JOB, config.EXPORTER_JOB, config.VLLM_JOB, config.VLLM_GUARD_JOB))
    return [
        b.rule(
            f'up{{job=~"{jobs}"}} == 0',
            "A layerwatch shim, exporter or vLLM guard, or a vLLM engine, cannot be scraped.",
            "Prometheus cannot scrape {{ $labels.job }} at {{ $labels.instance }}; the other "
            "layerwatch alerts of this target are inhibited while it is down.",
        )
    ]


# vLLM's latency against the objectives in config (kubernetes-mixin style: one number per objective,
# for every model). Per token, not per request: the e2e latency grows with the answer's length, so a
# fixed limit on it would page on long answers. The model's skip ratio is in the text, so that the
# first question ("did skipping make us slower?") is answered in the notification.
@alert("LayerwatchVllmLatencyHigh", severities=(TICKET,), default_for="10m")
def vllm_latency_high(b: AlertBuild) -> list[dict]:
    window = b.timing(config.RATE_WINDOW)
    quantile = b.objectives.quantile
    skip_ratio = (
        "{{ with printf `max(" + b.recorded.skip_ratio + "{model_name=%q})` $labels.model_name | query }}"
        '{{ . | first | value | printf "' + RATIO_FORMAT + '" }}{{ else }}n/a (no gate frames){{ end }}'
    )
    rules = []
    for trigger, metric, what, limit in (
        (
            "time_to_first_token",
            "vllm:time_to_first_token_seconds",
            "time to first token",
            b.objectives.time_to_first_token_max,
        ),
        (
            "inter_token",
            "vllm:inter_token_latency_seconds",
            "inter-token latency",
            b.objectives.inter_token_latency_max,
        ),
    ):
        buckets = f"sum by ({BY_MODEL}, le) (rate({metric}_bucket{{{config.VLLM_SELECTOR}}}[{window}]))"
        rules.append(
            b.rule(
                f"histogram_quantile({quantile}, {buckets})\n> {limit}",
                f"vLLM's {what} is above its objective.",
                f"The p{quantile * 100:g} {what} of {_WHERE} is {_value('%.3f')} s over {window} (objective "
                f"{limit:g} s). The model's skip ratio: " + skip_ratio + "; see the engine view of the dashboard "
                "for waiting requests, KV-cache usage and preemptions.",
                labels={"trigger": trigger},
            )
        )
    return rules


# A change is an event: notify at once (the alert stays up for the change window).
@alert("LayerwatchGateWeightsChanged", severities=(TICKET,), default_for="0s")
def gate_weights_changed(b: AlertBuild) -> list[dict]:
    change_window = b.timing(config.GATE_CHANGE_WINDOW)
    served = f"max_over_time(layerwatch_model_info{{{config.SHIM_SELECTOR}}}[{change_window}])"
    hashes_query = (
        f"max by (instance, gates_sha256) (max_over_time(layerwatch_model_info"
        f"{{{config.SHIM_SELECTOR},model_name=%q}}[{change_window}]))"
    )
    return [
        b.rule(
            # Counted across instances, so that a rolling deploy (new instances) is seen too; a
            # restart with the same weights keeps one gates_sha256 and does not fire.
            f"count by (model_name) (\n  count by (model_name, gates_sha256) ({served})\n) > 1",
            "The gate weights served for a model changed.",
            "Model {{ $labels.model_name }} served {{ $value }} different gate weights within "
            f"{change_window}: "
            "{{ range printf `" + hashes_query + "` $labels.model_name | query }}"
            "{{ .Labels.instance }}={{ .Labels.gates_sha256 }} {{ end }}"
            "- check that the change was intended.",
        )
    ]


# An addition to the field's alert set (docs/alerting.md, "The field's reports"): a gate file
# replaced on disk that the shim refused to load.
@alert("LayerwatchGateFileRejected", severities=(TICKET,), default_for="5m")
def gate_file_rejected(b: AlertBuild) -> list[dict]:
    return [
        b.rule(
            f"max by (job, instance, model_name) (layerwatch_gate_file_rejected{{{config.SHIM_SELECTOR}}}) == 1",
            "A replaced gate file was rejected; the shim keeps serving the gates it had.",
            "The gate file of model {{ $labels.model_name }} at {{ $labels.instance }} was replaced on "
            "disk with one the shim refused (incomplete, invalid, or for another model or policy); the "
            "previously loaded gates keep serving, and a restart would fail to start. See the shim's log.",
        )
    ]


# Two shims sending under one shim id (a fleet-wide LAYERWATCH_SHIM_ID, or a fixed id per image): the
# exporter tells their interleaved numberings apart from loss and counts the switches instead. One
# switch can also happen when a restarted shim's numbering overtakes the old one just where frames were
# lost; `for:` twice the rate window keeps such a single count quiet.
@alert("LayerwatchShimIdCollision", severities=(TICKET,), default_for="10m")
def shim_id_collision(b: AlertBuild) -> list[dict]:
    window = b.timing(config.RATE_WINDOW)
    return [
        b.rule(
            f"sum by ({BY_MODEL}) (\n  rate(layerwatch_exporter_frames_interleaved_total{{{config.EXPORTER_SELECTOR}}}"
            f"[{window}])\n) > 0",
            "Several shims send gate frames under one shim id.",
            "The exporter at {{ $labels.instance }} receives frames of model {{ $labels.model_name }} whose "
            "sequence numbers interleave under one shim id ("
            + _value("%.2f")
            + " switches/s): several shims use the same --shim-id. They are counted as interleaved, not as "
            "lost, but per-shim loss can no longer be told apart; give each shim process its own id.",
        )
    ]


# Frames the exporter decodes but refuses (docs/exporter.md) feed no statistic: without this alert the
# dashboards and the other alerts of those models go blind silently. A short burst (a few stray or
# forged frames) stays in the rate window for less than `for:`.
@alert("LayerwatchFramesRejected", severities=(TICKET,), default_for="10m")
def frames_rejected(b: AlertBuild) -> list[dict]:
    window = b.timing(config.RATE_WINDOW)
    return [
        b.rule(
            f"sum by (job, instance, reason) (\n  rate(layerwatch_exporter_frames_rejected_total"
            f"{{{config.EXPORTER_SELECTOR}}}[{window}])\n) > 0",
            "The exporter keeps rejecting gate frames; their statistics are missing.",
            "The exporter at {{ $labels.instance }} rejects gate frames with reason {{ $labels.reason }} ("
            + _value("%.2f")
            + " frames/s): they are counted in no statistic, so the panels and alerts of the models that "
            "send them go blind. See the runbook for what the reason means.",
        )
    ]


# A collector that raises leaves its metrics out of the scrape while the target stays up (node_exporter's
# isolation): the alerts that read those metrics go blind, silently, unless this one fires. A single
# failed scrape stays in min_over_time for one window, shorter than `for:`.
@alert("LayerwatchCollectorFailing", severities=(TICKET,), default_for="10m")
def collector_failing(b: AlertBuild) -> list[dict]:
    window = b.timing(config.RATE_WINDOW)
    exporter = f"layerwatch_exporter_scrape_collector_success{{{config.EXPORTER_SELECTOR}}}"
    shim = f"layerwatch_scrape_collector_success{{{config.SHIM_SELECTOR}}}"
    return [
        b.rule(
            f"min_over_time({exporter}[{window}]) == 0\nor\nmin_over_time({shim}[{window}]) == 0",
            "A metrics collector of a layerwatch target keeps failing; its metrics are missing.",
            "The {{ $labels.collector }} collector of {{ $labels.job }} at {{ $labels.instance }} has failed "
            f"at least once in every {window} for {b.for_}: its metrics are left out of those scrapes (the rest "
            "is served, so the target is up), and the alerts that read them cannot fire. The target's log has "
            "the exception.",
        )
    ]


# --- per-model alerts (thresholds from the profile) -------------------------------------------------


# A departure from the healthy shape of the pooled entropy distribution (layerwatch/alerts/profile.py,
# BimodalityProfile): a healthy shape with two humps that loses one (`single_peak`), or a window whose
# distribution lies farther from the recorded healthy histogram than any healthy window did (`shape`).
@alert("LayerwatchEntropyShapeChanged", severities=(PAGE,), default_for="10m", reads=("bimodality",))
def entropy_shape_changed(b: AlertBuild) -> list[dict]:
    bp = b.profile.bimodality
    exporter = f"{config.EXPORTER_SELECTOR}, {b.selector}"
    baseline = (
        ", ".join(
            f"{label} {value}"
            for label, value in (
                ("peaks", bp.peaks),
                ("bimodality coefficient", bp.bimodality_coefficient),
                ("dip", bp.dip),
                ("dip p-value", bp.dip_p_value),
            )
            if value is not None
        )
        or "not recorded in the profile"
    )
    window = (
        "bimodality coefficient "
        + _lookup("layerwatch_entropy_bimodality_coefficient")
        + ", dip "
        + _lookup("layerwatch_entropy_dip")
        + " (p = "
        + _lookup("layerwatch_entropy_dip_p_value")
        + "), "
        + _lookup("layerwatch_entropy_peaks", "%.0f")
        + f" peak(s). Healthy baseline: {baseline}."
    )
    observations = _lookup("layerwatch_entropy_window_observations", "%.0f")
    rules = []
    if bp.healthy_bimodal:
        rules.append(
            b.rule(
                # The exporter withholds the verdict below its own minimum window; the profile may ask for more.
                f"layerwatch_entropy_bimodal{{{exporter}}} == 0\n"
                f"and on ({BY_MODEL})\n"
                f"layerwatch_entropy_window_observations{{{exporter}}} >= {bp.min_observations}",
                "The gate entropy distribution is no longer bimodal (a single peak).",
                f"The entropy window of {_WHERE} holds {observations} entropies and is not bimodal: {window} "
                "Gating has degraded into static pruning or noise; the usual cause is gate weights overwritten or "
                "not loaded.",
                labels={"trigger": "single_peak"},
            )
        )
    if bp.histogram:
        gaps = (
            "abs(layerwatch_entropy_window_below_ratio{instance=%q,model_name=%q} - on (model_name, edge) "
            f"group_left () {ENTROPY_BELOW_HEALTHY})"
        )
        largest_gap = (
            "{{ range printf `topk(1, " + gaps + ")` $labels.instance $labels.model_name | query }}"
            "{{ .Labels.edge }}{{ end }}"
        )
        rules.append(
            b.rule(
                f"{b.recorded.entropy_shape_distance}{{{b.selector}}} > {bp.shape_distance_max}\n"
                f"and on ({BY_MODEL})\n"
                f"layerwatch_entropy_window_observations{{{exporter}}} >= {bp.shape_min_observations}",
                "The gate entropy distribution has left the model's healthy shape.",
                f"The entropy window of {_WHERE} holds {observations} entropies whose distribution lies "
                f"{_value()} from the healthy one (the largest gap between their shares below an edge, here below "
                f"{largest_gap}; limit {bp.shape_distance_max}, the most a healthy window moved): {window} The gates "
                "score tokens differently than when the profile was measured: gate weights overwritten, reset or "
                "for another model, or traffic unlike the calibration's (see the runbook).",
                labels={"trigger": "shape"},
            )
        )
    return rules


# The pooled histogram stays bimodal when gating degrades into static pruning (docs/exporter.md,
# "Static pruning and the routing verdict"); the routing statistics keep the layer axis and see it.
@alert("LayerwatchRoutingStatic", severities=(PAGE,), default_for="10m", reads=("routing",))
def routing_static(b: AlertBuild) -> list[dict]:
    rp = b.profile.routing
    exporter = f"{config.EXPORTER_SELECTOR}, {b.selector}"
    # The exporter withholds the share and the layer states below its own minimum window (and while
    # nothing scores below tau); the profile may ask for more tokens.
    traffic = f"and on ({BY_MODEL})\nlayerwatch_routing_window_tokens{{{exporter}}} >= {rp.min_tokens}"
    baseline_layers = ", ".join(map(str, rp.static_layers)) or "none"
    unexpected = f', layer!~"{"|".join(map(str, rp.static_layers))}"' if rp.static_layers else ""
    baseline_share = "not recorded" if rp.token_dependent_share is None else f"{rp.token_dependent_share}"
    share = _lookup("layerwatch_routing_token_dependent_share")
    tokens = _lookup("layerwatch_routing_window_tokens", "%.0f")
    summary = "Layer skipping has turned into static pruning."
    return [
        b.rule(
            f"layerwatch_routing_token_dependent_share{{{exporter}}} < {rp.share_floor}\n{traffic}",
            summary,
            f"Only {_value()} of the below-threshold gate scores of {_WHERE} lie in layers whose decision "
            f"depends on the token (floor {rp.share_floor}; healthy baseline {baseline_share}): the same "
            "layers are skipped for every token. Static layers now, with their share of tokens below the "
            "threshold: " + _static_layers(b) + f"(healthy baseline: {baseline_layers}). Window: {tokens} tokens.",
            labels={"trigger": "share"},
        ),
        b.rule(
            f"count by ({BY_MODEL}) (\n  layerwatch_routing_layer_static{{{exporter}{unexpected}}} == 1\n)\n{traffic}",
            summary,
            f"{_value('%.0f')} layer(s) of {_WHERE} that route per token in the healthy baseline are now "
            "static (below the threshold for almost every token): "
            + _static_layers(b, unexpected)
            + f"(static in the baseline: {baseline_layers}). Token-dependent share {share} (floor "
            f"{rp.share_floor}). Window: {tokens} tokens.",
            labels={"trigger": "new_static_layers"},
        ),
    ]


@alert(
    "LayerwatchRunawaySkipping",
    severities=(PAGE,),
    default_for="5m",
    reads=("runaway_skip_ratio", "runaway_fallbacks_per_minute"),
)
def runaway_skipping(b: AlertBuild) -> list[dict]:
    p, r = b.profile, b.recorded
    summary = "Almost every layer is being skipped."
    return [
        b.rule(
            f"{r.skip_ratio}{{{b.selector}}} > {p.runaway_skip_ratio}",
            summary,
            f"The skip ratio of {_WHERE} is {_value()}, above the runaway limit "
            f"{p.runaway_skip_ratio}. Most skipped layers: {_most_skipped_layers(b)}",
            labels={"trigger": "skip_ratio"},
        ),
        b.rule(
            f"{r.fallbacks_rate}{{{b.selector}}} * 60 > {p.runaway_fallbacks_per_minute}",
            summary,
            f"Model {_MODEL_ON_TARGET} keeps falling back to full depth: {_value('%.2f')} "
            f"fallbacks per minute (limit {p.runaway_fallbacks_per_minute}), sustained for "
            f"{b.for_}. Skip ratio: " + _lookup(r.skip_ratio) + ".",
            labels={"trigger": "fallbacks"},
        ),
    ]


@alert(
    "LayerwatchSkipRateSurge", severities=(TICKET,), default_for="5m", reads=("skip_surge_factor", "skip_ratio_normal")
)
def skip_rate_surge(b: AlertBuild) -> list[dict]:
    p, r = b.profile, b.recorded
    # The floor at the normal skip ratio keeps a jump from 1 % to 3 % (3x, but harmless) quiet.
    return [
        b.rule(
            f"{r.skip_ratio}{{{b.selector}}}\n> {p.skip_surge_factor} * {r.skip_ratio_baseline}{{{b.selector}}}\n"
            f"and\n{r.skip_ratio}{{{b.selector}}} > {p.skip_ratio_normal}",
            "The skip ratio jumped far above its own recent baseline.",
            f"The skip ratio of {_WHERE} is {_value()}, more than {p.skip_surge_factor}x its "
            f"{b.timing(config.SKIP_BASELINE_WINDOW)} baseline "
            + _lookup(r.skip_ratio_baseline)
            + f" (healthy: {p.skip_ratio_normal}). Most skipped layers: {_most_skipped_layers(b)}",
        )
    ]


def skip_collapse_limit(profile: Profile) -> float:
    """The skip ratio below which skipping has collapsed (rounded: it is printed into the rule)."""
    return float(f"{profile.skip_collapse_fraction * profile.skip_ratio_normal:.6g}")


# The mirror of runaway skipping: the gates keep (almost) every layer, so cost and power per token go
# back up while quality looks fine.
@alert(
    "LayerwatchSkippingCollapsed",
    severities=(TICKET,),
    default_for="15m",
    reads=("skip_collapse_fraction", "skip_ratio_normal", "routing"),
)
def skipping_collapsed(b: AlertBuild) -> list[dict]:
    p, r = b.profile, b.recorded
    limit = skip_collapse_limit(p)
    exporter = f"{config.EXPORTER_SELECTOR}, {b.selector}"
    tokens = (
        "{{ with printf `max(layerwatch_routing_window_tokens{model_name=%q})` $labels.model_name | query }}"
        '{{ . | first | value | printf "%.0f" }}{{ else }}n/a{{ end }}'
    )
    return [
        b.rule(
            # Traffic: the exporter's routing window holds the profile's minimum of tokens (a quiet model
            # has no skip ratio at all, 0/0; a trickle of short requests is all patience warm-up).
            f"{r.skip_ratio}{{{b.selector}}} < {limit}\n"
            f"and on (model_name)\n"
            f"max by (model_name) (layerwatch_routing_window_tokens{{{exporter}}}) >= {p.routing.min_tokens}",
            "Layer skipping collapsed: (almost) every layer runs.",
            f"The skip ratio of {_WHERE} is {_value()}, below {limit} ({p.skip_collapse_fraction} of the "
            f"healthy {p.skip_ratio_normal}): cost and power per token are back near full depth. Gate "
            "scores below the threshold in the exporter's window (share of tokens, most first): "
            + _lowest_layers()
            + f"over {tokens} tokens.",
        )
    ]


# Critical: the field's incident (docs/alerting.md, "The field's reports": a speech-to-text bug sent
# one category's requests down the same pruned path) degrades the answers of that category now,
# while every model-wide signal stays healthy: the global skip ratio moves by a point or two, so
# LayerwatchSkipRateSurge and LayerwatchRunawaySkipping never see it, and the shadow check samples
# too few of its requests to fall below its floor. Nothing else pages for it, and a ticket leaves
# those users with degraded answers for days. Healthy traffic keeps this share near zero (the
# profile's normal_share is measured with a margin), and `for:` of twice the rate window means one
# odd request, which stays in the window for 5 minutes, cannot fire it: only a sustained tail does.
@alert("LayerwatchRequestTailRunaway", severities=(PAGE,), default_for="10m", reads=("request_tail",))
def request_tail_runaway(b: AlertBuild) -> list[dict]:
    p, r = b.profile, b.recorded
    cutoff = p.request_tail.runaway_skip_fraction
    # A cut-off is a bucket edge below 1 and above 0 (layerwatch/alerts/profile_file.py), so its `le` reads the same
    # in Prometheus 2 (as exposed) and 3 (normalised): 0.35 -> "0.35".
    tail = f'{r.request_skip_tail_ratio}{{{b.selector}, le="{cutoff:g}"}}'
    layers = r.runaway_skip_ratio_by_layer + "{instance=%q,model_name=%q}"
    above = layers + " - " + r.skip_ratio_by_layer + "{instance=%q,model_name=%q}"
    return [
        b.rule(
            # Without `le`: the alert is about the model on its target, like the others.
            f"max without (le) ({tail}) > {p.request_tail.normal_share}",
            "A tail of requests skips far more layers than the rest of the traffic.",
            f"{_value()} of the finished requests of {_WHERE} skipped more than {cutoff:g} of their "
            f"decode layer evaluations (healthy: up to {p.request_tail.normal_share}; the shim counts "
            "runaway requests above "
            + _lookup("layerwatch_request_runaway_skip_fraction", "%g")
            + "), while the model's skip ratio is "
            + _lookup(r.skip_ratio)
            + ". Layers these requests skip most: "
            + _top_layers(f"topk(3, {layers})", "$labels.instance $labels.model_name", RATIO_FORMAT)
            + "- most above the model's own per-layer skip ratios: "
            + _top_layers(
                f"topk(3, {above})",
                "$labels.instance $labels.model_name $labels.instance $labels.model_name",
                "+%.3f",
            )
            + "- likely one category of inputs pruned the same way every time (see the runbook).",
        )
    ]


def _top_layers(query: str, arguments: str, fmt: str) -> str:
    """`layer (value)` for each series `query` returns, `%q` placeholders filled with `arguments`."""
    return (
        "{{ range printf `" + query + "` " + arguments + " | query }}"
        '{{ .Labels.layer }} ({{ .Value | printf "' + fmt + '" }}) {{ end }}'
    )


def _entropy_band(b: AlertBuild, series: str, band_field: str, what: str) -> list[dict]:
    band = getattr(b.profile, band_field)
    return [
        b.rule(
            f"{series}{{{b.ran}}} < {band.low}\nor\n{series}{{{b.ran}}} > {band.high}",
            f"The {what} of active-layer gate entropy left the model's healthy band.",
            f"The entropy {what} of the layers the skip rule ran, {_WHERE}, is {_value()}; "
            f"healthy band {band.low}-{band.high}.",
        )
    ]


@alert("LayerwatchEntropyMeanOutOfBand", severities=(TICKET,), default_for="15m", reads=("entropy_mean",))
def entropy_mean_out_of_band(b: AlertBuild) -> list[dict]:
    return _entropy_band(b, b.recorded.entropy_mean_by_decision, "entropy_mean", "mean")


@alert("LayerwatchEntropySpreadOutOfBand", severities=(TICKET,), default_for="15m", reads=("entropy_std",))
def entropy_spread_out_of_band(b: AlertBuild) -> list[dict]:
    return _entropy_band(b, b.recorded.entropy_std_by_decision, "entropy_std", "standard deviation")


# Two tiers of one alert: Alertmanager's critical-inhibits-warning rule keeps one notification.
@alert(
    "LayerwatchZeroEntropyRatioHigh",
    severities=(TICKET, PAGE),
    default_for="10m",
    reads=("zero_ratio", "zero_ratio_page"),
)
def zero_entropy_ratio_high(b: AlertBuild) -> list[dict]:
    p = b.profile
    return [
        b.rule(
            f"{b.recorded.entropy_zero_ratio}{{{b.selector}}} > {limit}",
            "Too many layers have zero gate entropy.",
            f"{_value()} of the gate entropies of {_WHERE} are below {ZERO_ENTROPY_LIMIT}, above "
            f"{limit} ({meaning}; healthy band {p.zero_ratio.low}-{p.zero_ratio.high}).",
            severity=severity,
        )
        for severity, limit, meaning in (
            (TICKET, p.zero_ratio.high, "above the healthy band"),
            (PAGE, p.zero_ratio_page, "over-pruning"),
        )
    ]


# Default `for:` 5m: the field's drift alarm "stays above 0.18 for 5 minutes" (docs/alerting.md,
# "The field's reports").
@alert("LayerwatchEntropyDrift", severities=(TICKET,), default_for="5m", reads=("drift",))
def entropy_drift(b: AlertBuild) -> list[dict]:
    p, r = b.profile, b.recorded
    window = b.timing(p.drift.window)
    return [
        b.rule(
            f"stddev_over_time({r.entropy_mean_by_decision}{{{b.ran}}}[{window}]) > {p.drift.limit}",
            "The active-layer entropy mean is drifting.",
            f"The {window} standard deviation of the entropy mean of {_WHERE} is {_value()}, "
            f"above {p.drift.limit}. Current mean: "
            + _lookup(r.entropy_mean_by_decision, matchers='decision="run",')
            + ".",
        )
    ]


# Agreement: the full-depth argmax against the gated model's own argmax at generation time (raw logits),
# for every request the shadow check samples, whatever its temperature (docs/service.md, "Quality guard").
# The agreement pages only when it is below the floor beyond its sampling noise: the ratio plus
# AGREEMENT_NOISE_Z binomial standard errors, sqrt(p (1 - p) / n) over the window's n checked tokens,
# is below it too. A window of a few hundred tokens (low traffic, a low shadow rate, the scaled
# end-to-end windows) moves a healthy 0.83 by +-0.024 per standard error, across a floor calibrated
# 0.05 below it on 512-token chunks; at production volume (thousands of tokens) the bound is the ratio.
AGREEMENT_NOISE_Z = 2


@alert("LayerwatchShadowAgreementLow", severities=(PAGE,), default_for="10m", reads=("shadow_agreement_min",))
def shadow_agreement_low(b: AlertBuild) -> list[dict]:
    p, r = b.profile, b.recorded
    ratio = f"{r.shadow_agreement_ratio}{{{b.selector}}}"
    tokens = (
        f"sum by ({BY_MODEL}) (increase(layerwatch_shadow_tokens_total{{{config.QUALITY_GUARD_SELECTOR}, {b.selector}}}"
        f"[{b.timing(config.RATE_WINDOW)}]))"
    )
    return [
        b.rule(
            f"{ratio} < {p.shadow_agreement_min}\nand\n"
            f"{ratio} + {AGREEMENT_NOISE_Z} * sqrt({ratio} * (1 - {ratio}) / {tokens}) < {p.shadow_agreement_min}",
            "Full-depth re-checks disagree with the gated model too often.",
            f"Only {_value()} of the shadow-checked tokens of {_WHERE} had the same top-1 token at "
            f"full depth as the gated model's own (minimum {p.shadow_agreement_min}, beyond "
            f"{AGREEMENT_NOISE_Z} standard errors of the window's tokens). Quality cost: "
            + _lookup(r.shadow_kl_per_token, "%.4f")
            + " nats per token. Skip ratio: "
            + _lookup(r.skip_ratio)
            + ".",
        )
    ]


# An addition to the field's alert set (docs/alerting.md, "The field's reports"): the gates are
# judged against what the layers do. The shadow check's full-depth pass measures each layer's
# relative residual update next to its gate score (docs/service.md, "Layer signals"); within each
# layer, healthy gates score a token high where the layer's update on the token it decides is large.
# The headline (the mean over the layers) pages; the description names the layers below their own
# calibrated floors, largest deficit first (one layer's own correlation is too noisy to page on:
# docs/runbooks.md). Absent (too few samples, no shadow checks): silent.
@alert("LayerwatchGateMiscalibrated", severities=(PAGE,), default_for="10m", reads=("gate_importance",))
def gate_miscalibrated(b: AlertBuild) -> list[dict]:
    p, r = b.profile, b.recorded
    g = p.gate_importance
    layers = "layerwatch_gate_layer_importance_correlation{instance=%q,model_name=%q}"
    if g.layer_floors:
        # The per-layer floors are this model's recorded constants (layerwatch/alerts/rules.py).
        floors = GATE_LAYER_IMPORTANCE_FLOOR + "{model_name=%q}"
        named = "Layers below their own healthy floor, largest deficit first: " + _top_layers(
            f"sort_desc({floors} - on (model_name, layer) group_right () {layers} > 0)",
            "$labels.model_name $labels.instance $labels.model_name",
            "%.3f below",
        )
    else:
        named = "Lowest layers (no per-layer floors in the profile): " + _top_layers(
            f"sort(bottomk(3, {layers}))", "$labels.instance $labels.model_name", RATIO_FORMAT
        )
    baseline = "" if g.correlation is None else f"; healthy baseline {g.correlation}"
    return [
        b.rule(
            f"layerwatch_gate_importance_correlation{{{config.SHIM_SELECTOR}, {b.selector}}}\n< {g.correlation_min}",
            "The gates no longer rank tokens by how much their layers matter.",
            f"On the full-depth shadow checks of {_WHERE}, the rank correlation between a layer's gate score "
            f"and its relative residual update on the token the score decides, averaged over "
            + _lookup("layerwatch_gate_importance_layers", "%.0f")
            + f" layers, is {_value()} (floor {g.correlation_min}{baseline}): skip decisions no longer follow "
            "which tokens each layer matters for. "
            + named
            + "- shadow agreement "
            + _lookup(r.shadow_agreement_ratio)
            + ". Usual causes: gates for another model, layer order or hidden-state layout, or edited gate weights.",
        )
    ]


# Two places lose frames, each counted once: the exporter sees the frames lost in transit as sequence
# gaps, the shim counts the frames it could not send (they take no sequence number). Each trigger names
# the target to look at.
@alert("LayerwatchTelemetryLoss", severities=(TICKET,), default_for="10m", reads=("telemetry_loss_max",))
def telemetry_loss(b: AlertBuild) -> list[dict]:
    p, r = b.profile, b.recorded
    summary = "Gate frames are lost between the shim and the exporter."
    reasons = (
        "{{ range printf `sum by (reason) (rate(layerwatch_telemetry_frames_dropped_total{instance=%q,model_name=%q}"
        f"[{b.timing(config.RATE_WINDOW)}])) > 0` "
        '$labels.instance $labels.model_name | query | sortByLabel "reason" }}'
        '{{ .Labels.reason }} ({{ .Value | printf "%.2f" }}/s) {{ end }}'
    )
    return [
        b.rule(
            f"{r.telemetry_loss_ratio}{{{b.selector}}} > {p.telemetry_loss_max}",
            summary,
            "The exporter at {{ $labels.instance }} missed " + _value() + " of the gate frames of "
            f"model {{{{ $labels.model_name }}}} in transit (limit {p.telemetry_loss_max}); entropy statistics "
            "are incomplete.",
            labels={"trigger": "lost"},
        ),
        b.rule(
            f"{r.telemetry_drop_ratio}{{{b.selector}}} > {p.telemetry_loss_max}",
            summary,
            "The shim at {{ $labels.instance }} could not send " + _value() + " of the gate frames of "
            f"model {{{{ $labels.model_name }}}} (limit {p.telemetry_loss_max}): " + reasons + "- the "
            "exporter's entropy statistics are incomplete.",
            labels={"trigger": "dropped"},
        ),
    ]


# The quality cost of skipping as a distribution distance, not only the top-1 token: the mean of
# KL(gated || full) per shadow-checked token, on the coarsened distributions of the gated model's
# top-K (a lower bound; docs/service.md, "Quality guard"). A page: the answers are measurably worse.
@alert("LayerwatchShadowQualityCost", severities=(PAGE,), default_for="10m", reads=("shadow_kl_nats_max",))
def shadow_quality_cost(b: AlertBuild) -> list[dict]:
    p, r = b.profile, b.recorded
    return [
        b.rule(
            f"{r.shadow_kl_per_token}{{{b.selector}}} > {p.shadow_kl_nats_max}",
            "Skipping costs more answer quality than the model's healthy baseline.",
            f"The shadow-checked tokens of {_WHERE} cost {_value('%.4f')} nats each of KL(gated || full) "
            f"between the two models' next-token distributions (limit {p.shadow_kl_nats_max}; a lower bound). "
            "Estimated perplexity increase: "
            + _lookup(r.shadow_perplexity_increase)
            + "; shadow agreement "
            + _lookup(r.shadow_agreement_ratio)
            + "; skip ratio "
            + _lookup(r.skip_ratio)
            + ".",
        )
    ]


# LayerwatchQualityGuardBlind: this many gated requests in the window with no shadow-checked token is
# gated traffic the quality pages did not see, whatever the shadow rate: an absent quality figure must
# not read as healthy. Where the rate expected this many checks too, zero by chance has probability at
# most e^-20 (each of n gated requests is checked with probability r: (1 - r)^n <= e^-nr), 2e-9: the
# checks fail; where it expected fewer, the rate is too low for the traffic.
MIN_UNCHECKED_GATED_REQUESTS = 20


# A ticket: the quality pages (shadow agreement, quality cost, gate calibration) cannot fire while the
# shadow check measures nothing, and nothing else would say so.
@alert("LayerwatchQualityGuardBlind", severities=(TICKET,), default_for="5m", reads=("shadow_rate_min",))
def quality_guard_blind(b: AlertBuild) -> list[dict]:
    p = b.profile
    guard = f"{config.QUALITY_GUARD_SELECTOR}, {b.selector}"  # a shim's or a vLLM guard's series
    shim = f"{config.SHIM_SELECTOR}, {b.selector}"
    window = b.timing(config.QUALITY_GUARD_WINDOW)

    def increase(metric: str, window: str, matchers: str = "", selector: str = guard) -> str:
        return f"sum by ({BY_MODEL}) (increase({metric}{{{selector}{matchers}}}[{window}]))"

    gated = increase("layerwatch_depth_decisions_total", window, ', mode!="full"')
    lowest_rate = (
        "{{ with printf `min(min_over_time(layerwatch_mitigation_shadow_rate{instance=%q,model_name=%q}"
        f"[{window}]))` "
        '$labels.instance $labels.model_name | query }}{{ . | first | value | printf "%g" }}{{ else }}n/a{{ end }}'
    )
    tokens = increase("layerwatch_shadow_tokens_total", window)
    # A shim told to check nothing (rate 0) is the `rate` trigger's, or deliberate where the profile
    # expects no checks.
    checking = f"max by ({BY_MODEL}) (max_over_time(layerwatch_mitigation_shadow_rate{{{guard}}}[{window}]))"
    summary = "The quality guard measures nothing: skipping could hurt the answers unseen."
    rules = [
        b.rule(
            f"{gated} >= {MIN_UNCHECKED_GATED_REQUESTS}\nand on ({BY_MODEL})\n{tokens} == 0\nand on ({BY_MODEL})\n"
            f"{checking} > 0",
            summary,
            f"{_value('%.0f')} gated requests of {_WHERE} in {window}, and no shadow check measured a token: "
            "the shadow agreement, quality cost and gate calibration figures are absent, so their pages cannot "
            "fire. Lowest shadow rate: "
            + lowest_rate
            + f"; where it times the requests is {MIN_UNCHECKED_GATED_REQUESTS} or more, the checks fail (outcomes "
            "of the sampled requests: "
            + _outcomes(b, window)
            + "- see the shim's or vLLM guard's log for 'shadow re-check failed'); where it is less, raise "
            "--shadow-rate for this traffic.",
            labels={"trigger": "no_checks"},
        ),
        b.rule(
            # Layer signals come from inside the shim's forward only: a vLLM guard has none to lose.
            f"{increase('layerwatch_shadow_tokens_total', window, selector=shim)} > 0\nand on ({BY_MODEL})\n"
            f"{increase('layerwatch_layer_signal_tokens_total', window, selector=shim)} == 0",
            summary,
            f"The shadow check of {_WHERE} compared {_value('%.0f')} tokens in {window} but measured no layer "
            "signal on any of them: the gate calibration (LayerwatchGateMiscalibrated) has no samples. "
            "Non-finite layer signals are left out: check the model's numerics and the shim's log.",
            labels={"trigger": "no_layer_signals"},
        ),
    ]
    if p.shadow_rate_min > 0:  # a profile that expects no checks has nothing to compare the rate with
        traffic = increase("layerwatch_depth_decisions_total", b.timing(config.RATE_WINDOW), ', mode!="full"')
        rules.append(
            b.rule(
                f"max by ({BY_MODEL}) (layerwatch_mitigation_shadow_rate{{{guard}}}) < {p.shadow_rate_min}\n"
                f"and on ({BY_MODEL})\n{traffic} > 0",
                summary,
                f"The shadow check rate of {_WHERE} is {_value('%g')} while it serves gated requests, below the "
                f"{p.shadow_rate_min:g} its profile expects: too few or no requests are compared with the "
                "full-depth model. Set --shadow-rate.",
                labels={"trigger": "rate"},
            )
        )
    return rules


def _outcomes(b: AlertBuild, window: str) -> str:
    """`outcome (count)` for each outcome of the sampled requests over `window` (a quoted query)."""
    query = f"sum by (outcome) (increase(layerwatch_shadow_requests_total{{instance=%q,model_name=%q}}[{window}])) > 0"
    return (
        "{{ range printf `" + query + '` $labels.instance $labels.model_name | query | sortByLabel "outcome" }}'
        '{{ .Labels.outcome }} ({{ .Value | printf "%.0f" }}) {{ else }}none {{ end }}'
    )


# --- derived from the specs above ------------------------------------------------------------------

ALERTS: tuple[AlertSpec, ...] = tuple(_SPECS)  # rendering order: common, then per model
ALERT_NAMES: tuple[str, ...] = tuple(spec.name for spec in ALERTS)
COMMON_ALERTS: tuple[AlertSpec, ...] = tuple(spec for spec in ALERTS if not spec.per_model)
PER_MODEL_ALERTS: tuple[AlertSpec, ...] = tuple(spec for spec in ALERTS if spec.per_model)
