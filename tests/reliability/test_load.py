"""Bounded load against `layerwatch serve` with the exporter running: nothing is lost.

Concurrent clients (streaming and not) for a fixed time, then every count is reconciled against
what the clients received in `usage`:
  - zero 5xx and zero connection errors;
  - the shim's generated-tokens counter equals Σ usage.completion_tokens (requests_total{ok} equals
    the request count, Σ layers_executed agrees with the layers-executed histogram's sum);
  - frames sent by the shim equal the exporter's received + lost (sequence gaps);
  - the exporter's entropy count equals decoded tokens × layers (one entropy per layer per token).
Throughput and p99 latency are printed (run with -s); docs/reliability.md records them.
"""

from __future__ import annotations

import time

from layerwatch.demo.loadgen import run_load
from tests.reliability.conftest import MODEL_NAME, exporter_entropy_count, sample_sum

LOAD_SECONDS = 6.0
CONCURRENCY = 6  # more clients than --max-batch-size 4: requests also queue for a batch slot
MAX_TOKENS = 16


def wait_for_frames(shim, exporter, timeout: float = 10.0) -> tuple[dict, dict]:
    """Scrapes of both once the exporter has accounted for every frame the shim sent (UDP in flight)."""
    deadline = time.monotonic() + timeout
    while True:
        shim_samples, exporter_samples = shim.metrics(), exporter.metrics()
        sent = sample_sum(shim_samples, "layerwatch_telemetry_frames_sent_total")
        seen = sample_sum(exporter_samples, "layerwatch_exporter_frames_received_total") + sample_sum(
            exporter_samples, "layerwatch_exporter_frames_lost_total"
        )
        if seen >= sent or time.monotonic() > deadline:
            return shim_samples, exporter_samples
        time.sleep(0.1)


def test_load_with_exporter_loses_nothing(make_shim, exporter):
    shim = make_shim("--max-batch-size", "4", exporter=exporter)
    report = run_load(
        shim.url,
        MODEL_NAME,
        duration=LOAD_SECONDS,
        concurrency=CONCURRENCY,
        max_tokens=MAX_TOKENS,
        stream_fraction=0.5,
        seed=7,
    )
    print(f"\nload: {report.summary()}")

    assert report.requests > 0 and report.by_status == {200: report.requests}, report.by_status
    assert report.completion_tokens == report.requests * MAX_TOKENS  # the tiny model never emits EOS
    shim_samples, exporter_samples = wait_for_frames(shim, exporter)
    layers = shim.checkpoint.num_layers

    assert sample_sum(shim_samples, "layerwatch_requests_total", status="ok") == report.requests
    assert sample_sum(shim_samples, "layerwatch_requests_total") == report.requests
    assert sample_sum(shim_samples, "layerwatch_tokens_total", phase="decode") == report.completion_tokens
    assert sample_sum(shim_samples, "layerwatch_tokens_total", phase="prefill") == report.prompt_tokens
    assert sample_sum(shim_samples, "layerwatch_layers_executed_count") == report.completion_tokens
    assert sample_sum(shim_samples, "layerwatch_layers_executed_sum") == report.layers_executed
    assert report.layers_executed + report.layers_skipped == report.completion_tokens * layers

    sent = sample_sum(shim_samples, "layerwatch_telemetry_frames_sent_total")
    received = sample_sum(exporter_samples, "layerwatch_exporter_frames_received_total", model_name=MODEL_NAME)
    lost = sample_sum(exporter_samples, "layerwatch_exporter_frames_lost_total", model_name=MODEL_NAME)
    assert sample_sum(shim_samples, "layerwatch_telemetry_frames_dropped_total") == 0
    assert sent > 0 and sent == received + lost, (sent, received, lost)
    assert sample_sum(exporter_samples, "layerwatch_exporter_frames_malformed_total") == 0
    # Lost frames carry entropies the exporter never saw; on loopback with an 8 MiB buffer there are none.
    assert lost == 0
    assert exporter_entropy_count(exporter_samples) == report.completion_tokens * layers
    # Frames carry the skip rules' decisions; usage counts what ran, which the default depth
    # execution makes differ at batch > 1 (docs/model.md, "Depth execution"): each side has its count.
    skipped_entropies = sample_sum(exporter_samples, "layerwatch_entropy_count", model_name=MODEL_NAME, decision="skip")
    assert skipped_entropies == sample_sum(shim_samples, "layerwatch_layer_skips_total")
    executed = sample_sum(shim_samples, "layerwatch_layer_skips_executed_total")
    assert executed == report.layers_skipped
    unneeded = sample_sum(shim_samples, "layerwatch_layer_unneeded_runs_total")
    assert executed >= skipped_entropies - unneeded  # the rest: layers a consensus voted off

    throughput = report.completion_tokens / report.elapsed
    print(
        f"load: {report.requests} requests, {report.completion_tokens} tokens, {throughput:.0f} tokens/s, "
        f"{report.requests / report.elapsed:.1f} requests/s, p50 {report.percentile(0.5) * 1e3:.0f} ms, "
        f"p99 {report.percentile(0.99) * 1e3:.0f} ms, frames {sent:.0f} sent = {received:.0f} received "
        f"+ {lost:.0f} lost"
    )
