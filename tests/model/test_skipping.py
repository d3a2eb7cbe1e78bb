"""Layer skipping in the real engine: the rule, skipped means skipped, KV policies, batching, fallback.

Outputs of gated decoding are checked against an independent, cache-free reference: every
position recomputed from scratch, where a (position, layer) that did not run passes its hidden
state through, and under `evict` its key is masked out of that layer's attention.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from layerwatch.inference_shim.runtime.depth_execution import DepthExecution, DepthExecutionConfig, FixedDepthCosts
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.inference_shim.runtime.model import Transformer, apply_rope
from layerwatch.inference_shim.runtime.skip_policy import SkipPolicy
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.skip_policy import SkipPolicyConfig

from .conftest import constant_gates, random_gates, random_model, tiny_config

MIXED = SkipPolicyConfig(threshold=0.5, patience=2)  # random gates score around 0.5: patterns switch
EWMA_MIXED = SkipPolicyConfig(threshold=0.5, patience=2, skip_rule="ewma", ewma_alpha=0.4)
PROMPTS = [[0, 17, 54, 120, 9], [0, 250, 3], [0, 77, 78, 79, 80, 81, 82, 83, 84]]


def gated_model(gates: str = "random", seed: int = 0, **config) -> Transformer:
    model = random_model(tiny_config(num_layers=6, **config), seed=seed)
    model.attach_gates(
        random_gates(model.config, seed=seed + 1)
        if gates == "random"
        else constant_gates(model.config, entropy_logit=-30.0)
    )
    return model


# These tests check each row's skip semantics, so their batches run every row exactly as it decided
# (the depth execution's "rows" mode); tests/model/test_depth_execution.py tests the other modes.
ROWS = DepthExecutionConfig("rows", vote=None)


def engine_for(model, tokenizer, policy=MIXED, kv_policy="project", depth=ROWS, **options) -> GenerationEngine:
    return GenerationEngine(
        model, tokenizer, model_name="tiny", policy=policy, kv_policy=kv_policy, depth=depth, **options
    )


def capture_logits(model: Transformer) -> list[torch.Tensor]:
    """Record the logits every decode step returns (a spy: the real method still runs)."""
    captured, original = [], model.decode_step

    def spy(*args, **kwargs):
        logits, entropies = original(*args, **kwargs)
        captured.append(logits.clone())
        return logits, entropies

    model.decode_step = spy
    return captured


@torch.no_grad()
def reference_logits(model: Transformer, tokens: list[int], ran: np.ndarray, kv_policy: str) -> torch.Tensor:
    """Cache-free gated forward. ran: bool [T, L] (prefill positions all True). -> logits [T, V]."""
    T = len(tokens)
    h = model.embed_tokens(torch.tensor([tokens]))
    cos, sin = model.rope(torch.arange(T)[None], h.dtype)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for l, block in enumerate(model.layers):
        runs = torch.as_tensor(ran[:, l])
        attn = block.self_attn
        x = block.input_layernorm(h)
        q = apply_rope(attn.q_proj(x).view(1, T, attn.num_heads, attn.head_dim).transpose(1, 2), cos, sin)
        k, v = attn.project_kv(x, cos, sin)
        visible = causal if kv_policy == "project" else causal & (runs[None, :] | torch.eye(T, dtype=torch.bool))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=attn.num_kv_heads != attn.num_heads)
        updated = h + attn.o_proj(out.transpose(1, 2).reshape(1, T, -1))
        updated = updated + block.mlp(block.post_attention_layernorm(updated))
        h = torch.where(runs[None, :, None], updated, h)
    return model.lm_head(model.norm(h))[0]


def check_against_reference(model, prompt, result, captured, kv_policy):
    fed = prompt + result.token_ids[:-1]
    ran = np.concatenate([np.ones((len(prompt) - 1, model.config.num_layers), dtype=bool), result.activity])
    expected = reference_logits(model, fed, ran, kv_policy)[len(prompt) - 1 :]
    got = torch.cat(captured)
    assert got.shape == expected.shape
    # The callers' models are float64: the two paths differ by summation order only. In float32 that
    # was up to 4.6e-5 (ATEN_CPU_CAPABILITY=default; 2.9e-5 with AVX-512) against a limit of 1e-4;
    # scaled by float64's unit roundoff over float32's (2^-29) it is 1e-13, and 1e-9 leaves 10^4 over it.
    assert got.dtype == torch.float64 and (got - expected).abs().max().item() <= 1e-9
    assert result.token_ids == expected.argmax(-1).tolist()


class Recorder:
    """Per-sequence tokens, activity and final counts, from the engine's public outputs."""

    def __init__(self) -> None:
        self.records: list = []
        self.tokens: dict[int, list[int]] = {}
        self.activity: dict[int, list[np.ndarray]] = {}
        self.final: dict[int, object] = {}

    def on_step(self, record) -> None:
        self.records.append(record)
        for row, sequence_id in enumerate(record.sequence_ids.tolist()):
            self.activity.setdefault(sequence_id, []).append(~record.skipped[row])

    def drain(self, engine: GenerationEngine) -> None:
        for update in engine.step():
            self.tokens.setdefault(update.sequence_id, []).extend(update.new_token_ids)
            if update.finished:
                self.final[update.sequence_id] = update


