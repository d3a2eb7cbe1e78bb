"""layerwatch.client.GateFrameSender as another engine uses it: on a real loopback socket, with bad
arguments (refused at construction), bad arrays (counted and logged, never raised) and several
threads sending at once. The shim's own use of it is tested in tests/service/test_frames.py."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import numpy as np
import pytest

import layerwatch.client
from layerwatch.client import DROP_LOG_INTERVAL_SECONDS, GateFrameSender
from layerwatch.wire import decode_frame

LAYERS = 6


class Receiver:
    """A loopback UDP socket standing in for the exporter, drained by a thread."""

    def __init__(self) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.settimeout(0.5)
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        self.datagrams: list[bytes] = []
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._stop = threading.Event()
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                self.datagrams.append(self.socket.recv(65536))
            except TimeoutError:
                continue

    def wait(self, count: int) -> list[bytes]:
        """The datagrams received, once there are `count` of them or after a few seconds."""
        deadline = time.monotonic() + 5
        while len(self.datagrams) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return list(self.datagrams)

    def frames(self, count: int) -> list:
        return [decode_frame(d) for d in self.wait(count)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def batch(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    scores = rng.random((rows, LAYERS), dtype=np.float32)
    return scores, scores < 0.3


class ArrayLike:
    """What an engine's own tensor type offers numpy: `__array__`, nothing else."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __array__(self, dtype=None, copy=None):
        return self._array if dtype is None else self._array.astype(dtype)


class DeviceTensor:
    """A tensor numpy cannot read from the host, as a CUDA tensor refuses `__array__`."""

    def __array__(self, dtype=None, copy=None):
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


