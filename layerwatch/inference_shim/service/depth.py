"""The depth each request runs at: its skip threshold tau, and why (docs/service.md, "Depth per request").

Before a request is submitted, `DepthDecider.decide` picks tau from the first source that has a
say, in this order:

    override        the alert-driven mitigation forces full depth (mitigation.py; the request
                    then runs at `override()` instead of its decision): tau = 0
    rollout         the current rollout level does not enable skipping for this request: tau = 0
    request         the request's `skip_threshold`, within --request-threshold-range
    prompt_length   prompts over --long-prompt-tokens run at --long-prompt-threshold
    default         the served policy's tau

A request still at `default` may be moved after its prefill, before its first decode step, by the
complexity pre-check (`after_prefill`): its prompt's complexity score (layerwatch/complexity.py,
from the gates' prefill scores) at or above --complexity-cutoff runs at --complexity-threshold
(reason `complexity`). Every choice of a prompt shares its decision (a completions request with
several prompts decides per prompt).

The mode names the depth: `full` (tau = 0), `strict` (below the served tau), `gated` (the served tau
or looser). Modes and reasons are the bounded label values of the depth metrics.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry

from layerwatch import argtypes
from layerwatch.complexity import prompt_complexity
from layerwatch.inference_shim.service.metrics import make_counter, make_gauge, make_histogram
from layerwatch.logfmt import logfmt_line
from layerwatch.settings import setting
from layerwatch.skip_policy import is_threshold

log = logging.getLogger(__name__)

MODES = ("full", "strict", "gated")
REASONS = ("override", "rollout", "request", "prompt_length", "complexity", "default")
REQUEST_FIELD = "skip_threshold"


@dataclass(frozen=True)
class DepthDecision:
    threshold: float  # the tau the request runs at; 0 = full depth
    mode: str  # one of MODES
    reason: str  # one of REASONS


@dataclass(frozen=True)
class RolloutLevel:
    """Skipping is enabled for a request when every condition holds."""

    share: float = 1.0  # of requests (by a hash of the request id)
    max_tokens: int | None = None  # only requests asking for at most this many tokens
    min_temperature: float | None = None  # only requests sampling at this temperature or above

    def enables(self, request_id: str, max_tokens: int, temperature: float) -> bool:
        if self.max_tokens is not None and max_tokens > self.max_tokens:
            return False
        if self.min_temperature is not None and temperature < self.min_temperature:
            return False
        return request_position(request_id) < self.share

    def covers(self, other: RolloutLevel) -> bool:
        """Whether every request `other` enables is enabled here too (shares of the same positions
        are nested, so a share at least as large covers a smaller one; a share of 0 enables none)."""
        return other.share == 0 or (
            self.share >= other.share
            and (self.max_tokens is None or (other.max_tokens is not None and self.max_tokens >= other.max_tokens))
            and (
                self.min_temperature is None
                or (other.min_temperature is not None and self.min_temperature <= other.min_temperature)
            )
        )

    def describe(self) -> str:
        parts = [f"share={self.share:g}"]
        if self.max_tokens is not None:
            parts.append(f"max_tokens={self.max_tokens}")
        if self.min_temperature is not None:
            parts.append(f"min_temperature={self.min_temperature:g}")
        return ",".join(parts)


def request_position(request_id: str) -> float:
    """A request's place in [0, 1), uniform over ids and the same for every choice of the request."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def parse_rollout_levels(text: str) -> tuple[RolloutLevel, ...]:
    """`share=0.1;share=0.5,max_tokens=256;share=1`: levels separated by `;`, each a comma-separated
    list of conditions (share in [0, 1], max_tokens >= 1, min_temperature >= 0), each level enabling
    at least the requests the one before enables. Raises ValueError."""
    levels: list[RolloutLevel] = []
    for number, item in enumerate(text.split(";"), 1):
        conditions: dict[str, float | int] = {}
        for part in (p.strip() for p in item.split(",") if p.strip()):
            key, equals, value = part.partition("=")
            key = key.strip()
            if not equals or key not in ("share", "max_tokens", "min_temperature") or key in conditions:
                raise ValueError(
                    f"rollout level {number}: {part!r} is not one of share=S, max_tokens=N, min_temperature=T "
                    "(each at most once)"
                )
            kind = int if key == "max_tokens" else float
            try:
                conditions[key] = kind(value)
            except ValueError:
                expected = "an integer" if kind is int else "a number"
                raise ValueError(f"rollout level {number}: {key} must be {expected}, got {value.strip()!r}") from None
        if not conditions:
            raise ValueError(f"rollout level {number} is empty")
        share = float(conditions.get("share", 1.0))
        max_tokens = conditions.get("max_tokens")
        min_temperature = conditions.get("min_temperature")
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"rollout level {number}: share must be in [0, 1], got {share:g}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"rollout level {number}: max_tokens must be >= 1, got {max_tokens}")
        if min_temperature is not None and not min_temperature >= 0:
            raise ValueError(f"rollout level {number}: min_temperature must be >= 0, got {min_temperature:g}")
        level = RolloutLevel(
            share,
            None if max_tokens is None else int(max_tokens),
            None if min_temperature is None else float(min_temperature),
        )
        if levels and not level.covers(levels[-1]):
            # A demotion goes back one level: were an earlier level wider, a paging alert would
            # widen skipping instead of narrowing it.
            raise ValueError(
                f"rollout level {number} ({level.describe()}) enables skipping for fewer requests than level "
                f"{number - 1} ({levels[-1].describe()}): each level must enable at least what the one before does"
            )
        levels.append(level)
    return tuple(levels)


