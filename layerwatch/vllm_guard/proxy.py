"""The guard's HTTP side: every request goes to vLLM and its answer back unchanged, streamed as it comes, except
for the sampled share of generation requests (`checkable` ones, at `shadow_rate`): these ask vLLM also for the
answer's raw top-20 log-probabilities and token ids (openai_bodies.py), which are taken out of the answer again
before the client sees it, and once the answer is complete each choice is queued for the full-depth check
(checker.py). The queue is bounded: a full one is counted, never waited for. `/metrics` is the guard's own.

vLLM refusing a sampled request it would have served (a `--max-logprobs` below 20, say) gets the client's own
request sent instead, counted as a failed check. An upstream that cannot be reached is answered 502 in vLLM's
error shape; one that fails mid-stream ends the stream with an error event, as vLLM ends its own.

A stop signal drains: no new connection is taken, a new request on an open one is answered 503, the requests in
flight get `drain_timeout_seconds` to finish, and a stream still running then ends with an error event (its upstream
request closed: vLLM aborts it); a request whose answer has not begun is answered 503, as a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import signal
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from yarl import URL

from layerwatch.log_limit import limit_rate
from layerwatch.vllm_guard.checker import Checker
from layerwatch.vllm_guard.metrics import GuardMetrics
from layerwatch.vllm_guard.openai_bodies import CHAT_PATH, GENERATION_PATHS, Answer, checkable, dumps, sampled_body

log = limit_rate(logging.getLogger(__name__))  # an upstream down would log every request

# Connection-level headers (RFC 9110 section 7.6.1) and those aiohttp sets from the body it sends.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding"}
    | {"upgrade", "host", "content-length"}
)
MAX_BODY_BYTES = 64 << 20  # a request body, at most: long prompts as token ids run to megabytes
EVENT_END = b"\n\n"  # server-sent events are separated by a blank line
EVENT_STREAM = "text/event-stream"
CUT_OFF_SECONDS = 5.0  # for the streams cut off at the end of a drain to write their error event
ANSWER_BEGUN = web.RequestKey("answer_begun", bool)


def forwarded(headers: Any, drop: tuple[str, ...] = ()) -> CIMultiDict[str]:
    """The end-to-end headers, each as often as it came (two Set-Cookie stay two)."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() not in drop)


def error_body(status: int, message: str, kind: str = "BadGatewayError") -> bytes:
    """vLLM's error shape (ErrorResponse)."""
    return dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


