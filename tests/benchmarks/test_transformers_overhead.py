"""benchmarks/transformers_overhead.py on a tiny routed model: both runs of every pair generate the same
tokens, only the observed one sends frames, one per step."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("transformers")

from benchmarks.transformers_overhead import run_case
from examples.router_llama import THRESHOLD, routed_llama
from layerwatch.client import GateFrameSender


def test_a_case_pairs_bare_and_observed_runs_of_the_same_generation():
    model = routed_llama(layers=2, hidden_size=32)
    model.generation_config.eos_token_id = None
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    with GateFrameSender(f"127.0.0.1:{receiver.getsockname()[1]}", "bench", 2, THRESHOLD) as sender:
        result = run_case(model, sender, batch_size=2, tokens=3, repeats=2)  # asserts equal outputs itself
    receiver.close()
    assert {key: len(values) for key, values in result.items()} == dict.fromkeys(
        ("bare", "observed", "ratio", "ratio_wall", "step_us", "hooks_us"), 2
    )
    assert sender.sent == 2 * 3 and sum(sender.dropped.values()) == 0  # observed runs only, a frame per step
    assert all(value > 0 for value in result["bare"] + result["observed"] + result["ratio"] + result["hooks_us"])
