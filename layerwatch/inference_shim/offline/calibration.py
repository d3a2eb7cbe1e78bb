"""A model's healthy profile, measured from a baseline decode run of the serving engine.

The baseline is served traffic in miniature: prompts from the held-out text, completed by the
GenerationEngine with the service's sampling settings; its decoded rows become the profile's bands,
bimodality and routing baseline by layerwatch/alerts/baseline.py (which `layerwatch calibrate-trace` shares, for
a trace of any engine). What only the serving engine can measure is measured here:

The shadow check's limits are measured the way the service's quality guard measures them: every
baseline request is decoded with its gated distribution recorded (`record=True`, at the baseline's
own sampling settings) and compared with a teacher-forced full-depth pass
(layerwatch/inference_shim/runtime/agreement.py), per chunk of `chunk_tokens` checked tokens; the limits are
cut from those checks by layerwatch/alerts/baseline.py ("The shadow check's limits"). The agreement
floor is [lowest chunk - margin]: a model whose gates change the top-1 token for one token in five is
healthy at 0.8, not at a generic 0.9. The quality-cost limit (nats of KL(gated || full) per token) is
QUALITY_COST_FACTOR x the highest chunk: KL is not a fraction, so its margin is relative. The
default sampling (temperature 1, top_p 1: OpenAI's defaults, the hottest traffic the load generator
sends) gives the lowest agreement and so a floor that holds for cooler traffic too.

Quality at executed depth: at batch > 1 the depth execution may run layers its rows decided to skip
(under `auto` a scattered skip runs whole), so the served batch can hide what the gates cost where
each row runs its own decisions: at batch 1, at low concurrency. The baseline's prompts are therefore
also decoded one at a time and shadow-checked (`one_at_a_time_quality`); the quality limits are cut
from the checks of both runs, so they hold from batch 1 to the served batch, and each run's decided
and executed skip shares are recorded. A run whose executed cost is past
MAX_HEALTHY_PERPLEXITY_INCREASE is a problem (`Calibration.problems`): `layerwatch calibrate` refuses
it; at batch 1 before the gate-importance passes (`UnhealthyBaseline`), which take most of the run.

The gate-importance floors (LayerwatchGateMiscalibrated) come from the same shadow passes, run with
the layer probe as the service runs them (`full_depth_agreement(..., layer_signals=True)`), folded
into the shim's own `LayerSignalStats` (layerwatch/gate_importance.py: per layer, Spearman over its
last GATE_LAYER_SAMPLES (gate score, next update) pairs; the headline, their mean). The readings are
the values the shim's gauges would take after each pass once the buffers are full. The headline's
floor is half its lowest reading, and at least `margin` below it (`gate_importance_floor`); each
layer whose gate counted in every reading gets its own floor by the same rule (the alert names the
layers below theirs) and its median reading as its baseline. The same passes with the drills' gates
(`shuffle_gates`: on the wrong layers; `scramble_gates`: reading permuted features) are measured
too: the floor must lie above every drill reading, or the alert cannot tell such gates from healthy
ones (the command warns; the profile is still written).

The request tail (LayerwatchRequestTailRunaway): every baseline prompt is one request, judged by
layerwatch/request_tail.py's skip fraction from the engine's per-request counts of its decode steps
(what the shim observes), then cut as layerwatch/alerts/baseline.py's `request_tail_profile` says.

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

from layerwatch import argtypes
from layerwatch.alerts.baseline import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_MARGIN,
    MAX_HEALTHY_PERPLEXITY_INCREASE,
    BaselineStatistics,
    GateReadings,
    agreement_floor,
    baseline_problems,
    build_profile,
    gate_importance_profile,
    quality_cost_limit,
)
from layerwatch.alerts.profile import Profile
from layerwatch.catalog import GATE_LAYER_SAMPLES
from layerwatch.gate_importance import LayerSignalStats
from layerwatch.inference_shim.offline.gated_model import GatedModel
from layerwatch.inference_shim.runtime.agreement import ShadowJob, ShadowResult, full_depth_agreement
from layerwatch.inference_shim.runtime.depth_execution import DepthExecutionConfig
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.inference_shim.runtime.gates import LoadedGates, scramble_gates, shuffle_gates
from layerwatch.inference_shim.runtime.model import KV_POLICIES, Transformer
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.request_tail import RequestLayers, request_skipping
from layerwatch.settings import setting
from layerwatch.skip_policy import SkipPolicyConfig, is_threshold
from layerwatch.statistics import DEFAULT_MIN_WINDOW_OBSERVATIONS, MAX_WINDOW_OBSERVATIONS

# The API's highest temperature (OpenAI's): the baseline samples as clients may.
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class CalibrationSettings:
    """How the baseline is decoded and how the bands are cut; each knob with a flag is one of `layerwatch
    calibrate` (layerwatch/cli/calibrate.py reads the rest from the flags it shares with `serve`)."""

    model_name: str
    threshold: float | None = None  # None: the threshold the gates were trained for
    prompts: int = setting(128, type=int, help="requests in the baseline")
    max_new_tokens: int = setting(32, type=int, help="tokens generated per request")
    # OpenAI's defaults: the hottest of the demo load generator's traffic.
    temperature: float = setting(1.0, type=float, help="the requests' sampling temperature")
    top_p: float = setting(1.0, type=float, help="the requests' nucleus sampling mass")
    seed: int = setting(0, type=int, help="seed of the prompts drawn and their sampling")
    # An instruction-tuned model is served chat traffic; else a completion prompt, the first words of a line.
    chat: bool = setting(
        False,
        help="send whole lines as one user message through the model's chat template "
        "(default: completions of a line's first 2-6 words)",
    )
    chunk_tokens: int = setting(
        DEFAULT_CHUNK_TOKENS, type=int, help="decoded tokens per chunk when measuring how much window statistics vary"
    )
    margin: float = setting(DEFAULT_MARGIN, type=float, help="added on both sides of each measured band")
    # The exporter's own minimum window.
    min_observations: int = setting(
        DEFAULT_MIN_WINDOW_OBSERVATIONS,
        type=int,
        help="entropies the exporter window needs before the single-peak alert may fire",
    )
    kv_policy: str = KV_POLICIES[0]
    batch_size: int = 8
    # How a batch runs the layers its rows decided: as the model is served (serve's default), so the
    # baseline's routing and quality are the served ones (docs/model.md, "Depth execution").
    depth: DepthExecutionConfig = DepthExecutionConfig()
    # Written to the profile: LayerwatchQualityGuardBlind tickets a shim serving the model below it.
    shadow_rate_min: float = setting(
        0.01, type=argtypes.fraction, help="the shadow rate the model's shims are expected to run at (0: none)"
    )
    # False: gates past MAX_HEALTHY_PERPLEXITY_INCREASE at batch 1 stop the run (UnhealthyBaseline)
    # before the gate-importance passes, most of its time; True: measured to the end.
    accept_unhealthy: bool = setting(
        False,
        help='write the profile even of a baseline its alerts page on (docs/alerting.md, "What calibrate measures")',
    )

    def __post_init__(self) -> None:
        # NaN compares false with every limit: --margin nan wrote every band as [0, 1] (alerts that never
        # fire) and exited 0.
        if not 0 <= self.margin < 1:
            raise ValueError(f"--margin must be a number in [0, 1), got {self.margin}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"--temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.threshold is not None and not is_threshold(self.threshold):
            raise ValueError(f"--threshold must be in [0, 1], got {self.threshold}")
        for name in ("prompts", "max_new_tokens", "chunk_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 1 <= self.min_observations <= MAX_WINDOW_OBSERVATIONS:
            raise ValueError(
                f"--min-observations must be 1..{MAX_WINDOW_OBSERVATIONS} (what a window holds), "
                f"got {self.min_observations}"
            )


@dataclass
class Baseline:
    """Decode-time gate entropies and skip decisions, one row per decoded token, each finished
    request's per-layer counts of its decode steps, and its shadow job (its gated record)."""

    entropies: list[np.ndarray] = field(default_factory=list)  # float32 [B, L] per step
    skipped: list[np.ndarray] = field(default_factory=list)  # bool [B, L] per step: the rule's decisions
    executed_skipped: list[np.ndarray] = field(default_factory=list)  # bool [B, L] per step: did not run
    requests: list[RequestLayers] = field(default_factory=list)  # in the order they finished
    jobs: list[ShadowJob] = field(default_factory=list)  # in the order they finished

    def record(self, step) -> None:  # an engine StepRecord
        self.entropies.append(step.entropies)
        self.skipped.append(step.skipped)
        self.executed_skipped.append(step.executed_skipped)

    def finish(self, update) -> None:  # an engine SequenceUpdate
        """A request's final update: its decode steps per layer, as the shim turns them into
        RequestLayers (layerwatch/inference_shim/service/completions.py)."""
        counts = update.layer_counts
        if update.finished and counts is not None:
            self.requests.append(RequestLayers(counts.tokens, counts.skipped, counts.below_threshold))

    def request_skip_fractions(self) -> list[float]:
        """layerwatch/request_tail.py's skip fraction of every request with a decode token."""
        judged = (request_skipping(layers) for layers in self.requests)
        return [r.skip_fraction for r in judged if r is not None]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(self.entropies), np.concatenate(self.skipped)

    def skip_shares(self) -> tuple[float, float]:
        """(decided, executed): the shares of decode layer evaluations the rule skipped and that did not run."""
        return float(np.concatenate(self.skipped).mean()), float(np.concatenate(self.executed_skipped).mean())


