"""The figure each page reads, next to the profile limit its alert compares it with.

For views that show a model's state beside its alerts (`layerwatch top --prometheus`, `layerwatch
demo`): every entry is one PromQL query over the series the alert itself reads (alerts/specs.py,
under the recorded names of the rendering's timing) and the profile field that holds its limit.
Adding a figure is one entry in FIGURES (one without an alert and limit is shown for context). The
bimodality and routing verdicts are the exporter's own and are shown with its histogram
(exporter/live_view.py); LayerwatchTargetDown reads `up`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from alerts.profile import Profile
from alerts.recorded import Recorded
from mixin import config


@dataclass(frozen=True)
class Figure:
    label: str
    alert: str | None  # the alert that reads it (alerts/specs.py); None: shown for context only
    # PromQL over the series the alert reads, given the model's selector (`model_name="..."`).
    series: Callable[[Recorded, Profile, str], str]
    limit: Callable[[Profile], float] | None  # None with no alert
    fires_below: bool  # the alert fires below the limit (else above it); the worse direction

    def query(self, recorded: Recorded, profile: Profile) -> str:
        """The worst of the model's series (lowest or highest across its targets)."""
        selector = f'model_name="{profile.model_name}"'
        return f"{'min' if self.fires_below else 'max'}({self.series(recorded, profile, selector)})"

    def breached(self, value: float, profile: Profile) -> bool:
        if self.limit is None:
            return False
        limit = self.limit(profile)
        return value < limit if self.fires_below else value > limit


FIGURES: tuple[Figure, ...] = (
    Figure(
        "token-dependent share",
        "LayerwatchRoutingStatic",
        lambda r, p, s: f"layerwatch_routing_token_dependent_share{{{config.EXPORTER_SELECTOR}, {s}}}",
        lambda p: p.routing.share_floor,
        fires_below=True,
    ),
    Figure(
        "skip ratio",
        "LayerwatchRunawaySkipping",
        lambda r, p, s: f"{r.skip_ratio}{{{s}}}",
        lambda p: p.runaway_skip_ratio,
        fires_below=False,
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
    ),
    Figure(
        "est. perplexity increase",
        None,
        lambda r, p, s: f"{r.shadow_perplexity_increase}{{{s}}}",
        None,
        fires_below=False,
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
    ),
)
