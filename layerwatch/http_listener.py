"""A small HTTP/1.1 listener that bounds everything a client controls: the exporter's /metrics
page and the shim's mitigation receiver (docs/security.md, "Defences, by default").

Both used to be the standard library's ThreadingHTTPServer: a thread per connection from its first
byte, reading the request head with no bound on its time, so that 600 half-sent requests held 600
threads and 32 trickling ones locked Alertmanager out. Here one event-loop thread reads
the request line and headers of every connection, so a slow client costs a socket and a bounded
buffer, never a thread:

- at most `max_connections` connections. One more closes a connection whose answer is written
  (lingering, or slow to take it), else the one that has been waiting longest for its request head
  (a slow client: Alertmanager's and Prometheus' heads arrive in one packet; a connection between
  its head and its answer is never closed to make room), or, when none can be, is answered 503 at
  once;
- the request line and headers within `max_head_bytes` (else 431) and `head_timeout` seconds of
  the connection opening (else 408);
- a body only with one Content-Length of ASCII digits (else 400; none where `body_methods` need
  one: 411), at most `max_body_bytes` (else 413, unread), within `body_timeout` seconds (else 408);
- the answer is computed on a pool of `workers` threads, and must be taken by the client within
  `write_timeout` seconds (a connection whose answer is written may be closed to make room); it is
  handed to the socket `WRITE_CHUNK_BYTES` at a time as the client takes it, so that a client that
  does not read holds one chunk of a large answer, not a copy of it;
- one request per connection (`Connection: close`), as the stdlib's HTTP/1.0 server answered.

A `Handler` screens each head before its body is read (`screen`, on the event loop: cheap checks
such as the bearer token), answers on a worker thread (`answer`), and hears of each refusal the
listener makes itself (`refused`). Those refusals are logged, at a bounded rate (log_limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import threading
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import TypeVar
from urllib.parse import urlsplit

from layerwatch import ports
from layerwatch.log_limit import limit_rate

log = limit_rate(logging.getLogger(__name__))
T = TypeVar("T")

# What the listener refuses on its own, as Handler.refused hears it.
REFUSALS = (
    "too_many_connections",  # 503: every connection has its head in
    "evicted",  # closed, still waiting for its head, to make room for a new connection
    "head_timeout",  # 408
    "head_too_large",  # 431
    "malformed",  # 400: request line, a header, or Content-Length
    "length_required",  # 411: a body method without Content-Length, or a chunked body
    "body_too_large",  # 413, unread
    "body_timeout",  # 408
)
_HEAD_END = b"\r\n\r\n"
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token: methods and header names
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")  # no control characters
_CONTENT_LENGTH = re.compile(rb"[0-9]{1,18}")  # ASCII digits only: str.isdigit() also takes '²'
LINGER_SECONDS = 1.0  # after an answer, unread input is drained this long, so the close sends no reset
LINGER_BYTES = 1 << 16
WRITE_CHUNK_BYTES = 1 << 16  # an answer's body goes to the transport this much at a time, as the client reads


@dataclass(frozen=True)
class Limits:
    max_connections: int = 64
    max_head_bytes: int = 16 * 1024
    head_timeout: float = 10.0
    max_body_bytes: int = 0
    body_timeout: float = 10.0
    body_methods: tuple[str, ...] = ()  # methods whose requests must say their Content-Length
    workers: int = 4
    write_timeout: float = 10.0
    backlog: int = 1024  # a burst of connections waits in the kernel instead of having its SYNs dropped
    tick_seconds: float = 0.0  # call Handler.tick this often on a worker thread (0: never)


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    headers: dict[str, str]  # names in lower case; repeated headers joined by ", "
    peer: str

    @property
    def path(self) -> str:
        return urlsplit(self.target).path


@dataclass(frozen=True)
class Request:
    head: RequestHead
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()

    def head(self) -> bytes:
        """The status line and headers, up to the blank line that ends them."""
        lines = [
            f"HTTP/1.1 {self.status} {HTTPStatus(self.status).phrase}",
            f"Date: {formatdate(usegmt=True)}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {len(self.body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in self.headers),
        ]
        return "\r\n".join(lines).encode("latin-1") + _HEAD_END


class Handler:
    """What a Listener serves. `screen` runs on the event loop and must not block; `answer` on a
    worker thread; `refused` on the event loop; `tick` on a worker thread."""

    def screen(self, head: RequestHead) -> Response | None:
        """An answer given before the body is read (a refusal), or None to read it and answer."""
        return None

    def answer(self, request: Request) -> Response:
        return Response(404, b"not found\n")

    def refused(self, reason: str, head: RequestHead | None) -> None:
        """The listener refused a request (one of REFUSALS); `head` is None when it was refused
        before its head was in (and so before `screen` saw it)."""

    def tick(self) -> None:
        pass


class _Refused(Exception):
    def __init__(self, reason: str, status: int, message: str) -> None:
        super().__init__(message)
        self.reason, self.status = reason, status

    def response(self, *headers: tuple[str, str]) -> Response:
        return Response(self.status, f"{self}\n".encode(), headers=headers)


@dataclass(eq=False)
class _Connection:
    peer: str
    task: asyncio.Task | None = None
    busy: bool = False  # its head is in, its answer not written yet: never closed to make room
    answered: bool = False  # its answer written (a client slow to take it may be closed to make room)
    evicted: bool = False
    head: RequestHead | None = field(default=None, repr=False)


class Listener:
    """Serves `handler` on a bound socket (ports.reserve) from start() to stop(), on its own thread."""

    def __init__(self, sock: socket.socket, handler: Handler, limits: Limits, name: str) -> None:
        self._socket, self._handler, self._limits, self._name = sock, handler, limits, name
        self._connections: dict[_Connection, None] = {}  # in the order they opened: the oldest first
        self._stopping = False
        self._ticker: asyncio.Task | None = None
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix=f"{name}-worker")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._serving = threading.Event()
        self._failure: BaseException | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._socket.getsockname()[:2]
        return host, port

    def start(self) -> None:
        ports.listen(self._socket, self._limits.backlog)
        self._thread.start()
        self._serving.wait()
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        elif not self._loop.is_closed():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._socket.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            server = self._loop.run_until_complete(
                asyncio.start_server(
                    self._serve, sock=self._socket, limit=self._limits.max_head_bytes, backlog=self._limits.backlog
                )
            )
        except BaseException as exc:  # handed to start(), which raises it
            self._failure = exc
            self._serving.set()
            self._loop.close()
            return
        # Kept: the loop holds its tasks only weakly.
        self._ticker = self._loop.create_task(self._tick()) if self._limits.tick_seconds > 0 else None
        self._serving.set()
        try:
            self._loop.run_forever()
        finally:
            self._stopping = True
            # No more accepts, but the server closed only once the connections accepted already have
            # their transports: Python 3.11 leaks the socket of one made after (Server._attach asserts).
            self._loop.remove_reader(self._socket.fileno())
            self._end_every_task()
            server.close()
            self._loop.close()

    def _end_every_task(self) -> None:
        """Cancels the loop's tasks (every connection, admitted or not, each ending without raising:
        _serve; and the ticker) and runs the loop until none is left: a connection accepted in the
        loop's last turn, whose task has not run yet, ends at once when it does (a task left pending
        would be logged as destroyed, its socket left open)."""
        while tasks := asyncio.all_tasks(self._loop):
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._limits.tick_seconds)
            try:
                await self._loop.run_in_executor(self._pool, self._handler.tick)
            except Exception:
                log.exception("%s: the periodic task failed", self._name)

    # --- one connection ---------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._stopping:  # accepted as the listener stopped
            writer.transport.abort()
            return
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        connection = _Connection(peer, asyncio.current_task())
        try:
            if self._admit(connection):
                await self._exchange(reader, writer, connection)
            else:
                refusal = _Refused("too_many_connections", 503, "too many connections, try again")
                self._refuse(connection, refusal)
                await self._send(writer, connection, refusal.response(("Retry-After", "1")))
            writer.close()
            await _within(writer.wait_closed(), self._limits.write_timeout)
        except asyncio.CancelledError:
            # Not raised on: asyncio's stream callback reads a cancelled task's exception() and
            # logs that as a traceback (Python 3.11), whether the listener stops or made room.
            if connection.evicted and not connection.answered:
                self._refuse(connection, _Refused("evicted", 0, "closed to make room for a new connection"))
        except (OSError, asyncio.IncompleteReadError):
            # The client went away (a reset, which a socket's shutdown reports as ENOTCONN, not as a
            # ConnectionError), or did not take its answer in time (TimeoutError).
            pass
        finally:
            self._connections.pop(connection, None)
            writer.transport.abort()  # a no-op after an orderly close

    def _admit(self, connection: _Connection) -> bool:
        if len(self._connections) >= self._limits.max_connections:
            # One answered already (lingering, or slow to take its answer), else the one waiting
            # longest for its head (the oldest first: the dict keeps the order they opened in).
            victim = next((c for c in self._connections if c.answered), None)
            victim = victim or next((c for c in self._connections if not c.busy), None)
            if victim is None:
                return False
            victim.evicted = True
            self._connections.pop(victim)
            if victim.task is not None:
                victim.task.cancel()
        self._connections[connection] = None
        return True

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: _Connection):
        try:
            response = await self._respond(reader, writer, connection)
        except _Refused as refusal:
            self._refuse(connection, refusal)
            response = refusal.response()
        await self._send(writer, connection, response)
        await self._linger(reader, writer)

    async def _respond(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: _Connection
    ) -> Response:
        limits = self._limits
        try:
            raw = await _within(reader.readuntil(_HEAD_END), limits.head_timeout)
        except asyncio.LimitOverrunError:
            message = f"request line and headers over {limits.max_head_bytes} bytes"
            raise _Refused("head_too_large", 431, message) from None
        except TimeoutError:
            raise _Refused("head_timeout", 408, f"request head not received within {limits.head_timeout:g} s") from None
        connection.head = head = _parse_head(raw, connection.peer)
        connection.busy = True
        screened = self._guarded(self._handler.screen, head)
        if screened is not None:
            return screened
        length = _body_length(head, limits)
        if length and head.headers.get("expect", "").lower() == "100-continue":  # curl waits 1 s for it
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = await _within(reader.readexactly(length), limits.body_timeout)
        except TimeoutError:
            raise _Refused("body_timeout", 408, f"body not received within {limits.body_timeout:g} s") from None
        return await self._loop.run_in_executor(self._pool, self._guarded, self._handler.answer, Request(head, body))

    def _guarded(self, method, argument):
        try:
            return method(argument)
        except Exception:  # a bug: the client gets a 500, the listener goes on
            log.exception("%s: %s failed", self._name, method.__name__)
            return Response(500, b"internal error\n")

    def _refuse(self, connection: _Connection, refusal: _Refused) -> None:
        log.warning(
            "%s: request from %s refused (%s): %s",
            self._name,
            connection.peer,
            refusal.reason,
            refusal,
            extra={"rate_key": (self._name, refusal.reason)},
        )
        try:
            self._handler.refused(refusal.reason, connection.head)
        except Exception:
            log.exception("%s: counting a refusal failed", self._name)

    async def _send(self, writer: asyncio.StreamWriter, connection: _Connection, response: Response) -> None:
        """Writes the answer within write_timeout, its body a chunk at a time: the transport copies
        what the socket does not take at once, and an answer shared by many connections (the
        exporter's page) would otherwise be copied whole into each slow reader's buffer."""
        connection.busy, connection.answered = False, True
        async with asyncio.timeout(self._limits.write_timeout):
            writer.write(response.head())
            body = memoryview(response.body)
            for start in range(0, len(body), WRITE_CHUNK_BYTES):
                writer.write(body[start : start + WRITE_CHUNK_BYTES])
                await writer.drain()
            await writer.drain()

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close, then drain what the client still sends for a moment: closing a socket with
        unread input resets the connection, and the client may lose the answer with it."""
        if writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(LINGER_SECONDS):
                drained = 0
                while drained < LINGER_BYTES and (chunk := await reader.read(LINGER_BYTES)):
                    drained += len(chunk)


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    """asyncio.wait_for, less its flaw in Python 3.11: a cancellation that arrives as `awaitable`
    completes is lost there (its result returned, the task going on), while the listener relies on
    every cancellation ending the connection (a stop waits for them all, an eviction frees a place)."""
    async with asyncio.timeout(seconds):
        return await awaitable


def _parse_head(raw: bytes, peer: str) -> RequestHead:
    request_line, *header_lines = raw[: -len(_HEAD_END)].split(b"\r\n")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1] or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1"):
        raise _Refused("malformed", 400, "malformed request line")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, colon, value = line.partition(b":")
        value = value.strip(b" \t")
        if not colon or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise _Refused("malformed", 400, "malformed header line")  # obs-fold (a leading space) included
        key, text = name.decode("ascii").lower(), value.decode("latin-1")
        if key == "content-length" and key in headers:
            raise _Refused("malformed", 400, "more than one Content-Length")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return RequestHead(parts[0].decode("ascii"), parts[1].decode("latin-1"), headers, peer)


def _body_length(head: RequestHead, limits: Limits) -> int:
    if "transfer-encoding" in head.headers:
        raise _Refused("length_required", 411, "a body must come with a Content-Length, not a Transfer-Encoding")
    declared = head.headers.get("content-length")
    if declared is None:
        if head.method in limits.body_methods:
            raise _Refused("length_required", 411, "a Content-Length is required")
        return 0
    if not _CONTENT_LENGTH.fullmatch(declared.encode("latin-1")):
        raise _Refused("malformed", 400, "Content-Length must be a number of ASCII digits")
    length = int(declared)
    if length > limits.max_body_bytes:
        message = f"the body has {length} bytes, at most {limits.max_body_bytes} are accepted"
        raise _Refused("body_too_large", 413, message)
    return length
