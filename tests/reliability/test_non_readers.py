"""Clients that stop reading their answers on loopback with the segment
size of a real link (tests/slow_clients.py, `non_reader`).

- A stream whose client never reads leaves admission when its generation ends: it held its slot
  (and, enough of them, every slot) for as long as the client kept the connection.
- A connection whose client takes none of its answer for --send-timeout-seconds is closed, and what
  it was answering stopped; past --max-connections such a connection is closed to make room. Both
  held their connection for good: a stream blocked on a full socket, and connections pipelining
  requests they never read the answers of, which filled every connection slot.

The send deadline and the eviction are the API's protocol (service/http_protocol.py), tested in a
real uvicorn on loopback with small apps (no model needed, short deadlines); admission and the
connection cap against a real `layerwatch serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from layerwatch.demo.processes import free_port
from layerwatch.inference_shim.service.http_protocol import BoundedH11Protocol, ConnectionRefusals, HTTPLimits
from tests.reliability.conftest import MODEL_NAME, Shim, sample_sum, wait_for_metrics
from tests.slow_clients import closed_by_server, connect, non_reader

CHUNK = b"x" * 16384


class Served:
    """An app served by the API's protocol in a real uvicorn on loopback, in a thread."""

    def __init__(self, app: Starlette, limits: HTTPLimits) -> None:
        self.registry = CollectorRegistry()
        self.protocol = BoundedH11Protocol.bounded(limits, ConnectionRefusals(self.registry, MODEL_NAME))
        self.port = free_port()
        config = uvicorn.Config(
            app, port=self.port, http=self.protocol, lifespan="off", log_level="error", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)

    def refused(self, reason: str) -> float:
        labels = {"model_name": MODEL_NAME, "reason": reason}
        return self.registry.get_sample_value("layerwatch_http_connections_refused_total", labels) or 0.0

    @contextlib.contextmanager
    def running(self) -> Iterator[Served]:
        thread = threading.Thread(target=self.server.run, daemon=True)
        thread.start()
        try:
            while not self.server.started:
                time.sleep(0.02)
            yield self
        finally:
            self.server.should_exit = True
            thread.join(10)


def endless_stream_app(stopped: threading.Event) -> Starlette:
    """GET /: a stream that never ends (as a long generation), `stopped` set once it has ended (by
    its response's background task, as the shim cancels a generation); GET /big: 64 KiB at once."""

    async def chunks() -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0)  # as a generation waits for its next token
            yield CHUNK

    async def stream(_: Request) -> StreamingResponse:
        return StreamingResponse(chunks(), background=BackgroundTask(stopped.set))

    async def big(_: Request) -> Response:
        return Response(CHUNK * 4)

    return Starlette(routes=[Route("/", stream), Route("/big", big)])


