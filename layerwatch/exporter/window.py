"""The sliding window of raw entropies that feeds the bimodality check (and, with dtype uint8, the
per-token routing codes that feed the routing statistics).

A ring buffer of float32 values, bounded two ways: at most `capacity` values, and nothing older
than `max_age_seconds`. Ages are tracked per chunk, not per value: values arriving within
`granularity` seconds of each other share one chunk, so expiry costs O(chunks) and the chunk
list stays small (≈ max_age / granularity) however fast frames arrive.
"""

from __future__ import annotations

import collections
import math

import numpy as np


class SlidingWindow:
    def __init__(
        self,
        capacity: int,
        max_age_seconds: float = math.inf,
        granularity: float = 1.0,
        dtype: np.dtype | type = np.float32,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"window capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.max_age_seconds = max_age_seconds
        self.granularity = granularity
        self._ring = np.empty(capacity, dtype=dtype)
        self._end = 0  # next write position
        self._size = 0
        self._chunks: collections.deque[list] = collections.deque()  # [start time, value count]
        self.version = 0  # changes whenever the contents change (for caching the statistics)

    def __len__(self) -> int:
        return self._size

    def add(self, values: np.ndarray, now: float) -> None:
        values = values.ravel()[-self.capacity :]
        n = len(values)
        if n == 0:
            return
        first = min(n, self.capacity - self._end)
        self._ring[self._end : self._end + first] = values[:first]
        self._ring[: n - first] = values[first:]
        self._end = (self._end + n) % self.capacity
        if self._chunks and now - self._chunks[-1][0] < self.granularity:
            self._chunks[-1][1] += n
        else:
            self._chunks.append([now, n])
        overwritten = max(0, self._size + n - self.capacity)
        self._size = min(self._size + n, self.capacity)
        self._drop_oldest(overwritten)
        self.version += 1

    def expire(self, now: float) -> None:
        """Forget chunks older than max_age_seconds."""
        oldest_allowed = now - self.max_age_seconds
        expired = 0
        while self._chunks and self._chunks[0][0] < oldest_allowed:
            expired += self._chunks.popleft()[1]
        if expired:
            self._size -= expired
            self.version += 1

    def values(self) -> np.ndarray:
        """A copy of the values held, oldest first."""
        start = (self._end - self._size) % self.capacity
        if start + self._size <= self.capacity:
            return self._ring[start : start + self._size].copy()
        return np.concatenate((self._ring[start:], self._ring[: self._end]))

    def _drop_oldest(self, excess: int) -> None:
        """The ring overwrote the oldest values: take them off the oldest chunks' counts."""
        while excess > 0:
            oldest = self._chunks[0]
            if oldest[1] <= excess:
                excess -= oldest[1]
                self._chunks.popleft()
            else:
                oldest[1] -= excess
                excess = 0