def switches(activity: np.ndarray) -> tuple[bool, bool]:
    """Whether some layer went run -> skip and some layer went skip -> run."""
    change = activity[1:].astype(int) - activity[:-1].astype(int)
    return bool((change < 0).any()), bool((change > 0).any())


# --- the rule ------------------------------------------------------------------------------------


def test_run_mask_takes_no_scores():
    assert list(inspect.signature(SkipPolicy.run_mask).parameters) == ["self", "slots"]


def test_policy_mask_for_a_step_is_fixed_before_that_step_is_observed():
    policy = SkipPolicy(SkipPolicyConfig(threshold=0.5, patience=2, protected_layers=()), num_layers=3, slots=1)
    slots = np.array([0])
    for _ in range(2):
        policy.observe(slots, np.array([[0.1, 0.9, 0.1]]), policy.run_mask(slots))
    before = policy.run_mask(slots)
    assert before.tolist() == [[False, True, False]]
    policy.observe(slots, np.array([[0.9, 0.9, 0.1]]), before)  # the step's own scores arrive afterwards
    assert policy.run_mask(slots).tolist() == [[True, True, False]]  # they only shape the next step


def test_engine_skips_exactly_by_the_previous_k_steps(tokenizer):
    model = gated_model()
    records = []
    engine = engine_for(model, tokenizer, step_hook=records.append)
    engine.generate(PROMPTS[0], SamplingParams(max_tokens=60))
    entropies = np.concatenate([r.entropies for r in records])
    skipped = np.concatenate([r.skipped for r in records])
    assert np.isfinite(entropies).all()  # every layer scored, skipped or not
    k, protected = MIXED.patience, [0, model.config.num_layers - 1]
    for t in range(len(records)):
        expected = np.zeros(model.config.num_layers, dtype=bool)
        if t >= k and not records[t].fallback[0]:
            expected = (entropies[t - k : t] < MIXED.threshold).all(axis=0)
            expected[protected] = False
        assert skipped[t].tolist() == expected.tolist(), f"step {t}"
    assert 0.1 < skipped.mean() < 0.6 and all(switches(~skipped))  # a non-trivial, switching pattern


def streak_skips(entropies: np.ndarray, policy: SkipPolicyConfig) -> np.ndarray:
    """bool [T, L]: what the streak rule skips at each step, from the scores [T, L] alone (no fallback)."""
    k, skips = policy.patience, np.zeros(entropies.shape, dtype=bool)
    for t in range(k, len(entropies)):
        skips[t] = (entropies[t - k : t] < np.float32(policy.threshold)).all(axis=0)
    return skips


