"""The quality guard: re-score a sample of finished requests at full depth, off the request path.

A sampled request's prompt + generated tokens go through the model's full-depth forward in one
teacher-forced pass; at each generated position the full-depth top-1 token is compared with the
token the gated model produced. Only greedy requests (temperature 0) are sampled: for them the
produced token *is* the gated top-1, so a disagreement means skipping changed the output; for
sampled requests it would mostly measure the sampling.

Jobs run in the engine thread (the model is not shared across threads), between decode steps and
within a time budget (see `ShadowChecker.due`), so they never delay a step by more than one job
and never hold a client response: the request has already been answered when its job is queued.

With a `LayerSignalStats`, the same full-depth pass also measures every layer's signals (relative
update, gate score, attention KL) and folds them in (layer_signals.py); that work is part of the
job's time, so the duty cycle covers it too.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable

from inference_shim.runtime.agreement import ShadowJob, ShadowResult, full_depth_agreement
from inference_shim.runtime.model import Transformer
from inference_shim.service.metrics import ShadowMetrics
from layerwatch.gate_importance import LayerSignalStats

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

    def offer(
        self,
        prompt_ids: list[int],
        generated_ids: list[int],
        greedy: bool,
        rate: float | None = None,
        on_result: ShadowCallback | None = None,
    ) -> None:
        """Called for every request that finished normally; keeps a `rate` sample of greedy ones.
        `rate`: the request's own (a mitigation's, mitigation.py); None: the configured one.
        `on_result` is told the check's result once it has run."""
        rate = self.rate if rate is None else rate
        if not greedy or not generated_ids or rate == 0.0 or len(self._jobs) >= QUEUE_LIMIT:
            return
        if self._random.random() < rate:
            self._jobs.append((ShadowJob(list(prompt_ids), list(generated_ids)), on_result))

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
            return
        finally:
            elapsed = time.monotonic() - started
            self._next_allowed = started + elapsed / DUTY_CYCLE
        self._metrics.tokens.inc(result.tokens)
        self._metrics.agreements.inc(result.agreements)
        if on_result is not None:
            try:
                on_result(result, elapsed)
            except Exception:  # the audit span is a report on the job: it must not take the engine thread down
                log.exception("reporting a shadow re-check failed")
