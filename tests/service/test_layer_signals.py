"""Layer signals from the shadow check: the rank correlations (within each layer and between layers),
the per-layer buffers, the collector, the shadow job that feeds them, the live shim, and the
--shuffle-gates and --scramble-gates drills."""

from __future__ import annotations

import hashlib
import math
import time

import httpx
import numpy as np
import pytest
import scipy.stats
import torch
from prometheus_client import CollectorRegistry

from layerwatch.catalog import GATE_LAYER_SAMPLES
from layerwatch.gate_importance import LayerSignalStats, average_ranks_rows, spearman, spearman_rows
from layerwatch.inference_shim.runtime.agreement import LayerSignals, ShadowJob, full_depth_agreement
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.gates import (
    feature_permutation,
    gate_derangement,
    load_gates,
    scramble_gates,
    shuffle_gates,
)
from layerwatch.inference_shim.service.layer_signals import LayerSignalsCollector
from layerwatch.inference_shim.service.metrics import ShadowMetrics
from layerwatch.inference_shim.service.shadow import ShadowChecker
from layerwatch.inference_shim.service.shim import ServeSettings, ShimService, export_gates
from tests.service.conftest import MODEL_NAME, NUM_LAYERS, tiny_gates, uniform_record
from tests.service.test_shadow import checks_done
from tests.support import collector_samples, sample_sum

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


def test_spearman_rows_is_each_rows_own_correlation():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 300))
    y = x * np.arange(5)[:, None] + rng.normal(size=(5, 300))
    x[3] = np.round(x[3])  # ties within one row, not across rows
    y[4] = 7.0  # a constant row
    expected = [scipy.stats.spearmanr(x[i], y[i]).statistic for i in range(4)] + [0.0]
    assert spearman_rows(x, y) == pytest.approx(expected, abs=1e-12)
    assert average_ranks_rows(x) == pytest.approx(np.stack([scipy.stats.rankdata(row) - 1 for row in x]))
    assert np.isnan(spearman_rows(x[:, :1], y[:, :1])).all()
    with pytest.raises(ValueError):
        spearman_rows(x, y[:, :10])


# --- the statistics and their collector ------------------------------------------------------------------


def signals(update, kl=None, gate=None) -> LayerSignals:
    update = np.asarray(update, dtype=np.float32)
    return LayerSignals(
        relative_update=update,
        attention_kl=np.asarray(kl if kl is not None else np.zeros_like(update), dtype=np.float32),
        gate_score=None if gate is None else np.asarray(gate, dtype=np.float32),
    )


def layered_passes(gate_rank_tokens: bool, passes: int = 40, positions: int = 33, layers: int = 8, seed: int = 0):
    """Shadow passes where layer l's update is large for deep layers and, on each token, proportional to
    a per-token importance. Gates score each layer at its own level (the between-layer ordering right);
    their token part either follows the importance of the token each score decides (the next one)
    or is random (the blindness of a pooled correlation)."""
    rng = np.random.default_rng(seed)
    level = np.linspace(0.05, 0.45, layers)  # layer l's typical update (and healthy gate level)
    for _ in range(passes):
        importance = rng.lognormal(0.0, 0.5, size=(positions, layers))
        update = level * importance
        token = np.roll(importance, -1, axis=0) if gate_rank_tokens else rng.lognormal(0.0, 0.5, size=importance.shape)
        gate = level + 0.05 * np.log(token)
        yield signals(update, gate=gate)


