"""Faults around the shim, each injected for real while it serves: the shim keeps serving and the
fault shows where an operator looks (metrics), not in client responses.

- the exporter SIGKILLed and restarted mid-load;
- Prometheus SIGKILLed mid-load;
- the shim restarted between two loads: Prometheus's counter-reset handling keeps `increase`/`rate`
  exact;
- NVML failing mid-run (a simulated NVML device; there is no GPU here);
- the trace file's disk filling up mid-load (a file-size limit on the shim: the full disk, without root).
Gate files replaced on disk are in test_gate_reload.py.
"""

from __future__ import annotations

import math
import signal
import subprocess
import time

import httpx
import pytest

from layerwatch.demo.loadgen import run_load
from layerwatch.trace import read_trace
from tests.reliability.conftest import (
    LAYERWATCH,
    MODEL_NAME,
    BackgroundLoad,
    Prometheus,
    Shim,
    exporter_entropy_count,
    require_binary,
    sample_sum,
)
from tests.service.simulated_nvml import SimulatedNvml


def test_exporter_killed_and_restarted_mid_load(make_shim, exporter):
    """The shim keeps serving every request; the outage shows as dropped frames on the shim and as a
    counter reset on the exporter, which counts again from the shim's next frame without inventing loss."""
    shim = make_shim("--max-batch-size", "4", exporter=exporter)
    load = BackgroundLoad(shim.url, duration=7.0, concurrency=4, max_tokens=12, seed=3)
    load.sleep_until(2.0)
    before_kill = exporter.metrics()
    exporter.kill()
    load.sleep_until(4.0)
    exporter.start()  # same ports: the shim's frames reach it again without the shim noticing
    report = load.result()
    print(f"\nexporter restarted mid-load: {report.summary()}")

    assert report.requests > 0 and report.by_status == {200: report.requests}  # no request noticed
    shim_samples = shim.metrics()
    assert sample_sum(shim_samples, "layerwatch_tokens_total", phase="decode") == report.completion_tokens
    dropped = sample_sum(shim_samples, "layerwatch_telemetry_frames_dropped_total", reason="send_error")
    sent = sample_sum(shim_samples, "layerwatch_telemetry_frames_sent_total")
    assert dropped > 0  # the outage, as the shim saw it (ICMP port unreachable on its connected socket)
    time.sleep(0.5)  # the last frames in flight
    after = exporter.metrics()
    received = sample_sum(after, "layerwatch_exporter_frames_received_total", model_name=MODEL_NAME)
    lost = sample_sum(after, "layerwatch_exporter_frames_lost_total", model_name=MODEL_NAME)
    received_before = sample_sum(before_kill, "layerwatch_exporter_frames_received_total", model_name=MODEL_NAME)
    assert received > 0 and lost == 0  # a fresh exporter: counts restart from zero, no invented gap
    assert received_before > 0
    # The two exporter lives never saw more than the shim sent (received_before is a lower bound:
    # it was scraped just before the kill). Frames that left the shim while the port was dead are
    # gone without a trace on either side; only the dropped counter above shows the outage.
    assert received_before + received <= sent
    layers = shim.checkpoint.num_layers
    entropies = exporter_entropy_count(after)  # whole rows only, and never more than were decoded
    assert 0 < entropies < report.completion_tokens * layers and entropies % layers == 0
    print(
        f"frames: {sent:.0f} sent, {dropped:.0f} dropped (send_error), exporter received {received_before:.0f} "
        f"before the kill + {received:.0f} after the restart"
    )


@pytest.fixture
def prometheus_for(tmp_path):
    """Factory: prometheus_for(targets) -> a started Prometheus (stopped after the test)."""
    require_binary("prometheus")
    started: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        prometheus = Prometheus(tmp_path / f"prometheus-{len(started)}", targets)
        started.append(prometheus)
        return prometheus.start()

    yield start
    for prometheus in started:
        prometheus.stop()


