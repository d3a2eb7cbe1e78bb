"""Options of `layerwatch serve` that change what is served or written: --reset-gates, --trace-max-bytes."""

from __future__ import annotations

import hashlib

import httpx

from layerwatch.trace import read_trace
from tests.service.conftest import MODEL_NAME


def gates_sha256(server) -> str:
    [labels] = [dict(labels) for (name, labels), _ in server.metrics().items() if name == "layerwatch_model_info"]
    return labels["gates_sha256"]


def test_reset_gates_serves_fresh_gates_and_says_so_in_model_info(in_process, tiny_checkpoint):
    file_sha = hashlib.sha256(tiny_checkpoint.gates_path.read_bytes()).hexdigest()
    reset = in_process(reset_gates=True)
    assert gates_sha256(reset) != file_sha
    body = {"model": MODEL_NAME, "prompt": "light", "max_tokens": 8, "temperature": 0}
    usage = httpx.post(f"{reset.base_url}/v1/completions", json=body, timeout=30).json()["usage"]
    assert usage["layers_skipped"] == 0  # fresh gates score near 0.5: nothing falls below 0.18


def test_trace_stops_at_its_size_cap(in_process, tmp_path):
    trace_path = tmp_path / "trace.jsonl"
    server = in_process(trace_file=trace_path, trace_max_bytes=1500)
    body = {"model": MODEL_NAME, "prompt": "light", "max_tokens": 30, "temperature": 0}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).status_code == 200
    size = trace_path.stat().st_size
    assert 0 < size <= 1500
    records = list(read_trace(trace_path))  # whole lines only
    assert 0 < len(records) < 30
