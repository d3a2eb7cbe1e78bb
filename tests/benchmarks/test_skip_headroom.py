"""benchmarks/skip_headroom.py on a tiny model: its policies skip what they say, and a skip it
executes through the full-sequence forward is the skip the serving decode step executes."""

from __future__ import annotations

import torch

from benchmarks.skip_headroom import PREFILL, log_probs, pairs_policy, per_token_policy, skip_costs, static_policy
from layerwatch.inference_shim.runtime.model import KVCache
from tests.model.conftest import random_model, tiny_config

LAYERS, WINDOWS, LENGTH = 5, 2, PREFILL + 6
SKIPPABLE = [1, 2, 3]  # the first and last protected, as the skip policy's default


def setup():
    model = random_model(tiny_config(num_layers=LAYERS)).double()  # the paths then differ by rounding only
    windows = torch.randint(2, model.config.vocab_size, (WINDOWS, LENGTH), generator=torch.Generator().manual_seed(0))
    full = log_probs(model, windows)
    return model, windows, full, skip_costs(model, windows, full, SKIPPABLE)


def test_each_policy_skips_its_count_per_decoded_token_and_never_a_protected_layer_or_the_prefill():
    _, _, _, costs = setup()
    assert costs[SKIPPABLE, :, PREFILL:].isfinite().all() and (costs[SKIPPABLE, :, PREFILL:] >= -1e-6).all()
    for count in (1, 2):
        static, per_token, pairs = (
            static_policy(costs, count),
            per_token_policy(costs, count),
            pairs_policy(costs, count),
        )
        for keep in (static, per_token, pairs):
            skipped = keep == 0
            assert not skipped[:, :, :PREFILL].any() and not skipped[[0, LAYERS - 1]].any()
            assert skipped.sum() == count * WINDOWS * (LENGTH - PREFILL)
        assert ((per_token == 0).sum(0)[:, PREFILL:] == count).all()
        static_layers = (static == 0).any(-1).any(-1).nonzero().flatten().tolist()
        assert len(static_layers) == count and ((static[static_layers, :, PREFILL:] == 0).all())
        # pairs: the cheapest pairs of the whole text, wherever they lie
        assert costs[pairs == 0].max() <= costs[SKIPPABLE, :, PREFILL:][pairs[SKIPPABLE, :, PREFILL:] == 1].min()


def test_a_skip_executed_by_the_forward_is_the_skip_the_decode_step_executes():
    """Teacher-forced decode through decode_step (the engine's step, `project` KV policy) with the
    policy's mask as its run mask gives the log-probabilities the benchmark's forward gives."""
    model, windows, full, costs = setup()
    keep = per_token_policy(costs, 2)
    skipped = log_probs(model, windows, keep)
    assert (skipped - full).abs().max() > 1e-3  # the skips change the predictions: the comparison can fail
    cache = KVCache(model.config, WINDOWS, LENGTH, torch.float64, "cpu")
    for slot in range(WINDOWS):
        model.prefill(windows[slot, :PREFILL], cache, slot)
    for position in range(PREFILL, LENGTH):
        run_mask = keep[:, :, position].T.numpy().astype(bool)  # [W, L]
        logits, _ = model.decode_step(windows[:, position], cache, list(range(WINDOWS)), [position] * WINDOWS, run_mask)
        # float64: summation order apart, as tests/model/test_skipping.py argues for its 1e-9
        assert (torch.log_softmax(logits, dim=-1) - skipped[:, position]).abs().max().item() <= 1e-9
