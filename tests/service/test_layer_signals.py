"""Layer signals from the shadow check: the rank correlation, the reservoir, the collector, the
shadow job that feeds them, the live shim, and the --shuffle-gates drill."""

from __future__ import annotations

import hashlib
import math
import time

import httpx
import numpy as np
import pytest
import scipy.stats
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inference_shim.runtime.agreement import LayerSignals
from inference_shim.runtime.checkpoint import load_checkpoint
from inference_shim.runtime.gates import gate_derangement, load_gates, shuffle_gates
from inference_shim.service.layer_signals import LayerSignalsCollector
from inference_shim.service.metrics import ShadowMetrics
from inference_shim.service.shadow import ShadowChecker
from inference_shim.service.shim import ServeSettings, ShimService
from layerwatch.gate_importance import LayerSignalStats, spearman
from tests.service.conftest import MODEL_NAME, NUM_LAYERS, sample_sum, tiny_gates, uniform_record

# --- Spearman's rank correlation ------------------------------------------------------------------------


def test_spearman_agrees_with_scipy_with_and_without_ties():
    rng = np.random.default_rng(0)
    x = rng.normal(size=500)
    y = x + rng.normal(size=500)
    assert spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y).statistic, abs=1e-12)
    tied_x, tied_y = np.round(x), np.round(y * 2) / 2  # many ties on both sides
    assert spearman(tied_x, tied_y) == pytest.approx(scipy.stats.spearmanr(tied_x, tied_y).statistic, abs=1e-12)
    # By hand: ranks of x = (0, 1.5, 1.5, 3), of y = (0, 1, 2, 3) -> Pearson of the ranks.
    assert spearman([1, 2, 2, 3], [10, 20, 30, 40]) == pytest.approx(0.9486833, abs=1e-7)


def test_spearman_ranks_and_its_edge_cases():
    x = np.arange(100.0)
    assert spearman(x, np.exp(x / 10)) == pytest.approx(1.0)  # any monotone relation is 1
    assert spearman(x, -(x**3)) == pytest.approx(-1.0)
    assert spearman(np.full(100, 0.3), x) == 0.0  # a gate that scores everything alike tracks nothing
    assert math.isnan(spearman([1.0], [2.0]))
    with pytest.raises(ValueError):
        spearman([1, 2, 3], [1, 2])


# --- the statistics and their collector ------------------------------------------------------------------


def signals(update, kl=None, gate=None) -> LayerSignals:
    update = np.asarray(update, dtype=np.float32)
    return LayerSignals(
        relative_update=update,
        attention_kl=np.asarray(kl if kl is not None else np.zeros_like(update), dtype=np.float32),
        gate_score=None if gate is None else np.asarray(gate, dtype=np.float32),
    )


