"""Constructed traces for the routing statistics: static pruning, per-token routing, and mixes.

Scores come from a per-token, per-layer state: a layer that is "redundant" for a token scores
N(0.10, sigma), otherwise N(0.30, sigma); the probability of "redundant" per layer is the layer's
intended low rate. Skip decisions follow the skip policy: per sequence, a layer is skipped once its
score stayed below the threshold for PATIENCE tokens, never the first and last layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from layerwatch.inference_shim.runtime.skip_policy import decide_sequences
from layerwatch.skip_policy import SkipPolicyConfig

THRESHOLD, PATIENCE = 0.18, 3
# The demo model's served trace: per-layer share of tokens below the threshold.
DEMO_LOW_RATES = (0, 0.48, 0.40, 0.45, 0.51, 0.56, 0.17, 0.32, 0.31, 0.72, 0.51, 0.92, 1.0, 0.97, 0.99, 0)


def scores_for_rates(
    rng: np.random.Generator, rates, tokens: int, sigma: float = 0.03, low: float = 0.10, high: float = 0.30
) -> np.ndarray:
    rates = np.asarray(rates, dtype=np.float64)
    redundant = rng.random((tokens, len(rates))) < rates
    centres = np.where(redundant, low, high)
    return np.clip(rng.normal(centres, sigma), 0, 1).astype(np.float32)


def static_rates(layers: int, static: list[int]) -> np.ndarray:
    rates = np.zeros(layers)
    rates[static] = 1.0
    return rates


def policy_skips(
    scores: np.ndarray, sequence_length: int, threshold: float = THRESHOLD, patience: int = PATIENCE
) -> np.ndarray:
    """bool [tokens, layers]: the skip policy's decisions (the first and last layer protected), for
    consecutive sequences of `sequence_length` tokens."""
    config = SkipPolicyConfig(threshold=threshold, patience=patience)
    return np.concatenate(
        [
            decide_sequences(config, scores[start : start + sequence_length][None])[0]
            for start in range(0, len(scores), sequence_length)
        ]
    )


def write_trace(
    path: Path,
    models: dict[str, np.ndarray],
    sequence_length: int = 64,
    threshold: float | None = None,
    skip_threshold: float = THRESHOLD,
) -> Path:
    """One JSONL trace; models {name: scores [tokens, layers]}, their tokens interleaved."""
    models = {name: np.round(scores, 4).astype(np.float32) for name, scores in models.items()}
    skipped = {name: policy_skips(scores, sequence_length, skip_threshold) for name, scores in models.items()}
    lines = []
    for token in range(max(len(scores) for scores in models.values())):
        for name, scores in models.items():
            if token < len(scores):
                line = {
                    "model_name": name,
                    "scores": [round(float(x), 4) for x in scores[token]],  # as stored
                    "skipped": skipped[name][token].astype(int).tolist(),
                }
                if threshold is not None:
                    line["threshold"] = threshold
                lines.append(json.dumps(line) + "\n")
    path.write_text("".join(lines))
    return path
