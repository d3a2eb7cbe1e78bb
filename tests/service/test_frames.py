"""Gate frames on a real UDP socket, the trace file, and a sender with no exporter behind it."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import httpx
import numpy as np
import pytest

from layerwatch.client import GateFrameSender
from layerwatch.demo.processes import LAYERWATCH_COMMAND, free_port
from layerwatch.trace import read_trace
from layerwatch.wire import MAX_FRAME_BYTES, decode_frame
from tests.service.conftest import MODEL_NAME, NUM_LAYERS
from tests.support import sample_sum


def test_frames_decode_to_the_same_entropies_and_masks_as_the_trace(server):
    for i in range(3):
        body = {"model": MODEL_NAME, "prompt": f"the face of the waters {i}", "max_tokens": 10, "temperature": 0}
        assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    server.wait_idle()
    decoded = sample_sum(server.metrics(), "layerwatch_layers_executed_count")
    deadline = time.monotonic() + 10
    while sum(f.entropies.shape[0] for f in server.capture.frames()) < decoded and time.monotonic() < deadline:
        time.sleep(0.05)

    frames = server.capture.frames()
    assert [f.sequence for f in frames] == list(range(len(frames)))  # none lost, none dropped
    assert {(f.model_name, f.shim_id) for f in frames} == {(MODEL_NAME, "test-shim")}
    (info,) = [dict(labels) for name, labels in server.metrics() if name == "layerwatch_model_info"]
    threshold = float(info["threshold"])  # the skip policy's τ (0.18 in the tiny gates)
    assert [f.threshold for f in frames] == [float(np.float32(threshold))] * len(frames)  # wire version 2
    assert sample_sum(server.metrics(), "layerwatch_telemetry_frames_sent_total") == len(frames)
    frame_entropies = np.concatenate([f.entropies for f in frames])
    frame_skipped = np.concatenate([f.skipped for f in frames])

    trace = list(read_trace(server.trace_path))
    assert len(trace) == len(frame_entropies) == decoded  # one row per decoded token, probes excluded
    assert {r.threshold for r in trace} == {threshold}
    assert {r.model_name for r in trace} == {MODEL_NAME}
    np.testing.assert_array_equal(np.stack([r.scores for r in trace]), frame_entropies)
    np.testing.assert_array_equal(np.stack([r.skipped for r in trace]), frame_skipped)
    assert frame_entropies.shape[1] == NUM_LAYERS and frame_skipped.any() and not frame_skipped.all()


def test_a_frame_carries_the_fallbacks_the_breaker_started_at_its_step(in_process):
    exporter = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    exporter.bind(("127.0.0.1", 0))
    exporter.settimeout(5)
    with exporter:
        # Every layer skippable and every score below τ: the breaker trips twice in 30 tokens
        # (tests/service/test_audit.py counts its log lines).
        server = in_process(
            threshold=1.0, protected_layers=(), exporter_address=f"127.0.0.1:{exporter.getsockname()[1]}"
        )
        body = {"model": MODEL_NAME, "prompt": "And God said", "max_tokens": 30, "temperature": 0}
        assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
        sent = sample_sum(server.metrics(), "layerwatch_telemetry_frames_sent_total")
        frames = [decode_frame(exporter.recv(MAX_FRAME_BYTES)) for _ in range(int(sent))]
    fallbacks = sample_sum(server.metrics(), "layerwatch_fallbacks_total")
    assert sum(f.fallbacks for f in frames) == fallbacks == 2
    assert sorted(f.fallbacks for f in frames)[-2:] == [1, 1]  # one sequence: one episode per step at most


def test_a_missing_exporter_only_moves_the_dropped_counter():
    port = free_port(socket.SOCK_DGRAM)  # nobody listens: loopback answers with ICMP port unreachable
    sender = GateFrameSender(f"127.0.0.1:{port}", MODEL_NAME, NUM_LAYERS, 0.18, shim_id="test")
    entropies = np.full((3, NUM_LAYERS), 0.5, dtype=np.float32)
    skipped = np.zeros((3, NUM_LAYERS), dtype=bool)
    for _ in range(20):
        sender.send(entropies, skipped)  # never raises
    sender.close()
    assert sender.sequence == sender.sent  # only frames that left are numbered
    assert sender.dropped["send_error"] > 0
    assert sender.sent + sender.dropped["send_error"] == 20


def test_a_batch_too_large_for_one_datagram_is_split_and_round_trips():
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(5)
    layers = 200
    sender = GateFrameSender(f"127.0.0.1:{receiver.getsockname()[1]}", MODEL_NAME, layers, 0.25, shim_id="test")
    rng = np.random.default_rng(0)
    rows = sender.rows_per_frame + 5
    entropies = rng.random((rows, layers), dtype=np.float32)
    skipped = rng.random((rows, layers)) < 0.3
    sender.send(entropies, skipped)
    frames = [decode_frame(receiver.recv(65536)) for _ in range(2)]
    receiver.close()
    sender.close()
    assert [f.sequence for f in frames] == [0, 1] and {f.threshold for f in frames} == {0.25}
    assert all(len(f.entropies) <= sender.rows_per_frame for f in frames)
    np.testing.assert_array_equal(np.concatenate([f.entropies for f in frames]), entropies)
    np.testing.assert_array_equal(np.concatenate([f.skipped for f in frames]), skipped)
    assert sender.rows_per_frame * layers * 4 < MAX_FRAME_BYTES


def test_invalid_entropies_are_dropped_not_raised():
    port = free_port(socket.SOCK_DGRAM)
    sender = GateFrameSender(f"127.0.0.1:{port}", MODEL_NAME, NUM_LAYERS, 0.18, shim_id="test")
    nan = np.full((2, NUM_LAYERS), np.nan, dtype=np.float32)  # what a model without gates reports
    sender.send(nan, np.zeros((2, NUM_LAYERS), dtype=bool))
    sender.close()
    assert sender.dropped["invalid"] == 1 and sender.sent == 0


def test_with_a_key_every_frame_is_tagged_and_still_fits_a_datagram():
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(5)
    layers, key = 147, b"k" * 32  # 107 rows of 147 layers fill an untagged frame to 14 bytes short
    address = f"127.0.0.1:{receiver.getsockname()[1]}"
    sender = GateFrameSender(address, MODEL_NAME, layers, 0.25, shim_id="test", key=key)
    untagged = GateFrameSender(address, MODEL_NAME, layers, 0.25, shim_id="test")
    assert sender.rows_per_frame < untagged.rows_per_frame  # room for the tag
    entropies = np.full((sender.rows_per_frame, layers), 0.5, dtype=np.float32)
    sender.send(entropies, np.zeros_like(entropies, dtype=bool))
    datagram = receiver.recv(65536)
    receiver.close()
    sender.close()
    untagged.close()
    assert len(datagram) <= MAX_FRAME_BYTES
    assert decode_frame(datagram, key).entropies.shape == entropies.shape


def test_a_key_file_others_can_read_stops_the_shim_from_starting(tiny_checkpoint, tmp_path):
    from layerwatch.inference_shim.service.shim import ServeSettings, ShimService

    key_file = tmp_path / "frame.key"
    key_file.write_text("k" * 64)
    key_file.chmod(0o644)
    settings = ServeSettings(model_dir=tiny_checkpoint.path, frame_key_file=key_file)
    with pytest.raises(ValueError, match=f"frame key file {key_file}: group or others may access it"):
        ShimService.load(settings)


def test_a_bad_key_file_stops_the_shim_before_the_model_is_loaded(tmp_path):
    from layerwatch.inference_shim.service.shim import ServeSettings, ShimService

    key_file = tmp_path / "frame.key"
    key_file.write_text("k" * 64)
    key_file.chmod(0o644)
    no_model = tmp_path / "no-such-checkpoint"  # loading it would fail: the key is refused first
    with pytest.raises(ValueError, match=f"frame key file {key_file}: group or others may access it"):
        ShimService.load(ServeSettings(model_dir=no_model, frame_key_file=key_file))


def test_a_fifo_as_key_file_is_refused_at_once_not_waited_on(tiny_checkpoint, tmp_path):
    fifo = tmp_path / "frame.key"
    os.mkfifo(fifo, 0o600)  # no writer will ever open it
    argv = [*LAYERWATCH_COMMAND, "serve", "--model", str(tiny_checkpoint.path), "--port", str(free_port())]
    try:
        result = subprocess.run(
            [*argv, "--frame-key-file", str(fifo)], capture_output=True, text=True, timeout=60, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("serve waited on the FIFO instead of refusing it")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot start: frame key file {fifo}: not a regular file" in result.stderr


def test_a_dropped_frame_leaves_no_sequence_gap():
    """The shim counts the frames it did not send; the exporter's sequence gaps are then only the frames
    lost in transit, so LayerwatchTelemetryLoss can add the two without counting a frame twice."""
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(5)
    sender = GateFrameSender(f"127.0.0.1:{receiver.getsockname()[1]}", MODEL_NAME, NUM_LAYERS, 0.18, shim_id="test")
    valid = np.full((2, NUM_LAYERS), 0.5, dtype=np.float32)
    skipped = np.zeros((2, NUM_LAYERS), dtype=bool)
    for entropies in (valid, np.full_like(valid, np.nan), valid):
        sender.send(entropies, skipped)
    frames = [decode_frame(receiver.recv(65536)) for _ in range(2)]
    receiver.close()
    sender.close()
    assert sender.dropped["invalid"] == 1 and sender.sent == 2
    assert [f.sequence for f in frames] == [0, 1]
