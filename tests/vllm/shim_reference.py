"""The shim engine's side of the parity checks: the tokens vLLM generated, teacher-forced through the shim's model
(`layerwatch serve`'s prefill and decode step) executing the masks vLLM executed, and the skip rule's decisions
on the shim's scores, held to vLLM's within a bound derived from float32's rounding of this very computation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.gates import GATES_FILE, load_gates
from layerwatch.inference_shim.runtime.model import KVCache, Transformer
from layerwatch.inference_shim.runtime.skip_policy import decide_sequences
from layerwatch.skip_policy import SkipPolicyConfig

# Two float32 implementations of one computation differ by their rounding, whose size depends on the model,
# the input and the kernels. Each is held to FLOAT32_ERRORS times how far float32 rounding moves the shim's own
# scores for the same tokens (its float32 run against a float64 copy's), as tests/model/test_transformers_reference
# holds the shim to transformers: the two engines each carry an error of that size, made in another order.
FLOAT32_ERRORS = 16


@dataclass
class Sequence:
    """One greedy completion through vLLM, with the plugin's frames for it (one row per step)."""

    prompt_ids: list[int]
    output_ids: list[int]
    scores: np.ndarray  # float32 [T, L]: the gates' scores vLLM's frames carried, step by step
    skipped: np.ndarray  # bool [T, L]: the layers vLLM did not run

    @property
    def fed(self) -> list[int]:
        """The token each step read: the prompt's last, then every generated token but the last."""
        return [self.prompt_ids[-1], *self.output_ids[:-1]]


@dataclass
class Comparison:
    bound: float  # the derived float32 error bound of a gate score
    score_error: float  # the largest |vLLM's score - the shim's| over every step and layer
    decisions: int  # (step, layer) decisions compared
    near_threshold: int  # decisions that differ where a score within the bound of τ decided them
    unexplained: list[tuple[int, int, int]]  # (sequence, step, layer) decisions that differ without one


def gated_model(folder: Path) -> Transformer:
    checkpoint = load_checkpoint(folder)
    checkpoint.model.attach_gates(load_gates(folder / GATES_FILE, checkpoint.model).gates)
    return checkpoint.model


def forced_scores(model: Transformer, sequence: Sequence) -> np.ndarray:
    """float64 [T, L]: the shim's gate scores for the sequence's tokens, each step executing vLLM's mask."""
    dtype = model.embed_tokens.weight.dtype
    length = len(sequence.prompt_ids) + len(sequence.output_ids)
    cache = KVCache(model.config, 1, length, dtype, "cpu")
    rows = []
    with torch.inference_mode():
        model.prefill(torch.tensor(sequence.prompt_ids[:-1]), cache, 0)
        position = len(sequence.prompt_ids) - 1
        for t, token in enumerate(sequence.fed):
            run = ~sequence.skipped[t : t + 1]
            _, entropies = model.decode_step(torch.tensor([token]), cache, [0], [position + t], run, "project")
            rows.append(entropies[0].double().numpy())
    return np.array(rows)


def compare(folder: Path, policy: SkipPolicyConfig, sequences: list[Sequence]) -> Comparison:
    """vLLM's scores and decisions against the shim's for the same tokens (module doc)."""
    model = gated_model(folder)
    exact = copy.deepcopy(model).double()
    shim = [forced_scores(model, s) for s in sequences]
    rounding = max(np.abs(a - forced_scores(exact, s)).max() for a, s in zip(shim, sequences))
    bound = FLOAT32_ERRORS * float(rounding)
    score_error, decisions, near, unexplained = 0.0, 0, 0, []
    for index, (sequence, scores) in enumerate(zip(sequences, shim)):
        score_error = max(score_error, float(np.abs(sequence.scores - scores).max()))
        decided = decide_sequences(policy, scores[None].astype(np.float32))[0]
        near_tau = np.abs(scores - policy.threshold) <= bound  # [T, L]
        # A decision at step t reads the scores of the steps before it, as far back as patience (streak) or
        # every earlier step (ewma's average; the fallback breaker's counts): any near-τ score before it explains it.
        explained = np.cumsum(near_tau, axis=0) - near_tau > 0
        differ = decided != sequence.skipped
        decisions += differ.size
        near += int((differ & explained).sum())
        unexplained += [(index, int(t), int(l)) for t, l in zip(*np.nonzero(differ & ~explained))]
    return Comparison(bound, score_error, decisions, near, unexplained)
