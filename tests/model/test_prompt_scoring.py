"""Prompt log-probabilities from the gated model as served: the prompt is scored teacher-forced
through the engine's own decode step, so they are `layerwatch eval`'s per-token losses (prefill 1),
full depth bit for bit at threshold 0, and a scored prompt shares the batch one token per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerwatch.inference_shim.offline.evaluation import teacher_forced_decode
from layerwatch.inference_shim.runtime.depth_execution import DepthExecutionConfig
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams, SequenceUpdate
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.skip_policy import SkipPolicyConfig

from .conftest import random_gates, random_model, tiny_config

# Random gates score around 0.5: at this threshold and patience the skip patterns switch.
POLICY = SkipPolicyConfig(threshold=0.5, patience=2)
PROMPT = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture
def model():
    model = random_model(tiny_config(num_layers=6, eos_token_ids=()), seed=2)
    model.attach_gates(random_gates(model.config, seed=3))
    return model


@pytest.fixture
def no_eos(backend_tokenizer) -> Tokenizer:
    return Tokenizer(backend_tokenizer, bos_token="<s>", add_bos_token=True)


def engine(model, tokenizer, policy=POLICY, **options) -> GenerationEngine:
    return GenerationEngine(model, tokenizer, model_name="tiny", policy=policy, **options)


def run(eng: GenerationEngine) -> dict[int, list[SequenceUpdate]]:
    """Step until every submitted sequence finished; -> each sequence's updates."""
    updates: dict[int, list[SequenceUpdate]] = {}
    while eng.has_work():
        for update in eng.step():
            updates.setdefault(update.sequence_id, []).append(update)
    return updates


def scored(eng: GenerationEngine, prompt: list[int], k: int = 2) -> list[float]:
    """The prompt's log-probabilities (from its second token on), nothing generated."""
    sequence = eng.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=k))
    (final,) = run(eng)[sequence]
    assert final.finish_reason == "length" and final.new_token_ids == [] and final.prompt_logprobs[0] is None
    assert [entry.token_id for entry in final.prompt_logprobs[1:]] == prompt[1:]
    return [entry.logprob for entry in final.prompt_logprobs[1:]]


@pytest.mark.parametrize("kv_policy", ["project", "evict"])
def test_prompt_logprobs_are_evals_gated_per_token_losses(model, no_eos, kv_policy):
    logprobs = scored(engine(model, no_eos, kv_policy=kv_policy), PROMPT)
    steps = []
    teacher_forced_decode(
        model, torch.tensor([PROMPT]), 1, POLICY, kv_policy=kv_policy, batch_size=1, on_step=steps.append
    )
    skipped = np.concatenate([s.skipped for s in steps])
    assert skipped.any() and not skipped.all()  # skipping really happened, and switched
    assert [-lp for lp in logprobs] == [float(s.losses[0]) for s in steps]  # bit for bit

    model.attach_gates(None)
    assert scored(engine(model, no_eos, kv_policy=kv_policy), PROMPT) != pytest.approx(logprobs, abs=1e-3)


def engine_logprob_bound(model) -> float:
    """How far the engine's log-probabilities can be from those of the exact logits, for a float64
    model (whose logits are exact but for float64 rounding, about 1e-15), on any CPU. The engine rounds
    the logits to float32 and takes log_softmax there (sampling's dtype); the bound is Higham's, for
    any summation order, in units of float32's u = 2^-24, with Z = max|z|: rounding the logits and the
    shift z - max(z), 4uZ; exp, 2u and 2uZ from its shifted argument; the sum of V terms, (V - 1)u
    relative, which the log makes absolute; the log and the last subtraction, u (1 + log V + 2Z).
    Rounded up: u (V + 8Z + 8). Z is bounded for any input and any skipping: the final RMSNorm's
    output has norm sqrt(d) times at most max|g| (its weight), so |z_j| <= ||W_j|| sqrt(d) max|g|."""
    u = 2.0**-24
    d = model.config.hidden_size
    z = model.lm_head.weight.norm(dim=1).max().item() * d**0.5 * model.norm.weight.abs().max().item()
    return u * (model.config.vocab_size + 8 * z + 8)


