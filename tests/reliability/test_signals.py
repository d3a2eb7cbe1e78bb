"""Signals to a real `layerwatch serve` process (docs/service.md, "Signals and shutdown").

SIGTERM drains: new requests get 503 (and /readyz 503) while the admitted ones finish; what is
still running when `--drain-timeout-seconds` ends is cut off with an error the client can read
(an SSE error event and `data: [DONE]` for streams, a 503 body otherwise). SIGHUP checks the gate
file at once and never stops the server.
"""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.reliability.conftest import MODEL_NAME, Shim, sample_sum
from tests.reliability.test_back_pressure import STREAM_TOKENS, queue, stalled_request, wait_for
from tests.reliability.test_gate_reload import gate_file_bytes, gates_sha256, replace_atomically

LONG_GENERATION = ("--max-tokens-cap", str(STREAM_TOKENS), "--max-prompt-tokens", "32")


class Stream:
    """A streaming completion read in a thread; `first_event` is set once the first line arrived."""

    def __init__(self, shim: Shim) -> None:
        self.lines: list[str] = []
        self.first_event = threading.Event()
        body = {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": STREAM_TOKENS, "stream": True}

        def read() -> None:
            with httpx.stream("POST", f"{shim.url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first_event.set()

        self._thread = threading.Thread(target=read)
        self._thread.start()

    def join(self) -> list[str]:
        self._thread.join(60)
        assert not self._thread.is_alive()
        return self.lines

    def events(self) -> list[dict]:
        return [json.loads(line.removeprefix("data: ")) for line in self.lines[:-1]]


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(make_shim):
    shim = make_shim(*LONG_GENERATION, "--drain-timeout-seconds", "60")
    waiting = stalled_request(shim.port)  # admitted, its body not yet complete: the drain waits for it
    stream = Stream(shim)
    assert stream.first_event.wait(30)
    wait_for(shim, lambda s: queue(s)[1] == 1)
    shim.process.proc.send_signal(signal.SIGTERM)

    # Draining: the port still answers, but admits nothing new and is out of rotation.
    refused = httpx.post(
        f"{shim.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "In the beginning"}, timeout=30
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert httpx.get(f"{shim.url}/readyz", timeout=30).status_code == 503
    # The request in flight finished as if nothing happened.
    lines = stream.join()
    assert lines[-1] == "data: [DONE]"
    assert stream.events()[-1]["choices"][0]["finish_reason"] == "length"
    assert shim.process.running()  # still waiting for the stalled request
    # The stalled request, completed now, is served; then the server exits.
    body = json.dumps({"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 2}).encode()
    waiting.sendall(body[10:])
    answer = waiting.recv(65536).decode()
    waiting.close()
    assert answer.startswith("HTTP/1.1 200"), answer
    assert shim.process.proc.wait(30) == -signal.SIGTERM
    assert "draining" in shim.process.log_path.read_text()


def test_the_drain_timeout_cuts_streams_with_an_error_event_and_done(make_shim):
    shim = make_shim(*LONG_GENERATION, "--max-batch-size", "2", "--drain-timeout-seconds", "0")
    stream = Stream(shim)
    assert stream.first_event.wait(30)
    whole: list[httpx.Response] = []
    body = {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": STREAM_TOKENS}
    plain = threading.Thread(
        target=lambda: whole.append(httpx.post(f"{shim.url}/v1/completions", json=body, timeout=60))
    )
    plain.start()
    wait_for(shim, lambda s: queue(s) == (2, 0))  # both decoding
    shim.process.proc.send_signal(signal.SIGTERM)

    lines = stream.join()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down"
    assert "drain timeout 0 s" in error["message"]
    assert len(stream.events()) < STREAM_TOKENS  # cut off, not finished
    plain.join(60)
    [response] = whole
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "server_shutting_down"
    assert shim.process.proc.wait(30) == -signal.SIGTERM


def test_sighup_checks_the_gate_file_now_and_serving_goes_on(make_shim, tiny_checkpoint, tmp_path):
    import dataclasses
    import shutil

    folder = tmp_path / "model" / MODEL_NAME
    shutil.copytree(tiny_checkpoint.path, folder)  # the test replaces the gate file
    checkpoint = dataclasses.replace(tiny_checkpoint, path=folder, gates_path=folder / "gates.safetensors")
    shim = Shim(tmp_path, checkpoint, "--gates-watch-seconds", "3600", "--log-level", "info").start()
    try:
        assert gates_sha256(shim.metrics()) == tiny_checkpoint.gates_sha256
        new_sha = replace_atomically(checkpoint.gates_path, gate_file_bytes(tmp_path, bias=3.0))
        shim.process.proc.send_signal(signal.SIGHUP)
        samples = wait_for(shim, lambda s: gates_sha256(s) == new_sha)  # not the hourly poll: the signal
        assert sample_sum(samples, "layerwatch_gate_file_reloads_total", status="loaded") == 1
        assert shim.process.running()
        assert shim.complete().status_code == 200
        assert "SIGHUP received: checking the gate file" in shim.process.log_path.read_text()
    finally:
        shim.stop()


def test_sighup_without_a_gate_watch_is_logged_and_ignored(make_shim):
    shim = make_shim("--gates-watch-seconds", "0")
    shim.process.proc.send_signal(signal.SIGHUP)
    assert shim.complete().status_code == 200
    assert shim.process.running()
    shim.stop()
    assert "SIGHUP received and ignored" in shim.process.log_path.read_text()