class GuardProxy:
    def __init__(self, upstream: str, shadow_rate: float, metrics: GuardMetrics, checker: Checker) -> None:
        self.upstream = upstream
        self.shadow_rate = shadow_rate
        self.metrics = metrics
        self.checker = checker
        self._session: aiohttp.ClientSession | None = None
        self._in_flight: set[asyncio.Task[Any]] = set()  # each forwarded request's (its connection's) task
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/metrics", self.serve_metrics)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_response_prepare.append(self._answer_begins)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        # No total timeout: an answer streams as long as it generates. No decompression: bytes pass as sent.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), auto_decompress=False
        )
        self.checker.start(self._session)

    async def _stop(self, app: web.Application) -> None:
        await self.checker.stop()
        if self._session is not None:
            await self._session.close()

    async def serve_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @staticmethod
    async def _answer_begins(request: web.Request, response: web.StreamResponse) -> None:
        request[ANSWER_BEGUN] = True

    @staticmethod
    def _stopping() -> web.Response:
        error = error_body(503, "the layerwatch guard is stopping", "ServiceUnavailableError")
        return web.Response(status=503, body=error, content_type="application/json", headers={"Connection": "close"})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if self._draining:
            return self._stopping()
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        self._idle.clear()
        try:
            return await self._forward(request)
        except asyncio.CancelledError:
            # Cut off by the drain while waiting for vLLM (a non-streamed answer, before its headers): a 503 its
            # client can retry elsewhere, not a connection closed without an answer. One begun is _cut_off's.
            if not self._draining or request.get(ANSWER_BEGUN):
                raise
            return self._stopping()
        finally:
            self._in_flight.discard(task)
            if not self._in_flight:
                self._idle.set()

    async def drain(self, timeout: float) -> None:
        """No new request from now on (503); those in flight get `timeout` seconds to finish, then are cut off."""
        self._draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        cut = list(self._in_flight)
        for task in cut:  # a stream's handler ends it with an error event (_cut_off), its connection then closes
            task.cancel()
        if cut:
            await asyncio.wait(cut, timeout=CUT_OFF_SECONDS)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            message = f"the layerwatch guard takes request bodies of up to {MAX_BODY_BYTES} bytes"
            error = error_body(413, message, "BadRequestError")
            return web.Response(status=413, body=error, content_type="application/json")
        path = request.path
        client_body = self._json(body) if request.method == "POST" and path in GENERATION_PATHS else None
        generation = checkable(path, client_body)
        sampled = generation and random.random() < self.shadow_rate
        if sampled:
            assert isinstance(client_body, dict)
            return await self._sampled(request, path, client_body, body)
        return await self._passed(request, body, generation)

    @staticmethod
    def _json(body: bytes) -> Any:
        try:
            return json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested too deep for Python's parser
            return None  # vLLM answers it with its own error

    async def _upstream(self, request: web.Request, body: bytes, drop: tuple[str, ...] = ()) -> aiohttp.ClientResponse:
        assert self._session is not None
        headers = forwarded(request.headers, drop)
        url = URL(self.upstream + request.rel_url.raw_path_qs, encoded=True)  # the path as sent: %3F stays %3F
        # No body, no data: aiohttp would add a Content-Type the client did not send.
        data = body or None
        return await self._session.request(request.method, url, headers=headers, data=data, allow_redirects=False)

    async def _passed(self, request: web.Request, body: bytes, generation: bool) -> web.StreamResponse:
        """The request and its answer, byte for byte, streamed as they come."""
        try:
            upstream = await self._upstream(request, body)
        except aiohttp.ClientError as exc:
            return self._unreachable(exc)
        complete = False
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            response.headers.extend(forwarded(upstream.headers))
            if upstream.content_length is not None and "Transfer-Encoding" not in upstream.headers:
                response.content_length = upstream.content_length  # the framing vLLM chose, not chunks
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except aiohttp.ClientConnectionResetError:  # the client went away, not vLLM
                return response
            except aiohttp.ClientError as exc:
                await self._failed_mid_answer(response, upstream, exc)
                return response
            except asyncio.CancelledError:
                await self._cut_off(response, upstream)
                raise
            await response.write_eof()
            complete = True
            return response
        finally:
            if generation and upstream.status == 200:
                self.metrics.gated_request()  # answered or cancelled: it ran
            if complete:
                upstream.release()
            else:
                upstream.close()  # vLLM aborts what it still generates

    async def _sampled(
        self, request: web.Request, path: str, client_body: dict[str, Any], body: bytes
    ) -> web.StreamResponse:
        try:  # without the client's Accept-Encoding: the guard reads the answer
            upstream = await self._upstream(request, dumps(sampled_body(path, client_body)), drop=("accept-encoding",))
        except aiohttp.ClientError as exc:
            self.metrics.not_checked("no_output")
            return self._unreachable(exc)
        if upstream.status != 200:
            message = (await upstream.read())[:300].decode(errors="replace")
            upstream.release()
            log.warning(
                "a sampled request was refused (%d): %s; the client's own request sent instead",
                upstream.status,
                message,
            )
            self.metrics.not_checked("failed")
            return await self._passed(request, body, generation=True)
        answer = Answer(chat=path == CHAT_PATH, client_wants_token_ids=bool(client_body.get("return_token_ids")))
        complete = False
        try:
            if upstream.headers.get("Content-Type", "").startswith(EVENT_STREAM):
                response, complete = await self._restored_stream(request, upstream, answer)
            else:
                try:
                    whole = await upstream.read()
                except aiohttp.ClientError as exc:
                    return self._unreachable(exc)
                restored = restore_body(whole, answer)
                response, complete = web.Response(status=200, body=restored, headers=forwarded(upstream.headers)), True
            return response
        finally:
            self.metrics.gated_request()
            if complete:
                if answer.unreadable:
                    log.warning("a sampled answer cannot be checked: %s", answer.unreadable)
                    self.metrics.not_checked("failed")
                else:
                    self.checker.submit(answer.finished_choices(), client_body.get("model"))
                upstream.release()
            else:
                self.metrics.not_checked("no_output")
                upstream.close()

    async def _restored_stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, answer: Answer
    ) -> tuple[web.StreamResponse, bool]:
        """Each event of vLLM's stream, restored, as it comes; whether the stream ended."""
        response = web.StreamResponse(status=200, reason=upstream.reason)
        response.headers.extend(forwarded(upstream.headers))
        await response.prepare(request)
        try:
            async for event in events(upstream.content.iter_any()):
                await response.write(restore_event(event, answer))
        except aiohttp.ClientConnectionResetError:  # the client went away, not vLLM
            return response, False
        except aiohttp.ClientError as exc:
            await self._failed_mid_answer(response, upstream, exc)
            return response, False
        except asyncio.CancelledError:
            await self._cut_off(response, upstream)
            raise
        await response.write_eof()
        return response, True

    def _unreachable(self, exc: Exception) -> web.Response:
        log.warning("vLLM at %s cannot be reached: %s", self.upstream, exc)
        message = f"the layerwatch guard cannot reach vLLM at {self.upstream}: {exc or type(exc).__name__}"
        return web.Response(status=502, body=error_body(502, message), content_type="application/json")

    async def _failed_mid_answer(
        self, response: web.StreamResponse, upstream: aiohttp.ClientResponse, exc: Exception
    ) -> None:
        """vLLM went away with the answer begun: a stream ends with an error event as vLLM's own errors do;
        another body cannot be mended, and its connection is cut."""
        log.warning("vLLM at %s failed mid-answer: %s", self.upstream, exc)
        if upstream.headers.get("Content-Type", "").startswith(EVENT_STREAM):
            message = f"vLLM at {self.upstream} failed mid-answer: {exc or type(exc).__name__}"
            await response.write(b"data: " + error_body(502, message) + EVENT_END + b"data: [DONE]" + EVENT_END)
            await response.write_eof()
        else:
            raise ConnectionResetError("vLLM failed mid-answer")

    async def _cut_off(self, response: web.StreamResponse, upstream: aiohttp.ClientResponse) -> None:
        """A stream the guard stops serving (its drain ran out, the client went away): it ends with an error event
        where a client may still read it, as vLLM ends its own."""
        if not upstream.headers.get("Content-Type", "").startswith(EVENT_STREAM):
            return
        message = "the layerwatch guard stopped before the answer was complete"
        # TimeoutError: a client that reads nothing leaves no room for the event, and a wait for room would hold
        # the guard's exit (aiohttp's shutdown waits a minute for the handler) past the orchestrator's grace.
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError, TimeoutError):
            async with asyncio.timeout(CUT_OFF_SECONDS):
                await response.write(b"data: " + error_body(503, message, "ServiceUnavailableError") + EVENT_END)
                await response.write(b"data: [DONE]" + EVENT_END)
                await response.write_eof()


