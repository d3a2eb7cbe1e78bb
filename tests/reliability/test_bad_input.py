"""Bad input, tried as a hostile user would: every case gets a clear error, nothing crashes or hangs,
and no partial state is left behind.

- the HTTP API fuzzed with hypothesis (hand-written strategies per endpoint: the app serves no
  OpenAPI schema, on purpose, and its request models are strict pydantic models);
- hostile datagrams on the exporter's frame port in the middle of real shim traffic;
- oversized bodies and slow clients;
- broken artifacts at the command line: checkpoints with wrong shapes or truncated weights, gates for
  another model, a malformed profile for `generate`, malformed traces for `replay`.
The frame parser itself is fuzzed in tests/exporter/test_wire.py; the checkpoint loader's messages
are checked one by one in tests/model/test_checkpoint.py. Here the whole commands face them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from layerwatch.demo.loadgen import run_load
from layerwatch.demo.processes import free_port
from layerwatch.inference_shim.runtime.gates import GateMetadata, model_fingerprint, save_gates
from layerwatch.inference_shim.service.http_protocol import BoundedH11Protocol, ConnectionRefusals, HTTPLimits
from layerwatch.wire import GateFrame, encode_frame
from tests.reliability.conftest import LAYERWATCH, MODEL_NAME, QUIET_ENV, Shim, sample_sum
from tests.reliability.test_load import wait_for_frames
from tests.service.conftest import tiny_gates, tiny_model
from tests.slow_clients import EndlessHeader, Trickler

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS_CAP = 8  # accepted fuzz requests stay cheap
MAX_BODY_BYTES = 16384  # room for hostile JSON: 3,000 levels of nesting, integers past 4,300 digits
FUZZ = settings(
    max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def fuzz_shim(tiny_checkpoint, tmp_path_factory) -> Iterator[Shim]:
    shim = Shim(
        tmp_path_factory.mktemp("fuzz"),
        tiny_checkpoint,
        "--max-tokens-cap",
        str(MAX_TOKENS_CAP),
        "--max-prompt-tokens",
        "64",
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        "--log-level",
        "info",
    )
    shim.start()
    yield shim
    shim.stop()


# --- fuzzing the HTTP API -------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=40)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values (so that some requests are valid and reach the model), sometimes any JSON."""
    return st.one_of(valid, valid, valid, valid, json_values)


sampling_fields = {
    "max_tokens": field(st.integers(-3, MAX_TOKENS_CAP + 3)),
    "temperature": field(st.floats(-1, 3) | st.just(float("nan"))),
    "top_p": field(st.floats(-0.5, 1.5, allow_nan=False)),
    "seed": field(st.integers(-5, 2**64)),
    "stop": field(st.lists(st.text(max_size=4), max_size=6) | st.text(max_size=4)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": field(st.integers(0, 3)),
    "max_completion_tokens": field(st.integers(-1, MAX_TOKENS_CAP + 1)),
    "best_of": field(st.integers(0, 3)),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "logit_bias": field(st.dictionaries(st.integers(-2, 400).map(str), st.floats(-150, 150), max_size=3)),
    "ignore_eos": field(st.booleans()),
    "logprobs": field(st.integers(-1, 21) | st.booleans()),
    "top_logprobs": field(st.integers(-1, 21)),
    "echo": field(st.booleans()),
    "response_format": field(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
}
prompts = (
    st.text(min_size=1, max_size=200)
    | st.lists(st.text(max_size=20), max_size=3)
    | st.lists(st.integers(-1, 400), max_size=12)
    | st.lists(st.lists(st.integers(0, 400), max_size=6), max_size=3)
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "wizard"]),
            "content": st.text(min_size=1, max_size=60)
            | st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=20)}),
                max_size=2,
            ),
        }
    ),
    min_size=1,
    max_size=4,
)

models = field(st.sampled_from([MODEL_NAME, MODEL_NAME, MODEL_NAME, "gpt-4", ""]))
completion_bodies = st.fixed_dictionaries({"model": models, "prompt": field(prompts)}, optional=sampling_fields)
chat_bodies = st.fixed_dictionaries({"model": models, "messages": field(messages)}, optional=sampling_fields)


