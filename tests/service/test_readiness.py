"""/healthz is liveness; /readyz runs a real gated generation and fails when the model cannot run."""

from __future__ import annotations

import httpx
import torch

from tests.service.conftest import MODEL_NAME
from tests.support import sample_sum


def test_live_server_is_healthy_and_ready(server):
    assert httpx.get(f"{server.base_url}/healthz", timeout=10).json() == {"status": "ok"}
    response = httpx.get(f"{server.base_url}/readyz", timeout=30)
    assert response.status_code == 200 and response.json()["ready"] is True


def test_probes_stay_out_of_the_metrics(in_process):
    server = in_process()
    rows_before = server.service.model.layer_rows_executed[0]
    assert httpx.get(f"{server.base_url}/readyz", timeout=30).status_code == 200
    assert server.service.model.layer_rows_executed[0] > rows_before  # the probe really ran the model
    metrics = server.metrics()
    assert sample_sum(metrics, "layerwatch_layers_executed_count") == 0
    assert sample_sum(metrics, "layerwatch_tokens_total") == 0


def test_not_ready_when_the_model_cannot_run(in_process):
    server = in_process()
    broken = server.service.model.layers[1].mlp.down_proj
    broken.weight = torch.nn.Parameter(torch.zeros(3, 3))  # a corrupted weight: every forward raises
    response = httpx.get(f"{server.base_url}/readyz", timeout=30)
    assert response.status_code == 503
    assert "failed to run" in response.json()["reason"]
    request = httpx.post(
        f"{server.base_url}/v1/completions", timeout=30, json={"model": MODEL_NAME, "prompt": "light", "max_tokens": 3}
    )
    assert request.status_code == 500 and request.json()["error"]["type"] == "server_error"
    assert sample_sum(server.metrics(), "layerwatch_requests_total", status="server_error") == 1
    assert httpx.get(f"{server.base_url}/healthz", timeout=10).status_code == 200  # alive, just not ready


def test_not_ready_without_a_layer_activity_record(in_process):
    server = in_process()
    server.service.model.attach_gates(None)  # "gates not loaded": the model runs, nothing scores the layers
    response = httpx.get(f"{server.base_url}/readyz", timeout=30)
    assert response.status_code == 503
    assert "layer-activity" in response.json()["reason"]
