"""A prompt's complexity score for the depth pre-check (docs/service.md, "Depth per request").

The prefill runs every prompt at full depth and every gate scores its layer for every prompt
token, so the gates' own view of the prompt comes for free before the first decode step. The
score is the share of the prompt's gate scores on skippable layers that fall below the served
threshold: how much of the prompt the gates would have let the decode skip. Measured on the demo
model's held-out text (benchmarks/depth_precheck.py, docs/performance.md), running the top decile
by this score at full depth buys back as much of the gated perplexity increase as the prompt's
own perplexity or mean gate score and more than its length; with short prompts a little more than
a random decile, with long ones no more.

Torch-free: the shim (layerwatch/inference_shim/service/depth.py) and the benchmark share it.
"""

from __future__ import annotations

import numpy as np

from layerwatch.skip_policy import below_threshold


def prompt_complexity(scores: np.ndarray, threshold: float, skippable: np.ndarray) -> float:
    """scores float [T, L]: the prompt's prefill gate scores (NaN without gates); skippable bool [L].
    -> the share in [0, 1] of the scores on skippable layers below `threshold` (0 for an empty
    prompt or a model without gates)."""
    on_skippable = scores[:, skippable]
    scored = np.isfinite(on_skippable)
    if not scored.any():
        return 0.0
    return float(below_threshold(on_skippable[scored], threshold).sum() / scored.sum())