def check_response(response: httpx.Response) -> None:
    """No 5xx; errors are OpenAI error bodies; successes are whole (streams end with [DONE])."""
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-200:]
        assert '"error"' not in response.text
    else:
        assert response.json()["choices"]


@FUZZ
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=st.data())
def test_fuzzed_generation_requests_never_fail_the_server(fuzz_shim, path, data):
    body = data.draw(completion_bodies if path == "/v1/completions" else chat_bodies)
    # Python's json (the server's parser too) writes and reads NaN and Infinity: a hostile client may send them.
    content = json.dumps(body, allow_nan=True).encode()
    check_response(
        httpx.post(f"{fuzz_shim.url}{path}", content=content, timeout=30, headers={"content-type": "application/json"})
    )


# JSON that is valid but hostile (unguarded, each is a 500 with a traceback, not counted):
# nesting past the parser's recursion limit (~1,000 levels), integers past Python's 4,300-digit
# int/str conversion limit, as values and as logit_bias keys; and the values Python's json reads
# beyond JSON itself.
hostile_json = st.one_of(
    st.integers(1, 3000).map(lambda depth: "[" * depth + "]" * depth),
    st.integers(1, 2500).map(lambda depth: '{"a": ' * depth + "0" + "}" * depth),
    st.integers(1, 5000).map(lambda digits: "9" * digits),
    st.integers(1, 5000).map(lambda digits: json.dumps({"9" * digits: 1})),
    st.sampled_from(["NaN", "-Infinity", "1e999", "-0", '"\\ud800"']),
)


@settings(FUZZ, max_examples=60)  # the shapes themselves are few; tests/service/test_bad_input.py has each
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=st.data())
def test_fuzzed_hostile_json_in_any_field_never_fails_the_server(fuzz_shim, path, data):
    body = data.draw(completion_bodies if path == "/v1/completions" else chat_bodies)
    name = data.draw(st.sampled_from(["model", "prompt", "messages", "x", *sampling_fields]))
    body.pop(name, None)
    value = data.draw(hostile_json)
    content = (json.dumps(body)[:-1] + f', "{name}": {value}}}').encode()
    check_response(
        httpx.post(f"{fuzz_shim.url}{path}", content=content, timeout=30, headers={"content-type": "application/json"})
    )


@FUZZ
@given(
    path=st.sampled_from(
        [
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/metrics",
            "/healthz",
            "/v1/../metrics",
            "/%00",
            "/v1/completions?x=%ff",
            "/" + "a" * 2000,
        ]
    ),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    body=st.binary(max_size=MAX_BODY_BYTES + 64),
    content_type=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]),
)
def test_fuzzed_raw_requests_never_fail_the_server(fuzz_shim, path, method, body, content_type):
    response = httpx.request(
        method,
        f"{fuzz_shim.url}{path}",
        content=body,
        timeout=30,
        headers={"content-type": content_type} if content_type else {},
    )
    assert response.status_code < 500, response.text
    if response.status_code >= 400 and path != "/healthz":
        assert response.json()["error"]["message"]


def test_after_the_fuzzing_the_server_is_healthy_and_logged_no_error(fuzz_shim):
    assert httpx.get(f"{fuzz_shim.url}/readyz", timeout=30).status_code == 200
    samples = fuzz_shim.metrics()
    assert sample_sum(samples, "layerwatch_requests_total", status="server_error") == 0
    assert sample_sum(samples, "layerwatch_requests_total", status="client_error") > 0
    assert sample_sum(samples, "layerwatch_requests_total", status="ok") > 0  # the fuzzer reached the model too
    log = fuzz_shim.process.log_tail(lines=100_000)
    assert "Traceback" not in log and " ERROR " not in log


# --- oversized and slow requests -------------------------------------------------------------------