def line_prompts(documents: list[str], count: int, rng: random.Random) -> list[str]:
    """`count` prompts: the first 2-6 words of randomly chosen lines (verses) of the text."""
    lines = [line.split() for document in documents for line in document.splitlines()]
    lines = [words for words in lines if len(words) >= 3]
    if not lines:
        raise ValueError("the text has no line of three words or more to cut prompts from")
    return [" ".join(words[: rng.randint(2, min(6, len(words) - 1))]) for words in rng.choices(lines, k=count)]


def chat_messages(documents: list[str], count: int, rng: random.Random) -> list[str]:
    """`count` user messages: randomly chosen lines of the text of three words or more, whole."""
    lines = [
        " ".join(words) for document in documents for line in document.splitlines() if len(words := line.split()) >= 3
    ]
    if not lines:
        raise ValueError("the text has no line of three words or more to use as a chat message")
    return rng.choices(lines, k=count)


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    """A prompt's ids as the shim encodes it: a chat message rendered by the chat template with the
    assistant's turn opened (/v1/chat/completions), or completion text (/v1/completions)."""
    from jinja2 import TemplateError

    if not chat:
        return tokenizer.encode(prompt)
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    except TemplateError as exc:  # e.g. raise_exception('a system message is required'); serve answers 400
        raise ValueError(
            f"the model's chat template refused a conversation of one user message, which is what --chat sends: {exc}"
        ) from None
    return tokenizer.encode_chat_prompt(text)


