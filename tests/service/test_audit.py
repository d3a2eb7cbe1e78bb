"""The audit trail: a span per request, with the numbers the client got in `usage` and /metrics.

In process with the SDK's in-memory exporter (every attribute, the shadow child spans, the
fallback count against the fallback log lines), and over real OTLP/HTTP from a live `layerwatch
serve --otlp-endpoint` into a loopback receiver that decodes opentelemetry-proto's
ExportTraceServiceRequest, including a collector that refuses the spans.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.inference_shim.service.shim import ServeSettings, ShimService, resolve_otlp_endpoint
from tests.service.conftest import MODEL_NAME, NUM_LAYERS, InProcessServer
from tests.support import sample_sum, scrape, wait_for

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture
def audited(tiny_checkpoint):
    """Factory: audited(**settings) -> (server, exporter): an in-process server whose spans go to
    the SDK's in-memory exporter."""
    started: list[InProcessServer] = []

    def start(**overrides) -> tuple[InProcessServer, InMemorySpanExporter]:
        exporter = InMemorySpanExporter()
        limits = {"max_tokens_cap": 32, "max_prompt_tokens": 64, **overrides}
        settings = ServeSettings(model_dir=tiny_checkpoint.path, model_name=MODEL_NAME, exporter_address="", **limits)
        server = InProcessServer(ShimService.load(settings, span_exporter=exporter)).__enter__()
        started.append(server)
        return server, exporter

    yield start
    for server in started:
        server.__exit__(None, None, None)