class RaisingEquality:
    """An element whose comparison raises: what an object array's np.isin calls."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("not comparable")

    __hash__ = object.__hash__


def test_a_batch_arrives_as_the_frames_the_exporter_decodes(receiver):
    scores, skipped = batch(3)
    with GateFrameSender(receiver.address, "my-engine", LAYERS, 0.5) as sender:
        sender.send(ArrayLike(scores), ArrayLike(skipped.astype(np.int8)))
        sender.send(scores[:0], skipped[:0])  # no rows: nothing to send, nothing dropped
    (frame,) = receiver.frames(1)
    assert (frame.model_name, frame.sequence, frame.threshold) == ("my-engine", 0, 0.5)
    assert re.fullmatch(rf"{re.escape(socket.gethostname())}-\d+-[0-9a-f]{{8}}", frame.shim_id)
    np.testing.assert_array_equal(frame.entropies, scores)
    np.testing.assert_array_equal(frame.skipped, skipped)
    assert sender.sent == 1 and sum(sender.dropped.values()) == 0
    sender.send(scores, skipped)  # after close: a counted send error, not an exception
    assert sender.dropped["send_error"] == 1


def test_a_steps_fallbacks_travel_once_in_its_first_frame(receiver):
    with GateFrameSender(receiver.address, "my-engine", LAYERS, 0.5) as sender:
        sender.rows_per_frame = 2  # a step of 5 rows in 3 frames
        sender.send(*batch(5), fallbacks=3)
        sender.send(*batch(1), fallbacks=0)
    assert [(f.sequence, f.entropies.shape[0], f.fallbacks) for f in receiver.frames(4)] == [
        (0, 2, 3),
        (1, 2, 0),
        (2, 1, 0),
        (3, 1, 0),
    ]


def test_a_pipeline_stage_sends_partial_frames_that_say_where_its_layers_sit(receiver):
    scores, skipped = batch(2)
    with GateFrameSender(receiver.address, "my-engine", LAYERS, 0.5, first_layer=10, model_layers=16) as sender:
        sender.send(scores, skipped)
    (frame,) = receiver.frames(1)
    assert (frame.partial, frame.first_layer, frame.total_layers) == (True, 10, 16)
    np.testing.assert_array_equal(frame.entropies, scores)
    for first_layer, model_layers, message in ((11, 16, "layers 11..16 are not inside 16"), (1, None, "needs model")):
        with pytest.raises(ValueError, match=message):
            GateFrameSender(receiver.address, "m", LAYERS, 0.5, first_layer=first_layer, model_layers=model_layers)


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (("127.0.0.1:9410", "", LAYERS, 0.5), ValueError, "model name must be 1..255"),
        (("127.0.0.1:9410", "m" * 256, LAYERS, 0.5), ValueError, "model name must be 1..255"),
        (("127.0.0.1:9410", b"m", LAYERS, 0.5), TypeError, "model name must be a str"),
        (("127.0.0.1:9410", "m", 0, 0.5), ValueError, "num_layers must be an integer >= 1"),
        (("127.0.0.1:9410", "m", True, 0.5), ValueError, "num_layers must be an integer >= 1"),
        (("127.0.0.1:9410", "m", 6.0, 0.5), ValueError, "num_layers must be an integer >= 1"),
        (("127.0.0.1:9410", "m", 20_000, 0.5), ValueError, "do not fit one row"),
        (("127.0.0.1:9410", "m", LAYERS, 1.5), ValueError, "threshold must be a number in"),
        (("127.0.0.1:9410", "m", LAYERS, float("nan")), ValueError, "threshold must be a number in"),
        (("127.0.0.1:9410", "m", LAYERS, "0.5"), ValueError, "threshold must be a number in"),
        (("127.0.0.1", "m", LAYERS, 0.5), ValueError, "exporter address '127.0.0.1' is not HOST:PORT"),
        (("127.0.0.1:0", "m", LAYERS, 0.5), ValueError, "port 0 can only be listened on"),
        # Unguarded, socket.gaierror (an OSError) from the lookup. .invalid never resolves (RFC 6761).
        (("example.invalid:9", "m", LAYERS, 0.5), ValueError, "exporter address 'example.invalid:9': cannot resolve"),
        # Unguarded, connect's OSError escapes (EACCES for broadcast, EINVAL without a zone).
        (("255.255.255.255:9", "m", LAYERS, 0.5), ValueError, "'255.255.255.255:9': cannot send to '255.255.255.255'"),
        (("[fe80::1]:9", "m", LAYERS, 0.5), ValueError, r"exporter address '\[fe80::1\]:9': cannot send to 'fe80::1'"),
    ],
)
def test_a_bad_argument_raises_at_construction(arguments, error, message):
    with pytest.raises(error, match=message):
        GateFrameSender(*arguments)


@pytest.mark.parametrize("key", ["k" * 32, b"k" * 31])
def test_a_frame_key_must_be_bytes_of_a_real_key_length(key):
    with pytest.raises(ValueError, match="frame key must be bytes, at least 32"):
        GateFrameSender("127.0.0.1:9410", "m", LAYERS, 0.5, key=key)


def test_a_shim_id_names_the_sequence_space_and_a_key_tags_every_frame(receiver):
    key = b"k" * 32
    with GateFrameSender(receiver.address, "m", LAYERS, 0.5, shim_id="engine-a", key=key) as sender:
        sender.send(*batch(2))
    (datagram,) = receiver.wait(1)
    assert decode_frame(datagram, key).shim_id == "engine-a"


@pytest.mark.parametrize(
    "scores, skipped, why",
    [
        (np.full((2, LAYERS), 0.5), np.zeros((2, LAYERS + 1), bool), "skipped has shape"),
        (np.full((2, LAYERS - 1), 0.5), np.zeros((2, LAYERS - 1), bool), f"scores must be \\[rows, {LAYERS}\\]"),
        (np.full(LAYERS, 0.5), np.zeros(LAYERS, bool), "scores must be"),
        ([["a"] * LAYERS], [[0] * LAYERS], "could not convert"),
        (DeviceTensor(), DeviceTensor(), "can't convert cuda:0"),
        (np.full((2, LAYERS), np.nan), np.zeros((2, LAYERS), bool), "NaN"),
        (np.full((2, LAYERS), 1.5), np.zeros((2, LAYERS), bool), "outside \\[0, 1\\]"),
        (np.full((2, LAYERS), 0.5), np.full((2, LAYERS), 2), "only 0/1"),
        # Unguarded, float32 keeps the real part (a ComplexWarning) and the frame is sent.
        (np.full((2, LAYERS), 0.5 + 0.5j), np.zeros((2, LAYERS), bool), "scores must be real numbers, got complex"),
        # Unguarded, np.isin's TypeError, and the elements' own __eq__, escape send.
        (np.full((1, LAYERS), 0.5), np.zeros((1, LAYERS), [("bit", "i1")]), "booleans or 0/1 numbers, got dtype"),
        (np.full((1, LAYERS), 0.5), np.zeros((1, LAYERS), "V1"), "booleans or 0/1 numbers, got dtype"),
        (np.full((1, LAYERS), 0.5), np.full((1, LAYERS), RaisingEquality()), "booleans or 0/1 numbers, got dtype"),
    ],
    ids=[
        "shapes-differ",
        "layer-count",
        "one-dimensional",
        "strings",
        "device-tensor",
        "nan",
        "above-1",
        "bits",
        "complex",
        "structured",
        "void",
        "object-raising-eq",
    ],
)
def test_a_bad_array_is_a_counted_drop_and_a_log_line_not_an_exception(receiver, caplog, scores, skipped, why):
    sender = GateFrameSender(receiver.address, "m", LAYERS, 0.5)
    with caplog.at_level(logging.WARNING, logger="layerwatch.client"):
        sender.send(scores, skipped)
    sender.send(*batch(1))  # the bad batch took no sequence number
    sender.close()
    assert sender.dropped == {"send_error": 0, "too_large": 0, "invalid": 1}
    assert [f.sequence for f in receiver.frames(1)] == [0]
    (line,) = caplog.messages
    assert "gate frames of model 'm' not sent (invalid)" in line and re.search(why, line), line


def test_drop_lines_are_rate_limited_and_say_how_many_they_stand_for(receiver, caplog, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(layerwatch.client.time, "monotonic", lambda: clock[0])
    sender = GateFrameSender(receiver.address, "m", LAYERS, 0.5)
    nan = np.full((1, LAYERS), np.nan)
    with caplog.at_level(logging.WARNING, logger="layerwatch.client"):
        for _ in range(50):  # a broken model: every step
            sender.send(nan, np.zeros_like(nan, dtype=bool))
        clock[0] += DROP_LOG_INTERVAL_SECONDS
        sender.send(nan, np.zeros_like(nan, dtype=bool))
    sender.close()
    assert sender.dropped["invalid"] == 51
    assert [re.search(r"(\d+) frame\(s\) dropped", m)[1] for m in caplog.messages] == ["1", "50"]


def test_concurrent_senders_share_one_numbering_without_gaps_or_repeats(receiver):
    threads, sends = 8, 60
    sender = GateFrameSender(receiver.address, "m", LAYERS, 0.5)
    start = threading.Barrier(threads)

    def decode_loop(seed: int) -> None:
        scores, skipped = batch(2, seed)
        start.wait()
        for _ in range(sends):
            sender.send(scores, skipped)

    workers = [threading.Thread(target=decode_loop, args=(seed,)) for seed in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    frames = receiver.frames(threads * sends)
    sender.close()
    assert sender.sent + sum(sender.dropped.values()) == threads * sends
    assert sender.sequence == sender.sent
    numbers = [f.sequence for f in frames]
    assert len(set(numbers)) == len(numbers), "a sequence number was used twice"
    assert set(numbers) <= set(range(sender.sent))
    assert len(numbers) == sender.sent  # loopback with a 4 MiB buffer drained by a thread loses none
