"""A model's healthy profile, measured from a baseline decode run.

The bands are what a short monitoring window may show while the model is healthy: the baseline's
decoded tokens are cut into chunks of `chunk_tokens` (roughly what the exporter's window holds at
demo load), the statistic is computed per chunk, and the band is [lowest chunk - margin, highest
chunk + margin], clipped to [0, 1]. The bimodality statistics are the exporter's own
(layerwatch/statistics.py), on at most as many entropies as the exporter's window keeps.

The routing baseline uses the exporter's own statistics (layerwatch/routing.py) on the same chunks:
the token-dependent share of the whole baseline (informational) and its floor, half the lowest
chunk's share (LayerwatchRoutingStatic pages below it: "well below" every healthy window); the
static layers are those static in the whole baseline or in any chunk (their turning static is
expected, any other layer's pages). The skip-collapse fraction stays at the profile's default
(0.5 of the normal skip ratio) unless a healthy chunk, less the margin, skipped less than that.

The shadow-agreement floor is measured the way the service's quality guard measures it (greedy
requests re-scored at full depth), per chunk of requests: [lowest chunk - margin]. A model whose
gates change the top-1 token for one token in five is healthy at 0.8, not at a generic 0.9.

The gate-importance floor (LayerwatchGateMiscalibrated) comes from the same shadow passes, run with
the layer probe as the service runs them (`full_depth_agreement(..., layer_signals=True)`), folded
into the shim's own `LayerSignalStats` (layerwatch/gate_importance.py: Spearman over the last
GATE_IMPORTANCE_SAMPLES (token, layer) samples). The readings are the values the shim's gauge would
take after each pass once its reservoir is full; the floor is half the lowest reading, and at least
`margin` below it (`gate_importance_floor`). The same passes with the gates shuffled across layers
(`shuffle_gates`, the drill for gates that no longer track their layers) are measured too: the floor
must lie above every shuffled reading, or the alert cannot tell such gates from healthy ones (the
command warns; the profile is still written).

The request tail (LayerwatchRequestTailRunaway): every baseline prompt is one request, judged by
layerwatch/request_tail.py's skip fraction from the engine's per-request counts of its decode steps
(what the shim observes). The cut-off is the smallest bucket edge of layerwatch_request_skip_fraction
above the healthy maximum plus one standard deviation of the requests' fractions (and above the
normal skip ratio); the normal share is the one-sided 90 % Wilson upper bound of the share of
baseline requests above the cut-off, at least MIN_REQUEST_NORMAL_SHARE (`request_tail_profile`).

`calibrate` is the whole run `layerwatch calibrate` makes (the command only parses its flags and
prints the result): prompts from the held-out text, the baseline decode, the shadow checks, the
profile.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import random
from dataclasses import dataclass, field

import numpy as np

from alerts.profile import (
    DEFAULT_SKIP_COLLAPSE_FRACTION,
    DEFAULT_ZERO_RATIO_PAGE,
    Band,
    BimodalityProfile,
    Profile,
    RequestTail,
    RoutingProfile,
)
from inference_shim.offline.gated_model import GatedModel
from inference_shim.runtime.agreement import ShadowJob, ShadowResult, full_depth_agreement
from inference_shim.runtime.engine import GenerationEngine, SamplingParams
from inference_shim.runtime.gates import shuffle_gates
from inference_shim.runtime.model import KV_POLICIES, Transformer
from inference_shim.runtime.skip_policy import SkipPolicyConfig
from layerwatch.catalog import GATE_IMPORTANCE_SAMPLES, REQUEST_FRACTION_BUCKETS
from layerwatch.gate_importance import LayerSignalStats
from layerwatch.request_tail import RequestLayers, request_skipping
from layerwatch.routing import DEFAULT_MIN_ROUTING_TOKENS, Routing, below_threshold, routing_from_rows, wilson_bounds
from layerwatch.statistics import (
    DEFAULT_MIN_WINDOW_OBSERVATIONS,
    DEFAULT_WINDOW_OBSERVATIONS,
    ZERO_ENTROPY_LIMIT,
    Bimodality,
    check_bimodality,
    histogram20,
)


@dataclass(frozen=True)
class CalibrationSettings:
    """How the baseline is decoded and how the bands are cut (the flags of `layerwatch calibrate`)."""

    model_name: str
    threshold: float | None = None  # None: the threshold the gates were trained for
    prompts: int = 128  # requests in the baseline
    max_new_tokens: int = 32  # tokens generated per request
    temperature: float = 0.8  # the demo load generator's sampling
    top_p: float = 0.95
    seed: int = 0
    chunk_tokens: int = 512  # decoded tokens per chunk when measuring how much window statistics vary
    margin: float = 0.03  # added on both sides of each measured band
    # Entropies the exporter's window needs before the single-peak alert may fire: the exporter's own
    # minimum window.
    min_observations: int = DEFAULT_MIN_WINDOW_OBSERVATIONS
    kv_policy: str = KV_POLICIES[0]
    batch_size: int = 8


# LayerwatchRoutingStatic's floor: this fraction of the lowest healthy chunk's token-dependent share.
SHARE_FLOOR_FRACTION = 0.5
# The smallest skip-collapse fraction calibrate writes (a model whose healthy chunks barely skip).
MIN_SKIP_COLLAPSE_FRACTION = 0.01
# LayerwatchGateMiscalibrated's floor: this fraction of the lowest healthy gate-importance reading
# (and at least the margin below it).
GATE_FLOOR_FRACTION = 0.5
# The smallest request_tail.normal_share calibrate writes: a 5-minute window must hold more than 1 %
# of its requests above the cut-off (the reference profile's "more than 1 % of requests") to page.
MIN_REQUEST_NORMAL_SHARE = 0.01


@dataclass
class Baseline:
    """Decode-time gate entropies and skip decisions, one row per decoded token, and each finished
    request's per-layer counts of its decode steps."""

    entropies: list[np.ndarray] = field(default_factory=list)  # float32 [B, L] per step
    skipped: list[np.ndarray] = field(default_factory=list)  # bool [B, L] per step
    requests: list[RequestLayers] = field(default_factory=list)  # in the order they finished

    def record(self, step) -> None:  # an engine StepRecord
        self.entropies.append(step.entropies)
        self.skipped.append(step.skipped)

    def finish(self, update) -> None:  # an engine SequenceUpdate
        """A request's final update: its decode steps per layer, as the shim turns them into
        RequestLayers (inference_shim/service/completions.py)."""
        counts = update.layer_counts
        if update.finished and counts is not None:
            self.requests.append(RequestLayers(counts.tokens, counts.skipped, counts.below_threshold))

    def request_skip_fractions(self) -> list[float]:
        """layerwatch/request_tail.py's skip fraction of every request with a decode token."""
        judged = (request_skipping(layers) for layers in self.requests)
        return [r.skip_fraction for r in judged if r is not None]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(self.entropies), np.concatenate(self.skipped)


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


