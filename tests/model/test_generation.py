"""The generation engine's contract: sampling, stop conditions, streaming, cancellation, accounting."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from layerwatch.inference_shim.runtime.depth_execution import DepthExecutionConfig
from layerwatch.inference_shim.runtime.engine import NUCLEUS_CANDIDATES, GenerationEngine, SamplingParams, sample_token
from layerwatch.inference_shim.runtime.model import KVCache
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.skip_policy import SkipPolicyConfig

from .conftest import random_gates, random_model, tiny_config

PROMPT = [0, 17, 54, 120, 9]


@pytest.fixture
def model():
    model = random_model(tiny_config(eos_token_ids=()), seed=2)
    model.attach_gates(random_gates(model.config, seed=3))
    return model


@pytest.fixture
def no_eos(backend_tokenizer) -> Tokenizer:
    return Tokenizer(backend_tokenizer, bos_token="<s>", add_bos_token=True)


def engine(model, tokenizer, **options) -> GenerationEngine:
    return GenerationEngine(model, tokenizer, model_name="tiny", policy=SkipPolicyConfig(threshold=0.5), **options)


def stream(eng: GenerationEngine, prompt, params):
    """Run one sequence through step(), collecting its updates."""
    sequence_id = eng.submit(prompt, params)
    updates = []
    while eng.has_work():
        updates += [u for u in eng.step() if u.sequence_id == sequence_id]
    return updates


def test_greedy_runs_to_max_tokens_with_consistent_accounting(model, no_eos):
    records, prefills = [], []
    eng = engine(model, no_eos, step_hook=records.append, prefill_hook=prefills.append)
    result = eng.generate(PROMPT, SamplingParams(max_tokens=12))
    assert result.finish_reason == "length" and result.completion_tokens == 12 == len(result.token_ids)
    assert result.prompt_tokens == len(PROMPT)
    assert len(records) == 12  # one decode step per generated token
    assert [int(r.token_ids[0]) for r in records] == [PROMPT[-1]] + result.token_ids[:-1]
    assert [int(r.next_token_ids[0]) for r in records] == result.token_ids
    assert result.activity.shape == (12, model.config.num_layers)
    assert result.layers_executed + result.layers_skipped == 12 * model.config.num_layers
    assert result.layers_executed == int(result.activity.sum())
    assert [r.step for r in records] == list(range(1, 13))
    assert all(r.step_seconds > 0 for r in records)
    (prefill,) = prefills
    assert prefill.token_ids.tolist() == PROMPT[:-1] and prefill.entropies.shape == (4, model.config.num_layers)
    assert result.text == no_eos.decode(result.token_ids)
    assert eng.generate(PROMPT, SamplingParams(max_tokens=12)).token_ids == result.token_ids


def test_streamed_deltas_add_up_to_the_text(model, no_eos):
    updates = stream(engine(model, no_eos), PROMPT, SamplingParams(max_tokens=30))
    assert [u.finished for u in updates] == [False] * 29 + [True]
    tokens = [t for u in updates for t in u.new_token_ids]
    assert "".join(u.text_delta for u in updates) == no_eos.decode(tokens)
    assert updates[-1].layers_executed + updates[-1].layers_skipped == 30 * model.config.num_layers


def test_eos_stops_and_counts_as_a_generated_token(model, backend_tokenizer, no_eos):
    free = engine(model, no_eos).generate(PROMPT, SamplingParams(max_tokens=20)).token_ids
    eos = free[4]
    first = free.index(eos)
    stopping = Tokenizer(backend_tokenizer, bos_token="<s>", extra_eos_token_ids=[eos], add_bos_token=True)
    result = engine(model, stopping).generate(PROMPT, SamplingParams(max_tokens=20))
    assert result.finish_reason == "stop"
    assert result.token_ids == free[: first + 1] and result.completion_tokens == first + 1


def test_stop_string_cuts_the_text_and_is_never_streamed(model, no_eos):
    text = engine(model, no_eos).generate(PROMPT, SamplingParams(max_tokens=40)).text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    updates = stream(engine(model, no_eos), PROMPT, SamplingParams(max_tokens=40, stop=("never seen", stop)))
    streamed = "".join(u.text_delta for u in updates)
    assert streamed == text[:cut]
    assert updates[-1].finish_reason == "stop"


def test_sampling_is_reproducible_per_seed_and_batch_independent(model, no_eos):
    params = SamplingParams(max_tokens=25, temperature=1.0, top_p=0.95, seed=42)
    first = engine(model, no_eos).generate(PROMPT, params).token_ids
    assert engine(model, no_eos).generate(PROMPT, params).token_ids == first
    other_seed = engine(model, no_eos).generate(PROMPT, SamplingParams(max_tokens=25, temperature=1.0, seed=43))
    assert other_seed.token_ids != first
    # A neighbour in the batch changes nothing where every row runs as it decided (depth execution
    # "rows"; the other modes may run a row deeper or shallower for its batch's sake).
    eng = engine(model, no_eos, depth=DepthExecutionConfig("rows"))
    eng.submit([0, 9, 9], SamplingParams(max_tokens=25, temperature=1.0, seed=7))
    assert eng.generate(PROMPT, params).token_ids == first


def test_tiny_top_p_is_greedy(model, no_eos):
    greedy = engine(model, no_eos).generate(PROMPT, SamplingParams(max_tokens=20)).token_ids
    nucleus = engine(model, no_eos).generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.5, top_p=1e-6, seed=1))
    assert nucleus.token_ids == greedy


def test_cancel_takes_effect_at_the_next_step(model, no_eos):
    eng = engine(model, no_eos, max_batch_size=1)
    running = eng.submit(PROMPT, SamplingParams(max_tokens=50))
    waiting = eng.submit(PROMPT, SamplingParams(max_tokens=3))
    eng.step()
    eng.step()
    eng.cancel(running)
    eng.cancel(12345)  # unknown: ignored
    updates = eng.step()
    cancelled = [u for u in updates if u.sequence_id == running]
    assert cancelled == [cancelled[0]] and cancelled[0].finish_reason == "cancelled" and not cancelled[0].new_token_ids
    assert [u.sequence_id for u in updates if u.new_token_ids] == [waiting]  # the slot went to the next one
    eng.cancel(waiting)
    assert [u.finish_reason for u in eng.step()] == ["cancelled"]
    assert not eng.has_work()


def test_more_sequences_than_slots_all_finish(model, no_eos):
    eng = engine(model, no_eos, max_batch_size=2)
    ids = [eng.submit(PROMPT[:n], SamplingParams(max_tokens=6)) for n in (1, 2, 3, 4, 5)]
    finished = {}
    while eng.has_work():
        finished.update({u.sequence_id: u for u in eng.step() if u.finished})
    assert sorted(finished) == ids and all(u.finish_reason == "length" for u in finished.values())


def test_a_request_of_many_sequences_takes_turns_with_one_that_came_after_it(model, no_eos):
    """Before: waiting sequences took free slots first come, first served, so a request of 128
    prompts held every slot until its last prompt was done (three 4-token chats sent meanwhile got
    0 tokens in 60 s). Now a free slot goes to the request holding the fewest."""
    eng = engine(model, no_eos, max_batch_size=2)
    big = [eng.submit(PROMPT, SamplingParams(max_tokens=4), request_id="big") for _ in range(6)]
    small = eng.submit(PROMPT, SamplingParams(max_tokens=4), request_id="small")
    finished = []
    while eng.has_work():
        finished += [u.sequence_id for u in eng.step() if u.finished]
    # The big request's first two run alone; the small one takes the first slot that frees.
    assert finished.index(small) < finished.index(big[3]), finished


def test_a_request_scoring_its_prompts_leaves_half_the_slots_to_whoever_comes_next(model, no_eos):
    """Before: a request of prompts scored with echo (a decode step per prompt token, 60.9 s for
    1,000 tokens against 5.2 s for a prefill) took every free slot; a chat sent a step later waited
    for one of them to finish scoring."""
    eng = engine(model, no_eos, max_batch_size=4)
    prompt = PROMPT * 4
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
    echo = [eng.submit(prompt, scored, request_id="echo") for _ in range(6)]
    eng.step()  # the first two score; two slots stay free
    chat = eng.submit(PROMPT, SamplingParams(max_tokens=2), request_id="chat")
    order = []
    while eng.has_work():
        order += [u.sequence_id for u in eng.step() if u.finished or u.new_token_ids]
    assert order.index(chat) < min(order.index(e) for e in echo), order


def test_prompt_scoring_of_several_requests_together_leaves_half_the_slots(model, no_eos):
    """Before: the half was counted per request, so two requests scoring their prompts took every
    slot between them, and a chat sent a step later waited for a scored prompt to finish."""
    eng = engine(model, no_eos, max_batch_size=4)
    prompt = PROMPT * 4
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
    echo = [eng.submit(prompt, scored, request_id=request) for request in ("a", "b") for _ in range(2)]
    eng.step()  # one of each request scores; two slots stay free
    chat = eng.submit(PROMPT, SamplingParams(max_tokens=2), request_id="chat")
    order = []
    while eng.has_work():
        order += [u.sequence_id for u in eng.step() if u.finished or u.new_token_ids]
    assert order.index(chat) < min(order.index(e) for e in echo), order


def test_model_without_gates_runs_full_depth(no_eos):
    records = []
    plain = random_model(tiny_config(eos_token_ids=()), seed=2)
    result = engine(plain, no_eos, step_hook=records.append).generate(PROMPT, SamplingParams(max_tokens=5))
    assert result.layers_skipped == 0
    assert all(np.isnan(r.entropies).all() and not r.skipped.any() for r in records)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "at least one token"),
        ([0, 300], SamplingParams(), "token ids must be in 0..299"),
        (list(range(70)), SamplingParams(), "exceeds max_seq_len=64"),
        (PROMPT, SamplingParams(max_tokens=-1), "max_tokens"),
        (PROMPT, SamplingParams(logit_bias={300: 1.0}), "logit_bias token ids must be in 0..299"),
        (PROMPT, SamplingParams(logit_bias={5: 101.0}), "logit_bias values"),
        (PROMPT, SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (PROMPT, SamplingParams(logprobs=21), "logprobs"),
        (PROMPT, SamplingParams(temperature=-1.0), "temperature"),
        (PROMPT, SamplingParams(top_p=0.0), "top_p"),
        (PROMPT, SamplingParams(stop=("",)), "stop strings"),
        (PROMPT, SamplingParams(allowed_token_ids=(5, 300)), "allowed_token_ids token ids must be in 0..299"),
        (PROMPT, SamplingParams(allowed_token_ids=()), "at least one token"),
        (PROMPT, SamplingParams(bad_words=((4, 300),)), "bad_words token ids must be in 0..299"),
        (PROMPT, SamplingParams(bad_words=((),)), "must not be empty"),
    ],
)
def test_bad_requests_are_refused_at_submit(model, no_eos, prompt, params, message):
    eng = engine(model, no_eos, max_seq_len=64)
    with pytest.raises(ValueError, match=message):
        eng.submit(prompt, params)
    assert not eng.has_work()


def test_engine_settings_are_checked(model, no_eos):
    with pytest.raises(ValueError, match="kv_policy"):
        engine(model, no_eos, kv_policy="drop")
    with pytest.raises(ValueError, match="max_seq_len must be in 2..512"):
        engine(model, no_eos, max_seq_len=1000)


class DeviceReads(TorchFunctionMode):
    """Records every torch call that makes the host wait for a tensor's value."""

    WAITING = {
        "cpu",
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "nonzero",
        "masked_select",
        "any",
        "all",
    }

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        to_host = name == "to" and any(str(a) == "cpu" for a in [*args[1:], kwargs.get("device")])
        bool_index = name in ("__getitem__", "__setitem__") and _has_bool_tensor(args[1])
        if name in self.WAITING or to_host or bool_index:
            self.calls.append(name)
        return func(*args, **kwargs)


