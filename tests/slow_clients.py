"""Hostile HTTP clients on loopback, for the tests and benchmarks/listener_flood.py: connections
that trickle a request head that never ends (slowloris), one endless header line sent as fast as
the server takes it, bursts of half-sent requests, and connections that never read their answers.
Each runs on one thread of its own, however many connections it holds."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

TRICKLED_HEAD = b"POST /alerts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: "
# Ethernet's segment size. Over loopback's 64 KiB segments Linux grows a sender's buffer to 4 MiB
# (2.3 MB of answer held in the server's kernel before its own buffer fills); with this it holds
# about 40 KB, as over a real link.
ETHERNET_MSS = 1460
TCP_ESTABLISHED = 1  # tcp_info's tcpi_state (linux/tcp_states.h)


def connect(address: tuple[str, int], timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(address, timeout=timeout)


class Trickler:
    """`count` connections, each sending `head` and then one byte every `interval` seconds, never
    finishing its request. A connection the server closes (or answers) is opened again at once, as
    an attacker would: `closed_by_server` counts them, `answers` keeps the first bytes of each answer."""

    def __init__(self, address: tuple[str, int], count: int, head: bytes = TRICKLED_HEAD, interval: float = 0.2):
        self.address, self.count, self.head, self.interval = address, count, head, interval
        self.closed_by_server = 0
        self.answers: list[bytes] = []
        self._open: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trickler", daemon=True)

    def __enter__(self) -> Trickler:
        for _ in range(self.count):
            self._open.append(self._connect())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for connection in self._open:
            connection.close()

    def summary(self) -> dict:
        return {"connections closed by the server": self.closed_by_server}

    def _connect(self) -> socket.socket:
        connection = connect(self.address)
        connection.sendall(self.head)
        connection.setblocking(False)
        return connection

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for connection in list(self._open):
                try:
                    answer = connection.recv(256)  # an answer, or the end: the server is done with it
                except BlockingIOError:
                    answer = None  # nothing: it is still waiting for the rest of the head
                except OSError:
                    answer = b""
                if answer is not None:
                    if answer:
                        self.answers.append(answer)
                    self._replace(connection)
                    continue
                try:
                    connection.send(b"x")
                except BlockingIOError:
                    pass  # the server stopped reading: the byte waits
                except OSError:
                    self._replace(connection)

    def _replace(self, connection: socket.socket) -> None:
        connection.close()
        self._open.remove(connection)
        self.closed_by_server += 1
        with contextlib.suppress(OSError):  # the listener may be gone already
            self._open.append(self._connect())


class EndlessHeader:
    """`count` clients, each sending a request line, then one header line that never ends, as fast
    as the server reads it (or at `rate` bytes a second per client); a client whose connection the
    server closes opens another one and starts again. `sent` counts bytes, `connections` connections."""

    def __init__(self, address: tuple[str, int], count: int = 1, rate: float = 0.0, path: str = "/healthz") -> None:
        self.address, self.count, self.rate = address, count, rate
        self.head = f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Endless: ".encode()
        self.sent = self.connections = 0
        self.answers: list[bytes] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]

    def __enter__(self) -> EndlessHeader:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def summary(self) -> dict:
        return {"header bytes sent": self.sent, "connections": self.connections}

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(OSError), connect(self.address) as connection:
                self.connections += 1
                self._send_until_closed(connection, started)
                connection.settimeout(2.0)
                self.answers.append(connection.recv(256))

    def _send_until_closed(self, connection: socket.socket, started: float) -> None:
        chunk = b"a" * 65536
        connection.sendall(self.head)
        connection.settimeout(0.5)
        while not self._stop.is_set():
            if self.rate and self.sent > self.rate * self.count * (time.monotonic() - started):
                time.sleep(0.01)
                continue
            try:
                connection.sendall(chunk)
            except TimeoutError:
                continue  # the server is slow to read: keep pushing
            self.sent += len(chunk)


def non_reader(address: tuple[str, int], requests: bytes) -> socket.socket:
    """A connection that sends `requests` (one, or several pipelined) and never reads the answers:
    a 2 KiB receive buffer, the segment size of a client on Ethernet."""
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, ETHERNET_MSS)
    connection.settimeout(10.0)
    connection.connect(address)
    connection.sendall(requests)
    return connection


def closed_by_server(connection: socket.socket) -> bool:
    """Whether the server has closed (or reset) the connection, seen without reading its answer."""
    return connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_ESTABLISHED


def half_sent_requests(address: tuple[str, int], count: int, head: bytes = b"GET /metrics HTTP/1.1\r\nHo"):
    """`count` connections, each having sent the start of a request and nothing more."""
    connections = []
    for _ in range(count):
        with contextlib.suppress(OSError):  # a listener at its limit may refuse or reset some
            connection = connect(address)
            connection.sendall(head)
            connections.append(connection)
    return connections
