"""A model's healthy profile: the bands and limits its alerts are generated from (the schema).

One YAML file per model in layerwatch/alerts/profiles/, read and written by layerwatch/alerts/profile_file.py. A field's
`metadata` says how the file checks it (`fraction`: in [0, 1]; `yaml_key`: its key in the file).
Durations are held in seconds (`Seconds`). The `for:` overrides name per-model alerts, whose
defaults are their specs' (layerwatch/alerts/specs.py: `AlertSpec.for_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

from layerwatch.catalog import DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION
from layerwatch.routing import DEFAULT_MIN_ROUTING_TOKENS
from layerwatch.statistics import DIP_ALPHA

Seconds = NewType("Seconds", float)  # written as a Prometheus duration in YAML

# Fields whose values are fractions of something and must lie in [0, 1].
_FRACTION = {"fraction": True}
# Defaults of optional fields that `layerwatch calibrate` also starts from.
# The field's values are in docs/alerting.md, "The field's reports".
DEFAULT_ZERO_RATIO_PAGE = 0.40  # the field's "a jump above 40 % means over-pruning"
DEFAULT_SKIP_COLLAPSE_FRACTION = 0.5  # collapsed: skipping below half of its healthy ratio
DEFAULT_RUNAWAY_SKIP_RATIO = 0.85  # the field's fallback trigger: more than 85 % of layers skipped
DEFAULT_SHADOW_KL_NATS_MAX = 0.05  # exp(0.05) - 1: about a 5 % perplexity-scale cost per token


@dataclass(frozen=True)
class Band:
    """A healthy range [low, high]."""

    low: float = field(metadata=_FRACTION)
    high: float = field(metadata=_FRACTION)


@dataclass(frozen=True)
class BimodalityProfile:
    """The healthy shape of the entropy distribution, and when the exporter's window departs from it.

    Not the verdict itself (that is layerwatch.statistics.Bimodality): the profile's expectations of it.
    LayerwatchEntropyShapeChanged pages on a departure from this shape: a healthy shape with two humps
    (`healthy_bimodal`) pages when the window is no longer bimodal; a recorded `histogram` pages when the
    window's shape_distance to it (layerwatch/statistics.py) exceeds `shape_distance_max`. A profile
    needs at least one of the two (layerwatch/alerts/profile_file.py): a healthy shape of one hump is recorded.
    """

    # The bimodality trigger waits until the exporter's window holds at least this many entropies
    # (the exporter itself withholds the verdict below its own, possibly smaller, minimum).
    min_observations: int
    # Statistics of the healthy baseline: `peaks` and `dip_p_value` say whether it had two humps; all of
    # them are in the alert text.
    peaks: int | None = None
    dip: float | None = field(default=None, metadata=_FRACTION)
    dip_p_value: float | None = field(default=None, metadata=_FRACTION)
    bimodality_coefficient: float | None = field(default=None, metadata=_FRACTION)
    # The healthy shape itself: the baseline's share of entropies in each of the 20 bins (layerwatch.statistics.
    # histogram20), the largest shape distance of a healthy window from it plus the margin (calibrate: its
    # chunks'), and the window that limit holds for (the entropies of one chunk: a smaller window is noisier).
    histogram: tuple[float, ...] = ()
    shape_distance_max: float | None = field(default=None, metadata=_FRACTION)
    shape_min_observations: int | None = None

    @property
    def healthy_bimodal(self) -> bool:
        """Whether the healthy shape has two humps, by the exporter's rule (layerwatch/statistics.py)."""
        return self.peaks is not None and self.peaks >= 2 and (self.dip_p_value is None or self.dip_p_value < DIP_ALPHA)


@dataclass(frozen=True)
class RoutingProfile:
    """The healthy baseline's routing statistics (layerwatch/routing.py) and when they page.

    LayerwatchRoutingStatic pages when the exporter's token-dependent share falls below
    `share_floor`, or when a layer outside `static_layers` becomes static (below τ on almost every
    token); both wait for the exporter's window to hold `min_tokens` tokens.
    """

    # Page below this token-dependent share ("well below" the baseline; calibrate: half of the
    # lowest chunk's share).
    share_floor: float = field(metadata=_FRACTION)
    # Layers static in the healthy baseline (skipped whatever the token): expected, not paged.
    static_layers: tuple[int, ...]
    # The routing alerts wait until the exporter's window holds this many tokens (the exporter
    # itself withholds the verdict below its own --min-routing-tokens).
    min_tokens: int = DEFAULT_MIN_ROUTING_TOKENS
    # The healthy baseline's share, for the alert text; informational.
    token_dependent_share: float | None = field(default=None, metadata=_FRACTION)