def wait_until_closed(connection, timeout: float = 10.0) -> float:
    """Seconds until the server closed `connection` (unread); fails after `timeout`."""
    started = time.monotonic()
    while not closed_by_server(connection):
        assert time.monotonic() - started < timeout, "the server kept the connection of a client that reads nothing"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_stream_its_client_never_reads_is_closed_after_the_send_timeout_and_stopped():
    stopped = threading.Event()
    with Served(endless_stream_app(stopped), HTTPLimits(send_timeout=0.5)).running() as served:
        with non_reader(("127.0.0.1", served.port), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") as client:
            held = wait_until_closed(client)
        assert stopped.wait(5), "the stream went on after its connection was closed"
        assert served.refused("send_timeout") == 1
    assert 0.5 <= held < 5.0


def test_pipelined_requests_whose_answers_are_never_read_are_cut_off_after_the_send_timeout():
    with Served(endless_stream_app(threading.Event()), HTTPLimits(send_timeout=0.5)).running() as served:
        with non_reader(("127.0.0.1", served.port), b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 8) as client:
            held = wait_until_closed(client)
        assert served.refused("send_timeout") == 1
    assert 0.5 <= held < 5.0


def test_a_slow_reader_that_keeps_taking_its_answer_is_not_cut_off():
    """The send deadline is for a client that takes nothing (nginx's send_timeout: the time between
    two writes that make progress), not a bound on a whole answer."""
    stopped = threading.Event()
    with Served(endless_stream_app(stopped), HTTPLimits(send_timeout=2.0)).running() as served:
        with non_reader(("127.0.0.1", served.port), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") as client:
            read, deadline = 0, time.monotonic() + 5.0  # past two send timeouts
            while time.monotonic() < deadline:
                read += len(client.recv(8192))
                time.sleep(0.05)
            assert not closed_by_server(client)
        assert served.refused("send_timeout") == 0
    assert read > 3 * len(CHUNK)


def test_past_max_connections_a_connection_not_taking_its_answers_is_closed_for_room():
    """Two connections pipelining requests whose answers they never read, at a cap of two: the
    third connection is served, and the longest-stalled of the two closed for it. Before, a
    connection with a request in was never closed for room: 503 for as long as they stayed."""
    served = Served(endless_stream_app(threading.Event()), HTTPLimits(max_connections=2, send_timeout=60))
    with served.running():
        pipelined = b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 8
        with non_reader(("127.0.0.1", served.port), pipelined) as first:
            deadline = time.monotonic() + 10
            while len(served.protocol.stalled) < 1:
                assert time.monotonic() < deadline, "the first connection never stalled"
                time.sleep(0.02)
            with non_reader(("127.0.0.1", served.port), pipelined) as second:
                while len(served.protocol.stalled) < 2:
                    assert time.monotonic() < deadline, "the second connection never stalled"
                    time.sleep(0.02)
                with connect(("127.0.0.1", served.port)) as third:
                    third.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    answer = b""
                    while chunk := third.recv(65536):
                        answer += chunk
                assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(CHUNK * 4)
                wait_until_closed(first)
                assert not closed_by_server(second)
        assert served.refused("evicted") == 1
        assert served.refused("too_many_connections") == 0


# --- against `layerwatch serve` -------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_shim(tiny_checkpoint, tmp_path_factory) -> Iterator[Shim]:
    """One batch slot, one waiting slot, six connections; the default send timeout (30 s)."""
    shim = Shim(
        tmp_path_factory.mktemp("non-readers"),
        tiny_checkpoint,
        "--max-batch-size",
        "1",
        "--max-waiting-requests",
        "1",
        "--max-connections",
        "6",
    )
    shim.start()
    yield shim
    shim.stop()


def chat_stream(max_tokens: int) -> bytes:
    """A streamed chat completion with 20 alternatives per token: about 1.7 KB of events a token."""
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "In the beginning"}],
            "max_tokens": max_tokens,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def requests_counted(shim: Shim, status: str) -> float:
    return sample_sum(shim.metrics(), "layerwatch_requests_total", status=status)


def test_streams_their_clients_never_read_leave_admission_when_their_generation_ends(small_shim):
    """Were a request to leave admission only once its client read its last update, a
    client that never reads would block the stream on a full socket, so two of them (the batch slot and
    the waiting slot, ~200 KB of events each) would get every other request 429 until they hung up. Here
    they are counted, and leave, when their generations end, their connections still open."""
    shim = small_shim
    ok = requests_counted(shim, "ok")
    streams = [non_reader(("127.0.0.1", shim.port), chat_stream(max_tokens=120)) for _ in range(2)]
    try:
        wait_for_metrics(shim, lambda s: sample_sum(s, "layerwatch_requests_total", status="ok") == ok + 2)
        answer = shim.complete()
        assert answer.status_code == 200, answer.text
        assert not any(closed_by_server(stream) for stream in streams)  # unread, and still open
    finally:
        for stream in streams:
            stream.close()


def test_connections_pipelining_requests_they_never_read_cannot_hold_every_connection(small_shim):
    """Unguarded, six connections (the cap) each pipelining eight scrapes and reading
    nothing get /healthz a 503 for as long as they stay. Here one of them is closed for it."""
    shim = small_shim
    evicted = sample_sum(shim.metrics(), "layerwatch_http_connections_refused_total", reason="evicted")
    scrapes = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 8
    attackers = [non_reader(("127.0.0.1", shim.port), scrapes) for _ in range(6)]

    def answered_by_closing_an_attacker() -> bool:
        # (A probe may get in before the server has taken in every attacker: it proves nothing.)
        answered = httpx.get(f"{shim.url}/healthz", timeout=10).status_code == 200
        return answered and any(closed_by_server(attacker) for attacker in attackers)

    try:
        deadline = time.monotonic() + 30
        while not answered_by_closing_an_attacker():
            assert time.monotonic() < deadline, "every connection stayed held by clients that read nothing"
            time.sleep(0.1)
        assert sample_sum(shim.metrics(), "layerwatch_http_connections_refused_total", reason="evicted") > evicted
    finally:
        for attacker in attackers:
            attacker.close()
