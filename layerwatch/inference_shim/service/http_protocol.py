"""The API's HTTP/1.1 protocol: uvicorn's h11 implementation, with bounds on what a client's
request head, and an answer it leaves unread, may cost (docs/service.md, "Connections").

uvicorn's default parser (httptools) sets no limit on a header line and re-copies it as it grows,
on the event loop: one client sending an endless header line held /healthz at 2.5-9.8 s and cost
290 MB. h11, which uvicorn also brings, refuses an incomplete request line and headers
over `max_incomplete_event_size` bytes (here `HTTPLimits.max_head_bytes`); this protocol refuses a
complete one over that size too (h11 parses a head that arrives whole in one read at any size),
with a 431 (where uvicorn says 400 for any parse error). uvicorn bounds neither the time a head
may take, nor the number of connections, nor how long an answer may wait for its client, so this
protocol adds all three:

- a request head must be complete within `head_timeout` seconds of the connection opening or of
  the previous answer on it (else 408 and the connection closed; a connection that sent nothing
  is just closed, as uvicorn closes an idle keep-alive one after `timeout_keep_alive`);
- at most `max_connections` connections: one more closes the connection whose request has been
  arriving longest (a slow client, still sending its head or its body), else the one whose answer
  has waited longest for its client (below), else the one idle longest (a keep-alive connection
  between requests: its client reconnects), or, when every connection has a whole request in and
  takes its answers (never closed to make room), is answered 503 at once, with `Retry-After` as
  the admission queue's 429 (room comes back as soon as any of them is answered). A body still
  arriving is closed as a head is: 1,000 bodies trickled a byte at a time otherwise kept everyone
  out for the whole body timeout (30 s), again after each reconnect (docs/reliability.md);
- an answer the client does not take: a connection whose unsent output has not shrunk for
  `send_timeout` seconds is reset, its unsent output dropped (nginx's `send_timeout`: the time
  between two writes that make progress, not a bound on the whole answer), which cancels a
  generation still running for it. A stream whose client stopped reading held its connection for
  good, and connections pipelining requests without reading the answers would fill every slot.

It also refuses a request whose body two parsers could frame differently, where h11 accepts it:
`Content-Length` with `Transfer-Encoding` (h11 reads it chunked and keeps the connection: behind a
proxy that reads the length, the rest of the body is the next request, smuggled past it), or
`Transfer-Encoding` in an HTTP/1.0 request (a 1.0 hop ignores it). RFC 9112 (sections 6.1 and 6.3)
has both answered as an error, then the connection closed; h11 already refuses differing lengths
and any coding but `chunked` (uvicorn's 400, counted as a malformed head).

Each refusal is counted (layerwatch_http_connections_refused_total) and logged at a bounded rate.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import socket
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import h11
from prometheus_client import CollectorRegistry
from uvicorn.protocols.http.h11_impl import H11Protocol

from layerwatch.inference_shim.service.metrics import make_counter
from layerwatch.log_limit import limit_rate

log = limit_rate(logging.getLogger(__name__))

# uvicorn's own warning for each malformed request ("Invalid HTTP request received."), at a bounded rate too
limit_rate(logging.getLogger("uvicorn.error"))

REFUSALS = (
    "head_too_large",
    "malformed_head",
    "ambiguous_framing",
    "head_timeout",
    "evicted",
    "too_many_connections",
    "send_timeout",
)
_HEAD_END = re.compile(rb"\n\r?\n")  # where h11 sees the end of a request head
# Kept besides the connections (a quarter of a lower hard limit): the model's files, the trace, its
# own sockets; an idle `serve` holds about 20.
SPARE_FILE_DESCRIPTORS = 256
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection, dropping unsent data
RETRY_AFTER_SECONDS = 1  # past max_connections: each busy connection is evictable again once answered


@dataclass(frozen=True)
class HTTPLimits:
    max_head_bytes: int = 16 * 1024  # h11's own default
    head_timeout: float = 10.0
    max_connections: int = 1000
    # nginx's send_timeout is 60 s, the exporter's listener allows 10 s for a whole answer: 30 s, as
    # the body timeout, lets a client behind a congested link catch up and frees a stalled one's socket.
    send_timeout: float = 30.0


class ConnectionRefusals:
    """layerwatch_http_connections_refused_total{reason}, every reason exposed from the start."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        counter = make_counter("layerwatch_http_connections_refused_total", registry)
        self._counts = {reason: counter.labels(model_name, reason) for reason in REFUSALS}

    def count(self, reason: str) -> None:
        self._counts[reason].inc()


