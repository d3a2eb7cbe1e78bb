"""The running exporter: a UDP receiver thread for gate frames and an HTTP server for /metrics."""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from exporter.collectors import build_registry
from exporter.exposition import TextEncoder
from exporter.state import ExporterState
from layerwatch.wire import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

# Room for bursts (many shims flushing at once) before the kernel drops datagrams.
RECEIVE_BUFFER_BYTES = 8 * 1024 * 1024
# How often the receiver wakes up to notice a stop request.
_POLL_SECONDS = 0.2


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


def _handler_class(registry: CollectorRegistry, receiver: FrameReceiver) -> type[BaseHTTPRequestHandler]:
    encoder = TextEncoder()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == "/metrics":
                # Always the 0.0.4 text format: Prometheus accepts it whatever it asks for first.
                self._reply(200, CONTENT_TYPE_PLAIN_0_0_4, encoder.encode(registry))
            elif path == "/healthz":
                if receiver.is_alive():
                    self._reply(200, "text/plain; charset=utf-8", b"ok\n")
                else:
                    self._reply(503, "text/plain; charset=utf-8", b"frame receiver stopped\n")
            elif path == "/":
                self._reply(
                    200,
                    "text/html; charset=utf-8",
                    b'<h1>layerwatch exporter</h1><a href="/metrics">/metrics</a> <a href="/healthz">/healthz</a>\n',
                )
            else:
                self._reply(404, "text/plain; charset=utf-8", b"not found\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never blocks shutdown

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)


class ExporterServer:
    """Binds both sockets on construction (so the real ports are known), serves after start()."""

    def __init__(self, state: ExporterState, frames_address: tuple[str, int], http_address: tuple[str, int]) -> None:
        self.receiver = FrameReceiver(frames_address, state)
        registry = build_registry(state)
        self.http = _HTTPServer(http_address, _handler_class(registry, self.receiver))
        self._http_thread = threading.Thread(target=self.http.serve_forever, name="http", daemon=True)

    @property
    def frames_address(self) -> tuple[str, int]:
        return self.receiver.address

    @property
    def http_address(self) -> tuple[str, int]:
        # typeshed allows a bytes host (bind() accepts one); an AF_INET/AF_INET6 server reports a str.
        return cast(tuple[str, int], self.http.server_address[:2])

    def start(self) -> None:
        self.receiver.start()
        self._http_thread.start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.receiver.stop()
