"""Admission counts the batch slots a request's sequences take, not requests (issue 43, item 4)."""

from __future__ import annotations

import pytest

from layerwatch.inference_shim.service.admission import Admission
from layerwatch.inference_shim.service.schemas import APIError


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