def raw_status(port: int, request: bytes) -> int:
    """Sends bytes as they are (no client library to correct them) and returns the first status code."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(request)
        return int(connection.recv(4096).split(b" ", 2)[1])


def test_oversized_bodies_get_413_however_they_arrive(fuzz_shim):
    url = f"{fuzz_shim.url}/v1/completions"
    big = json.dumps({"model": MODEL_NAME, "prompt": "x" * (2 * MAX_BODY_BYTES)}).encode()
    declared = httpx.post(url, content=big, timeout=30)
    chunked = httpx.post(url, content=iter([big[i : i + 512] for i in range(0, len(big), 512)]), timeout=30)
    for response in (declared, chunked):
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    # Announcing a terabyte is refused on the header alone, before any body is read.
    assert raw_status(fuzz_shim.port, head + b"Content-Length: 1099511627776\r\n\r\n{}") == 413
    # Announcing less than is sent: the server reads what was announced (not JSON) and stops there.
    assert raw_status(fuzz_shim.port, head + b"Content-Length: 10\r\n\r\n" + big) == 400


def resident_mb(pid: int) -> float:
    return int(re.search(r"^VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)[1]) / 1024


def slow_client(port: int, payload: bytes) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port), timeout=5)
    connection.sendall(payload)
    return connection


def test_slow_clients_do_not_stall_other_clients(fuzz_shim):
    """Slowloris: connections that stop mid-headers or mid-body hold only their own socket.

    The engine never sees them (the body is read in full before a request is queued), so the other
    clients are served at their usual latency meanwhile. The stalled heads are cut off once
    --header-timeout-seconds (10 s) has passed, the bodies after --body-timeout-seconds (below).
    """
    stalled = [slow_client(fuzz_shim.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(10)]
    stalled += [
        slow_client(
            fuzz_shim.port,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b'application/json\r\nContent-Length: 400\r\n\r\n{"mo',
        )
        for _ in range(10)
    ]
    try:
        report = run_load(
            fuzz_shim.url, MODEL_NAME, duration=3.0, concurrency=3, max_tokens=MAX_TOKENS_CAP, seed=1, timeout=10
        )
        assert report.requests > 0 and report.by_status == {200: report.requests}
        assert report.percentile(0.99) < 2.0, report.summary()
        for connection in stalled:  # still waiting for their request to complete: no answer was sent
            connection.settimeout(0.05)
            with pytest.raises(TimeoutError):
                connection.recv(1)
    finally:
        for connection in stalled:
            connection.close()
    # Closing them mid-request leaves nothing behind: the server answers and counts as before.
    time.sleep(0.5)
    assert fuzz_shim.complete(max_tokens=2).status_code == 200


def test_a_stalled_body_is_cut_off_with_408(make_shim):
    """A client that sends its headers and part of the body, then stalls, gets 408 once
    --body-timeout-seconds has passed; meanwhile others are served."""
    shim = make_shim("--body-timeout-seconds", "1")
    started = time.monotonic()
    stalled = slow_client(
        shim.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b'application/json\r\nContent-Length: 400\r\n\r\n{"mo',
    )
    try:
        assert shim.complete(max_tokens=2).status_code == 200
        stalled.settimeout(10)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):  # the whole (small JSON) answer
            chunk = stalled.recv(4096)
            assert chunk, f"connection closed after {answer!r}"
            answer += chunk
        waited = time.monotonic() - started
    finally:
        stalled.close()
    assert 1.0 <= waited < 5.0
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert shim.complete(max_tokens=2).status_code == 200


def refused(shim: Shim, reason: str) -> float:
    return sample_sum(shim.metrics(), "layerwatch_http_connections_refused_total", reason=reason)


def test_a_request_head_over_the_size_bound_gets_431_at_once(fuzz_shim):
    """httptools, uvicorn's default parser, has no bound on a request line or header."""
    before = refused(fuzz_shim, "head_too_large")
    big_header = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    long_path = b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    assert raw_status(fuzz_shim.port, big_header) == 431
    assert raw_status(fuzz_shim.port, long_path) == 431
    # Behind a small request in the same read: h11 parsed it whole once the first was answered (a 404)
    with socket.create_connection(("127.0.0.1", fuzz_shim.port), timeout=10) as connection:
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + big_header)
        answer, closed = answer_until_closed(connection)
    statuses = [line for line in answer.split(b"\r\n") if b"HTTP/1.1 " in line]
    assert statuses == [b"HTTP/1.1 200 OK", b'{"status":"ok"}HTTP/1.1 431 '] and closed, answer
    assert refused(fuzz_shim, "head_too_large") == before + 3
    within = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8_000 + b"\r\n\r\n"
    assert raw_status(fuzz_shim.port, within) == 200


