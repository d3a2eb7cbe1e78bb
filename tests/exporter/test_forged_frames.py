"""Forged gate frames against a real `layerwatch exporter` process over loopback UDP:
what a sender without the frame key can cost the exporter is bounded, and counted by reason."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from layerwatch.wire import encode_frame
from tests.exporter.support import RunningExporter, forged_flood, random_frame
from tests.support import wait_for

WIDEST_SINGLE_ROW_LAYERS = 15_742  # the widest one-row frame that fits a datagram


def rejected(exporter: RunningExporter, reason: str) -> float | None:
    return exporter.value("layerwatch_exporter_frames_rejected_total", reason=reason)


def layer_series(page: str, model: str) -> int:
    """How many layers of the model have a layerwatch_layer_entropy_count_total series."""
    prefix, label = "layerwatch_layer_entropy_count_total{", f'model_name="{model}"'
    return sum(1 for line in page.splitlines() if line.startswith(prefix) and label in line)


def test_a_flood_of_wide_frames_naming_new_models_is_refused_and_costs_nothing(start_exporter) -> None:
    exporter = start_exporter()
    rng = np.random.default_rng(0)
    exporter.send_frames([encode_frame(random_frame(rng, 0, model="real"))])
    for datagram in forged_flood(64, WIDEST_SINGLE_ROW_LAYERS):
        exporter.send(datagram)
        time.sleep(0.002)
    wait_for(lambda: rejected(exporter, "too_many_layers") == 64)
    page = exporter.metrics_text()
    assert "forged-" not in page and len(page.encode()) < 1_000_000
    assert exporter.value("process_resident_memory_bytes") < 100e6
    assert exporter.value("layerwatch_exporter_frames_received_total", model_name="real") == 1
    assert layer_series(page, "real") == 6


def test_a_name_that_is_not_printable_is_refused_and_never_reaches_a_terminal(start_exporter) -> None:
    """A decoder that took any UTF-8 name would let one untagged datagram named
    "\\x1b]0;...\\x07\\x1b[2J..." became a label value that `layerwatch top` wrote raw to the
    operator's terminal (its title set, the screen cleared, a forged line after a newline)."""
    exporter = start_exporter()
    rng = np.random.default_rng(0)
    exporter.send_frames([encode_frame(random_frame(rng, 0, model="real"))])
    hostile = random_frame(rng, 0, model="real", shim="forger")
    datagram = encode_frame(hostile).replace(b"real", b"\x1b[2J", 1)  # the same length: 4 bytes
    exporter.send(datagram)
    wait_for(lambda: exporter.value("layerwatch_exporter_frames_malformed_total") == 1)
    top = subprocess.run(
        [sys.executable, "-m", "layerwatch.cli.main", "top", "--once", "--url", exporter.url],
        capture_output=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
    )
    assert top.returncode == 0, top.stderr
    assert b"real: " in top.stdout and b"\x1b" not in top.stdout
    assert exporter.value("layerwatch_exporter_frames_received_total", model_name="real") == 1


def test_a_frame_of_another_width_under_a_models_name_is_refused(start_exporter) -> None:
    exporter = start_exporter("--max-layers", "100")
    rng = np.random.default_rng(0)
    exporter.send_frames([encode_frame(random_frame(rng, 0, layers=6))])
    exporter.send(encode_frame(random_frame(rng, 1, layers=100)))  # wider, within the cap
    exporter.send(encode_frame(random_frame(rng, 2, layers=5)))
    exporter.send(encode_frame(random_frame(rng, 3, layers=101)))
    wait_for(lambda: rejected(exporter, "layer_count_changed") == 2)
    wait_for(lambda: rejected(exporter, "too_many_layers") == 1)
    exporter.send_frames([encode_frame(random_frame(rng, 4, layers=6))])
    assert layer_series(exporter.metrics_text(), "demo") == 6
    assert exporter.value("layerwatch_exporter_frames_received_total", model_name="demo") == 2
    assert exporter.value("layerwatch_exporter_frames_lost_total", model_name="demo") == 0  # refused, not lost


def test_an_idle_model_is_forgotten_and_its_slot_goes_to_a_new_one(start_exporter) -> None:
    exporter = start_exporter("--max-models", "1", "--model-idle-seconds", "1", "--window-seconds", "1")
    rng = np.random.default_rng(0)
    exporter.send_frames([encode_frame(random_frame(rng, 0, model="squatter", shim="forger"))])
    exporter.send(encode_frame(random_frame(rng, 0, model="real", shim="shim")))
    wait_for(lambda: rejected(exporter, "too_many_models") == 1)
    wait_for(lambda: "squatter" not in exporter.metrics_text())  # a scrape forgets it, series and all
    exporter.send_frames([encode_frame(random_frame(rng, 1, model="real", shim="shim"))])
    assert layer_series(exporter.metrics_text(), "real") == 6


