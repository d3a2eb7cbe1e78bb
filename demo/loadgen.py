"""A bounded load generator for a layerwatch shim (or any OpenAI-compatible server).

Used by `layerwatch demo`, the end-to-end alert tests and the load test. Standard library only, so it
runs beside any install. Every loop is bounded by a deadline and a request count, and stops by
itself; it targets whatever base URL it is given (tests and the demo give it loopback addresses).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

PROMPTS = (
    "In the beginning",
    "And the LORD said unto Moses,",
    "Blessed are the",
    "The LORD is my shepherd;",
    "And it came to pass, when",
    "Then answered Jesus and said unto them,",
    "Hear, O Israel:",
    "And God said, Let there be",
    "For God so loved the world,",
    "Now the serpent was more subtil than",
    "And the children of Israel",
    "Praise ye the LORD.",
)


@dataclass
class LoadReport:
    requests: int = 0
    by_status: dict[int, int] = field(default_factory=dict)  # HTTP status -> count (0 = connection error)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    layers_executed: int = 0
    layers_skipped: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests only
    elapsed: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.by_status.items() if status >= 500 or status == 0)

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> str:
        rate = self.completion_tokens / self.elapsed if self.elapsed else 0.0
        return (
            f"{self.requests} requests in {self.elapsed:.1f}s, statuses {dict(sorted(self.by_status.items()))}, "
            f"{self.completion_tokens} tokens ({rate:.1f} tok/s), "
            f"p50 {self.percentile(0.5) * 1000:.0f} ms, p99 {self.percentile(0.99) * 1000:.0f} ms"
        )


class _Merge:
    def __init__(self) -> None:
        self.report = LoadReport()
        self._lock = threading.Lock()

    def add(self, status: int, usage: dict | None, latency: float) -> None:
        with self._lock:
            r = self.report
            r.requests += 1
            r.by_status[status] = r.by_status.get(status, 0) + 1
            if usage is not None:
                r.completion_tokens += usage.get("completion_tokens", 0)
                r.prompt_tokens += usage.get("prompt_tokens", 0)
                r.layers_executed += usage.get("layers_executed", 0)
                r.layers_skipped += usage.get("layers_skipped", 0)
                r.latencies.append(latency)


def _one_request(
    host: str, port: int, model: str, rng: random.Random, max_tokens: int, stream: bool, greedy: bool, timeout: float
) -> tuple[int, dict | None]:
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "stream": stream}
    if greedy:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        if resp.status != 200:
            return resp.status, None
        if not stream:
            return 200, json.loads(payload)["usage"]
        usage = None
        for line in payload.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: ") :])
                usage = event.get("usage") or usage
        return 200, usage
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return 0, None
    finally:
        conn.close()


def run_load(
    base_url: str,
    model: str,
    *,
    duration: float,
    concurrency: int = 4,
    max_tokens: int = 32,
    stream_fraction: float = 0.5,
    greedy_fraction: float = 0.25,
    max_requests: int = 100_000,
    seed: int = 0,
    stop: threading.Event | None = None,
    timeout: float = 120.0,
) -> LoadReport:
    """Send completions from `concurrency` threads until `duration` seconds, `max_requests` or `stop`.

    A `greedy_fraction` of the requests decode greedily (the shim shadow-checks only those, since a
    sampled token has no single full-depth answer); the rest sample with a per-request seed.
    """
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    merge = _Merge()
    stop = stop or threading.Event()
    deadline = time.monotonic() + duration
    issued = iter(range(max_requests))
    issue_lock = threading.Lock()

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while not stop.is_set() and time.monotonic() < deadline:
            with issue_lock:
                if next(issued, None) is None:
                    return
            started = time.monotonic()
            status, usage = _one_request(
                host,
                port,
                model,
                rng,
                max_tokens,
                rng.random() < stream_fraction,
                rng.random() < greedy_fraction,
                timeout,
            )
            merge.add(status, usage, time.monotonic() - started)
            if status == 0:
                stop.wait(0.2)  # server not reachable: back off instead of spinning

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merge.report.elapsed = time.monotonic() - started
    return merge.report