def test_gates_that_rank_layers_right_and_tokens_at_random_score_near_zero_within_layers():
    random_tokens = LayerSignalStats(num_layers=8, reservoir=512)
    ranked_tokens = LayerSignalStats(num_layers=8, reservoir=512)
    pooled_gate, pooled_update = [], []
    for passed in layered_passes(gate_rank_tokens=False):
        random_tokens.observe(passed)
        pooled_gate.append(passed.gate_score[:-1])
        pooled_update.append(passed.relative_update[1:])
    for passed in layered_passes(gate_rank_tokens=True):
        ranked_tokens.observe(passed)
    blind, healthy = random_tokens.snapshot(), ranked_tokens.snapshot()
    # The pooled (token, layer) correlation the shim exported before: high, layer levels dominate it.
    assert spearman(np.concatenate(pooled_gate), np.concatenate(pooled_update)) > 0.6
    assert blind.layer_order_correlation == pytest.approx(1.0) == healthy.layer_order_correlation
    # Within each layer: noise around 0 (1/sqrt(512) = 0.044 per layer) against a clear value.
    assert blind.correlation is not None and abs(blind.correlation) < 0.05
    assert np.abs(blind.layer_correlation).max() < 0.15
    assert healthy.correlation is not None and healthy.correlation > 0.9
    assert blind.counted_layers == healthy.counted_layers == 8


def test_a_pair_is_a_score_and_the_update_of_the_next_position():
    stats = LayerSignalStats(num_layers=1, reservoir=4)
    update = np.array([[5.0], [1.0], [2.0], [3.0], [4.0]])
    stats.observe(signals(update, gate=[[0.1], [0.2], [0.3], [0.4], [0.9]]))  # score i follows update i + 1
    s = stats.snapshot()
    assert s.layer_samples.tolist() == [4] and s.correlation == pytest.approx(1.0)
    # Paired with its own position instead, the same scores would rank the updates 5, 1, 2, 3, 4 badly.
    assert spearman([0.1, 0.2, 0.3, 0.4], [5.0, 1.0, 2.0, 3.0]) < 0.5


def test_sums_count_finite_tokens_and_each_layer_keeps_its_last_finite_pairs():
    stats = LayerSignalStats(num_layers=2, reservoir=4)
    stats.observe(
        signals(
            [[1.0, 2.0], [3.0, np.nan], [4.0, 5.0]],
            kl=[[0.5, 0.1], [0.5, 0.1], [0.5, 0.1]],
            gate=[[0.1, 0.2], [np.inf, 0.4], [0.5, 0.6]],
        )
    )
    s = stats.snapshot()
    assert s.tokens.tolist() == [3, 2]  # the NaN update is left out of layer 1
    assert s.relative_update_sum.tolist() == [8.0, 7.0] and s.attention_kl_sum.tolist() == pytest.approx([1.5, 0.2])
    # Layer 0: (0.1, 3) kept, (inf, 4) left out; layer 1: (0.2, NaN) left out, (0.4, 5) kept.
    assert s.layer_samples.tolist() == [1, 1] and s.samples == 2
    assert np.isnan(s.layer_correlation).all() and s.correlation is None  # absent until a buffer is full
    stats.observe(signals(np.arange(10.0).reshape(5, 2), gate=np.linspace(0.1, 0.9, 10).reshape(5, 2)))
    s = stats.snapshot()
    assert s.layer_samples.tolist() == [4, 4]  # full: the oldest pairs went first
    assert s.layer_correlation == pytest.approx([1.0, 1.0]) and s.correlation == pytest.approx(1.0)
    # The highest scores now on the smallest updates: the layer's correlation turns.
    stats.observe(signals([[9.0, 9.0], [0.0, 9.0], [0.0, 9.0]], gate=[[0.99, 0.5], [0.98, 0.5], [0.97, 0.5]]))
    held_gates, held_updates = [0.4556, 0.6333, 0.99, 0.98], [6.0, 8.0, 0.0, 0.0]
    expected = scipy.stats.spearmanr(held_gates, held_updates).statistic
    assert stats.snapshot().layer_correlation[0] == pytest.approx(expected)


