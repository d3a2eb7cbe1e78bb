"""The audit trail: one OpenTelemetry span per generation request, exported over OTLP/HTTP.

Each request the engine served gets a span (`text_completion MODEL` / `chat MODEL`) from its
arrival to its last choice being counted: OTel's GenAI attributes (`gen_ai.*`) for what was asked
and answered, and `layerwatch.*` for how deep it ran: the threshold and depth mode, the layers
executed and skipped (as in `usage`), the skips per layer, the mean gate score, the fallback
episodes. A shadow re-check of one of its choices, which runs after the answer, is a child span
`layerwatch.shadow_check` with that choice's full-depth agreement and quality cost. docs/service.md, "Audit trail",
lists every attribute.

Spans are off unless an endpoint is configured (ShimService builds an AuditTrail only then, and
imports this module only then: the SDK and exporter take 0.4 s to import). Exporting never
touches the request path: ending a span appends it to the batch processor's queue, and the SDK's
export thread sends batches. The queue holds AUDIT_QUEUE_SPANS; a span ended while it is full is
dropped. Every span ends up in `layerwatch_audit_spans_total{outcome}` (exported, failed,
dropped); a failing export is logged once when it starts failing and once when it recovers (the
SDK logs each failed batch too).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from layerwatch.catalog import AUDIT_QUEUE_SPANS
from layerwatch.inference_shim.runtime.agreement import ShadowResult
from layerwatch.inference_shim.service.metrics import AuditSpanCounts
from layerwatch.inference_shim.service.records import RequestRecord

log = logging.getLogger(__name__)

SHUTDOWN_SECONDS = 5.0  # at shutdown, spans still queued get this long to leave
SERVICE = "layerwatch-serve"  # service.name unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES set one
PROVIDER = "layerwatch"  # gen_ai.provider.name
OPERATIONS = {"completion": "text_completion", "chat": "chat"}  # gen_ai.operation.name by request kind


class RequestSpan:
    """One request's span, open from its arrival until `end`."""

    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self._span = span

    def end(self, record: RequestRecord) -> None:
        self._span.set_attributes(request_attributes(record))
        if record.status == "server_error":
            self._span.set_status(Status(StatusCode.ERROR))
        self._span.end()

    def shadow_checked(self, choice: int, result: ShadowResult, seconds: float) -> None:
        """A child span for the full-depth re-check of one choice, which ran `seconds` until now
        (in the engine thread, after the request was answered)."""
        ended = time.time_ns()
        tokens = result.tokens
        span = self._tracer.start_span(
            "layerwatch.shadow_check",
            context=trace.set_span_in_context(self._span),
            kind=SpanKind.INTERNAL,
            start_time=ended - int(seconds * 1e9),
            attributes={
                "layerwatch.choice.index": choice,
                "layerwatch.shadow.tokens": tokens,
                "layerwatch.shadow.agreements": result.agreements,
                "layerwatch.shadow.agreement": result.agreements / tokens,
                "layerwatch.shadow.kl_nats_per_token": result.kl_nats / tokens,
                "layerwatch.shadow.reverse_kl_nats_per_token": result.reverse_kl_nats / tokens,
            },
        )
        span.end(end_time=ended)


def request_attributes(record: RequestRecord) -> dict[str, AttributeValue]:
    """The span's attributes: OTel's GenAI conventions where they apply, `layerwatch.*` for the rest."""
    params = record.params
    attributes: dict[str, AttributeValue] = {
        gen_ai.GEN_AI_OPERATION_NAME: OPERATIONS[record.kind],
        gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER,
        gen_ai.GEN_AI_REQUEST_MODEL: record.model_name,
        gen_ai.GEN_AI_RESPONSE_MODEL: record.model_name,
        gen_ai.GEN_AI_RESPONSE_ID: record.request_id,
        gen_ai.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
        gen_ai.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
        gen_ai.GEN_AI_REQUEST_TOP_P: params.top_p,
        gen_ai.GEN_AI_REQUEST_STREAM: record.stream,
        gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: record.finish_reasons,
        gen_ai.GEN_AI_USAGE_INPUT_TOKENS: record.usage["prompt_tokens"],
        gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: record.usage["completion_tokens"],
        "layerwatch.request.status": record.status,
        "layerwatch.gates.sha256": record.gates_sha256,
        "layerwatch.skip.threshold": record.threshold,
        "layerwatch.depth.mode": record.depth_mode,
        "layerwatch.depth.reason": record.depth_reason,
        "layerwatch.layers.executed": record.usage["layers_executed"],
        "layerwatch.layers.skipped": record.usage["layers_skipped"],
    }
    if params.seed is not None:
        attributes[gen_ai.GEN_AI_REQUEST_SEED] = params.seed
    if record.n != 1:  # the convention records it only when it is not 1
        attributes[gen_ai.GEN_AI_REQUEST_CHOICE_COUNT] = record.n
    if record.status in ("client_error", "server_error"):
        attributes[ERROR_TYPE] = record.status
    if record.layers:
        # Bounded by the layer count, however long the generation: per-layer totals, not per-token lists.
        skipped = np.sum([counts.skipped for counts in record.layers], axis=0)
        attributes["layerwatch.layers.skipped_per_layer"] = skipped.tolist()
        attributes["layerwatch.fallbacks"] = sum(counts.fallbacks for counts in record.layers)
        tokens = sum(counts.tokens for counts in record.layers)
        score_sum = float(np.sum([counts.score_sum for counts in record.layers]))
        if tokens and np.isfinite(score_sum):  # NaN: a model without gates has no scores
            attributes["layerwatch.entropy.mean"] = score_sum / (tokens * len(skipped))
    return attributes


