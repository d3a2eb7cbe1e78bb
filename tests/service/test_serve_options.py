"""Options of `layerwatch serve` that change what is served or written: --reset-gates, --static-gates,
--trace-max-bytes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from layerwatch.demo.processes import LAYERWATCH_COMMAND
from layerwatch.inference_shim.service.shim import ServeSettings, ShimService, resolve_limits
from layerwatch.trace import read_trace
from tests.service.conftest import MODEL_NAME


def gates_sha256(server) -> str:
    return model_info(server)["gates_sha256"]


def test_reset_gates_serves_fresh_gates_and_says_so_in_model_info(in_process, tiny_checkpoint):
    file_sha = hashlib.sha256(tiny_checkpoint.gates_path.read_bytes()).hexdigest()
    reset = in_process(reset_gates=True)
    assert gates_sha256(reset) != file_sha
    body = {"model": MODEL_NAME, "prompt": "light", "max_tokens": 8, "temperature": 0}
    usage = httpx.post(f"{reset.base_url}/v1/completions", json=body, timeout=30).json()["usage"]
    assert usage["layers_skipped"] == 0  # fresh gates score near 0.5: nothing falls below 0.18


def test_static_gates_serve_constants_and_say_so_in_model_info(in_process, tiny_checkpoint):
    static = in_process(static_gates=True)
    assert gates_sha256(static) not in (tiny_checkpoint.gates_sha256, "")
    assert static.service.gate_watcher is None  # a reload would end the drill
    body = {"model": MODEL_NAME, "prompt": "light", "max_tokens": 12, "temperature": 0}
    usage = httpx.post(f"{static.base_url}/v1/completions", json=body, timeout=30).json()["usage"]
    # The tiny gates' layers 1 and 2 score far below 0.18 on every token: still skipped after the
    # patience (3), every token, as with the file's gates.
    assert usage["layers_skipped"] >= 2 * (12 - 3 - 1)
    gates = static.service.model.gates
    inputs = torch.randn(tiny_checkpoint.num_layers, 5, gates[0].fc1.in_features)
    scores = gates.scores(inputs)
    assert torch.allclose(scores, scores[:1].expand_as(scores))  # the same for every input


def test_reset_and_static_gates_exclude_each_other(tiny_checkpoint):
    settings = ServeSettings(model_dir=tiny_checkpoint.path, reset_gates=True, static_gates=True)
    with pytest.raises(ValueError, match="exclude each other"):
        ShimService.load(settings)


def test_static_gates_refuse_a_patience_they_were_not_measured_at(tiny_checkpoint):
    settings = ServeSettings(model_dir=tiny_checkpoint.path, static_gates=True, patience=5)
    with pytest.raises(ValueError, match="leave --patience unset"):
        ShimService.load(settings)


def model_info(server) -> dict[str, str]:
    [labels] = [dict(labels) for (name, labels), _ in server.metrics().items() if name == "layerwatch_model_info"]
    return labels


def test_the_gate_files_skip_rule_is_served_unless_the_command_line_says_otherwise(
    in_process, tiny_checkpoint, tmp_path
):
    ewma_file = tmp_path / "ewma-gates.safetensors"
    with safe_open(tiny_checkpoint.gates_path, "pt") as original:
        metadata = json.loads(original.metadata()["layerwatch_gates"])
    save_file(
        load_file(tiny_checkpoint.gates_path),
        ewma_file,
        metadata={"layerwatch_gates": json.dumps({**metadata, "skip_rule": "ewma", "ewma_alpha": 0.3})},
    )
    from_file = in_process(gates_path=ewma_file)
    assert (from_file.service.policy.skip_rule, from_file.service.policy.ewma_alpha) == ("ewma", 0.3)
    assert {k: model_info(from_file)[k] for k in ("skip_rule", "ewma_alpha")} == {
        "skip_rule": "ewma",
        "ewma_alpha": "0.3",
    }
    overridden = in_process(gates_path=ewma_file, skip_rule="streak")
    assert overridden.service.policy.skip_rule == "streak"
    assert model_info(overridden)["skip_rule"] == "streak" and model_info(overridden)["ewma_alpha"] == ""
    assert in_process(gates_path=ewma_file, ewma_alpha=0.7).service.policy.ewma_alpha == 0.7
    assert model_info(in_process())["skip_rule"] == "streak"  # the checkpoint's own file


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


WATCH_REFUSED = r"--gates-watch-seconds must be 0 \(never\) or a number from 0.1 to 86400, got"


@pytest.mark.parametrize(
    "override, message",
    [
        ({"max_waiting_requests": -1}, "--max-waiting-requests must be >= 0"),
        ({"drain_timeout_seconds": -1.0}, "--drain-timeout-seconds must be >= 0"),
        ({"drain_timeout_seconds": float("nan")}, "--drain-timeout-seconds must be >= 0"),
        # 1e300 would kill the watcher thread with OverflowError in Event.wait.
        *(({"gates_watch_seconds": s}, WATCH_REFUSED) for s in (float("nan"), 1e-9, 0.05, -1.0, float("inf"), 1e300)),
        ({"mitigation_minutes": 5e9}, "--mitigation-minutes must be a positive number of at most 525600"),
        ({"max_batch_size": 10**9}, "--max-batch-size 1000000000: the KV cache for 1000000000 sequences"),
        # Unguarded, a name with an escape sequence reaches label values and terminals.
        ({"model_name": "demo\x1b[2J"}, r"--model-name 'demo\\x1b\[2J' holds '\\x1b', which is not printable"),
    ],
)
def test_queue_drain_and_watch_settings_out_of_range_are_refused(tiny_checkpoint, override, message):
    with pytest.raises(ValueError, match=message):
        ShimService.load(ServeSettings(model_dir=tiny_checkpoint.path, exporter_address="", **override))


@pytest.mark.parametrize("address", ["255.255.255.255:9410", "[fe80::1]:9410"])
def test_an_exporter_address_frames_cannot_be_sent_to_is_refused_naming_the_flag(tiny_checkpoint, address):
    # Unguarded, connect's OSError ("[Errno 13] Permission denied") names nothing.
    host = address.rpartition(":")[0].strip("[]")
    message = rf"--exporter-address, --shim-id\): exporter address '{re.escape(address)}': cannot send to '{host}'"
    with pytest.raises(ValueError, match=message):
        ShimService.load(ServeSettings(model_dir=tiny_checkpoint.path, exporter_address=address))


@pytest.mark.parametrize(
    "flags, message",
    [
        # Unchecked, the first mitigating alert raises OverflowError; the mitigation never starts.
        (["--mitigation-minutes", "5e9"], "--mitigation-minutes must be a positive number of at most 525600"),
        (["--gates-watch-seconds", "1e300"], "--gates-watch-seconds must be 0 (never) or a number from 0.1"),
        (["--port", "70000"], "argument --port: must be 0..65535, got 70000"),  # was an OverflowError traceback
    ],
)
def test_serve_refuses_numbers_it_cannot_use_before_loading_the_model(tiny_checkpoint, flags, message):
    result = subprocess.run(
        [*LAYERWATCH_COMMAND, "serve", "--model", str(tiny_checkpoint.path), "--exporter-address", "", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "loading the model" not in result.stderr


def test_the_prompt_size_bound_is_the_token_limit_times_the_longest_token():
    assert (
        resolve_limits(ServeSettings(model_dir=Path("unused"), max_prompt_tokens=100), 256, 14).max_prompt_chars == 1400
    )
    assert resolve_limits(ServeSettings(model_dir=Path("unused")), 256, None).max_prompt_chars is None


def test_a_fifo_as_trace_file_stops_the_start_at_once(tiny_checkpoint, tmp_path):
    # Unchecked, serve waits in open() for a reader for ever, holding its port.
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    argv = ["serve", "--model", str(tiny_checkpoint.path), "--exporter-address", "", "--port", "0"]
    result = subprocess.run(
        [*LAYERWATCH_COMMAND, *argv, "--trace-file", str(fifo)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert f"cannot start: trace file {fifo}: not a regular file" in result.stderr
