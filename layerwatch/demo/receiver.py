"""A loopback webhook receiver standing in for the pager and ticket bridges: Alertmanager's
notifications end here, in the process that runs it (`layerwatch demo`, the end-to-end tests).

It binds 127.0.0.1 on a free port and records every POST with the time it arrived; `url(path)` is
what a rendered alertmanager.yml points a receiver at (`/pager`, `/ticket`). It serves on the
bounded listener the sidecars use (layerwatch/http_listener.py): a slow or oversized request costs
it a socket, not a thread, and a bad one gets its 4xx.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from layerwatch import ports
from layerwatch.http_listener import Handler, Limits, Listener, Request, RequestHead, Response

# Where the rendered alertmanager.yml routes an alert: critical pages, warning opens a ticket.
PAGER_PATH, TICKET_PATH = "/pager", "/ticket"
# The most notifications a receiver keeps (a long demo must not grow without bound).
MAX_NOTIFICATIONS = 10_000
# Alertmanager's notifications: at most 100 alerts (the generated max_alerts), far under 1 MiB.
LIMITS = Limits(max_connections=16, max_body_bytes=1 << 20, body_methods=("POST",), workers=1)


@dataclass(frozen=True)
class Notification:
    received_at: float  # time.monotonic()
    receiver: str  # the URL path: /pager or /ticket
    payload: dict  # Alertmanager's webhook body

    def alerts(self) -> list[tuple[str, str, dict[str, str]]]:
        """(alertname, status, labels) of each alert the notification carries."""
        return [
            (alert["labels"].get("alertname", "?"), alert.get("status", "?"), alert["labels"])
            for alert in self.payload.get("alerts", [])
        ]


class _Recorder(Handler):
    def __init__(self, received: list[Notification]) -> None:
        self._received = received

    def screen(self, head: RequestHead) -> Response | None:
        return None if head.method == "POST" else Response(405, b"POST notifications\n", headers=(("Allow", "POST"),))

    def answer(self, request: Request) -> Response:
        try:
            payload = json.loads(request.body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            return Response(400, b"not a JSON object\n")
        self._received.append(Notification(time.monotonic(), request.head.path, payload))
        del self._received[:-MAX_NOTIFICATIONS]
        return Response(200)


class WebhookReceiver:
    """Records every POST Alertmanager sends, like a pager or ticket bridge would receive it."""

    def __init__(self) -> None:
        self.notifications: list[Notification] = []
        bound = ports.reserve(("127.0.0.1", 0), "the demo's webhook receiver", "(a free port)")
        self._listener = Listener(bound, _Recorder(self.notifications), LIMITS, "webhook-receiver")
        self._listener.start()

    def url(self, receiver: str) -> str:
        return f"http://127.0.0.1:{self._listener.address[1]}{receiver}"

    def first_firing(self, receiver: str, alertname: str, since: float = -math.inf) -> float | None:
        """When `receiver` was first notified of `alertname` firing (monotonic), at or after `since`, or None."""
        return next(
            (
                n.received_at
                for n in list(self.notifications)
                if n.receiver == receiver and n.received_at >= since
                for name, status, _ in n.alerts()
                if name == alertname and status == "firing"
            ),
            None,
        )

    def latest(self, count: int) -> list[Notification]:
        """The last `count` notifications, newest first."""
        return list(reversed(self.notifications[-count:]))

    def close(self) -> None:
        self._listener.stop()
