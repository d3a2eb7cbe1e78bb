"""The default ports of the stack's services (docs/interfaces.md). Every default address and the
compose stack's targets are built from these; services bind to loopback unless told otherwise."""

import socket

SHIM_HTTP_PORT = 8000  # `layerwatch serve`: the OpenAI-compatible API, /metrics, /healthz, /readyz
SHIM_MITIGATION_PORT = 8001  # `layerwatch serve --mitigation-address`: Alertmanager's webhook receiver (off by default)
EXPORTER_FRAMES_PORT = 9410  # `layerwatch exporter`: gate frames in, over UDP
EXPORTER_HTTP_PORT = 9411  # `layerwatch exporter`: /metrics and /healthz
PROMETHEUS_PORT = 9090  # Prometheus' own default
ALERTMANAGER_PORT = 9093  # Alertmanager's own default
VLLM_HTTP_PORT = 8000  # `vllm serve`: its OpenAI-compatible API and /metrics (vLLM's own default)
VLLM_GUARD_PORT = 8002  # `layerwatch vllm-guard`: vLLM's API through the quality guard, and the guard's /metrics

LOOPBACK = "127.0.0.1"


def reserve(address: tuple[str, int], what: str, flag: str) -> socket.socket:
    """A TCP socket bound to `address` (IPv6 for a host with ':'), not yet listening: its server
    listens (listen()) when it starts serving, and until then a connection is refused rather than
    left waiting. `layerwatch serve` reserves its ports before the model loads, so that a taken
    port fails the start at once, not minutes later, a port another starting `serve` reserved
    included. Raises OSError naming `what` ("the API"), the address and the `flag` that set it."""
    host, port = address
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
        sock.bind(address)
        # Held alone while not listening: Linux lets SO_REUSEADDR sockets share a port until one
        # listens, so a second server reserving it would fail only at listen, after its model loaded.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"{what} cannot listen on {host}:{port} ({flag}): {exc.strerror}") from None
    return sock


def listen(sock: socket.socket, backlog: int) -> None:
    """Listen on a socket from reserve(), with SO_REUSEADDR again: listen needs it when the port
    still has connections in TIME_WAIT (a server restarted after serving)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.listen(backlog)


def http_url(address: tuple[str, int], path: str = "") -> str:
    """http://HOST:PORT/path for a bound address, an IPv6 host in brackets."""
    host, port = address[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"