def ewma_skips(entropies: np.ndarray, policy: SkipPolicyConfig) -> np.ndarray:
    """bool [T, L]: what the ewma rule skips at each step, re-derived step by step in Python floats:
    average[t] = alpha * score[t] + (1 - alpha) * average[t - 1], average[0] = score[0]; step t
    skips where average[t - 1] < tau, from step `patience` on (no fallback)."""
    alpha, skips = policy.ewma_alpha, np.zeros(entropies.shape, dtype=bool)
    average = [float(score) for score in entropies[0]]
    for t in range(1, len(entropies)):
        if t >= policy.patience:
            skips[t] = [a < float(np.float32(policy.threshold)) for a in average]
        average = [alpha * float(score) + (1 - alpha) * a for score, a in zip(entropies[t], average)]
    return skips


def test_engine_ewma_rule_skips_exactly_by_the_average_of_the_previous_steps(tokenizer):
    model = gated_model()
    records = []
    engine = engine_for(model, tokenizer, policy=EWMA_MIXED, step_hook=records.append)
    engine.generate(PROMPTS[0], SamplingParams(max_tokens=60))
    entropies = np.concatenate([r.entropies for r in records])
    skipped = np.concatenate([r.skipped for r in records])
    fallback = np.concatenate([r.fallback for r in records])
    expected = ewma_skips(entropies, EWMA_MIXED)
    expected[:, [0, model.config.num_layers - 1]] = False  # protected
    expected[fallback] = False
    assert skipped.tolist() == expected.tolist()
    assert not skipped[: EWMA_MIXED.patience].any()  # warm-up: the first k steps run full depth
    assert 0.1 < skipped.mean() < 0.6 and all(switches(~skipped))  # a non-trivial, switching pattern
    # The average decides differently from the streak on these very scores.
    assert (streak_skips(entropies, EWMA_MIXED)[:, 1:-1] != expected[:, 1:-1]).any()


def test_ewma_with_alpha_one_is_the_streak_rule_with_patience_one_after_warm_up():
    scores = np.random.default_rng(0).uniform(0.3, 0.7, size=(12, 4)).astype(np.float32)
    masks = {}
    for rule in ("streak", "ewma"):
        config = SkipPolicyConfig(threshold=0.5, patience=1, protected_layers=(), skip_rule=rule, ewma_alpha=1.0)
        policy, slots, masks[rule] = SkipPolicy(config, num_layers=4, slots=1), np.array([0]), []
        for row in scores:
            masks[rule].append(policy.run_mask(slots)[0])
            policy.observe(slots, row[None], masks[rule][-1][None])
    assert np.array_equal(masks["streak"], masks["ewma"]) and not np.all(masks["ewma"])


def test_a_new_sequence_in_the_slot_starts_a_fresh_average():
    config = SkipPolicyConfig(threshold=0.5, patience=2, protected_layers=(), skip_rule="ewma")
    policy, slots = SkipPolicy(config, num_layers=2, slots=2), np.array([0, 1])
    for _ in range(3):
        policy.observe(slots, np.array([[0.1, 0.9], [0.1, 0.9]]), policy.run_mask(slots))
    assert policy.run_mask(slots).tolist() == [[False, True], [False, True]]
    policy.reset(1)
    policy.observe(slots, np.array([[0.1, 0.9], [0.9, 0.9]]), policy.run_mask(slots))
    assert policy.run_mask(slots).tolist() == [[False, True], [True, True]]  # slot 1 warms up again
    policy.observe(slots, np.array([[0.1, 0.9], [0.3, 0.9]]), policy.run_mask(slots))
    # Its average starts at its own first score: (0.9 + 0.3) / 2 (the old 0.1s would have given 0.4).
    assert policy.run_mask(slots).tolist() == [[False, True], [True, True]]
    policy.observe(slots, np.array([[0.1, 0.9], [0.3, 0.9]]), policy.run_mask(slots))
    assert policy.run_mask(slots).tolist() == [[False, True], [False, True]]  # (0.6 + 0.3) / 2 < 0.5


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"skip_rule": "sliding"}, "skip rule must be one of streak, ewma, got 'sliding'"),
        ({"ewma_alpha": 0.0}, r"ewma_alpha must be in \(0, 1\], got 0.0"),
        ({"ewma_alpha": float("nan")}, r"ewma_alpha must be in \(0, 1\], got nan"),
    ],
)
def test_a_bad_rule_or_alpha_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        SkipPolicyConfig(**settings)