@dataclass(frozen=True)
class Drift:
    """The field's drift alarm (docs/alerting.md, "The field's reports"): stddev of the entropy mean
    over `window` above `limit`."""

    limit: float = field(default=0.18, metadata=_FRACTION)
    window: Seconds = Seconds(600.0)


@dataclass(frozen=True)
class RequestTail:
    """The tail of the per-request skip fractions (layerwatch_request_skip_fraction): a small category
    of traffic that skips far more than the rest shows here long before it moves the global ratio.

    `runaway_skip_fraction` must be a bucket edge of the histogram (layerwatch/catalog.py), and the
    shim counts the layers of runaway requests at the same cut-off (`layerwatch serve` reads it from
    this profile unless --request-runaway-fraction says otherwise).
    """

    # A request skipping more than this share of its decode layer evaluations is runaway.
    runaway_skip_fraction: float = field(default=DEFAULT_REQUEST_RUNAWAY_SKIP_FRACTION, metadata=_FRACTION)
    # The share of requests above it that healthy traffic shows (with a margin): the alert fires above.
    # `layerwatch calibrate` measures both (docs/alerting.md, "What calibrate measures").
    normal_share: float = field(default=0.01, metadata=_FRACTION)


@dataclass(frozen=True)
class GateImportance:
    """LayerwatchGateMiscalibrated's limits: the within-layer gate-importance correlation
    (layerwatch_gate_importance_correlation, Spearman's correlation in [-1, 1] of each layer's gate
    score with its layer's update, averaged over the layers; docs/service.md, "Layer signals").

    `layerwatch calibrate` measures all of it; the default floor only catches gates whose token
    ranking is unrelated to their layers' updates (those read about 0; the demo's healthy gates
    0.07-0.14).
    """

    # Page below this headline correlation (calibrate: half the lowest healthy reading, at least the
    # margin below it).
    correlation_min: float = 0.03
    # The healthy baseline's headline, for the alert text; informational.
    correlation: float | None = None
    # Per layer (the layers whose healthy gates vary): the healthy baseline's correlation
    # (informational) and the floor below which the alert names the layer (calibrate: as the headline's).
    layer_baselines: dict[int, float] = field(default_factory=dict)
    layer_floors: dict[int, float] = field(default_factory=dict)


# Keys a profile may no longer carry, and why (the loader says so instead of "unknown key").
@dataclass(frozen=True)
class Profile:
    model_name: str
    threshold: float = field(metadata=_FRACTION)  # gate threshold the model is served with
    patience: int  # consecutive low-score tokens before a layer is skipped
    entropy_mean: Band  # mean entropy of the layers that ran (decision="run")
    entropy_std: Band  # standard deviation of the same
    zero_ratio: Band  # share of entropies below 0.01, all layers
    skip_ratio_normal: float = field(metadata=_FRACTION)  # healthy share of skipped layer evaluations
    bimodality: BimodalityProfile
    routing: RoutingProfile  # token-dependent share floor and the baseline's static layers
    zero_ratio_page: float = field(default=DEFAULT_ZERO_RATIO_PAGE, metadata=_FRACTION)  # page above this
    skip_surge_factor: float = 2.0  # surge: skip ratio above factor x its own 1h baseline
    # collapse: skip ratio below this fraction of skip_ratio_normal (cost and power up)
    skip_collapse_fraction: float = field(default=DEFAULT_SKIP_COLLAPSE_FRACTION, metadata=_FRACTION)
    runaway_skip_ratio: float = field(default=DEFAULT_RUNAWAY_SKIP_RATIO, metadata=_FRACTION)
    runaway_fallbacks_per_minute: float = 0.0  # fallbacks above this rate, sustained, are runaway
    drift: Drift = Drift()
    shadow_agreement_min: float = field(default=0.90, metadata=_FRACTION)
    # Page above this quality cost: nats of KL(gated || full) per shadow-checked token, the gated
    # model's raw distributions (docs/service.md, "Quality guard"). `layerwatch calibrate` measures it;
    # the default (a perplexity-scale cost of about 5 %) is ours, not a measurement.
    shadow_kl_nats_max: float = DEFAULT_SHADOW_KL_NATS_MAX
    # The shadow rate this model's shims must run at (LayerwatchQualityGuardBlind tickets a shim serving
    # gated traffic below it); 0: no checks expected.
    shadow_rate_min: float = field(default=0.0, metadata=_FRACTION)
    gate_importance: GateImportance = GateImportance()  # LayerwatchGateMiscalibrated
    telemetry_loss_max: float = field(default=0.01, metadata=_FRACTION)
    request_tail: RequestTail = RequestTail()
    # Per-alert `for:` overrides of per-model alerts; the others use their spec's default.
    for_durations: dict[str, Seconds] = field(default_factory=dict, metadata={"yaml_key": "for"})
    source: str = ""  # where the numbers come from (a paper, a calibration run and its date)
