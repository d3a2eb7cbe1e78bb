"""The quality guard: compare a sample of requests with the full-depth model, off the request path.

Whether a request is checked is decided when the engine thread admits it (`sample`: its own rate,
a mitigation's, or the configured one), whatever its sampling settings, so that the engine records,
for that sequence only, what the gated model's distribution said at each generated position
(layerwatch/inference_shim/runtime/agreement.py, `GatedRecord`). Once the request has been answered, its
prompt + generated tokens go through the model's full-depth forward in one teacher-forced pass, and
each generated position is compared with the record: the two argmaxes, KL(gated || full) (the
quality cost) and KL(full || gated) (the perplexity estimate), on the coarsened distributions of
agreement.py. docs/service.md, "Quality guard", says what is estimated and why.

Jobs run in the engine thread (the model is not shared across threads), between decode steps and
within a time budget (see `ShadowChecker.due`), so they never delay a step by more than one job
and never hold a client response: the request has already been answered when its job is queued.

With a `LayerSignalStats`, the same full-depth pass also measures every layer's signals (relative
update, gate score, attention KL) and folds them in (layer_signals.py); that work is part of the
job's time, so the duty cycle covers it too.

Every sampled request ends in one outcome of `layerwatch_shadow_requests_total` (SHADOW_OUTCOMES): checked,
queue_full (64 jobs waited), failed (the job raised), full_depth (the complexity pre-check moved it to
full depth after its prefill: nothing gated to check) or no_output (it failed, or generated nothing).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable

from layerwatch.gate_importance import LayerSignalStats
from layerwatch.inference_shim.runtime.agreement import GatedRecord, ShadowJob, ShadowResult, full_depth_agreement
from layerwatch.inference_shim.runtime.model import Transformer
from layerwatch.inference_shim.service.metrics import SHADOW_OUTCOMES, ShadowMetrics

log = logging.getLogger(__name__)

# Told a job's result and how many seconds it took (the request's audit span, when spans are on).
ShadowCallback = Callable[[ShadowResult, float], None]

QUEUE_LIMIT = 64  # sampled requests waiting for a re-check; beyond it new samples are not taken
DUTY_CYCLE = 0.1  # while requests are decoding, shadow work takes at most this share of the engine thread


class ShadowChecker:
    def __init__(
        self, model: Transformer, metrics: ShadowMetrics, rate: float, signals: LayerSignalStats | None = None
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"shadow rate must be in [0, 1], got {rate}")
        self._model = model
        self._metrics = metrics
        self._signals = signals
        self.rate = rate
        self._random = random.Random()
        self._jobs: deque[tuple[ShadowJob, ShadowCallback | None]] = deque()
        self._next_allowed = 0.0  # monotonic time before which a busy engine runs no shadow job

    def sample(self, rate: float | None = None) -> bool:
        """At admission: whether to check this request. `rate`: the request's own (a mitigation's,
        mitigation.py); None: the configured one."""
        rate = self.rate if rate is None else rate
        return rate > 0.0 and self._random.random() < rate

    def offer(
        self,
        prompt_ids: list[int],
        generated_ids: list[int],
        record: GatedRecord,
        on_result: ShadowCallback | None = None,
    ) -> None:
        """A sampled request was answered: queue its check. `on_result` is told the check's result
        once it has run."""
        if len(self._jobs) >= QUEUE_LIMIT:
            self.skip("queue_full")
            return
        self._jobs.append((ShadowJob(list(prompt_ids), list(generated_ids), record), on_result))

    def skip(self, outcome: str) -> None:
        """A sampled request that will not be checked, and why (one of SHADOW_OUTCOMES)."""
        if outcome not in SHADOW_OUTCOMES:
            raise ValueError(f"unknown shadow outcome {outcome!r}")
        self._metrics.requests[outcome].inc()

    def pending(self) -> int:
        return len(self._jobs)

    def due(self, engine_busy: bool) -> bool:
        """Whether to run a job now: always when idle, within the duty cycle while decoding."""
        return bool(self._jobs) and (not engine_busy or time.monotonic() >= self._next_allowed)

    def run_one(self) -> None:
        job, on_result = self._jobs.popleft()
        started = time.monotonic()
        try:
            result = full_depth_agreement(self._model, job, layer_signals=self._signals is not None)
            if self._signals is not None and result.layer_signals is not None:
                self._signals.observe(result.layer_signals)
        except Exception:  # a shadow failure must not take the engine thread down
            log.exception("shadow re-check failed")
            self.skip("failed")
            return
        finally:
            elapsed = time.monotonic() - started
            self._next_allowed = started + elapsed / DUTY_CYCLE
        self._metrics.observe(result)
        if on_result is not None:
            try:
                on_result(result, elapsed)
            except Exception:  # the audit span is a report on the job: it must not take the engine thread down
                log.exception("reporting a shadow re-check failed")
