"""The engine's per-sequence layer counts (the final update's `layer_counts`) against its step records."""

from __future__ import annotations

import numpy as np

from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.skip_policy import SkipPolicyConfig, below_threshold

from .conftest import random_gates, random_model, tiny_config

POLICY = SkipPolicyConfig(threshold=0.5, patience=2)  # random gates score around 0.5: decisions vary


def test_final_update_counts_each_sequences_skips_and_low_scores(tokenizer):
    model = random_model(tiny_config(num_layers=6))
    model.attach_gates(random_gates(model.config))
    records = []
    engine = GenerationEngine(
        model, tokenizer, model_name="tiny", policy=POLICY, max_batch_size=2, step_hook=records.append
    )
    prompts = ([0, 17, 54, 120, 9], [0, 250, 3], [0, 77, 78, 79, 80, 81, 82, 83, 84])
    lengths = {
        engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0.0)): n
        for prompt, n in zip(prompts, (9, 23, 4))
    }
    finals = {}
    while engine.has_work():
        for update in engine.step():
            assert (update.layer_counts is not None) == update.finished
            if update.finished:
                finals[update.sequence_id] = update

    assert set(finals) == set(lengths)
    for sequence_id, update in finals.items():
        rows = [
            (r.skipped[i], r.executed_skipped[i], r.entropies[i])
            for r in records
            for i, s in enumerate(r.sequence_ids.tolist())
            if s == sequence_id
        ]
        skipped, executed_skipped = np.array([row[0] for row in rows]), np.array([row[1] for row in rows])
        entropies = np.array([row[2] for row in rows])
        counts = update.layer_counts
        assert counts.tokens == len(rows) <= lengths[sequence_id]  # EOS may end it early
        assert counts.skipped.tolist() == skipped.sum(axis=0).tolist()  # what its skip rule decided
        assert counts.below_threshold.tolist() == below_threshold(entropies, POLICY.threshold).sum(axis=0).tolist()
        np.testing.assert_allclose(counts.score_sum, entropies.astype(np.float64).sum(axis=0))
        # The client's usage: what ran for it, the batch's depth execution included.
        assert update.layers_skipped == int(executed_skipped.sum())
        assert update.layers_executed + update.layers_skipped == counts.tokens * model.config.num_layers
    assert any(int(u.layer_counts.skipped.sum()) for u in finals.values())  # something was skipped
    assert max(u.layer_counts.tokens for u in finals.values()) > 6


def test_cancelled_sequence_reports_what_it_decoded(tokenizer):
    model = random_model(tiny_config(num_layers=4))
    model.attach_gates(random_gates(model.config))
    engine = GenerationEngine(model, tokenizer, model_name="tiny", policy=POLICY)
    waiting = engine.submit([0, 5], SamplingParams(max_tokens=50))
    engine.cancel(waiting)  # before it was admitted: no decode step
    (update,) = engine.step()
    assert update.finish_reason == "cancelled" and update.layer_counts.tokens == 0
    assert update.layer_counts.skipped.tolist() == [0, 0, 0, 0]

    running = engine.submit([0, 5], SamplingParams(max_tokens=50))
    for _ in range(5):
        engine.step()
    engine.cancel(running)
    (update,) = engine.step()
    assert update.finish_reason == "cancelled" and update.layer_counts.tokens == 5


def test_counts_without_gates_have_nothing_below_threshold(tokenizer):
    model = random_model(tiny_config(num_layers=4))
    engine = GenerationEngine(model, tokenizer, model_name="tiny", policy=POLICY)
    sequence_id = engine.submit([0, 5, 6], SamplingParams(max_tokens=6))
    while engine.has_work():
        final = [u for u in engine.step() if u.sequence_id == sequence_id and u.finished]
    (update,) = final
    assert update.layer_counts.tokens == 6
    assert update.layer_counts.below_threshold.tolist() == [0, 0, 0, 0]  # NaN scores are never below
    assert update.layer_counts.skipped.tolist() == [0, 0, 0, 0]
