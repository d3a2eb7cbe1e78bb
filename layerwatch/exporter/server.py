"""The running exporter: a UDP receiver thread for gate frames and an HTTP listener for /metrics."""

from __future__ import annotations

import logging
import socket
import threading

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from layerwatch import ports
from layerwatch.exporter.collectors import build_registry
from layerwatch.exporter.exposition import SharedRender, TextEncoder
from layerwatch.exporter.state import ExporterState
from layerwatch.http_listener import Handler, Limits, Listener, Request, RequestHead, Response
from layerwatch.wire import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

# Room for bursts (many shims flushing at once) before the kernel drops datagrams.
RECEIVE_BUFFER_BYTES = 8 * 1024 * 1024
# How often the receiver wakes up to notice a stop request.
_POLL_SECONDS = 0.2
# /metrics and /healthz (layerwatch/http_listener.py): a few scrapers, GETs without a body; the
# connection waiting longest for its request head is closed to let a new one in, so that a flood
# of half-sent requests never keeps a scrape out. A worker per connection: concurrent scrapes wait
# on one shared render (SharedRender), never in the pool's queue behind each other.
HTTP_LIMITS = Limits(max_connections=64, head_timeout=10.0, workers=64)


class FrameReceiver:
    """Reads datagrams until stopped and hands each to the state (which counts bad ones)."""

    def __init__(self, address: tuple[str, int], state: ExporterState) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_DGRAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        self._socket.bind(address)
        self._socket.settimeout(_POLL_SECONDS)
        self._state = state
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="frame-receiver", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self._socket.getsockname()[:2]

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self._socket.close()

    def _receive(self) -> None:
        while not self._stopping.is_set():
            try:
                # One byte more than a frame may have, so an oversized datagram is seen as such.
                data = self._socket.recv(MAX_FRAME_BYTES + 1)
            except TimeoutError:
                continue
            except OSError as exc:  # e.g. ICMP errors surfacing on the socket: keep receiving
                log.warning("receiving a frame failed: %s", exc)
                continue
            try:
                self._state.ingest_datagram(data)
            except Exception:  # a bug must not stop ingest for every shim
                log.exception("ingesting a %d-byte datagram failed", len(data))


class _Page(Handler):
    """GET /metrics, /healthz and / (a link page); anything else 404, other methods 405."""

    def __init__(self, registry: CollectorRegistry, receiver: FrameReceiver) -> None:
        self._receiver = receiver
        encoder = TextEncoder()
        self._metrics = SharedRender(lambda: encoder.encode(registry))

    def screen(self, head: RequestHead) -> Response | None:
        if head.method != "GET":
            return Response(405, b"only GET\n", headers=(("Allow", "GET"),))
        return None

    def answer(self, request: Request) -> Response:
        path = request.head.path
        if path == "/metrics":
            # Always the 0.0.4 text format: Prometheus accepts it whatever it asks for first.
            return Response(200, self._metrics.page(), CONTENT_TYPE_PLAIN_0_0_4)
        if path == "/healthz":
            return Response(200, b"ok\n") if self._receiver.is_alive() else Response(503, b"frame receiver stopped\n")
        if path == "/":
            links = b'<h1>layerwatch exporter</h1><a href="/metrics">/metrics</a> <a href="/healthz">/healthz</a>\n'
            return Response(200, links, "text/html; charset=utf-8")
        return Response(404, b"not found\n")


class ExporterServer:
    """Binds both sockets on construction (so the real ports are known), serves after start()."""

    def __init__(self, state: ExporterState, frames_address: tuple[str, int], http_address: tuple[str, int]) -> None:
        bound = ports.reserve(http_address, "the exporter's HTTP", "--http")
        try:
            self.receiver = FrameReceiver(frames_address, state)
        except OSError:
            bound.close()
            raise
        self.http = Listener(bound, _Page(build_registry(state), self.receiver), HTTP_LIMITS, "http")

    @property
    def frames_address(self) -> tuple[str, int]:
        return self.receiver.address

    @property
    def http_address(self) -> tuple[str, int]:
        return self.http.address

    def start(self) -> None:
        self.receiver.start()
        self.http.start()

    def stop(self) -> None:
        self.http.stop()
        self.receiver.stop()
