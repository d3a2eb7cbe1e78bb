"""The official `openai` client against a live `layerwatch serve`: completions, chat, streaming."""

from __future__ import annotations

import openai
import pytest

from tests.service.conftest import MODEL_NAME, NUM_LAYERS


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=30)


def assert_usage(usage, completion_tokens: int) -> None:
    assert usage.completion_tokens == completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = usage.model_extra
    assert extra["layers_executed"] + extra["layers_skipped"] == completion_tokens * NUM_LAYERS
    assert extra["layers_skipped"] > 0  # the test gates make layers 1-2 skippable after the patience


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_completion(client):
    result = client.completions.create(model=MODEL_NAME, prompt="In the beginning", max_tokens=12, temperature=0)
    choice = result.choices[0]
    assert result.object == "text_completion" and result.model == MODEL_NAME
    assert choice.finish_reason == "length" and choice.text
    assert_usage(result.usage, 12)
    again = client.completions.create(model=MODEL_NAME, prompt="In the beginning", max_tokens=12, temperature=0)
    assert again.choices[0].text == choice.text  # greedy is deterministic, whatever shares the batch


def test_chat_completion(client):
    result = client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=10,
        temperature=0.7,
        seed=3,
        messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Let there be light"}],
    )
    message = result.choices[0].message
    assert message.role == "assistant" and message.content
    assert result.choices[0].finish_reason == "length"
    assert_usage(result.usage, 10)


def test_streaming_completion_matches_the_whole_one(client):
    whole = client.completions.create(model=MODEL_NAME, prompt="And God said", max_tokens=9, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="And God said",
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None
    assert_usage(chunks[-1].usage, 9)
    assert chunks[-1].usage.model_extra == whole.usage.model_extra


def test_streaming_chat(client):
    messages = [{"role": "user", "content": "darkness was upon the face of the deep"}]
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=7,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=7, temperature=0)
    assert content == whole.choices[0].message.content
    assert_usage(chunks[-1].usage, 7)


def test_unknown_model_is_a_404_the_client_understands(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
