"""The plugin inside a real `vllm serve` (the session's shared engine, tests/vllm_engine.py), on the real SmolLM2
with its shipped gates: full depth at τ 0 is stock vLLM token for token; at τ 0.18 vLLM skips what the shim's
engine skips for the same tokens; what vLLM executed is what its frames say under concurrent sampled load; and a
bad setting stops `vllm serve` with one line."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from layerwatch.skip_policy import SkipPolicyConfig
from layerwatch.wire import GateFrame
from tests.conftest import RealModel
from tests.vllm_engine import (
    SERVED_MODEL_NAME,
    START_TIMEOUT_SECONDS,
    VLLM_ENV,
    VllmEngine,
    plugin_overrides,
    require_vllm,
    run_helper,
    serve_argv,
)

from .shim_reference import Sequence, compare
from .stock_folder import stock_folder

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):"]
GREEDY_TOKENS = 40


def complete(engine: VllmEngine, prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """A greedy completion through the API -> (prompt token ids, generated token ids)."""
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = httpx.post(f"{engine.base_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    (choice,) = response.json()["choices"]
    return choice["prompt_token_ids"], choice["token_ids"]


def one_row_each(frames: list[GateFrame]) -> tuple[np.ndarray, np.ndarray]:
    """A lone sequence's frames -> its scores float32 [T, L] and skips bool [T, L], step by step."""
    assert all(frame.entropies.shape[0] == 1 for frame in frames)
    return np.concatenate([f.entropies for f in frames]), np.concatenate([f.skipped for f in frames])


def primed(engine: VllmEngine) -> int:
    """Once the frame port is open: one short request, then the number of frames the plugin has sent, which the
    next frame's sequence number is. Frames another test sent while the port was closed leave an ICMP error on the
    plugin's socket, which its next send reports instead of sending: that send is this request's frame."""
    complete(engine, "Hello", 1)
    (answer,) = engine.rpc("layerwatch_executed")
    return answer["frames"]


def test_at_threshold_zero_greedy_tokens_are_stock_vllms(vllm_engine: VllmEngine, tmp_path: Path) -> None:
    stock = stock_folder(vllm_engine.folder, tmp_path / "stock")
    expected = run_helper("offline_run.py", str(stock), str(GREEDY_TOKENS), json.dumps(PROMPTS))["runs"]
    with vllm_engine.threshold_set(0.0), vllm_engine.frames() as frames:
        first = primed(vllm_engine)
        served = [complete(vllm_engine, prompt, GREEDY_TOKENS) for prompt in PROMPTS]
        steps = sum(len(output_ids) for _, output_ids in served)  # one step row per generated token

        def rows() -> int:
            return sum(f.entropies.shape[0] for f in frames.taken() if f.sequence >= first)

        deadline = time.monotonic() + 10  # the last step's frame can trail its answer on a loaded machine
        while rows() < steps and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [(run["prompt_ids"], run["output_ids"]) for run in expected] == served
    received = [f for f in frames.taken() if f.sequence >= first]
    assert sum(f.entropies.shape[0] for f in received) == steps  # every step was gated ...
    assert not any(f.skipped.any() for f in received) and {f.threshold for f in received} == {0.0}  # ... at τ 0


def test_teacher_forced_decisions_are_the_shims_but_within_the_float32_bound_of_tau(vllm_engine: VllmEngine) -> None:
    sequences = []
    for prompt in PROMPTS:  # one at a time: each frame is that sequence's step
        with vllm_engine.frames() as frames:
            prompt_ids, output_ids = complete(vllm_engine, prompt, GREEDY_TOKENS)
        scores, skipped = one_row_each(frames.taken())
        sequences.append(Sequence(prompt_ids, output_ids, scores, skipped))
    assert sum(s.skipped.sum() for s in sequences) > 0  # vLLM really skipped layers
    comparison = compare(vllm_engine.folder, SkipPolicyConfig(threshold=vllm_engine.threshold), sequences)
    print(comparison)
    assert comparison.score_error <= comparison.bound
    assert not comparison.unexplained


def stream_chat(engine: VllmEngine, temperature: float, n: int, cancel_after: int | None = None) -> int:
    """A streamed sampled chat; with `cancel_after`, the connection is closed after that many chunks. -> chunks."""
    body = {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me about the history of Rome."}],
        "max_tokens": 48,
        "temperature": temperature,
        "n": n,
        "stream": True,
    }
    chunks = 0
    with httpx.stream("POST", f"{engine.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    break
    return chunks


def executed(engine: VllmEngine) -> tuple[np.ndarray, int]:
    (answer,) = engine.rpc("layerwatch_executed")
    return np.array(answer["skips"]), answer["step_rows"]


def test_executed_skips_equal_the_frames_under_concurrent_sampled_load(vllm_engine: VllmEngine) -> None:
    with vllm_engine.frames() as frames:
        first = primed(vllm_engine)
        skips_before, rows_before = executed(vllm_engine)
        runs = [(0.7, 1, None), (1.0, 2, None), (0.9, 3, None), (0.8, 1, 4), (1.0, 1, None)]  # n > 1; one cancelled
        threads = [threading.Thread(target=stream_chat, args=(vllm_engine, *run)) for run in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)

        def settled() -> tuple[np.ndarray, int]:  # the cancelled request's last step, if any, has run
            while True:
                first = executed(vllm_engine)
                time.sleep(1.0)
                if executed(vllm_engine)[1] == first[1]:
                    return first

        skips_after, rows_after = settled()
        received = [f for f in frames.taken() if f.sequence >= first]
    sequences = [f.sequence for f in received]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))  # none lost, none reordered
    frame_rows = sum(f.entropies.shape[0] for f in received)
    frame_skips = sum(f.skipped.sum(axis=0).astype(np.int64) for f in received)
    assert rows_after - rows_before == frame_rows > 8 * 30  # every sequence's steps
    assert (skips_after - skips_before).tolist() == frame_skips.tolist()
    assert frame_skips.sum() > 0
    assert {f.model_name for f in received} == {SERVED_MODEL_NAME}
    assert max(f.entropies.shape[0] for f in received) > 1  # the sequences shared steps


def test_a_bad_setting_stops_vllm_serve_with_one_line(real_model: RealModel, tmp_path: Path) -> None:
    require_vllm()
    argv = serve_argv(real_model.folder, 9, plugin_overrides({"threshold": 1.5}))
    log = tmp_path / "vllm.log"
    with open(log, "wb") as out:
        code = subprocess.run(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=VLLM_ENV | {"PATH": "/usr/bin:/bin"},
            timeout=START_TIMEOUT_SECONDS,
        ).returncode
    assert code != 0
    text = log.read_text()
    assert "layerwatch: threshold must be in [0, 1], got 1.5" in text, text[-3000:]


def test_vllm_features_the_gated_loop_cannot_serve_stop_start_up_with_one_line(real_model: RealModel) -> None:
    # LoRA: vLLM's LoRA layers take every token's adapter by its place in the batch; a layer's row subset killed the
    # engine (an einsum size error) once concurrent rows skipped differently.
    require_vllm()
    refusals = run_helper("unsupported_configs.py", str(real_model.folder))
    assert refusals == {
        "none": None,
        "pipeline parallelism, eager": "layerwatch: pipeline parallelism on CPU needs vLLM's compile warm-up: "
        "serve without --enforce-eager",
        "pipeline parallelism, compiled": None,
        "speculative decoding": "layerwatch: speculative decoding is not supported by the plugin",
        "LoRA": "layerwatch: LoRA adapters are not supported by the plugin",
    }
