"""Signals to the real long-running commands (docs/interfaces.md, "Signals").

`serve` (docs/service.md, "Signals and shutdown"): SIGTERM drains: new requests get 503 (and
/readyz 503) while the admitted ones finish; what is still running when `--drain-timeout-seconds`
ends is cut off with an error the client can read (an SSE error event and `data: [DONE]` for
streams, a 503 body otherwise). SIGHUP checks the gate file at once and never stops the server.

`exporter`, `top` and `demo`: SIGTERM, SIGINT and SIGHUP stop them cleanly, logged, from the first
moment of start-up, and they exit by the signal; `demo` stops every process it started however it
ends, its parent's death (SIGKILL, nothing to clean up) included.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from layerwatch.demo.processes import ManagedProcess, free_port
from tests.reliability.conftest import LAYERWATCH, LONG_TOKENS, MODEL_NAME, Exporter, Shim, sample_sum, wait_for_metrics
from tests.reliability.test_back_pressure import Completion, Stream, queue
from tests.reliability.test_gate_reload import gate_file_bytes, gates_sha256, replace_atomically

DRAINED_TOKENS = 600  # finishes within the drain, after the test has looked at the draining server


@pytest.fixture(autouse=True)
def default_stop_signals():
    """The commands under test start with SIGHUP and SIGINT at their default actions, as from a terminal.
    A test run started by `nohup`, or as a background job of a non-interactive shell, has them ignored,
    and the commands rightly keep an inherited ignore (layerwatch/cli/signals.py): six of these tests
    then timed out in a fresh-clone run started so."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGHUP, signal.SIGINT)}
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for signum, handler in previous.items():
        if handler is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signum, handler)


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