def _has_bool_tensor(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def test_prefill_computes_logits_for_the_last_position_only(model, no_eos):
    head_rows = []  # positions the LM head computed, per call
    model.lm_head.register_forward_hook(lambda _, __, logits: head_rows.append(logits.numel() // logits.shape[-1]))
    prefills = []
    eng = engine(model, no_eos, prefill_hook=prefills.append)
    eng.submit(PROMPT, SamplingParams(max_tokens=1))
    eng.step()
    assert len(prefills[0].token_ids) == len(PROMPT) - 1 > 1
    assert head_rows == [1, 1]  # prefill's last position, then the one decode step


def test_a_decode_step_reads_the_device_exactly_once(model, no_eos):
    # The skip decision must never wait on the device: within a step, the only device read is the
    # packed tokens + entropies after the last layer (here: `.cpu()` and then `.numpy()` of its copy).
    eng = engine(model, no_eos)
    eng.submit(PROMPT, SamplingParams(max_tokens=20))
    eng.submit([0, 9, 9], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=1))
    records = []
    eng.step_hook = records.append
    eng.step()  # admission and prefill read their own results; decode steps follow
    for _ in range(15):
        with DeviceReads() as reads:
            eng.step()
        assert reads.calls == ["cpu", "numpy"]
    assert any(r.skipped.any() for r in records)  # the steps did skip layers


class KernelCounts(TorchDispatchMode):
    """Counts the aten ops (kernels) dispatched inside the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_llama_decode_step_runs_no_family_kernels(model):
    # The family features are off for a Llama and cost it nothing: per layer two norms and one
    # SiLU, attention through SDPA; no soft-cap tanh, no hand-written softmax, no window mask.
    L = model.config.num_layers
    cache = KVCache(model.config, slots=2, max_len=32, dtype=torch.float32, device="cpu")
    model.prefill(torch.tensor(PROMPT), cache, slot=0)
    run_mask = np.ones((1, L), dtype=bool)
    run_mask[0, 1] = False
    for mask in (None, run_mask):
        with KernelCounts() as kernels:
            model.decode_step(torch.tensor([5]), cache, slots=[0], positions=[len(PROMPT)], run_mask=mask)
        ops = kernels.ops
        attention = sum(n for name, n in ops.items() if "scaled_dot_product" in name)
        assert attention == (L if mask is None else L - 1)
        assert ops["rsqrt"] == L + attention + 1  # every input norm (the gates read it), run layers' MLP norm, final
        assert ops["silu"] == attention
        assert not {"tanh", "_softmax", "arange"} & set(ops)
        assert ops["gelu"] == 1  # the gates, all layers batched


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=1e-300)])
def test_extreme_sampling_values_sample_the_most_likely_token(model, no_eos, params):
    # Regression: 1e-300 is 0 in float32, so the draw divided by zero (or the nucleus kept nothing)
    # and torch.multinomial raised for the whole batch.
    greedy = engine(model, no_eos).generate(PROMPT, SamplingParams(max_tokens=6))
    params.max_tokens, params.seed = 6, 3
    assert engine(model, no_eos).generate(PROMPT, params).token_ids == greedy.token_ids


def test_a_row_with_non_finite_logits_fails_alone(model, no_eos):
    eng = engine(model, no_eos)
    victim = eng.submit(PROMPT, SamplingParams(max_tokens=4))
    broken = eng.submit([0, 9, 9], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    real_step = eng.model.decode_step

    def nan_for_the_second_row(*args, **kwargs):
        logits, entropies = real_step(*args, **kwargs)
        if len(logits) == 2:  # the broken row is the second while both run
            logits[1] = float("nan")
        return logits, entropies

    eng.model.decode_step = nan_for_the_second_row
    finals = {}
    while eng.has_work():
        finals.update({u.sequence_id: u for u in eng.step() if u.finished})
    assert finals[broken].finish_reason == "error" and "non-finite logits" in finals[broken].error
    assert finals[victim].finish_reason == "length" and finals[victim].error is None


def test_bans_that_leave_no_token_fail_that_sequence_alone(model, no_eos):
    """allowed_token_ids {a, b}, b banned always and a after a: the first token is a, and then no
    token is left; that sequence fails with the reason, its batch neighbour goes on."""
    eng = engine(model, no_eos)
    a, b = 40, 41
    banned = eng.submit(PROMPT, SamplingParams(max_tokens=4, allowed_token_ids=(a, b), bad_words=((b,), (a, a))))
    neighbour = eng.submit(PROMPT, SamplingParams(max_tokens=4))
    updates = []
    while eng.has_work():
        updates += eng.step()
    mine = [u for u in updates if u.sequence_id == banned]
    assert [t for u in mine for t in u.new_token_ids] == [a]
    assert mine[-1].finish_reason == "error" and "no token" in mine[-1].error
    assert [u for u in updates if u.sequence_id == neighbour][-1].finish_reason == "length"


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p distribution, written out: the smallest most-likely prefix reaching top_p, renormalised."""
    probs = torch.softmax(logits.double(), dim=-1)
    ordered, order = probs.sort(descending=True)
    kept = ordered.cumsum(-1) - ordered < top_p
    return torch.zeros_like(probs).scatter(-1, order, ordered * kept) / (ordered * kept).sum()


@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_a_draw_sorts_no_real_vocabulary_and_follows_the_nucleus(top_p):
    # Sorting the whole vocabulary for the nucleus and drawing with torch.multinomial would cost
    # 11 ms and 2.4 ms per token on SmolLM2-135M's 49,152 (benchmarks/sampling.py).
    vocab = 49_152
    logits = torch.full((vocab,), -20.0)
    logits[:6] = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0])  # a peaked next-token distribution
    generator = torch.Generator().manual_seed(0)
    with KernelCounts() as kernels:
        sample_token(logits, 1.0, top_p, generator)
    assert not {"sort", "multinomial"} & set(kernels.ops), kernels.ops
    draws = torch.stack([sample_token(logits, 1.0, top_p, generator) for _ in range(4000)])
    frequencies = torch.bincount(draws, minlength=vocab).double() / len(draws)
    expected = nucleus(logits, top_p)
    # Within 4 binomial standard errors of each token's probability, or one draw (one seed: the same every run).
    error = 4 * (expected * (1 - expected) / len(draws)).sqrt() + 1 / len(draws)
    assert bool(((frequencies - expected).abs() <= error).all())


def test_a_nucleus_beyond_the_top_candidates_is_cut_from_the_whole_vocabulary():
    logits = torch.zeros(3 * NUCLEUS_CANDIDATES)  # flat: top_p 0.5 keeps half the vocabulary
    logits[0] = 1.0
    generator = torch.Generator().manual_seed(1)
    draws = torch.stack([sample_token(logits, 1.0, 0.5, generator) for _ in range(3000)])
    assert int(draws.max()) >= NUCLEUS_CANDIDATES  # tokens past the candidates are drawn too
    assert bool((nucleus(logits, 0.5)[draws] > 0).all())  # and none outside the nucleus