def test_with_a_frame_key_only_frames_tagged_under_it_are_counted(start_exporter, tmp_path: Path, monkeypatch) -> None:
    key = os.urandom(32).hex().encode()
    key_file = tmp_path / "frame.key"
    key_file.write_bytes(key + b"\n")
    key_file.chmod(0o600)
    monkeypatch.setenv("LAYERWATCH_FRAME_KEY_FILE", str(key_file))  # the variable as good as the flag
    exporter = start_exporter()
    rng = np.random.default_rng(0)
    exporter.send_frames([encode_frame(random_frame(rng, 0), key)])
    for datagram in forged_flood(64, 6):  # named like new models, well-formed, untagged
        exporter.send(datagram)
    exporter.send(encode_frame(random_frame(rng, 1), os.urandom(32)))  # tagged under another key
    wait_for(lambda: rejected(exporter, "missing_tag") == 64 and rejected(exporter, "bad_tag") == 1)
    exporter.send_frames([encode_frame(random_frame(rng, 2), key)])
    page = exporter.metrics_text()
    assert "forged-" not in page
    assert exporter.value("layerwatch_exporter_frames_received_total", model_name="demo") == 2
    assert exporter.value("layerwatch_exporter_frames_malformed_total") == 0


def test_a_frame_key_file_others_can_read_stops_the_exporter_naming_it(tmp_path: Path) -> None:
    key_file = tmp_path / "frame.key"
    key_file.write_text("k" * 64)
    key_file.chmod(0o644)
    result = subprocess.run(
        [sys.executable, "-m", "layerwatch.cli.main", "exporter", "--frame-key-file", str(key_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"frame key file {key_file}: group or others may access it (mode 0644)" in result.stderr
    assert "Traceback" not in result.stderr


def test_two_forged_datagrams_cannot_blind_the_loss_counter(start_exporter) -> None:
    # A made-up shim id sends 0, then 2**64 - 1, for the real model: unbounded, 1.84e19 "lost", and the
    # one frame really lost afterwards invisible in float64.
    exporter = start_exporter()
    rng = np.random.default_rng(0)
    exporter.send_frames([encode_frame(random_frame(rng, n, shim="real")) for n in range(5)])
    exporter.send_frames([encode_frame(random_frame(rng, 0, shim="made-up"))])
    exporter.send(encode_frame(random_frame(rng, 2**64 - 1, shim="made-up")))
    wait_for(lambda: rejected(exporter, "sequence_jump") == 1)
    exporter.send_frames([encode_frame(random_frame(rng, n, shim="real")) for n in (6, 7)])  # 5 lost in transit
    assert exporter.value("layerwatch_exporter_frames_lost_total", model_name="demo") == 1
    assert exporter.value("layerwatch_exporter_frames_received_total", model_name="demo") == 8


def test_with_a_frame_key_replayed_frames_are_counted_once(start_exporter, tmp_path: Path) -> None:
    key = os.urandom(32).hex().encode()
    key_file = tmp_path / "frame.key"
    key_file.write_bytes(key)
    key_file.chmod(0o600)
    exporter = start_exporter("--frame-key-file", str(key_file))
    rng = np.random.default_rng(0)
    captured = [encode_frame(random_frame(rng, n), key) for n in range(10)]
    exporter.send_frames(captured)
    for _ in range(99):  # ten captured frames sent 100 times must count once each
        for datagram in captured:
            exporter.send(datagram)
        time.sleep(0.001)
    wait_for(lambda: rejected(exporter, "replayed") == 990)
    assert exporter.value("layerwatch_exporter_frames_received_total", model_name="demo") == 10
    assert exporter.value("layerwatch_exporter_frames_lost_total", model_name="demo") == 0


def test_scrapes_are_answered_while_slow_readers_hold_the_page(start_exporter) -> None:
    """In the state forged frames can fill (every model slot, wide frames),
    each GET rendered the page on its own: 60 clients that ask for /metrics and never read queued 60
    renders ahead of the real scrape (none answered within Prometheus' 10 s timeout). Now concurrent
    scrapes share the render in flight. (What the slow readers cost in memory is measured by
    benchmarks/frame_flood.py --slow-readers: docs/reliability.md, "Forged frames".)"""
    exporter = start_exporter()
    for datagram in forged_flood(64, 256):  # every slot, the widest frames --max-layers admits
        exporter.send(datagram)
        time.sleep(0.002)
    wait_for(lambda: exporter.received_frames() == 64)
    # The state the attack needs: a page that takes about a second to render.
    assert len(exporter.get("/metrics")[1].encode()) > 5_000_000
    readers = [slow_reader(exporter, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n") for _ in range(60)]
    try:
        with urllib.request.urlopen(exporter.url + "/metrics", timeout=PROMETHEUS_SCRAPE_TIMEOUT) as response:
            assert response.status == 200 and len(response.read()) > 5_000_000
    finally:
        for reader in readers:
            reader.close()


PROMETHEUS_SCRAPE_TIMEOUT = 10.0  # Prometheus' default scrape_timeout


def slow_reader(exporter: RunningExporter, request: bytes) -> socket.socket:
    """A connection that sends `request` and never reads, its receive buffer the smallest the kernel allows."""
    connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    connection.connect(("127.0.0.1", int(exporter.url.rsplit(":", 1)[1])))
    connection.sendall(request)
    return connection
