"""Every request field the compatibility issue listed, through the official `openai` client against a
live `layerwatch serve`: each works as OpenAI (or vLLM, for its extensions) defines it.

Log-probabilities, penalties and logit_bias are checked against a reference computed here from the
model's plain full-depth forward pass (prompt log-probabilities: from `layerwatch eval`'s
teacher-forced decoding, as the engine scores a prompt), on an in-process server at threshold 0
(nothing is skipped, so the served model is the full-depth model).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from layerwatch.inference_shim.offline.evaluation import teacher_forced_decode
from tests.service.conftest import MODEL_NAME, NUM_LAYERS

PROMPT = "In the beginning"


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def full_depth(tiny_checkpoint):
    """An in-process server that skips nothing (threshold 0), and its openai client."""
    from layerwatch.inference_shim.service.shim import ServeSettings, ShimService
    from tests.service.conftest import InProcessServer

    settings = ServeSettings(
        model_dir=tiny_checkpoint.path,
        model_name=MODEL_NAME,
        exporter_address="",
        max_tokens_cap=32,
        max_prompt_tokens=64,
        threshold=0.0,
    )
    torch.set_num_threads(1)
    with InProcessServer(ShimService.load(settings)) as server:
        yield server, openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=30)


def reference_greedy(service, prompt_ids: list[int], max_tokens: int, adjust) -> list[int]:
    """Greedy decoding by the model's full forward pass, `adjust(logits, generated)` before the argmax."""
    ids, generated = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = service.model(torch.tensor([ids]))[0][0, -1].double()
            token = int(adjust(logits, generated).argmax())
            generated.append(token)
            ids.append(token)
    return generated


# --- token limits -----------------------------------------------------------------------------------


def test_max_completion_tokens_limits_the_answer_and_wins_over_max_tokens(client):
    messages = [{"role": "user", "content": "Let there be light"}]
    alone = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=3)
    assert alone.usage.completion_tokens == 3 and alone.choices[0].finish_reason == "length"
    both = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=5, max_tokens=20, temperature=0
    )
    assert both.usage.completion_tokens == 5
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, extra_body={"max_completion_tokens": 4}, max_tokens=9
    )
    assert completion.usage.completion_tokens == 4


def test_health_answers_when_serving(server):
    response = httpx.get(f"{server.base_url}/health", timeout=10)
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_null_means_absent(client):
    # The openai client sends None as null; OpenAI reads null as "use the default".
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "echo", "stop", "max_tokens", "logprobs"])
    extra = dict.fromkeys(["ignore_eos", "stream_options", "presence_penalty", "logit_bias", "best_of"])
    with_nulls = client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=5, **nulls, extra_body=extra)
    omitted = client.completions.create(model=MODEL_NAME, prompt=PROMPT, seed=5)
    assert [c.text for c in with_nulls.choices] == [c.text for c in omitted.choices]
    assert with_nulls.usage == omitted.usage

    messages = [{"role": "user", "content": "darkness"}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, seed=5, max_tokens=4, temperature=None, top_p=None, n=None, stream=None,
        stop=None, logprobs=None, top_logprobs=None, max_completion_tokens=None,
        extra_body={"echo": None, "stream_options": {"include_usage": None}},
    )  # fmt: skip
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, seed=5, max_tokens=4)
    assert chat.choices[0].message.content == plain.choices[0].message.content

    with pytest.raises(openai.BadRequestError, match="model") as refused:  # a required field stays required
        client.completions.create(model=None, prompt=PROMPT)
    assert refused.value.body["param"] == "model"


# --- several choices and prompts ----------------------------------------------------------------------


def test_n_choices_each_drawn_on_its_own(client):
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=11)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.text for c in result.choices}) > 1  # three draws, not one answer thrice
    assert result.usage.completion_tokens == 18
    single = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6)
    assert result.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    extra = result.usage.model_extra
    assert extra["layers_executed"] + extra["layers_skipped"] == 18 * NUM_LAYERS
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in result.choices]  # the seed fixes every choice


def test_n_chat_choices_streamed_and_whole_agree(client):
    request = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "darkness"}],
        n=2,
        max_tokens=5,
        temperature=0.9,
        seed=4,
    )
    whole = client.chat.completions.create(**request)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_several_prompts_string_and_token_ids(client, server):
    prompts = [PROMPT, "And God said"]
    each = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.text for c in batch.choices] == [r.choices[0].text for r in each]
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in each)

    from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint

    tokenizer = load_checkpoint(server.checkpoint.path).tokenizer
    ids = [tokenizer.encode(p) for p in prompts]
    one = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=5, temperature=0)
    assert one.choices[0].text == each[0].choices[0].text and one.usage.prompt_tokens == len(ids[0])
    lists = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in lists.choices] == [c.text for c in batch.choices]


# --- log-probabilities -------------------------------------------------------------------------------


def test_completion_logprobs_whole_and_streamed(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and top[token] == logprob and len(top) <= 3  # tokens of one text share a key
        assert logprob == max(top.values())  # greedy: the chosen token is the most likely
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, stream=True
        )
        if c.choices[0].logprobs is not None
    ]
    assert sum((s.token_logprobs for s in streamed), []) == logprobs.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == logprobs.text_offset


