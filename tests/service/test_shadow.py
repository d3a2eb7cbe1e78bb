"""The quality guard: full-depth teacher-forced re-checks of finished greedy requests."""

from __future__ import annotations

import time

import httpx
import torch

from inference_shim.runtime.agreement import ShadowJob, ShadowResult, full_depth_agreement
from inference_shim.runtime.checkpoint import load_checkpoint
from inference_shim.runtime.engine import GenerationEngine, SamplingParams
from inference_shim.runtime.skip_policy import SkipPolicyConfig
from tests.service.conftest import MODEL_NAME, sample_sum, tiny_gates


def test_full_depth_output_agrees_with_itself_and_a_changed_token_does_not(tiny_checkpoint):
    torch.set_num_threads(1)
    loaded = load_checkpoint(tiny_checkpoint.path)
    model = loaded.model
    model.attach_gates(tiny_gates(model))
    never_skip = SkipPolicyConfig(threshold=0.0)  # no entropy is below 0: the engine runs full depth
    engine = GenerationEngine(model, loaded.tokenizer, model_name=MODEL_NAME, policy=never_skip)
    prompt = loaded.tokenizer.encode("And God called the light Day")
    result = engine.generate(prompt, SamplingParams(max_tokens=12))
    assert result.layers_skipped == 0
    job = ShadowJob(prompt, result.token_ids)
    assert full_depth_agreement(model, job) == ShadowResult(tokens=12, agreements=12)
    changed = list(result.token_ids)
    changed[5] = (changed[5] + 1) % model.config.vocab_size
    # Teacher forcing feeds the changed token onwards, so only its own position must disagree.
    disagreed = full_depth_agreement(model, ShadowJob(prompt, changed))
    assert disagreed.tokens == 12 and disagreed.agreements <= 11


def shadow_tokens(server) -> tuple[float, float]:
    metrics = server.metrics()
    return (
        sample_sum(metrics, "layerwatch_shadow_tokens_total"),
        sample_sum(metrics, "layerwatch_shadow_agreements_total"),
    )


def settled(server, timeout: float = 30.0) -> tuple[float, float]:
    """Shadow counters once they stop moving (jobs run in the engine thread after the requests)."""
    deadline = time.monotonic() + timeout
    last = shadow_tokens(server)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        current = shadow_tokens(server)
        if current == last:
            return current
        last = current
    raise TimeoutError("shadow counters kept moving")


def test_live_server_rechecks_every_greedy_request(server):  # it runs with --shadow-rate 1
    server.wait_idle()
    tokens_before, agreements_before = settled(server)
    greedy_tokens = 0
    for i, temperature in enumerate((0, 0.8, 0)):
        body = {"model": MODEL_NAME, "prompt": f"the lazy dog {i}", "max_tokens": 10 + i, "temperature": temperature}
        usage = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).json()["usage"]
        greedy_tokens += usage["completion_tokens"] if temperature == 0 else 0
    tokens_after, agreements_after = settled(server)
    assert tokens_after - tokens_before == greedy_tokens  # sampled requests are not re-checked
    assert 0 <= agreements_after - agreements_before <= greedy_tokens