# --- skipped means skipped -----------------------------------------------------------------------


def test_skipped_layers_execute_neither_attention_nor_ffn(tokenizer):
    model = gated_model()
    decode_rows = {name: [0] * model.config.num_layers for name in ("queries", "o_proj", "mlp")}

    def counter(name, layer):
        def hook(module, inputs, output):
            if inputs[0].dim() == 2:  # decode: [rows, features]; prefill is [1, T, features]
                decode_rows[name][layer] += inputs[0].shape[0]

        return hook

    def counted_queries(layer, projection):
        # Decoding projects a row's query with its K/V (decode_qkv) or alone (decode_queries, when
        # `project` gave the whole batch its K/V): either way the row's attention runs.
        def project(x, *args):
            decode_rows["queries"][layer] += x.shape[0]
            return projection(x, *args)

        return project

    for l, block in enumerate(model.layers):
        attention = block.self_attn
        attention.decode_qkv = counted_queries(l, attention.decode_qkv)
        attention.decode_queries = counted_queries(l, attention.decode_queries)
        attention.o_proj.register_forward_hook(counter("o_proj", l))
        block.mlp.register_forward_hook(counter("mlp", l))
    recorder = Recorder()
    engine = engine_for(model, tokenizer, max_batch_size=4, step_hook=recorder.on_step)
    for prompt in PROMPTS:
        engine.submit(prompt, SamplingParams(max_tokens=30))
    model.reset_counters()
    prefill_rows = sum(len(p) - 1 for p in PROMPTS)
    while engine.has_work():
        recorder.drain(engine)
    activity = np.concatenate([np.array(a) for a in recorder.activity.values()])
    ran, evaluations = activity.sum(axis=0), activity.size
    assert ran.sum() < evaluations  # layers were skipped
    for name in decode_rows:
        assert decode_rows[name] == ran.tolist(), name
    assert model.layer_rows_executed == (ran + prefill_rows).tolist()
    assert sum(u.layers_executed for u in recorder.final.values()) == ran.sum()
    assert sum(u.layers_skipped for u in recorder.final.values()) == evaluations - ran.sum()


# --- KV policies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_policy", ["project", "evict"])
def test_threshold_zero_is_exactly_the_ungated_model(tokenizer, kv_policy):
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=11)
    ungated = random_model(tiny_config(num_layers=6), seed=0)
    plain_logits = capture_logits(ungated)
    plain = engine_for(ungated, tokenizer, policy=SkipPolicyConfig(threshold=0.0)).generate(PROMPTS[0], params)
    gated = gated_model()
    gated_logits = capture_logits(gated)
    result = engine_for(gated, tokenizer, policy=SkipPolicyConfig(threshold=0.0), kv_policy=kv_policy).generate(
        PROMPTS[0], params
    )
    assert result.token_ids == plain.token_ids
    assert torch.equal(torch.cat(gated_logits), torch.cat(plain_logits))
    assert result.layers_skipped == 0


@pytest.mark.parametrize("kv_policy", ["project", "evict"])
def test_switching_patterns_match_the_reference(tokenizer, kv_policy):
    model = gated_model().double()
    captured = capture_logits(model)
    result = engine_for(model, tokenizer, kv_policy=kv_policy).generate(PROMPTS[2], SamplingParams(max_tokens=60))
    assert all(switches(result.activity))
    check_against_reference(model, PROMPTS[2], result, captured, kv_policy)