def test_chat_logprobs_and_top_logprobs_whole_and_streamed(client):
    request = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Let there be light"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    whole = client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert bytes(entry.bytes).decode("utf-8") == entry.token
    streamed = [
        e
        for c in client.chat.completions.create(**request, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**{**request, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_echo_with_no_new_tokens_gives_the_prompts_logprobs(full_depth):
    server, client = full_depth
    service = server.service
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = result.choices[0]
    assert choice.text == PROMPT and result.usage.completion_tokens == 0
    ids = service.tokenizer.encode(PROMPT)
    assert result.usage.prompt_tokens == len(ids) == len(choice.logprobs.tokens)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    # The prompt is scored as `layerwatch eval` decodes a window (prefill 1); threshold 0: full depth.
    steps = []
    teacher_forced_decode(service.model, torch.tensor([ids]), 1, None, batch_size=1, on_step=steps.append)
    assert choice.logprobs.token_logprobs[1:] == [-float(s.losses[0]) for s in steps]  # the same kernels: bit for bit
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, echo=True, temperature=0)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=3, echo=True, temperature=0, stream=True
        )
    )
    assert streamed == echoed.choices[0].text


def test_generated_logprobs_are_the_models(full_depth):
    server, client = full_depth
    ids = server.service.tokenizer.encode(PROMPT)
    result = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0, logprobs=0)
    generated = reference_greedy(server.service, ids, 4, lambda logits, _: logits)
    assert result.choices[0].logprobs.tokens == [server.service.tokenizer.decode([t]) for t in generated]
    # The generated tokens' log-probabilities are `layerwatch eval`'s losses for them, decoded after a
    # prefill of the prompt (threshold 0: full depth): the same kernels, so bit for bit. (Against the
    # one-pass forward they differ by float32 summation order, which depends on the CPU's kernels.)
    steps = []
    context = torch.tensor([ids + generated])
    teacher_forced_decode(server.service.model, context, len(ids), None, batch_size=1, on_step=steps.append)
    assert result.choices[0].logprobs.token_logprobs == [-float(s.losses[0]) for s in steps]


# --- logit_bias and penalties ----------------------------------------------------------------------


def test_logit_bias_and_penalties_match_a_reference(full_depth):
    server, client = full_depth
    service = server.service
    ids = service.tokenizer.encode(PROMPT)
    plain = reference_greedy(service, ids, 8, lambda logits, _: logits)
    banned = plain[0]

    def biased(logits, _):
        return logits + torch.nn.functional.one_hot(torch.tensor(banned), len(logits)) * -100.0

    def penalised(logits, generated):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(logits)).double()
        return logits - 1.5 * counts - 0.5 * (counts > 0).double()

    def served(**fields) -> list[str]:
        result = client.completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0, logprobs=0, **fields
        )
        return result.choices[0].logprobs.tokens

    def texts(token_ids: list[int]) -> list[str]:
        return [service.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    with_bias = reference_greedy(service, ids, 8, biased)
    assert texts(with_bias) != texts(plain)
    assert served(logit_bias={str(banned): -100}) == texts(with_bias)
    with_penalties = reference_greedy(service, ids, 8, penalised)
    assert texts(with_penalties) != texts(plain)  # the penalties change this generation: the test can tell
    assert served(frequency_penalty=1.5, presence_penalty=0.5) == texts(with_penalties)


# --- numerically safe sampling -------------------------------------------------------------------


@pytest.mark.parametrize("hostile", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 2.0, "top_p": 1e-300}])
def test_extreme_sampling_values_fail_nobody(server, hostile):
    """A request with an extreme (accepted) sampling value and four greedy victims in one batch: all
    succeed, and the victims get what they get alone."""
    victims = [f"{PROMPT} {word}" for word in ("light", "darkness", "waters", "earth")]

    def post(prompt: str, **fields) -> httpx.Response:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, **fields}
        return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)

    alone = [post(p).json()["choices"][0]["text"] for p in victims]
    with ThreadPoolExecutor(5) as pool:
        attacker = pool.submit(post, PROMPT, **{"temperature": 1.0, **hostile, "seed": 1})
        together = [pool.submit(post, p) for p in victims]
        responses = [attacker.result(), *(f.result() for f in together)]
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    assert [r.json()["choices"][0]["text"] for r in responses[1:]] == alone
    assert responses[0].json()["usage"]["completion_tokens"] == 24
    assert all(math.isfinite(v) for v in server.metrics().values() if isinstance(v, float))


# --- vLLM's token bans and token ids in logprobs -------------------------------------------------------


def served_ids(client, **fields) -> list[list[int]]:
    """Each choice's generated token ids, read from its logprobs (return_tokens_as_token_ids)."""
    result = client.completions.create(
        model=MODEL_NAME,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, **fields.pop("extra", {})},
        **fields,
    )
    return [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens] for c in result.choices]