def parse_threshold_range(text: str) -> tuple[float, float]:
    """`LO:HI`, 0 <= LO <= HI <= 1. Raises ValueError."""
    lo, colon, hi = text.partition(":")
    try:
        bounds = (float(lo), float(hi))
    except ValueError:
        bounds = (float("nan"), float("nan"))
    if not colon or not 0.0 <= bounds[0] <= bounds[1] <= 1.0:
        raise ValueError(f"expected LO:HI with 0 <= LO <= HI <= 1, got {text!r}")
    return bounds


@dataclass(frozen=True, kw_only=True)
class DepthSettings:
    """The depth flags of `layerwatch serve` (a part of ServeSettings, service/settings.py)."""

    request_threshold_range: tuple[float, float] | None = setting(
        None,  # the request field is refused
        type=argtypes.parsed_by(parse_threshold_range),
        metavar="LO:HI",
        help=f"accept the request field `{REQUEST_FIELD}` within [LO, HI] (default: refused)",
    )
    long_prompt_tokens: int | None = setting(
        None,
        type=argtypes.positive(int),
        metavar="N",
        help="prompts over N tokens run at --long-prompt-threshold (default: no such rule)",
    )
    long_prompt_threshold: float = setting(
        0.0,
        type=argtypes.fraction,
        metavar="T",
        help="the skip threshold of long prompts (default %(default)s: full depth)",
    )
    complexity_cutoff: float | None = setting(
        None,
        type=argtypes.fraction,
        metavar="C",
        help="prompts whose complexity score is at least C run at --complexity-threshold (default: off)",
    )
    complexity_threshold: float = setting(
        0.0,
        type=argtypes.fraction,
        metavar="T",
        help="the skip threshold of complex prompts (default %(default)s: full depth)",
    )
    rollout_levels: tuple[RolloutLevel, ...] = setting(
        (),  # skipping enabled for every request
        type=argtypes.parsed_by(parse_rollout_levels),
        metavar="LEVELS",
        help="staged rollout, e.g. 'share=0.1;share=0.5;share=1' (default: skipping for every request)",
    )
    rollout_level: int | None = setting(
        None,  # 1-based; None: the last (fully rolled out)
        type=argtypes.positive(int),
        metavar="N",
        help="start at rollout level N, from 1 (default: the last)",
    )
    # After a demotion, further ones wait this long: one incident pages once per alert and per
    # instance of the model (each shim hears them all), and should cost one level, not N.
    rollout_demotion_holdoff_minutes: float = setting(
        10.0,
        type=float,
        metavar="M",
        help="minutes after a demotion in which paging alerts demote no further (default %(default)s)",
    )

    def check(self) -> None:
        bounds = self.request_threshold_range
        if bounds is not None and not 0.0 <= bounds[0] <= bounds[1] <= 1.0:
            raise ValueError(f"--request-threshold-range must satisfy 0 <= LO <= HI <= 1, got {bounds}")
        for flag, tau in (
            ("--long-prompt-threshold", self.long_prompt_threshold),
            ("--complexity-threshold", self.complexity_threshold),
        ):
            if not is_threshold(tau):
                raise ValueError(f"{flag} must be in [0, 1], got {tau}")
        if self.long_prompt_tokens is not None and self.long_prompt_tokens < 1:
            raise ValueError(f"--long-prompt-tokens must be >= 1, got {self.long_prompt_tokens}")
        if self.complexity_cutoff is not None and not 0.0 <= self.complexity_cutoff <= 1.0:
            raise ValueError(f"--complexity-cutoff must be in [0, 1], got {self.complexity_cutoff}")
        if not self.rollout_demotion_holdoff_minutes >= 0.0:
            raise ValueError(
                f"--rollout-demotion-holdoff-minutes must be >= 0, got {self.rollout_demotion_holdoff_minutes}"
            )
        if self.rollout_level is not None:
            if not self.rollout_levels:
                raise ValueError("--rollout-level needs --rollout-levels")
            if not 1 <= self.rollout_level <= len(self.rollout_levels):
                raise ValueError(
                    f"--rollout-level must be in 1..{len(self.rollout_levels)} (the levels given), "
                    f"got {self.rollout_level}"
                )


class DepthMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        decisions = make_counter("layerwatch_depth_decisions_total", registry)
        self.decisions = {
            (mode, reason): decisions.labels(model_name, mode, reason) for mode in MODES for reason in REASONS
        }
        self.threshold = make_histogram("layerwatch_request_threshold", registry).labels(model_name)
        self.complexity = make_histogram("layerwatch_prompt_complexity", registry).labels(model_name)
        self.level = make_gauge("layerwatch_rollout_level", registry).labels(model_name)
        self.demotions = make_counter("layerwatch_rollout_demotions_total", registry).labels(model_name)


