"""The README's first command: `layerwatch demo` runs the stack on the demo model and stops cleanly on Ctrl-C."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time

import pytest

from demo.processes import LAYERWATCH_COMMAND, free_port


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.skipif(
    not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")),
    reason="the demo starts Prometheus and Alertmanager when they are installed",
)
def test_demo_shows_the_live_histogram_and_leaves_nothing_behind_on_ctrl_c(tmp_path):
    ports = {name: free_port() for name in ("port", "exporter-port", "prometheus-port", "alertmanager-port")}
    argv = [*LAYERWATCH_COMMAND, "demo", "--workdir", str(tmp_path), "--interval", "1"]
    for name, port in ports.items():
        argv += [f"--{name}", str(port)]
    # Ctrl-C reaches a demo run from a terminal; one started by a background job (`cmd &` in a
    # script, nohup: how CI may run this suite) inherits SIGINT ignored and would never see it.
    # The child gets SIGINT's default, as a foreground job has it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        demo = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    output: list[str] = []
    try:
        deadline = time.monotonic() + 240
        # The exporter's view shows a model's histogram once gate frames arrive from the load.
        while time.monotonic() < deadline:
            line = demo.stdout.readline()
            if not line:
                break
            output.append(line)
            if "observations" in line:  # a model's report line: frames have arrived
                break
        assert any("prometheus" in line and "/alerts" in line for line in output), "".join(output)
        assert any("observations" in line for line in output), "".join(output)
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, "".join(output) + rest
    assert "stopped every process it started" in rest
    assert all(_port_closed(port) for port in ports.values()), ports
