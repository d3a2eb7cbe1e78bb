"""The figure each page reads, next to the profile limit its alert compares it with.

For views that show a model's state beside its alerts (`layerwatch top --prometheus`, `layerwatch
demo`): every entry is one PromQL query over the series the alert itself reads (layerwatch/alerts/specs.py,
under the recorded names of the rendering's timing) and the profile field that holds its limit.
Every rule of a per-model alert that pages has its entry (its `trigger`, where the alert has
several; tests/test_alert_view.py holds FIGURES to that), so that a page on screen always has its
figure beside it. A figure whose rule a profile does not generate (LayerwatchEntropyShapeChanged's
triggers follow the recorded healthy shape) is left out for that model (`figures_for`). Adding a
figure is one entry in FIGURES (one without an alert and limit is shown for context).
LayerwatchTargetDown reads `up`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from layerwatch.alerts.profile import Profile
from layerwatch.alerts.recorded import Recorded
from layerwatch.alerts.specs import skip_collapse_limit
from layerwatch.mixin import config
from layerwatch.statistics import DIP_ALPHA


def _ratio(value: float) -> str:
    return f"{value:.3f}"


def _count(value: float) -> str:
    return f"{value:.0f}"


def _percent_increase(value: float) -> str:
    return f"{100 * value:+.1f} %"


@dataclass(frozen=True)
class Figure:
    label: str
    alert: str | None  # the alert that reads it (layerwatch/alerts/specs.py); None: shown for context only
    # PromQL over the series the alert reads, given the model's selector (`model_name="..."`).
    series: Callable[[Recorded, Profile, str], str]
    limit: Callable[[Profile], float] | None  # None with no alert
    fires_below: bool  # the alert fires below the limit (else above it); the worse direction
    trigger: str | None = None  # the `trigger` label of the alert's rule that reads it, where it has several
    show: Callable[[float], str] = _ratio  # the value (and the limit) as the screen writes it
    applies: Callable[[Profile], bool] = lambda p: True  # whether the profile's rules read this figure

    def query(self, recorded: Recorded, profile: Profile) -> str:
        """The worst of the model's series (lowest or highest across its targets)."""
        selector = f'model_name="{profile.model_name}"'
        return f"{'min' if self.fires_below else 'max'}({self.series(recorded, profile, selector)})"

    def breached(self, value: float, profile: Profile) -> bool:
        if self.limit is None:
            return False
        limit = self.limit(profile)
        return value < limit if self.fires_below else value > limit


def _newly_static_layers(r: Recorded, p: Profile, s: str) -> str:
    """How many layers are static that the healthy profile does not expect static: LayerwatchRoutingStatic's
    new_static_layers rule counts the same; 0 (not absent) while the exporter reports the layers."""
    expected = f', layer!~"{"|".join(map(str, p.routing.static_layers))}"' if p.routing.static_layers else ""
    exporter = f"{config.EXPORTER_SELECTOR}, {s}"
    return (
        f"count(layerwatch_routing_layer_static{{{exporter}{expected}}} == 1)"
        f" or (0 * max(layerwatch_routing_window_tokens{{{exporter}}}))"
    )


