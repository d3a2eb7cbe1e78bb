"""The shim's side of the parity checks runs on one torch thread: on a machine shared with vLLM's worker, two
spinning OpenMP threads slow its decode steps tenfold."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
