"""The HTTP API of `layerwatch serve` (FastAPI): OpenAI-compatible generation, health, metrics.

    POST /v1/completions, /v1/chat/completions   generation (stream=true: server-sent events)
    GET  /v1/models, /v1/models/{id}             the one model served, and its context limits
    POST /tokenize, /detokenize                  vLLM's: the served tokenizer (and chat template)
    GET  /tokenizer_info                         vLLM's: its special tokens and chat template
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
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request

from layerwatch.inference_shim.runtime.engine import SamplingParams
from layerwatch.inference_shim.service.admission import ONE_SLOT
from layerwatch.inference_shim.service.completions import (
    ACTIVITY_HEADER,
    Generation,
    Prepared,
    Prompt,
    admission_weight,
    run_to_end,
    stream_events,
)
from layerwatch.inference_shim.service.depth import REQUEST_FIELD
from layerwatch.inference_shim.service.prompts import (
    bad_word_ids,
    check_prompt_chars,
    check_prompt_tokens,
    check_token_ids,
    describe_limits,
    encode_text,
    render_chat_off_loop,
)
from layerwatch.inference_shim.service.records import FinishedRequest
from layerwatch.inference_shim.service.schemas import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Detokenize,
    SamplingFields,
    TokenizeChat,
    TokenizeCompletion,
    parse_request,
    read_json_body,
)
from layerwatch.inference_shim.service.shim import ShimService

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

    def model_card() -> dict[str, Any]:
        limits = service.limits
        return {
            "id": service.model_name,
            "object": "model",
            "created": started,
            "owned_by": "layerwatch",
            "root": service.model_name,
            "max_model_len": limits.max_model_len,  # vLLM's field: prompt and generation together
            "max_prompt_tokens": limits.max_prompt_tokens,  # layerwatch's: each has its own limit too
            "max_completion_tokens": limits.max_tokens_cap,
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        check_model(service, model_id)
        return JSONResponse(model_card())

    _tokenizer_routes(app, service)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(service, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(service, request, "chat")

    return app


def _tokenizer_routes(app: FastAPI, service: ShimService) -> None:
    """vLLM's tokenizer routes: what lm-eval's remote tokenizer (and anyone counting tokens) asks."""

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        tokenizer = service.tokenizer
        return JSONResponse(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **tokenizer.special_tokens,
                "add_bos_token": tokenizer.adds_bos,
                "chat_template": tokenizer.chat_template,
                "model_max_length": service.limits.max_model_len,
            }
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(await _tokenize(service, request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        limits = service.limits
        data = await read_json_body(request, limits.max_body_bytes, limits.body_timeout_seconds)
        body = await asyncio.to_thread(parse_request, Detokenize, data)
        check_model(service, body.model)
        check_token_ids(body.tokens, service.model.config.vocab_size, "tokens")
        if len(body.tokens) > limits.max_model_len:
            raise APIError(
                400,
                f"{len(body.tokens)} tokens are more than the longest sequence this server runs "
                f"({limits.max_model_len}).",
                param="tokens",
                code="context_length_exceeded",
            )
        return JSONResponse({"prompt": service.tokenizer.decode(body.tokens)})


async def _generate(service: ShimService, request: Request, kind: Literal["completion", "chat"]) -> Response:
    arrived = time.monotonic()
    try:
        service.admission.check()  # a body that could not be admitted is not even read
        limits = service.limits
        data = await read_json_body(request, limits.max_body_bytes, limits.body_timeout_seconds)
        service.admission.enter()  # 429 when too many wait for a batch slot, 503 while draining
        try:
            prepared = await _prepare(service, request, kind, data)
            service.admission.weigh(admission_weight(service.admission, prepared))
        except BaseException:
            service.admission.leave(ONE_SLOT)  # from here on, the generation leaves when it is counted
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
    generation = Generation(service.generation_parts, prepared, arrived, audit)
    generation.start()
    if prepared.stream:

        async def settle() -> None:  # runs however the stream ended, even before its first event
            generation.cancel()

        return StreamingResponse(
            stream_events(generation),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
            background=BackgroundTask(settle),
        )
    await run_to_end(generation, request)
    headers = {ACTIVITY_HEADER: generation.activity_json()} if prepared.debug else None
    # Built and encoded in a worker thread, a choice at a time: answers reach tens of MB (n 128 with
    # top_logprobs 20), and the event loop answers everyone else meanwhile.
    body = await asyncio.to_thread(generation.encoded_response)
    return Response(body, media_type="application/json", headers=headers)


async def _prepare(service: ShimService, request: Request, kind: Literal["completion", "chat"], data: Any) -> Prepared:
    body: CompletionRequest | ChatCompletionRequest
    # Validation and template rendering cost time in proportion to the body (a 1 MiB chat of 30,000
    # messages: ~0.3 s): in a worker thread, so that the event loop keeps answering everyone else.
    if kind == "chat":
        body = await asyncio.to_thread(parse_request, ChatCompletionRequest, data, CHAT_UNSUPPORTED)
    else:
        body = await asyncio.to_thread(parse_request, CompletionRequest, data, COMPLETION_UNSUPPORTED)
    check_model(service, body.model)
    if isinstance(body, ChatCompletionRequest):
        inputs: list[str | list[int]] = [
            await render_chat_off_loop(service.tokenizer, body, service.refused_in_messages)
        ]
    else:
        inputs = body.prompts()
    if len(inputs) * body.n > MAX_CHOICES:
        raise APIError(
            400, f"At most {MAX_CHOICES} choices (n × prompts) per request.", param="n", code="invalid_value"
        )
    prompts = await _encode_prompts(service, body, inputs)
    echo = isinstance(body, CompletionRequest) and body.echo
    max_tokens = _max_tokens(service, body, echo)
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
    params = _sampling(service, body, max_tokens, logprobs, prompt_logprobs=logprobs if echo else None)
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
        params=params,
        stream=body.stream,
        include_usage=body.include_usage(),
        continuous_usage=body.continuous_usage(),
        debug=debug,
        echo=echo,
        logprobs=logprobs,
        tokens_as_ids=body.return_tokens_as_token_ids,
    )


TOKENIZE_CHAT_UNSUPPORTED = {"chat_template": CHAT_UNSUPPORTED["chat_template"]}


def check_model(service: ShimService, name: str | None) -> None:
    """404 for a model other than the one served (None: the request names none, as /tokenize allows)."""
    if name is not None and name != service.model_name:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{service.model_name}'.",
            param="model",
            code="model_not_found",
        )


async def _encode_prompts(
    service: ShimService, body: CompletionRequest | ChatCompletionRequest, inputs: list[str | list[int]]
) -> list[Prompt]:
    """Each prompt's ids, within the prompt limits. Completion text gets the tokenizer's special tokens
    (BOS) unless add_special_tokens is false; a rendered chat template holds its own."""
    limits = service.limits
    param = "prompt" if isinstance(body, CompletionRequest) else "messages"
    tokenizer = service.tokenizer
    if isinstance(body, CompletionRequest):
        add_special_tokens = body.add_special_tokens

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    else:
        add_special_tokens_chat = body.add_special_tokens

        def encode(text: str) -> list[int]:
            return tokenizer.encode_chat_prompt(text, add_special_tokens_chat)

    prompts = []
    for prompt in inputs:
        if not prompt:
            raise APIError(400, "The prompt is empty.", param=param, code="empty_prompt")
        if isinstance(prompt, str):
            log.debug("prompt: %r", prompt)
            prompts.append(Prompt(await encode_text(limits, prompt, encode, param), prompt))
        else:
            check_token_ids(prompt, service.model.config.vocab_size, param)
            prompts.append(Prompt(prompt, tokenizer.decode(prompt)))
        check_prompt_tokens(limits, len(prompts[-1].ids), param)
    return prompts


def _max_tokens(service: ShimService, body: CompletionRequest | ChatCompletionRequest, echo: bool) -> int:
    limits = service.limits
    asked, limit_field = body.token_limit()
    completion = isinstance(body, CompletionRequest)
    default_max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if completion else limits.max_tokens_cap
    max_tokens = min(default_max_tokens, limits.max_tokens_cap) if asked is None else asked
    if max_tokens > limits.max_tokens_cap:
        raise APIError(
            400,
            f"{limit_field}={max_tokens} exceeds this server's cap: it accepts {describe_limits(limits)}.",
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
    return max_tokens


async def _tokenize(service: ShimService, request: Request) -> dict[str, Any]:
    """vLLM's /tokenize: a text prompt, or a conversation as the chat route renders it. Bounded as a
    generation's prompt is (body size, and a text too long in characters to fit is refused
    untokenized); the count may exceed the prompt limit: telling it is the point."""
    limits = service.limits
    data = await read_json_body(request, limits.max_body_bytes, limits.body_timeout_seconds)
    tokenizer = service.tokenizer
    body: TokenizeCompletion | TokenizeChat
    if isinstance(data, dict) and "messages" in data:
        body = await asyncio.to_thread(parse_request, TokenizeChat, data, TOKENIZE_CHAT_UNSUPPORTED)
        check_model(service, body.model)
        text = await render_chat_off_loop(tokenizer, body, service.refused_in_messages)
        add_special_tokens = body.add_special_tokens

        def encode(text: str) -> list[int]:
            return tokenizer.encode_chat_prompt(text, add_special_tokens)
    else:
        body = await asyncio.to_thread(parse_request, TokenizeCompletion, data)
        check_model(service, body.model)
        text, add_special = body.prompt, body.add_special_tokens

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=add_special)

    param = "messages" if isinstance(body, TokenizeChat) else "prompt"
    check_prompt_chars(limits, text, param)
    ids = await asyncio.to_thread(encode, text)
    token_strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids, "token_strs": token_strs}


def _sampling(
    service: ShimService, body: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    vocab = service.model.config.vocab_size
    check_token_ids(body.token_bias(), vocab, "logit_bias")
    allowed = None if body.allowed_token_ids is None else tuple(sorted(set(body.allowed_token_ids)))
    if allowed is not None:
        check_token_ids(allowed, vocab, "allowed_token_ids")
    bad_words = bad_word_ids(service.tokenizer, body.bad_words or ())
    if allowed is not None and set(allowed) <= {word[0] for word in bad_words if len(word) == 1}:
        raise APIError(
            400, "bad_words ban every token of allowed_token_ids.", param="allowed_token_ids", code="invalid_value"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings(),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=body.token_bias(),
        allowed_token_ids=allowed,
        bad_words=bad_words,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