@dataclass(frozen=True)
class RoutingBaseline:
    """The routing statistics of the baseline's chunks, behind the profile's routing fields."""

    chunk_shares: list[float]  # token-dependent share per chunk whose verdict was given
    chunk_static_layers: list[tuple[int, ...]]  # static layers per such chunk
    chunk_skip_ratios: list[float]  # skip ratio per chunk


def chunk_band(values: list[float], margin: float) -> Band:
    """[lowest - margin, highest + margin] in [0, 1]; NaN (a chunk without active layers) is ignored."""
    low, high = np.nanmin(values), np.nanmax(values)
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
    entropies: np.ndarray, skipped: np.ndarray, min_observations: int, threshold: float
) -> BaselineStatistics:
    mean, std, zero = _chunk_stats(entropies, skipped)
    window = entropies.ravel()[-DEFAULT_WINDOW_OBSERVATIONS:]  # the exporter's window size
    return BaselineStatistics(
        observations=int(entropies.size),
        histogram=[int(c) for c in histogram20(entropies.ravel())],
        active_mean=mean,
        active_std=std,
        zero_ratio=zero,
        skip_ratio=float(skipped.mean()),
        bimodality=check_bimodality(window, min_observations),
        routing=_routing(entropies, skipped, threshold),
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


def gate_importance_floor(readings: list[float], margin: float) -> float:
    """Half the lowest healthy reading of the gate-importance correlation, and at least `margin` below
    it (a reading near or below 0 has no useful half), in [-1, 1].

    readings: the values the shim's gauge takes over a healthy baseline (`GateImportance`).
    """
    if not readings:
        raise ValueError("no gate-importance reading: the shadow checks never filled the reservoir")
    lowest = min(readings)
    # Rounded down to 3 decimals: rounded to the nearest, the floor could end less than `margin` below.
    return max(-1.0, math.floor(min(GATE_FLOOR_FRACTION * lowest, lowest - margin) * 1000) / 1000)


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


def build_profile(
    model_name: str,
    threshold: float,
    patience: int,
    runaway_skip_ratio: float,
    entropies: np.ndarray,
    skipped: np.ndarray,
    shadow_agreement_min: float,
    *,
    chunk_tokens: int,
    margin: float,
    min_observations: int,
    source: str,
    gate_importance_correlation_min: float | None = None,
    request_skip_fractions: list[float] | None = None,
) -> tuple[Profile, BaselineStatistics]:
    """entropies float [N, L] and skipped bool [N, L], one row per decoded token.

    `gate_importance_correlation_min` (from `gate_importance_floor`) and `request_skip_fractions` (one
    per request, for `request_tail_profile`) left out keep the profile's defaults (not measured)."""
    if len(entropies) < chunk_tokens:
        raise ValueError(f"the baseline decoded {len(entropies)} tokens, fewer than one chunk of {chunk_tokens}")
    chunks = [
        _chunk_stats(entropies[i : i + chunk_tokens], skipped[i : i + chunk_tokens])
        for i in range(0, len(entropies) - chunk_tokens + 1, chunk_tokens)
    ]
    means, stds, zeros = zip(*chunks)
    stats = summarize(entropies, skipped, min_observations, threshold)
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
        shadow_agreement_min=shadow_agreement_min,
        bimodality=BimodalityProfile(
            min_observations=min_observations,
            peaks=b.peaks,
            dip=_rounded(b.dip, 5),
            dip_p_value=_rounded(b.dip_p_value, 6),
            bimodality_coefficient=bc,
        ),
        routing=routing_profile(stats.routing, routing),
        source=source,
    )
    if gate_importance_correlation_min is not None:
        profile = dataclasses.replace(profile, gate_importance_correlation_min=gate_importance_correlation_min)
    if request_skip_fractions is not None:
        profile = dataclasses.replace(
            profile, request_tail=request_tail_profile(request_skip_fractions, skip_ratio_normal)
        )
    return profile, stats


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


