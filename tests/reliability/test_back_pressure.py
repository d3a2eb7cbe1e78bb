"""Back-pressure and over-long prompts against a real `layerwatch serve` process.

At most `--max-batch-size + --max-waiting-requests` generation requests are admitted; the next one
gets 429 with Retry-After, and `layerwatch_requests_running` / `_waiting` show where the admitted
ones are. A prompt longer than `--max-prompt-tokens` tokens can hold is refused by its size, before
the tokenizer sees it (docs/service.md, "Back-pressure" and "Prompt limits").
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests.reliability.conftest import MODEL_NAME, sample_sum

STREAM_TOKENS = 200  # long enough to still be decoding when the test looks


def stalled_request(port: int) -> socket.socket:
    """A completion whose body stops half-way: admitted, and waiting for the rest of its body."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 2}).encode()
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    connection.sendall(head.encode() + body[:10])
    return connection


def wait_for(shim, condition, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = shim.metrics()
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, "the shim did not reach the expected state"
        time.sleep(0.02)


def queue(samples: dict) -> tuple[float, float]:
    return sample_sum(samples, "layerwatch_requests_running"), sample_sum(samples, "layerwatch_requests_waiting")


def test_a_full_queue_answers_429_with_retry_after_and_the_gauges_show_it(make_shim):
    shim = make_shim(
        "--max-batch-size", "1", "--max-waiting-requests", "1", "--max-tokens-cap", str(STREAM_TOKENS),
        "--max-prompt-tokens", "32",
    )  # fmt: skip
    assert queue(shim.metrics()) == (0, 0)
    waiting = stalled_request(shim.port)
    wait_for(shim, lambda s: queue(s) == (0, 1))

    streamed: list[str] = []
    first_event = threading.Event()

    def stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": STREAM_TOKENS, "stream": True}
        with httpx.stream("POST", f"{shim.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    streamed.append(line)
                    first_event.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    try:
        assert first_event.wait(30)
        # One request decoding, one waiting for its body: the queue is full.
        assert queue(wait_for(shim, lambda s: queue(s) == (1, 1))) == (1, 1)
        refused = shim.complete()
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "server_overloaded"
        assert "1 requests running and 1 waiting" in error["message"]
    finally:
        streaming.join(60)
        waiting.close()
    assert streamed[-1] == "data: [DONE]"
    # Both left: the stream finished, the stalled client went away. Room again.
    wait_for(shim, lambda s: queue(s) == (0, 0))
    assert shim.complete().status_code == 200
    samples = shim.metrics()
    assert sample_sum(samples, "layerwatch_requests_total", status="client_error") == 1  # the 429


def test_an_over_long_prompt_is_refused_by_size_and_one_that_fits_is_served(make_shim):
    shim = make_shim("--max-prompt-tokens", "32", "--max-body-bytes", str(2 << 20))
    refused = shim.complete(prompt="The quick brown fox jumps over the lazy dog. " * 20_000)  # 900 KB
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    # Refused by its length in characters, without tokenizing it.
    assert error["message"].startswith("The prompt has 900000 characters, more than 32 tokens can hold")
    # Within the size bound but over the token limit: tokenized, then refused by its token count.
    assert shim.complete(prompt="In the beginning " * 4).json()["error"]["message"].endswith("at most 32.")
    assert shim.complete(prompt="In the beginning").status_code == 200
