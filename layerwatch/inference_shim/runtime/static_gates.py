"""Constant gates: the static-pruning drill behind `layerwatch serve --static-gates`.

Each layer's gate is replaced by a constant, so nothing depends on the token any more while the
model keeps about its skip ratio and its two entropy humps: the failure LayerwatchRoutingStatic
exists for and LayerwatchEntropyShapeChanged cannot see (docs/exporter.md, "Static pruning and the
routing verdict").

Design. The healthy scores are measured at start-up from the loaded gates, the way they are served:
greedy completions of a fixed prompt set (`PROMPTS`, `NEW_TOKENS` tokens each) by the real
GenerationEngine under the gate file's own threshold τ and patience. Then:
- the k layers the healthy gates skip most become static-skipped, where k is the healthy number of
  skipped layers per token, rounded (Σ of the per-layer skip rates): the same skip ratio to within
  one layer's share;
- each layer's constant is its healthy mean score on the side of τ it is put on: the mean of its
  scores below τ for a static-skipped layer (the low hump), the mean of its scores at or above τ
  for every other layer (the high hump); a layer with no score on that side keeps its overall mean.

Why not simply each layer's overall mean score: a layer that is below τ for half of the tokens
averages to about τ, so the constants fill the valley between the humps and the pooled histogram
becomes one peak (the demo model's means are 0.11-0.30 with most near 0.2): the drill would page
LayerwatchEntropyShapeChanged like `--reset-gates` does, instead of showing a static pruning that
only the routing statistics can see.

A constant gate is the gate architecture with zero weights and the output bias at logit(c):
sigmoid(0 · x + logit(c)) = c for any input. The bank keeps the loaded metadata (threshold,
patience, base fingerprint) and is hashed like a gate file, so `layerwatch_model_info`'s
`gates_sha256` changes. Deterministic for a given checkpoint and gate file.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch

from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams, StepRecord
from layerwatch.inference_shim.runtime.gates import LoadedGates, gates_sha256
from layerwatch.inference_shim.runtime.model import GateBank, Transformer
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.skip_policy import SkipPolicyConfig, below_threshold

# Short and generic (plus the demo model's KJV register), fixed so that the constants are reproducible.
PROMPTS = (
    "In the beginning",
    "And the LORD said unto",
    "Blessed are they that",
    "And it came to pass, when",
    "The weather today is",
    "Once upon a time, there was",
    "The quick brown fox",
    "Here is a short list of",
)
NEW_TOKENS = 32  # greedy tokens per prompt: at most 256 decode steps' scores per layer
_EPSILON = 1e-6  # keeps logit(c) finite


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields
class StaticGates:
    gates: LoadedGates  # the constant gates
    constants: np.ndarray  # float [L]: what each layer scores, for every token
    static_layers: tuple[int, ...]  # constant below τ: skipped for every token (unless protected)
    healthy_skip_rates: np.ndarray  # float [L]: the measured healthy skip rate per layer


def healthy_decode(
    model: Transformer,
    tokenizer: Tokenizer,
    gates: GateBank,
    policy: SkipPolicyConfig,
    kv_policy: str,
    prompts: tuple[str, ...] = PROMPTS,
    new_tokens: int = NEW_TOKENS,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy completions of `prompts` with `gates` (left attached to `model`): every decode step's
    (scores float [T, L], skipped bool [T, L])."""
    scores: list[np.ndarray] = []
    skipped: list[np.ndarray] = []

    def record(step: StepRecord) -> None:
        scores.append(step.entropies)
        skipped.append(step.skipped)

    model.attach_gates(gates)
    engine = GenerationEngine(
        model,
        tokenizer,
        model_name="static-gates-measurement",
        policy=policy,
        kv_policy=kv_policy,
        max_batch_size=len(prompts),
        step_hook=record,
    )
    for prompt in prompts:
        engine.submit(tokenizer.encode(prompt), SamplingParams(max_tokens=new_tokens, temperature=0.0))
    while engine.has_work():
        engine.step()
    if not scores:
        raise ValueError("measuring the healthy gate scores decoded no token (every prompt ended at once)")
    return np.concatenate(scores).astype(np.float64), np.concatenate(skipped)


def plan_constants(scores: np.ndarray, skipped: np.ndarray, threshold: float) -> tuple[np.ndarray, tuple[int, ...]]:
    """(constant per layer, layers whose constant is below τ) from healthy scores and skips [T, L]
    (see the module docstring)."""
    skip_rates = skipped.mean(axis=0)
    k = int(round(float(skip_rates.sum())))  # <= the layers with a skip rate > 0: each rate is <= 1
    order = sorted(range(len(skip_rates)), key=lambda layer: (-skip_rates[layer], layer))
    static = tuple(sorted(layer for layer in order[:k] if skip_rates[layer] > 0))
    below = below_threshold(scores, threshold)
    constants = scores.mean(axis=0)
    for layer in range(scores.shape[1]):
        side = below[:, layer] if layer in static else ~below[:, layer]
        if side.any():
            constants[layer] = scores[side, layer].mean()
    # The chosen layers, and any other whose every healthy score was below τ.
    return constants, tuple(np.flatnonzero(below_threshold(constants, threshold)).tolist())


def constant_gates(loaded: LoadedGates, constants: np.ndarray) -> LoadedGates:
    """A copy of `loaded` (device, dtype, metadata) whose layer l scores `constants[l]` for any input."""
    if len(constants) != len(loaded.gates):
        raise ValueError(f"{len(constants)} constants for {len(loaded.gates)} gates")
    bank = copy.deepcopy(loaded.gates)
    with torch.no_grad():
        for layer, constant in enumerate(constants.tolist()):
            gate = bank[layer]
            c = min(max(constant, _EPSILON), 1.0 - _EPSILON)
            for parameter in (gate.fc1.weight, gate.fc1.bias, gate.fc2.weight):
                parameter.zero_()
            gate.fc2.bias.fill_(math.log(c / (1.0 - c)))
    return LoadedGates(gates=bank.eval(), metadata=loaded.metadata, sha256=gates_sha256(bank, loaded.metadata))


def static_gates(
    model: Transformer,
    tokenizer: Tokenizer,
    loaded: LoadedGates,
    *,
    protected_layers: tuple[int, ...] | None,
    kv_policy: str,
    threshold: float | None = None,
) -> StaticGates:
    """The drill's constant gates for `loaded`, measured under the skip policy they are served at: the
    gate file's own (threshold, patience, rule), its threshold replaced by `threshold` where serve is
    given one (gates that record tau 0 skip nothing at their own), with the served protected layers
    and KV policy."""
    if threshold is None:
        threshold = loaded.metadata.threshold
    policy = loaded.metadata.policy(protected_layers=protected_layers, threshold=threshold)
    scores, skipped = healthy_decode(model, tokenizer, loaded.gates, policy, kv_policy)
    constants, static = plan_constants(scores, skipped, threshold)
    return StaticGates(constant_gates(loaded, constants), constants, static, skipped.mean(axis=0))