def line_prompts(documents: list[str], count: int, rng: random.Random) -> list[str]:
    """`count` prompts: the first 2-6 words of randomly chosen lines (verses) of the text."""
    lines = [line.split() for document in documents for line in document.splitlines()]
    lines = [words for words in lines if len(words) >= 3]
    if not lines:
        raise ValueError("the text has no line of three words or more to cut prompts from")
    return [" ".join(words[: rng.randint(2, min(6, len(words) - 1))]) for words in rng.choices(lines, k=count)]


def generate_baseline(
    gated: GatedModel,
    policy: SkipPolicyConfig,
    prompts: list[str],
    baseline: Baseline,
    *,
    model_name: str,
    kv_policy: str,
    batch_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> int:
    """Complete every prompt with the GenerationEngine, recording each decode step; returns fallbacks."""
    fallbacks = 0

    def record(step) -> None:
        nonlocal fallbacks
        baseline.record(step)
        fallbacks += int(step.fallback_started.sum())

    gated.model.attach_gates(gated.gates.gates)
    tokenizer = gated.loaded.tokenizer
    engine = GenerationEngine(
        gated.model,
        tokenizer,
        model_name=model_name,
        policy=policy,
        kv_policy=kv_policy,
        max_batch_size=batch_size,
        step_hook=record,
    )
    for i, prompt in enumerate(prompts):
        engine.submit(
            tokenizer.encode(prompt),
            SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + i),
        )
    while engine.has_work():
        for update in engine.step():
            baseline.finish(update)
    return fallbacks


