"""What the decode loop emits per step: metric counts, a gate frame to the exporter, trace lines.

`StepTelemetry` is the engine's step hook. It runs in the engine thread between two decode steps,
so it does only a few microseconds of work: it queues the step's masks for the metric totals,
encodes one frame and does one non-blocking send. It never blocks and never raises into the
decode loop (a failed send is a counter, not an exception).

The frames go through `layerwatch.client.GateFrameSender`, the public sender any other engine uses
too (docs/instrument.md): one implementation of numbering, splitting, tagging and counting.
Encoding and the send happen in the engine thread, right in the step hook: a sender thread cost
more CPU in thread hand-offs than it moved off the decode thread, on 2 CPU cores (decode tokens per
CPU second with the telemetry on and off, `python benchmarks/service_bench.py --repetitions 21
--tokens 48`: docs/performance.md, "Service").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
from prometheus_client.core import Metric

from layerwatch.client import DROP_REASONS, GateFrameSender
from layerwatch.inference_shim.service.metrics import DecodeStats, ShimCollector, family
from layerwatch.trace import DROP_REASONS as TRACE_DROP_REASONS
from layerwatch.trace import TraceWriter

log = logging.getLogger(__name__)


class FrameSenderCollector(ShimCollector):
    """layerwatch_telemetry_frames_sent_total / _dropped_total; zero when no exporter is configured."""

    metric_names = ("layerwatch_telemetry_frames_sent_total", "layerwatch_telemetry_frames_dropped_total")

    def __init__(self, sender: GateFrameSender | None, model_name: str) -> None:
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
        self,
        model_name: str,
        stats: DecodeStats,
        sender: GateFrameSender | None = None,
        trace: TraceWriter | None = None,
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
            self.sender.send(entropies, skipped, int(fallback_started.sum()))
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