async def events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The server-sent events of a byte stream, each with its blank line; what trails the last one too. Only the
    bytes a chunk adds are searched: an event arriving in many chunks costs its length, not its length squared."""
    buffer = bytearray()
    async for chunk in chunks:
        searched = max(len(buffer) - len(EVENT_END) + 1, 0)  # a separator may straddle the chunks
        buffer += chunk
        start = 0
        while (end := buffer.find(EVENT_END, max(start, searched))) != -1:
            yield bytes(buffer[start : end + len(EVENT_END)])
            start = end + len(EVENT_END)
        del buffer[:start]
    if buffer:
        yield bytes(buffer)


def restore_body(whole: bytes, answer: Answer) -> bytes:
    """A whole answer restored; one that is not a JSON object is passed as it came (and not checked)."""
    try:
        body = json.loads(whole)
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        answer.unreadable = "not a JSON object"
        return whole
    return dumps(answer.read_and_restore(body))


def restore_event(event: bytes, answer: Answer) -> bytes:
    prefix = b"data: "
    payload = event.removesuffix(EVENT_END)
    if not payload.startswith(prefix) or payload == prefix + b"[DONE]":
        return event
    try:
        body = json.loads(payload[len(prefix) :])
    except (ValueError, RecursionError):
        return event
    if not isinstance(body, dict):
        return event
    return prefix + dumps(answer.read_and_restore(body)) + EVENT_END


async def run_until_stopped(
    proxy: GuardProxy, host: str, port: int, drain_timeout_seconds: float, stop_signals: Iterable[int]
) -> int:
    """Serve until one of `stop_signals`, then drain (module doc); the signal's number. A second one while draining
    is logged and ignored: the drain has its own limit."""
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None)  # a client gone: upstream closed
    await runner.setup()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if received:
            log.warning("%s received while draining: ignored", name)
            return
        received.append(signum)
        log.warning("%s received: draining (requests in flight get up to %g s)", name, drain_timeout_seconds)
        stop.set()

    # Before the site starts: a signal raised as an exception inside one of the loop's callbacks would be lost.
    for signum in stop_signals:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # one inherited as ignored stays ignored
            loop.add_signal_handler(signum, on_signal, signum)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        await stop.wait()
        await site.stop()
        await proxy.drain(drain_timeout_seconds)
    finally:
        await runner.cleanup()
    return received[0]