@pytest.mark.parametrize("kv_policy", ["project", "evict"])
def test_all_skippable_layers_skipped_match_the_reference(tokenizer, kv_policy):
    model = gated_model("near-zero").double()
    captured = capture_logits(model)
    engine = engine_for(model, tokenizer, policy=SkipPolicyConfig(), kv_policy=kv_policy)
    result = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20))
    L = model.config.num_layers
    assert result.activity[:3].all()  # the first k = 3 steps run full depth
    assert (result.activity[3:] == np.array([True] + [False] * (L - 2) + [True])).all()
    check_against_reference(model, PROMPTS[0], result, captured, kv_policy)
    positions = np.arange(len(PROMPTS[0]) - 1 + 3, len(PROMPTS[0]) - 1 + 20)
    valid = engine.cache.valid[1 : L - 1, 0, positions]  # what the skipped positions left in the cache
    assert bool(valid.all()) if kv_policy == "project" else not bool(valid.any())


@pytest.mark.parametrize("kv_policy", ["project", "evict"])
def test_long_generation_stops_at_the_cache_length(backend_tokenizer, kv_policy):
    model = gated_model(eos_token_ids=()).double()  # nothing ends the sequence but the cache length
    captured = capture_logits(model)
    engine = engine_for(model, Tokenizer(backend_tokenizer), kv_policy=kv_policy, max_seq_len=260)
    result = engine.generate(PROMPTS[0], SamplingParams(max_tokens=1000))
    assert result.finish_reason == "length"
    assert result.completion_tokens == 260 - len(PROMPTS[0]) + 1  # the last token is never fed
    check_against_reference(model, PROMPTS[0], result, captured, kv_policy)


# --- batching ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_policy", ["project", "evict"])
def test_batched_rows_match_running_alone(tokenizer, kv_policy):
    params = [
        SamplingParams(max_tokens=40),
        SamplingParams(max_tokens=25, temperature=1.0, seed=5),
        SamplingParams(max_tokens=40),
        SamplingParams(max_tokens=30),
    ]
    prompts = PROMPTS + [[0, 5, 6]]
    model = gated_model()
    alone = [engine_for(model, tokenizer, kv_policy=kv_policy).generate(p, s) for p, s in zip(prompts, params)]

    recorder = Recorder()
    engine = engine_for(model, tokenizer, kv_policy=kv_policy, max_batch_size=3, step_hook=recorder.on_step)
    ids = [engine.submit(p, s) for p, s in zip(prompts[:3], params[:3])]
    for _ in range(5):
        recorder.drain(engine)
    ids.append(engine.submit(prompts[3], params[3]))  # waits for a free slot, then joins
    while engine.has_work():
        recorder.drain(engine)

    for sequence_id, single in zip(ids, alone):
        assert recorder.tokens[sequence_id] == single.token_ids
        assert np.array_equal(np.array(recorder.activity[sequence_id]), single.activity)
    records = recorder.records
    mixed_steps = [
        r
        for r in records
        if len(r.sequence_ids) > 1 and r.skipped.any(axis=0).any() and (r.skipped != r.skipped[0]).any()
    ]
    assert mixed_steps  # rows really had different masks in one step
    for r in records:
        assert r.batch_skipped.tolist() == r.skipped.all(axis=0).tolist()
    assert max(len(r.sequence_ids) for r in records) == 3