def test_prometheus_down_mid_load_is_invisible_to_the_shim(make_shim, prometheus_for):
    shim = make_shim(start=False)
    prometheus = prometheus_for([f"127.0.0.1:{shim.port}"])
    # Prometheus first: it scrapes some 5 s after it starts (its target discovery's first update),
    # time the shim's start-up takes place in.
    shim.start()
    prometheus.wait_scraped(after=time.time())
    load = BackgroundLoad(shim.url, duration=5.0, concurrency=4, max_tokens=12, seed=5)
    load.sleep_until(2.0)
    prometheus.kill()
    report = load.result()
    print(f"\nPrometheus killed mid-load: {report.summary()}")

    assert report.requests > 0 and report.by_status == {200: report.requests}
    assert sample_sum(shim.metrics(), "layerwatch_tokens_total", phase="decode") == report.completion_tokens
    assert httpx.get(f"{shim.url}/readyz", timeout=30).status_code == 200


def test_shim_restart_keeps_prometheus_increase_exact(make_shim, prometheus_for):
    """Counters restart at zero in the new process; Prometheus treats the drop as a counter reset, so
    `increase` over a window spanning the restart equals the tokens clients received in both lives.

    The loads stop before each scrape that the comparison uses, so the counters Prometheus last saw
    hold every token; and `increase` is evaluated at the timestamp of the last sample with the
    window starting just before the first one (whose value is 0), so Prometheus has nothing to
    extrapolate: the result must be exact. `rate` is the same number over the window's length.
    """
    shim = make_shim(start=False)
    prometheus = prometheus_for([f"127.0.0.1:{shim.port}"])
    # Prometheus first: it scrapes some 5 s after it starts (its target discovery's first update),
    # time the shim's start-up takes place in.
    shim.start()
    prometheus.wait_scraped(after=time.time())  # the first sample: the counter at 0

    first = run_load(shim.url, MODEL_NAME, duration=1.0, concurrency=3, max_tokens=10, seed=11)
    prometheus.wait_scraped(after=time.time())
    shim.stop()
    shim.start()
    prometheus.wait_scraped(after=time.time())  # the new process, its counter back at 0
    second = run_load(shim.url, MODEL_NAME, duration=1.0, concurrency=3, max_tokens=10, seed=12)
    prometheus.wait_scraped(after=time.time())
    expected = first.completion_tokens + second.completion_tokens
    assert first.server_errors == second.server_errors == 0 and expected > 0

    selector = f'layerwatch_tokens_total{{model_name="{MODEL_NAME}",phase="decode"}}'
    [raw] = prometheus.query(f"{selector}[10m]")
    timestamps = [float(t) for t, _ in raw["values"]]
    values = [float(v) for _, v in raw["values"]]
    assert values[0] == 0 and values[-1] == second.completion_tokens  # the live process's own count
    at, window = timestamps[-1], math.ceil(timestamps[-1] - timestamps[0] + 0.5)
    [resets] = prometheus.query(f"resets({selector}[{window}s])", at=at)
    [increase] = prometheus.query(f"increase({selector}[{window}s])", at=at)
    [rate] = prometheus.query(f"rate({selector}[{window}s])", at=at)
    print(
        f"\nshim restart: {expected} tokens served, Prometheus increase {increase['value'][1]}, "
        f"rate {float(rate['value'][1]):.2f}/s over {window}s, resets {resets['value'][1]}"
    )
    assert float(resets["value"][1]) == 1
    assert float(increase["value"][1]) == pytest.approx(expected, rel=1e-9)
    # `rate` divides by the sampled interval after extrapolation; with none it is increase / window.
    assert float(rate["value"][1]) == pytest.approx(expected / window, rel=1e-9)
    assert values[-1] < expected  # a naive last-minus-first would be wrong: the reset is real


# --- NVML ------------------------------------------------------------------------------------------


