"""Client disconnects cancel generations; the debug header returns per-token layer activity."""

from __future__ import annotations

import json
import socket

import httpx

from tests.service.conftest import MODEL_NAME, NUM_LAYERS
from tests.support import sample_sum, wait_for


def raw_post(server, body: dict) -> socket.socket:
    """Send a request on a bare socket (so the test decides when the client goes away)."""
    host, port = server.base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(payload) + payload
    )
    return sock


def test_disconnected_clients_cancel_their_generation(server):
    server.wait_idle()
    before = server.metrics()
    # Streaming: read the first event, then hang up.
    stream = raw_post(server, {"model": MODEL_NAME, "prompt": "light", "max_tokens": 48, "stream": True})
    received = b""
    while b"data:" not in received:
        received += stream.recv(4096)
    stream.close()
    # Not streaming: hang up at once (the generation cannot finish its 48 tokens before the server
    # notices; a request whose body the server had not read yet is cancelled too).
    raw_post(server, {"model": MODEL_NAME, "prompt": "darkness", "max_tokens": 48}).close()

    def cancelled() -> float:
        return sample_sum(server.metrics(), "layerwatch_requests_total", status="cancelled") - sample_sum(
            before, "layerwatch_requests_total", status="cancelled"
        )

    wait_for(lambda: cancelled() == 2, timeout=20)
    server.wait_idle()
    after = server.metrics()
    decoded = sample_sum(after, "layerwatch_tokens_total", phase="decode") - sample_sum(
        before, "layerwatch_tokens_total", phase="decode"
    )
    assert 0 < decoded < 2 * 48  # stopped early; still counted like the layer counters
    assert decoded == sample_sum(after, "layerwatch_layers_executed_count") - sample_sum(
        before, "layerwatch_layers_executed_count"
    )
    assert sample_sum(after, "layerwatch_requests_total", status="ok") == sample_sum(
        before, "layerwatch_requests_total", status="ok"
    )


def test_debug_header_returns_layer_activity_matching_usage(server):
    body = {"model": MODEL_NAME, "prompt": "And God saw the light", "max_tokens": 8, "temperature": 0}
    response = httpx.post(
        f"{server.base_url}/v1/completions", json=body, timeout=30, headers={"x-layerwatch-debug": "true"}
    )
    activity = json.loads(response.headers["x-layerwatch-layer-activity"])
    usage = response.json()["usage"]
    assert len(activity) == usage["completion_tokens"] == 8
    assert all(len(token) == NUM_LAYERS and set(token) <= {0, 1} for token in activity)
    assert sum(map(sum, activity)) == usage["layers_executed"]
    assert activity[0] == [1] * NUM_LAYERS  # the first `patience` tokens run full depth
    assert (
        "x-layerwatch-layer-activity"
        not in httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).headers
    )


def test_debug_activity_arrives_as_a_final_stream_event(server):
    body = {
        "model": MODEL_NAME,
        "prompt": "And God saw the light",
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=30, headers={"x-layerwatch-debug": "true"}
    ) as response:
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    name, data = events[-2].split("\n")
    assert name == "event: layerwatch.layer_activity"
    activity = json.loads(data.removeprefix("data: "))["layer_activity"]
    usage = json.loads(events[-3].removeprefix("data: "))["usage"]
    assert len(activity) == usage["completion_tokens"]
    assert sum(map(sum, activity)) == usage["layers_executed"]


def test_debug_header_is_ignored_without_allow_debug(in_process):
    server = in_process(allow_debug=False)
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=30,
        headers={"x-layerwatch-debug": "true"},
        json={"model": MODEL_NAME, "prompt": "light", "max_tokens": 3},
    )
    assert response.status_code == 200
    assert "x-layerwatch-layer-activity" not in response.headers