def test_an_endless_header_line_costs_other_clients_nothing(fuzz_shim):
    """Unbounded, one client sending a header line that never ends holds /healthz at 2.5-9.8 s
    and grows the shim by 290 MB, its growing buffer copied again and again on the event loop. Now
    each such connection is answered 431 once 16 KiB are in, and closed; the attackers here open
    another one at once, for 3 s."""
    resident = resident_mb(fuzz_shim.process.proc.pid)
    before = refused(fuzz_shim, "head_too_large")
    latencies = []
    with EndlessHeader(("127.0.0.1", fuzz_shim.port), count=2) as attack:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert httpx.get(f"{fuzz_shim.url}/healthz", timeout=10).status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
    # Each closed at 16 KiB with a 431 (which the attacker, still sending, loses to the reset).
    assert attack.connections > 10 and refused(fuzz_shim, "head_too_large") >= before + attack.connections - 2
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    assert resident_mb(fuzz_shim.process.proc.pid) < resident + 50
    assert fuzz_shim.complete(max_tokens=2).status_code == 200


def answer_until_closed(connection: socket.socket, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Everything the server sends, and whether it then closed the connection (within `timeout`)."""
    connection.settimeout(timeout)
    answer = b""
    try:
        while chunk := connection.recv(4096):
            answer += chunk
    except TimeoutError:
        return answer, False
    return answer, True


def completion_request(framing: str) -> bytes:
    body = json.dumps({"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 2}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if framing == "chunked":
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


def served(shim: Shim) -> float:
    return sample_sum(shim.metrics(), "layerwatch_requests_total")


SMUGGLED = completion_request("content-length")
# A proxy that frames by Content-Length forwards all of it as one request; h11 read it chunked, then
# answered SMUGGLED as a second request of the proxy's connection (docs/reliability.md).
LENGTH_AND_CHUNKED = [
    b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % (5 + len(SMUGGLED)),
    b"transfer-encoding: chunked\r\ncontent-length: %d\r\n" % (5 + len(SMUGGLED)),
]


@pytest.mark.parametrize(
    "version,framing,fault",
    [
        (b"1.1", LENGTH_AND_CHUNKED[0], b"Content-Length and Transfer-Encoding both sent"),
        (b"1.1", LENGTH_AND_CHUNKED[1], b"Content-Length and Transfer-Encoding both sent"),
        (b"1.0", b"Transfer-Encoding: chunked\r\n", b"Transfer-Encoding in an HTTP/1.0 request"),
    ],
    ids=["length-then-chunked", "chunked-then-length", "chunked-in-http-1.0"],
)
def test_a_request_whose_body_length_is_ambiguous_gets_400_and_the_connection_closed(
    fuzz_shim, version, framing, fault
):
    """Request smuggling (RFC 9112, 6.1 and 6.3): h11 read Content-Length with Transfer-Encoding as
    chunked and kept the connection, answering what followed the empty chunked body as a second
    request. Now the head alone is answered 400, then the connection closed: nothing reaches the app."""
    refusals = refused(fuzz_shim, "ambiguous_framing"), refused(fuzz_shim, "malformed_head")
    requests = served(fuzz_shim)
    head = b"POST /v1/completions HTTP/" + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", fuzz_shim.port), timeout=10) as connection:
        connection.sendall(head + framing + b"\r\n0\r\n\r\n" + SMUGGLED)
        answer, closed = answer_until_closed(connection)
    status, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert status == b"HTTP/1.1 400 " and closed, answer
    assert b"connection: close" in headers.lower().split(b"\r\n"), answer
    assert body == fault + b": the body length is ambiguous.", answer  # and SMUGGLED never answered
    assert (refused(fuzz_shim, "ambiguous_framing"), refused(fuzz_shim, "malformed_head")) == (
        refusals[0] + 1,
        refusals[1],
    )
    assert served(fuzz_shim) == requests


def test_an_ambiguous_head_request_gets_the_400_head(fuzz_shim):
    """h11 sends no body in an answer to HEAD: the whole refusal was dropped, the connection closed mute."""
    refusals = refused(fuzz_shim, "ambiguous_framing")
    with socket.create_connection(("127.0.0.1", fuzz_shim.port), timeout=10) as connection:
        connection.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n" + LENGTH_AND_CHUNKED[0] + b"\r\n0\r\n\r\n")
        answer, closed = answer_until_closed(connection)
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.endswith(b"\r\n\r\n") and closed, answer
    assert b"\r\ncontent-length: 77\r\n" in answer, answer  # the GET answer's body length, as RFC 9110 9.3.2 asks
    assert refused(fuzz_shim, "ambiguous_framing") == refusals + 1


def test_chunked_and_length_framed_requests_are_served_on_one_kept_connection(fuzz_shim):
    """What the refusal above must leave alone: each framing on its own, one after the other."""
    requests = served(fuzz_shim)
    with socket.create_connection(("127.0.0.1", fuzz_shim.port), timeout=30) as connection:
        for framing in ("chunked", "content-length"):
            connection.sendall(completion_request(framing))
            answer = b""
            while not (answer.startswith(b"HTTP/1.1 ") and answer.endswith(b"}")):  # a small JSON answer
                chunk = connection.recv(4096)
                assert chunk, f"connection closed after {answer!r}"
                answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), answer
            assert json.loads(body)["usage"]["completion_tokens"] == 2
        answer, closed = answer_until_closed(connection, timeout=0.5)
    assert (answer, closed) == (b"", False)  # still open, nothing more sent
    assert served(fuzz_shim) == requests + 2


@pytest.fixture(scope="module")
def few_files_shim(tiny_checkpoint, tmp_path_factory) -> Iterator[Shim]:
    """A shim allowed 256 open files, which lowers --max-connections to fit them (192), with
    --header-timeout-seconds 2 from the environment."""
    launcher = ("env", "LAYERWATCH_HEADER_TIMEOUT_SECONDS=2", "prlimit", "--nofile=256")
    shim = Shim(tmp_path_factory.mktemp("few-files"), tiny_checkpoint, launcher=launcher).start()
    yield shim
    shim.stop()


def test_trickled_heads_are_cut_off_and_cannot_hold_every_connection(few_files_shim):
    """uvicorn has no deadline for a request head, nor a bound on connections: a
    head trickled a byte at a time held its connection for as long as the client liked, and enough
    of them used up the process' open files: every other client refused. Here 300 of them against
    the shim allowed 192 connections: each connection past that closes the one whose request has
    been arriving longest, and a head not in within --header-timeout-seconds (2 s) gets 408."""
    shim = few_files_shim
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
    evicted = refused(shim, "evicted")
    with Trickler(("127.0.0.1", shim.port), 300, head=head, interval=0.2) as attack:
        time.sleep(0.5)
        report = run_load(shim.url, MODEL_NAME, duration=3.0, concurrency=3, max_tokens=4, seed=2, timeout=10)
        open_files = len(os.listdir(f"/proc/{shim.process.proc.pid}/fd"))
    assert report.requests > 0 and report.by_status == {200: report.requests}, report.summary()
    assert attack.closed_by_server >= 108 and refused(shim, "evicted") >= evicted + 108
    assert open_files <= 256
    assert "--max-connections 1000 lowered to 192" in shim.process.log_tail(200)
    started = time.monotonic()
    with Trickler(("127.0.0.1", shim.port), 1, head=head, interval=0.2) as alone:
        while not alone.answers and time.monotonic() - started < 10:
            time.sleep(0.05)
    assert alone.answers and alone.answers[0].startswith(b"HTTP/1.1 408"), alone.answers
    assert 2.0 <= time.monotonic() - started < 6.0
    assert refused(shim, "head_timeout") >= 1


def test_trickled_bodies_cannot_hold_every_connection(few_files_shim):
    """A connection whose head was in but whose body still trickled was never
    closed to make room, so 1,000 of them (one byte every 2 s) got every other client, /healthz
    included, a 503 for the whole --body-timeout-seconds (30 s), again after each reconnect. Now a
    body still arriving is closed to make room as a head still arriving is, the oldest first."""
    shim = few_files_shim
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    )
    evicted, cancelled = (
        refused(shim, "evicted"),
        sample_sum(shim.metrics(), "layerwatch_requests_total", status="cancelled"),
    )
    with Trickler(("127.0.0.1", shim.port), 300, head=head, interval=0.2) as attack:
        time.sleep(0.5)
        report = run_load(shim.url, MODEL_NAME, duration=3.0, concurrency=3, max_tokens=4, seed=3, timeout=10)
        health = httpx.get(f"{shim.url}/healthz", timeout=10).status_code
    assert report.requests > 0 and report.by_status == {200: report.requests}, report.summary()
    assert health == 200
    assert attack.closed_by_server >= 108 and refused(shim, "evicted") >= evicted + 108
    # Each one cut off is a request its client abandoned (499, as a client that hung up).
    assert sample_sum(shim.metrics(), "layerwatch_requests_total", status="cancelled") >= cancelled + 108


def test_past_max_connections_with_every_one_busy_the_503_says_when_to_retry():
    """The 503 past --max-connections, when no connection can be closed for
    room, had no Retry-After (the queue's 429 and the exporter's listener send one). The API's own
    protocol in a real uvicorn on loopback, 2 connections allowed, each holding a whole request that
    its handler answers only when released: no model needed to keep them busy."""
    arrived, release = threading.Semaphore(0), threading.Event()

    async def held(scope, receive, send):
        arrived.release()
        await asyncio.to_thread(release.wait, 10)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    protocol = BoundedH11Protocol.bounded(HTTPLimits(max_connections=2), ConnectionRefusals(CollectorRegistry(), "m"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(held, port=port, http=protocol, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        busy = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        for connection in busy:
            connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert all(arrived.acquire(timeout=10) for _ in busy)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            head = extra.recv(4096).split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 503") and b"\r\nretry-after: 1\r\n" in head + b"\r\n", head
        release.set()
        for connection in busy:
            assert connection.recv(4096).startswith(b"HTTP/1.1 200")
            connection.close()
    finally:
        release.set()
        server.should_exit = True
        thread.join(10)


# --- hostile datagrams among real frames ---------------------------------------------------------


def test_hostile_datagrams_do_not_disturb_the_shims_accounting(make_shim, exporter):
    """Garbage on the frame port while a real shim streams frames: the garbage is counted as
    malformed, and the real frames still reconcile exactly with the tokens served."""
    shim = make_shim("--max-batch-size", "4", exporter=exporter)
    rng = np.random.default_rng(0)
    valid = encode_frame(
        GateFrame(MODEL_NAME, "real-shim-id-for-shape", 0, np.full((2, 6), 0.5, np.float32), np.zeros((2, 6), bool))
    )
    garbage = [rng.bytes(int(n)) for n in rng.integers(0, 3000, 150)]
    garbage += [valid[: int(n)] for n in rng.integers(0, len(valid) - 1, 100)]  # truncated frames
    garbage += [b"LWGF" + rng.bytes(40) for _ in range(100)]  # a plausible magic, then noise
    stop = threading.Event()

    def spray() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            for datagram in garbage:
                if stop.is_set():
                    return
                sender.sendto(datagram, ("127.0.0.1", exporter.udp_port))
                time.sleep(0.005)

    sprayer = threading.Thread(target=spray)
    sprayer.start()
    report = run_load(shim.url, MODEL_NAME, duration=3.0, concurrency=3, max_tokens=8, seed=2)
    stop.set()
    sprayer.join()
    assert report.by_status == {200: report.requests}
    shim_samples, exporter_samples = wait_for_frames(shim, exporter)  # not a fixed wait: UDP in flight
    sent = sample_sum(shim_samples, "layerwatch_telemetry_frames_sent_total")
    assert sample_sum(exporter_samples, "layerwatch_exporter_frames_received_total", model_name=MODEL_NAME) == sent
    assert sample_sum(exporter_samples, "layerwatch_exporter_frames_lost_total") == 0
    assert (
        sample_sum(exporter_samples, "layerwatch_entropy_count", model_name=MODEL_NAME)
        == report.completion_tokens * shim.checkpoint.num_layers
    )
    malformed = sample_sum(exporter_samples, "layerwatch_exporter_frames_malformed_total")
    assert 0 < malformed <= len(garbage)  # an empty datagram may be dropped by the kernel; the rest count
    assert httpx.get(f"{exporter.url}/healthz", timeout=10).status_code == 200


# --- broken artifacts at the command line ---------------------------------------------------------


def broken_copy(checkpoint_path: Path, dest: Path) -> Path:
    folder = dest / MODEL_NAME
    shutil.copytree(checkpoint_path, folder)
    return folder


def truncated_weights(folder: Path) -> str:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "model.safetensors"


def gates_of_another_model(folder: Path) -> str:
    other = tiny_model(seed=42)  # same shapes, other weights: only the fingerprint tells them apart
    save_gates(
        folder / "gates.safetensors",
        tiny_gates(other),
        GateMetadata(
            num_layers=other.config.num_layers,
            hidden_size=other.config.hidden_size,
            threshold=0.18,
            patience=3,
            base_fingerprint=model_fingerprint(other),
        ),
    )
    return "gates.safetensors"


def nan_weight(folder: Path) -> str:
    # Off the gates' fingerprint sample (model_fingerprint), so only the weight check can refuse it:
    # before it, serve started and answered every request 500.
    path = folder / "model.safetensors"
    state = load_file(path)
    state["model.layers.1.mlp.down_proj.weight"].view(-1)[1] = float("nan")
    save_file(state, path, metadata={"format": "pt"})
    return "model.safetensors"


def config_not_json(folder: Path) -> str:
    (folder / "config.json").write_text('{"hidden_size": 32,')
    return "config.json"


# One subprocess per case is ~2 s of CPU: the command line is shown refusing a few, each of another
# kind; every other way a file can be broken goes through the same loaders, and those are tested in
# process (tests/model/test_checkpoint.py, tests/model/test_gates.py), messages included.
BREAKAGES = [truncated_weights, nan_weight, gates_of_another_model, config_not_json]


def rewrite_gates(folder: Path, tensor_change=None, **metadata_changes) -> str:
    """The checkpoint's own gate file with one tensor changed or metadata fields replaced."""
    path = folder / "gates.safetensors"
    with safe_open(path, "pt") as gates:
        metadata = json.loads(gates.metadata()["layerwatch_gates"])
    tensors = load_file(path)
    if tensor_change is not None:
        tensor_change(tensors)
    save_file(tensors, path, metadata={"layerwatch_gates": json.dumps({**metadata, **metadata_changes})})
    return "gates.safetensors"


def nan_gate_weight(folder: Path) -> str:
    return rewrite_gates(folder, lambda tensors: tensors["gates.2.fc1.weight"].__setitem__((0, 0), float("nan")))


def unknown_gate_skip_rule(folder: Path) -> str:
    return rewrite_gates(folder, skip_rule="sliding")


def huge_gate_file(folder: Path) -> str:
    with open(folder / "gates.safetensors", "wb") as file:  # sparse: no disk, and no memory unless read
        file.truncate(1_500_000_000)
    return "gates.safetensors"


GATE_BREAKAGES = {
    nan_gate_weight: "tensor gates.2.fc1.weight holds 1 NaN or infinite value(s)",
    unknown_gate_skip_rule: 'metadata: skip_rule must be one of "streak", "ewma", got "sliding"',
    huge_gate_file: "1500000000 bytes; a gate file for this model has at most",
}


def start_broken_serves(checkpoint: Path, tmp_path: Path, breakages) -> list[tuple]:
    """One `layerwatch serve` per breakage, on a broken copy of the checkpoint, all in parallel."""
    runs = []
    for breakage in breakages:
        folder = broken_copy(checkpoint, tmp_path / breakage.__name__)
        culprit = breakage(folder)
        port = free_port()
        argv = [*LAYERWATCH, "serve", "--model", str(folder), "--port", str(port), "--exporter-address", ""]
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**QUIET_ENV, "PATH": "/usr/bin:/bin"},
        )
        runs.append((breakage.__name__, folder / culprit, port, process, time.monotonic()))
    return runs