def test_nvml_failing_mid_run_drops_nvml_up_and_serving_continues(in_process, monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    device = SimulatedNvml(pynvml)
    device.install(monkeypatch)  # before the first scrape: the collector starts NVML lazily
    server = in_process()
    gpu = (("gpu", "0"), ("uuid", SimulatedNvml.UUID))

    load = BackgroundLoad(server.base_url, duration=4.0, concurrency=2, max_tokens=8, seed=9)
    healthy = server.metrics()
    assert healthy[("layerwatch_nvml_up", ())] == 1
    assert healthy[("layerwatch_gpu_power_watts", gpu)] == 250.0
    assert healthy[("layerwatch_gpu_temperature_celsius", gpu)] == SimulatedNvml.TEMPERATURE_CELSIUS
    load.sleep_until(1.5)
    device.fail()
    failed = server.metrics()  # the page still renders
    assert failed[("layerwatch_nvml_up", ())] == 0
    # No stale reading is presented as current: every GPU series is gone.
    assert not [key for key in failed if key[0].startswith("layerwatch_gpu_")]
    report = load.result()
    assert report.requests > 0 and report.by_status == {200: report.requests}
    assert sample_sum(server.metrics(), "layerwatch_tokens_total", phase="decode") == report.completion_tokens


TRACE_FILE_SIZE_LIMIT = 8192  # bytes: some 50 trace lines of the tiny model


def test_trace_file_on_a_full_disk_stops_tracing_and_serving_goes_on(tiny_checkpoint, tmp_path):
    """The shim runs under a file-size limit (RLIMIT_FSIZE via prlimit; Python ignores SIGXFSZ, so a
    write past it writes what fits and then fails with EFBIG, as on a full disk). The trace hits it
    mid-load: clients see nothing, the file ends with a whole line, the failure is logged once and
    every decoded token is either a written line or a counted dropped one; shutdown succeeds and
    `replay` reads the trace as it is."""
    require_binary("prlimit")
    trace = tmp_path / "trace.jsonl"
    shim = Shim(
        tmp_path,
        tiny_checkpoint,
        "--trace-file",
        str(trace),
        launcher=("prlimit", f"--fsize={TRACE_FILE_SIZE_LIMIT}"),
    )
    shim.start()
    try:
        report = run_load(shim.url, MODEL_NAME, duration=3.0, concurrency=2, max_tokens=8, seed=31)
        samples = shim.metrics()
    finally:
        exit_code = shim.process.stop()
    assert report.requests > 0 and report.by_status == {200: report.requests}
    written = sample_sum(samples, "layerwatch_trace_lines_written_total", model_name=MODEL_NAME)
    failed = sample_sum(samples, "layerwatch_trace_lines_dropped_total", reason="write_error")
    assert sample_sum(samples, "layerwatch_trace_lines_dropped_total", reason="max_bytes") == 0
    assert written > 0 and failed > 0
    assert (
        written + failed == report.completion_tokens == sample_sum(samples, "layerwatch_tokens_total", phase="decode")
    )
    data = trace.read_bytes()
    assert len(data) <= TRACE_FILE_SIZE_LIMIT and data.endswith(b"\n")
    assert len(list(read_trace(trace))) == written  # whole lines only: the strict reader accepts every one

    log = shim.process.log_path.read_text()
    assert exit_code in (0, -signal.SIGTERM), log[-2000:]  # uvicorn re-raises the signal it shut down on
    assert log.count("trace writing stopped") == 1 and "File too large" in log, log[-2000:]
    assert "Application shutdown failed" not in log and "Traceback" not in log, log[-2000:]
    replay = subprocess.run([*LAYERWATCH, "replay", str(trace), "--json"], capture_output=True, text=True, timeout=60)
    assert replay.returncode == 0 and replay.stderr == "", replay.stderr
    print(
        f"\n{report.requests} requests, all 200; trace: {written:.0f} lines ({len(data)} bytes) written, "
        f"{failed:.0f} dropped after the write error"
    )