def test_gates_that_barely_vary_are_left_out_of_the_headline():
    rng = np.random.default_rng(3)
    stats = LayerSignalStats(num_layers=3, reservoir=64)
    update = rng.lognormal(size=(65, 3))
    gate = np.stack(
        [
            np.full(65, 0.3) + 1e-5 * rng.normal(size=65),  # a protected layer's gate: constant up to noise
            np.roll(update[:, 1], -1) / 10,  # follows the next update
            np.full(65, 0.1),  # exactly constant (ties everywhere)
        ],
        axis=1,
    )
    stats.observe(signals(update, gate=gate))
    s = stats.snapshot()
    assert s.layer_samples.tolist() == [64, 64, 64]  # measured ...
    assert np.isnan(s.layer_correlation[[0, 2]]).all() and s.layer_correlation[1] == pytest.approx(1.0)
    assert (s.counted_layers, s.correlation) == (1, pytest.approx(1.0))  # ... but only layer 1 counts
    # Every gate constant: no headline at all (not 0, which would page).
    flat = LayerSignalStats(num_layers=2, reservoir=8)
    flat.observe(signals(rng.lognormal(size=(9, 2)), gate=np.full((9, 2), 0.2)))
    assert flat.snapshot().correlation is None and flat.snapshot().counted_layers == 0


def test_correlations_are_computed_once_per_pass_not_per_scrape():
    stats = LayerSignalStats(num_layers=2, reservoir=4)
    stats.observe(signals(np.arange(10.0).reshape(5, 2), gate=np.linspace(0.1, 0.9, 10).reshape(5, 2)))
    first, second = stats.snapshot(), stats.snapshot()
    assert first.layer_correlation is second.layer_correlation  # the cached result, not a recomputation
    stats.observe(signals([[1.0, 1.0], [2.0, 2.0]], gate=[[0.5, 0.5], [0.5, 0.5]]))
    assert stats.snapshot().layer_correlation is not first.layer_correlation


def test_without_gates_only_the_sums_move():
    stats = LayerSignalStats(num_layers=3, reservoir=4)
    stats.observe(signals(np.ones((5, 3))))
    s = stats.snapshot()
    assert s.tokens.tolist() == [5, 5, 5] and s.samples == 0 and s.correlation is None
    assert s.layer_order_correlation is None
    with pytest.raises(ValueError, match="for 3 layers"):
        stats.observe(signals(np.ones((5, 2))))
    with pytest.raises(ValueError, match="gate scores of shape"):
        stats.observe(signals(np.ones((5, 3)), gate=np.ones((4, 3))))


def test_collector_exposes_each_layer_once_measured_and_the_headline_over_the_varying_gates():
    stats = LayerSignalStats(num_layers=3, reservoir=4)
    collector = LayerSignalsCollector(stats, "m")
    stats.observe(signals([[0.5, 0.25, 1.0], [0.5, 0.25, 2.0]], kl=[[1.0, 2.0, 0.0]] * 2, gate=[[0.3, 0.1, 0.2]] * 2))
    samples = collector_samples(collector)

    def layer(name: str, l: int):
        return samples.get((name, (("layer", str(l)), ("model_name", "m"))))

    assert layer("layerwatch_layer_signal_tokens_total", 1) == 2
    assert layer("layerwatch_layer_relative_update_sum_total", 0) == 1.0
    assert layer("layerwatch_layer_attention_kl_sum_total", 1) == 4.0
    assert [layer("layerwatch_gate_layer_importance_samples", l) for l in range(3)] == [1, 1, 1]
    assert samples[("layerwatch_gate_importance_samples", (("model_name", "m"),))] == 3
    names = {name for name, _ in samples}
    for absent in (  # buffers not full yet
        "layerwatch_gate_layer_importance_correlation",
        "layerwatch_gate_importance_correlation",
        "layerwatch_gate_layer_order_correlation",
    ):
        assert absent not in names
    assert samples[("layerwatch_gate_importance_layers", (("model_name", "m"),))] == 0

    # Layers 0 and 2 rank their tokens (0 ascending, 2 descending); layer 1's gate is constant.
    stats.observe(
        signals(
            [[0.0, 0.5, 9.0], [1.0, 0.5, 4.0], [2.0, 0.5, 3.0], [3.0, 0.5, 2.0], [4.0, 0.5, 1.0]],
            gate=[[0.1, 0.2, 0.1], [0.2, 0.2, 0.2], [0.3, 0.2, 0.3], [0.4, 0.2, 0.4], [0.5, 0.2, 0.5]],
        )
    )
    samples = collector_samples(collector)
    correlations = {
        dict(labels)["layer"]: value
        for (name, labels), value in samples.items()
        if name == "layerwatch_gate_layer_importance_correlation"
    }
    assert correlations == {"0": pytest.approx(1.0), "2": pytest.approx(-1.0)}  # bounded: one per layer at most
    assert samples[("layerwatch_gate_importance_correlation", (("model_name", "m"),))] == pytest.approx(0.0)
    assert samples[("layerwatch_gate_importance_layers", (("model_name", "m"),))] == 2
    assert samples[("layerwatch_gate_importance_samples", (("model_name", "m"),))] == 12
    assert ("layerwatch_gate_layer_order_correlation", (("model_name", "m"),)) in samples


