"""The network between the engine and the exporter, for the `telemetry` drill: a UDP relay on loopback
that the engine sends its gate frames to and that forwards each one to the exporter, until the drill
makes it lose some.

The loss is deterministic (every n-th frame), not random: the share the exporter sees as sequence gaps
is the drill's share exactly, so its margin over the alert's limit is known in advance. The relay is a
thread of the demo's process: a frame is one datagram, a few hundred a second at most.
"""

from __future__ import annotations

import socket
import threading

from layerwatch.ports import LOOPBACK
from layerwatch.wire import parse_address

# The largest UDP datagram: the relay forwards what the engine sent, the exporter judges it.
MAX_DATAGRAM_BYTES = 65_535
# How often the relay's thread looks up from a quiet socket to see whether it was closed.
POLL_SECONDS = 0.5


class FrameLink:
    """Listens on `address` (loopback, a free port) and forwards every datagram to `destination`
    (HOST:PORT, the exporter's --listen); after `lose_every(n)`, every n-th datagram is dropped."""

    def __init__(self, destination: str) -> None:
        host, port = parse_address(destination)
        self._inbound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._inbound.bind((LOOPBACK, 0))
        self._inbound.settimeout(POLL_SECONDS)
        self._outbound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._outbound.connect((host, port))
        self.address = f"{LOOPBACK}:{self._inbound.getsockname()[1]}"
        self.forwarded = 0
        self.lost = 0
        self._every = 0  # 0: lose nothing
        self._seen = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._relay, name="frame-link", daemon=True)
        self._thread.start()

    def lose_every(self, n: int) -> None:
        """From now on drop every n-th frame (a share of 1/n); 0 forwards them all again."""
        if n < 0 or n == 1:
            raise ValueError(f"lose_every takes 0 (nothing) or n >= 2 (a share of 1/n), got {n}")
        self._every, self._seen = n, 0

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2 * POLL_SECONDS)
        self._inbound.close()
        self._outbound.close()

    def _relay(self) -> None:
        while not self._closed.is_set():
            try:
                frame = self._inbound.recv(MAX_DATAGRAM_BYTES)
            except TimeoutError:
                continue
            except OSError:  # closed under us
                return
            self._seen += 1
            if self._every and self._seen % self._every == 0:
                self.lost += 1
                continue
            try:
                self._outbound.send(frame)
                self.forwarded += 1
            except OSError:  # no exporter listening yet (ICMP port unreachable): the frame is lost, as on a network
                self.lost += 1
