"""The shadow check's record and comparison (layerwatch/inference_shim/runtime/agreement.py): what the engine keeps of
the gated distribution for a flagged sequence, and the divergences a full-depth pass computes from it,
against exact values from the full gated and full-depth distributions of a tiny random model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from layerwatch.inference_shim.runtime.agreement import ShadowJob, full_depth_agreement, partition_divergences
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.inference_shim.runtime.model import GateBank
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.skip_policy import SkipPolicyConfig

from .conftest import VOCAB_SIZE, constant_gates, random_model, tiny_config

PROMPT = [0, 17, 54, 120, 9]
# Sampled traffic as chat clients send it, and the settings a full-depth re-run cannot reproduce.
SAMPLED = {
    "temperature 1.0": SamplingParams(max_tokens=24, temperature=1.0, seed=11),
    "temperature 0.7": SamplingParams(max_tokens=24, temperature=0.7, seed=12),
    "top_p 0.9": SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=13),
    "penalties": SamplingParams(max_tokens=24, temperature=0.9, presence_penalty=1.5, frequency_penalty=0.5, seed=14),
    "logit_bias": SamplingParams(max_tokens=24, temperature=1.0, logit_bias={40: 6.0, 41: -100.0}, seed=15),
}


def skipping_gates(config) -> GateBank:
    """Layers 1 and 2 score ~0.002 (skipped from the fourth step on, whatever the token), the others ~1."""
    gates = constant_gates(config, 6.0)
    with torch.no_grad():
        for layer in (1, 2):
            gates.gates[layer].fc2.bias.fill_(-6.0)
    return gates


@pytest.fixture
def model():
    model = random_model(tiny_config(eos_token_ids=()), seed=2)
    model.attach_gates(skipping_gates(model.config))
    return model


@pytest.fixture
def no_eos(backend_tokenizer) -> Tokenizer:
    return Tokenizer(backend_tokenizer, bos_token="<s>", add_bos_token=True)


def engine(model, tokenizer, threshold: float = 0.18, **options) -> GenerationEngine:
    """tau 0: full depth."""
    return GenerationEngine(
        model, tokenizer, model_name="tiny", policy=SkipPolicyConfig(threshold=threshold), **options
    )


def full_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The full-depth log-distributions [G, V] at the generated positions, teacher-forced."""
    with torch.inference_mode():
        logits, _ = model(torch.tensor([prompt + generated]))
    first = len(prompt) - 1
    return torch.log_softmax(logits[0, first : first + len(generated)].float(), dim=-1).double()


def gated_logprobs(record) -> torch.Tensor:
    """The gated distributions [G, V] from a record that kept the whole vocabulary (k = V)."""
    logprobs = torch.full(record.top_ids.shape, math.nan, dtype=torch.float64)
    logprobs.scatter_(1, torch.as_tensor(record.top_ids), torch.as_tensor(record.top_logprobs))
    assert not logprobs.isnan().any()
    return logprobs


# --- the record on the decode path -------------------------------------------------------------------


def test_only_flagged_sequences_record_and_recording_changes_no_token(model, no_eos):
    """A seeded sampled request generates the same tokens with and without its record; its batch mates
    record nothing and are unaffected by it."""
    params = SAMPLED["temperature 1.0"]
    mate = SamplingParams(max_tokens=24, temperature=0.7, seed=3)

    def run(record: bool):
        eng = engine(model, no_eos, max_batch_size=4)
        flagged = eng.submit(PROMPT, params, record=record)
        mates = [eng.submit(PROMPT[:3], mate) for _ in range(2)]
        finals, tokens = {}, {i: [] for i in (flagged, *mates)}
        while eng.has_work():
            for update in eng.step():
                tokens[update.sequence_id] += update.new_token_ids
                if update.finished:
                    finals[update.sequence_id] = update
        return [tokens[i] for i in (flagged, *mates)], [finals[i].gated_record for i in (flagged, *mates)]

    tokens_on, records_on = run(record=True)
    tokens_off, records_off = run(record=False)
    assert tokens_on == tokens_off
    record = records_on[0]
    assert record is not None and len(record) == 24 and record.top_ids.shape == (24, 16)
    assert records_on[1:] == [None, None] and records_off == [None, None, None]


