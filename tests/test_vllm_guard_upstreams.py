"""`layerwatch vllm-guard` (layerwatch/vllm_guard) in front of tiny upstreams on loopback that answer what a real
vLLM cannot be made to (no vLLM here: tests/vllm/test_guard.py has the real one): answers not of vLLM's shape
reach the client as sent, a malformed re-score does not stop the checks, and requests and answers keep their
bytes and framing (the path as sent, a Content-Length, no Content-Type added)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from layerwatch.demo.processes import free_port
from layerwatch.log_limit import BURST
from layerwatch.ports import LOOPBACK
from layerwatch.vllm_guard import checker as checker_module
from layerwatch.vllm_guard import proxy as proxy_module
from layerwatch.vllm_guard.checker import CONCURRENT_CHECKS, Checker
from layerwatch.vllm_guard.metrics import GuardMetrics
from layerwatch.vllm_guard.openai_bodies import CHAT_PATH, COMPLETIONS_PATH, Choice, checkable
from layerwatch.vllm_guard.proxy import GuardProxy, events

MODEL = "m"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A chat answer whose log-probabilities name tokens by text, not `token_id:N` (return_tokens_as_token_ids ignored).
TEXT_TOKENS_CHOICE = {
    "index": 0,
    "message": {"role": "assistant", "content": "hi"},
    "logprobs": {"content": [{"token": "hi", "logprob": -0.1, "top_logprobs": [{"token": "hi", "logprob": -0.1}]}]},
    "token_ids": [5],
}


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=False)  # a client gone is seen on a write
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, LOOPBACK, port).start()
    return runner, f"http://{LOOPBACK}:{port}"


@asynccontextmanager
async def guarded(answer: Handler, shadow_rate: float = 1.0) -> AsyncIterator[tuple[str, GuardProxy]]:
    """The guard's URL in front of an upstream answering every request with `answer` (and /v1/models)."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL, "max_model_len": 100}]})

    upstream_app = web.Application(client_max_size=1 << 30)
    upstream_app.router.add_get("/v1/models", models)
    upstream_app.router.add_route("*", "/{tail:.*}", answer)
    upstream, upstream_url = await serve(upstream_app)
    metrics = GuardMetrics(MODEL, shadow_rate)
    proxy = GuardProxy(upstream_url, shadow_rate, metrics, Checker(upstream_url, MODEL, metrics))
    guard, guard_url = await serve(proxy.app())
    try:
        yield guard_url, proxy
    finally:
        await guard.cleanup()
        await upstream.cleanup()


def outcomes(proxy: GuardProxy) -> dict[str, float]:
    return {outcome: counter._value.get() for outcome, counter in proxy.metrics.outcomes.items()}


CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def test_answers_not_of_vllms_shape_reach_the_client_as_sent_and_count_as_failed_checks() -> None:
    async def not_json(_: web.Request) -> web.Response:
        return web.Response(body=b"not json {", content_type="application/json")

    async def a_list(_: web.Request) -> web.Response:
        return web.json_response([1, 2])

    async def text_tokens(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.json_response({"choices": [TEXT_TOKENS_CHOICE], "prompt_token_ids": [1, 2]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps({"choices": [TEXT_TOKENS_CHOICE]}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def check() -> None:
        for answer, expected in ((not_json, b"not json {"), (a_list, b"[1, 2]")):
            async with guarded(answer) as (url, proxy), aiohttp.ClientSession() as client:
                async with client.post(url + CHAT_PATH, json=CHAT_BODY) as response:
                    assert response.status == 200 and await response.read() == expected
                assert outcomes(proxy)["failed"] == 1
        async with guarded(text_tokens) as (url, proxy), aiohttp.ClientSession() as client:
            async with client.post(url + CHAT_PATH, json=CHAT_BODY) as response:
                whole = await response.json()
            assert response.status == 200, whole
            assert whole["choices"][0]["logprobs"] is None and whole["choices"][0]["message"]["content"] == "hi"
            async with client.post(url + CHAT_PATH, json={**CHAT_BODY, "stream": True}) as response:
                events = (await response.read()).split(b"\n\n")
            assert json.loads(events[0].removeprefix(b"data: "))["choices"][0]["logprobs"] is None, events
            assert events[1] == b"data: [DONE]", events
            assert outcomes(proxy)["failed"] == 2

    asyncio.run(check())


CHECKS = max(CONCURRENT_CHECKS, BURST) + 2


def test_a_malformed_rescore_fails_its_check_and_the_checks_go_on(caplog: pytest.LogCaptureFixture) -> None:
    choice = {**TEXT_TOKENS_CHOICE, "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.1}]}}

    async def answer(request: web.Request) -> web.Response:
        if (await request.json()).get("prompt_logprobs"):  # the re-score, without its prompt's log-probabilities
            return web.json_response({"choices": [{"prompt_logprobs": []}]})
        return web.json_response({"choices": [choice], "prompt_token_ids": [1, 2]})

    async def check() -> None:
        async with guarded(answer) as (url, proxy), aiohttp.ClientSession() as client:
            for _ in range(CHECKS):  # more than the workers: each must survive its failure
                async with client.post(url + CHAT_PATH, json=CHAT_BODY) as response:
                    assert response.status == 200
                await asyncio.wait_for(proxy.checker.join(), 30)
            assert outcomes(proxy)["failed"] == CHECKS
        # Counted each, logged in a burst: a vLLM refusing every re-score must not flood the log.
        assert 0 < len([r for r in caplog.records if r.name == checker_module.__name__]) <= BURST

    asyncio.run(check())


def test_a_rescore_vllm_never_answers_times_out_and_frees_its_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checker_module, "CHECK_TIMEOUT_SECONDS", 0.5)
    choice = {**TEXT_TOKENS_CHOICE, "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.1}]}}
    hung = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        if (await request.json()).get("prompt_logprobs"):  # the re-score: vLLM stalls
            await hung.wait()
        return web.json_response({"choices": [choice], "prompt_token_ids": [1, 2]})

    async def check() -> None:
        async with guarded(answer) as (url, proxy), aiohttp.ClientSession() as client:
            for _ in range(CONCURRENT_CHECKS + 1):  # more than the workers: each comes back from its stall
                async with client.post(url + CHAT_PATH, json=CHAT_BODY) as response:
                    assert response.status == 200  # the client's answer never waits for its check
            await asyncio.wait_for(proxy.checker.join(), 30)
            assert outcomes(proxy)["failed"] == CONCURRENT_CHECKS + 1
            hung.set()

    asyncio.run(check())


def test_a_rescore_keeps_the_sessions_connect_limit_under_its_total(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM that does not accept the connection fails the check at the session's connect limit, not the total."""
    monkeypatch.setattr(checker_module, "CHECK_TIMEOUT_SECONDS", 60.0)
    with socket.socket() as listener, socket.socket() as queued:
        listener.bind((LOOPBACK, 0))
        listener.listen(0)  # never accepted: one connection fills the queue, the next one's SYN is dropped
        queued.connect(listener.getsockname())
        upstream = f"http://{LOOPBACK}:{listener.getsockname()[1]}"

        async def check() -> None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=0.5)  # as the guard's session, shorter
            async with aiohttp.ClientSession(timeout=timeout) as session:
                checker = Checker(upstream, MODEL, GuardMetrics(MODEL, 1.0))
                checker.start(session)
                try:
                    with pytest.raises(aiohttp.ServerTimeoutError):  # the connect limit, not wait_for's
                        await asyncio.wait_for(checker.full_depth_positions(Choice([1], [2], [{}]), MODEL), 10)
                finally:
                    await checker.stop()

        asyncio.run(check())


def test_requests_and_answers_keep_their_bytes_and_framing() -> None:
    seen: list[tuple[str, str | None, bytes]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((request.raw_path, request.headers.get("Content-Type"), await request.read()))
        return web.Response(body=b'{"ok": true}', content_type="application/json")

    async def check() -> None:
        deep = b"[" * 100_000 + b"]" * 100_000  # deeper than Python's JSON parser goes: vLLM's to refuse
        async with guarded(answer, shadow_rate=0.0) as (url, _), aiohttp.ClientSession() as client:
            async with client.get(URL(url + "/v1/models%3Fx/a%2Fb?q=%26", encoded=True)) as response:
                assert response.content_length == len(b'{"ok": true}') and "Transfer-Encoding" not in response.headers
            async with client.post(url + COMPLETIONS_PATH, data=deep) as response:
                assert response.status == 200
        assert seen[0] == ("/v1/models%3Fx/a%2Fb?q=%26", None, b"")
        assert seen[1][2] == deep

    asyncio.run(check())


def test_an_echoed_completion_is_not_checked() -> None:
    """vLLM scores an echoed prompt too, its log-probabilities before the answer's: they would be read as the
    answer's."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
    assert checkable(COMPLETIONS_PATH, body)
    assert not checkable(COMPLETIONS_PATH, {**body, "echo": True})


def test_a_client_gone_mid_stream_is_not_read_as_vllm_failing(caplog: pytest.LogCaptureFixture) -> None:
    streaming: list[bool] = []

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        streaming.append(True)
        try:
            while True:
                await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null}]}\n\n')
                await asyncio.sleep(0.02)
        except ConnectionResetError:  # the guard closed it: quietly, as vLLM aborts a request
            return response
        finally:
            streaming.remove(True)

    async def check(shadow_rate: float) -> None:
        async with guarded(endless, shadow_rate) as (url, _), aiohttp.ClientSession() as client:
            async with client.post(url + CHAT_PATH, json={**CHAT_BODY, "stream": True}) as response:
                await response.content.readuntil(b"\n\n")
            for _ in range(100):  # the guard's next write finds the client gone and closes vLLM's stream
                if not streaming:
                    break
                await asyncio.sleep(0.05)
            assert not streaming

    for shadow_rate in (0.0, 1.0):
        asyncio.run(check(shadow_rate))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_cut_off_stream_whose_client_reads_nothing_ends_within_the_cut_off_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The error event of a stream the drain cuts off cannot reach a client that reads nothing: the cut-off gives
    up after CUT_OFF_SECONDS instead of waiting for room, which held the guard's exit a minute past its drain."""
    monkeypatch.setattr(proxy_module, "CUT_OFF_SECONDS", 0.1)

    class Stalled:  # every write waits for room the client never makes
        async def write(self, data: bytes = b"") -> None:
            await asyncio.Event().wait()

        write_eof = write

    async def check() -> None:
        metrics = GuardMetrics(MODEL, 0.0)
        proxy = GuardProxy("http://unused", 0.0, metrics, Checker("http://unused", MODEL, metrics))
        upstream = SimpleNamespace(headers={"Content-Type": "text/event-stream"})
        await asyncio.wait_for(proxy._cut_off(Stalled(), upstream), 5)

    asyncio.run(check())


def test_a_body_over_the_limit_gets_a_json_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_module, "MAX_BODY_BYTES", 1000)  # the limit the app is built with, made small

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({})

    async def check() -> None:
        async with guarded(ok) as (url, _), aiohttp.ClientSession() as client:
            response = await client.post(url + CHAT_PATH, data=b"x" * 2000)
            assert response.status == 413 and response.content_type == "application/json"
            assert "up to 1000 bytes" in (await response.json())["error"]["message"]

    asyncio.run(check())


def test_events_are_split_wherever_the_chunks_break() -> None:
    stream = b"data: a\n\ndata: bb\n\n\n\ndata: [DONE]\n\ntrailing"
    expected = [b"data: a\n\n", b"data: bb\n\n", b"\n\n", b"data: [DONE]\n\n", b"trailing"]

    async def split(sizes: list[int]) -> list[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            at = 0
            for size in sizes:
                yield stream[at : at + size]
                at += size

        return [event async for event in events(chunks())]

    for size in range(1, len(stream) + 1):  # every chunk size, each separator split at every byte
        sizes = [size] * (len(stream) // size) + [len(stream) % size]
        assert asyncio.run(split(sizes)) == expected, size


def test_a_header_sent_twice_arrives_twice_both_ways() -> None:
    seen: list[list[str]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.getall("X-Trace"))
        response = web.json_response({})
        response.headers.add("Set-Cookie", "a=1")
        response.headers.add("Set-Cookie", "b=2")
        return response

    async def check() -> None:
        for shadow_rate in (0.0, 1.0):  # passed and sampled
            async with guarded(answer, shadow_rate) as (url, _), aiohttp.ClientSession() as client:
                headers = [("X-Trace", "1"), ("X-Trace", "2")]
                async with client.post(url + CHAT_PATH, json=CHAT_BODY, headers=headers) as response:
                    assert response.headers.getall("Set-Cookie") == ["a=1", "b=2"]
            assert seen.pop() == ["1", "2"]

    asyncio.run(check())