class AuditTrail:
    """The tracer of `layerwatch serve`: its own provider (no global state), every span sampled
    (an audit trail keeps every request), batches exported in the SDK's thread."""

    def __init__(self, exporter: SpanExporter, counts: AuditSpanCounts, shim_id: str) -> None:
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over these defaults, as in any OTel SDK.
        defaults = {SERVICE_NAME: SERVICE, SERVICE_INSTANCE_ID: shim_id}
        resource = Resource.create({**defaults, **OTELResourceDetector().detect().attributes})
        self._provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
        self._provider.add_span_processor(_BoundedBatchProcessor(_CountingExporter(exporter, counts), counts))
        self._tracer = self._provider.get_tracer("layerwatch.serve")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def over_otlp(cls, endpoint: str, counts: AuditSpanCounts, shim_id: str) -> AuditTrail:
        """Spans to an OTLP/HTTP traces URL; headers, timeout, compression and TLS from the standard
        OTEL_EXPORTER_OTLP_[TRACES_]* variables, as the SDK reads them."""
        return cls(OTLPSpanExporter(endpoint=endpoint), counts, shim_id)

    def start(self, kind: str, model_name: str, arrived: float, headers: Mapping[str, str]) -> RequestSpan:
        """A request's span, started at its arrival (`time.monotonic()`); a W3C `traceparent` header
        makes it a child of the client's span."""
        start = time.time_ns() - int((time.monotonic() - arrived) * 1e9)
        span = self._tracer.start_span(
            f"{OPERATIONS[kind]} {model_name}",
            context=self._propagator.extract(headers),
            kind=SpanKind.SERVER,
            start_time=start,
        )
        return RequestSpan(self._tracer, span)

    def force_flush(self) -> bool:
        return self._provider.force_flush()

    def shutdown(self) -> None:
        """Send what is queued, for at most SHUTDOWN_SECONDS (an unreachable collector must not
        hold up the process's exit: the export retries for up to its own timeout)."""
        closing = threading.Thread(target=self._provider.shutdown, name="layerwatch-audit-shutdown", daemon=True)
        closing.start()
        closing.join(SHUTDOWN_SECONDS)
        if closing.is_alive():
            log.warning("audit spans: shutdown gave up after %gs; spans still queued are lost", SHUTDOWN_SECONDS)


class _CountingExporter(SpanExporter):
    """The real exporter, with every span's outcome counted; nothing it raises leaves it."""

    def __init__(self, exporter: SpanExporter, counts: AuditSpanCounts) -> None:
        self._exporter = exporter
        self._counts = counts
        self._failed_before: int | None = None  # while failing: the failed count when it began

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._exporter.export(spans)
        except Exception:
            log.exception("audit spans: the exporter raised")
            result = SpanExportResult.FAILURE
        ok = result is SpanExportResult.SUCCESS
        failed_before = self._counts.failed
        self._counts.settle(len(spans), ok)
        # Said when the state changes, not at every batch (the SDK logs each failed batch itself).
        if not ok and self._failed_before is None:
            self._failed_before = failed_before
            log.error(
                "audit spans: export failed, %d span(s) lost; until it recovers, lost spans are only counted "
                '(layerwatch_audit_spans_total{outcome="failed"})',
                len(spans),
            )
        elif ok and self._failed_before is not None:
            log.warning(
                "audit spans: exporting again, %d span(s) lost meanwhile", self._counts.failed - self._failed_before
            )
            self._failed_before = None
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class _BoundedBatchProcessor(BatchSpanProcessor):
    """The SDK's batch processor, with the queue bound kept here so that a dropped span is counted
    (the SDK drops it too, but counts it only in its opt-in internal metrics)."""

    def __init__(self, exporter: _CountingExporter, counts: AuditSpanCounts) -> None:
        super().__init__(exporter, max_queue_size=AUDIT_QUEUE_SPANS)
        self._counts = counts

    def on_end(self, span: ReadableSpan) -> None:
        if self._counts.enqueue(AUDIT_QUEUE_SPANS):
            super().on_end(span)
