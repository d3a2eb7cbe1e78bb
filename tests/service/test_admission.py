"""Admission counts the work a request brings, not requests: the batch slots its sequences take and the
prompt tokens it scores; a request of many sequences takes turns with those after it (issue 43, item 4)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from layerwatch.inference_shim.service.admission import ONE_SLOT, Admission, Weight
from layerwatch.inference_shim.service.schemas import APIError
from tests.support import wait_for

from .conftest import MODEL_NAME


def admitted(admission: Admission, sequences: int, scored_tokens: int = 0) -> Weight:
    admission.enter()
    weight = admission.weight(sequences, scored_tokens)
    admission.weigh(weight)
    return weight


def test_a_request_counts_the_batch_slots_its_prompts_and_choices_take():
    """Before: every request counted one. A request of 128 prompts took every batch slot as one
    request, beside 39 more (max_batch_size 8 + 32 waiting), and the gauges said 1 running."""
    admission = Admission(max_batch_size=8, max_waiting=4, running=lambda: 8, max_scored_tokens=100)
    big = admitted(admission, 128)  # alone: as the 8 slots it takes at once (its other sequences wait in the engine)
    assert (admission.admitted, admission.running(), admission.waiting()) == (8, 8, 0)
    admitted(admission, 3)
    admission.enter()
    with pytest.raises(APIError) as refused:  # 8 + 3 + 2 > 8 + 4
        admission.weigh(admission.weight(2))
    assert (
        refused.value.status == 429 and "this request takes 2 batch slots" in refused.value.body()["error"]["message"]
    )
    admission.leave(ONE_SLOT)  # as app.py leaves a request refused while being prepared
    admitted(admission, 1)
    with pytest.raises(APIError):  # 12 of 12: the next is refused before its body is read
        admission.check()
    admission.leave(big)
    assert admission.admitted == 4


def test_scored_prompt_tokens_count_against_a_budget_requests_that_score_nothing_never_meet():
    """Before: a request scoring 128 prompts of 1,000 tokens counted as 8 slots, like 8 short chats:
    five of them filled the queue (429 for every chat) and two held every batch slot."""
    admission = Admission(max_batch_size=8, max_waiting=32, running=lambda: 0, max_scored_tokens=4000)
    assert admitted(admission, 2, 120) == Weight(2, 120)  # a small scoring request counts its tokens
    admission.enter()
    with pytest.raises(APIError) as refused:  # 120 + 4000 (128 x 999, counted as the whole budget) > 4000
        admission.weigh(admission.weight(128, 128 * 999))
    message = refused.value.body()["error"]["message"]
    assert "120 prompt tokens are being scored, at most 4000 at once, and this request counts 4000" in message
    admission.leave(ONE_SLOT)
    admission.leave(Weight(2, 120))
    big = admitted(admission, 128, 128 * 999)  # alone it is admitted: larger than the budget is not refused for good
    for _ in range(24):  # the queue stays open to requests that score nothing, as without it
        assert admitted(admission, 1) == Weight(1, 0)
    admission.enter()
    with pytest.raises(APIError):  # another scoring request waits its turn
        admission.weigh(admission.weight(1, 10))
    admission.leave(ONE_SLOT)
    admission.leave(big)
    assert admitted(admission, 1, 10) == Weight(1, 10)


def test_chats_finish_first_while_prompts_are_scored_and_a_second_scoring_request_waits_its_turn(in_process):
    """Before: one /v1/completions of 128 scored token-id prompts (echo, logprobs) held every batch
    slot until its last prompt was scored; three 4-token chats sent meanwhile got 0 tokens in 60 s.
    Then: admitted beside it, a second scoring request took the other half of the slots."""
    server = in_process(max_batch_size=4)  # max_prompt_tokens 64: 2 scoring slots x 64 = 128 tokens scored at once
    prompts = [[(7 * i + j) % 300 + 3 for j in range(60)] for i in range(16)]
    big = {"model": MODEL_NAME, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}
    second = big | {"prompt": prompts[:2]}  # 118 tokens scored
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "the earth"}], "max_tokens": 4}
    finished: dict[str, float] = {}

    def post(name: str, path: str, body: dict) -> httpx.Response:
        response = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
        finished[name] = time.monotonic()
        return response

    with ThreadPoolExecutor(4) as pool:
        scoring = pool.submit(post, "big", "/v1/completions", big)
        wait_for(lambda: server.service.admission.scored_tokens > 0, what="the scoring request admitted")
        refused = post("second", "/v1/completions", second)
        chats = [pool.submit(post, f"chat{i}", "/v1/chat/completions", chat) for i in range(3)]
        responses = [future.result() for future in [scoring, *chats]]
    assert refused.status_code == 429 and "128 prompt tokens are being scored" in refused.text, refused.text
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:300] for r in responses]
    assert max(finished[f"chat{i}"] for i in range(3)) < finished["big"], finished
    assert post("second", "/v1/completions", second).status_code == 200  # its turn came
