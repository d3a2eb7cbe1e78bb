"""Every kind of bad input gets an OpenAI-style error body and a 4xx, and the server keeps serving."""

from __future__ import annotations

import json
import tracemalloc

import httpx
import pytest
from pydantic import ValidationError

from benchmarks.invalid_body import hostile_bodies
from layerwatch.inference_shim.service import schemas
from tests.service.conftest import MODEL_NAME
from tests.support import sample_sum

LONG_PROMPT = " ".join(f"word{i}" for i in range(400))  # far over --max-prompt-tokens 96
DEEP = b"[" * 2000 + b"]" * 2000  # 4 KB, past the JSON parser's recursion limit
HUGE = b"9" * 4301  # past Python's int/str conversion limit


def completion(**overrides) -> dict:
    return {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 4, **overrides}


def chat(**overrides) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Let there be light"}], **overrides}


CASES = [
    # (id, path, raw body or JSON object, headers, status, code)
    ("not-json", "/v1/completions", b"{not json", {}, 400, "invalid_json"),
    ("empty-body", "/v1/completions", b"", {}, 400, "invalid_json"),
    ("json-array", "/v1/completions", [1, 2], {}, 400, "invalid_json"),
    ("invalid-utf8", "/v1/completions", b'{"model": "tiny-test", "prompt": "caf\xe9"}', {}, 400, "invalid_encoding"),
    ("lone-surrogate", "/v1/completions", b'{"model": "tiny-test", "prompt": "\\ud800"}', {}, 400, "invalid_value"),
    ("missing-prompt", "/v1/completions", {"model": MODEL_NAME}, {}, 400, "invalid_value"),
    ("missing-model", "/v1/completions", {"prompt": "hi"}, {}, 400, "invalid_value"),
    ("wrong-type", "/v1/completions", completion(max_tokens="many"), {}, 400, "invalid_value"),
    ("string-for-number", "/v1/completions", completion(max_tokens="5"), {}, 400, "invalid_value"),
    ("string-for-boolean", "/v1/completions", completion(stream="yes"), {}, 400, "invalid_value"),
    ("token-id-out-of-vocabulary", "/v1/completions", completion(prompt=[1, 320]), {}, 400, "invalid_value"),
    ("negative-token-id", "/v1/completions", completion(prompt=[[1, -2]]), {}, 400, "invalid_value"),
    ("mixed-prompt-list", "/v1/completions", completion(prompt=["a", 1]), {}, 400, "invalid_value"),
    ("empty-prompt-list", "/v1/completions", completion(prompt=[]), {}, 400, "invalid_value"),
    (
        "image-content",
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {},
        400,
        "invalid_value",
    ),
    ("zero-max-tokens", "/v1/completions", completion(max_tokens=0), {}, 400, "invalid_value"),
    ("temperature-out-of-range", "/v1/completions", completion(temperature=7), {}, 400, "invalid_value"),
    ("seed-out-of-range", "/v1/completions", completion(seed=-1), {}, 400, "invalid_value"),
    ("n-zero", "/v1/completions", completion(n=0), {}, 400, "invalid_value"),
    ("too-many-choices", "/v1/completions", completion(prompt=["a", "b"], n=65), {}, 400, "invalid_value"),
    ("best-of-above-n", "/v1/completions", completion(best_of=2), {}, 400, "invalid_value"),
    ("logprobs-above-20", "/v1/completions", completion(logprobs=21), {}, 400, "invalid_value"),
    ("logit-bias-key-not-a-token-id", "/v1/completions", completion(logit_bias={"x": 1}), {}, 400, "invalid_value"),
    (
        "logit-bias-token-out-of-vocabulary",
        "/v1/completions",
        completion(logit_bias={"320": 1}),
        {},
        400,
        "invalid_value",
    ),
    ("logit-bias-above-100", "/v1/completions", completion(logit_bias={"5": 101}), {}, 400, "invalid_value"),
    ("presence-penalty-above-2", "/v1/completions", completion(presence_penalty=2.5), {}, 400, "invalid_value"),
    ("frequency-penalty-below-2", "/v1/completions", completion(frequency_penalty=-3), {}, 400, "invalid_value"),
    (
        "json-response-format",
        "/v1/completions",
        completion(response_format={"type": "json_object"}),
        {},
        400,
        "unsupported_parameter",
    ),
    ("suffix", "/v1/completions", completion(suffix="and the end"), {}, 400, "unsupported_parameter"),
    ("top-k", "/v1/completions", completion(top_k=5), {}, 400, "unsupported_parameter"),
    (
        "zero-max-tokens-with-echo-above-cap",
        "/v1/completions",
        completion(max_tokens=49, echo=True),
        {},
        400,
        "max_tokens_exceeded",
    ),
    ("empty-stop", "/v1/completions", completion(stop=[""]), {}, 400, "invalid_value"),
    ("empty-prompt", "/v1/completions", completion(prompt=""), {}, 400, "empty_prompt"),
    ("over-long-prompt", "/v1/completions", completion(prompt=LONG_PROMPT[:6000]), {}, 400, "context_length_exceeded"),
    ("max-tokens-above-cap", "/v1/completions", completion(max_tokens=49), {}, 400, "max_tokens_exceeded"),
    (
        "max-completion-tokens-above-cap",
        "/v1/completions",
        completion(max_tokens=4, max_completion_tokens=49),
        {},
        400,
        "max_tokens_exceeded",
    ),
    ("unknown-model", "/v1/completions", completion(model="gpt-17"), {}, 404, "model_not_found"),
    ("body-too-large", "/v1/completions", completion(prompt="x" * 9000), {}, 413, "request_too_large"),
    ("no-messages", "/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, {}, 400, "invalid_value"),
    (
        "bad-role",
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]},
        {},
        400,
        "invalid_value",
    ),
    (
        "chat-unknown-model",
        "/v1/chat/completions",
        {"model": "x", "messages": [{"role": "user", "content": "x"}]},
        {},
        404,
        "model_not_found",
    ),
    (
        "tools",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        {},
        400,
        "unsupported_parameter",
    ),
    ("tool-choice", "/v1/chat/completions", chat(tool_choice="required"), {}, 400, "unsupported_parameter"),
    (
        "chat-json-format",
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema"}),
        {},
        400,
        "unsupported_parameter",
    ),
    ("chat-echo", "/v1/chat/completions", chat(echo=True), {}, 400, "unsupported_parameter"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", chat(top_logprobs=2), {}, 400, "invalid_value"),
    ("top-logprobs-above-20", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), {}, 400, "invalid_value"),
    (
        "chat-zero-max-completion-tokens",
        "/v1/chat/completions",
        chat(max_completion_tokens=0),
        {},
        400,
        "invalid_value",
    ),
    (
        "echo-logprobs-several-choices",  # the prompt would be scored once per identical choice
        "/v1/completions",
        completion(echo=True, logprobs=1, max_tokens=0, n=2),
        {},
        400,
        "invalid_value",
    ),
    ("unknown-route", "/v1/embeddings", completion(), {}, 404, "not_found"),
    # Unguarded, these get a 500 with a traceback, not counted in layerwatch_requests_total.
    (
        "json-nested-2000-deep",
        "/v1/completions",
        b'{"model": "tiny-test", "x": ' + DEEP + b"}",
        {},
        400,
        "invalid_json",
    ),
    (
        "integer-over-4300-digits",
        "/v1/completions",
        b'{"model": "tiny-test", "max_tokens": ' + HUGE + b"}",
        {},
        400,
        "invalid_json",
    ),
    (
        "logit-bias-key-over-4300-digits",
        "/v1/completions",
        completion(logit_bias={HUGE.decode(): 1}),
        {},
        400,
        "invalid_value",
    ),
]


