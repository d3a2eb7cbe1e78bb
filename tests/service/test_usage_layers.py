"""`usage.layers_executed` / `layers_skipped` are the layers the request really ran and skipped:
streamed (`stream_options.include_usage`) as whole, for several choices and prompts and for chat,
and equal to what the shim's counters moved by. The field's complaint was streaming usage that
claimed full depth. With the official `openai` client against the live session server.
"""

from __future__ import annotations

import openai
import pytest

from tests.service.conftest import MODEL_NAME, NUM_LAYERS
from tests.support import sample_sum

COMPLETION = {"prompt": "And the evening and the morning", "max_tokens": 14, "temperature": 0}
REQUESTS = {
    "completion, n=2": ("completions", {**COMPLETION, "n": 2}),
    "completion, two prompts": ("completions", {**COMPLETION, "prompt": ["And God said", "the face of the deep"]}),
    "chat, n=2": (
        "chat",
        {"messages": [{"role": "user", "content": "Let there be light"}], "max_tokens": 11, "temperature": 0, "n": 2},
    ),
}
LAYER_FIELDS = ("layers_executed", "layers_skipped")


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=30)


def create(client: openai.OpenAI, endpoint: str, **body):
    api = client.chat.completions if endpoint == "chat" else client.completions
    return api.create(model=MODEL_NAME, **body)


def usage_of(usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        **{field: usage.model_extra[field] for field in LAYER_FIELDS},
    }


def counted(server) -> dict[str, float]:
    """The shim's counters that `usage` must agree with."""
    metrics = server.metrics()
    return {
        "completion_tokens": sample_sum(metrics, "layerwatch_tokens_total", phase="decode"),
        "layers_executed": sample_sum(metrics, "layerwatch_layers_executed_sum"),
        "layers_skipped": sample_sum(metrics, "layerwatch_layer_skips_executed_total"),
        "choices": sample_sum(metrics, "layerwatch_request_skip_fraction_count"),
    }


@pytest.mark.parametrize("name", list(REQUESTS))
def test_streamed_usage_is_the_whole_answers_and_the_counters(client, server, name):
    endpoint, body = REQUESTS[name]
    whole = create(client, endpoint, **body)
    server.wait_idle()
    before = counted(server)
    chunks = list(create(client, endpoint, **body, stream=True, stream_options={"include_usage": True}))
    server.wait_idle()
    after = counted(server)

    *answer, last = chunks
    assert last.choices == [] and all(chunk.usage is None for chunk in answer)  # usage comes once, last
    streamed = usage_of(last.usage)
    assert streamed == usage_of(whole.usage)  # greedy: the same tokens, so the same layers
    choices = len(whole.choices)
    assert choices == 2
    assert streamed["layers_executed"] + streamed["layers_skipped"] == streamed["completion_tokens"] * NUM_LAYERS
    assert streamed["layers_skipped"] > 0  # not full depth: the test gates skip the middle layers
    moved = {key: after[key] - before[key] for key in after}
    assert moved == {
        "completion_tokens": streamed["completion_tokens"],
        "layers_executed": streamed["layers_executed"],
        "layers_skipped": streamed["layers_skipped"],
        "choices": choices,
    }


def test_a_stream_without_include_usage_has_no_usage_chunk(client):
    endpoint, body = REQUESTS["chat, n=2"]
    chunks = list(create(client, endpoint, **body, stream=True))
    assert chunks and all(chunk.usage is None and chunk.choices for chunk in chunks)