def full_depth_logprobs(model, prompt: list[int]) -> list[float]:
    """The one-pass forward's log-probability of each prompt token after the first (exact, up to float64
    rounding, for a float64 model)."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt]))
    forward = torch.log_softmax(logits[0, :-1].double(), dim=-1)
    return forward.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def test_at_threshold_zero_prompt_logprobs_are_full_depth_bit_for_bit(model, no_eos):
    # In float64, so that the two paths (one token a decode step, the one-pass forward) differ by the
    # engine's float32 log_softmax only, which has a bound; in float32 their different summation orders
    # differ by what each CPU's kernels make of them (1.07e-5 on an AVX-512 Xeon, 6.8e-6 on an EPYC).
    model.double()
    gated = scored(engine(model, no_eos, policy=SkipPolicyConfig(threshold=0.0)), PROMPT)
    model.attach_gates(None)
    assert scored(engine(model, no_eos), PROMPT) == gated
    assert gated == pytest.approx(full_depth_logprobs(model, PROMPT), abs=engine_logprob_bound(model), rel=0)


def test_a_scored_prompt_shares_the_batch_one_token_per_step(model, no_eos):
    model.double()  # the scores compared below within a bound (float32's differ by summation order)
    alone_generated = engine(model, no_eos).generate(PROMPT[:5], SamplingParams(max_tokens=8)).token_ids
    alone_scored = scored(engine(model, no_eos), PROMPT)

    records = []
    # Every row as it decided (depth execution "rows"), so that sharing the batch changes no row.
    eng = engine(model, no_eos, step_hook=records.append, depth=DepthExecutionConfig("rows"))
    scorer = eng.submit(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2))
    generator = eng.submit(PROMPT[:5], SamplingParams(max_tokens=8))
    per_step = [eng.step() for _ in range(len(PROMPT) - 1)]
    assert not eng.has_work()
    # The generation was not held up: one token in each of the first 8 steps, scoring alongside.
    generated = [[u.new_token_ids for u in step if u.sequence_id == generator] for step in per_step]
    assert generated[:8] == [[[token]] for token in alone_generated] and not any(generated[8:])
    (final,) = per_step[-1]  # the scorer finished in the step that read its last-but-one token
    # Each row's result does not depend on its neighbours, up to float summation order (docs/model.md:
    # a matmul of one row and one of two sum in different orders): in float64, each within the engine's
    # log_softmax bound of the exact value, so within twice it of each other.
    assert final.sequence_id == scorer
    bound = 2 * engine_logprob_bound(model)
    assert [e.logprob for e in final.prompt_logprobs[1:]] == pytest.approx(alone_scored, abs=bound, rel=0)
    # Scoring steps are prompt work: the step records (the telemetry) hold the generated tokens only.
    assert [r.sequence_ids.tolist() for r in records] == [[generator]] * 8
    assert final.layer_counts.tokens == 0 and final.layers_executed == final.layers_skipped == 0


def test_a_scored_prompt_then_generates_as_without_scoring(model, no_eos):
    sampling = {"max_tokens": 6, "temperature": 0.8, "seed": 5, "logprobs": 1}
    plain = run_one(engine(model, no_eos), SamplingParams(**sampling))
    echoed = run_one(engine(model, no_eos), SamplingParams(**sampling, prompt_logprobs=2))
    assert [u.new_token_ids for u in echoed] == [u.new_token_ids for u in plain]
    assert [u.logprobs for u in echoed] == [u.logprobs for u in plain]
    assert echoed[-1].layers_executed + echoed[-1].layers_skipped == 6 * model.config.num_layers
    # The prompt's log-probabilities come once, with the first generated token.
    assert [u.prompt_logprobs is not None for u in echoed] == [True] + [False] * 5
    assert [e.logprob for e in echoed[0].prompt_logprobs[1:]] == scored(engine(model, no_eos), PROMPT)


def run_one(eng: GenerationEngine, params: SamplingParams) -> list[SequenceUpdate]:
    sequence = eng.submit(PROMPT, params)
    return run(eng)[sequence]


def test_a_one_token_prompt_has_nothing_to_score(model, no_eos):
    eng = engine(model, no_eos)
    eng.submit([0], SamplingParams(max_tokens=0, prompt_logprobs=1))
    (final,) = eng.step()
    assert final.finished and final.prompt_logprobs == [None] and not eng.has_work()


def test_cancelling_a_sequence_while_its_prompt_is_scored(model, no_eos):
    eng = engine(model, no_eos, max_batch_size=1)
    scorer = eng.submit(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=1))
    waiting = eng.submit(PROMPT[:5], SamplingParams(max_tokens=2))
    assert eng.step() == [] and eng.step() == []  # scoring: no update until the prompt is read
    eng.cancel(scorer)
    updates = run(eng)
    (cancelled,) = updates[scorer]
    assert cancelled.finish_reason == "cancelled" and cancelled.prompt_logprobs is None
    assert updates[waiting][-1].finish_reason == "length"  # the freed slot serves the next sequence
