"""Request bodies of the OpenAI-compatible API and the errors bad input gets.

Every rejection is an `APIError`, rendered as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status. The body is read with a size
cap before anything parses it, then decoded as strict UTF-8, then parsed as JSON, then validated.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from starlette.requests import Request

from layerwatch.inference_shim.runtime.engine import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY

_Request = TypeVar("_Request", bound=BaseModel)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,  # e.g. retry-after on a 429
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


# --- reading the body --------------------------------------------------------------------------------


async def read_json_body(request: Request, max_bytes: int, timeout: float) -> Any:
    """The request's JSON, refusing bodies over `max_bytes` before reading (or while reading) them,
    and bodies that do not arrive within `timeout` seconds (a slow client holds a connection only
    that long; uvicorn itself has no body timeout)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise body_too_large(max_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise body_too_large(max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} s.", code="request_timeout") from None
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"The request body is not valid UTF-8 (byte {exc.start}).", code="invalid_encoding"
        ) from None
    if not text.strip():
        raise APIError(400, "The request body is empty; expected a JSON object.", code="invalid_json")
    # In a worker thread: its stack starts almost empty, so how deep a body may nest does not depend
    # on how deep the event loop's stack happens to be (and a large body does not hold the loop).
    return await asyncio.to_thread(parse_json, text)


def parse_json(text: str) -> Any:
    """JSON text -> Python, every way it can fail an APIError 400 (code invalid_json)."""
    try:
        return json.loads(text, parse_int=_json_integer)
    except json.JSONDecodeError as exc:
        message = f"{exc.msg} (line {exc.lineno}, column {exc.colno})"
    except RecursionError:  # the parser recurses once per level: Python's stack limit, ~1,000 levels
        message = "it is nested too deeply"
    except _IntegerTooLong as exc:
        message = str(exc)
    raise APIError(400, f"The request body is not valid JSON: {message}.", code="invalid_json")


class _IntegerTooLong(ValueError):
    pass


def _json_integer(digits: str) -> int:
    # Python refuses to convert longer ones (the int/str conversion limit, a guard against quadratic
    # time), with a ValueError json.loads would pass on.
    limit = sys.get_int_max_str_digits()
    if len(digits.lstrip("-")) > limit:
        raise _IntegerTooLong(f"an integer of {len(digits.lstrip('-'))} digits; at most {limit}")
    return int(digits)


def body_too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body exceeds the limit of {max_bytes} bytes.", code="request_too_large")


def parse_request(model: type[_Request], data: Any, unsupported: Mapping[str, Unsupported] | None = None) -> _Request:
    """The validated body. Fields of `unsupported` are refused unless at their "not used" value, then
    left out; any other field the model does not know is refused: nothing sent is silently ignored."""
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, not {type(data).__name__}.", code="invalid_json")
    if unsupported:
        refuse_unsupported(data, unsupported)
        data = {name: value for name, value in data.items() if name not in unsupported}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(first["loc"])
        if first["type"] == "extra_forbidden":
            raise APIError(
                400,
                f"Unknown field {param}: this server does not know it, and would not ignore it silently "
                "(docs/service.md lists every field).",
                param=param,
                code="unknown_parameter",
            ) from None
        raise APIError(
            400,
            f"Invalid request: {param}: {first['msg']}" if param else first["msg"],
            param=param,
            code="invalid_value",
        ) from None


def _param(loc: tuple[str | int, ...]) -> str | None:
    """The field path of a validation error, without pydantic's union-member tags ("str", "list[str]")."""
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "literal", "TextPart"}


# --- request models ----------------------------------------------------------------------------------


def _encodable(text: str) -> str:
    # JSON may carry lone surrogates ("\ud800"), which are not text: refuse them here, not in the tokenizer.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    return text


# Every string of a request: valid Unicode, so it can be tokenized, logged and echoed in errors.
Text = Annotated[str, AfterValidator(_encodable)]


# Strict: "5" is not a number and "yes" not a boolean; a field the model does not declare is refused.
STRICT = ConfigDict(extra="forbid", strict=True)

TokenId = Annotated[int, Field(ge=0)]


