"""The mitigation webhook receiver: Alertmanager posts its notifications here (docs/service.md,
"Alert-driven mitigation").

Its own listener (`--mitigation-address`, loopback by default), apart from the public API: only
Alertmanager needs to reach it. Every request must carry `Authorization: Bearer <token>`, the
token from `--mitigation-token-file`; anything else is answered 401 before its body is read.
`POST /alerts` takes Alertmanager's version-4 webhook JSON, at most MAX_BODY_BYTES; the body
must arrive within BODY_TIMEOUT_SECONDS. For the operator, `GET /mitigations` lists the
mitigations in effect and `DELETE /mitigations` ends them all now. Each request is counted by outcome
(layerwatch_mitigation_webhook_requests_total). The server thread also ends the mitigations whose
time is up (`Mitigations.expire`) between requests, so that they end on time without traffic.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast

from inference_shim.service.mitigation import MalformedNotification, Mitigations, ShuttingDown, parse_notification
from layerwatch import ports

log = logging.getLogger(__name__)

WEBHOOK_PATH = "/alerts"
MITIGATIONS_PATH = "/mitigations"  # GET: the mitigations in effect; DELETE: end them all now
MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_SECONDS = 10.0
EXPIRY_POLL_SECONDS = 0.5
MAX_CONNECTIONS = 32  # Alertmanager sends a few notifications at a time
REQUEST_SECONDS = 2 * BODY_TIMEOUT_SECONDS  # for a whole request, headers and body, to arrive


def _handler_class(mitigations: Mitigations, token: Callable[[], bytes]) -> type[BaseHTTPRequestHandler]:
    counts = mitigations.metrics.webhook

    class Handler(BaseHTTPRequestHandler):
        timeout = BODY_TIMEOUT_SECONDS  # a slow or silent client loses its connection, not a thread forever

        def do_POST(self) -> None:
            if not self._authorized():
                return
            if self.path != WEBHOOK_PATH:
                self._refuse(404, "not_found", f"POST webhook notifications to {WEBHOOK_PATH}")
                return
            length = self.headers.get("Content-Length", "")
            if not length.isdigit():
                self._refuse(411, "malformed", "a Content-Length is required")
                return
            if int(length) > MAX_BODY_BYTES:
                self._refuse(413, "too_large", f"the body has {length} bytes, at most {MAX_BODY_BYTES} are accepted")
                return
            try:
                alerts = parse_notification(self._read_body(int(length)))
            except TimeoutError:
                self._refuse(408, "malformed", f"the body did not arrive within {BODY_TIMEOUT_SECONDS:g} s")
                return
            except MalformedNotification as exc:
                self._refuse(400, "malformed", str(exc))
                return
            try:
                outcomes = mitigations.apply(alerts)
            except ShuttingDown as exc:  # Alertmanager retries it: another replica, or this one restarted
                self._refuse(503, "shutting_down", f"{exc}: the notification was not applied, send it again")
                return
            counts["accepted"].inc()
            self._reply(200, {"outcomes": outcomes})

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path != MITIGATIONS_PATH:
                self._refuse(404, "not_found", f"GET {MITIGATIONS_PATH} lists the mitigations in effect")
                return
            counts["accepted"].inc()
            self._reply(200, {"mitigations": mitigations.in_effect()})

        def do_DELETE(self) -> None:
            if not self._authorized():
                return
            if self.path != MITIGATIONS_PATH:
                self._refuse(404, "not_found", f"DELETE {MITIGATIONS_PATH} ends every mitigation in effect")
                return
            counts["accepted"].inc()
            ended = mitigations.end_all()
            log.warning("the operator ended %d mitigation(s) (DELETE %s)", ended, MITIGATIONS_PATH)
            self._reply(200, {"ended": ended})

        def _read_body(self, length: int) -> bytes:
            """The body, all of it within BODY_TIMEOUT_SECONDS: the socket's timeout bounds each read
            only, and a client sending a byte now and then would hold this thread for ever."""
            deadline = time.monotonic() + BODY_TIMEOUT_SECONDS
            body = bytearray()
            try:
                while len(body) < length:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    self.connection.settimeout(left)
                    chunk = self.rfile.read1(length - len(body))
                    if not chunk:
                        break  # the client closed early: the short body fails validation
                    body += chunk
            finally:
                self.connection.settimeout(self.timeout)
            return bytes(body)

        def _authorized(self) -> bool:
            scheme, _, given = self.headers.get("Authorization", "").partition(" ")
            # Compared in constant time, so that timing does not tell how much of a guess was right.
            if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "replace"), token()):
                return True
            self._refuse(401, "unauthorized", "a valid bearer token is required", {"WWW-Authenticate": "Bearer"})
            return False

        def _refuse(self, status: int, outcome: str, message: str, headers: dict[str, str] | None = None) -> None:
            counts[outcome].inc()
            peer = self.client_address[0]
            log.warning("mitigation webhook from %s refused (%d %s): %s", peer, status, outcome, message)
            self.close_connection = True  # the unread body, if any, must not be taken for the next request
            self._reply(status, {"error": message}, {"Connection": "close", **(headers or {})})

        def _reply(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            cast(_HTTPServer, self.server).answered(self.connection)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS of them (more are closed at once, counted
    too_many_connections). A connection whose next request has not fully arrived REQUEST_SECONDS
    after it opened or after its last answer is read no further: its handler answers what arrived
    (without the token, 401) and closes it. The socket's timeout bounds each read only, and a peer
    sending a byte now and then, token or not, would keep a thread for ever."""

    daemon_threads = True  # a stuck client never blocks shutdown
    request_queue_size = MAX_CONNECTIONS  # the stdlib's backlog of 5 drops SYNs in a burst (a 1 s retry)

    def __init__(self, bound: socket.socket, handler: type[BaseHTTPRequestHandler], mitigations: Mitigations):
        self.mitigations = mitigations
        self._deadlines: dict[socket.socket, float] = {}  # each open connection's (monotonic)
        self._deadlines_lock = threading.Lock()
        super().__init__(bound.getsockname(), handler, bind_and_activate=False)
        self.socket.close()  # the stdlib's own, never bound: the one bound before the model loaded serves
        self.socket = bound

    def server_activate(self) -> None:
        ports.listen(self.socket, self.request_queue_size)

    def verify_request(self, request: socket.socket, client_address: object) -> bool:  # type: ignore[override]
        with self._deadlines_lock:
            if len(self._deadlines) >= MAX_CONNECTIONS:
                self.mitigations.metrics.webhook["too_many_connections"].inc()
                return False
            self._deadlines[request] = time.monotonic() + REQUEST_SECONDS
            return True

    def answered(self, connection: socket.socket) -> None:
        """The connection's request was answered: the next one gets REQUEST_SECONDS from now."""
        with self._deadlines_lock:
            self._deadlines[connection] = time.monotonic() + REQUEST_SECONDS

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        with self._deadlines_lock:
            self._deadlines.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:  # serve_forever calls this between requests, at least every poll
        self.mitigations.expire()
        now = time.monotonic()
        with self._deadlines_lock:
            overdue = [connection for connection, deadline in self._deadlines.items() if now >= deadline]
            for connection in overdue:
                del self._deadlines[connection]  # cut once
        for connection in overdue:
            with contextlib.suppress(OSError):  # already closed by its peer
                connection.shutdown(socket.SHUT_RD)  # its handler reads the end, answers and closes


def reserve(address: tuple[str, int]) -> socket.socket:
    """The receiver's socket, bound and not yet listening (layerwatch.ports.reserve), for MitigationReceiver."""
    return ports.reserve(address, "the mitigation receiver", "--mitigation-address")


class MitigationReceiver:
    """Listens on a socket from reserve() and serves after start(); stop() closes it."""

    def __init__(self, bound: socket.socket, mitigations: Mitigations, token: Callable[[], bytes]) -> None:
        """`token` gives the bearer token at each request (RotatingSecret.current: the file may be rotated)."""
        self._server = _HTTPServer(bound, _handler_class(mitigations, token), mitigations)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(EXPIRY_POLL_SECONDS,), name="mitigation-receiver", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        return cast(tuple[str, int], self._server.server_address[:2])

    def start(self) -> None:
        self._server.server_activate()  # listen
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
