"""Constant gates for the static-pruning drill (`serve --static-gates`): each layer scores a constant
taken from its healthy scores on every token, so skipping keeps its ratio and its two entropy humps
but loses all token dependence."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.inference_shim.runtime.gates import GateMetadata, LoadedGates, gates_sha256, model_fingerprint
from layerwatch.inference_shim.runtime.static_gates import PROMPTS, constant_gates, plan_constants, static_gates
from layerwatch.routing import STATIC, below_threshold, routing_from_rows
from layerwatch.skip_policy import SkipPolicyConfig
from layerwatch.statistics import check_bimodality

from .conftest import random_gates, random_model, tiny_config

THRESHOLD = 0.18


@pytest.fixture
def model():
    return random_model(tiny_config(num_layers=6), seed=5)


@pytest.fixture
def healthy(model) -> LoadedGates:
    """Token-dependent gates: layer 2 scores around the threshold (input-dependent), layer 3 low."""
    gates = random_gates(model.config, seed=2)
    with torch.no_grad():
        gates[2].fc1.weight.mul_(20.0)
        gates[2].fc2.weight.normal_(0.0, 3.0)
        gates[2].fc2.bias.fill_(-1.5)
        gates[3].fc2.bias.fill_(-4.0)
    metadata = GateMetadata(
        num_layers=model.config.num_layers,
        hidden_size=model.config.hidden_size,
        threshold=THRESHOLD,
        patience=3,
        base_fingerprint=model_fingerprint(model),
    )
    return LoadedGates(gates=gates.eval(), metadata=metadata, sha256=gates_sha256(gates, metadata))


def decode(model, tokenizer, gates: LoadedGates) -> tuple[np.ndarray, np.ndarray]:
    """Greedy completions of the fixed prompts: (scores float [T, L], skipped bool [T, L])."""
    scores, skipped = [], []

    def record(step) -> None:
        scores.append(step.entropies)
        skipped.append(step.skipped)

    model.attach_gates(gates.gates)
    engine = GenerationEngine(
        model,
        tokenizer,
        model_name="m",
        policy=SkipPolicyConfig(threshold=THRESHOLD, patience=3),
        max_batch_size=len(PROMPTS),
        step_hook=record,
    )
    for prompt in PROMPTS:
        engine.submit(tokenizer.encode(prompt), SamplingParams(max_tokens=24, temperature=0.0))
    while engine.has_work():
        engine.step()
    return np.concatenate(scores), np.concatenate(skipped)


def test_the_drill_keeps_the_skip_ratio_and_two_humps_but_loses_token_dependence(model, tokenizer, healthy):
    scores, skipped = decode(model, tokenizer, healthy)
    low = below_threshold(scores, THRESHOLD)
    assert 0.05 < low[:, 2].mean() < 0.95, "the healthy layer 2 should route per token"

    drill = static_gates(model, tokenizer, healthy, protected_layers=None, kv_policy="project")
    static_scores, static_skipped = decode(model, tokenizer, drill.gates)
    # Every token scores each layer's constant.
    np.testing.assert_allclose(static_scores, np.broadcast_to(drill.constants, static_scores.shape), atol=1e-6)
    static_low = below_threshold(static_scores, THRESHOLD)
    assert set(static_low.mean(axis=0).tolist()) <= {0.0, 1.0}  # no layer depends on the token
    routing = routing_from_rows(static_low, static_skipped, min_tokens=1)
    assert routing.verdict == STATIC and routing.token_dependent_share == 0.0
    assert 3 in drill.static_layers and set(drill.static_layers) == set(routing.static_layers)
    # The skip ratio stays within one layer's share of the healthy one; the protected ends never skip.
    assert abs(static_skipped.mean() - skipped.mean()) <= 1 / model.config.num_layers
    assert not static_skipped[:, [0, 5]].any()
    # The constants sit in the two healthy humps, so the pooled histogram stays bimodal.
    assert check_bimodality(np.tile(drill.constants.astype(np.float32), 200), 1000).bimodal


def test_gates_that_record_tau_0_are_measured_at_the_threshold_they_are_served_at(model, tokenizer, healthy):
    # Gates shipped opt-in record tau 0 (full depth: nothing skips, so no layer could be made static);
    # served with --threshold, the drill measures there, as for a file that records that tau.
    full_depth = dataclasses.replace(healthy, metadata=dataclasses.replace(healthy.metadata, threshold=0.0))
    assert static_gates(model, tokenizer, full_depth, protected_layers=None, kv_policy="project").static_layers == ()
    served = static_gates(model, tokenizer, full_depth, protected_layers=None, kv_policy="project", threshold=THRESHOLD)
    own = static_gates(model, tokenizer, healthy, protected_layers=None, kv_policy="project")
    assert 3 in served.static_layers and served.static_layers == own.static_layers
    np.testing.assert_array_equal(served.constants, own.constants)


def test_constants_are_healthy_means_on_the_side_of_tau_each_layer_is_put():
    rng = np.random.default_rng(0)
    # 400 tokens, 5 layers; healthy skip rates 0, 0.9, 0.6, 0.2, 0 (sum 1.7 -> the 2 most skipped static).
    scores = np.column_stack(
        [
            rng.uniform(0.25, 0.35, 400),  # always high
            np.where(rng.random(400) < 0.95, 0.1, 0.3),
            np.where(rng.random(400) < 0.7, 0.12, 0.28),
            np.where(rng.random(400) < 0.3, 0.08, 0.26),
            rng.uniform(0.0, 0.1, 400),  # always low but never skipped (protected)
        ]
    )
    skipped = np.zeros_like(scores, dtype=bool)
    for layer, rate in ((1, 0.9), (2, 0.6), (3, 0.2)):
        skipped[: int(rate * 400), layer] = True
    constants, static = plan_constants(scores, skipped, THRESHOLD)
    low = scores < THRESHOLD
    assert static == (1, 2, 4)  # the two most skipped, and layer 4 (no score at or above tau)
    assert constants[1] == pytest.approx(scores[low[:, 1], 1].mean())
    assert constants[2] == pytest.approx(scores[low[:, 2], 2].mean())
    assert constants[3] == pytest.approx(scores[~low[:, 3], 3].mean())  # kept: its high hump
    assert constants[0] == pytest.approx(scores[:, 0].mean())
    assert constants[4] == pytest.approx(scores[:, 4].mean())  # nothing on its side: overall mean


def test_constant_gates_ignore_their_input_and_hash_like_a_new_file(model, healthy):
    means = np.linspace(0.05, 0.95, model.config.num_layers)  # any constants
    constant = constant_gates(healthy, means)
    inputs = torch.randn(model.config.num_layers, 7, model.config.hidden_size) * 10
    np.testing.assert_allclose(constant.gates.scores(inputs).numpy(), np.tile(means, (7, 1)), atol=1e-6)
    assert constant.sha256 != healthy.sha256 and constant.metadata == healthy.metadata
    assert constant_gates(healthy, means).sha256 == constant.sha256  # deterministic
    assert constant_gates(healthy, means + 0.01).sha256 != constant.sha256
    # The loaded gates are left as they were.
    assert healthy.gates[3].fc2.bias.item() == -4.0 and healthy.gates[2].fc2.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="constants for"):
        constant_gates(healthy, means[:-1])
