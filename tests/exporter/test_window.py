"""The sliding window: bounded by count and by age, expiring whole chunks."""

from __future__ import annotations

import numpy as np
import pytest

from layerwatch.exporter.window import SlidingWindow


def values(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.float32)


def test_keeps_the_newest_values_up_to_capacity() -> None:
    window = SlidingWindow(capacity=10)
    window.add(values(0, 4), now=0)
    window.add(values(4, 4), now=5)
    assert window.values().tolist() == list(range(8))
    window.add(values(8, 5), now=10)  # wraps around the ring
    assert len(window) == 10 and window.values().tolist() == list(range(3, 13))
    window.add(values(13, 25), now=20)  # more than the capacity at once
    assert window.values().tolist() == list(range(28, 38))


def test_expires_by_age_in_whole_chunks() -> None:
    window = SlidingWindow(capacity=100, max_age_seconds=60, granularity=1.0)
    window.add(values(0, 3), now=0.0)
    window.add(values(3, 2), now=0.5)  # within the granularity: same chunk as the first
    window.add(values(5, 4), now=30.0)
    window.expire(now=60.0)
    assert len(window) == 9
    window.expire(now=60.1)
    assert window.values().tolist() == [5, 6, 7, 8]
    window.expire(now=200.0)
    assert len(window) == 0 and window.values().tolist() == []
    window.add(values(9, 2), now=201.0)
    assert window.values().tolist() == [9, 10]


def test_overwritten_values_leave_the_chunk_counts_consistent() -> None:
    window = SlidingWindow(capacity=5, max_age_seconds=10)
    window.add(values(0, 4), now=0)
    window.add(values(4, 3), now=5)  # overwrites two values of the first chunk
    window.expire(now=10.5)  # the first chunk (2 values left) expires
    assert window.values().tolist() == [4, 5, 6]


def test_version_changes_with_the_contents() -> None:
    window = SlidingWindow(capacity=5, max_age_seconds=10)
    v0 = window.version
    window.add(values(0, 1), now=0)
    v1 = window.version
    window.expire(now=5)
    assert window.version == v1 != v0
    window.expire(now=11)
    assert window.version != v1


def test_refuses_an_empty_capacity() -> None:
    with pytest.raises(ValueError, match="positive"):
        SlidingWindow(capacity=0)
