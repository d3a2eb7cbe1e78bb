"""`layerwatch vllm-guard` in front of the session's shared `vllm serve` (tests/vllm_engine.py), on the real SmolLM2
with its shipped gates: the client sees exactly what vLLM answers, chat and text completions, streamed or not, n > 1;
the sampled answers are checked against the full-depth model: agreement 1 and no cost at τ 0, much less agreement
and more cost with gates that skip far more; a cancelled request is counted and aborted in vLLM; a bad upstream,
an upstream gone mid-answer and a client's bad JSON get vLLM-like errors while the guard goes on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.ports import LOOPBACK
from tests.vllm_engine import SERVED_MODEL_NAME, VllmEngine

# Answers compared field by field but these, which differ between any two requests.
PER_REQUEST = ("id", "created")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPTS = ["Write a short poem about the sea.", "Explain why the sky is blue.", "List three uses of copper."]
# At τ 0 the gated decode and the full-depth prefill are the same model computed along different kernels: their
# float32 log-probabilities agree to about 1e-5 nats here (1e-4 allowed). KL(p || q) on any partition is
# sum_i p_i (log p_i - log q_i) <= max_i |log p_i - log q_i|, so each position costs at most that bound.
FULL_DEPTH_LOGPROB_TOLERANCE = 1e-4
BROKEN_THRESHOLD = 0.8  # far more layers skipped than the shipped gates' 0.18 decides


@pytest.fixture(scope="module")
def guard(vllm_engine: VllmEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The guard checking every generation request (rate 1: each test knows which answers were checked)."""
    with running_guard(vllm_engine.base_url, tmp_path_factory.mktemp("guard"), shadow_rate=1.0) as url:
        yield url


@contextlib.contextmanager
def running_guard(upstream: str, workdir: Path, shadow_rate: float, *flags: str) -> Iterator[str]:
    with guard_process(upstream, workdir, shadow_rate, *flags) as (process, url):
        yield url
        assert process.running(), process.log_tail()


@contextlib.contextmanager
def guard_process(
    upstream: str, workdir: Path, shadow_rate: float, *flags: str
) -> Iterator[tuple[ManagedProcess, str]]:
    port = free_port()
    argv = [sys.executable, "-m", "layerwatch.cli.main", "vllm-guard", "--upstream", upstream]
    argv += ["--listen", f"{LOOPBACK}:{port}", "--served-model-name", SERVED_MODEL_NAME]
    argv += ["--shadow-rate", str(shadow_rate), *flags]
    process = ManagedProcess("vllm-guard", argv, workdir / "guard.log")
    url = f"http://{LOOPBACK}:{port}"
    try:
        process.wait_http(f"{url}/metrics", 60)
        yield process, url
    finally:
        process.stop()


def guard_counts(url: str) -> dict[str, float]:
    """The guard's shadow series (by outcome for the requests), summed over their labels."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        match = re.match(r"layerwatch_(shadow_\w+|depth_decisions)_total(?:\{([^}]*)\})? (\S+)", line)
        if match:
            name, labels, value = match.groups()
            outcome = re.search(r'outcome="(\w+)"', labels or "")
            key = f"{name}:{outcome.group(1)}" if outcome else name
            counts[key] = counts.get(key, 0.0) + float(value)
    return counts


def settled(url: str, before: dict[str, float], sequences: int, timeout: float = 300) -> dict[str, float]:
    """The change in the guard's counts once `sequences` sampled sequences have an outcome (their checks done)."""
    deadline = time.monotonic() + timeout
    while True:
        after = guard_counts(url)
        change = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        if sum(v for k, v in change.items() if k.startswith("shadow_requests:")) >= sequences:
            return change
        assert time.monotonic() < deadline, f"{sequences} sampled sequences not settled: {change}"
        time.sleep(0.2)


def without_per_request(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_per_request(v) for k, v in value.items() if k not in PER_REQUEST}
    if isinstance(value, list | tuple):
        return [without_per_request(v) for v in value]
    return value


def per_choice(events: list[Any]) -> dict[Any, list[Any]]:
    """A stream's events, each choice's in its order (vLLM interleaves the choices of n > 1 in no fixed order)."""
    streams: dict[Any, list[Any]] = {}
    for event in events:
        if isinstance(event, dict) and len(event.get("choices") or ()) == 1:
            streams.setdefault(event["choices"][0]["index"], []).append(event)
        else:
            streams.setdefault("other", []).append(event)
    return streams