# --- per-sequence threshold ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", [MIXED, EWMA_MIXED], ids=["streak", "ewma"])
def test_each_sequence_skips_at_its_own_threshold_in_a_shared_batch(tokenizer, policy):
    """Rows at tau 0 (full depth), the policy's tau and a stricter-than-policy tau share one batch:
    each decodes exactly as it does alone at a policy with its tau, under either rule."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    model = gated_model()
    thresholds = [0.0, None, 0.45]
    alone = [
        engine_for(model, tokenizer, policy=policy if t is None else dataclasses.replace(policy, threshold=t)).generate(
            PROMPTS[0], params
        )
        for t in thresholds
    ]
    assert alone[0].layers_skipped == 0 < alone[2].layers_skipped < alone[1].layers_skipped

    recorder = Recorder()
    engine = engine_for(model, tokenizer, policy=policy, max_batch_size=3, step_hook=recorder.on_step)
    ids = [engine.submit(PROMPTS[0], params, threshold=t) for t in thresholds]
    while engine.has_work():
        recorder.drain(engine)
    for sequence_id, single in zip(ids, alone):
        assert recorder.tokens[sequence_id] == single.token_ids
        assert np.array_equal(np.array(recorder.activity[sequence_id]), single.activity)
    assert max(len(r.sequence_ids) for r in recorder.records) == 3


def test_after_prefill_sets_the_threshold_from_the_prefill_before_the_first_decode_step(tokenizer):
    """A sequence's `after_prefill` sees its prompt's full-depth gate scores, and the tau it returns
    replaces the submitted one: the sequence decodes exactly as one submitted at that tau."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    model = gated_model()
    engine = engine_for(model, tokenizer)
    reference = engine.generate(PROMPTS[0], params, threshold=0.0)
    seen = []

    def full_depth_after_prefill(record):
        seen.append(record.entropies.shape)
        return 0.0

    sequence_id = engine.submit(PROMPTS[0], params, after_prefill=full_depth_after_prefill)
    recorder = Recorder()
    engine.step_hook = recorder.on_step
    while engine.has_work():
        recorder.drain(engine)
    assert seen == [(len(PROMPTS[0]) - 1, model.config.num_layers)]
    assert recorder.tokens[sequence_id] == reference.token_ids
    assert np.array(recorder.activity[sequence_id]).all()  # every layer ran for every token
    kept = engine.submit(PROMPTS[0], params, after_prefill=lambda record: None)  # None: the submitted tau
    while engine.has_work():
        recorder.drain(engine)
    assert recorder.final[kept].layers_skipped > 0


