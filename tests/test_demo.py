"""The README's first commands: `layerwatch demo` runs the stack on the demo model with Prometheus and
Alertmanager, `--drill static` injects static pruning after a healthy baseline and the terminal shows
the LayerwatchRoutingStatic page arriving at the demo's own receiver, `layerwatch top --prometheus`
shows the same alert state; Ctrl-C then stops everything.
Its other ways to end (a closed terminal, SIGKILL, --duration) are in tests/reliability/test_signals.py."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time

import pytest

from layerwatch.demo.processes import LAYERWATCH_COMMAND, free_port

PAGE = "LayerwatchRoutingStatic"


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.skipif(
    not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")),
    reason="the demo's drills need Prometheus and Alertmanager (scripts/install-system-deps.sh)",
)
def test_the_static_drill_shows_its_page_and_ctrl_c_leaves_nothing_behind(tmp_path):
    ports = {name: free_port() for name in ("port", "exporter-port", "prometheus-port", "alertmanager-port")}
    argv = [*LAYERWATCH_COMMAND, "demo", "--workdir", str(tmp_path), "--interval", "1"]
    argv += ["--drill", "static", "--baseline", "8", "--duration", "240"]
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
        while time.monotonic() < deadline:
            line = demo.stdout.readline()
            if not line:
                break
            output.append(line)
            if f"PAGED {PAGE}" in line:
                break
        # The rest of the screen that says PAGED (the alert panel: its length grows with the alerts and
        # notifications), up to the next screen's first line.
        for _ in range(200):
            line = demo.stdout.readline()
            if not line or line.startswith("drill "):
                break
            output.append(line)
        # `layerwatch top` shows the same alert state, given the demo's Prometheus and time scale.
        top = subprocess.run(
            [*LAYERWATCH_COMMAND, "top", "--once", "--url", f"http://127.0.0.1:{ports['exporter-port']}"]
            + ["--prometheus", f"http://127.0.0.1:{ports['prometheus-port']}", "--time-scale", "0.01"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    text = "".join(output)
    injected = next((i for i, line in enumerate(output) if "fault injected" in line), len(output))
    baseline, drill = "".join(output[:injected]), "".join(output[injected:])
    assert "prometheus" in text and "/alerts" in text and "x 0.01" in text, text  # the scaled rules, said
    assert "observations" in baseline and "routing: dynamic" in baseline, baseline  # the healthy histogram
    assert not [line for line in output[:injected] if "FIRING" in line and PAGE in line], baseline
    assert f"PAGED {PAGE}" in drill, text
    # The panel beside the histogram: Prometheus holds it firing, the demo's receiver got the page,
    # and the figure it reads is past its profile limit.
    assert any("FIRING" in line and PAGE in line for line in output[injected:]), drill
    assert any("pager" in line and PAGE in line and "ago" in line for line in output[injected:]), drill
    assert any("token-dependent share" in line and "past the limit" in line for line in output[injected:]), drill
    assert top.returncode == 0, top.stderr
    top_lines = top.stdout.splitlines()
    assert any("FIRING" in line and PAGE in line for line in top_lines), top.stdout
    assert any("token-dependent share" in line and "past the limit" in line for line in top_lines), top.stdout
    assert demo.returncode == -signal.SIGINT, text + rest  # stopped, then exits by the signal
    assert "stopped every process it started" in rest
    assert f"drill static: {PAGE} paged" in rest, rest
    assert all(_port_closed(port) for port in ports.values()), ports


def test_free_port_never_gives_one_process_a_port_twice():
    """Ports drawn back to back (a stack's four, before any process binds
    one) are all free at once, so a draw among the 8,192 below the ephemeral range repeated one (2
    in 2,000 draws of four): the second process to bind it failed 'Address already in use'."""
    ports = [free_port() for _ in range(500)] + [free_port(socket.SOCK_DGRAM) for _ in range(100)]
    assert len(set(ports)) == len(ports)