def refusal(run: tuple) -> str:
    """Wait for a broken serve: exit 2 naming the broken file, no traceback, its port never opened.
    Returns its output; prints how long it took (a figure, not a test: the cores are shared)."""
    name, culprit, port, process, started = run
    output, _ = process.communicate(timeout=180)  # a hang guard: 2 shared cores run these slowly
    elapsed = time.monotonic() - started
    assert process.returncode == 2, f"{name}: {output}"
    assert "cannot start" in output and str(culprit) in output, f"{name}: {output}"
    assert "Traceback" not in output, f"{name}: {output}"
    with socket.socket() as probe:  # nothing listens there
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    print(f"\n{name}: exit 2 after {elapsed:.1f}s: {output.strip().splitlines()[-1][:160]}")
    return output


def test_serve_refuses_broken_checkpoints_naming_the_file(tiny_checkpoint, tmp_path):
    """All cases at once (one process each, in parallel): exit 2, a message naming the broken file,
    and no listener was ever opened (the port is still free)."""
    torch.set_num_threads(1)
    for run in start_broken_serves(tiny_checkpoint.path, tmp_path, BREAKAGES):
        refusal(run)


def test_serve_refuses_broken_gate_files_naming_file_and_fault(tiny_checkpoint, tmp_path):
    """A NaN weight, an unknown skip rule, and a gate path at a 1.5 GB file (refused from its size,
    never read): exit 2 naming the file and the tensor or field at fault."""
    for run, detail in zip(
        start_broken_serves(tiny_checkpoint.path, tmp_path, GATE_BREAKAGES), GATE_BREAKAGES.values()
    ):
        output = refusal(run)
        assert detail in output, f"{run[0]}: {output}"