def test_sums_count_finite_tokens_per_layer_and_the_reservoir_keeps_the_last_pairs():
    stats = LayerSignalStats(num_layers=2, reservoir=6)
    stats.observe(signals([[1.0, 2.0], [3.0, np.nan]], kl=[[0.5, 0.1], [0.5, 0.1]], gate=[[0.1, 0.2], [0.3, 0.4]]))
    s = stats.snapshot()
    assert s.tokens.tolist() == [2, 1]  # the NaN update is left out of layer 1
    assert s.relative_update_sum.tolist() == [4.0, 2.0] and s.attention_kl_sum.tolist() == pytest.approx([1.0, 0.1])
    assert (s.samples, s.correlation) == (3, None)  # absent until the reservoir is full
    # 3 more pairs fill it; then the oldest go first. Pairs (gate, update) in token-then-layer order.
    stats.observe(signals([[4.0, 5.0], [6.0, 7.0]], gate=[[0.5, 0.6], [0.7, 0.8]]))
    s = stats.snapshot()
    assert s.samples == 6
    # Held: (0.2,2) (0.3,3) (0.5,4) (0.6,5) (0.7,6) (0.8,7): perfectly concordant.
    assert s.correlation == pytest.approx(1.0)
    stats.observe(signals([[1.0, 0.5]], gate=[[0.9, 0.95]]))  # the highest gates on the smallest updates
    held_gates = [0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
    held_updates = [4.0, 5.0, 6.0, 7.0, 1.0, 0.5]
    assert stats.snapshot().correlation == pytest.approx(scipy.stats.spearmanr(held_gates, held_updates).statistic)
    stats.observe(signals(np.ones((10, 2)), gate=np.tile([0.1, 0.9], (10, 1))))  # more than the reservoir at once
    assert stats.snapshot().correlation == 0.0  # updates all alike: no rank information


def test_without_gates_only_the_sums_move():
    stats = LayerSignalStats(num_layers=3, reservoir=4)
    stats.observe(signals(np.ones((5, 3))))
    s = stats.snapshot()
    assert s.tokens.tolist() == [5, 5, 5] and s.samples == 0 and s.correlation is None
    with pytest.raises(ValueError, match="for 3 layers"):
        stats.observe(signals(np.ones((5, 2))))


def scrape(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_collector_exposes_sums_per_layer_and_the_correlation_once_the_reservoir_is_full():
    stats = LayerSignalStats(num_layers=2, reservoir=4)
    collector = LayerSignalsCollector(stats, "m")
    stats.observe(signals([[0.5, 0.25]], kl=[[1.0, 2.0]], gate=[[0.3, 0.1]]))
    samples = scrape(collector)
    assert samples[("layerwatch_layer_signal_tokens_total", (("layer", "1"), ("model_name", "m")))] == 1
    assert samples[("layerwatch_layer_relative_update_sum_total", (("layer", "0"), ("model_name", "m")))] == 0.5
    assert samples[("layerwatch_layer_attention_kl_sum_total", (("layer", "1"), ("model_name", "m")))] == 2.0
    assert samples[("layerwatch_gate_importance_samples", (("model_name", "m"),))] == 2
    assert not any(name == "layerwatch_gate_importance_correlation" for name, _ in samples)
    stats.observe(signals([[0.5, 0.25]], gate=[[0.3, 0.1]]))
    samples = scrape(collector)
    assert samples[("layerwatch_gate_importance_correlation", (("model_name", "m"),))] == pytest.approx(1.0)
    assert samples[("layerwatch_gate_importance_samples", (("model_name", "m"),))] == 4


# --- the shadow job feeds them --------------------------------------------------------------------------


def test_a_shadow_job_measures_every_layer_of_every_decode_position(tiny_checkpoint):
    torch.set_num_threads(1)
    model = load_checkpoint(tiny_checkpoint.path).model
    model.attach_gates(tiny_gates(model))
    stats = LayerSignalStats(NUM_LAYERS, reservoir=8 * NUM_LAYERS)
    checker = ShadowChecker(model, ShadowMetrics(CollectorRegistry(), "m"), rate=1.0, signals=stats)
    checker.offer([0, 5, 6, 7], [8, 9, 10, 11, 12], uniform_record(5))
    checker.run_one()
    s = stats.snapshot()
    assert s.tokens.tolist() == [5] * NUM_LAYERS and s.samples == 5 * NUM_LAYERS
    assert (s.relative_update_sum > 0).all() and (s.attention_kl_sum >= 0).all()
    # The tiny gates score layers 1-3 low and the others high; the reservoir is not full yet.
    assert s.correlation is None
    checker.offer([0, 5], [8, 9, 10], uniform_record(3))
    checker.run_one()
    assert stats.snapshot().correlation is not None


# --- the live shim ------------------------------------------------------------------------------------


def settled(server, name: str, timeout: float = 30.0) -> float:
    """A counter's value once it stops moving (shadow jobs run after the requests)."""
    deadline = time.monotonic() + timeout
    last = sample_sum(server.metrics(), name)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        current = sample_sum(server.metrics(), name)
        if current == last:
            return current
        last = current
    raise TimeoutError(f"{name} kept moving")


def test_live_shim_measures_each_shadow_checked_token_on_every_layer(server):  # --shadow-rate 1
    server.wait_idle()
    tokens_before = settled(server, "layerwatch_shadow_tokens_total")
    before = server.metrics()
    body = {"model": MODEL_NAME, "prompt": "the face of the deep", "max_tokens": 12, "temperature": 0}
    httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).raise_for_status()
    checked = settled(server, "layerwatch_shadow_tokens_total") - tokens_before
    after = server.metrics()
    assert checked == 12
    for layer in map(str, range(NUM_LAYERS)):
        measured = sample_sum(after, "layerwatch_layer_signal_tokens_total", layer=layer) - sample_sum(
            before, "layerwatch_layer_signal_tokens_total", layer=layer
        )
        assert measured == checked
        update = sample_sum(after, "layerwatch_layer_relative_update_sum_total", layer=layer) - sample_sum(
            before, "layerwatch_layer_relative_update_sum_total", layer=layer
        )
        assert update > 0
    assert sample_sum(after, "layerwatch_gate_importance_samples") >= 12 * NUM_LAYERS


# --- the --shuffle-gates drill --------------------------------------------------------------------------


def test_gate_derangement_moves_every_gate():
    for layers in range(2, 40):
        source = gate_derangement(layers)
        assert sorted(source) == list(range(layers)) and all(s != layer for layer, s in enumerate(source))
    with pytest.raises(ValueError):
        gate_derangement(1)


def test_shuffle_gates_serves_the_file_gates_on_other_layers(in_process, tiny_checkpoint):
    file_sha = hashlib.sha256(tiny_checkpoint.gates_path.read_bytes()).hexdigest()
    server = in_process(shuffle_gates=True)
    [labels] = [dict(ls) for (name, ls), _ in server.metrics().items() if name == "layerwatch_model_info"]
    assert labels["gates_sha256"] != file_sha
    served = server.service.model.gates
    original = load_gates(tiny_checkpoint.gates_path, server.service.model).gates
    for layer, source in enumerate(gate_derangement(NUM_LAYERS)):
        for name, tensor in served[layer].state_dict().items():
            assert torch.equal(tensor, original[source].state_dict()[name])
    again = shuffle_gates(load_gates(tiny_checkpoint.gates_path, server.service.model))
    assert again.sha256 == labels["gates_sha256"]  # a fixed derangement: the same hash every time
    assert server.service.gate_watcher is None  # a file watch would undo the drill


def test_reset_and_shuffle_exclude_each_other(tiny_checkpoint):
    settings = ServeSettings(model_dir=tiny_checkpoint.path, reset_gates=True, shuffle_gates=True)
    with pytest.raises(ValueError, match="exclude each other"):
        ShimService.load(settings)
