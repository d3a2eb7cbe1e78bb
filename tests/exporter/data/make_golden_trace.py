"""Writes golden-trace.jsonl, the fixed trace behind the golden /metrics and replay tests.

Two models, interleaved as concurrent sequences would be: "demo" (12 layers, 500 tokens) has the healthy two
humps (redundant layers near 0.1, key layers near 0.3, skipped after 3 tokens below 0.18);
"flat" (8 layers, 250 tokens) has degraded into one hump near 0.5 and never skips. Seeded: rerunning it
reproduces the file byte for byte.

    .venv/bin/python tests/exporter/data/make_golden_trace.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from layerwatch.inference_shim.runtime.skip_policy import decide_sequences
from layerwatch.skip_policy import SkipPolicyConfig

THRESHOLD, PATIENCE = 0.18, 3


def demo_scores(rng: np.random.Generator, tokens: int) -> np.ndarray:
    redundant = np.array([0, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0], dtype=bool)  # per layer
    centres = np.where(redundant, 0.1, 0.3)
    return np.clip(rng.normal(centres, 0.035, size=(tokens, len(centres))), 0, 1)


def policy_skips(scores: np.ndarray) -> np.ndarray:
    """The skip policy's decisions for one sequence of [tokens, layers] scores (no protected layers)."""
    config = SkipPolicyConfig(threshold=THRESHOLD, patience=PATIENCE, protected_layers=())
    return decide_sequences(config, scores[None])[0]


def main() -> None:
    rng = np.random.default_rng(20251130)
    demo = np.round(demo_scores(rng, 500), 4)
    flat = np.round(np.clip(rng.normal(0.5, 0.08, size=(250, 8)), 0, 1), 4)
    demo_skipped = policy_skips(demo).astype(int)
    lines = []
    for token in range(500):
        lines.append({"model_name": "demo", "scores": demo[token].tolist(), "skipped": demo_skipped[token].tolist()})
        if token % 2:
            lines.append({"model_name": "flat", "scores": flat[token // 2].tolist(), "skipped": [0] * 8})
    path = Path(__file__).with_name("golden-trace.jsonl")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