@dataclass(frozen=True)
class GateImportance:
    """The gate-importance correlation over the shadow checks, as the shim's gauge reads it."""

    readings: list[float]  # the gauge after each shadow pass once the reservoir was full (served gates)
    shuffled_readings: list[float]  # the same passes with `shuffle_gates` (gates on the wrong layers)
    samples: int  # (token, layer) samples measured (the reservoir holds GATE_IMPORTANCE_SAMPLES)


@dataclass(frozen=True)
class ShadowChecks:
    checks: list[tuple[int, int]]  # (tokens, agreements) per prompt, in order
    gate_importance: GateImportance


def probed_passes(model: Transformer, jobs: list[ShadowJob]) -> list[ShadowResult]:
    """The shadow check's full-depth pass of every job with the layer probe, as the service runs it."""
    return [full_depth_agreement(model, job, layer_signals=True) for job in jobs]


def gauge_readings(num_layers: int, results: list[ShadowResult]) -> tuple[list[float], int]:
    """The values `layerwatch_gate_importance_correlation` takes over these shadow passes: each one
    folded into the shim's own `LayerSignalStats`, the gauge read after each (absent until the
    reservoir is full). Returns the readings and the (token, layer) samples measured."""
    stats = LayerSignalStats(num_layers)
    readings = []
    for result in results:
        if result.layer_signals is None:
            raise ValueError("a shadow pass without layer signals (run it with layer_signals=True)")
        stats.observe(result.layer_signals)
        correlation = stats.snapshot().correlation
        if correlation is not None and math.isfinite(correlation):
            readings.append(correlation)
    return readings, int(stats.snapshot().tokens.sum())


