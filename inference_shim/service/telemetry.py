"""What the decode loop emits per step: metric counts, a gate frame to the exporter, trace lines.

`StepTelemetry` is the engine's step hook. It runs in the engine thread between two decode steps,
so it does only a few microseconds of work: it queues the step's masks for the metric totals,
encodes one frame and does one non-blocking send. It never blocks and never raises into the
decode loop (a failed send is a counter, not an exception).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Iterator

import numpy as np
from prometheus_client.core import Metric

from inference_shim.service.metrics import DecodeStats, ShimCollector, family
from layerwatch.trace import DROP_REASONS as TRACE_DROP_REASONS
from layerwatch.trace import TraceWriter
from layerwatch.wire import (
    MAX_FRAME_BYTES,
    MAX_NAME_BYTES,
    FrameTooLarge,
    GateFrame,
    encode_frame,
    frame_bytes,
    parse_address,
)

log = logging.getLogger(__name__)

DROP_REASONS = ("send_error", "too_large", "invalid")


def default_shim_id() -> str:
    """hostname-pid-random: unique per process start. Hostname and pid alone repeat: every container's
    shim is PID 1, and on host networking the containers share the hostname; two shims under one id
    interleave their sequence numbers at the exporter (docs/wire-format.md)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class FrameSender:
    """Sends one gate frame per decode step over UDP, without ever waiting.

    Encoding and the send happen in the engine thread, right in the step hook: a sender thread
    cost more in hand-offs than it saved on the 2-core benchmark machine (docs/performance.md,
    "Service"). The socket is non-blocking and connected, so a missing exporter shows up as send
    errors (ICMP port unreachable, reported on the next send) in
    `layerwatch_telemetry_frames_dropped_total` rather than anywhere else. Only frames that left
    take a sequence number, so the exporter's sequence gaps are the frames lost in transit and no
    frame is counted on both sides (LayerwatchTelemetryLoss fires on either). Every
    frame carries the skip policy's `threshold` (wire version 2), which the exporter's routing
    statistics need to tell below-threshold scores from the rest. With a frame `key`, every frame
    is tagged with it (an HMAC, docs/wire-format.md), so an exporter holding the key can tell it
    from a forged one.
    """

    def __init__(
        self,
        address: str,
        model_name: str,
        shim_id: str,
        num_layers: int,
        *,
        threshold: float,
        key: bytes | None = None,
    ) -> None:
        for field, value in (("model name", model_name), ("shim id", shim_id)):
            if not 0 < len(value.encode("utf-8")) <= MAX_NAME_BYTES:
                raise ValueError(f"the {field} must be 1..{MAX_NAME_BYTES} UTF-8 bytes to fit a gate frame")
        try:
            host, port = parse_address(address)  # a destination: port 0 is refused
        except ValueError as exc:
            raise ValueError(f"exporter address {exc}") from None
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        self._socket = socket.socket(family, kind, proto)
        self._socket.setblocking(False)
        self._socket.connect(sockaddr)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.model_name = model_name
        self.shim_id = shim_id
        self.threshold = threshold
        self.key = key
        self.sequence = 0
        self.sent = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        # A batch whose frame would exceed the datagram limit goes out in several frames.
        tagged = key is not None
        overhead = frame_bytes(0, num_layers, model_name, shim_id, threshold, tagged)
        per_row = frame_bytes(1, num_layers, model_name, shim_id, threshold, tagged) - overhead
        self.rows_per_frame = max(1, (MAX_FRAME_BYTES - overhead) // per_row)

    def send(self, entropies: np.ndarray, skipped: np.ndarray) -> None:
        for start in range(0, entropies.shape[0], self.rows_per_frame):
            rows = slice(start, start + self.rows_per_frame)
            self._send_frame(entropies[rows], skipped[rows])

    def close(self) -> None:
        self._socket.close()

    def _send_frame(self, entropies: np.ndarray, skipped: np.ndarray) -> None:
        try:
            frame = GateFrame(self.model_name, self.shim_id, self.sequence, entropies, skipped, self.threshold)
            data = encode_frame(frame, self.key)
        except FrameTooLarge:
            self.dropped["too_large"] += 1
            return
        except ValueError:  # NaN or out-of-range entropies: a broken model, visible in this counter
            self.dropped["invalid"] += 1
            return
        try:
            self._socket.send(data)
        except OSError:  # ConnectionRefused (no exporter), BlockingIOError (buffer full), ...
            self.dropped["send_error"] += 1
            return
        self.sequence += 1
        self.sent += 1


class FrameSenderCollector(ShimCollector):
    """layerwatch_telemetry_frames_sent_total / _dropped_total; zero when no exporter is configured."""

    metric_names = ("layerwatch_telemetry_frames_sent_total", "layerwatch_telemetry_frames_dropped_total")

    def __init__(self, sender: FrameSender | None, model_name: str) -> None:
        self._sender = sender
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        sent, dropped = map(family, self.metric_names)
        sent.add_metric([self._model_name], self._sender.sent if self._sender else 0)
        yield sent
        for reason in DROP_REASONS:
            dropped.add_metric([self._model_name, reason], self._sender.dropped[reason] if self._sender else 0)
        yield dropped


class TraceCollector(ShimCollector):
    """layerwatch_trace_lines_written_total / _dropped_total; zero when no trace file is written."""

    metric_names = ("layerwatch_trace_lines_written_total", "layerwatch_trace_lines_dropped_total")

    def __init__(self, trace: TraceWriter | None, model_name: str) -> None:
        self._trace = trace
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        written, dropped = map(family, self.metric_names)
        written.add_metric([self._model_name], self._trace.written if self._trace else 0)
        yield written
        for reason in TRACE_DROP_REASONS:
            dropped.add_metric([self._model_name, reason], self._trace.dropped[reason] if self._trace else 0)
        yield dropped


class StepTelemetry:
    """The engine's step hook for served traffic: metrics, frames and trace from one StepRecord.

    Called with the rows that belong to client requests only (the service filters out its own
    readiness probes), so every count here agrees with the `usage` clients receive.
    """

    def __init__(
        self, model_name: str, stats: DecodeStats, sender: FrameSender | None = None, trace: TraceWriter | None = None
    ) -> None:
        self.model_name = model_name
        self.stats = stats
        self.sender = sender
        self.trace = trace

    def __call__(
        self,
        entropies: np.ndarray,
        skipped: np.ndarray,
        executed_skipped: np.ndarray,
        batch_skipped: np.ndarray,
        fallback_started: np.ndarray,
    ) -> None:
        """A step's client rows (StepRecord fields). Frames and trace lines carry `skipped`, the skip
        rule's decisions, which the exporter's routing statistics judge (docs/model.md, "Depth
        execution"); the metrics count what ran too."""
        self.stats.observe(skipped, executed_skipped, batch_skipped, fallback_started)
        if self.sender is not None:
            self.sender.send(entropies, skipped)
        if self.trace is not None:
            self._write_trace(self.trace, entropies, skipped)

    def _write_trace(self, trace: TraceWriter, entropies: np.ndarray, skipped: np.ndarray) -> None:
        try:
            trace.write_rows(self.model_name, entropies, skipped)
        except OSError as exc:  # raised once: the writer stopped for good and counts the lines it drops
            log.error(
                "trace file %s: %s; trace writing stopped, the file ends with the last whole line; "
                'lines not written count in layerwatch_trace_lines_dropped_total{reason="write_error"}',
                trace.path,
                exc,
            )
        except ValueError as exc:  # NaN entropies from a broken model: not representable in the format
            log.warning("trace file %s: step not written: %s", trace.path, exc)
