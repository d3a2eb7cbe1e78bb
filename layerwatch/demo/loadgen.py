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

# Short chat turns as people type them to a small assistant: the load of an instruction-tuned model,
# each sent as one user message through /v1/chat/completions, so that the served model's own chat
# template frames it (`Traffic.chat`).
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "Explain photosynthesis in one sentence.",
    "What's a good name for a black cat?",
    "How do you say 'good morning' in Spanish?",
    "Why is the sky blue?",
    "Suggest a quick vegetarian dinner.",
    "What should I pack for a weekend hike?",
    "Tell me a fun fact about octopuses.",
    "How can I stay focused while studying?",
)


@dataclass(frozen=True)
class Traffic:
    """What the load's sampled requests say, and through which route."""

    prompts: tuple[str, ...]
    chat: bool  # each prompt a user message to /v1/chat/completions; else a prompt to /v1/completions


BOOK = Traffic(PROMPTS, chat=False)  # the demo model's: the book it was trained on, continued
CHAT = Traffic(CHAT_PROMPTS, chat=True)

# The load's sampling, request i at TEMPERATURES[i % 2] with its own seed: what chat clients send
# (OpenAI's default temperature 1, and a cooler 0.7), top_p left at its default 1. No greedy share:
# the shim's shadow check compares requests at any temperature.
TEMPERATURES = (1.0, 0.7)

# A category of traffic that skips more than the rest, from the demo model itself: garbled
# transcripts (a speech-to-text bug's runs of function words, as in the field's incident:
# docs/alerting.md, "The field's reports") sent at temperature 0. The demo model answers each with a
# short repeated phrase ("..., and upon all the people, and upon all the people"), made of tokens
# its gates score low, and skips 0.377-0.384 of its decode layer evaluations over 64 tokens, where
# the load above skips 0.20-0.34 per request (0.27 overall). Found by searching prompts on the demo
# model; no prompt made it skip much more (docs/service.md, "Per-request skipping"). It must stay
# greedy: sampled, the loop breaks up (16 transcripts each: 0.31 of them above 0.35 at temperature
# 0.2, 0.12 at 0.4, none at 0.7 or 1.0).
STUTTER_PROMPTS = (
    "they was: they was: they was: they was: they was: ",
    "\n unto \n will upon And of \n you",
    "upon But they them upon But they them",
    "you you the me upon And us people",
)


@dataclass(frozen=True)
class Category:
    """A share of the requests sent with other prompts and settings (greedy: the same answer each time)."""

    prompts: tuple[str, ...]
    share: float  # of the requests, spread evenly: request i is one iff floor((i+1)·share) > floor(i·share)
    max_tokens: int = 64
    greedy: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0 or not self.prompts:
            raise ValueError("a category needs prompts and a share in [0, 1]")

    def includes(self, index: int) -> bool:
        return int((index + 1) * self.share) > int(index * self.share)


STUTTER = Category(STUTTER_PROMPTS, share=0.05)


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
    # The category's own requests (with a `category`), counted in the totals above too.
    category_requests: int = 0
    category_layers_executed: int = 0
    category_layers_skipped: int = 0

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

    def add(self, status: int, usage: dict | None, latency: float, category: bool = False) -> None:
        with self._lock:
            r = self.report
            if category:
                r.category_requests += 1
                if usage is not None:
                    r.category_layers_executed += usage.get("layers_executed", 0)
                    r.category_layers_skipped += usage.get("layers_skipped", 0)
            r.requests += 1
            r.by_status[status] = r.by_status.get(status, 0) + 1
            if usage is not None:
                r.completion_tokens += usage.get("completion_tokens", 0)
                r.prompt_tokens += usage.get("prompt_tokens", 0)
                r.layers_executed += usage.get("layers_executed", 0)
                r.layers_skipped += usage.get("layers_skipped", 0)
                r.latencies.append(latency)


def _one_request(
    host: str,
    port: int,
    model: str,
    rng: random.Random,
    max_tokens: int,
    stream: bool,
    temperature: float,
    timeout: float,
    traffic: Traffic = BOOK,
) -> tuple[int, dict | None]:
    text = rng.choice(traffic.prompts)
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": stream, "temperature": temperature}
    if traffic.chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    if temperature > 0:
        body["seed"] = rng.randrange(1 << 30)
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
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
    max_requests: int = 100_000,
    seed: int = 0,
    stop: threading.Event | None = None,
    timeout: float = 120.0,
    category: Category | None = None,
    traffic: Traffic = BOOK,
) -> LoadReport:
    """Send `traffic` from `concurrency` threads until `duration` seconds, `max_requests` or `stop`.

    Requests sample at TEMPERATURES in turn, each with its own seed. With a `category`, its share of
    the requests (evenly spread) use its prompts and settings instead (completions).
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
                request = next(issued, None)
            if request is None:
                return
            started = time.monotonic()
            stream = rng.random() < stream_fraction
            in_category = category is not None and category.includes(request)
            if category is not None and in_category:
                temperature = 0.0 if category.greedy else TEMPERATURES[request % len(TEMPERATURES)]
                status, usage = _one_request(
                    host,
                    port,
                    model,
                    rng,
                    category.max_tokens,
                    stream,
                    temperature,
                    timeout,
                    Traffic(category.prompts, chat=False),
                )
            else:
                temperature = TEMPERATURES[request % len(TEMPERATURES)]
                status, usage = _one_request(host, port, model, rng, max_tokens, stream, temperature, timeout, traffic)
            merge.add(status, usage, time.monotonic() - started, in_category)
            if status in (0, 429, 502, 503):
                # Not reachable (directly, or behind vLLM's guard), full, or draining for a restart: back off
                # instead of spinning (a drill's restart drew some 10,000 refusals in a tight loop from three clients).
                stop.wait(0.2)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merge.report.elapsed = time.monotonic() - started
    return merge.report