def finished_spans(server: InProcessServer, exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The first `count` spans, once the service has ended them (shadow spans come after the answer)."""
    deadline = time.monotonic() + 30
    while True:
        server.service.audit.force_flush()
        spans = exporter.get_finished_spans()
        if len(spans) >= count or time.monotonic() > deadline:
            return list(spans)
        time.sleep(0.05)


def test_a_span_per_request_carries_what_usage_and_metrics_say(audited, tiny_checkpoint):
    server, exporter = audited(shadow_rate=1.0)
    client = client_for(server.base_url)
    before = server.metrics()
    whole = client.completions.create(
        model=MODEL_NAME, prompt="In the beginning", max_tokens=12, temperature=0, n=2, seed=5
    )
    streamed = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Let there be light"}],
            max_tokens=9,
            temperature=0.8,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"traceparent": TRACEPARENT},
        )
    )
    # 2 request spans and one shadow span per choice (--shadow-rate 1), the chat's sampled at 0.8 too.
    spans = finished_spans(server, exporter, 5)
    after = server.metrics()
    requests = {s.attributes["gen_ai.operation.name"]: s for s in spans if s.kind is SpanKind.SERVER}
    completion, chat = requests["text_completion"], requests["chat"]

    assert completion.name == f"text_completion {MODEL_NAME}" and chat.name == f"chat {MODEL_NAME}"
    a = completion.attributes
    assert a["gen_ai.provider.name"] == "layerwatch"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL_NAME
    assert a["gen_ai.response.id"] == whole.id
    assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.seed"] == 5 and a["gen_ai.request.choice.count"] == 2
    assert a["gen_ai.request.stream"] is False
    assert list(a["gen_ai.response.finish_reasons"]) == [c.finish_reason for c in whole.choices]
    assert a["gen_ai.usage.input_tokens"] == whole.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == whole.usage.completion_tokens == 24
    assert a["layerwatch.layers.executed"] == whole.usage.model_extra["layers_executed"]
    assert a["layerwatch.layers.skipped"] == whole.usage.model_extra["layers_skipped"] > 0
    assert a["layerwatch.gates.sha256"] == tiny_checkpoint.gates_sha256
    assert a["layerwatch.skip.threshold"] == pytest.approx(0.18) and a["layerwatch.depth.mode"] == "gated"
    assert a["layerwatch.request.status"] == "ok" and a["layerwatch.fallbacks"] == 0
    assert "error.type" not in a and completion.status.status_code is StatusCode.UNSET
    # A bounded summary of which layers were skipped: one count per layer, the protected ones never.
    per_layer = list(a["layerwatch.layers.skipped_per_layer"])
    assert len(per_layer) == NUM_LAYERS and sum(per_layer) == a["layerwatch.layers.skipped"]
    assert per_layer[0] == per_layer[-1] == 0
    assert 0.0 < a["layerwatch.entropy.mean"] < 1.0

    c = chat.attributes
    usage = streamed[-1].usage
    assert c["gen_ai.usage.output_tokens"] == usage.completion_tokens == 9
    assert c["layerwatch.layers.skipped"] == usage.model_extra["layers_skipped"]
    assert c["gen_ai.request.stream"] is True and "gen_ai.request.choice.count" not in c
    # The client's traceparent makes the request span a child of the client's span.
    assert format(chat.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert format(chat.parent.span_id, "016x") == TRACEPARENT.split("-")[2]
    assert chat.start_time < chat.end_time

    # The shim's own counters moved by the same amounts.
    executed = "layerwatch_layer_skips_executed_total"  # usage and spans count what ran
    skips = sample_sum(after, executed) - sample_sum(before, executed)
    assert skips == a["layerwatch.layers.skipped"] + c["layerwatch.layers.skipped"]

    shadows = [s for s in spans if s.name == "layerwatch.shadow_check"]
    assert len(shadows) == 3  # the two greedy choices and the sampled chat
    for shadow in shadows:
        parent = completion if shadow.parent.span_id == completion.context.span_id else chat
        assert shadow.parent.span_id == parent.context.span_id
        assert shadow.context.trace_id == parent.context.trace_id
        s = shadow.attributes
        tokens = parent.attributes["gen_ai.usage.output_tokens"] // (2 if parent is completion else 1)
        assert s["layerwatch.shadow.tokens"] == tokens
        assert s["layerwatch.shadow.agreement"] == s["layerwatch.shadow.agreements"] / tokens
        assert s["layerwatch.shadow.kl_nats_per_token"] > 0 and s["layerwatch.shadow.reverse_kl_nats_per_token"] > 0
    by_parent = sorted(
        (s.parent.span_id == chat.context.span_id, s.attributes["layerwatch.choice.index"]) for s in shadows
    )
    assert by_parent == [(False, 0), (False, 1), (True, 0)]
    shadow_tokens = sample_sum(server.metrics(), "layerwatch_shadow_tokens_total")
    assert shadow_tokens == sum(s.attributes["layerwatch.shadow.tokens"] for s in shadows)

    exported = sample_sum(server.metrics(), "layerwatch_audit_spans_total", outcome="exported")
    assert exported == len(exporter.get_finished_spans())
    assert sample_sum(server.metrics(), "layerwatch_audit_spans_queued") == 0


def test_fallbacks_in_the_span_match_the_fallback_lines(audited, caplog):
    # Every layer skippable and every score below tau: all layers skip after the patience, so the
    # fallback breaker trips.
    server, exporter = audited(threshold=1.0, protected_layers=())
    client = client_for(server.base_url)
    with caplog.at_level(logging.WARNING, logger="layerwatch.inference_shim.runtime.engine"):
        result = client.completions.create(model=MODEL_NAME, prompt="And God said", max_tokens=30, temperature=0)
    (span,) = finished_spans(server, exporter, 1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ILP_FALLBACK: HIGH_SKIPPING ")]
    assert lines and all(f"model={MODEL_NAME} request={result.id} sequence=" in line for line in lines)
    assert all(re.fullmatch(r"ILP_FALLBACK: HIGH_SKIPPING( \w+=\S+)+", line) for line in lines)
    assert span.attributes["layerwatch.fallbacks"] == len(lines) == 2  # 3 patience + 3 skipping + 16 full, again
    assert span.attributes["layerwatch.skip.threshold"] == 1.0


def test_a_request_the_client_abandons_ends_its_span_as_cancelled(audited):
    server, exporter = audited(max_tokens_cap=200, max_prompt_tokens=32)  # a long generation, cut short
    body = {"model": MODEL_NAME, "prompt": "And God called the light Day", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as response:
        next(response.iter_lines())  # the first event: the generation runs; then the client goes away
    (span,) = finished_spans(server, exporter, 1)
    a = span.attributes
    assert a["layerwatch.request.status"] == "cancelled" and list(a["gen_ai.response.finish_reasons"]) == ["cancelled"]
    assert 0 < a["gen_ai.usage.output_tokens"] < 200
    assert sum(a["layerwatch.layers.skipped_per_layer"]) == a["layerwatch.layers.skipped"]
    assert "error.type" not in a


def test_full_depth_reads_full_and_skips_nothing(audited):
    server, exporter = audited(threshold=0.0)
    result = client_for(server.base_url).completions.create(model=MODEL_NAME, prompt="Day", max_tokens=6)
    (span,) = finished_spans(server, exporter, 1)
    assert span.attributes["layerwatch.depth.mode"] == "full"
    assert span.attributes["layerwatch.layers.skipped"] == result.usage.model_extra["layers_skipped"] == 0
    assert list(span.attributes["layerwatch.layers.skipped_per_layer"]) == [0] * NUM_LAYERS


def test_spans_are_off_by_default_and_the_sdk_is_not_even_imported(tiny_checkpoint):
    # In a fresh interpreter: this one has imported the SDK for the other tests.
    script = (
        "import sys\n"
        "from layerwatch.inference_shim.service.shim import ServeSettings, ShimService\n"
        f"service = ShimService.load(ServeSettings(model_dir={str(tiny_checkpoint.path)!r}, exporter_address=''))\n"
        "assert service.audit is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- where spans go --------------------------------------------------------------------------------


def test_endpoint_from_the_flag_or_the_standard_variables():
    assert resolve_otlp_endpoint(None, {}) is None  # off by default
    assert resolve_otlp_endpoint("http://127.0.0.1:4318", {}) == "http://127.0.0.1:4318/v1/traces"
    assert resolve_otlp_endpoint("http://c:4318/", {}) == "http://c:4318/v1/traces"
    assert resolve_otlp_endpoint("https://c/otlp/v1/traces", {}) == "https://c/otlp/v1/traces"  # a path: as is
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318"}
    assert resolve_otlp_endpoint(None, env) == "http://base:4318/v1/traces"
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://traces:9999/custom"
    assert resolve_otlp_endpoint(None, env) == "http://traces:9999/custom"
    assert resolve_otlp_endpoint("http://flag:4318", env) == "http://flag:4318/v1/traces"  # the flag wins
    assert resolve_otlp_endpoint("http://flag:4318", {**env, "OTEL_SDK_DISABLED": "true"}) is None
    assert resolve_otlp_endpoint(None, {**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) is not None


@pytest.mark.parametrize(
    ("endpoint", "env", "message"),
    [
        ("127.0.0.1:4318", {}, "--otlp-endpoint must be an http:// or https:// URL with a host"),
        ("grpc://c:4317", {}, "--otlp-endpoint must be an http"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://c"}, "OTEL_EXPORTER_OTLP_ENDPOINT must be an http"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "http/protobuf only"),
    ],
)
def test_an_endpoint_that_cannot_work_is_refused(endpoint, env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_otlp_endpoint(endpoint, env)


# --- over OTLP/HTTP into a real receiver -----------------------------------------------------------


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on loopback: decodes every ExportTraceServiceRequest it gets and
    answers `status` (200 with an ExportTraceServiceResponse, or a refusal)."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        self.status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.paths.append(self.path)
                assert self.headers["content-type"] == "application/x-protobuf"
                receiver.requests.append(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString() if receiver.status == 200 else b""
                self.send_response(receiver.status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[tuple[dict, dict, object]]:
        """(resource attributes, span attributes, span) for every span received."""
        return [
            (attributes(resource_spans.resource.attributes), attributes(span.attributes), span)
            for request in list(self.requests)
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(key_values) -> dict:
    return {kv.key: value(kv.value) for kv in key_values}


def value(any_value: AnyValue):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def test_serve_sends_spans_over_otlp_http_and_survives_a_collector_that_refuses(tiny_checkpoint, receiver, tmp_path):
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "layerwatch.cli.main",
        "serve",
        "--model",
        str(tiny_checkpoint.path),
        "--model-name",
        MODEL_NAME,
        "--port",
        str(port),
        "--exporter-address",
        "",
        "--shim-id",
        "audit-shim",
        "--otlp-endpoint",
        receiver.url,  # a base URL: spans go to /v1/traces
    ]
    env = {"OMP_NUM_THREADS": "1", "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "shim-under-test"}
    process = ManagedProcess("serve", argv, tmp_path / "serve.log", env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        process.wait_http(f"{base_url}/healthz", timeout=120)
        client = client_for(base_url)
        result = client.completions.create(model=MODEL_NAME, prompt="In the beginning", max_tokens=8, temperature=0)
        wait_for(lambda: receiver.spans(), timeout=30)
        ((resource, span_attributes, span),) = receiver.spans()
        assert receiver.paths == ["/v1/traces"]
        assert resource["service.name"] == "shim-under-test" and resource["service.instance.id"] == "audit-shim"
        assert span.name == f"text_completion {MODEL_NAME}" and span.kind == span.SPAN_KIND_SERVER
        assert span_attributes["gen_ai.response.id"] == result.id
        assert span_attributes["gen_ai.usage.output_tokens"] == 8
        assert span_attributes["layerwatch.layers.skipped"] == result.usage.model_extra["layers_skipped"]
        assert span_attributes["layerwatch.gates.sha256"] == tiny_checkpoint.gates_sha256
        assert len(span_attributes["layerwatch.layers.skipped_per_layer"]) == NUM_LAYERS
        wait_for(
            lambda: sample_sum(scrape(base_url), "layerwatch_audit_spans_total", outcome="exported") == 1, timeout=30
        )

        # A collector that refuses the spans: requests are served as before, the spans are counted as failed.
        receiver.status = 400
        for _ in range(3):
            assert client.completions.create(model=MODEL_NAME, prompt="Day", max_tokens=4).usage.completion_tokens == 4
        wait_for(
            lambda: sample_sum(scrape(base_url), "layerwatch_audit_spans_total", outcome="failed") == 3, timeout=30
        )
        metrics = scrape(base_url)
        assert sample_sum(metrics, "layerwatch_audit_spans_total", outcome="exported") == 1
        assert sample_sum(metrics, "layerwatch_requests_total", status="ok") == 4
        assert httpx.get(f"{base_url}/readyz", timeout=20).status_code == 200

        receiver.status = 200  # the collector is back
        client.completions.create(model=MODEL_NAME, prompt="Night", max_tokens=2)
        wait_for(
            lambda: sample_sum(scrape(base_url), "layerwatch_audit_spans_total", outcome="exported") == 2, timeout=30
        )
        log = (tmp_path / "serve.log").read_text()
        assert log.count("audit spans: export failed") == 1  # said once, not per batch
        assert log.count("audit spans: exporting again, 3 span(s) lost meanwhile") == 1
    finally:
        process.stop()