class FramingCheckedConnection(h11.Connection):
    """h11's connection, raising its RemoteProtocolError for a request with an ambiguous body length
    (see the module's docstring), the reason kept in `framing_fault` for the answer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.framing_fault: str | None = None

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}  # lower-cased by h11
            if b"transfer-encoding" in names and b"content-length" in names:
                self.framing_fault = "Content-Length and Transfer-Encoding both sent: the body length is ambiguous."
            elif b"transfer-encoding" in names and event.http_version == b"1.0":
                self.framing_fault = "Transfer-Encoding in an HTTP/1.0 request: the body length is ambiguous."
            if self.framing_fault is not None:
                raise h11.RemoteProtocolError(self.framing_fault)
        return event


class BoundedH11Protocol(H11Protocol):
    """One connection; `bounded()` makes the class a server uses, with its limits and its counts."""

    limits: ClassVar[HTTPLimits]
    refusals: ClassVar[ConnectionRefusals]
    conn: FramingCheckedConnection
    # This server's connections waiting for a request, the longest-waiting first: those with part
    # of one in (of its head, or its head and part of its body), and those with nothing yet (new, or
    # between two requests).
    arriving: ClassVar[OrderedDict[BoundedH11Protocol, None]]
    idle: ClassVar[OrderedDict[BoundedH11Protocol, None]]
    # Its connections with output the client has not taken yet, the longest-stalled first.
    stalled: ClassVar[OrderedDict[BoundedH11Protocol, None]]

    @classmethod
    def bounded(cls, limits: HTTPLimits, refusals: ConnectionRefusals) -> type[BoundedH11Protocol]:
        # The queues are this server's own: each bounded() class serves one server.
        attributes = {
            "limits": limits,
            "refusals": refusals,
            "arriving": OrderedDict(),
            "idle": OrderedDict(),
            "stalled": OrderedDict(),
        }
        return cast(type[BoundedH11Protocol], type(cls.__name__, (cls,), attributes))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = FramingCheckedConnection(h11.SERVER, self.limits.max_head_bytes)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._reading_body = False  # its request head is in, its body is still arriving
        self._send_deadline: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes of output waiting for the client when the send deadline was set

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Writing pauses as soon as the kernel leaves any output unsent (not past asyncio's 64 KiB),
        # so that the send deadline watches every answer a client leaves unread, however small,
        # and the next write of an answer waits for the client instead of piling up here.
        transport.set_write_buffer_limits(high=0)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            self._refuse("too_many_connections", 503, "Too many connections, try again.", RETRY_AFTER_SECONDS)
            return
        self._wait_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        self._stop_stall_watch()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.stalled[self] = None
        self._unsent = self.transport.get_write_buffer_size()
        self._send_deadline = self.loop.call_later(self.limits.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_stall_watch()

    def data_received(self, data: bytes) -> None:
        if self in self.idle:  # its head begins
            del self.idle[self]
            self.arriving[self] = None
        super().data_received(data)

    def handle_events(self) -> None:
        # h11 bounds an incomplete head only: one that comes whole in a read passes at any size, so
        # each head is measured before h11 parses it: as it arrives, and one pipelined behind the
        # request just answered when its turn comes.
        if self.conn.their_state is h11.IDLE and self._head_too_large(self.conn.trailing_data[0]):
            return
        super().handle_events()
        if self.conn.their_state is h11.SEND_BODY:  # its head is in: no head deadline, still arriving
            self._reading_body = True
            if not self.transport.is_closing():  # (a pipelined head, read after the previous answer)
                self.arriving.setdefault(self, None)
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None
        elif self.conn.their_state is not h11.IDLE:  # a whole request is in (or the connection is done)
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # the next request's cycle, and any pipelined head already in
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            self._wait_for_head()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to any head h11 refused: 431 when it is the size, ours to an ambiguous body length."""
        if self.conn.framing_fault is not None:  # the head is in: h11 now waits for its body
            self._stop_waiting()
            self._refuse("ambiguous_framing", 400, self.conn.framing_fault)
        elif len(self.conn.trailing_data[0]) > self.limits.max_head_bytes:
            self._refuse_too_large()
        else:
            self.refusals.count("malformed_head")
            super().send_400_response(msg)

    def _wait_for_head(self) -> None:
        self._stop_waiting()
        (self.arriving if self.conn.trailing_data[0] else self.idle)[self] = None
        self._head_deadline = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)

    def _stop_waiting(self) -> None:
        self._reading_body = False
        self.arriving.pop(self, None)
        self.idle.pop(self, None)
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _stop_stall_watch(self) -> None:
        self.stalled.pop(self, None)
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _make_room(self) -> bool:
        """Close the connection whose request has been arriving longest, else the one whose output
        has waited longest for its client, else the one idle longest; False when every connection
        has a whole request in and takes its answers."""
        if self.arriving:
            oldest = next(iter(self.arriving))
            oldest.refusals.count("evicted")
            part = "body" if oldest._reading_body else "head"
            log.warning("closed a connection from %s still sending its request %s, to make room", oldest.peer, part)
        elif self.stalled:
            oldest = next(iter(self.stalled))
            oldest.refusals.count("evicted")
            log.warning("closed a connection from %s not taking its answer, to make room", oldest.peer)
        elif self.idle:
            oldest = next(iter(self.idle))
        else:
            return False
        oldest._stop_waiting()
        oldest._close_now()
        return True

    def _close_now(self) -> None:
        """Close, dropping any output the client has not taken: an orderly close waits for it to be
        sent, which a client that does not read holds off for good (here, and in the kernel, which
        would keep the socket and its unsent answer: it is reset instead, as nginx's
        `reset_timedout_connection` does)."""
        self._stop_stall_watch()
        if self.transport.get_write_buffer_size():
            self.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            self.transport.abort()
        else:
            self.transport.close()

    def _send_timed_out(self) -> None:
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent:  # the client took some: a slow reader, given another period
            self._unsent = unsent
            self._send_deadline = self.loop.call_later(self.limits.send_timeout, self._send_timed_out)
            return
        self._send_deadline = None
        self.refusals.count("send_timeout")
        log.warning(
            "closed a connection from %s: its client took none of %d bytes of its answer within %g s",
            self.peer,
            unsent,
            self.limits.send_timeout,
        )
        self._stop_waiting()
        self._close_now()

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        self._stop_waiting()
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:
            self._refuse("head_timeout", 408, f"Request head not received within {self.limits.head_timeout:g} s.")
        else:
            self.transport.close()  # nothing sent: as a keep-alive timeout

    def _head_too_large(self, pending: bytes) -> bool:
        """Whether the request head beginning `pending` is over the bound: then refused, 431."""
        end = _HEAD_END.search(pending)
        if (end.start() if end else len(pending)) <= self.limits.max_head_bytes:
            return False
        self._stop_waiting()
        self._refuse_too_large()
        return True

    def _refuse_too_large(self) -> None:
        self._refuse("head_too_large", 431, f"Request line and headers over {self.limits.max_head_bytes} bytes.")

    def _refuse(self, reason: str, status: int, message: str, retry_after: int | None = None) -> None:
        """Answer `status` (h11 lets a server answer before a request is in) and close."""
        self.refusals.count(reason)
        log.warning(
            "request from %s refused (%d %s): %s", self.peer, status, reason, message, extra={"rate_key": reason}
        )
        body = message.encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # a response already begun, or the body of one to HEAD: closing is left
            pass
        self.transport.close()

    @property
    def peer(self) -> str:
        return self.client[0] if self.client else "?"


def fit_open_files(max_connections: int) -> int:
    """`max_connections`, with the soft limit on open files raised to hold them if it is lower (as
    systemd asks of a program that needs more than its 1024); less, and a warning, when even the
    hard limit cannot hold them: a server out of file descriptors stops accepting anyone at all."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = SPARE_FILE_DESCRIPTORS if hard == resource.RLIM_INFINITY else min(SPARE_FILE_DESCRIPTORS, hard // 4)
    needed = max_connections + spare
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    ceiling = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
    if ceiling < needed:
        fitted = max(1, ceiling - spare)
        log.warning(
            "--max-connections %d lowered to %d: at most %d open files (ulimit -Hn)", max_connections, fitted, hard
        )
        return fitted
    return max_connections
