"""Readiness: a real one-token generation through the gated path, cached for a few seconds.

A health check that bypasses the model proves nothing (docs/service.md, "Readiness"): `/readyz` succeeds only when the
probe went through the engine and its decode step produced a layer-activity record, i.e. every
layer's gate scored the token. Probes run one at a time; concurrent callers share the result.
"""

from __future__ import annotations

import asyncio
import time

from layerwatch.inference_shim.service.engine_worker import EngineWorker, ProbeResult

CACHE_SECONDS = 5.0
PROBE_TIMEOUT_SECONDS = 15.0  # a probe waits behind a full batch; longer than this is not ready


class Readiness:
    def __init__(
        self, worker: EngineWorker, cache_seconds: float = CACHE_SECONDS, timeout_seconds: float = PROBE_TIMEOUT_SECONDS
    ) -> None:
        self._worker = worker
        self._cache_seconds = cache_seconds
        self._timeout_seconds = timeout_seconds
        self._lock = asyncio.Lock()
        self._last: ProbeResult | None = None
        self._last_at = 0.0

    async def check(self) -> ProbeResult:
        async with self._lock:
            if self._last is not None and time.monotonic() - self._last_at < self._cache_seconds:
                return self._last
            if not self._worker.alive():
                return ProbeResult(False, "the engine thread is not running")
            try:
                result = await asyncio.wait_for(asyncio.wrap_future(self._worker.probe()), self._timeout_seconds)
            except TimeoutError:
                result = ProbeResult(False, f"the probe generation did not finish within {self._timeout_seconds:.0f} s")
            self._last, self._last_at = result, time.monotonic()
            return result