@pytest.mark.parametrize("path,body,headers,status,code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_an_openai_error(server, path, body, headers, status, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{server.base_url}{path}", content=content, timeout=30, headers={"content-type": "application/json", **headers}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    if code == "invalid_value" and isinstance(body, dict):
        assert error["param"].split(".")[0] in body or error["param"] in ("prompt", "model")  # names the field


def test_a_body_announced_too_large_is_refused_before_it_is_read(server):
    with httpx.Client(timeout=30) as client:
        response = client.post(
            f"{server.base_url}/v1/completions",
            content=b"{}",
            headers={"content-length": "2", "content-type": "application/json"},
        )
        assert response.status_code == 400  # a small body is read and judged on its content
        chunks = (b"x" * 4096 for _ in range(64))  # streamed without a length: 256 KiB
        response = client.post(f"{server.base_url}/v1/completions", content=chunks)
    assert response.status_code == 413


def test_bad_input_is_counted_as_client_error_and_the_server_keeps_serving(server):
    before = sample_sum(server.metrics(), "layerwatch_requests_total", status="client_error")
    errors_logged = server.process.log_tail(lines=100_000).count("unexpected error")
    hostile = (
        b'{"x": ' + DEEP + b"}",
        b'{"max_tokens": ' + HUGE + b"}",
        json.dumps(completion(logit_bias={HUGE.decode(): 1})),
    )
    for body in (b"{", json.dumps(completion(max_tokens=10_000)).encode(), *hostile):
        assert httpx.post(f"{server.base_url}/v1/completions", content=body, timeout=30).status_code == 400
    assert sample_sum(server.metrics(), "layerwatch_requests_total", status="client_error") == before + 5
    ok = httpx.post(f"{server.base_url}/v1/completions", json=completion(), timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert sample_sum(server.metrics(), "layerwatch_requests_total", status="server_error") == 0
    log = server.process.log_tail(lines=100_000)
    assert "In the beginning" not in log  # prompts are not logged at info
    assert log.count("unexpected error") == errors_logged  # (the handler of a 500 logs its traceback)


def _collections_that_collect_every_error(schema: object) -> list[dict]:
    """The list, dict, set and tuple schemas in a pydantic core schema that do not stop at their first error."""
    found = []
    if isinstance(schema, dict):
        if schema.get("type") in ("list", "dict", "set", "frozenset", "tuple") and not schema.get("fail_fast"):
            found.append(schema)
        for value in schema.values():
            found += _collections_that_collect_every_error(value)
    elif isinstance(schema, list):
        for value in schema:
            found += _collections_that_collect_every_error(value)
    return found


REQUEST_MODELS = (
    schemas.CompletionRequest,
    schemas.ChatCompletionRequest,
    schemas.TokenizeCompletion,
    schemas.TokenizeChat,
    schemas.Detokenize,
)


@pytest.mark.parametrize("model", REQUEST_MODELS, ids=lambda m: m.__name__)
def test_every_collection_of_a_request_stops_at_its_first_bad_element(model):
    assert _collections_that_collect_every_error(model.__pydantic_core_schema__) == []


@pytest.mark.parametrize("name", list(hostile_bodies(1)))
def test_a_body_bad_in_every_element_costs_a_few_errors_not_one_per_element(name):
    # Left alone, pydantic builds one error per bad element and parse_request uses the first: 786 k of
    # them (4.8 s, 900 MB) for a 1 MiB "prompt": [1.5, 1.5, ...]. At most one per union member here.
    model, unsupported, data = hostile_bodies(20_000)[name]
    data = {field: value for field, value in data.items() if field not in (unsupported or {})}
    with pytest.raises(ValidationError) as refusal:
        model.model_validate(data)
    assert refusal.value.error_count() <= 4


def test_a_megabyte_of_bad_elements_is_refused_within_a_few_megabytes():
    text = json.dumps({"model": MODEL_NAME, "prompt": [1.5] * (1 << 18)})  # 1 MiB, as --max-body-bytes
    data = schemas.parse_json(text)
    tracemalloc.start()
    with pytest.raises(schemas.APIError, match=r"prompt: Input should be a valid string"):
        schemas.parse_request(schemas.CompletionRequest, data, schemas.COMPLETION_UNSUPPORTED)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < len(text)  # was 644 MiB
