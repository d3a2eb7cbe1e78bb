"""Routing statistics: does the gate still route per token, or has it become static pruning?

The pooled entropy histogram (layerwatch/statistics.py) cannot tell: if layers 11–14 score 0.10
on every token and all others 0.30, the pooled values form two humps and the verdict says bimodal,
although the same four layers are skipped for every token. The question is about the *layer ×
token* structure of the decisions, so these statistics keep the layer axis.

Per layer l, over the T tokens of a window (one token = one frame or trace row):
- low rate p_l: the share of tokens whose gate score is below τ. It is taken from the scores, not
  from the skip decisions, because decisions lag the scores by `patience` tokens: the first tokens
  of every sequence cannot be skipped, so short sequences would make every layer look
  token-dependent. The skip rate (decisions) is reported next to it for comparison.
- class: **static** (skipped whatever the token) when the one-sided 90 % Wilson lower bound of
  p_l is ≥ 0.95; **static-run** (kept whatever the token) when the upper bound is ≤ 0.05;
  otherwise **token-dependent**. A bound, not the point estimate, so that sampling noise in a small
  window does not make a token-dependent layer look static; 90 % rather than 95 % so that a layer
  clearly past the line (0.97) is recognised within a 1,000-token window (docs/exporter.md).

Headline, the token-dependent share of skipping:

    token_dependent_share = 1 − Σ_{l static} p_l / Σ_{l not static-run} p_l

the share of the below-τ mass (layer evaluations below τ) that lies in layers whose decision varies
with the token. Static-run layers are left out of both sums: their few stray low scores are noise,
and counting them as token-dependent let many rarely-low layers outweigh a truly static one.
docs/exporter.md compares it with the alternatives (1 − η², mass-weighted within-layer variance,
a min(p, 1 − p) decomposition).

Verdict: withheld while the window holds fewer than `min_tokens` tokens, or no score below τ at all
(nothing is skipped: there is no skipping to be static or dynamic); otherwise
dynamic ⇔ token_dependent_share ≥ 0.5, else static (most of the skipping is static pruning).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from layerwatch import skip_policy

# A layer below τ for at least this share of tokens is static (skipped whatever the token) ...
STATIC_LOW_RATE = 0.95
# ... and one below τ for at most this share is static-run (kept whatever the token).
STATIC_RUN_LOW_RATE = 0.05
# z of the one-sided 90 % Wilson bounds that classify a layer.
CONFIDENCE_Z = 1.2815515655446004
# dynamic ⇔ at least this share of the below-τ mass lies in token-dependent layers.
DYNAMIC_SHARE = 0.5
# Below this many tokens in the window the verdict is withheld. At 200 tokens a layer below τ on
# every token has a lower bound of 0.992, and a token-dependent layer at 0.92 is called static
# with a probability of 0.3 %.
DEFAULT_MIN_ROUTING_TOKENS = 200

DYNAMIC, STATIC, WITHHELD = "dynamic", "static", "withheld"

# Per-layer state codes as exported (layerwatch_routing_layer_static).
STATE_STATIC, STATE_TOKEN_DEPENDENT, STATE_STATIC_RUN = 1, 0, -1


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields
class Routing:
    """The routing statistics of one window; the judgements are None while withheld."""

    tokens: int
    low_counts: np.ndarray  # int [layers]: tokens whose score was below τ
    skip_counts: np.ndarray  # int [layers]: tokens for which the layer was skipped
    verdict: str  # DYNAMIC | STATIC | WITHHELD
    token_dependent_share: float | None
    static_layers: tuple[int, ...] | None
    static_run_layers: tuple[int, ...] | None

    @property
    def withheld(self) -> bool:
        return self.verdict == WITHHELD

    @property
    def layers(self) -> int:
        return len(self.low_counts)

    @property
    def low_rates(self) -> np.ndarray:
        """float [layers]: share of tokens below τ (empty while the window holds no token)."""
        return self.low_counts / self.tokens if self.tokens else np.zeros(0)

    @property
    def skip_rates(self) -> np.ndarray:
        return self.skip_counts / self.tokens if self.tokens else np.zeros(0)

    def layer_states(self) -> np.ndarray | None:
        """int [layers]: STATE_STATIC, STATE_TOKEN_DEPENDENT or STATE_STATIC_RUN; None while withheld."""
        if self.static_layers is None or self.static_run_layers is None:  # both None exactly when withheld
            return None
        states = np.full(self.layers, STATE_TOKEN_DEPENDENT, dtype=np.int64)
        states[list(self.static_layers)] = STATE_STATIC
        states[list(self.static_run_layers)] = STATE_STATIC_RUN
        return states


def wilson_bounds(successes: np.ndarray, trials: int, z: float = CONFIDENCE_Z) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval of a binomial proportion: (lower, upper) arrays, each one-sided at z."""
    k = np.asarray(successes, dtype=np.float64)
    n = float(trials)
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return np.clip(centre - half, 0.0, 1.0), np.clip(centre + half, 0.0, 1.0)