@pytest.mark.parametrize(("mode", "limit"), [("auto", 1), ("batch", 0)])
@pytest.mark.parametrize("policy", [MIXED, EWMA_MIXED], ids=["streak", "ewma"])
def test_a_full_depth_sequence_stays_at_full_depth_under_batch_consensus(tokenizer, policy, mode, limit):
    """Tau 0 is full depth (a mitigation's override, a rollout's or the request's choice) even when
    the batch's consensus skips a layer: the other rows, whose gates all score low, outvote it. It
    runs such a layer alone where the row-partial path pays (limit 1 of 3 rows), else with them all."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    depth = DepthExecution(DepthExecutionConfig(mode, vote=0.5), FixedDepthCosts(default=limit))
    engine = engine_for(gated_model("constant"), tokenizer, policy=policy, max_batch_size=3, depth=depth)
    recorder = Recorder()
    engine.step_hook = recorder.on_step
    ids = [engine.submit(PROMPTS[0], params, threshold=t) for t in (None, None, 0.0)]
    while engine.has_work():
        recorder.drain(engine)
    gated, _, full = (recorder.final[i] for i in ids)
    assert gated.layer_counts.skipped.sum() > 0 and full.layer_counts.skipped.sum() == 0  # as each rule decided
    assert full.layers_skipped == 0  # and what ran: the full-depth row ran every layer of every step
    executed = np.stack([~r.executed_skipped for r in recorder.records])
    assert executed[:, 2].all()
    # The consensus skipped layers for the other two rows where the full-depth row could run them
    # alone; where it could not (limit 0), they ran with it.
    assert (gated.layers_skipped > 0) == (~executed[:, :2]).any() == (limit == 1)


@pytest.mark.parametrize("threshold", [-0.1, 1.5, float("nan")])
def test_a_threshold_outside_zero_to_one_is_refused_at_submit(tokenizer, threshold):
    engine = engine_for(gated_model(), tokenizer)
    with pytest.raises(ValueError, match="threshold must be in"):
        engine.submit(PROMPTS[0], SamplingParams(max_tokens=2), threshold=threshold)
    assert not engine.has_work()


# --- fallback breaker ----------------------------------------------------------------------------


def test_fallback_after_sustained_high_skipping(tokenizer, caplog):
    model = gated_model("near-zero")
    records = []
    policy = SkipPolicyConfig(protected_layers=())  # everything skippable: 100 % skipped > 85 %
    engine = engine_for(model, tokenizer, policy=policy, step_hook=records.append)
    with caplog.at_level(logging.WARNING, logger="layerwatch.inference_shim.runtime.engine"):
        result = engine.generate(PROMPTS[0], SamplingParams(max_tokens=30))
    depth = result.activity.sum(axis=1)
    L = model.config.num_layers
    # steps 1-3 build patience, 4-6 skip everything, 7-22 fallback at full depth, 23-25 skip again.
    assert depth.tolist() == [L] * 3 + [0] * 3 + [L] * 16 + [0] * 3 + [L] * 5
    fallback = np.array([r.fallback[0] for r in records])
    assert np.flatnonzero(fallback).tolist() == list(range(6, 22)) + list(range(25, 30))
    started = [r.step for r in records if r.fallback_started[0]]
    assert started == [6, 25]
    messages = [r.getMessage() for r in caplog.records if "FALLBACK" in r.getMessage()]
    assert messages == [
        "ILP_FALLBACK: HIGH_SKIPPING model=tiny request=- sequence=0 step=6",
        "ILP_FALLBACK: HIGH_SKIPPING model=tiny request=- sequence=0 step=25",
    ]


def test_fallback_line_names_the_request_and_counts_in_the_sequence(tokenizer, caplog):
    model = gated_model("near-zero")
    records = []
    policy = SkipPolicyConfig(protected_layers=())
    engine = GenerationEngine(model, tokenizer, model_name="tiny model", policy=policy, step_hook=records.append)
    sequence_id = engine.submit(PROMPTS[0], SamplingParams(max_tokens=30), request_id="cmpl-42")
    with caplog.at_level(logging.WARNING, logger="layerwatch.inference_shim.runtime.engine"):
        finals = [u for _ in range(40) for u in engine.step() if u.finished]
    messages = [r.getMessage() for r in caplog.records if "FALLBACK" in r.getMessage()]
    # A value with a space is quoted, as logfmt does, so the line still splits into key=value pairs.
    assert messages == [
        f'ILP_FALLBACK: HIGH_SKIPPING model="tiny model" request=cmpl-42 sequence={sequence_id} step=6',
        f'ILP_FALLBACK: HIGH_SKIPPING model="tiny model" request=cmpl-42 sequence={sequence_id} step=25',
    ]
    (final,) = finals
    counts = final.layer_counts
    assert counts.fallbacks == 2 == sum(int(r.fallback_started[0]) for r in records)
    scores = np.stack([r.entropies[0] for r in records]).astype(np.float64)
    np.testing.assert_allclose(counts.score_sum, scores.sum(axis=0))


def test_fallback_settings_are_configurable(tokenizer):
    model = gated_model("near-zero")
    policy = SkipPolicyConfig(protected_layers=(), fallback_trigger_steps=1, fallback_steps=2)
    result = engine_for(model, tokenizer, policy=policy).generate(PROMPTS[0], SamplingParams(max_tokens=10))
    L = model.config.num_layers
    assert result.activity.sum(axis=1).tolist() == [L] * 3 + [0] + [L] * 2 + [0] + [L] * 2 + [0]