def answer(base: str, path: str, body: dict[str, Any]) -> Any:
    """The JSON answer, or a streamed answer's events (parsed where JSON) per choice, as the client reads them."""
    if not body.get("stream"):
        response = httpx.post(base + path, json=body, timeout=300)
        return response.status_code, response.json()
    events = []
    with httpx.stream("POST", base + path, json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return response.status_code, per_choice(events)


def chat_body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": prompt}], **extra}


TRANSPARENCY_CASES = {
    "chat": (CHAT, chat_body(PROMPTS[0], max_tokens=24)),
    "chat streamed": (CHAT, chat_body(PROMPTS[1], max_tokens=24, stream=True)),
    "chat n=2 streamed with usage": (
        CHAT,
        chat_body(PROMPTS[2], max_tokens=16, n=2, stream=True, stream_options={"include_usage": True}),
    ),
    "chat with its own token ids": (CHAT, chat_body(PROMPTS[0], max_tokens=16, return_token_ids=True)),
    "text": (COMPLETIONS, {"model": SERVED_MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 24}),
    "text streamed, two prompts": (
        COMPLETIONS,
        {
            "model": SERVED_MODEL_NAME,
            "prompt": ["def fibonacci(n):", "Once upon a time"],
            "max_tokens": 16,
            "stream": True,
        },
    ),
}


@pytest.mark.parametrize("case", TRANSPARENCY_CASES, ids=list(TRANSPARENCY_CASES))
def test_the_client_sees_what_vllm_answers(vllm_engine: VllmEngine, guard: str, case: str) -> None:
    """Sampled at temperature 0.8 with a seed, one request at a time, each with a fresh cache salt (so that neither
    reuses the other's prefix cache and both compute the same numbers): the answer through the guard, which asked
    vLLM for the log-probabilities and token ids of every choice and checked each, equals vLLM's own but for ids
    and timestamps."""
    path, body = TRANSPARENCY_CASES[case]
    body = {**body, "temperature": 0.8, "seed": 7}
    direct = answer(vllm_engine.base_url, path, {**body, "cache_salt": secrets.token_hex(16)})
    before = guard_counts(guard)
    through = answer(guard, path, {**body, "cache_salt": secrets.token_hex(16)})
    sequences = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
    change = settled(guard, before, sequences)
    assert without_per_request(through) == without_per_request(direct)
    assert change["shadow_requests:checked"] == sequences, change
    assert change["depth_decisions"] == 1 and change["shadow_tokens"] > 0


def sampled_chat(url: str, requests: int = 6) -> None:
    for i in range(requests):
        body = chat_body(PROMPTS[i % len(PROMPTS)], max_tokens=40, temperature=0.8, stream=i % 2 == 1)
        status, _ = answer(url, CHAT, body)
        assert status == 200


def quality(change: dict[str, float]) -> tuple[float, float]:
    """(agreement, KL(gated || full) per token) of a change in the guard's counts."""
    return change["shadow_agreements"] / change["shadow_tokens"], change["shadow_kl_nats"] / change["shadow_tokens"]


def test_sampled_chat_at_full_depth_agrees_and_costs_nothing_and_broken_gates_do_not(
    vllm_engine: VllmEngine, guard: str
) -> None:
    """Chat at temperature 0.8. At τ 0 the plugin runs every layer: every argmax agrees and each position costs at
    most the float32 bound. At the shipped τ the gates skip and cost something; at τ 0.8 they skip far more,
    and the guard sees agreement fall and the cost rise."""
    figures = {}
    for threshold in (0.0, vllm_engine.threshold, BROKEN_THRESHOLD):
        with vllm_engine.threshold_set(threshold):
            before = guard_counts(guard)
            sampled_chat(guard)
            change = settled(guard, before, 6)
        assert change["shadow_requests:checked"] == 6, change
        figures[threshold] = quality(change)
        if threshold == 0.0:
            assert change["shadow_agreements"] == change["shadow_tokens"] > 100
            assert change["shadow_kl_nats"] <= FULL_DEPTH_LOGPROB_TOLERANCE * change["shadow_tokens"]
            assert change["shadow_reverse_kl_nats"] <= FULL_DEPTH_LOGPROB_TOLERANCE * change["shadow_tokens"]
    (full_agreement, _), (healthy_agreement, healthy_kl), (broken_agreement, broken_kl) = figures.values()
    assert healthy_agreement < full_agreement and healthy_kl > 10 * FULL_DEPTH_LOGPROB_TOLERANCE, figures
    # About 240 tokens each: a binomial standard error of 0.03 on the agreement; the drop is several times it.
    assert broken_agreement < healthy_agreement - 0.1 and broken_kl > healthy_kl, figures


def vllm_gauge_sum(engine: VllmEngine, name: str) -> float:
    text = httpx.get(f"{engine.base_url}/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)", text, re.M))