def generate_baseline(
    gated: GatedModel,
    policy: SkipPolicyConfig,
    prompts: list[str],
    baseline: Baseline,
    *,
    model_name: str,
    kv_policy: str,
    batch_size: int,
    depth: DepthExecutionConfig,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    chat: bool = False,
) -> int:
    """Complete every prompt with the GenerationEngine, recording each decode step and each request's
    gated distribution (its shadow job); returns fallbacks."""
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
        depth=depth,
    )
    submitted: dict[int, tuple[list[int], list[int]]] = {}  # sequence id -> (prompt, generated so far)
    for i, prompt in enumerate(prompts):
        prompt_ids = encode_prompt(tokenizer, prompt, chat)
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + i)
        submitted[engine.submit(prompt_ids, params, record=True)] = (prompt_ids, [])
    while engine.has_work():
        for update in engine.step():
            baseline.finish(update)
            prompt_ids, generated = submitted[update.sequence_id]
            generated += update.new_token_ids
            if update.finished and update.gated_record is not None and generated:
                baseline.jobs.append(ShadowJob(prompt_ids, generated, update.gated_record))
    return fallbacks


@dataclass(frozen=True)
class GateImportanceReadings:
    """The gate-importance gauges over the shadow checks: with the served gates and with the drills'."""

    served: GateReadings
    drills: dict[str, GateReadings]  # the same passes scored by a drill's gates, by its flag


@dataclass(frozen=True)
class ShadowChecks:
    checks: list[ShadowResult]  # per request, in order (without their layer signals)
    gate_importance: GateImportanceReadings


def probed_passes(model: Transformer, jobs: list[ShadowJob]) -> list[ShadowResult]:
    """The shadow check's full-depth pass of every job with the layer probe, as the service runs it."""
    return [full_depth_agreement(model, job, layer_signals=True) for job in jobs]