def test_the_record_is_the_raw_distribution_whatever_the_sampling(model, no_eos):
    """argmax, the emitted token's log-probability and the top tokens come from the model's own logits
    (temperature 1, no top-p, penalties or bias), as the `logprobs` field reports them."""
    params = SamplingParams(max_tokens=16, temperature=1.0, logit_bias={40: 100.0}, logprobs=5, seed=1)
    eng = engine(model, no_eos)
    sequence = eng.submit(PROMPT, params, record=True)
    logprobs, final = [], None
    while eng.has_work():
        for update in eng.step():
            if update.sequence_id == sequence:
                logprobs += update.logprobs or []
                final = update if update.finished else final
    record = final.gated_record
    assert [lp.token_id for lp in logprobs] == [40] * 16  # the bias decides every token ...
    # ... but the record is the model's own view: its argmax is rarely 40, and 40's log-probability is its own.
    assert (record.argmax != 40).any()
    np.testing.assert_allclose(record.emitted_logprob, [lp.logprob for lp in logprobs], atol=1e-5)
    np.testing.assert_array_equal(record.top_ids[:, :5], [[t for t, _ in lp.top] for lp in logprobs])
    np.testing.assert_allclose(record.top_logprobs[:, :5], [[v for _, v in lp.top] for lp in logprobs], atol=1e-5)
    # The rest of the mass: what the top 16 leave, exactly.
    np.testing.assert_allclose(np.exp(record.rest_logprob) + np.exp(record.top_logprobs).sum(axis=1), 1.0, atol=1e-5)


def test_a_recording_sequence_cancelled_early_or_late_ends_alone_with_what_it_generated(model, no_eos):
    """Cancelled while it waits for a slot (nothing generated) or after some tokens: its final update
    carries a record of exactly its tokens, and the batch goes on."""
    eng = engine(model, no_eos, max_batch_size=1)
    running = eng.submit(PROMPT, SAMPLED["temperature 1.0"], record=True)
    waiting = eng.submit(PROMPT, SAMPLED["temperature 0.7"], record=True)
    for _ in range(5):
        eng.step()
    eng.cancel(waiting)
    eng.cancel(running)
    finals = {u.sequence_id: u for u in eng.step() if u.finished}
    assert finals[waiting].finish_reason == finals[running].finish_reason == "cancelled"
    assert len(finals[waiting].gated_record) == 0 and finals[waiting].gated_record.top_ids.shape == (0, 16)
    assert len(finals[running].gated_record) == 5  # the five tokens it generated
    after = eng.generate(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=1), record=True)
    assert after.finish_reason == "length" and len(after.gated_record) == 3


def test_a_scored_prompt_records_only_its_generated_positions(model, no_eos):
    eng = engine(model, no_eos)
    result = eng.generate(PROMPT, SamplingParams(max_tokens=7, temperature=0.8, seed=2, prompt_logprobs=2), record=True)
    assert result.gated_record is not None and len(result.gated_record) == 7 == len(result.token_ids)


# --- the comparison -----------------------------------------------------------------------------------


