"""Which layers each sequence skips at the next decode step, decided from earlier steps only.

Two rules (threshold tau, patience k), chosen by `SkipPolicyConfig.skip_rule` (the settings, their
defaults and checks: layerwatch/skip_policy.py):

- "streak" (default): at decode step t, layer l is skipped for a sequence iff that layer's
  entropy was below tau at each of the sequence's previous k decode steps;
- "ewma": layer l is skipped iff the exponentially weighted moving average of its entropy over the
  sequence's previous decode steps is below tau, e = alpha * score + (1 - alpha) * e (started at
  the first score), once the sequence has at least k decode steps behind it (warm-up, as patience:
  its first k steps run full depth). One high score among low ones need not end a skip, where the
  streak rule starts counting again; one low score among high ones need not start one.

Under either rule a protected layer, or a sequence in a fallback episode, runs. Because step t's
mask depends only on steps < t, it is known before step t starts: no layer ever waits on the
device to learn whether it runs.

Fallback breaker: when more than `fallback_skip_fraction` of all layers were skipped for
`fallback_trigger_steps` consecutive steps of a sequence, the next `fallback_steps` steps of that
sequence run at full depth.

The mask is each row's own, whatever else shares its batch: how a batch then runs the layers its
rows want (row by row, whole layers, a batch consensus) is the depth execution's choice
(depth_execution.py), which takes the rows at full depth (`full_depth_rows`) as they are.

Per-sequence threshold: a sequence may run at its own tau (`reset(slot, threshold)`), e.g. one
an operator or the request chose; tau = 0 is full depth (no score is below 0). The other settings
are the policy's.

State is kept per cache slot in [slots, L] arrays so that a whole batch is planned and updated
with a few vectorised numpy operations, whichever slots the rows occupy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from layerwatch.skip_policy import SkipPolicyConfig, below_threshold


@dataclass
class StepDecision:
    """What the policy learned from one finished step, per row."""

    fallback_started: np.ndarray  # bool [B]: a fallback episode begins after this step


class SkipPolicy:
    def __init__(self, config: SkipPolicyConfig, num_layers: int, slots: int) -> None:
        self.config = config
        self.num_layers = num_layers
        self.skippable = config.skippable(num_layers)
        self._threshold = np.full(slots, config.threshold)  # tau per slot (float64: a tiny tau stays > 0)
        self._below_streak = np.zeros((slots, num_layers), dtype=np.int32)  # "streak"
        self._ewma = np.zeros((slots, num_layers), dtype=np.float64)  # "ewma": the average of past scores
        self._steps_seen = np.zeros(slots, dtype=np.int32)  # "ewma": observed steps, counted up to patience
        self._high_skip_streak = np.zeros(slots, dtype=np.int32)
        self._fallback_left = np.zeros(slots, dtype=np.int32)

    def reset(self, slot: int, threshold: float | None = None) -> None:
        """A new sequence takes the slot: no history, so its first k decode steps run full depth.
        `threshold`: the sequence's own tau in [0, 1], checked where it came in (GenerationEngine.add,
        the service's depth settings); None = the policy's."""
        threshold = self.config.threshold if threshold is None else threshold
        self._threshold[slot] = threshold
        self._below_streak[slot] = 0
        self._steps_seen[slot] = 0  # the next observation starts the average afresh
        self._high_skip_streak[slot] = 0
        self._fallback_left[slot] = 0

    def in_fallback(self, slots: np.ndarray) -> np.ndarray:
        """bool [B]: rows whose next step is forced to full depth by a fallback episode."""
        return self._fallback_left[slots] > 0

    def run_mask(self, slots: np.ndarray) -> np.ndarray:
        """bool [B, L] for the next step: True = the layer runs for that row. Reads only past steps."""
        if self.config.skip_rule == "ewma":
            warm = self._steps_seen[slots] >= self.config.patience
            skip = warm[:, None] & (self._ewma[slots] < self._threshold[slots, None]) & self.skippable
        else:
            skip = (self._below_streak[slots] >= self.config.patience) & self.skippable
        skip &= ~self.in_fallback(slots)[:, None]
        return ~skip

    def full_depth_rows(self, slots: np.ndarray) -> np.ndarray:
        """bool [B]: rows whose next step runs every layer, whatever their batch does: a fallback
        episode, or tau 0 (an override, a rollout's or the request's choice of full depth)."""
        return self.in_fallback(slots) | (self._threshold[slots] == 0.0)

    def below_threshold(self, slots: np.ndarray, entropies: np.ndarray) -> np.ndarray:
        """bool [B, L]: each row's scores float [B, L] below its own tau (NaN, no gates: never)."""
        return below_threshold(entropies, self._threshold[slots, None])

    def observe(self, slots: np.ndarray, entropies: np.ndarray, run_mask: np.ndarray) -> StepDecision:
        """Record a finished step: entropies float [B, L] and the run mask `run_mask` gave it (the
        rule's decision: the fallback breaker counts the rule's skips, whatever the batch ran)."""
        if self.config.skip_rule == "ewma":
            self._update_ewma(slots, entropies)
        else:
            below = self.below_threshold(slots, entropies)
            self._below_streak[slots] = np.where(below, self._below_streak[slots] + 1, 0)

        was_fallback = self._fallback_left[slots] > 0
        self._fallback_left[slots] = np.maximum(self._fallback_left[slots] - 1, 0)
        skipped_fraction = (~run_mask).sum(axis=1) / self.num_layers
        high = skipped_fraction > self.config.fallback_skip_fraction
        high_streak = np.where(high & ~was_fallback, self._high_skip_streak[slots] + 1, 0)
        started = high_streak >= self.config.fallback_trigger_steps
        self._high_skip_streak[slots] = np.where(started, 0, high_streak)
        self._fallback_left[slots] = np.where(started, self.config.fallback_steps, self._fallback_left[slots])
        return StepDecision(fallback_started=started)

    def _update_ewma(self, slots: np.ndarray, entropies: np.ndarray) -> None:
        """Fold a step's scores into each row's average (NaN, no gates: stays NaN, never below tau)."""
        alpha = self.config.ewma_alpha
        seen = self._steps_seen[slots]
        scores = entropies.astype(np.float64)
        averaged = alpha * scores + (1.0 - alpha) * self._ewma[slots]
        self._ewma[slots] = np.where(seen[:, None] > 0, averaged, scores)
        self._steps_seen[slots] = np.minimum(seen + 1, self.config.patience)


def decide_sequences(config: SkipPolicyConfig, scores: np.ndarray) -> np.ndarray:
    """bool [B, T, L]: the layers the policy skips at each of T consecutive decode steps of B sequences
    whose gates scored `scores` float [B, T, L], teacher-forced (each step's mask from the steps before
    it, every decision executed). The one rule, replayed: what training reports, the tests' traces and
    parity checks against other engines use instead of a copy of it."""
    rows, steps, layers = scores.shape
    policy = SkipPolicy(config, layers, slots=rows)
    slots = np.arange(rows)
    skipped = np.zeros(scores.shape, dtype=bool)
    for t in range(steps):
        run = policy.run_mask(slots)
        skipped[:, t] = ~run
        policy.observe(slots, scores[:, t], run)
    return skipped
