"""One HTTP GET whose whole exchange is bounded: what `layerwatch top` reads from an exporter and from
Prometheus (layerwatch/exporter/live_view.py, layerwatch/demo/alert_view.py).

A socket's timeout bounds each read, not the answer: a server trickling a byte every few seconds, in
its head or its body, held `top` for as long as it liked, and an endless body grew it without bound.
Here the exchange, head included, ends by one deadline and at a size limit, and whatever http.client
raises for a broken answer (its errors are neither OSError nor ValueError) is one `BadAnswer`.
"""

from __future__ import annotations

import http.client
import io
import math
import socket
import time
import urllib.parse
from dataclasses import dataclass


class BadAnswer(ValueError):
    """The server answered, but not with a whole HTTP answer: a broken status line or head, a chunked
    body closed mid-chunk, or a body cut short of its Content-Length (http.client's read1 ends such a
    body quietly)."""


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    body: bytes


def get(url: str, timeout: float, max_bytes: int, accept: str, what: str = "answer") -> Answer:
    """GET `url` (http or https) within `timeout` seconds and `max_bytes` of body, whatever the status.

    Raises TimeoutError ("the {what} took over ..."), ValueError ("a {what} over ... MiB"), BadAnswer,
    or the OSError of a server that is not there or hangs up without answering."""
    parts = urllib.parse.urlsplit(url)
    connection_class = _BoundedHTTPSConnection if parts.scheme == "https" else _BoundedHTTPConnection
    connection = connection_class(parts.netloc, timeout=timeout)
    connection.deadline = time.monotonic() + timeout
    connection.what = what
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("GET", path or "/", headers={"Accept": accept})
        response = connection.getresponse()
        body = bytearray()
        while chunk := response.read1(1 << 16):
            body += chunk
            if len(body) > max_bytes:
                raise ValueError(f"a {what} over {max_bytes >> 20} MiB")
        if response.length:  # what the head announced and the server never sent
            raise BadAnswer(f"the {what} ended {response.length} bytes short of its Content-Length")
        return Answer(response.status, response.reason, bytes(body))
    except http.client.HTTPException as exc:
        if isinstance(exc, OSError):  # RemoteDisconnected: no answer at all, as a server that is not there
            raise
        raise BadAnswer(f"not an HTTP answer: {type(exc).__name__}: {str(exc).strip()}") from None
    finally:
        connection.close()


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting only for what is left of one deadline."""

    def __init__(self, sock: socket.socket, deadline: float, timeout: float, what: str) -> None:
        self._sock, self._deadline, self._timeout, self._what = sock, deadline, timeout, what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]  # RawIOBase's takes any buffer
        left = self._deadline - time.monotonic()
        if left > 0:
            self._sock.settimeout(left)
            try:
                return self._sock.recv_into(buffer)
            except TimeoutError:
                pass
        raise TimeoutError(f"the {self._what} took over {self._timeout:g} s")

    def close(self) -> None:
        if not self.closed:
            self._sock.close()
        super().close()


class _DeadlineSocket:
    """A connected socket whose response stream (http.client reads it through makefile) ends at a deadline."""

    def __init__(self, sock: socket.socket, deadline: float, timeout: float, what: str) -> None:
        self._sock, self._deadline, self._timeout, self._what = sock, deadline, timeout, what
        self._streaming = False

    def makefile(self, mode: str, *args: object, **kwargs: object) -> io.BufferedReader:
        self._streaming = True
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline, self._timeout, self._what))

    def close(self) -> None:
        """http.client closes the connection once a response's head says the server will close it, before
        the body is read: the socket then stays open until the response stream closes (as socket.makefile's)."""
        if not self._streaming:
            self._sock.close()

    def __getattr__(self, name: str) -> object:  # sendall, close, ... as the socket's
        return getattr(self._sock, name)


class _BoundedHTTPConnection(http.client.HTTPConnection):
    deadline = math.inf  # time.monotonic() by which the response must be in
    what = "answer"  # what the messages call the response

    def connect(self) -> None:
        super().connect()  # (through HTTPSConnection's: the TLS handshake, bounded by the timeout)
        assert self.timeout is not None  # get gives one
        self.sock = _DeadlineSocket(self.sock, self.deadline, self.timeout, self.what)


class _BoundedHTTPSConnection(_BoundedHTTPConnection, http.client.HTTPSConnection):
    pass
