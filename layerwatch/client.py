"""Send gate frames to a layerwatch exporter from any engine: the sender `layerwatch serve` uses.

An engine that scores its layers (a router, a gate, an exit head) calls `GateFrameSender.send` once
per decode step with that step's scores and skip decisions, `[rows, layers]` each: one row per
sequence of the batch that decoded a token. The sender turns them into gate frames
(layerwatch/wire.py, docs/wire-format.md) and sends them over UDP without ever waiting, so the
exporter's histograms, verdicts and the generated alert rules see the engine as they see a served
model. Needs numpy only: no torch, no model code.

The public names are `GateFrameSender`, `DROP_REASONS`, `default_shim_id` and `load_frame_key`;
what is stable about them is in docs/interfaces.md ("Python API"). Instrumenting an engine, and what
the exporter needs from it: docs/instrument.md.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from typing import Self

import numpy as np
import numpy.typing as npt

from layerwatch.secret_file import MIN_SECRET_BYTES
from layerwatch.skip_policy import is_threshold
from layerwatch.wire import (
    MAX_FRAME_BYTES,
    MAX_NAME_BYTES,
    FrameTooLarge,
    GateFrame,
    encode_frame,
    frame_bytes,
    load_frame_key,
    parse_address,
    unprintable,
)

__all__ = ["DROP_REASONS", "GateFrameSender", "default_shim_id", "load_frame_key"]

log = logging.getLogger(__name__)

# Why a frame was not sent: the socket refused it (no exporter listening, buffer full, closed), it
# would not fit a datagram, or its arrays are not gate scores and skip bits. The label values of
# layerwatch_telemetry_frames_dropped_total{reason}.
DROP_REASONS = ("send_error", "too_large", "invalid")
# A caller's bad arrays are logged at most once per this many seconds (and per reason), with the
# number of drops since the last line: a broken model sends a bad batch every step.
DROP_LOG_INTERVAL_SECONDS = 60.0


def default_shim_id() -> str:
    """hostname-pid-random: unique per process start. Hostname and pid alone repeat: every container's
    shim is PID 1, and on host networking the containers share the hostname; two senders under one id
    interleave their sequence numbers at the exporter (docs/wire-format.md)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class GateFrameSender:
    """Sends a batch's gate scores and skip decisions as gate frames over UDP, without ever waiting.

    `address` is the exporter's `--listen` (HOST:PORT, IPv6 as `[::1]:PORT`); `model_name` is the
    `model_name` label of every series the exporter keeps for these frames and the name the
    model's profile (layerwatch/alerts/profiles/) is written for; `num_layers` the number of scores per row;
    `threshold` the skip threshold τ in [0, 1] the engine compares scores with (a score below it
    counts toward skipping the layer: the exporter's routing statistics need it). `shim_id` names
    this sender's sequence space (default: `default_shim_id()`, new per process); `key`, the frame
    key (`load_frame_key(path)`, at least 32 bytes), tags every frame so that an exporter holding
    the same key can tell it from a forged one. An engine that runs some of the model's layers (a
    pipeline stage) sends their scores as partial frames: `first_layer`, the model layer of its first
    column, and `model_layers`, the whole model's count; the exporter folds the parts into one model.
    A bad argument raises ValueError or TypeError here, never later.

    `send` never raises and never blocks: the socket is non-blocking and connected, so a missing
    exporter shows up as `dropped["send_error"]` (ICMP port unreachable, reported on the next send);
    arrays that are not gate scores count in `dropped["invalid"]`, with a WARNING at most once per
    DROP_LOG_INTERVAL_SECONDS. A batch larger than one datagram holds is split over several frames
    (`rows_per_frame` rows each). Only frames that left take a sequence number, so the exporter's
    sequence gaps are the frames lost in transit and no frame is counted as both dropped and lost.

    Thread-safe: frames are numbered and sent under one lock, so concurrent `send` calls (one per
    decode loop, say) each get their own numbers and the counters add up. `sent`, `dropped` and
    `sequence` may be read at any time.
    """

    def __init__(
        self,
        address: str,
        model_name: str,
        num_layers: int,
        threshold: float,
        *,
        shim_id: str | None = None,
        key: bytes | None = None,
        first_layer: int = 0,
        model_layers: int | None = None,
    ) -> None:
        shim_id = default_shim_id() if shim_id is None else shim_id
        for field, value in (("model name", model_name), ("shim id", shim_id)):
            if not isinstance(value, str):
                raise TypeError(f"the {field} must be a str, got {type(value).__name__}")
            if not 0 < len(value.encode("utf-8")) <= MAX_NAME_BYTES:
                raise ValueError(f"the {field} must be 1..{MAX_NAME_BYTES} UTF-8 bytes to fit a gate frame")
            if (character := unprintable(value)) is not None:
                raise ValueError(f"the {field} holds {character}, which is not printable (the exporter refuses it)")
        if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) or num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        if model_layers is not None and not 0 <= first_layer < first_layer + num_layers <= model_layers <= 0xFFFF:
            raise ValueError(f"layers {first_layer}..{first_layer + num_layers - 1} are not inside {model_layers}")
        if model_layers is None and first_layer != 0:
            raise ValueError(f"first_layer {first_layer} needs model_layers, the whole model's layer count")
        if not is_threshold(threshold):
            raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
        if key is not None and (not isinstance(key, bytes) or len(key) < MIN_SECRET_BYTES):
            raise ValueError(f"the frame key must be bytes, at least {MIN_SECRET_BYTES} of them (load_frame_key)")
        tagged = key is not None
        partial = model_layers is not None and (first_layer, num_layers) != (0, model_layers)
        # Room for a fallback count in every frame: the first of a step's frames may carry one.
        overhead = frame_bytes(0, num_layers, model_name, shim_id, threshold, tagged, partial, fallbacks=True)
        per_row = frame_bytes(1, num_layers, model_name, shim_id, threshold, tagged, partial, fallbacks=True) - overhead
        if num_layers > 0xFFFF or overhead + per_row > MAX_FRAME_BYTES:
            raise ValueError(f"{num_layers} layers do not fit one row into a gate frame of {MAX_FRAME_BYTES} bytes")
        try:
            host, port = parse_address(address)  # a destination: port 0 is refused
        except ValueError as exc:
            raise ValueError(f"exporter address {exc}") from None
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        except socket.gaierror as exc:  # an OSError: a bad argument here, as the docstring says
            raise ValueError(f"exporter address {address!r}: cannot resolve {host!r} ({exc.strerror})") from None
        self._socket = socket.socket(family, kind, proto)
        self._socket.setblocking(False)
        try:
            self._socket.connect(sockaddr)
        except OSError as exc:  # a broadcast address (EACCES), a link-local one without its zone (EINVAL)
            self._socket.close()
            raise ValueError(f"exporter address {address!r}: cannot send to {host!r} ({exc.strerror})") from None
        self.model_name = model_name
        self.shim_id = shim_id
        self.num_layers = int(num_layers)
        self.first_layer = int(first_layer)
        self.model_layers = None if model_layers is None else int(model_layers)
        self.threshold = float(threshold)
        self.key = key
        self.rows_per_frame = (MAX_FRAME_BYTES - overhead) // per_row
        self.sequence = 0  # the next frame's number: frames sent so far
        self.sent = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._lock = threading.Lock()
        self._drop_log = _DropLog(model_name)

    def send(self, scores: npt.ArrayLike, skipped: npt.ArrayLike, fallbacks: int = 0) -> None:
        """One decode step: `scores` float [rows, num_layers] in [0, 1], `skipped` bool or 0/1 of the
        same shape (True: the layer did not run for that row's token), numpy arrays or anything
        with `__array__` on the host; `fallbacks`, the fallback episodes the engine's breaker started
        at this step (the first of the step's frames carries them). No rows: nothing to send. Never raises."""
        try:
            scores, skipped = self._batch(scores, skipped)
        except Exception as exc:  # whatever the caller's object raises on conversion counts as invalid
            with self._lock:
                self._drop("invalid", str(exc))
            return
        with self._lock:
            for start in range(0, scores.shape[0], self.rows_per_frame):
                rows = slice(start, start + self.rows_per_frame)
                self._send_frame(scores[rows], skipped[rows], fallbacks if start == 0 else 0)

    def close(self) -> None:
        """Close the socket; later sends count as send errors."""
        self._socket.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _batch(self, scores: npt.ArrayLike, skipped: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """The two arrays, their shapes checked; their values are checked per frame by encode_frame."""
        scores = np.asarray(scores)
        if scores.dtype.kind == "c":  # float32 would keep the real part only, with a ComplexWarning
            raise TypeError(f"scores must be real numbers, got {scores.dtype}")
        scores = scores.astype(np.float32, copy=False)
        skipped = np.asarray(skipped)
        if scores.ndim != 2 or scores.shape[1] != self.num_layers:
            raise ValueError(f"scores must be [rows, {self.num_layers}], got shape {scores.shape}")
        if skipped.shape != scores.shape:
            raise ValueError(f"skipped has shape {skipped.shape}, scores {scores.shape}")
        return scores, skipped

    def _send_frame(self, scores: np.ndarray, skipped: np.ndarray, fallbacks: int) -> None:
        try:
            frame = GateFrame(
                self.model_name,
                self.shim_id,
                self.sequence,
                scores,
                skipped,
                self.threshold,
                self.first_layer,
                self.model_layers,
                fallbacks,
            )
            data = encode_frame(frame, self.key)
        except FrameTooLarge as exc:  # rows_per_frame keeps every frame within the limit
            self._drop("too_large", str(exc))
            return
        except (ValueError, TypeError) as exc:  # NaN or out-of-range scores, skip bits not 0/1, a bad count
            self._drop("invalid", str(exc))
            return
        try:
            self._socket.send(data)
        except OSError:  # ConnectionRefused (no exporter), BlockingIOError (buffer full), a closed socket
            self.dropped["send_error"] += 1
            return
        self.sequence += 1
        self.sent += 1

    def _drop(self, reason: str, why: str) -> None:
        self.dropped[reason] += 1
        self._drop_log.note(reason, why)


class _DropLog:
    """At most one WARNING per reason per DROP_LOG_INTERVAL_SECONDS, saying how many drops it covers."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self._last: dict[str, float] = {}
        self._unlogged = dict.fromkeys(DROP_REASONS, 0)

    def note(self, reason: str, why: str) -> None:
        now = time.monotonic()
        self._unlogged[reason] += 1
        if now - self._last.get(reason, -math.inf) < DROP_LOG_INTERVAL_SECONDS:
            return
        count, self._unlogged[reason] = self._unlogged[reason], 0
        self._last[reason] = now
        log.warning(
            "gate frames of model %r not sent (%s): %s; %d frame(s) dropped for this reason since the last such "
            "line (GateFrameSender.dropped, layerwatch_telemetry_frames_dropped_total{reason=%r})",
            self._model_name,
            reason,
            why,
            count,
            reason,
        )
