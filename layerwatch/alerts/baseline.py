"""A model's healthy profile from the decoded rows of a baseline run: the bands, bimodality and routing
baseline its alerts are generated from.

Torch-free, so that a profile can be made where the model runs (`layerwatch calibrate`, which decodes
the baseline with the serving engine, layerwatch/inference_shim/offline/calibration.py) or from a trace file of
any engine's healthy traffic (`layerwatch calibrate-trace`, `read_trace_baseline`; docs/instrument.md).

The bands are what a short monitoring window may show while the model is healthy: the baseline's
decoded tokens are cut into chunks of `chunk_tokens` (roughly what the exporter's window holds at
demo load), the statistic is computed per chunk, and the band is [lowest chunk - margin, highest
chunk + margin], clipped to [0, 1]. The bimodality statistics are the exporter's own
(layerwatch/statistics.py), on at most as many entropies as the exporter's window keeps. The healthy
shape is the whole baseline's 20-bin histogram; its limit, the largest shape distance of a chunk's
histogram from it plus the margin (`shape_distance_limit`), holds for windows of at least one chunk's
entropies (the profile's `shape_min_observations`).

The routing baseline uses the exporter's own statistics (layerwatch/routing.py) on the same chunks:
the token-dependent share of the whole baseline (informational) and its floor, half the lowest
chunk's share (LayerwatchRoutingStatic pages below it: "well below" every healthy window); the
static layers are those static in the whole baseline or in any chunk (their turning static is
expected, any other layer's pages). The skip-collapse fraction stays at the profile's default
(0.5 of the normal skip ratio) unless a healthy chunk, less the margin, skipped less than that.

The request tail (LayerwatchRequestTailRunaway), from each baseline request's skip fraction: the
cut-off is the smallest bucket edge of layerwatch_request_skip_fraction above the healthy maximum
plus one standard deviation of the requests' fractions (and above the normal skip ratio); the
normal share is the one-sided 90 % Wilson upper bound of the share of baseline requests above the
cut-off, at least MIN_REQUEST_NORMAL_SHARE (`request_tail_profile`). A trace has no request
boundaries, so a profile from a trace keeps the defaults.

The shadow check's limits, from the shadow checks of the baseline's requests (what only the serving
engine measures; layerwatch/inference_shim/offline/calibration.py runs them): the agreement floor is the lowest
chunk's agreement less the margin (`agreement_floor`), the quality-cost limit QUALITY_COST_FACTOR x the
highest chunk's nats per token (`quality_cost_limit`), the gate-importance floors half the lowest
reading of each gauge and at least the margin below it (`gate_importance_floor`,
`gate_importance_profile`).

A baseline the alerts can use (`baseline_problems`): one that does not already show what an alert
pages on (static routing, nothing skipped, a shadow agreement or quality cost beyond the limits below)
and whose shape the shape alert can use (one that varies less between chunks than MAX_HEALTHY_SHAPE_DISTANCE;
one hump is a shape like two, recorded); `layerwatch calibrate` refuses any other unless told to accept it.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from layerwatch.alerts.profile import (
    DEFAULT_SKIP_COLLAPSE_FRACTION,
    DEFAULT_ZERO_RATIO_PAGE,
    Band,
    BimodalityProfile,
    GateImportance,
    Profile,
    RequestTail,
    RoutingProfile,
)
from layerwatch.catalog import REQUEST_FRACTION_BUCKETS
from layerwatch.routing import (
    DEFAULT_MIN_ROUTING_TOKENS,
    DYNAMIC_SHARE,
    STATIC,
    Routing,
    below_threshold,
    routing_from_rows,
    wilson_bounds,
)
from layerwatch.statistics import (
    DEFAULT_WINDOW_OBSERVATIONS,
    ZERO_ENTROPY_LIMIT,
    Bimodality,
    check_bimodality,
    histogram20,
    shape_distance,
)
from layerwatch.trace import read_trace_batches

# How the bands are cut (the flags of `layerwatch calibrate` and `calibrate-trace`).
DEFAULT_CHUNK_TOKENS = 512  # decoded tokens per chunk when measuring how much window statistics vary
DEFAULT_MARGIN = 0.03  # added on both sides of each measured band
# LayerwatchRoutingStatic's floor: this fraction of the lowest healthy chunk's token-dependent share.
SHARE_FLOOR_FRACTION = 0.5
# The smallest skip-collapse fraction calibrate writes (a model whose healthy chunks barely skip).
MIN_SKIP_COLLAPSE_FRACTION = 0.01
# The smallest request_tail.normal_share calibrate writes: a 5-minute window must hold more than 1 %
# of its requests above the cut-off (the reference profile's "more than 1 % of requests") to page.
MIN_REQUEST_NORMAL_SHARE = 0.01


@dataclass(frozen=True)
class BaselineStatistics:
    observations: int
    histogram: list[int]  # the 20 bins of layerwatch.statistics.histogram20, all layers, both decisions
    active_mean: float
    active_std: float
    zero_ratio: float
    skip_ratio: float
    bimodality: Bimodality
    routing: Routing  # of the whole baseline, at the profile's threshold
    # shape_distance of each chunk's histogram from the whole baseline's (the healthy shape)
    chunk_shape_distances: list[float]


@dataclass(frozen=True)
class RoutingBaseline:
    """The routing statistics of the baseline's chunks, behind the profile's routing fields."""

    chunk_shares: list[float]  # token-dependent share per chunk whose verdict was given
    chunk_static_layers: list[tuple[int, ...]]  # static layers per such chunk
    chunk_skip_ratios: list[float]  # skip ratio per chunk


def chunk_band(values: list[float], margin: float) -> Band:
    """[lowest - margin, highest + margin] in [0, 1]; NaN (a chunk without active layers) is ignored.
    Raises ValueError when every chunk is NaN (numpy's nanmin would warn, naming a source file)."""
    measured = [value for value in values if not math.isnan(value)]
    if not measured:
        raise ValueError("every gate entropy of the baseline was skipped: the entropy bands need layers that ran")
    low, high = min(measured), max(measured)
    return Band(low=round(max(0.0, float(low) - margin), 4), high=round(min(1.0, float(high) + margin), 4))


def _chunk_stats(entropies: np.ndarray, skipped: np.ndarray) -> tuple[float, float, float]:
    active = entropies[~skipped]
    zero_ratio = float((entropies < ZERO_ENTROPY_LIMIT).mean())
    if active.size == 0:
        return math.nan, math.nan, zero_ratio
    return float(active.mean()), float(active.std()), zero_ratio


def _routing(entropies: np.ndarray, skipped: np.ndarray, threshold: float) -> Routing:
    # No minimum window: the Wilson bounds already keep a short chunk's layers from looking static.
    return routing_from_rows(below_threshold(entropies, threshold), skipped, min_tokens=1)


def summarize(
    entropies: np.ndarray, skipped: np.ndarray, min_observations: int, threshold: float, chunk_tokens: int
) -> BaselineStatistics:
    mean, std, zero = _chunk_stats(entropies, skipped)
    window = entropies.ravel()[-DEFAULT_WINDOW_OBSERVATIONS:]  # the exporter's window size
    histogram = histogram20(entropies.ravel())
    chunks = range(0, len(entropies) - chunk_tokens + 1, chunk_tokens)
    return BaselineStatistics(
        observations=int(entropies.size),
        histogram=[int(c) for c in histogram],
        active_mean=mean,
        active_std=std,
        zero_ratio=zero,
        skip_ratio=float(skipped.mean()),
        bimodality=check_bimodality(window, min_observations),
        routing=_routing(entropies, skipped, threshold),
        chunk_shape_distances=[shape_distance(histogram20(entropies[i : i + chunk_tokens]), histogram) for i in chunks],
    )


def routing_baseline(
    entropies: np.ndarray, skipped: np.ndarray, threshold: float, chunk_tokens: int
) -> RoutingBaseline:
    """The routing statistics of every whole chunk of `chunk_tokens` decoded tokens."""
    shares, static, skips = [], [], []
    for i in range(0, len(entropies) - chunk_tokens + 1, chunk_tokens):
        chunk = _routing(entropies[i : i + chunk_tokens], skipped[i : i + chunk_tokens], threshold)
        skips.append(float(skipped[i : i + chunk_tokens].mean()))
        # Withheld (nothing below tau in this chunk): no share to measure.
        if chunk.token_dependent_share is not None and chunk.static_layers is not None:
            shares.append(chunk.token_dependent_share)
            static.append(chunk.static_layers)
    return RoutingBaseline(shares, static, skips)


def routing_profile(whole: Routing, chunks: RoutingBaseline) -> RoutingProfile:
    """The profile's routing fields from the whole baseline and its chunks (see the module docstring)."""
    whole_share = whole.token_dependent_share  # None while withheld
    shares = chunks.chunk_shares + ([] if whole_share is None else [whole_share])
    static = set(whole.static_layers or ()).union(*chunks.chunk_static_layers)
    return RoutingProfile(
        share_floor=round(SHARE_FLOOR_FRACTION * min(shares), 3) if shares else 0.0,
        static_layers=tuple(sorted(static)),
        min_tokens=DEFAULT_MIN_ROUTING_TOKENS,
        token_dependent_share=None if whole_share is None else round(whole_share, 4),
    )


def skip_collapse_fraction(skip_ratio_normal: float, chunk_skip_ratios: list[float], margin: float) -> float:
    """The default fraction, lowered if a healthy chunk (less the margin) skipped less than that."""
    if skip_ratio_normal <= 0 or not chunk_skip_ratios:
        return DEFAULT_SKIP_COLLAPSE_FRACTION
    lowest = (min(chunk_skip_ratios) - margin) / skip_ratio_normal
    return round(max(MIN_SKIP_COLLAPSE_FRACTION, min(DEFAULT_SKIP_COLLAPSE_FRACTION, lowest)), 3)


def request_tail_profile(skip_fractions: list[float], skip_ratio_normal: float) -> RequestTail:
    """The runaway cut-off and normal share of the healthy requests' skip fractions.

    Cut-off: the smallest bucket edge of layerwatch_request_skip_fraction above the highest fraction
    plus one standard deviation of the fractions (the highest of 128 normal samples lies about 2.6
    standard deviations above their mean, of 5,000 about 3.7: the margin covers the healthy maximum
    of a few thousand requests, and the normal share the rarer ones beyond), and above
    `skip_ratio_normal` (the model's own average is never runaway); the
    highest edge below 1 if the healthy requests reach beyond it. Normal share: the one-sided 90 %
    Wilson upper bound of the share of these requests above the cut-off (none above it still leaves
    z²/(n + z²): what n requests cannot rule out), at least MIN_REQUEST_NORMAL_SHARE.
    """
    fractions = np.asarray(skip_fractions, dtype=np.float64)
    if fractions.size == 0:
        raise ValueError("the baseline has no request with a decode token")
    spread = float(fractions.std(ddof=1)) if fractions.size > 1 else 0.0
    level = float(fractions.max()) + spread
    edges = [e for e in REQUEST_FRACTION_BUCKETS if skip_ratio_normal < e < 1.0]
    if not edges:
        raise ValueError(f"no bucket edge below 1 lies above the normal skip ratio {skip_ratio_normal}")
    cutoff = next((e for e in edges if e > level), edges[-1])
    above = int((fractions > cutoff).sum())
    _, upper = wilson_bounds(np.array([above]), int(fractions.size))
    # Rounded up to 0.001 (the bound is what healthy traffic may show), below 1 (a share of requests).
    share = min(0.999, math.ceil(float(upper[0]) * 1000 - 1e-9) / 1000)
    return RequestTail(runaway_skip_fraction=cutoff, normal_share=max(MIN_REQUEST_NORMAL_SHARE, share))


def build_profile(
    model_name: str,
    threshold: float,
    patience: int,
    runaway_skip_ratio: float,
    entropies: np.ndarray,
    skipped: np.ndarray,
    shadow_agreement_min: float | None,
    *,
    chunk_tokens: int,
    margin: float,
    min_observations: int,
    source: str,
    gate_importance: GateImportance | None = None,
    request_skip_fractions: list[float] | None = None,
    shadow_kl_nats_max: float | None = None,
    shadow_rate_min: float | None = None,
) -> tuple[Profile, BaselineStatistics]:
    """entropies float [N, L] and skipped bool [N, L], one row per decoded token.

    `shadow_agreement_min`, `gate_importance`, `shadow_kl_nats_max` (the shim's shadow
    checks: layerwatch/inference_shim/offline/calibration.py), `request_skip_fractions` (one per request, for
    `request_tail_profile`) and `shadow_rate_min` left out (None) keep the profile's defaults (not
    measured)."""
    if len(entropies) < chunk_tokens:
        raise ValueError(f"the baseline decoded {len(entropies)} tokens, fewer than one chunk of {chunk_tokens}")
    chunks = [
        _chunk_stats(entropies[i : i + chunk_tokens], skipped[i : i + chunk_tokens])
        for i in range(0, len(entropies) - chunk_tokens + 1, chunk_tokens)
    ]
    means, stds, zeros = zip(*chunks)
    stats = summarize(entropies, skipped, min_observations, threshold, chunk_tokens)
    routing = routing_baseline(entropies, skipped, threshold, chunk_tokens)
    skip_ratio_normal = round(stats.skip_ratio, 4)
    zero_band = chunk_band(list(zeros), margin)
    b = stats.bimodality
    bc = b.bimodality_coefficient
    bc = None if bc is None or np.isnan(bc) else round(float(bc), 4)
    profile = Profile(
        model_name=model_name,
        threshold=threshold,
        patience=patience,
        entropy_mean=chunk_band(list(means), margin),
        entropy_std=chunk_band(list(stds), margin),
        zero_ratio=zero_band,
        zero_ratio_page=max(DEFAULT_ZERO_RATIO_PAGE, zero_band.high),
        skip_ratio_normal=skip_ratio_normal,
        skip_collapse_fraction=skip_collapse_fraction(skip_ratio_normal, routing.chunk_skip_ratios, margin),
        runaway_skip_ratio=runaway_skip_ratio,
        bimodality=BimodalityProfile(
            min_observations=min_observations,
            peaks=b.peaks,
            dip=_rounded(b.dip, 5),
            dip_p_value=_rounded(b.dip_p_value, 6),
            bimodality_coefficient=bc,
            histogram=tuple(round(count / stats.observations, 4) for count in stats.histogram),
            shape_distance_max=shape_distance_limit(stats.chunk_shape_distances, margin),
            shape_min_observations=chunk_tokens * entropies.shape[1],
        ),
        routing=routing_profile(stats.routing, routing),
        source=source,
    )
    if shadow_agreement_min is not None:
        profile = dataclasses.replace(profile, shadow_agreement_min=shadow_agreement_min)
    if gate_importance is not None:
        profile = dataclasses.replace(profile, gate_importance=gate_importance)
    if request_skip_fractions is not None:
        profile = dataclasses.replace(
            profile, request_tail=request_tail_profile(request_skip_fractions, skip_ratio_normal)
        )
    if shadow_kl_nats_max is not None:
        profile = dataclasses.replace(profile, shadow_kl_nats_max=shadow_kl_nats_max)
    if shadow_rate_min is not None:
        profile = dataclasses.replace(profile, shadow_rate_min=shadow_rate_min)
    return profile, stats


def shape_distance_limit(chunk_distances: list[float], margin: float) -> float:
    """The largest healthy chunk's shape distance plus the margin, rounded up to 4 decimals; at least
    0.0001 (one chunk at --margin 0 measures 0, and a profile's limit is positive)."""
    return max(1, math.ceil((max(chunk_distances) + margin) * 1e4 - 1e-9)) / 1e4  # (- 1e-9: float noise)


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


def ascii_histogram(histogram: list[int], width: int = 40) -> str:
    """The 20-bin histogram as text bars with counts (for the terminal and the model card)."""
    top = max(histogram) or 1
    bins = len(histogram)
    lines = []
    for i, count in enumerate(histogram):
        bar = "#" * round(width * count / top)
        closing = "]" if i == bins - 1 else ")"  # the last bin holds 1.0 (layerwatch.statistics.bin_index)
        lines.append(f"[{i / bins:.2f}, {(i + 1) / bins:.2f}{closing} {bar:<{width}} {count}")
    return "\n".join(lines)


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields
class TraceBaseline:
    """One model's decoded rows from a trace file, in the trace's order, and the τ they were decided with."""

    model_name: str
    threshold: float
    entropies: np.ndarray  # float32 [tokens, layers]
    skipped: np.ndarray  # bool [tokens, layers]


def read_trace_baseline(
    path: str | os.PathLike[str], model_name: str | None = None, threshold: float | None = None
) -> TraceBaseline:
    """The rows of `model_name` (default: the trace's only model) from a trace of healthy traffic.

    τ is the one the lines carry (their "threshold" key), or `threshold`, which must agree with the
    lines that carry one; lines without one are judged by the same τ. Raises TraceError for a bad
    line and ValueError for a trace that cannot make one baseline (no such model, several models and
    none named, several thresholds, no threshold at all, rows of different layer counts).
    """
    batches = [b for b in read_trace_batches(path) if model_name is None or b.model_name == model_name]
    names = list(dict.fromkeys(b.model_name for b in batches))
    if not batches:
        raise ValueError(f"{path}: no trace line of model {model_name!r}" if model_name else f"{path}: an empty trace")
    if len(names) > 1:
        raise ValueError(f"{path}: lines of several models ({', '.join(names)}): name the one to calibrate")
    thresholds = {b.threshold for b in batches if b.threshold is not None}
    if threshold is not None:
        thresholds.add(threshold)
    if len(thresholds) != 1:
        found = ", ".join(f"{t:g}" for t in sorted(thresholds)) or "none"
        raise ValueError(f"{path}: one threshold needed for the baseline, the lines (and --threshold) give {found}")
    if len({b.entropies.shape[1] for b in batches}) > 1:
        raise ValueError(f"{path}: the lines of {names[0]!r} do not all have the same number of layers")
    return TraceBaseline(
        model_name=names[0],
        threshold=thresholds.pop(),
        entropies=np.concatenate([b.entropies for b in batches]),
        skipped=np.concatenate([b.skipped for b in batches]),
    )


def profile_from_trace(
    baseline: TraceBaseline,
    *,
    source: str,
    patience: int,
    runaway_skip_ratio: float,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    margin: float = DEFAULT_MARGIN,
    min_observations: int,
) -> tuple[Profile, BaselineStatistics]:
    """The profile of a trace's baseline: what the rows measure, the profile's defaults for what only
    the shim measures (shadow agreement, gate importance, request tail). `source` names the trace."""
    description = (
        f"layerwatch calibrate-trace {datetime.date.today().isoformat()}: {len(baseline.entropies)} decoded tokens "
        f"from {source}, threshold {baseline.threshold:g}; shadow agreement, gate importance and request tail not "
        "measured (defaults)"
    )
    profile, stats = build_profile(
        baseline.model_name,
        baseline.threshold,
        patience,
        runaway_skip_ratio,
        baseline.entropies,
        baseline.skipped,
        None,
        chunk_tokens=chunk_tokens,
        margin=margin,
        min_observations=min_observations,
        source=description,
    )
    return dataclasses.replace(profile, request_tail=default_request_tail(profile.skip_ratio_normal)), stats


def default_request_tail(skip_ratio_normal: float) -> RequestTail:
    """The request tail's defaults, its cut-off raised to the first bucket edge above the normal skip
    ratio where the default is not above it (a model that skips half its layers on average is not
    runaway at 0.5). Raises ValueError when no edge below 1 is above it."""
    default = RequestTail()
    edges = [e for e in REQUEST_FRACTION_BUCKETS if skip_ratio_normal < e < 1.0]
    if not edges:
        raise ValueError(f"no bucket edge below 1 lies above the normal skip ratio {skip_ratio_normal}")
    return dataclasses.replace(default, runaway_skip_fraction=max(default.runaway_skip_fraction, edges[0]))


def baseline_summary(stats: BaselineStatistics, profile: Profile) -> list[str]:
    """What a calibration measured, for the terminal: entropy moments, bimodality, routing."""
    b, routing, rp = stats.bimodality, stats.routing, profile.routing
    share = "n/a" if routing.token_dependent_share is None else f"{routing.token_dependent_share:.3f}"
    bimodality = (
        f"bimodality: withheld (a window of {b.observations} entropies, fewer than the minimum)"
        if b.withheld
        else f"bimodality: {'bimodal' if b.bimodal else 'NOT bimodal'} (peaks {b.peaks}, dip {b.dip:.4f}, "
        f"p {b.dip_p_value:.4g}, BC {b.bimodality_coefficient:.3f}, window {b.observations})"
    )
    return [
        f"active-layer entropy mean {stats.active_mean:.4f} std {stats.active_std:.4f}; "
        f"zero-entropy ratio {stats.zero_ratio:.4f}",
        bimodality,
        f"routing: {routing.verdict}, token-dependent share {share} (page below {rp.share_floor}), static layers "
        f"{list(rp.static_layers)} (whole baseline or any chunk); skipping collapsed below "
        f"{profile.skip_collapse_fraction} x {profile.skip_ratio_normal}",
    ]


# --- a baseline the alerts can use ---------------------------------------------------------------

# A profile is cut around its baseline: every alert pages on a departure from what the baseline showed.
# A baseline that already shows what an alert pages on makes that alert blind (its floor lies below a
# broken model) or a constant page; `layerwatch calibrate` refuses such a baseline unless told to
# accept it. The limits below are ours, placed well outside the demo model's healthy baseline
# (layerwatch/alerts/profiles/demo.yaml: agreement 0.826 in its lowest chunk, 0.046 nats per token in its worst)
# and well inside SmolLM2-135M gates that skipped statically (0.459, 0.598).
# LayerwatchShadowAgreementLow pages below the baseline's lowest chunk less the margin: below this
# share of full-depth top-1 tokens kept, the gates change the answers, and the floor would make that normal.
MIN_HEALTHY_AGREEMENT = 0.7
# LayerwatchShadowQualityCost pages above QUALITY_COST_FACTOR x the baseline's worst chunk: above this
# many nats per token of KL(gated || full) (a perplexity-scale cost of exp(0.2) - 1 = 22 %), the limit
# would accept a model made far worse by its skipping.
MAX_HEALTHY_KL_NATS = 0.2
# What the gates may cost where their skips are executed (at batch 1 every row runs its own decisions):
# an estimated perplexity increase of 10 % (exp of KL(full || gated) per shadow-checked token, less 1).
# Twice the 5 % the gate cards choose their default tau by: calibrate's prompts are another sample than
# the card's, and gates chosen at the target must not be refused on that noise (the demo model's measure
# +4.1 % to +5.3 % across prompt sets); a cost past it is no sampling error. Past it the profile would
# call healthy a model its users see get worse, and the quality pages would measure against that loss.
MAX_HEALTHY_PERPLEXITY_INCREASE = 0.10
# LayerwatchEntropyShapeChanged pages above the largest shape distance of a healthy chunk (plus the margin):
# a healthy shape that moves this much of its mass between chunks leaves room only for departures that
# move most of it. Drilled gates move far more (docs/alerting.md, "The entropy shape").
MAX_HEALTHY_SHAPE_DISTANCE = 0.25


def baseline_problems(
    stats: BaselineStatistics,
    threshold: float,
    *,
    agreement: float | None = None,
    kl_nats_per_token: float | None = None,
) -> list[str]:
    """What in a baseline keeps its profile's alerts from telling healthy traffic from broken, one
    phrase each naming the figure and the alert (empty: none). `agreement` (top-1 tokens kept over the
    shadow-checked tokens) and `kl_nats_per_token` left out: not measured, not judged."""
    problems = []
    routing = stats.routing
    if routing.token_dependent_share is None and threshold > 0:  # (tau 0: full depth, nothing is meant to skip)
        problems.append(
            f"no gate score below the threshold {threshold:g}: nothing is skipped, so the routing and skip-rate "
            "alerts have no healthy skipping to compare with"
        )
    elif routing.verdict == STATIC:
        problems.append(
            f"routing static: token-dependent share {routing.token_dependent_share:.3f}, below {DYNAMIC_SHARE}; the "
            "same layers are skipped whatever the token, so LayerwatchRoutingStatic cannot page on static pruning"
        )
    shape_limit = shape_distance_limit(stats.chunk_shape_distances, 0.0)
    if shape_limit > MAX_HEALTHY_SHAPE_DISTANCE:
        problems.append(
            f"the entropy shape varies between the baseline's chunks up to a distance {shape_limit:.3f} from the "
            f"whole baseline's, above {MAX_HEALTHY_SHAPE_DISTANCE}: LayerwatchEntropyShapeChanged could not tell a "
            "departure from the healthy shape from its own variation"
        )
    if agreement is not None and agreement < MIN_HEALTHY_AGREEMENT:
        problems.append(
            f"shadow agreement {agreement:.3f}, below {MIN_HEALTHY_AGREEMENT}: the gates change the full-depth "
            "top-1 token too often for LayerwatchShadowAgreementLow's floor to mean healthy"
        )
    if kl_nats_per_token is not None and kl_nats_per_token > MAX_HEALTHY_KL_NATS:
        problems.append(
            f"quality cost {kl_nats_per_token:.3f} nats per token, above {MAX_HEALTHY_KL_NATS}: "
            "LayerwatchShadowQualityCost's limit would accept that loss as healthy"
        )
    return problems


# --- the shadow check's limits ------------------------------------------------------------------

# LayerwatchGateMiscalibrated's floor: this fraction of the lowest healthy gate-importance reading
# (and at least the margin below it).
GATE_FLOOR_FRACTION = 0.5
# LayerwatchShadowQualityCost's limit: this factor x the highest healthy chunk's nats per token.
QUALITY_COST_FACTOR = 1.5


class CheckedTokens(Protocol):
    """One shadow-checked request's figures (the runtime's `ShadowResult` is one)."""

    @property
    def tokens(self) -> int: ...

    @property
    def kl_nats(self) -> float: ...


@dataclass(frozen=True)
class GateReadings:
    """What the shim's gate-importance gauges read after each shadow pass, once a layer had a value."""

    headline: list[float]  # layerwatch_gate_importance_correlation
    layers: list[list[float]]  # layerwatch_gate_layer_importance_correlation per layer, NaN where absent
    samples: int  # (gate score, next update) pairs measured, all layers together


def gate_importance_floor(readings: list[float], margin: float) -> float:
    """Half the lowest healthy reading of a gate-importance correlation, and at least `margin` below
    it (a reading near or below 0 has no useful half), in [-1, 1].

    readings: the values one of the shim's gauges takes over a healthy baseline (`GateReadings`).
    """
    if not readings:
        raise ValueError("no gate-importance reading: the shadow checks never filled the buffers")
    lowest = min(readings)
    # Rounded down to 3 decimals: rounded to the nearest, the floor could end less than `margin` below.
    return max(-1.0, math.floor(min(GATE_FLOOR_FRACTION * lowest, lowest - margin) * 1000) / 1000)


def quality_cost_limit(checks: Sequence[CheckedTokens], chunk_tokens: int) -> float:
    """QUALITY_COST_FACTOR x the highest nats per token of KL(gated || full) over chunks of at least
    `chunk_tokens` checked tokens (checks in order), rounded up to 4 decimals, at least 0.0001 (a
    full-depth baseline costs nothing: its limit is the least cost the limit can state)."""
    per_token, tokens, nats = [], 0, 0.0
    for check in checks:
        tokens, nats = tokens + check.tokens, nats + check.kl_nats
        if tokens >= chunk_tokens:
            per_token.append(nats / tokens)
            tokens, nats = 0, 0.0
    if not per_token:
        raise ValueError(f"the shadow checks covered fewer than one chunk of {chunk_tokens} tokens")
    return max(math.ceil(QUALITY_COST_FACTOR * max(per_token) * 1e4 - 1e-9), 1) / 1e4  # (- 1e-9: float noise)


def gate_importance_profile(readings: GateReadings, margin: float) -> GateImportance:
    """The profile's gate-importance section from the healthy readings: the headline's floor and median;
    per layer counted in every reading, its floor (same rule) and median."""
    if not readings.headline:
        raise ValueError("no gate-importance reading: the shadow checks never filled the buffers")
    layers = np.asarray(readings.layers, dtype=np.float64)  # [readings, L]
    always = np.flatnonzero(np.isfinite(layers).all(axis=0))
    return GateImportance(
        correlation_min=gate_importance_floor(readings.headline, margin),
        correlation=round(float(np.median(readings.headline)), 3),
        layer_baselines={int(l): round(float(np.median(layers[:, l])), 3) for l in always},
        layer_floors={int(l): gate_importance_floor(layers[:, l].tolist(), margin) for l in always},
    )


def agreement_floor(checks: list[tuple[int, int]], chunk_tokens: int, margin: float) -> float:
    """Lowest agreement ratio over chunks of at least `chunk_tokens` tokens, minus `margin`.

    checks: (tokens, agreements) per shadow-checked request, in order.
    """
    ratios, tokens, agreements = [], 0, 0
    for request_tokens, request_agreements in checks:
        tokens, agreements = tokens + request_tokens, agreements + request_agreements
        if tokens >= chunk_tokens:
            ratios.append(agreements / tokens)
            tokens, agreements = 0, 0
    if not ratios:
        raise ValueError(f"the shadow checks covered fewer than one chunk of {chunk_tokens} tokens")
    return round(max(0.0, min(ratios) - margin), 3)
