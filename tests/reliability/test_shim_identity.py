"""Two real shims sending gate frames under one `--shim-id` (a fleet-wide LAYERWATCH_SHIM_ID, or
hostname-pid where every container's shim is PID 1): the exporter reports the collision and
counts no loss, so LayerwatchTelemetryLoss stays quiet and LayerwatchShimIdCollision says why.
"""

from __future__ import annotations

import time

from layerwatch.client import default_shim_id
from tests.reliability.conftest import MODEL_NAME, BackgroundLoad, sample_sum


def test_two_shims_under_one_id_are_a_collision_not_loss(make_shim, exporter):
    first = make_shim("--shim-id", "shared", "--max-batch-size", "2", exporter=exporter)
    head_start = BackgroundLoad(first.url, duration=1.5, concurrency=2, max_tokens=8, seed=1)
    head_start.result()  # the first shim's numbering is well ahead when the second one starts at 0
    second = make_shim("--shim-id", "shared", "--max-batch-size", "2", exporter=exporter)
    loads = [BackgroundLoad(shim.url, duration=2.0, concurrency=2, max_tokens=8, seed=2) for shim in (first, second)]
    for load in loads:
        assert load.result().by_status.keys() == {200}

    sent = [sample_sum(shim.metrics(), "layerwatch_telemetry_frames_sent_total") for shim in (first, second)]
    assert [sample_sum(shim.metrics(), "layerwatch_telemetry_frames_dropped_total") for shim in (first, second)] == [
        0,
        0,
    ]
    deadline = time.monotonic() + 10
    while sample_sum(samples := exporter.metrics(), "layerwatch_exporter_frames_received_total") < sum(sent):
        assert time.monotonic() < deadline, "the exporter did not receive every frame"
        time.sleep(0.1)
    interleaved = sample_sum(samples, "layerwatch_exporter_frames_interleaved_total", model_name=MODEL_NAME)
    lost = sample_sum(samples, "layerwatch_exporter_frames_lost_total", model_name=MODEL_NAME)
    print(f"\nframes sent {sent[0]:.0f} + {sent[1]:.0f}, exporter: {interleaved:.0f} interleaved, {lost:.0f} lost")
    assert sample_sum(samples, "layerwatch_exporter_frames_received_total") == sum(sent)
    assert lost == 0
    assert interleaved > 0


def test_default_shim_ids_differ_even_with_the_same_hostname_and_pid():
    # Two starts in one process: the same hostname and pid, as two containers' PID-1 shims on host networking.
    ids = {default_shim_id() for _ in range(100)}
    assert len(ids) == 100