def test_a_cancelled_request_is_aborted_in_vllm_and_counted(vllm_engine: VllmEngine, guard: str) -> None:
    """A client that leaves a sampled stream after its first event: the guard counts it run and not checked, and
    vLLM stops generating it long before the 400 tokens it asked for."""
    before, generated = guard_counts(guard), vllm_gauge_sum(vllm_engine, "vllm:generation_tokens_total")
    body = chat_body(PROMPTS[0], max_tokens=400, temperature=0.8, stream=True, ignore_eos=True)
    with httpx.stream("POST", guard + CHAT, json=body, timeout=300) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ") and next(lines) == ""
    change = settled(guard, before, 1)
    assert change["shadow_requests:no_output"] == 1 and change["depth_decisions"] == 1, change
    deadline = time.monotonic() + 120
    while vllm_gauge_sum(vllm_engine, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "vLLM still runs the cancelled request"
        time.sleep(0.2)
    assert vllm_gauge_sum(vllm_engine, "vllm:generation_tokens_total") - generated < 400


def test_a_clients_bad_json_gets_vllms_own_error(vllm_engine: VllmEngine, guard: str) -> None:
    direct, through = (
        httpx.post(base + CHAT, content=b'{"model": "x", "messages": [', headers={"Content-Type": "application/json"})
        for base in (vllm_engine.base_url, guard)
    )
    assert direct.status_code == through.status_code == 400
    assert through.json() == direct.json()


def test_an_unreachable_upstream_is_a_vllm_like_502_and_the_guard_goes_on(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens there
    with running_guard(f"http://{LOOPBACK}:{closed}", tmp_path, shadow_rate=1.0) as url:
        for body in (chat_body("hi"), chat_body("hi", stream=True)):
            response = httpx.post(url + CHAT, json={**body, "model": SERVED_MODEL_NAME}, timeout=60)
            assert response.status_code == 502
            error = response.json()["error"]
            assert error["code"] == 502 and f"{LOOPBACK}:{closed}" in error["message"], error
        assert guard_counts(url)["shadow_requests:no_output"] == 2


def test_a_bad_upstream_url_is_one_line() -> None:
    argv = [sys.executable, "-m", "layerwatch.cli.main", "vllm-guard", "--upstream", "ftp://vllm:8000"]
    result = subprocess.run(
        [*argv, "--served-model-name", "m"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("expected http://HOST:PORT (or HOST:PORT), got 'ftp://vllm:8000'")
    )


class StreamingUpstream:
    """An upstream that answers a streamed chat with `events` events of vLLM's shape, `interval` s apart, then `data:
    [DONE]`; or, `dies`, drops the connection instead, as a vLLM that dies mid-answer does (the shared engine cannot be
    killed); or, `holds`, answers nothing, as vLLM generating a non-streamed answer. `received` is set once a request
    is read; `closed` when the guard closes a request before its end (vLLM would abort it)."""

    EVENT = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": SERVED_MODEL_NAME,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None, "finish_reason": None}
        ],
    }

    def __init__(self, events: int = 1, interval: float = 0.0, dies: bool = False, holds: bool = False) -> None:
        self.events, self.interval, self.dies, self.holds = events, interval, dies, holds
        self.received, self.closed = threading.Event(), threading.Event()
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._answer, LOOPBACK, self.port)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        await reader.readexactly(length)
        self.received.set()
        if self.holds:
            if not await reader.read(1):
                self.closed.set()
            return
        event = b"data: " + json.dumps(self.EVENT).encode() + b"\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(self.events):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                if not await asyncio.wait_for(reader.read(1), self.interval):  # the guard closed the connection
                    self.closed.set()
                    return
        if self.dies:
            writer.transport.abort()  # gone mid-answer: no last chunk
            return
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.mark.parametrize("shadow_rate", [0.0, 1.0], ids=["passed", "sampled"])
def test_an_upstream_gone_mid_stream_ends_the_stream_with_an_error_event(tmp_path: Path, shadow_rate: float) -> None:
    upstream = StreamingUpstream(dies=True)
    try:
        with running_guard(f"http://{LOOPBACK}:{upstream.port}", tmp_path, shadow_rate) as url:
            for _ in range(2):  # and the guard serves the next one
                status, events = answer(url, CHAT, chat_body("hi", stream=True))
                assert status == 200 and events[0][0]["choices"][0]["delta"]["content"] == "Hel"
                error, done = events["other"]
                assert error["error"]["code"] == 502 and done == "[DONE]", events
            assert httpx.get(f"{url}/metrics").status_code == 200
    finally:
        upstream.close()