def test_coarsened_divergences_are_exact_at_k_equal_v_and_lower_bounds_growing_with_k(model, no_eos):
    """KL on the partition {top-k alone} + {rest}: each k's partition refines the one before, so by the
    data-processing inequality the value never decreases with k and reaches the exact KL at k = V."""
    params = SAMPLED["temperature 1.0"]
    records = {}
    for k in (1, 4, 16, VOCAB_SIZE):
        result = engine(model, no_eos, record_top_k=k).generate(PROMPT, params, record=True)
        records[k] = result.gated_record
        tokens = result.token_ids
    full = full_logprobs(model, PROMPT, tokens)
    gated = gated_logprobs(records[VOCAB_SIZE])
    exact_forward = (gated.exp() * (gated - full)).sum(dim=-1)
    exact_reverse = (full.exp() * (full - gated)).sum(dim=-1)
    # Patience 3: the first three steps run every layer; from then on the gated model differs.
    assert (exact_forward[:3].abs() < 1e-6).all() and (exact_forward[3:] > 1e-3).all()

    def divergences(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = records[k]
        forward, reverse = partition_divergences(
            torch.as_tensor(r.top_ids), torch.as_tensor(r.top_logprobs), torch.as_tensor(r.rest_logprob), full
        )
        return torch.as_tensor(forward), torch.as_tensor(reverse)

    previous = (torch.zeros_like(exact_forward), torch.zeros_like(exact_reverse))
    for k in (1, 4, 16, VOCAB_SIZE):
        forward, reverse = divergences(k)
        # (up to float32 rounding of the recorded log-probabilities)
        assert (forward >= previous[0] - 1e-6).all() and (reverse >= previous[1] - 1e-6).all(), k
        assert (forward <= exact_forward + 1e-6).all() and (reverse <= exact_reverse + 1e-6).all(), k
        previous = (forward, reverse)
    # At k = V every token is its own cell and the rest is empty: the same float64 terms as the exact
    # KL, summed in another order (at most (V + 1) 2^-53 times the sum of their magnitudes apart), and
    # clamped at 0 where float32 rounding leaves the exact one just below it (a full-depth position).
    for coarsened, p_log, q_log in ((previous[0], gated, full), (previous[1], full, gated)):
        terms = p_log.exp() * (p_log - q_log)
        summation = (VOCAB_SIZE + 1) * 2.0**-53 * terms.abs().sum(dim=-1)
        assert ((coarsened - terms.sum(dim=-1).clamp_min(0.0)).abs() <= summation).all()
    assert (divergences(4)[0] < exact_forward - 1e-4).any()  # coarse enough to lose something


@pytest.mark.parametrize("setting", SAMPLED, ids=list(SAMPLED))
def test_a_full_depth_run_agrees_with_itself_at_any_sampling(model, no_eos, setting):
    """Nothing skipped (tau 0): every position agrees and costs nothing, whatever the temperature,
    top-p, penalties or bias chose; with skipping, the same request costs some nats."""
    params = SAMPLED[setting]
    full_depth = engine(model, no_eos, threshold=0.0).generate(PROMPT, params, record=True)
    assert full_depth.layers_skipped == 0
    result = full_depth_agreement(model, ShadowJob(PROMPT, full_depth.token_ids, full_depth.gated_record))
    assert result.tokens == result.agreements == 24
    # float32 rounding only: two forward passes of the same model differ by ~1e-7 per log-probability.
    assert result.kl_nats < 24e-6 and result.reverse_kl_nats < 24e-6

    gated = engine(model, no_eos).generate(PROMPT, params, record=True)
    assert gated.layers_skipped > 0
    result = full_depth_agreement(model, ShadowJob(PROMPT, gated.token_ids, gated.gated_record))
    assert result.tokens == 24 and 0 <= result.agreements <= 24
    assert result.kl_nats > 0.01 and result.reverse_kl_nats > 0.01


def test_greedy_agreement_is_the_full_depth_top1_against_the_emitted_token(model, no_eos):
    """For a plain greedy request the gated argmax is the emitted token: the old definition."""
    gated = engine(model, no_eos).generate(PROMPT, SamplingParams(max_tokens=24), record=True)
    np.testing.assert_array_equal(gated.gated_record.argmax, gated.token_ids)
    full_top1 = full_logprobs(model, PROMPT, gated.token_ids).argmax(dim=-1)
    expected = int((full_top1 == torch.tensor(gated.token_ids)).sum())
    result = full_depth_agreement(model, ShadowJob(PROMPT, gated.token_ids, gated.gated_record))
    assert result.agreements == expected < 24  # skipping changed some top-1 tokens


def test_the_sample_based_estimate_matches_the_exact_kl_at_temperature_one(model, no_eos):
    """The mean of log p_gated(y) - log p_full(y) over emitted y is unbiased for KL(gated || full) when y
    is drawn from the raw gated distribution (temperature 1, top_p 1, no adjustments): over ~1,000
    tokens it lies within 4 standard errors of the exact mean KL (k = V)."""
    eng = engine(model, no_eos, record_top_k=VOCAB_SIZE, max_batch_size=8)
    log_ratios, exact = [], []
    for seed in range(40):
        result = eng.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=100 + seed), record=True)
        full = full_logprobs(model, PROMPT, result.token_ids)
        gated = gated_logprobs(result.gated_record)
        exact.append((gated.exp() * (gated - full)).sum(dim=-1))
        emitted = torch.tensor(result.token_ids)[:, None]
        log_ratios.append((gated.gather(1, emitted) - full.gather(1, emitted))[:, 0])
        job = full_depth_agreement(model, ShadowJob(PROMPT, result.token_ids, result.gated_record))
        assert job.sampled_log_ratio == pytest.approx(float(log_ratios[-1].sum()), abs=1e-4)
    ratios, kl = torch.cat(log_ratios), torch.cat(exact)
    standard_error = float(ratios.std()) / math.sqrt(len(ratios))
    assert abs(float(ratios.mean()) - float(kl.mean())) < 4 * standard_error, (ratios.mean(), kl.mean())
