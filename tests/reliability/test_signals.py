"""Signals to a real `layerwatch serve` process (docs/service.md, "Signals and shutdown").

SIGTERM drains: new requests get 503 (and /readyz 503) while the admitted ones finish; what is
still running when `--drain-timeout-seconds` ends is cut off with an error the client can read
(an SSE error event and `data: [DONE]` for streams, a 503 body otherwise). SIGHUP checks the gate
file at once and never stops the server.
"""

from __future__ import annotations

import json
import signal
import sys

import httpx

from tests.reliability.conftest import LONG_TOKENS, MODEL_NAME, Shim, sample_sum, wait_for_metrics
from tests.reliability.test_back_pressure import Completion, Stream, queue
from tests.reliability.test_gate_reload import gate_file_bytes, gates_sha256, replace_atomically

DRAINED_TOKENS = 600  # finishes within the drain, after the test has looked at the draining server


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(make_long_shim):
    shim = make_long_shim("--max-batch-size", "1", "--drain-timeout-seconds", "60")
    decoding = Stream(shim, max_tokens=DRAINED_TOKENS)
    queued = Completion(shim, max_tokens=4)
    wait_for_metrics(shim, lambda s: queue(s) == (1, 1))
    shim.process.proc.send_signal(signal.SIGTERM)

    # Draining: the port still answers, but admits nothing new and is out of rotation.
    refused = shim.complete()
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert httpx.get(f"{shim.url}/readyz", timeout=30).status_code == 503
    # The requests in flight, decoding or waiting for a slot, finish as if nothing happened.
    lines = decoding.join()
    assert lines[-1] == "data: [DONE]"
    assert decoding.chunks()[-1]["choices"][0]["finish_reason"] == "length"
    assert queued.response().status_code == 200
    # Then the server exits, as SIGTERM asked.
    assert shim.process.proc.wait(30) == -signal.SIGTERM
    assert "SIGTERM received: draining" in shim.process.log_path.read_text()


def test_the_drain_timeout_cuts_off_what_is_still_running_with_an_error(make_long_shim):
    shim = make_long_shim("--max-batch-size", "2", "--drain-timeout-seconds", "0")
    streaming = Stream(shim)
    whole = Completion(shim, max_tokens=LONG_TOKENS)
    wait_for_metrics(shim, lambda s: queue(s) == (2, 0))  # both decoding
    shim.process.proc.send_signal(signal.SIGTERM)

    # The stream ends with an error event and [DONE], not a broken chunked body.
    lines = streaming.join()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down"
    assert "drain timeout 0 s" in error["message"]
    assert len(streaming.chunks()) < LONG_TOKENS  # cut off, not finished
    # The non-streaming request gets a 503 that says why.
    response = whole.response()
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
        samples = wait_for_metrics(shim, lambda s: gates_sha256(s) == new_sha)  # not the hourly poll: the signal
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


# Runs `python -m MODULE ARGS...` (given after the code), sending the process a SIGHUP from inside its
# own start-up at the moment it first imports torch: the slow imports and model loading that follow
# are where a hang-up used to end it at once, silently.
HANG_UP_AT_TORCH_IMPORT = """
import importlib.abc, os, runpy, signal, sys

class HangUpAtTorchImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGHUP)
        return None

sys.meta_path.insert(0, HangUpAtTorchImport())
module = sys.argv[3]  # sys.argv: -c PYTHON -m MODULE ARGS...
sys.argv = [module, *sys.argv[4:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def test_a_sighup_during_start_up_is_logged_and_ignored(tiny_checkpoint, tmp_path):
    launcher = (sys.executable, "-c", HANG_UP_AT_TORCH_IMPORT)
    shim = Shim(tmp_path, tiny_checkpoint, "--log-level", "info", launcher=launcher)
    try:
        shim.start()
        assert shim.complete().status_code == 200
        assert "SIGHUP received during start-up: ignored" in shim.process.log_path.read_text()
    finally:
        shim.stop()


# Runs `python -m MODULE ARGS...` with SIGINT raising KeyboardInterrupt, as Python sets it up in a
# foreground terminal (a test run from a background job would inherit SIGINT ignored).
WITH_CTRL_C = """
import runpy, signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)
module = sys.argv[3]  # sys.argv: -c PYTHON -m MODULE ARGS...
sys.argv = [module, *sys.argv[4:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_drains_and_exits_by_the_signal_without_a_traceback(tiny_checkpoint, tmp_path):
    shim = Shim(tmp_path, tiny_checkpoint, "--log-level", "info", launcher=(sys.executable, "-c", WITH_CTRL_C))
    try:
        shim.start()
        assert shim.complete().status_code == 200
        shim.process.proc.send_signal(signal.SIGINT)
        assert shim.process.proc.wait(30) == -signal.SIGINT
        log = shim.process.log_path.read_text()
        assert "SIGINT received: draining" in log
        assert "Traceback" not in log, log[-2000:]
    finally:
        shim.stop()
