"""Options of `layerwatch serve` that change what is served or written: --reset-gates, --trace-max-bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from inference_shim.service.shim import ServeSettings, resolve_limits
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


def test_limits_fit_the_context_or_are_refused():
    def limits(**overrides):
        return resolve_limits(ServeSettings(model_dir=Path("unused"), **overrides), context=256)

    assert (limits().max_prompt_tokens, limits().max_tokens_cap) == (128, 128)  # defaults shrink to fit
    assert limits(max_tokens_cap=56).max_prompt_tokens == 200
    assert limits(max_prompt_tokens=250).max_tokens_cap == 6
    for bad in (
        dict(max_prompt_tokens=256),
        dict(max_tokens_cap=300),
        dict(max_prompt_tokens=200, max_tokens_cap=57),
        dict(max_tokens_cap=0),
    ):
        with pytest.raises(ValueError):
            limits(**bad)