def gauge_readings(num_layers: int, results: list[ShadowResult]) -> GateReadings:
    """The values the gate-importance gauges take over these shadow passes: each one folded into the
    shim's own `LayerSignalStats`, the gauges read after each (absent until a layer has a value)."""
    stats = LayerSignalStats(num_layers)
    headline, layers = [], []
    for result in results:
        if result.layer_signals is None:
            raise ValueError("a shadow pass without layer signals (run it with layer_signals=True)")
        stats.observe(result.layer_signals)
        snapshot = stats.snapshot()
        if snapshot.correlation is not None and math.isfinite(snapshot.correlation):
            headline.append(snapshot.correlation)
            layers.append(snapshot.layer_correlation.tolist())
    return GateReadings(headline, layers, stats.snapshot().samples)


# The drills whose gates the floor must tell from the served ones, by their `layerwatch serve` flag.
GATE_DRILLS = {"--shuffle-gates": shuffle_gates, "--scramble-gates": scramble_gates}


def shadow_checks(gated: GatedModel, jobs: list[ShadowJob]) -> ShadowChecks:
    """The baseline's requests (their gated records) compared with the full-depth model with the layer
    probe, as the service's quality guard (`--shadow-rate`) does it: the comparison per request and
    the gate-importance readings; then the same passes scored by each drill's gates."""
    model = gated.model
    model.attach_gates(gated.gates.gates)
    served = probed_passes(model, jobs)
    num_layers = model.config.num_layers
    drills = {
        flag: gauge_readings(num_layers, _scored_by(model, drill(gated.gates), jobs, gated.gates))
        for flag, drill in GATE_DRILLS.items()
    }
    importance = GateImportanceReadings(gauge_readings(num_layers, served), drills)
    return ShadowChecks([dataclasses.replace(r, layer_signals=None) for r in served], importance)


def _scored_by(
    model: Transformer, gates: LoadedGates, jobs: list[ShadowJob], served: LoadedGates
) -> list[ShadowResult]:
    """The passes of `jobs` with `gates` attached, then the served gates again. The text stays the
    healthy one: the correlations compare each gate's score with its layer's updates at full depth,
    and neither depends on which gates chose the tokens."""
    try:
        model.attach_gates(gates.gates)
        return probed_passes(model, jobs)
    finally:
        model.attach_gates(served.gates)


class UnhealthyBaseline(ValueError):
    """The gates cost past what a healthy baseline may cost; the message says what, where."""