def shadow_checks(
    gated: GatedModel,
    policy: SkipPolicyConfig,
    prompts: list[str],
    *,
    model_name: str,
    kv_policy: str,
    batch_size: int,
    max_new_tokens: int,
) -> ShadowChecks:
    """Greedy gated completions re-scored at full depth with the layer probe, as the service's quality
    guard (`--shadow-rate`) does it: (tokens, agreements) per prompt and the gate-importance readings;
    then the same passes with the gates shuffled across layers."""
    tokenizer = gated.loaded.tokenizer
    model = gated.model
    model.attach_gates(gated.gates.gates)
    engine = GenerationEngine(
        model, tokenizer, model_name=model_name, policy=policy, kv_policy=kv_policy, max_batch_size=batch_size
    )
    jobs = []
    for prompt in prompts:
        prompt_ids = tokenizer.encode(prompt)
        result = engine.generate(prompt_ids, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
        jobs.append(ShadowJob(prompt_ids, result.token_ids))
    served = probed_passes(model, jobs)
    # The same passes scored by gates on the wrong layers. The text stays the healthy one: the
    # correlation compares each gate's score with its layer's update at full depth, and neither
    # depends on which gates chose the tokens.
    try:
        model.attach_gates(shuffle_gates(gated.gates).gates)
        shuffled = probed_passes(model, jobs)
    finally:
        model.attach_gates(gated.gates.gates)
    num_layers = model.config.num_layers
    readings, samples = gauge_readings(num_layers, served)
    shuffled_readings, _ = gauge_readings(num_layers, shuffled)
    importance = GateImportance(readings, shuffled_readings, samples)
    return ShadowChecks([(r.tokens, r.agreements) for r in served], importance)


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` measured: the profile, and the numbers behind it for the report."""

    profile: Profile
    stats: BaselineStatistics
    requests: int
    decoded_tokens: int
    fallbacks: int
    shadow_tokens: int  # greedy tokens re-scored at full depth
    shadow_agreements: int  # of which the full-depth top-1 was the gated token
    gate_importance: GateImportance  # behind profile.gate_importance_correlation_min
    request_skip_fractions: list[float]  # per baseline request, behind profile.request_tail

    @property
    def gate_floor_separates(self) -> bool:
        """Whether the floor lies above every reading of the shuffled gates (the alert can tell them
        from healthy ones)."""
        shuffled = self.gate_importance.shuffled_readings
        return not shuffled or self.profile.gate_importance_correlation_min > max(shuffled)


def calibrate(gated: GatedModel, documents: list[str], settings: CalibrationSettings, *, data_name: str) -> Calibration:
    """Measure a healthy baseline of `gated` on prompts cut from `documents` and build its profile.

    `data_name` names the text in the profile's `source`. Raises ValueError on unusable input (no
    prompt in the text, a baseline shorter than one chunk, shadow checks that never fill the
    gate-importance reservoir)."""
    s = settings
    prompts = line_prompts(documents, s.prompts, random.Random(s.seed))
    threshold = s.threshold if s.threshold is not None else gated.gates.metadata.threshold
    policy = gated.policy(threshold)
    baseline = Baseline()
    fallbacks = generate_baseline(
        gated,
        policy,
        prompts,
        baseline,
        model_name=s.model_name,
        kv_policy=s.kv_policy,
        batch_size=s.batch_size,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed,
    )
    entropies, skipped = baseline.arrays()
    shadow = shadow_checks(
        gated,
        policy,
        prompts,
        model_name=s.model_name,
        kv_policy=s.kv_policy,
        batch_size=s.batch_size,
        max_new_tokens=s.max_new_tokens,
    )
    checks, importance = shadow.checks, shadow.gate_importance
    if not importance.readings:
        raise ValueError(
            f"the shadow checks measured {importance.samples} (token, layer) samples, fewer than the "
            f"{GATE_IMPORTANCE_SAMPLES} the gate-importance correlation needs: raise --prompts or --max-new-tokens"
        )
    request_skip_fractions = baseline.request_skip_fractions()
    source = (
        f"layerwatch calibrate {datetime.date.today().isoformat()}: {len(prompts)} prompts from {data_name}, "
        f"{len(entropies)} decoded tokens (temperature {s.temperature:g}, top_p {s.top_p:g}), threshold "
        f"{threshold:g}, skip rule {policy.rule_description()}, gates sha256 {gated.gates.sha256[:12]}, "
        f"kv policy {s.kv_policy}"
    )
    profile, stats = build_profile(
        s.model_name,
        threshold,
        gated.patience,
        policy.fallback_skip_fraction,
        entropies,
        skipped,
        agreement_floor(checks, s.chunk_tokens, s.margin),
        chunk_tokens=s.chunk_tokens,
        margin=s.margin,
        min_observations=s.min_observations,
        source=source,
        gate_importance_correlation_min=gate_importance_floor(importance.readings, s.margin),
        request_skip_fractions=request_skip_fractions,
    )
    return Calibration(
        profile=profile,
        stats=stats,
        requests=len(prompts),
        decoded_tokens=len(entropies),
        fallbacks=fallbacks,
        shadow_tokens=sum(t for t, _ in checks),
        shadow_agreements=sum(a for _, a in checks),
        gate_importance=importance,
        request_skip_fractions=request_skip_fractions,
    )
