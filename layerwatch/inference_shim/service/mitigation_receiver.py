"""The mitigation webhook receiver: Alertmanager posts its notifications here (docs/service.md,
"Alert-driven mitigation").

Its own listener (`--mitigation-address`, loopback by default), apart from the public API: only
Alertmanager needs to reach it. Every request must carry `Authorization: Bearer <token>`, the
token from `--mitigation-token-file`; anything else is answered 401 before its body is read.
`POST /alerts` takes Alertmanager's version-4 webhook JSON, at most MAX_BODY_BYTES; the body
must arrive within BODY_TIMEOUT_SECONDS. For the operator, `GET /mitigations` lists the
mitigations in effect and `DELETE /mitigations` ends them all now. Each request is counted by outcome
(layerwatch_mitigation_webhook_requests_total). The listener (layerwatch/http_listener.py) bounds
what a client without the token can hold: a request head within HEAD_TIMEOUT_SECONDS and 16 KiB,
at most MAX_CONNECTIONS connections, the one waiting longest for its head closed to let a new one
in, so that trickling connections cannot lock Alertmanager out. Every such refusal counts as
unauthorized: no token was shown. The listener also ends the mitigations whose time is up
(`Mitigations.expire`) every EXPIRY_POLL_SECONDS, so that they end on time without traffic.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from layerwatch import ports
from layerwatch.http_listener import Handler, Limits, Listener, Request, RequestHead, Response
from layerwatch.inference_shim.service.mitigation import (
    MalformedNotification,
    Mitigations,
    ShuttingDown,
    parse_notification,
)
from layerwatch.log_limit import limit_rate

log = limit_rate(logging.getLogger(__name__))

WEBHOOK_PATH = "/alerts"
MITIGATIONS_PATH = "/mitigations"  # GET: the mitigations in effect; DELETE: end them all now
MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_SECONDS = 10.0
HEAD_TIMEOUT_SECONDS = 10.0
EXPIRY_POLL_SECONDS = 0.5
MAX_CONNECTIONS = 32  # Alertmanager sends a few notifications at a time
LIMITS = Limits(
    max_connections=MAX_CONNECTIONS,
    head_timeout=HEAD_TIMEOUT_SECONDS,
    max_body_bytes=MAX_BODY_BYTES,
    body_timeout=BODY_TIMEOUT_SECONDS,
    body_methods=("POST",),
    tick_seconds=EXPIRY_POLL_SECONDS,
)
ROUTES = {("POST", WEBHOOK_PATH), ("GET", MITIGATIONS_PATH), ("DELETE", MITIGATIONS_PATH)}
# A refusal of the listener's own after the token was shown: its outcome (else malformed).
_AUTHENTICATED_REFUSALS = {"body_too_large": "too_large"}


@dataclass(frozen=True)
class _Refusal:
    status: int
    outcome: str
    message: str
    headers: tuple[tuple[str, str], ...] = ()


class _Webhook(Handler):
    def __init__(self, mitigations: Mitigations, token: Callable[[], bytes]) -> None:
        self._mitigations, self._token = mitigations, token
        self._counts = mitigations.metrics.webhook

    def screen(self, head: RequestHead) -> Response | None:
        scheme, _, given = head.headers.get("authorization", "").partition(" ")
        # Compared in constant time, so that timing does not tell how much of a guess was right.
        given_token = given.strip().encode("utf-8", "replace")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given_token, self._token())):
            challenge = (("WWW-Authenticate", "Bearer"),)
            return self._refuse(head.peer, _Refusal(401, "unauthorized", "a valid bearer token is required", challenge))
        if (head.method, head.path) not in ROUTES:
            return self._refuse(
                head.peer,
                _Refusal(404, "not_found", f"POST notifications to {WEBHOOK_PATH}; GET or DELETE {MITIGATIONS_PATH}"),
            )
        return None

    def answer(self, request: Request) -> Response:
        if request.head.method == "GET":
            self._counts["accepted"].inc()
            return _json(200, {"mitigations": self._mitigations.in_effect()})
        if request.head.method == "DELETE":
            self._counts["accepted"].inc()
            ended = self._mitigations.end_all()
            log.warning("the operator ended %d mitigation(s) (DELETE %s)", ended, MITIGATIONS_PATH)
            return _json(200, {"ended": ended})
        try:
            outcomes = self._mitigations.apply(parse_notification(request.body))
        except MalformedNotification as exc:
            return self._refuse(request.head.peer, _Refusal(400, "malformed", str(exc)))
        except ShuttingDown as exc:  # Alertmanager retries it: another replica, or this one restarted
            message = f"{exc}: the notification was not applied, send it again"
            return self._refuse(request.head.peer, _Refusal(503, "shutting_down", message))
        self._counts["accepted"].inc()
        return _json(200, {"outcomes": outcomes})

    def refused(self, reason: str, head: RequestHead | None) -> None:
        # A head screened was authenticated; a refusal before (too slow, too large, malformed, closed
        # to make room) never showed the token.
        if head is None:
            outcome = "too_many_connections" if reason == "too_many_connections" else "unauthorized"
        else:
            outcome = _AUTHENTICATED_REFUSALS.get(reason, "malformed")
        self._counts[outcome].inc()

    def tick(self) -> None:
        self._mitigations.expire()

    def _refuse(self, peer: str, refusal: _Refusal) -> Response:
        self._counts[refusal.outcome].inc()
        log.warning(
            "mitigation webhook from %s refused (%d %s): %s",
            peer,
            refusal.status,
            refusal.outcome,
            refusal.message,
            extra={"rate_key": refusal.outcome},
        )
        return _json(refusal.status, {"error": refusal.message}, refusal.headers)


def _json(status: int, body: dict, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, json.dumps(body).encode(), "application/json", headers)


def reserve(address: tuple[str, int]) -> socket.socket:
    """The receiver's socket, bound and not yet listening (layerwatch.ports.reserve), for MitigationReceiver."""
    return ports.reserve(address, "the mitigation receiver", "--mitigation-address")


class MitigationReceiver:
    """Listens on a socket from reserve() and serves after start(); stop() closes it."""

    def __init__(
        self, bound: socket.socket, mitigations: Mitigations, token: Callable[[], bytes], limits: Limits = LIMITS
    ) -> None:
        """`token` gives the bearer token at each request (RotatingSecret.current: the file may be rotated)."""
        self._listener = Listener(bound, _Webhook(mitigations, token), limits, "mitigation-receiver")

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.address

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        self._listener.stop()