@pytest.mark.parametrize("drain", ["finished", "cut off"])
def test_a_stop_signal_drains_the_stream_in_flight_and_takes_no_new_connection(tmp_path: Path, drain: str) -> None:
    """SIGTERM: the listener closes at once and a new request on an open connection gets 503; a stream in flight
    finishes within --drain-timeout-seconds, or is then cut off with an error event and its upstream request closed;
    the guard exits by the signal."""
    finished = drain == "finished"
    upstream = StreamingUpstream(events=30 if finished else 10_000, interval=0.1)  # 3 s, or 1,000 s
    timeout = "60" if finished else "1"
    try:
        with guard_process(f"http://{LOOPBACK}:{upstream.port}", tmp_path, 0.0, "--drain-timeout-seconds", timeout) as (
            process,
            url,
        ):
            other = httpx.Client(timeout=60)
            other.get(f"{url}/metrics")  # a connection opened before the signal, kept alive
            with httpx.stream("POST", url + CHAT, json=chat_body("hi", stream=True), timeout=60) as response:
                lines = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
                first = json.loads(next(lines))
                process.proc.send_signal(signal.SIGTERM)
                refused = until_refused(url, within=2.0)  # while the stream still runs (finished: 2.9 s left)
                late = other.post(url + CHAT, json=chat_body("hi")).status_code if finished else 503
                rest = list(lines)
            other.close()
            assert process.proc.wait(30) == -signal.SIGTERM
        log = process.log_path.read_text()
    finally:
        upstream.close()
    assert refused and late == 503 and first["choices"][0]["delta"]["content"] == "Hel"
    assert "SIGTERM received: draining (requests in flight get up to" in log
    if finished:
        assert len(rest) == 30 and rest[-1] == "[DONE]" and not upstream.closed.is_set()
    else:
        error = json.loads(rest[-2])
        assert error["error"]["code"] == 503 and "stopped" in error["error"]["message"] and rest[-1] == "[DONE]"
        assert upstream.closed.wait(5)


@pytest.mark.parametrize("shadow_rate", [0.0, 1.0])
def test_a_request_still_waiting_for_its_answer_when_the_drain_ends_gets_503(
    tmp_path: Path, shadow_rate: float
) -> None:
    """A non-streamed answer vLLM has not given when the drain runs out: its client gets vLLM's error shape (503, as
    `serve` answers), not a connection closed without an answer; vLLM's request is closed."""
    upstream = StreamingUpstream(holds=True)
    try:
        with guard_process(
            f"http://{LOOPBACK}:{upstream.port}", tmp_path, shadow_rate, "--drain-timeout-seconds", "0.5"
        ) as (
            process,
            url,
        ):
            answers: list[httpx.Response] = []
            client = threading.Thread(target=lambda: answers.append(httpx.post(url + CHAT, json=chat_body("hi"))))
            client.start()
            assert upstream.received.wait(10)
            process.proc.send_signal(signal.SIGTERM)
            client.join(30)
            assert process.proc.wait(30) == -signal.SIGTERM
    finally:
        upstream.close()
    assert answers[0].status_code == 503 and answers[0].json()["error"]["type"] == "ServiceUnavailableError"
    assert upstream.closed.wait(5)


def until_refused(url: str, within: float) -> bool:
    """Whether a new connection to `url` is refused within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/metrics", timeout=1)
        except httpx.ConnectError:
            return True
        time.sleep(0.05)
    return False