def below_threshold(entropies: np.ndarray, threshold: float) -> np.ndarray:
    """bool, same shape: the score counts toward skipping, τ as a frame carries it (a float32)."""
    return skip_policy.below_threshold(entropies, np.float32(threshold))


def check_routing(
    tokens: int, low_counts: np.ndarray, skip_counts: np.ndarray, min_tokens: int = DEFAULT_MIN_ROUTING_TOKENS
) -> Routing:
    """The statistics and verdict from per-layer counts over `tokens` tokens (see the module docstring)."""
    low_counts = np.asarray(low_counts, dtype=np.int64)
    skip_counts = np.asarray(skip_counts, dtype=np.int64)
    if low_counts.shape != skip_counts.shape or low_counts.ndim != 1:
        raise ValueError(f"low_counts {low_counts.shape} and skip_counts {skip_counts.shape} must be equal [layers]")
    if tokens < 0 or (low_counts < 0).any() or (low_counts > tokens).any():
        raise ValueError("counts must lie in 0..tokens")
    if tokens < max(min_tokens, 1) or low_counts.sum() == 0:
        return Routing(tokens, low_counts, skip_counts, WITHHELD, None, None, None)
    lower, upper = wilson_bounds(low_counts, tokens)
    static = lower >= STATIC_LOW_RATE
    static_run = upper <= STATIC_RUN_LOW_RATE
    share = token_dependent_share(low_counts, static, static_run)
    return Routing(
        tokens,
        low_counts,
        skip_counts,
        DYNAMIC if share >= DYNAMIC_SHARE else STATIC,
        share,
        tuple(np.flatnonzero(static).tolist()),
        tuple(np.flatnonzero(static_run).tolist()),
    )


def routing_from_rows(below: np.ndarray, skipped: np.ndarray, min_tokens: int = DEFAULT_MIN_ROUTING_TOKENS) -> Routing:
    """Convenience: the statistics of bool [tokens, layers] below-τ and skip masks."""
    below = np.asarray(below, dtype=bool)
    skipped = np.asarray(skipped, dtype=bool)
    return check_routing(below.shape[0], below.sum(axis=0), skipped.sum(axis=0), min_tokens)


def token_dependent_share(low_counts: np.ndarray, static: np.ndarray, static_run: np.ndarray | None = None) -> float:
    """Share of the below-τ mass in token-dependent layers: neither static nor static-run (0 when
    nothing counts). A static-run layer's few stray low scores are noise, not routing: counted as
    token-dependent, thirty of them would outweigh one truly static layer."""
    counts = np.asarray(low_counts)
    considered = np.ones(len(counts), dtype=bool) if static_run is None else ~np.asarray(static_run)
    total = int(np.sum(counts[considered]))
    if total == 0:
        return 0.0
    return 1.0 - int(np.sum(counts[considered & np.asarray(static)])) / total


def routing_report(routing: Routing, threshold: float | None) -> dict[str, object]:
    """The routing keys `layerwatch replay --json` adds per model."""
    share = routing.token_dependent_share
    return {
        "routing_verdict": routing.verdict,
        "token_dependent_share": None if share is None or math.isnan(share) else share,
        "static_layers": None if routing.static_layers is None else list(routing.static_layers),
        "static_run_layers": None if routing.static_run_layers is None else list(routing.static_run_layers),
        "per_layer_low_rate": routing.low_rates.tolist(),
        "per_layer_skip_rate": routing.skip_rates.tolist(),
        "routing_tokens": routing.tokens,
        "threshold": threshold,
    }
