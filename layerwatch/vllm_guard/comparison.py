"""What the shim's shadow check measures (layerwatch/inference_shim/runtime/agreement.py), from what vLLM's API gives:
per generated position, the gated model's top-20 raw log-probabilities (the answer's own `logprobs`, before
temperature under vLLM's default `--logprobs-mode raw_logprobs`) and the full-depth model's top-20 plus the
answer's token (`prompt_logprobs` of the re-scored prompt + answer: the plugin runs prompt tokens at full depth).

- **agreement**: the full-depth argmax (rank 1) equals the gated argmax (the highest gated log-probability);
- **KL(gated || full)** and **KL(full || gated)**, summed by layerwatch/shadow_divergence.py on a partition of the
  vocabulary. The shim's partition is {each of the gated top-16 tokens} + {the rest}; here a gated top-16 token
  missing from the full-depth list has no known full-depth probability, so it is merged into the rest cell, whose
  full-depth mass is then known exactly: 1 - the known cells'. The partition is {each gated top-16 token the
  full-depth list holds} + {every other token}: a coarsening of the shim's, so by the data-processing inequality
  each figure is at most the shim's at the same position, itself a lower bound of the true KL. The full-depth
  list holds the 20 most likely tokens, so only tokens the full-depth model ranks below 20 are merged: where the
  two models agree they are rare, and the figure equals the shim's.

A rest cell at or below 0 on one side (its mass lost in float32 rounding, each list summing to 1 only that
closely) is merged into the first cell, so that no cell has mass on one side only: coarser still, still a bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from layerwatch.shadow_divergence import SHADOW_TOP_K, partition_kl

REQUESTED_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class Position:
    """One generated position: each side's known log-probabilities by token id."""

    gated: Mapping[int, float]  # the answer's top log-probabilities (the sampled token's among them)
    full: Mapping[int, float]  # the re-score's prompt log-probabilities at the same position
    full_argmax: int  # the full-depth token of rank 1


@dataclass(frozen=True)
class ShadowFigures:
    tokens: int
    agreements: int
    kl_nats: float  # sum over the positions of KL(gated || full) on the partition (module doc)
    reverse_kl_nats: float  # the same for KL(full || gated)


def compare(positions: Sequence[Position]) -> ShadowFigures:
    if not positions:
        return ShadowFigures(0, 0, 0.0, 0.0)
    rows = [cells(position) for position in positions]
    width = max(len(gated) for gated, _ in rows)
    gated_cells = np.full((len(rows), width), -np.inf)
    full_cells = np.full((len(rows), width), -np.inf)
    for row, (gated, full) in enumerate(rows):
        gated_cells[row, : len(gated)] = gated
        full_cells[row, : len(full)] = full
    agreements = sum(gated_argmax(p.gated) == p.full_argmax for p in positions)
    return ShadowFigures(
        tokens=len(positions),
        agreements=agreements,
        kl_nats=float(partition_kl(gated_cells, full_cells).sum()),
        reverse_kl_nats=float(partition_kl(full_cells, gated_cells).sum()),
    )


def gated_argmax(gated: Mapping[int, float]) -> int:
    return max(gated, key=gated.__getitem__)


def cells(position: Position) -> tuple[np.ndarray, np.ndarray]:
    """The (gated, full) log-probabilities of one position's partition (module doc), float64."""
    top = sorted(position.gated, key=position.gated.__getitem__, reverse=True)[:SHADOW_TOP_K]
    known = [token for token in top if token in position.full]
    gated = np.array([position.gated[t] for t in known], dtype=np.float64)
    full = np.array([position.full[t] for t in known], dtype=np.float64)
    gated_rest, full_rest = rest_logprob(gated), rest_logprob(full)
    if known and (gated_rest == -np.inf) != (full_rest == -np.inf):
        gated[0], full[0] = np.logaddexp(gated[0], gated_rest), np.logaddexp(full[0], full_rest)
        return gated, full
    return np.append(gated, gated_rest), np.append(full, full_rest)


def rest_logprob(known: np.ndarray) -> float:
    """log(1 - the mass of the known cells), -inf where rounding leaves none."""
    mass = -np.expm1(np.logaddexp.reduce(known)) if len(known) else 1.0
    return float(np.log(mass)) if mass > 0 else -np.inf