# A body that fails element by element must cost one error, not one per element: pydantic builds
# every error of a validation (786 k for a 1 MiB "prompt": [1.5, 1.5, ...], 4.8 s and 900 MB), so
# every list and dict of a request stops at its first bad element, and a model reports one unknown
# field however many it was sent (RequestModel). tests/service/test_bad_input.py checks every collection.
FAIL_FAST = Field(fail_fast=True)


class RequestModel(BaseModel):
    """A part of a request body. OpenAI allows null for its optional fields (the openai client sends
    `temperature=None` as null): null means absent, so the field's default applies; a required field
    stays required. Of the fields the model does not know, only the first is kept, so that it is
    refused once (extra="forbid"), not once per field."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_and_all_but_one_unknown(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        unknown = next((name for name in data if name not in fields), None)
        return {
            name: value
            for name, value in data.items()
            if name == unknown or (name in fields and (value is not None or fields[name].is_required()))
        }


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage


MAX_CHOICES = 128  # choices per request (n × prompts): OpenAI's largest n
# Stop strings and bad words per request, and their characters in all: far more than clients send
# (OpenAI allows 4 stop strings, lm-eval's humaneval sends 6), few enough that checking them per
# generated token stays cheap (1,024 characters of stop strings: at worst 0.5 ms per token on this machine).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 1024
MAX_TOKEN_ID_DIGITS = 18  # a longer logit_bias key is no token id of any vocabulary


class SamplingFields(RequestModel):
    """What completions and chat share. A field the model does not declare is refused, and so are
    the known ones this server does not implement, at values that would change the result
    (`parse_request`); the accepted ones are honoured (docs/service.md has the table)."""

    model: Text
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: only with completions' echo
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name; wins
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Text | Annotated[list[Text], FAIL_FAST] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    best_of: int | None = None
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]], FAIL_FAST] | None
    ) = None
    ignore_eos: bool = False  # vLLM's: run to the token limit through EOS (benchmark clients send it)
    # vLLM's token bans (the engine's SamplingParams), and token ids in place of token texts in logprobs
    bad_words: Annotated[list[Text], FAIL_FAST] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1), FAIL_FAST] | None = None
    return_tokens_as_token_ids: bool = False
    user: Text | None = None  # OpenAI's end-user id for abuse monitoring: no effect on the result
    # layerwatch's: this request's skip threshold, within the operator's range (service/depth.py checks it)
    skip_threshold: float | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS or sum(map(len, stops)) > MAX_STOP_CHARS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of {MAX_STOP_CHARS} characters in all")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value: list[str] | None) -> list[str] | None:
        words = value or []
        if len(words) > MAX_BAD_WORDS or sum(map(len, words)) > MAX_BAD_WORD_CHARS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad words of {MAX_BAD_WORD_CHARS} characters in all")
        if any(not w.strip() for w in words):
            raise ValueError("bad words must hold more than spaces")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of must equal n: this server returns every sequence it generates")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal integers), not {key!r}")
            if len(key) > MAX_TOKEN_ID_DIGITS:  # (and int() would refuse a key of over 4,300 digits)
                raise ValueError(f"keys must be token ids; a {len(key)}-digit number is not one")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats, which (as in vLLM) applies with include_usage only."""
        return self.include_usage() and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def token_limit(self) -> tuple[int | None, str]:
        """(the generation's token limit, the field it came from): max_completion_tokens wins over
        the deprecated max_tokens, as OpenAI documents."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def token_bias(self) -> dict[int, float]:
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}


# A field this server does not implement: the values that mean "not used", and why any other is refused.
Unsupported = tuple[tuple[Any, ...], str]

# Fields this server does not implement, with the values that mean "not used": any other value
# would change the result, so it is refused with a 400 naming the field rather than ignored.
# (OpenAI's fields, and vLLM's sampling extensions that clients send.)
_UNSUPPORTED: dict[str, Unsupported] = {
    "tools": ((None, []), "tool calling is not supported"),
    "tool_choice": ((None, "none"), "tool calling is not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "response_format": ((None, {"type": "text"}), "only the text response format is supported"),
    "suffix": ((None, ""), "insertion (suffix) is not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "top_k": ((None, -1, 0), "top-k sampling is not supported (use top_p)"),
    "min_p": ((None, 0), "min-p sampling is not supported (use top_p)"),
    "repetition_penalty": (
        (None, 1),
        "repetition_penalty is not supported (use presence_penalty or frequency_penalty)",
    ),
    "min_tokens": ((None, 0), "min_tokens is not supported"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "stop_token_ids": ((None, []), "stop_token_ids is not supported (use stop)"),
    "include_stop_str_in_output": ((None, False), "include_stop_str_in_output is not supported"),
    "skip_special_tokens": ((None, True), "special tokens are always skipped in the text"),
    "prompt_logprobs": ((None,), "prompt_logprobs is not supported (use echo with logprobs)"),
    "guided_json": ((None,), "guided decoding is not supported"),
    "guided_regex": ((None,), "guided decoding is not supported"),
    "guided_choice": ((None,), "guided decoding is not supported"),
    "guided_grammar": ((None,), "guided decoding is not supported"),
    "structured_outputs": ((None,), "structured outputs are not supported"),
    "truncate_prompt_tokens": ((None,), "prompt truncation is not supported"),
    "priority": ((None, 0), "priority scheduling is not supported"),
    "store": ((None, False), "completions are not stored"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "reasoning_effort": ((None,), "reasoning effort is not supported"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
}
COMPLETION_UNSUPPORTED = _UNSUPPORTED
CHAT_UNSUPPORTED = _UNSUPPORTED | {
    "echo": ((None, False), "echo is a completions field"),
    # A template is code the server would run, and Jinja's sandbox bounds neither its time nor its
    # memory (docs/security.md): vLLM refuses it too unless told to trust it.
    "chat_template": ((None,), "a chat template of the request's own is not accepted; the checkpoint's renders"),
}


def refuse_unsupported(data: dict[str, Any], unsupported: Mapping[str, Unsupported]) -> None:
    """400 naming the first field that asks for something this server does not do."""
    for name, (neutral, why) in unsupported.items():
        value = data.get(name)
        # (a boolean is not a number here: "top_k": false is not top_k 0)
        if name in data and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            raise APIError(400, f"{name}: {why}.", param=name, code="unsupported_parameter")


class CompletionRequest(SamplingFields):
    # One prompt or several; each a string or token ids (as lm-eval and vLLM send them).
    prompt: (
        Text
        | Annotated[list[Text], FAIL_FAST]
        | Annotated[list[TokenId], FAIL_FAST]
        | Annotated[list[Annotated[list[TokenId], FAIL_FAST]], FAIL_FAST]
    )
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's special tokens (BOS)

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not value:
            raise ValueError("at least one prompt is required")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids used as they are."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [cast("list[int]", self.prompt)]
        return cast("list[str | list[int]]", self.prompt)


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], FAIL_FAST]
    # Handed to the chat template as transformers hands them (reasoning under each of its names)
    name: Text | None = None
    reasoning_content: Text | None = None
    reasoning: Text | None = None
    thinking: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def template_message(self) -> dict[str, Any]:
        return {**self.model_dump(exclude={"content"}, exclude_none=True), "content": self.text()}


class ChatTemplateFields(RequestModel):
    """How a conversation becomes the prompt (vLLM's fields): chat and /tokenize take them alike."""

    messages: Annotated[list[ChatMessage], Field(min_length=1), FAIL_FAST]
    add_generation_prompt: bool | None = None  # default: true, unless continue_final_message
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: the template's own (`Tokenizer.encode_chat_prompt`)
    documents: Annotated[list[Annotated[dict[str, Text], FAIL_FAST]], FAIL_FAST] | None = None
    chat_template_kwargs: Annotated[dict[str, Any], FAIL_FAST] | None = None

    @model_validator(mode="after")
    def _generation_prompt_or_continuation(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    def generation_prompt(self) -> bool:
        return not self.continue_final_message if self.add_generation_prompt is None else self.add_generation_prompt


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # OpenAI's, with no effect on the result (tools, which parallel_tool_calls is about, are refused)
    metadata: Annotated[dict[str, Text], FAIL_FAST] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value


# --- tokenizer routes (vLLM's /tokenize and /detokenize) -----------------------------------------------


class TokenizeCompletion(RequestModel):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(ChatTemplateFields):
    model: Text | None = None
    return_token_strs: bool = False


class Detokenize(RequestModel):
    model: Text | None = None
    tokens: Annotated[list[TokenId], FAIL_FAST]