@dataclass(frozen=True)
class ExecutedQuality:
    """What the gates cost as one batch size and depth execution runs them: the baseline's requests
    decoded that way, each shadow-checked against the full-depth model."""

    batch_size: int
    depth: DepthExecutionConfig
    checks: list[ShadowResult]  # per request, in the order they finished
    decided_skip_share: float  # of the decode layer evaluations: skipped by the rule
    executed_skip_share: float  # of the decode layer evaluations: did not run

    @classmethod
    def of(
        cls, baseline: Baseline, checks: list[ShadowResult], batch_size: int, depth: DepthExecutionConfig
    ) -> ExecutedQuality:
        decided, executed = baseline.skip_shares()
        return cls(batch_size, depth, checks, decided, executed)

    def total(self, field_name: str) -> float:
        """A field of ShadowResult summed over the checks (tokens, agreements, kl_nats, ...)."""
        return sum(getattr(check, field_name) for check in self.checks)

    @property
    def agreement(self) -> float:
        return self.total("agreements") / max(self.total("tokens"), 1)

    @property
    def kl_nats_per_token(self) -> float:
        return self.total("kl_nats") / max(self.total("tokens"), 1)

    @property
    def perplexity_increase(self) -> float:
        """exp(KL(full || gated) per token) - 1: the shim's estimated perplexity increase."""
        return math.expm1(self.total("reverse_kl_nats") / max(self.total("tokens"), 1))

    def where(self) -> str:
        return f"batch {self.batch_size}, depth execution {self.depth.describe()}"

    def summary(self) -> str:
        return (
            f"at {self.where()}: skipped {self.decided_skip_share:.1%} decided, {self.executed_skip_share:.1%} "
            f"executed; agreement {self.agreement:.3f}, quality cost {self.kl_nats_per_token:.4f} nats per token, "
            f"estimated perplexity {self.perplexity_increase:+.1%} over {self.total('tokens'):.0f} checked tokens"
        )

    def problem(self) -> str | None:
        """What the gates cost, when it is past what a healthy baseline may cost (None: within)."""
        if self.perplexity_increase <= MAX_HEALTHY_PERPLEXITY_INCREASE:
            return None
        return (
            f"the gates cost {self.perplexity_increase:+.1%} estimated perplexity (agreement {self.agreement:.3f}, "
            f"{self.kl_nats_per_token:.3f} nats per token; {self.executed_skip_share:.1%} of layer evaluations "
            f"executed skipped) at {self.where()}, past the {MAX_HEALTHY_PERPLEXITY_INCREASE:+.0%} a healthy "
            "baseline may cost: the quality alerts would call that loss healthy"
        )


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` measured: the profile, and the numbers behind it for the report."""

    profile: Profile
    stats: BaselineStatistics
    requests: int
    decoded_tokens: int
    fallbacks: int
    shadow_checks: list[ShadowResult]  # per baseline request: its comparison with the full-depth model
    # What the gates cost as served (the baseline's batch and depth execution), then at batch 1 where
    # that differs: profile.shadow_agreement_min and shadow_kl_nats_max hold for every one.
    quality: list[ExecutedQuality]
    gate_importance: GateImportanceReadings  # behind profile.gate_importance
    request_skip_fractions: list[float]  # per baseline request, behind profile.request_tail

    def shadow_total(self, field_name: str) -> float:
        """A field of ShadowResult summed over the baseline's checks (tokens, agreements, kl_nats, ...)."""
        return sum(getattr(check, field_name) for check in self.shadow_checks)

    @property
    def gates_vary(self) -> bool:
        """Whether some layer's gate varied enough over the baseline to measure its ranking of tokens
        (else the profile's gate_importance is the schema's default, and the alert stays silent)."""
        return bool(self.gate_importance.served.headline)

    def problems(self) -> list[str]:
        """What keeps this baseline's profile from telling healthy from broken (layerwatch/alerts/baseline.py's
        `baseline_problems`, and the gate-importance alert's own: gates that rank no tokens, a floor that
        does not separate the drills); empty for a healthy baseline."""
        tokens = self.shadow_total("tokens")
        problems = baseline_problems(
            self.stats,
            self.profile.threshold,
            agreement=self.shadow_total("agreements") / tokens if tokens else None,
            kl_nats_per_token=self.shadow_total("kl_nats") / tokens if tokens else None,
        )
        problems.extend(problem for quality in self.quality if (problem := quality.problem()) is not None)
        if not self.gates_vary:
            problems.append(
                "no gate's score varied over the baseline: the gates rank no tokens, and LayerwatchGateMiscalibrated "
                "has nothing to read"
            )
        problems.extend(
            f"the gate-importance floor {self.profile.gate_importance.correlation_min} is not above every {flag} "
            "reading: LayerwatchGateMiscalibrated cannot tell those gates from these"
            for flag in self.drills_above_the_floor()
        )
        return problems

    def drills_above_the_floor(self) -> list[str]:
        """The drills (by flag) with a reading at or above the headline's floor: the alert cannot tell
        their gates from this model's own (none when the model's own gates do not vary)."""
        if not self.gates_vary:
            return []
        floor = self.profile.gate_importance.correlation_min
        return [flag for flag, r in self.gate_importance.drills.items() if r.headline and max(r.headline) >= floor]


def decode_baseline(
    gated: GatedModel, policy: SkipPolicyConfig, prompts: list[str], settings: CalibrationSettings, batch_size: int
) -> tuple[Baseline, int]:
    """The baseline's prompts completed at `batch_size` with the settings' depth execution and
    sampling: -> (the baseline, its fallbacks)."""
    s = settings
    baseline = Baseline()
    fallbacks = generate_baseline(
        gated,
        policy,
        prompts,
        baseline,
        model_name=s.model_name,
        kv_policy=s.kv_policy,
        batch_size=batch_size,
        depth=s.depth,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed,
        chat=s.chat,
    )
    return baseline, fallbacks


def one_at_a_time_quality(
    gated: GatedModel, policy: SkipPolicyConfig, prompts: list[str], settings: CalibrationSettings
) -> ExecutedQuality:
    """What the gates cost at batch 1, where every row runs exactly the layers it decided: the
    prompts decoded one at a time, each request shadow-checked (without the layer probe)."""
    baseline, _ = decode_baseline(gated, policy, prompts, settings, batch_size=1)
    gated.model.attach_gates(gated.gates.gates)
    checks = [full_depth_agreement(gated.model, job) for job in baseline.jobs]
    return ExecutedQuality.of(baseline, checks, 1, settings.depth)


def calibrate(gated: GatedModel, documents: list[str], settings: CalibrationSettings, *, data_name: str) -> Calibration:
    """Measure a healthy baseline of `gated` on prompts cut from `documents` and build its profile.

    `data_name` names the text in the profile's `source`. Raises ValueError on unusable input (no
    prompt in the text, a baseline shorter than one chunk, shadow checks that never fill the
    gate-importance reservoir), UnhealthyBaseline on gates that cost too much one request at a time
    (unless `settings.accept_unhealthy`)."""
    s = settings
    cut = chat_messages if s.chat else line_prompts
    prompts = cut(documents, s.prompts, random.Random(s.seed))
    threshold = s.threshold if s.threshold is not None else gated.gates.metadata.threshold
    policy = gated.policy(threshold)
    baseline, fallbacks = decode_baseline(gated, policy, prompts, s, s.batch_size)
    entropies, skipped = baseline.arrays()
    one_at_a_time = []
    if s.batch_size > 1 and threshold > 0:  # (at tau 0 every row runs every layer at any batch)
        one_at_a_time.append(one_at_a_time_quality(gated, policy, prompts, s))
        if (problem := one_at_a_time[0].problem()) is not None and not s.accept_unhealthy:
            raise UnhealthyBaseline(problem)
    shadow = shadow_checks(gated, baseline.jobs)
    checks, importance = shadow.checks, shadow.gate_importance
    quality = [ExecutedQuality.of(baseline, checks, s.batch_size, s.depth), *one_at_a_time]
    num_layers = gated.model.config.num_layers
    if not importance.served.headline and importance.served.samples < num_layers * GATE_LAYER_SAMPLES:
        raise ValueError(
            f"the shadow checks measured {importance.served.samples} (gate score, next update) pairs over "
            f"{num_layers} layers, fewer than the {GATE_LAYER_SAMPLES} per layer the gate-importance "
            "correlation needs: raise --prompts or --max-new-tokens"
        )
    request_skip_fractions = baseline.request_skip_fractions()
    source = (
        f"layerwatch calibrate {datetime.date.today().isoformat()}: {len(prompts)} "
        f"{'chat messages (the chat template)' if s.chat else 'prompts'} from {data_name}, "
        f"{len(entropies)} decoded tokens (temperature {s.temperature:g}, top_p {s.top_p:g}), threshold "
        f"{threshold:g}, skip rule {policy.rule_description()}, gates sha256 {gated.gates.sha256[:12]}, "
        f"kv policy {s.kv_policy}, batch {s.batch_size}, depth execution {s.depth.describe()}; layer evaluations "
        "skipped (decided, executed) "
        + ", ".join(f"{q.decided_skip_share:.1%}, {q.executed_skip_share:.1%} at batch {q.batch_size}" for q in quality)
        + "; quality limits hold at each"
    )
    profile, stats = build_profile(
        s.model_name,
        threshold,
        gated.patience,
        policy.fallback_skip_fraction,
        entropies,
        skipped,
        min(agreement_floor([(c.tokens, c.agreements) for c in q.checks], s.chunk_tokens, s.margin) for q in quality),
        chunk_tokens=s.chunk_tokens,
        margin=s.margin,
        min_observations=s.min_observations,
        source=source,
        # Full buffers but no headline: no layer's gate varies, there is no ranking of tokens to
        # calibrate (the shim's headline stays absent too); the profile keeps the defaults.
        gate_importance=gate_importance_profile(importance.served, s.margin) if importance.served.headline else None,
        request_skip_fractions=request_skip_fractions,
        shadow_kl_nats_max=max(quality_cost_limit(q.checks, s.chunk_tokens) for q in quality),
        shadow_rate_min=s.shadow_rate_min,
    )
    return Calibration(
        profile=profile,
        stats=stats,
        requests=len(prompts),
        decoded_tokens=len(entropies),
        fallbacks=fallbacks,
        shadow_checks=checks,
        quality=quality,
        gate_importance=importance,
        request_skip_fractions=request_skip_fractions,
    )
