"""A loopback webhook receiver standing in for the pager and ticket bridges: Alertmanager's
notifications end here, in the process that runs it (`layerwatch demo`, the end-to-end tests).

It binds 127.0.0.1 on a free port and records every POST with the time it arrived; `url(path)` is
what a rendered alertmanager.yml points a receiver at (`/pager`, `/ticket`).
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Where the rendered alertmanager.yml routes an alert: critical pages, warning opens a ticket.
PAGER_PATH, TICKET_PATH = "/pager", "/ticket"
# The most notifications a receiver keeps (a long demo must not grow without bound).
MAX_NOTIFICATIONS = 10_000


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


class WebhookReceiver:
    """Records every POST Alertmanager sends, like a pager or ticket bridge would receive it."""

    def __init__(self) -> None:
        self.notifications: list[Notification] = []
        received = self.notifications

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    payload = json.loads(body)
                except ValueError:
                    self.send_response(400)
                    self.end_headers()
                    return
                received.append(Notification(time.monotonic(), self.path, payload))
                del received[:-MAX_NOTIFICATIONS]
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:  # keep the terminal (and pytest's output) for the results
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, receiver: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{receiver}"

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
        self._server.shutdown()
        self._server.server_close()