# --- the shadow job feeds them --------------------------------------------------------------------------


def test_a_shadow_job_measures_every_layer_of_every_decode_position(tiny_checkpoint):
    torch.set_num_threads(1)
    model = load_checkpoint(tiny_checkpoint.path).model
    model.attach_gates(tiny_gates(model))
    stats = LayerSignalStats(NUM_LAYERS, reservoir=6)
    checker = ShadowChecker(model, ShadowMetrics(CollectorRegistry(), "m"), rate=1.0, signals=stats)
    checker.offer([0, 5, 6, 7], [8, 9, 10, 11, 12], uniform_record(5))
    checker.run_one()
    s = stats.snapshot()
    # 5 decode positions per layer, 4 (score, next update) pairs: the buffers (6) are not full yet.
    assert s.tokens.tolist() == [5] * NUM_LAYERS and s.layer_samples.tolist() == [4] * NUM_LAYERS
    assert (s.relative_update_sum > 0).all() and (s.attention_kl_sum >= 0).all()
    assert np.isnan(s.layer_correlation).all() and s.correlation is None
    checker.offer([0, 5], [8, 9, 10], uniform_record(3))
    checker.run_one()
    # Full: the same statistics as the two passes folded in by hand.
    by_hand = LayerSignalStats(NUM_LAYERS, reservoir=6)
    for prompt, generated in (([0, 5, 6, 7], [8, 9, 10, 11, 12]), ([0, 5], [8, 9, 10])):
        job = ShadowJob(prompt, generated, uniform_record(len(generated)))
        signals = full_depth_agreement(model, job, layer_signals=True).layer_signals
        assert signals is not None
        by_hand.observe(signals)
    fed, expected = stats.snapshot(), by_hand.snapshot()
    assert fed.layer_samples.tolist() == [6] * NUM_LAYERS
    np.testing.assert_array_equal(fed.layer_correlation, expected.layer_correlation)
    assert fed.correlation == expected.correlation and fed.layer_order_correlation == expected.layer_order_correlation


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
    checks_done(server, sample_sum(before, "layerwatch_shadow_requests_total", outcome="checked") + 1)
    checked = sample_sum(server.metrics(), "layerwatch_shadow_tokens_total") - tokens_before
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
    # 12 positions per layer, 11 (score, next update) pairs each.
    assert sample_sum(after, "layerwatch_gate_importance_samples") >= 11 * NUM_LAYERS
    for layer in map(str, range(NUM_LAYERS)):
        assert 11 <= sample_sum(after, "layerwatch_gate_layer_importance_samples", layer=layer) <= GATE_LAYER_SAMPLES


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