def test_generate_refuses_a_malformed_profile_and_writes_nothing(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "layerwatch" / "alerts" / "profiles", tree / "layerwatch" / "alerts" / "profiles")
    profile = tree / "layerwatch" / "alerts" / "profiles" / "reference.yaml"
    inputs = set(tree.rglob("*"))
    cases = {
        "not-yaml": "model_name: [unclosed\n",
        "wrong-type": profile.read_text().replace("runaway_skip_ratio: 0.85", "runaway_skip_ratio: lots"),
        "a-list": "- 1\n- 2\n",
    }
    for name, text in cases.items():
        profile.write_text(text)
        result = subprocess.run(
            [*LAYERWATCH, "generate", "--root", str(tree)], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert result.returncode == 2, f"{name}: {result.stdout}{result.stderr}"
        assert "reference.yaml" in result.stderr and "Traceback" not in result.stderr, f"{name}: {result.stderr}"
        written = set(tree.rglob("*")) - inputs
        assert written == set(), f"{name}: partial output {written}"


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff\xfe garbage \x80\n",
        b'{"model_name": "m", "scores": [NaN, 0.1], "skipped": [0, 0]}\n',
        b'{"model_name": "m", "scores": [0.1, 0.2], "skipped": [0]}\n',
        b'{"model_name": "m", "scores": "0.1", "skipped": [0]}\n',
        b"[1, 2, 3]\n",
        b'{"model_name": "m", "scores": [' + b"0.5, " * 200_000 + b'0.5], "skipped": [0]}\n',
    ],
    ids=["binary", "nan", "ragged", "string-scores", "not-an-object", "huge-line"],
)
def test_replay_refuses_a_malformed_trace_with_file_and_line(tmp_path, content):
    good = b'{"model_name": "m", "scores": [0.1, 0.9], "skipped": [1, 0]}\n'
    path = tmp_path / "trace.jsonl"
    path.write_bytes(good + content)
    result = subprocess.run([*LAYERWATCH, "replay", str(path), "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert f"{path}:2" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_replay_skips_a_torn_last_line_with_a_warning(tmp_path):
    """A trace whose last write was cut short (a full disk, a crash): the 220 whole lines before it are
    replayed, the torn line is skipped with a warning naming it, and the exit code is 0."""
    good = b'{"model_name": "m", "scores": [0.1, 0.9], "skipped": [1, 0]}\n'
    path = tmp_path / "trace.jsonl"
    path.write_bytes(good * 220 + good[:30])
    result = subprocess.run([*LAYERWATCH, "replay", str(path), "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["observations"] == 220 * 2
    assert "1 torn last line skipped" in result.stderr and f"{path}:221: " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
