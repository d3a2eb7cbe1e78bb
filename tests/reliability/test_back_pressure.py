"""Back-pressure and over-long prompts against a real `layerwatch serve` process.

At most `--max-batch-size + --max-waiting-requests` generation requests are admitted; the next one
gets 429 with Retry-After, and `layerwatch_requests_running` / `_waiting` show where the admitted
ones are. Clients still sending their body are not admitted, so they cannot fill the queue. A
prompt longer than `--max-prompt-tokens` tokens can hold is refused by its size, before the
tokenizer sees it (docs/service.md, "Back-pressure" and "Prompt limits").
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx

from tests.reliability.conftest import LONG_TOKENS, MODEL_NAME, Shim, sample_sum, wait_for_metrics


class Stream:
    """A streaming completion read in a thread; `first_event` is set once its first event arrived,
    `close()` hangs up (which cancels the generation)."""

    def __init__(self, shim: Shim, max_tokens: int = LONG_TOKENS) -> None:
        self.lines: list[str] = []
        self.first_event = threading.Event()
        self._hang_up = threading.Event()
        body = {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": max_tokens, "stream": True}

        def read() -> None:
            with httpx.stream("POST", f"{shim.url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if self._hang_up.is_set():
                        return
                    if line:
                        self.lines.append(line)
                        self.first_event.set()

        self._thread = threading.Thread(target=read)
        self._thread.start()
        assert self.first_event.wait(60), "the stream did not start"

    def join(self) -> list[str]:
        self._thread.join(60)
        assert not self._thread.is_alive()
        return self.lines

    def close(self) -> None:
        self._hang_up.set()
        self.join()

    def chunks(self) -> list[dict]:
        return [json.loads(line.removeprefix("data: ")) for line in self.lines if line != "data: [DONE]"]


class Completion:
    """A non-streaming completion in a thread; `response()` waits for it."""

    def __init__(self, shim: Shim, max_tokens: int) -> None:
        self._responses: list[httpx.Response] = []
        body = {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": max_tokens}
        self._thread = threading.Thread(
            target=lambda: self._responses.append(httpx.post(f"{shim.url}/v1/completions", json=body, timeout=60))
        )
        self._thread.start()

    def response(self) -> httpx.Response:
        self._thread.join(60)
        [response] = self._responses
        return response


def queue(samples: dict) -> tuple[float, float]:
    """(running, waiting) requests."""
    return sample_sum(samples, "layerwatch_requests_running"), sample_sum(samples, "layerwatch_requests_waiting")


def stalled_body(port: int) -> socket.socket:
    """A completion whose body stops half-way."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 2}).encode()
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    connection.sendall(head.encode() + body[:10])
    return connection


def test_a_full_queue_answers_429_with_retry_after_and_the_gauges_show_it(make_long_shim):
    shim = make_long_shim("--max-batch-size", "1", "--max-waiting-requests", "1")
    assert queue(shim.metrics()) == (0, 0)
    decoding = Stream(shim)
    queued = Completion(shim, max_tokens=2)
    wait_for_metrics(shim, lambda s: queue(s) == (1, 1))  # one in the batch, one waiting for its slot

    refused = shim.complete()
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "server_overloaded"
    assert "1 sequences running and 1 waiting" in error["message"]

    decoding.close()  # its slot frees: the queued request runs
    assert queued.response().status_code == 200
    wait_for_metrics(shim, lambda s: queue(s) == (0, 0))
    assert shim.complete().status_code == 200
    assert sample_sum(shim.metrics(), "layerwatch_requests_total", status="client_error") == 1  # the 429


def test_clients_still_sending_their_body_do_not_fill_the_queue(make_shim):
    shim = make_shim("--max-batch-size", "1", "--max-waiting-requests", "0")
    stalled = [stalled_body(shim.port) for _ in range(5)]
    try:
        time.sleep(0.5)  # let the server take them in
        assert queue(shim.metrics()) == (0, 0)
        assert shim.complete().status_code == 200
    finally:
        for connection in stalled:
            connection.close()


def test_an_over_long_prompt_is_refused_by_size_and_one_that_fits_is_served(make_shim):
    shim = make_shim("--max-prompt-tokens", "32", "--max-body-bytes", str(2 << 20))
    refused = shim.complete(prompt="The quick brown fox jumps over the lazy dog. " * 20_000)  # 900 KB
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    # Refused by its length in characters, without tokenizing it.
    assert error["message"].startswith("The prompt has 900000 characters, more than 32 tokens can hold")
    # Within the size bound but over the token limit: tokenized, then refused by its token count.
    over = shim.complete(prompt="In the beginning " * 4).json()["error"]["message"]
    assert re.fullmatch(r"The prompt has \d+ tokens; this server accepts at most 32 prompt tokens .*", over), over
    assert shim.complete(prompt="In the beginning").status_code == 200


def test_a_request_with_several_choices_is_admitted_once_and_leaves_once(make_long_shim):
    shim = make_long_shim("--max-batch-size", "1", "--max-waiting-requests", "1")
    assert shim.complete(max_tokens=2, n=4).status_code == 200
    several_prompts = {"model": MODEL_NAME, "prompt": ["In the beginning", "And God said"], "max_tokens": 2, "n": 2}
    assert httpx.post(f"{shim.url}/v1/completions", json=several_prompts, timeout=60).status_code == 200
    wait_for_metrics(shim, lambda s: queue(s) == (0, 0))

    # The bound still holds: two admitted requests fill it, the third is refused.
    decoding = Stream(shim)
    queued = Completion(shim, max_tokens=2)
    wait_for_metrics(shim, lambda s: queue(s) == (1, 1))
    assert shim.complete().status_code == 429
    decoding.close()
    assert queued.response().status_code == 200
    wait_for_metrics(shim, lambda s: queue(s) == (0, 0))
