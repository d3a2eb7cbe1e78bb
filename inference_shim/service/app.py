"""The HTTP API of `layerwatch serve` (FastAPI): OpenAI-compatible generation, health, metrics.

    POST /v1/completions, /v1/chat/completions   generation (stream=true: server-sent events)
    GET  /v1/models                              the one model served
    GET  /healthz, /health                       liveness: the process and its engine thread run
    GET  /readyz                                 readiness: a real one-token gated generation
    GET  /metrics                                Prometheus exposition of the service's registry

Bad input never reaches the engine: it gets an OpenAI-style error body and a 4xx (see schemas.py).
Prompts are logged only at DEBUG level.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2.exceptions import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request

from inference_shim.runtime.engine import SamplingParams
from inference_shim.service.completions import (
    ACTIVITY_HEADER,
    Generation,
    Prepared,
    Prompt,
    run_to_end,
    stream_events,
)
from inference_shim.service.depth import REQUEST_FIELD
from inference_shim.service.metrics import FinishedRequest
from inference_shim.service.schemas import (
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_request,
    read_json_body,
    refuse_unsupported,
)
from inference_shim.service.shim import ShimService

log = logging.getLogger(__name__)

DEBUG_HEADER = "x-layerwatch-debug"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the cap


def create_app(service: ShimService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(title="layerwatch serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if err.status_code == 404 else "method_not_allowed" if err.status_code == 405 else None
        return JSONResponse(
            APIError(err.status_code, str(err.detail), code=code).body(),
            status_code=err.status_code,
            headers=err.headers,
        )

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error")  # a bug: bad input is an APIError long before this
        return JSONResponse(APIError(500, "Internal server error.", type="server_error").body(), status_code=500)

    @app.get("/healthz")
    @app.get("/health")  # vLLM's name, which clients (guidellm) check before they start
    async def healthz() -> JSONResponse:
        if not service.worker.alive():
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if service.admission.draining:  # out of the load balancer's rotation while in-flight work finishes
            return JSONResponse(
                {"ready": False, "reason": "shutting down: draining in-flight requests"}, status_code=503
            )
        result = await service.readiness.check()
        return JSONResponse({"ready": result.ready, "reason": result.reason}, status_code=200 if result.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": service.model_name, "object": "model", "created": started, "owned_by": "layerwatch"}],
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(service, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(service, request, "chat")

    return app


async def _generate(service: ShimService, request: Request, kind: Literal["completion", "chat"]) -> Response:
    arrived = time.monotonic()
    try:
        service.admission.check()  # a body that could not be admitted is not even read
        limits = service.limits
        data = await read_json_body(request, limits.max_body_bytes, limits.body_timeout_seconds)
        service.admission.enter()  # 429 when too many wait for a batch slot, 503 while draining
        try:
            prepared = await _prepare(service, request, kind, data)
        except BaseException:
            service.admission.leave()  # from here on, the generation leaves when it is counted
            raise
    except APIError as err:
        service.request_metrics.finish(FinishedRequest("client_error" if err.status < 500 else "server_error"))
        raise
    except ClientDisconnect:  # gone before its body was read: nothing to answer
        service.request_metrics.finish(FinishedRequest("cancelled"))
        return Response(status_code=499)
    except Exception:  # a bug (bad input is an APIError): answered 500 by unexpected_error, counted here
        service.request_metrics.finish(FinishedRequest("server_error"))
        raise
    log.info(
        "%s: %s, %d prompt(s) of %s tokens, n=%d, max_tokens=%d, stream=%s",
        prepared.request_id,
        kind,
        len(prepared.prompts),
        "+".join(str(len(p.ids)) for p in prepared.prompts),
        prepared.n,
        prepared.params.max_tokens,
        prepared.stream,
    )
    audit = None if service.audit is None else service.audit.start(kind, prepared.model_name, arrived, request.headers)
    generation = Generation(service, prepared, arrived, audit)
    generation.start()
    if prepared.stream:

        async def settle() -> None:  # runs however the stream ended, even before its first event
            generation.abandon()

        return StreamingResponse(
            stream_events(generation),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
            background=BackgroundTask(settle),
        )
    await run_to_end(generation, request)
    headers = {ACTIVITY_HEADER: generation.activity_json()} if prepared.debug else None
    return JSONResponse(generation.response(), headers=headers)


async def _prepare(service: ShimService, request: Request, kind: Literal["completion", "chat"], data: Any) -> Prepared:
    limits = service.limits
    body: CompletionRequest | ChatCompletionRequest
    # Validation and template rendering cost time in proportion to the body (a 1 MiB chat of 30,000
    # messages: ~0.3 s): in a worker thread, so that the event loop keeps answering everyone else.
    if kind == "chat":
        body = await asyncio.to_thread(parse_request, ChatCompletionRequest, data)
    else:
        body = await asyncio.to_thread(parse_request, CompletionRequest, data)
    refuse_unsupported(data, chat=kind == "chat")
    if body.model != service.model_name:
        raise APIError(
            404,
            f"The model '{body.model}' does not exist; this server serves '{service.model_name}'.",
            param="model",
            code="model_not_found",
        )
    prompt_param = "prompt" if kind == "completion" else "messages"
    inputs = await asyncio.to_thread(_prompt_inputs, service, body)
    if len(inputs) * body.n > MAX_CHOICES:
        raise APIError(
            400, f"At most {MAX_CHOICES} choices (n × prompts) per request.", param="n", code="invalid_value"
        )
    vocab = service.model.config.vocab_size
    # Completion text gets the tokenizer's special tokens (BOS); a rendered chat template holds its own.
    encode = service.tokenizer.encode if kind == "completion" else service.tokenizer.encode_chat_prompt
    prompts = []
    for prompt in inputs:
        if not prompt:
            raise APIError(400, "The prompt is empty.", param=prompt_param, code="empty_prompt")
        if isinstance(prompt, str):
            log.debug("prompt: %r", prompt)
            if limits.max_prompt_chars is not None and len(prompt) > limits.max_prompt_chars:
                # Refused by size: it cannot fit, and tokenizing it would cost CPU in proportion to its length.
                raise APIError(
                    400,
                    f"The prompt has {len(prompt)} characters, more than {limits.max_prompt_tokens} tokens can "
                    f"hold ({limits.max_prompt_chars} characters); this server accepts at most "
                    f"{limits.max_prompt_tokens} tokens.",
                    param=prompt_param,
                    code="context_length_exceeded",
                )
            # In a worker thread, which the tokenizer releases the GIL in: neither the event loop nor the
            # engine thread waits for it.
            prompts.append(Prompt(await asyncio.to_thread(encode, prompt), prompt))
        else:
            _check_token_ids(prompt, vocab, prompt_param)
            prompts.append(Prompt(prompt, service.tokenizer.decode(prompt)))
        length = len(prompts[-1].ids)
        if length > limits.max_prompt_tokens:
            raise APIError(
                400,
                f"The prompt has {length} tokens; this server accepts at most {limits.max_prompt_tokens}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
    echo = isinstance(body, CompletionRequest) and body.echo
    asked, limit_field = body.token_limit()
    default_max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if kind == "completion" else limits.max_tokens_cap
    max_tokens = min(default_max_tokens, limits.max_tokens_cap) if asked is None else asked
    if max_tokens > limits.max_tokens_cap:
        raise APIError(
            400,
            f"{limit_field}={max_tokens} exceeds this server's cap of {limits.max_tokens_cap}.",
            param=limit_field,
            code="max_tokens_exceeded",
        )
    if max_tokens == 0 and not echo:
        raise APIError(
            400,
            f"{limit_field} must be at least 1 (0 only with echo: the prompt's log-probabilities).",
            param=limit_field,
            code="invalid_value",
        )
    _check_token_ids(body.token_bias(), vocab, "logit_bias")
    logprobs = (
        body.logprobs if isinstance(body, CompletionRequest) else (body.top_logprobs or 0) if body.logprobs else None
    )
    if echo and logprobs is not None and body.n > 1:
        # Every choice would score the same prompt again, one decode step per token (a 3 KB request
        # could cost minutes of CPU); the prompt's log-probabilities do not depend on the choice.
        raise APIError(
            400,
            "echo with logprobs scores the prompt once per choice and every choice gets the same numbers: send n=1.",
            param="n",
            code="invalid_value",
        )
    try:
        service.depth.check_request_threshold(body.skip_threshold)
    except ValueError as exc:
        raise APIError(400, f"{exc}.", param=REQUEST_FIELD, code="invalid_value") from None
    debug = service.allow_debug and request.headers.get(DEBUG_HEADER, "").strip().lower() == "true"
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
    return Prepared(
        kind=kind,
        request_id=request_id,
        model_name=service.model_name,
        prompts=prompts,
        depth=[
            service.depth.decide(request_id, len(p.ids), max_tokens, body.temperature, body.skip_threshold)
            for p in prompts
        ],
        n=body.n,
        params=_sampling(body, max_tokens, logprobs, prompt_logprobs=logprobs if echo else None),
        stream=body.stream,
        include_usage=body.include_usage(),
        debug=debug,
        echo=echo,
        logprobs=logprobs,
    )


def _check_token_ids(ids: Iterable[int], vocab: int, param: str) -> None:
    if any(token >= vocab for token in ids):  # (negative ids are refused by the schema)
        raise APIError(400, f"{param}: token ids must be in 0..{vocab - 1}.", param=param, code="invalid_value")


def _prompt_inputs(service: ShimService, body: CompletionRequest | ChatCompletionRequest) -> list[str | list[int]]:
    """Each prompt as text or token ids; a chat's messages rendered by the chat template."""
    if isinstance(body, CompletionRequest):
        return body.prompts()
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        return [service.tokenizer.apply_chat_template(messages)]
    except TemplateError as exc:  # the checkpoint's template refuses the conversation (e.g. role order)
        raise APIError(
            400, f"The chat template refused the messages: {exc}", param="messages", code="invalid_messages"
        ) from None


def _sampling(
    body: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings(),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=body.token_bias(),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
