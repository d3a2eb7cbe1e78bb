"""Helpers for the exporter tests: a running exporter process, frames from traces, the pixels of a plot."""

from __future__ import annotations

import signal
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from layerwatch.exporter.replay_plot import HeatMapBox
from layerwatch.trace import read_trace_batches
from layerwatch.wire import GateFrame, encode_frame
from tests.support import Sample, page_samples, wait_for

DATA = Path(__file__).with_name("data")
GOLDEN_TRACE = DATA / "golden-trace.jsonl"


class RunningExporter:
    """A `layerwatch exporter` subprocess on ephemeral loopback ports."""

    def __init__(self, process: subprocess.Popen, udp_port: int, http_port: int) -> None:
        self.process = process
        self.frames_address = ("127.0.0.1", udp_port)
        self.url = f"http://127.0.0.1:{http_port}"
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def send(self, datagram: bytes) -> None:
        self._socket.sendto(datagram, self.frames_address)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status, response.read().decode("utf-8")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8")

    def metrics_text(self) -> str:
        status, body = self.get("/metrics")
        assert status == 200
        return body

    def samples(self) -> dict[Sample, float]:
        """{(sample name, sorted labels): value} of the current /metrics page."""
        return page_samples(self.metrics_text())

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples().get((name, tuple(sorted(labels.items()))))

    def received_frames(self) -> float:
        samples = self.samples()
        return sum(v for (name, _), v in samples.items() if name == "layerwatch_exporter_frames_received_total")

    def send_frames(self, frames: list[bytes], burst: int = 16) -> None:
        """Send in bursts, waiting for each to be counted, so the kernel buffer never overflows."""
        start = self.received_frames()
        for offset in range(0, len(frames), burst):
            for frame in frames[offset : offset + burst]:
                self.send(frame)

            def all_counted(expected: float = start + min(offset + burst, len(frames))) -> bool:
                return self.received_frames() >= expected

            wait_for(all_counted)

    def stop(self) -> int:
        self._socket.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=10)


def trace_frames(
    path: Path, rows_per_frame: int = 8, shim_id: str = "golden-shim", threshold: float | None = None
) -> list[bytes]:
    """The trace as the shim would send it: consecutive rows of one model batched into frames.

    Frames carry `threshold`, else the trace's own (wire version 2); neither: version 1.
    """
    frames: list[bytes] = []
    for batch in read_trace_batches(path, max_rows=rows_per_frame):
        tau = batch.threshold if threshold is None else threshold
        frames.append(
            encode_frame(GateFrame(batch.model_name, shim_id, len(frames), batch.entropies, batch.skipped, tau))
        )
    return frames


def random_frame(
    rng: np.random.Generator, sequence: int, model: str = "demo", shim: str = "shim-a", rows: int = 4, layers: int = 6
) -> GateFrame:
    entropies = rng.random((rows, layers), dtype=np.float32)
    return GateFrame(model, shim, sequence, entropies, entropies < 0.18)


def forged_flood(models: int, layers: int) -> list[bytes]:
    """The forged-frame flood: well-formed, untagged frames of one row, each naming a new model."""
    rng = np.random.default_rng(0)
    return [
        encode_frame(random_frame(rng, index, model=f"forged-{index}", shim="forger", rows=1, layers=layers))
        for index in range(models)
    ]


def heat_map_row_colours(png: Path, box: HeatMapBox) -> list[int]:
    """How many distinct colours each layer's row of a `replay --plot` heat map has in the written
    image: 1 for a layer whose score never changes. Read a quarter of a row's height from its top,
    clear of the dots that mark skipped cells at the cells' centres, and 2 pixels inside the frame."""
    from matplotlib.image import imread

    pixels = imread(png)
    row_height = (box.bottom - box.top) / box.layers
    left, right = int(np.ceil(box.left)) + 2, int(box.right) - 2
    return [
        len({tuple(p) for p in pixels[int(box.top + (layer + 0.25) * row_height), left:right]})
        for layer in range(box.layers)
    ]