def vllm_bad_words(tokenizer, word: str) -> list[list[int]]:
    """The token sequences vLLM bans for a bad word (its `update_from_tokenizer`), and the word's own."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    own = tokenizer.encode(word, add_special_tokens=False)
    return [bare, *([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else []), own]


def completes(sequences: list[list[int]], generated: list[int]) -> list[int]:
    return [
        s[-1] for s in sequences if len(s) <= len(generated) + 1 and generated[len(generated) - len(s) + 1 :] == s[:-1]
    ]


def contains(generated: list[int], sequence: list[int]) -> bool:
    return any(generated[i : i + len(sequence)] == sequence for i in range(len(generated)))


def test_return_tokens_as_token_ids_names_each_token_by_its_id(full_depth):
    server, client = full_depth
    ids = server.service.tokenizer.encode(PROMPT)
    result = client.completions.create(
        model=MODEL_NAME,
        prompt=ids,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    logprobs = result.choices[0].logprobs
    generated = reference_greedy(server.service, ids, 5, lambda logits, _: logits)
    assert logprobs.tokens == [f"token_id:{t}" for t in generated]
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs for key in top)
    decoded = [server.service.tokenizer.decode([t], skip_special_tokens=False) for t in generated]
    assert logprobs.text_offset == [sum(len(t) for t in decoded[:i]) for i in range(5)]  # still the text's
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "light"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert all(
        e.token.startswith("token_id:") and e.top_logprobs[0].token.startswith("token_id:")
        for e in chat.choices[0].logprobs.content
    )


def words_in(tokenizer, generated: list[int], size: int) -> list[str]:
    """The texts of `size` consecutive generated tokens that tokenize back to those tokens."""
    pieces = [generated[i : i + size] for i in range(len(generated) - size + 1)]
    texts = [tokenizer.decode(p) for p in pieces]
    return [t for p, t in zip(pieces, texts) if t.strip() and tokenizer.encode(t, add_special_tokens=False) == p]


@pytest.mark.parametrize("size", [1, 2])
def test_bad_words_are_banned_as_vllm_bans_them(full_depth, size):
    """Greedy: the served tokens are a reference's that bans, at each step, the last token of every
    bad word's token sequence whose other tokens end the generation (one-token words always)."""
    server, client = full_depth
    service, tokenizer = server.service, server.service.tokenizer
    ids = tokenizer.encode(PROMPT)
    plain = reference_greedy(service, ids, 12, lambda logits, _: logits)
    words = words_in(tokenizer, plain, size)[:1]  # a word this generation says
    sequences = [s for w in words for s in vllm_bad_words(tokenizer, w)]
    assert words and any(len(s) == size for s in sequences)

    def banned(logits, generated):
        logits = logits.clone()
        logits[completes(sequences, generated)] = float("-inf")
        return logits

    expected = reference_greedy(service, ids, 12, banned)
    assert expected != plain  # the ban changes this generation: the test can tell
    assert not any(contains(expected, s) for s in sequences)
    assert served_ids(client, prompt=ids, max_tokens=12, temperature=0, extra={"bad_words": words}) == [expected]


def test_sampled_choices_never_hold_a_bad_word_and_keep_to_allowed_token_ids(full_depth):
    server, client = full_depth
    tokenizer = server.service.tokenizer
    sampled = dict(prompt=PROMPT, max_tokens=24, temperature=0.9, n=6, seed=7)
    free = served_ids(client, **sampled)
    # Words these choices say, one and two tokens long: banning them must change what is drawn.
    words = sorted({w for c in free for size in (1, 2) for w in words_in(tokenizer, c, size)})[:8]
    sequences = [s for w in words for s in vllm_bad_words(tokenizer, w)]
    assert any(contains(c, s) for c in free for s in sequences if len(s) == 2)
    for choice in served_ids(client, **sampled, extra={"bad_words": words}):
        assert not any(contains(choice, s) for s in sequences), (choice, sequences)
    allowed = sorted({t for c in free for t in c})[:5]
    for choice in served_ids(client, **sampled, extra={"allowed_token_ids": allowed}):
        assert set(choice) <= set(allowed)
    # Greedy too: the most likely allowed token.
    ids = tokenizer.encode(PROMPT)
    only = torch.full((server.service.model.config.vocab_size,), float("-inf"), dtype=torch.float64)
    only[allowed] = 0.0
    expected = reference_greedy(server.service, ids, 6, lambda logits, _: logits + only)
    assert served_ids(client, prompt=ids, max_tokens=6, temperature=0, extra={"allowed_token_ids": allowed}) == [
        expected
    ]


def test_bans_that_leave_nothing_to_draw_are_refused(server):
    from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint

    tokenizer = load_checkpoint(server.checkpoint.path).tokenizer
    (token,) = tokenizer.encode(" the", add_special_tokens=False)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "allowed_token_ids": [token], "bad_words": [" the"]}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "allowed_token_ids"
    for field, value in (("allowed_token_ids", [320]), ("allowed_token_ids", []), ("bad_words", ["  "])):
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, field: value}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
