"""Admission counts the batch slots a request's sequences take, not requests, and a request of many
sequences takes turns with those after it (issue 43, item 4)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from layerwatch.inference_shim.service.admission import Admission
from layerwatch.inference_shim.service.schemas import APIError

from .conftest import MODEL_NAME


def admitted(admission: Admission, sequences: int) -> None:
    admission.enter()
    admission.weigh(sequences)


def test_a_request_counts_the_batch_slots_its_prompts_and_choices_take():
    """Before: every request counted one. A request of 128 prompts took every batch slot as one
    request, beside 39 more (max_batch_size 8 + 32 waiting), and the gauges said 1 running."""
    admission = Admission(max_batch_size=8, max_waiting=4, running=lambda: 8)
    admitted(admission, 128)  # alone: as the 8 slots it takes at once (its other sequences wait in the engine)
    assert (admission.admitted, admission.running(), admission.waiting()) == (8, 8, 0)
    admitted(admission, 3)
    admission.enter()
    with pytest.raises(APIError) as refused:  # 8 + 3 + 2 > 8 + 4
        admission.weigh(2)
    assert (
        refused.value.status == 429 and "this request takes 2 batch slots" in refused.value.body()["error"]["message"]
    )
    admission.leave()  # as app.py leaves a request refused while being prepared
    admitted(admission, 1)
    with pytest.raises(APIError):  # 12 of 12: the next is refused before its body is read
        admission.check()
    admission.leave(admission.weight(128))
    assert admission.admitted == 4


def test_chats_sent_during_a_request_of_many_scored_prompts_finish_first(in_process):
    """Before: one /v1/completions of 128 scored token-id prompts (echo, logprobs) held every batch
    slot until its last prompt was scored; three 4-token chats sent meanwhile got 0 tokens in 60 s."""
    server = in_process(max_batch_size=4)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(60)] for i in range(16)]
    big = {"model": MODEL_NAME, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "the earth"}], "max_tokens": 4}
    finished: dict[str, float] = {}

    def post(name: str, path: str, body: dict) -> None:
        response = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
        assert response.status_code == 200, response.text[:300]
        finished[name] = time.monotonic()

    with ThreadPoolExecutor(4) as pool:
        scoring = pool.submit(post, "big", "/v1/completions", big)
        time.sleep(0.3)  # its prompts are scoring
        chats = [pool.submit(post, f"chat{i}", "/v1/chat/completions", chat) for i in range(3)]
        for future in [scoring, *chats]:
            future.result()
    assert max(finished[f"chat{i}"] for i in range(3)) < finished["big"], finished