# Runs `python -m MODULE ARGS...` (given after the code), sending the process a signal from inside its
# own start-up at the moment it first imports a module: the slow imports and model loading that
# follow are where a signal used to end it at once, silently (or with a traceback, for SIGINT).
SIGNAL_AT_IMPORT = """
import importlib.abc, os, runpy, signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground terminal, even from a background job

class SignalAtImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.{signal})
        return None

sys.meta_path.insert(0, SignalAtImport())
module = sys.argv[3]  # sys.argv: -c PYTHON -m MODULE ARGS...
sys.argv = [module, *sys.argv[4:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def signal_at_import(module: str, sig: signal.Signals) -> tuple[str, ...]:
    return (sys.executable, "-c", SIGNAL_AT_IMPORT.format(module=module, signal=sig.name))


def test_a_sighup_during_start_up_is_logged_and_ignored(tiny_checkpoint, tmp_path):
    launcher = signal_at_import("torch", signal.SIGHUP)
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


def test_ctrl_c_during_start_up_stops_serve_logged_and_by_the_signal(tiny_checkpoint, tmp_path):
    # Before: killed at once, silently; a Ctrl-C (SIGINT) at that moment was a KeyboardInterrupt traceback.
    shim = Shim(tmp_path, tiny_checkpoint, "--log-level", "info", launcher=signal_at_import("torch", signal.SIGINT))
    with pytest.raises(RuntimeError, match="exited with -2"):
        shim.start()
    log = shim.process.log_path.read_text()
    assert "SIGINT received during start-up: stopping" in log and "Traceback" not in log, log


# --- exporter, top, demo -----------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_the_exporter_stops_cleanly_on_each_stop_signal_and_exits_by_it(tmp_path, sig):
    # SIGHUP's default would end the exporter at once (exit 129), not a line in its log.
    exporter = Exporter(tmp_path).start()
    try:
        exporter.process.proc.send_signal(sig)
        assert exporter.process.proc.wait(30) == -sig
        log = exporter.process.log_path.read_text()
        assert f"{sig.name} received: stopping" in log and "stopped" in log, log
        assert "Traceback" not in log, log
    finally:
        exporter.stop()


def test_a_sighup_during_the_exporters_start_up_stops_it_logged():
    exporter = [*LAYERWATCH, "exporter", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"]
    done = subprocess.run(
        [*signal_at_import("numpy", signal.SIGHUP), *exporter], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGHUP
    assert "SIGHUP received: stopping" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_top_stops_on_sighup_its_terminal_closing(tmp_path):
    top = subprocess.Popen(
        [*LAYERWATCH, "top", "--url", "http://127.0.0.1:9", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "cannot read" in top.stdout.readline() + top.stdout.readline()  # running: retrying
        top.send_signal(signal.SIGHUP)
        _, stderr = top.communicate(timeout=30)
    finally:
        top.kill()
    assert top.returncode == -signal.SIGHUP
    assert "SIGHUP received: stopping" in stderr and "Traceback" not in stderr, stderr


def test_a_process_started_from_a_thread_that_ends_keeps_running(tmp_path):
    """Linux sends the parent-death signal (layerwatch/demo/die_with_parent.py) when the *thread* that started a
    process ends, and a drill restarts the shim from a thread of its own, which then ends:
    ManagedProcess starts every process from one thread that lives as long as the process."""
    started: list[ManagedProcess] = []

    def start_then_end() -> None:
        started.append(ManagedProcess("sleep", ["sleep", "30"], tmp_path / "sleep.log"))
        time.sleep(1.0)  # past the child's prctl: were it this thread's child, its end would be signalled

    starter = threading.Thread(target=start_then_end)
    starter.start()
    starter.join()
    time.sleep(0.5)
    try:
        assert started[0].running()
    finally:
        started[0].stop()


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def _wait_ports_free(ports: dict[str, int], within: float) -> dict[str, int]:
    """The ports still taken after `within` seconds ({} when all are free)."""
    deadline = time.monotonic() + within
    while (
        taken := {name: port for name, port in ports.items() if not _port_free(port)}
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    return taken


class TerminalDemo:
    """`layerwatch demo` in a new session whose controlling terminal is a pty: closing the pty's
    master is a closed terminal window (the kernel hangs up the session: SIGHUP)."""

    def __init__(self, temporary: Path, model: Path, *flags: str) -> None:
        self.ports = {name: free_port() for name in ("port", "exporter-port", "prometheus-port", "alertmanager-port")}
        argv = [*LAYERWATCH, "demo", "--model", str(model), "--interval", "0.5", *flags]
        for name, port in self.ports.items():
            argv += [f"--{name}", str(port)]
        self._master, slave = pty.openpty()
        # No --workdir: the demo makes its own temporary folder, here under `temporary`.
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(temporary)}
        self.process = subprocess.Popen(  # setsid --ctty: a session of its own, the pty its terminal
            ["setsid", "--ctty", *argv], stdin=slave, stdout=slave, stderr=slave, env=environment
        )
        os.close(slave)
        self.output = b""
        self._hang_up = threading.Event()
        # A full pty would block the demo. The reader also closes the master: a close while another
        # thread is blocked reading it takes effect (the hang-up) only once that read returns.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._hang_up.is_set():
            if not select.select([self._master], [], [], 0.05)[0]:
                continue
            try:
                chunk = os.read(self._master, 4096)
            except OSError:  # EIO: the demo closed its side
                break
            if not chunk:
                break
            self.output += chunk
        os.close(self._master)

    def wait_for(self, text: bytes, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.process.poll() is None, f"the demo exited with {self.process.returncode}:\n{self.text()}"
            assert time.monotonic() < deadline, f"the demo did not show {text!r}:\n{self.text()}"
            time.sleep(0.1)

    def hang_up(self) -> None:
        self._hang_up.set()
        self._reader.join()

    def text(self) -> str:
        return self.output.decode(errors="replace")[-4000:]

    def close(self) -> None:
        if self.process.poll() is None:  # its processes end with it (layerwatch/demo/processes.py)
            self.process.kill()
            self.process.wait()
        self.hang_up()


@pytest.mark.skipif(
    not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")),
    reason="the demo starts Prometheus and Alertmanager when they are installed",
)
@pytest.mark.parametrize("ending", ["terminal closed", "terminal closed during start-up", "demo killed", "duration"])
def test_the_demo_leaves_nothing_behind_however_it_ends(tiny_checkpoint, tmp_path, ending):
    """Unhandled, closing the demo's terminal leaves the shim, the exporter, Prometheus and
    Alertmanager running with their ports held (all four still up 8 s later). A hang-up stops
    them as Ctrl-C does (tests/test_demo.py), also while the shim is still loading, a SIGKILL of
    the demo takes them along (each one gets SIGTERM when its parent dies), and --duration ends it
    all with status 0. Each run's temporary folder (1-7 MB) is
    removed, unless --keep-workdir asks for it, and then its path is said (a SIGKILL leaves it)."""
    flags = ["--duration", "8", "--keep-workdir"] if ending == "duration" else []
    demo = TerminalDemo(tmp_path, tiny_checkpoint.path, *flags)
    try:
        if ending == "terminal closed during start-up":
            while _port_free(demo.ports["exporter-port"]):  # the exporter up, the shim loading
                assert demo.process.poll() is None, demo.text()
                time.sleep(0.05)
        else:
            demo.wait_for(b"observations")  # the whole stack up, frames arriving
        if ending.startswith("terminal closed"):
            demo.hang_up()
        elif ending == "demo killed":
            demo.process.kill()
        status = demo.process.wait(60)
        taken = _wait_ports_free(demo.ports, within=15.0)
        assert not taken, f"still listening after the demo ended: {taken}\n{demo.text()}"
        assert status == {"demo killed": -signal.SIGKILL, "duration": 0}.get(ending, -signal.SIGHUP), demo.text()
        left = [p.name for p in tmp_path.glob("layerwatch-demo-*")]
        if ending == "duration":
            assert b"stopped every process it started" in demo.output
            assert len(left) == 1 and f"logs and configs kept in {tmp_path / left[0]}" in demo.text(), demo.text()
            assert (tmp_path / left[0] / "shim.log").exists()
        elif ending != "demo killed":
            assert left == [], demo.text()
    finally:
        demo.close()
