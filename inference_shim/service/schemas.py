"""Request bodies of the OpenAI-compatible API and the errors bad input gets.

Every rejection is an `APIError`, rendered as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status. The body is read with a size
cap before anything parses it, then decoded as strict UTF-8, then parsed as JSON, then validated.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request

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
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
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
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(
            400,
            f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}).",
            code="invalid_json",
        ) from None


def body_too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body exceeds the limit of {max_bytes} bytes.", code="request_too_large")


def parse_request(model: type[_Request], data: Any) -> _Request:
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, not {type(data).__name__}.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(first["loc"])
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


# Strict: "5" is not a number and "yes" not a boolean. Unknown fields are ignored.
STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share. Unknown fields are ignored (as many OpenAI-compatible
    servers do), but fields whose other values would change the result are checked."""

    model_config = STRICT

    model: Text
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text]
    echo: Literal[False] = False
    logprobs: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return value

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: Literal[False] | None = None