@pytest.mark.parametrize("other", ["reset_gates", "static_gates", "shuffle_gates"])
def test_the_gate_drills_exclude_each_other(tiny_checkpoint, other):
    settings = ServeSettings(model_dir=tiny_checkpoint.path, scramble_gates=True, **{other: True})
    flag = "--" + other.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag} and --scramble-gates exclude each other"):
        ShimService.load(settings)
    with pytest.raises(ValueError, match="exclude each other"):
        ShimService.load(ServeSettings(model_dir=tiny_checkpoint.path, reset_gates=True, shuffle_gates=True))


@pytest.mark.parametrize("drill", ["shuffle_gates", "scramble_gates", "reset_gates"])
def test_export_gates_writes_the_gate_file_of_what_the_drill_serves(in_process, tiny_checkpoint, tmp_path, drill):
    """`serve --export-gates` (how `demo --engine vllm` gives vLLM's plugin a drill's gates) writes the gates the
    shim serves under the same drill flag: the file's sha256 is the served gates_sha256, and it differs from
    the healthy file's."""
    dest = tmp_path / "drill.safetensors"
    sha = export_gates(ServeSettings(model_dir=tiny_checkpoint.path, export_gates=dest, **{drill: True}))
    server = in_process(**{drill: True})
    [labels] = [dict(ls) for (name, ls), _ in server.metrics().items() if name == "layerwatch_model_info"]
    assert sha == hashlib.sha256(dest.read_bytes()).hexdigest() == labels["gates_sha256"]
    assert sha != tiny_checkpoint.gates_sha256
    load_gates(dest, server.service.model)  # a gate file of this model


def test_export_gates_without_gates_is_refused(tiny_checkpoint, tmp_path):
    settings = ServeSettings(model_dir=tiny_checkpoint.path, no_gates=True, export_gates=tmp_path / "g.safetensors")
    with pytest.raises(ValueError, match="--export-gates"):
        export_gates(settings)


# --- the --scramble-gates drill -------------------------------------------------------------------------


def test_feature_permutation_moves_every_feature_and_is_fixed():
    for width in (2, 3, 128, 129):
        source = feature_permutation(width)
        assert sorted(source) == list(range(width)) and all(s != j for j, s in enumerate(source))
        assert feature_permutation(width) == source
    with pytest.raises(ValueError):
        feature_permutation(1)


def test_scramble_gates_reads_permuted_features_with_the_same_biases(in_process, tiny_checkpoint):
    file_sha = hashlib.sha256(tiny_checkpoint.gates_path.read_bytes()).hexdigest()
    server = in_process(scramble_gates=True)
    [labels] = [dict(ls) for (name, ls), _ in server.metrics().items() if name == "layerwatch_model_info"]
    assert labels["gates_sha256"] != file_sha
    model = server.service.model
    original = load_gates(tiny_checkpoint.gates_path, model).gates
    served = model.gates
    source = feature_permutation(model.config.hidden_size)
    x = torch.randn(7, model.config.hidden_size)
    for layer in range(NUM_LAYERS):
        # Each gate is its own layer's gate fed the permuted hidden state ...
        torch.testing.assert_close(served[layer](x), original[layer](x[:, source]))
        # ... with the same file layout and every tensor but the first projection's weights unchanged.
        scrambled, healthy = served[layer].state_dict(), original[layer].state_dict()
        assert scrambled.keys() == healthy.keys()
        for name in ("fc1.bias", "fc2.weight", "fc2.bias"):
            assert torch.equal(scrambled[name], healthy[name])
        assert not torch.equal(scrambled["fc1.weight"], healthy["fc1.weight"])
    again = scramble_gates(load_gates(tiny_checkpoint.gates_path, model))
    assert again.sha256 == labels["gates_sha256"]  # a fixed permutation: the same hash every time
    assert again.sha256 != shuffle_gates(load_gates(tiny_checkpoint.gates_path, model)).sha256
    assert server.service.gate_watcher is None  # a file watch would undo the drill
