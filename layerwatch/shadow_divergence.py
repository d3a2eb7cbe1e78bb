"""The quality guard's divergence between the gated and the full-depth model at one position, over a partition of
the vocabulary into cells: one definition for the shim, which computes the cells on its device from the full
distributions (layerwatch/inference_shim/runtime/agreement.py), and the vLLM guard, which has only vLLM's top-20
lists (layerwatch/vllm_guard/comparison.py). Merging cells never increases a KL divergence (the data-processing
inequality), so a figure on a coarser partition is a lower bound of one on a finer one and of the true KL.
"""

from __future__ import annotations

import numpy as np

SHADOW_TOP_K = 16  # tokens of the gated distribution that are cells of their own (docs/service.md)


def partition_kl(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    """KL(p || q) in nats per row, float64 [G], of two distributions given as the log-probabilities of the same
    cells [G, C]. A cell whose p is 0 contributes 0 (0 log 0 = 0): rows of fewer cells pad with -inf on both
    sides. Clamped at 0, where the two agree up to rounding (each side sums to 1 only that closely)."""
    p_log = np.asarray(p_log, dtype=np.float64)
    q_log = np.asarray(q_log, dtype=np.float64)
    p = np.exp(p_log)
    with np.errstate(invalid="ignore"):  # -inf - -inf in the padding cells, which `where` leaves out
        terms = np.where(p > 0, p * (p_log - q_log), 0.0)
    return np.maximum(terms.sum(axis=-1), 0.0)