class DepthDecider:
    """Decides each request's tau (module doc). Thread-safe: handlers decide, the engine thread
    runs `after_prefill`, and `demote` may come from anywhere."""

    def __init__(
        self,
        settings: DepthSettings,
        served_threshold: float,
        skippable: np.ndarray,
        metrics: DepthMetrics,
    ) -> None:
        settings.check()
        self.settings = settings
        self.served_threshold = served_threshold
        self.skippable = skippable  # bool [L]: the layers the policy may skip
        self.metrics = metrics
        self._lock = threading.Lock()
        self._last_demotion: float | None = None  # monotonic time of the last demotion
        levels = settings.rollout_levels
        self._level = (settings.rollout_level or len(levels)) - 1 if levels else -1  # index; -1: no rollout
        metrics.level.set(self._level + 1)

    # --- the decision ------------------------------------------------------------------------------

    def check_request_threshold(self, value: float | None) -> None:
        """Raises ValueError (the message names the field and the limits) for a field this server refuses."""
        if value is None:
            return
        bounds = self.settings.request_threshold_range
        if bounds is None:
            raise ValueError(
                f"{REQUEST_FIELD}: this server does not accept per-request thresholds "
                "(the operator enables them with --request-threshold-range LO:HI)"
            )
        lo, hi = bounds
        if not lo <= value <= hi:
            # The value as sent, not rounded: 0.50000000001 is not "0.5" to a client told it is out of range.
            raise ValueError(f"{REQUEST_FIELD} must be in [{lo:g}, {hi:g}] on this server, got {value!r}")

    def decide(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        temperature: float,
        requested: float | None = None,
    ) -> DepthDecision:
        """The decision before prefill (`requested` already checked by check_request_threshold)."""
        with self._lock:
            level = self.settings.rollout_levels[self._level] if self._level >= 0 else None
        if level is not None and not level.enables(request_id, max_tokens, temperature):
            return self._decision(0.0, "rollout")
        if requested is not None:
            return self._decision(requested, "request")
        long_prompt = self.settings.long_prompt_tokens
        if long_prompt is not None and prompt_tokens > long_prompt:
            return self._decision(self.settings.long_prompt_threshold, "prompt_length")
        return self._decision(self.served_threshold, "default")

    def override(self) -> DepthDecision:
        """Full depth for a request an operator's override covers (the alert-driven mitigation)."""
        return self._decision(0.0, "override")

    def after_prefill(self, decision: DepthDecision, prefill_scores: np.ndarray) -> tuple[DepthDecision, float]:
        """The complexity pre-check on the prompt's prefill gate scores float [T, L]: -> (the
        decision the generation runs at, the prompt's complexity score)."""
        score = prompt_complexity(prefill_scores, self.served_threshold, self.skippable)
        cutoff = self.settings.complexity_cutoff
        if decision.reason == "default" and cutoff is not None and score >= cutoff:
            decision = self._decision(self.settings.complexity_threshold, "complexity")
        return decision, score

    def record(self, decision: DepthDecision, complexity: float | None) -> None:
        """Count a request that ran (once per choice, as layerwatch_requests_total counts)."""
        self.metrics.decisions[decision.mode, decision.reason].inc()
        self.metrics.threshold.observe(decision.threshold)
        if complexity is not None:
            self.metrics.complexity.observe(complexity)

    def _decision(self, threshold: float, reason: str) -> DepthDecision:
        mode = "full" if threshold == 0.0 else "strict" if threshold < self.served_threshold else "gated"
        return DepthDecision(threshold, mode, reason)

    # --- the rollout -------------------------------------------------------------------------------

    def demote(self, reason: str) -> bool:
        """Drop to the previous rollout level (e.g. a paging alert fired). False when there is none,
        or when the last demotion was less than the hold-off ago."""
        with self._lock:
            if self._level <= 0:
                log.warning("%s", _skipped_line(self._level + 1, reason, "no lower level"))
                return False
            now = time.monotonic()
            holdoff = self.settings.rollout_demotion_holdoff_minutes * 60
            if self._last_demotion is not None and now - self._last_demotion < holdoff:
                why = f"the last demotion was {now - self._last_demotion:.0f} s ago, hold-off {holdoff:.0f} s"
                log.warning("%s", _skipped_line(self._level + 1, reason, why))
                return False
            self._last_demotion = now
            self._level -= 1
            level, described = self._level + 1, self.settings.rollout_levels[self._level].describe()
            # Under the lock: two demotions at once must not leave the gauge at the one set first.
            self.metrics.level.set(level)
        self.metrics.demotions.inc()
        log.warning(
            "%s",
            logfmt_line("ROLLOUT_DEMOTED:", from_level=level + 1, to_level=level, conditions=described, reason=reason),
        )
        return True


def _skipped_line(level: int, reason: str, why: str) -> str:
    return logfmt_line("ROLLOUT_DEMOTION_SKIPPED:", level=level, reason=reason, why=why)
