"""Per-request skipping: what one finished request did, for the tail a small category lives in.

The global skip ratio averages over all traffic: a category that is 5 % of the requests and skips
twice as much moves it by a point or two. Judged per request, the same category is a tail of the
distribution of requests' skip fractions, and it shows at once (docs/service.md, "Per-request
skipping"). Two statistics per request, over its decode tokens only (prefill runs full depth):

- **skip fraction** = skipped layer evaluations / layer evaluations, the skips its skip rule
  decided (`LayerCounts.skipped`: its routing, whatever its batch ran; `usage` counts what ran,
  docs/model.md, "Depth execution"). Defined for every request with a decode token.
- **token-dependent share**: layerwatch/routing.py's statistic with the request's tokens as the
  window: 1 − Σ_{static l} p_l / Σ_l p_l, where p_l is the share of the request's tokens whose score
  for layer l was below τ and a layer is static when the one-sided 90 % Wilson lower bound of p_l is
  ≥ 0.95. The same statistic and classification as the exporter's window, so a request's value
  reads like the model's (docs/exporter.md, "Why this statistic"): 0 = all of the request's skipping
  is in layers below τ on (nearly) every one of its tokens, i.e. static pruning for that request.

  Defined from MIN_REQUEST_ROUTING_TOKENS decode tokens on, and only when some score was below τ.
  The threshold is not arbitrary: it is the fewest tokens at which a layer can be classified static
  at all (below τ on all n tokens: Wilson lower bound n / (n + z²) ≥ 0.95 ⇔ n ≥ 19 z² = 31.2). A
  shorter request would read 1.0 whenever anything is below τ, by construction and not by routing,
  so it is left out rather than reported. Scores, not skip decisions, as in the exporter: decisions
  lag the scores by `patience` tokens, so in a 32-token request a layer below τ throughout would be
  skipped on at most 29 tokens and never look static.

The exporter's verdict needs 200 tokens because it judges a whole model's routing; a request is
judged only for its own tokens, and its values are aggregated in a histogram, whose tail is what
alerts read (layerwatch/alerts/specs.py, LayerwatchRequestTailRunaway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from layerwatch.routing import CONFIDENCE_Z, STATIC_LOW_RATE, check_routing

# The fewest tokens at which a layer below τ on every token is classified static (see above): 32.
MIN_REQUEST_ROUTING_TOKENS = math.ceil(STATIC_LOW_RATE * CONFIDENCE_Z**2 / (1.0 - STATIC_LOW_RATE))


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields
class RequestLayers:
    """A finished request's decode steps, per layer (the engine counts them as it decodes)."""

    tokens: int  # decode tokens (= completion_tokens)
    skipped: np.ndarray  # int [layers]: tokens for which the layer was skipped
    below_threshold: np.ndarray  # int [layers]: tokens whose gate score for the layer was below τ

    def __post_init__(self) -> None:
        skipped, below = np.asarray(self.skipped), np.asarray(self.below_threshold)
        if skipped.ndim != 1 or skipped.shape != below.shape:
            raise ValueError(f"skipped {skipped.shape} and below_threshold {below.shape} must be equal [layers]")
        if self.tokens < 0 or (skipped < 0).any() or (skipped > self.tokens).any():
            raise ValueError("skip counts must lie in 0..tokens")
        if (below < 0).any() or (below > self.tokens).any():
            raise ValueError("below-threshold counts must lie in 0..tokens")

    @property
    def layers(self) -> int:
        return len(self.skipped)


@dataclass(frozen=True)
class RequestSkipping:
    """The statistics of one request (see the module docstring)."""

    tokens: int
    skip_fraction: float
    token_dependent_share: float | None  # None: fewer than MIN_REQUEST_ROUTING_TOKENS, or nothing below τ

    def runaway(self, cutoff: float) -> bool:
        """Whether the request skipped more than `cutoff` of its layer evaluations (strictly, so that
        a cut-off on a histogram bucket edge counts exactly the requests above that bucket)."""
        return self.skip_fraction > cutoff


def request_skipping(layers: RequestLayers) -> RequestSkipping | None:
    """The request's statistics; None for a request without decode tokens (nothing to judge)."""
    if layers.tokens == 0 or layers.layers == 0:
        return None
    skipped = int(np.sum(layers.skipped))
    # Integers divided once: exactly the float the same numbers give in the client's `usage`.
    fraction = skipped / (layers.tokens * layers.layers)
    routing = check_routing(
        layers.tokens, layers.below_threshold, layers.skipped, min_tokens=MIN_REQUEST_ROUTING_TOKENS
    )
    return RequestSkipping(layers.tokens, fraction, routing.token_dependent_share)