FIGURES: tuple[Figure, ...] = (
    Figure(
        "token-dependent share",
        "LayerwatchRoutingStatic",
        lambda r, p, s: f"layerwatch_routing_token_dependent_share{{{config.EXPORTER_SELECTOR}, {s}}}",
        lambda p: p.routing.share_floor,
        fires_below=True,
        trigger="share",
    ),
    Figure(
        "newly static layers",
        "LayerwatchRoutingStatic",
        _newly_static_layers,
        lambda p: 0.0,
        fires_below=False,
        trigger="new_static_layers",
        show=_count,
    ),
    Figure(
        "entropy peaks",
        "LayerwatchEntropyShapeChanged",
        lambda r, p, s: f"layerwatch_entropy_peaks{{{config.EXPORTER_SELECTOR}, {s}}}",
        lambda p: 2.0,  # layerwatch/statistics.py: bimodal takes two peaks and the dip test
        fires_below=True,
        trigger="single_peak",
        show=_count,
        applies=lambda p: p.bimodality.healthy_bimodal,
    ),
    Figure(
        "dip test p-value",
        "LayerwatchEntropyShapeChanged",
        lambda r, p, s: f"layerwatch_entropy_dip_p_value{{{config.EXPORTER_SELECTOR}, {s}}}",
        lambda p: DIP_ALPHA,
        fires_below=False,
        trigger="single_peak",
        applies=lambda p: p.bimodality.healthy_bimodal,
    ),
    Figure(
        "entropy shape distance",
        "LayerwatchEntropyShapeChanged",
        lambda r, p, s: f"{r.entropy_shape_distance}{{{s}}}",
        lambda p: p.bimodality.shape_distance_max or 0.0,  # applies only where it is recorded
        fires_below=False,
        trigger="shape",
        applies=lambda p: bool(p.bimodality.histogram),
    ),
    Figure(
        "skip ratio",
        "LayerwatchRunawaySkipping",
        lambda r, p, s: f"{r.skip_ratio}{{{s}}}",
        lambda p: p.runaway_skip_ratio,
        fires_below=False,
        trigger="skip_ratio",
    ),
    Figure(
        "fallbacks per minute",
        "LayerwatchRunawaySkipping",
        lambda r, p, s: f"{r.fallbacks_rate}{{{s}}} * 60",
        lambda p: p.runaway_fallbacks_per_minute,
        fires_below=False,
        trigger="fallbacks",
        show=lambda v: f"{v:.1f}",
    ),
    Figure(
        "skip ratio, collapse floor",
        "LayerwatchSkippingCollapsed",
        lambda r, p, s: f"{r.skip_ratio}{{{s}}}",
        skip_collapse_limit,
        fires_below=True,
    ),
    Figure(
        "zero-entropy ratio",
        "LayerwatchZeroEntropyRatioHigh",
        lambda r, p, s: f"{r.entropy_zero_ratio}{{{s}}}",
        lambda p: p.zero_ratio_page,
        fires_below=False,
    ),
    Figure(
        "requests in the skip tail",
        "LayerwatchRequestTailRunaway",
        lambda r, p, s: f'{r.request_skip_tail_ratio}{{{s}, le="{p.request_tail.runaway_skip_fraction:g}"}}',
        lambda p: p.request_tail.normal_share,
        fires_below=False,
    ),
    Figure(
        "shadow agreement",
        "LayerwatchShadowAgreementLow",
        lambda r, p, s: f"{r.shadow_agreement_ratio}{{{s}}}",
        lambda p: p.shadow_agreement_min,
        fires_below=True,
    ),
    Figure(
        "quality cost (nats/token)",
        "LayerwatchShadowQualityCost",
        lambda r, p, s: f"{r.shadow_kl_per_token}{{{s}}}",
        lambda p: p.shadow_kl_nats_max,
        fires_below=False,
        show=lambda v: f"{v:.4f}",
    ),
    Figure(
        "est. perplexity increase",
        None,
        lambda r, p, s: f"{r.shadow_perplexity_increase}{{{s}}}",
        None,
        fires_below=False,
        show=_percent_increase,
    ),
    Figure(
        "gate-importance correlation",
        "LayerwatchGateMiscalibrated",
        lambda r, p, s: f"layerwatch_gate_importance_correlation{{{config.SHIM_SELECTOR}, {s}}}",
        lambda p: p.gate_importance.correlation_min,
        fires_below=True,
    ),
    Figure(
        "telemetry loss",
        "LayerwatchTelemetryLoss",
        lambda r, p, s: f"{r.telemetry_loss_ratio}{{{s}}}",
        lambda p: p.telemetry_loss_max,
        fires_below=False,
        trigger="lost",
    ),
)


def figures_for(profile: Profile) -> tuple[Figure, ...]:
    """The figures the profile's rules read."""
    return tuple(figure for figure in FIGURES if figure.applies(profile))
