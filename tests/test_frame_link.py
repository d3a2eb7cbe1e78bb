"""The telemetry drill's link between the engine and the exporter (layerwatch/demo/frame_link.py): on real
UDP sockets on loopback, it forwards every datagram byte for byte until told to lose every n-th, and then
loses exactly those."""

from __future__ import annotations

import socket

import pytest

from layerwatch.demo.frame_link import FrameLink
from layerwatch.wire import parse_address


@pytest.fixture
def exporter():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5)
    yield sock
    sock.close()


def _send_through(link: FrameLink, frames: list[bytes]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as engine:
        engine.connect(parse_address(link.address))
        for frame in frames:
            engine.send(frame)


def _received(exporter: socket.socket, count: int) -> list[bytes]:
    return [exporter.recv(70_000) for _ in range(count)]


def test_the_link_forwards_every_frame_until_it_loses_every_nth(exporter):
    link = FrameLink(f"127.0.0.1:{exporter.getsockname()[1]}")
    try:
        healthy = [b"frame %d " % i * 50 for i in range(10)]
        _send_through(link, healthy)
        assert _received(exporter, 10) == healthy  # byte for byte, in order

        link.lose_every(5)
        lossy = [b"frame %d" % i for i in range(1, 21)]
        _send_through(link, lossy)
        assert _received(exporter, 16) == [f for i, f in enumerate(lossy, 1) if i % 5]
        exporter.settimeout(0.5)
        with pytest.raises(TimeoutError):  # nothing else came
            exporter.recv(70_000)
        assert (link.forwarded, link.lost) == (26, 4)
    finally:
        link.close()


@pytest.mark.parametrize("every", [-1, 1])
def test_a_loss_that_is_not_one_frame_in_n_is_refused(exporter, every):
    link = FrameLink(f"127.0.0.1:{exporter.getsockname()[1]}")
    try:
        with pytest.raises(ValueError, match="0 \\(nothing\\) or n >= 2"):
            link.lose_every(every)
    finally:
        link.close()
