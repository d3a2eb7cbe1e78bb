"""The quality guard: full-depth teacher-forced checks of requests at any temperature, in the service."""

from __future__ import annotations

import time

import httpx
import torch
from prometheus_client import CollectorRegistry

from layerwatch.catalog import METRICS
from layerwatch.inference_shim.runtime.agreement import SHADOW_TOP_K, ShadowJob, full_depth_agreement
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.inference_shim.service.metrics import SHADOW_OUTCOMES, ShadowMetrics
from layerwatch.inference_shim.service.shadow import QUEUE_LIMIT, ShadowChecker
from layerwatch.skip_policy import SkipPolicyConfig
from tests.service.conftest import MODEL_NAME, NUM_LAYERS, tiny_gates, uniform_record
from tests.support import sample_sum

SHADOW_COUNTERS = (
    "layerwatch_shadow_tokens_total",
    "layerwatch_shadow_agreements_total",
    "layerwatch_shadow_kl_nats_total",
    "layerwatch_shadow_reverse_kl_nats_total",
)


def test_full_depth_output_agrees_with_itself_and_a_changed_token_does_not(tiny_checkpoint):
    torch.set_num_threads(1)
    loaded = load_checkpoint(tiny_checkpoint.path)
    model = loaded.model
    model.attach_gates(tiny_gates(model))
    never_skip = SkipPolicyConfig(threshold=0.0)  # no entropy is below 0: the engine runs full depth
    engine = GenerationEngine(model, loaded.tokenizer, model_name=MODEL_NAME, policy=never_skip)
    prompt = loaded.tokenizer.encode("And God called the light Day")
    result = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=4), record=True)
    assert result.layers_skipped == 0 and result.gated_record is not None
    checked = full_depth_agreement(model, ShadowJob(prompt, result.token_ids, result.gated_record))
    assert checked.tokens == checked.agreements == 12 and checked.kl_nats < 12e-6
    changed = list(result.token_ids)
    changed[5] = (changed[5] + 1) % model.config.vocab_size
    # Teacher forcing feeds the changed token onwards: the full-depth distributions after it are not
    # the ones the gated model recorded, and the comparison says so.
    disagreed = full_depth_agreement(model, ShadowJob(prompt, changed, result.gated_record))
    assert disagreed.tokens == 12 and disagreed.agreements <= 11 and disagreed.kl_nats > 0.01


def test_the_catalog_names_the_record_size_the_runtime_keeps():
    (spec,) = [m for m in METRICS if m.name == "layerwatch_shadow_kl_nats_total"]
    assert f"K = {SHADOW_TOP_K}" in spec.help


def test_a_full_queue_counts_the_requests_it_turns_away(tiny_checkpoint):
    model = load_checkpoint(tiny_checkpoint.path).model
    registry = CollectorRegistry()
    checker = ShadowChecker(model, ShadowMetrics(registry, "m"), rate=1.0)
    for _ in range(QUEUE_LIMIT + 2):
        checker.offer([0, 5], [8, 9], uniform_record(2))
    assert checker.pending() == QUEUE_LIMIT
    checker.run_one()
    count = {
        o: registry.get_sample_value("layerwatch_shadow_requests_total", {"model_name": "m", "outcome": o})
        for o in SHADOW_OUTCOMES
    }
    assert count == {"checked": 1, "queue_full": 2, "failed": 0, "full_depth": 0, "no_output": 0}
    checker.offer([0, 5], [8, 9], uniform_record(3))  # a record that does not match its tokens
    while checker.pending():
        checker.run_one()
    assert registry.get_sample_value("layerwatch_shadow_requests_total", {"model_name": "m", "outcome": "failed"}) == 1


# --- the live shim ---------------------------------------------------------------------------------


def shadow_counters(server) -> tuple[float, ...]:
    metrics = server.metrics()
    return tuple(sample_sum(metrics, name) for name in SHADOW_COUNTERS)


def settled(server, timeout: float = 30.0) -> tuple[float, ...]:
    """Shadow counters once they stop moving (jobs run in the engine thread after the requests)."""
    deadline = time.monotonic() + timeout
    last = shadow_counters(server)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        current = shadow_counters(server)
        if current == last:
            return current
        last = current
    raise TimeoutError("shadow counters kept moving")


def checks_done(server, checked: float, timeout: float = 30.0) -> tuple[float, ...]:
    """Shadow counters once `checked` requests in all count as checked: the checks run in the engine
    thread after their requests, as long as a loaded machine makes them take (counters unchanged
    for 0.5 s, as settled() sees them, is no proof that none is running), and a check's counters
    move before its request counts as checked (ShadowMetrics.observe)."""
    deadline = time.monotonic() + timeout
    while sample_sum(metrics := server.metrics(), "layerwatch_shadow_requests_total", outcome="checked") < checked:
        assert time.monotonic() < deadline, f"fewer than {checked:g} requests shadow-checked within {timeout:g} s"
        time.sleep(0.05)
    return tuple(sample_sum(metrics, name) for name in SHADOW_COUNTERS)


SAMPLED_BODIES = (  # what chat clients send: no greedy request among them
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5},
    {"temperature": 0.7, "logit_bias": {"40": 5}},
)


def test_live_server_checks_sampled_requests_and_measures_their_layers(server):  # it runs with --shadow-rate 1
    """Sampled-only traffic: every generated token is shadow-checked (agreement and quality cost), every
    one measured on every layer (the calibration samples), and each request counted as checked."""
    server.wait_idle()
    before, metrics_before = settled(server), server.metrics()
    generated = 0
    for i, sampling in enumerate(SAMPLED_BODIES):
        body = {"model": MODEL_NAME, "prompt": f"the lazy dog {i}", "max_tokens": 10 + i, "seed": i, **sampling}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        generated += response.raise_for_status().json()["usage"]["completion_tokens"]
    checked_before = sample_sum(metrics_before, "layerwatch_shadow_requests_total", outcome="checked")
    done = checks_done(server, checked_before + len(SAMPLED_BODIES))
    tokens, agreements, kl, reverse = (a - b for a, b in zip(done, before))
    after = server.metrics()
    assert tokens == generated == sum(10 + i for i in range(len(SAMPLED_BODIES)))
    assert 0 <= agreements <= tokens
    assert kl > 0 and reverse > 0  # the tiny gates skip layers 1-2: the gated distributions differ
    checked = sample_sum(after, "layerwatch_shadow_requests_total", outcome="checked") - sample_sum(
        metrics_before, "layerwatch_shadow_requests_total", outcome="checked"
    )
    assert checked == len(SAMPLED_BODIES)
    for layer in map(str, range(NUM_LAYERS)):
        measured = sample_sum(after, "layerwatch_layer_signal_tokens_total", layer=layer) - sample_sum(
            metrics_before, "layerwatch_layer_signal_tokens_total", layer=layer
        )
        assert measured == tokens
    assert (
        sample_sum(after, "layerwatch_gate_importance_samples")
        > sample_sum(metrics_before, "layerwatch_gate_importance_samples")
        or sample_sum(after, "layerwatch_gate_importance_samples") == 4096
    )
