"""Hostile HTTP clients against each listener of the stack, and what they cost it.

    python benchmarks/listener_flood.py api-endless-header [--clients 4]       # one header line that never ends
    python benchmarks/listener_flood.py api-slowloris --clients 1100 --nofile 1024   # heads trickled, past the files
    python benchmarks/listener_flood.py api-slow-bodies --clients 1100           # whole heads, bodies trickled
    python benchmarks/listener_flood.py api-unread-streams --clients 4          # streams whose client never reads
    python benchmarks/listener_flood.py api-unread-pipelines --clients 20       # pipelined requests, answers unread
    python benchmarks/listener_flood.py receiver-trickle --clients 32          # mitigation receiver, no token
    python benchmarks/listener_flood.py exporter-half-sent --clients 600       # requests stopped mid-head
    python benchmarks/listener_flood.py exporter-burst --clients 1000          # connections opened at once
    ... --checkout /path/to/old/checkout                                       # the same, against older code

The target runs as its own process (`serve` on the embedded demo model, or `exporter`), with the code
of `--checkout` (default: this one). While the attack runs for `--seconds`, a well-behaved client does
what the listener is for, every `--every` seconds: GET /healthz of the API, an authenticated
Alertmanager notification to the receiver, a scrape of the exporter's /metrics (against unread
streams, a one-token completion instead: their harm is to admission). Printed: that
client's latency (median, 90th percentile, worst) and failures; the target's resident memory
(before, peak, after), CPU share, threads and open files (/proc). Figures in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.demo.processes import free_port
from tests.slow_clients import EndlessHeader, Trickler, half_sent_requests, non_reader

REPOSITORY = Path(__file__).resolve().parents[1]
ATTACKS = (
    "api-endless-header",
    "api-slowloris",
    "api-slow-bodies",
    "api-unread-streams",
    "api-unread-pipelines",
    "receiver-trickle",
    "exporter-half-sent",
    "exporter-burst",
)
# A whole head that announces a body, then its first byte: the trickler sends the rest a byte at a time.
SLOW_BODY_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
)
# Six choices of 64 tokens, 20 alternatives each (about 1.7 KB of events a token).
UNREAD_STREAM_BODY = json.dumps(
    {
        "model": "layerwatch-demo",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "n": 6,
        "max_tokens": 64,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
).encode()
UNREAD_STREAM = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(UNREAD_STREAM_BODY), UNREAD_STREAM_BODY)
)
UNREAD_PIPELINE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 8
# The servers: two batch slots and two waiting ones; twenty connections.
UNREAD_FLAGS = {
    "api-unread-streams": ["--max-batch-size", "2", "--max-waiting-requests", "2"],
    "api-unread-pipelines": ["--max-connections", "20"],
}


class Target:
    """The process under attack: /proc figures of it."""

    def __init__(self, process: subprocess.Popen, log: Path) -> None:
        self.process, self.log = process, log

    def status(self, field: str) -> int:
        found = re.search(rf"^{field}:\s+(\d+)", Path(f"/proc/{self.process.pid}/status").read_text(), re.M)
        return int(found[1]) if found else 0

    def rss_mb(self) -> float:
        return self.status("VmRSS") / 1024

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))


@contextmanager
def started(checkout: Path, argv: list[str], ready: str, nofile: int | None, workdir: Path) -> Iterator[Target]:
    command = [sys.executable, "-m", "layerwatch.cli.main", *argv]
    if nofile:
        command = ["prlimit", f"--nofile={nofile}", *command]
    log = workdir / f"{argv[0]}.log"
    environment = dict(os.environ, PYTHONPATH=str(checkout.resolve()), OMP_NUM_THREADS="1")
    with open(log, "wb") as output:
        process = subprocess.Popen(command, cwd=checkout, env=environment, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"{argv[0]} did not start:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(ready, timeout=2).close()
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        yield Target(process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def timed(call: Callable[[], object], timeout: float) -> float | None:
    """Seconds `call` took, or None when it failed (no answer, an error, over `timeout`)."""
    started_at = time.perf_counter()
    try:
        call()
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return None
    took = time.perf_counter() - started_at
    return took if took <= timeout else None


def measure(target: Target, attack, victim: Callable[[], object], seconds: float, every: float) -> dict:
    rss_before = target.rss_mb()
    latencies: list[float | None] = []
    peak_rss, peak_threads, peak_files = rss_before, 0, 0
    with attack:
        time.sleep(min(2.0, seconds / 4))  # the attack in place first
        cpu_before, started_at = target.cpu_seconds(), time.monotonic()
        while time.monotonic() - started_at < seconds:
            latencies.append(timed(victim, timeout=30))
            peak_rss = max(peak_rss, target.rss_mb())
            peak_threads = max(peak_threads, target.status("Threads"))
            peak_files = max(peak_files, target.open_files())
            time.sleep(every)
        cpu_share = (target.cpu_seconds() - cpu_before) / (time.monotonic() - started_at)
    answered = sorted(t for t in latencies if t is not None)
    return {
        "victim requests": len(latencies),
        "answered": len(answered),
        "latency ms (p50, p90, max)": [
            round(1000 * statistics.median(answered), 1) if answered else None,
            round(1000 * answered[int(0.9 * (len(answered) - 1))], 1) if answered else None,
            round(1000 * answered[-1], 1) if answered else None,
        ],
        "RSS MB (before, peak, after)": [round(rss_before), round(peak_rss), round(target.rss_mb())],
        "CPU %": round(100 * cpu_share),
        "threads (peak)": peak_threads,
        "open files (peak)": peak_files,
        "attacker": attack.summary(),
    }


class _Held:
    """Connections opened by `open_them` for the time of the measure (an attack as a context)."""

    def __init__(self, open_them: Callable[[], list[socket.socket]]) -> None:
        self._open_them = open_them
        self.connections: list[socket.socket] = []

    def __enter__(self):
        self.connections = self._open_them()
        return self

    def __exit__(self, *exc: object) -> None:
        for connection in self.connections:
            connection.close()

    def summary(self) -> dict:
        return {"connections opened": len(self.connections)}


class _Bursts:
    """Bursts of `count` connections opened as fast as the listener accepts them, held for a second,
    closed, again, for the time of the measure."""

    def __init__(self, address: tuple[str, int], count: int) -> None:
        self.address, self.count, self.opened = address, count, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        return {"connections opened": self.opened}

    def _run(self) -> None:
        while not self._stop.is_set():
            held = []
            for _ in range(self.count):
                try:
                    held.append(socket.create_connection(self.address, timeout=5))
                    self.opened += 1
                except OSError:
                    pass
            self._stop.wait(1.0)
            for connection in held:
                connection.close()


def notification(number: int) -> bytes:
    alert = {
        "status": "firing",
        "labels": {"alertname": "LayerwatchRoutingStatic", "model_name": "layerwatch-demo", "severity": "critical"},
        "annotations": {},
        "startsAt": "2026-12-01T03:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "",
        "fingerprint": f"{number:016x}",
    }
    body = {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": "firing", "receiver": "m"}
    body |= {"groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "", "alerts": [alert]}
    return json.dumps(body).encode()


def get(url: str) -> Callable[[], object]:
    return lambda: urllib.request.urlopen(url, timeout=30).read()


def flood_exporter(args: argparse.Namespace, workdir: Path) -> dict:
    port = free_port()
    argv = ["exporter", "--listen", "127.0.0.1:0", "--http", f"127.0.0.1:{port}"]
    address = ("127.0.0.1", port)
    attack: _Held | _Bursts
    if args.attack == "exporter-half-sent":
        attack = _Held(lambda: half_sent_requests(address, args.clients))
    else:
        attack = _Bursts(address, args.clients)
    with started(args.checkout, argv, f"http://127.0.0.1:{port}/healthz", None, workdir) as target:
        return measure(target, attack, get(f"http://127.0.0.1:{port}/metrics"), args.seconds, args.every)


def flood_receiver(args: argparse.Namespace, workdir: Path) -> dict:
    port, receiver_port = free_port(), free_port()
    token = secrets.token_hex(32)
    token_file = workdir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    argv = ["serve", "--port", str(port), "--exporter-address", "", "--log-level", "warning"]
    argv += ["--mitigation-address", f"127.0.0.1:{receiver_port}", "--mitigation-token-file", str(token_file)]
    sent = iter(range(1 << 30))

    def notify() -> object:  # as Alertmanager does
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        url = f"http://127.0.0.1:{receiver_port}/alerts"
        return urllib.request.urlopen(urllib.request.Request(url, notification(next(sent)), headers), timeout=10).read()

    attack = Trickler(("127.0.0.1", receiver_port), args.clients, interval=0.5)
    with started(args.checkout, argv, f"http://127.0.0.1:{port}/healthz", args.nofile, workdir) as target:
        return measure(target, attack, notify, args.seconds, args.every)


def one_token(url: str) -> Callable[[], object]:
    body = json.dumps({"model": "layerwatch-demo", "prompt": "Hello", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    return lambda: urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30).read()


def flood_api(args: argparse.Namespace, workdir: Path) -> dict:
    port = free_port()
    argv = ["serve", "--port", str(port), "--exporter-address", "", "--log-level", "warning"]
    argv += UNREAD_FLAGS.get(args.attack, [])
    address = ("127.0.0.1", port)
    victim = get(f"http://127.0.0.1:{port}/healthz")
    if args.attack == "api-unread-streams":
        victim = one_token(f"http://127.0.0.1:{port}/v1/completions")
    if args.attack.startswith("api-unread"):
        request = UNREAD_STREAM if args.attack == "api-unread-streams" else UNREAD_PIPELINE
        attack: EndlessHeader | Trickler | _Held = _Held(
            lambda: [non_reader(address, request) for _ in range(args.clients)]
        )
    elif args.attack == "api-endless-header":
        attack = EndlessHeader(address, args.clients)
    elif args.attack == "api-slow-bodies":
        attack = Trickler(address, args.clients, head=SLOW_BODY_HEAD, interval=1.0)
    else:
        attack = Trickler(address, args.clients, head=b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ", interval=1.0)
    with started(args.checkout, argv, f"http://127.0.0.1:{port}/healthz", args.nofile, workdir) as target:
        return measure(target, attack, victim, args.seconds, args.every)


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("attack", choices=ATTACKS)
    parser.add_argument("--clients", type=int, default=1, help="attacking connections (default 1)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the attack lasts (default 20)")
    parser.add_argument("--every", type=float, default=0.2, help="seconds between the victim's requests")
    parser.add_argument("--nofile", type=int, default=None, help="run serve under this open-file limit (prlimit)")
    parser.add_argument("--checkout", type=Path, default=REPOSITORY, help="the code to run (default: this one)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="listener-flood-"))
    flood = (
        flood_exporter
        if args.attack.startswith("exporter")
        else flood_receiver
        if args.attack.startswith("receiver")
        else flood_api
    )
    result = flood(args, workdir)
    print(json.dumps({"attack": args.attack, "clients": args.clients, "checkout": str(args.checkout), **result}))


if __name__ == "__main__":
    main()
