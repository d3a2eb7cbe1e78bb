"""A collector that raises (here: the statistics, made to fail) costs only its own metrics: the
exporter still answers the scrape (so `up` stays 1 and LayerwatchTargetDown does not inhibit every
other alert of the target) and says which collector failed, as node_exporter does."""

from __future__ import annotations

import socket

import numpy as np

import layerwatch.exporter.state
from layerwatch.exporter.server import ExporterServer
from layerwatch.exporter.state import ExporterConfig, ExporterState
from layerwatch.wire import encode_frame
from tests.exporter.support import random_frame
from tests.support import scrape, wait_for

COLLECTORS = ("entropy", "layer", "window", "routing", "ingest")


def test_a_failing_collector_leaves_the_rest_of_the_scrape_served(monkeypatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise FloatingPointError("injected: the dip test failed")

    monkeypatch.setattr(layerwatch.exporter.state, "check_bimodality", broken)
    server = ExporterServer(
        ExporterState(ExporterConfig(min_window_observations=10)), ("127.0.0.1", 0), ("127.0.0.1", 0)
    )
    server.start()
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rng = np.random.default_rng(0)
        for sequence in range(5):
            sender.sendto(encode_frame(random_frame(rng, sequence)), server.frames_address)
        host, port = server.http_address
        url = f"http://{host}:{port}"
        received = ("layerwatch_exporter_frames_received_total", (("model_name", "demo"),))
        wait_for(lambda: scrape(url).get(received) == 5, what="the five frames")

        samples = scrape(url)  # a status other than 200 raises
        success = {
            dict(labels)["collector"]: value
            for (name, labels), value in samples.items()
            if name == "layerwatch_exporter_scrape_collector_success"
        }
        assert success == {name: (0.0 if name == "window" else 1.0) for name in COLLECTORS}
        durations = [n for n, _ in samples if n == "layerwatch_exporter_scrape_collector_duration_seconds"]
        assert len(durations) == len(COLLECTORS)
        names = {name for name, _ in samples}
        assert "layerwatch_entropy_window_observations" not in names  # the failed collector's metrics only
        assert {
            "layerwatch_entropy_count",
            "layerwatch_routing_window_tokens",
            "process_resident_memory_bytes",
        } <= names
    finally:
        sender.close()
        server.stop()
