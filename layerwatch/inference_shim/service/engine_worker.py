"""The engine thread: the one place the model runs, fed by HTTP handlers through a queue.

HTTP handlers (asyncio) hand a `RequestHandle` to `EngineWorker.submit`; the worker thread admits
it into the engine at the next step boundary, where it joins the running batch (continuous
batching, up to the engine's max batch size). After every `engine.step()` each row's
`SequenceUpdate` goes back to its handler's asyncio queue via `loop.call_soon_threadsafe`.
Cancellation (client gone) travels the same queue and takes effect at the next step boundary.

Between steps the worker also runs readiness probes (real one-token generations, whose rows are
kept out of the telemetry so that metrics describe client traffic only) and shadow re-checks. A
request is sampled for its shadow check when it is admitted (the engine then records its gated
distribution) and offered to the checker once it has been answered.
If a step raises, every in-flight request fails with a server error and the engine is rebuilt:
the failed engine's state is unknown, and a model that cannot run then fails each request and
each readiness probe on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from layerwatch.inference_shim.runtime.engine import (
    GenerationEngine,
    PrefillRecord,
    SamplingParams,
    SequenceUpdate,
    StepHook,
    StepRecord,
)
from layerwatch.inference_shim.runtime.model import GateBank
from layerwatch.inference_shim.service.depth import DepthDecider, DepthDecision
from layerwatch.inference_shim.service.schemas import APIError, server_error
from layerwatch.inference_shim.service.shadow import ShadowCallback, ShadowChecker
from layerwatch.inference_shim.service.telemetry import StepTelemetry

log = logging.getLogger(__name__)

EngineFactory = Callable[[StepHook], GenerationEngine]


@dataclass(frozen=True)
class EngineFailure:
    """Delivered instead of an update when the request cannot be served."""

    message: str
    client_error: bool = False  # the engine refused the input (400), rather than failing (500)
    shutting_down: bool = False  # cut off when the drain timed out (503: worth retrying elsewhere)

    def api_error(self) -> APIError:
        if self.client_error:
            return APIError(400, self.message)
        if self.shutting_down:
            return APIError(503, self.message, type="server_error", code="server_shutting_down")
        return server_error(self.message)


@dataclass
class RequestHandle:
    """One generation's link between its HTTP handler (event loop) and the engine thread."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    capture_activity: bool = False  # debug header: keep per-token layer activity
    # The depth it runs at (decided before prefill; the engine thread may revise it after the
    # prefill) and its prompt's complexity score (set after the prefill). None: the policy's tau.
    depth: DepthDecision | None = None
    complexity: float | None = None
    shadow_rate: float | None = None  # its own shadow check rate (a mitigation's); None: the checker's
    request_id: str | None = None  # names the request in the engine's log lines
    on_shadow_result: ShadowCallback | None = None  # told the choice's shadow re-check, if one runs
    shadowed: bool = False  # sampled for a shadow check at admission (its gated distribution is recorded)
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)  # SequenceUpdate | EngineFailure
    # Written by the engine thread; read by the handler once the final update has arrived.
    sequence_id: int | None = None
    generated_ids: list[int] = field(default_factory=list)
    activity: list[np.ndarray] = field(default_factory=list)  # bool [L] per token, True = the layer ran

    def deliver(self, item: SequenceUpdate | EngineFailure) -> None:
        # RuntimeError: the event loop is closed; the server is gone and nobody is waiting.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.updates.put_nowait, item)


@dataclass(frozen=True)
class ProbeResult:
    ready: bool
    reason: str


@dataclass
class _Probe:
    future: Future
    saw_layer_activity: bool = False


_STOP = object()


class EngineWorker:
    def __init__(
        self,
        engine_factory: EngineFactory,
        probe_prompt_ids: list[int],
        telemetry: StepTelemetry | None = None,
        shadow: ShadowChecker | None = None,
        depth: DepthDecider | None = None,
        gated: bool = True,
    ) -> None:
        """`depth` None: no complexity pre-check after the prefill. `gated` False: the model is served
        without gates (--no-gates), so the readiness probe asks that every layer ran, not that every gate scored."""
        self._engine_factory = engine_factory
        self._depth = depth
        self._gated = gated
        self._probe_prompt_ids = probe_prompt_ids
        self._telemetry = telemetry
        self._shadow = shadow
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[int, RequestHandle] = {}
        self._capturing: dict[int, RequestHandle] = {}
        self._probes: dict[int, _Probe] = {}
        self._engine: GenerationEngine  # built by start(), before the engine thread runs
        self._thread = threading.Thread(target=self._run, name="layerwatch-engine", daemon=True)
        self._telemetry_failed = False
        self._cut_message: str | None = None  # set by cut(): every request is failed with it from then on
        # Client sequences holding a batch slot after the last step (written by the engine thread only).
        self.running = 0

    # --- called from any thread --------------------------------------------------------------------

    def start(self) -> None:
        # The first engine is built here, so that a model that cannot even be set up fails start-up.
        self._engine = self._engine_factory(self._on_step)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, handle: RequestHandle) -> None:
        self._inbox.put(("submit", handle))

    def cancel(self, handle: RequestHandle) -> None:
        self._inbox.put(("cancel", handle))

    def cut(self, message: str) -> None:
        """Fail every request in flight, and every one submitted later, as cut off by the shutdown."""
        self._inbox.put(("cut", message))

    def probe(self) -> Future:
        """A real one-token generation; resolves to a ProbeResult."""
        future: Future = Future()
        self._inbox.put(("probe", future))
        return future

    def swap_gates(self, gates: GateBank) -> Future:
        """Attach `gates` to the model between two decode steps; resolves once they serve."""
        future: Future = Future()
        self._inbox.put(("gates", (gates, future)))
        return future

    # --- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        self._engine.prepare_depth()  # in this thread: the one that decodes (shim.py says why)
        while True:
            busy = self._engine.has_work()
            idle_work = self._shadow is not None and self._shadow.pending() > 0
            if not self._drain_inbox(block=not busy and not idle_work):
                break
            if self._engine.has_work():
                self._step()
            if self._shadow is not None and self._shadow.due(engine_busy=self._engine.has_work()):
                self._shadow.run_one()
        self._fail_all("the server is shutting down")

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                return False
            kind, payload = command
            if kind == "submit":
                self._admit(payload)
            elif kind == "cancel":
                if payload.sequence_id in self._handles:
                    self._engine.cancel(payload.sequence_id)
            elif kind == "probe":
                self._start_probe(payload)
            elif kind == "gates":
                self._attach_gates(*payload)
            elif kind == "cut":
                self._cut(payload)

    def _admit(self, handle: RequestHandle) -> None:
        if self._cut_message is not None:
            handle.deliver(EngineFailure(self._cut_message, shutting_down=True))
            return
        depth, after_prefill = handle.depth, None
        if depth is not None and self._depth is not None:
            after_prefill = functools.partial(self._after_prefill, self._depth, handle)
        handle.shadowed = self._sample_shadow(handle)
        try:
            handle.sequence_id = self._engine.submit(
                handle.prompt_ids,
                handle.params,
                threshold=None if depth is None else depth.threshold,
                request_id=handle.request_id,
                after_prefill=after_prefill,
                record=handle.shadowed,
            )
        except ValueError as exc:  # input the engine refuses (the HTTP layer checks limits first)
            handle.deliver(EngineFailure(str(exc), client_error=True))
            return
        except Exception as exc:
            log.exception("the engine could not admit a request")
            handle.deliver(EngineFailure(f"the engine could not admit the request: {exc}"))
            return
        self._handles[handle.sequence_id] = handle
        if handle.capture_activity:
            self._capturing[handle.sequence_id] = handle

    def _sample_shadow(self, handle: RequestHandle) -> bool:
        """Whether to shadow-check the request, whatever its sampling settings. A run at full depth by
        its depth decision has nothing gated to check: its check would always agree and dilute the
        agreement ratio the shadow alert reads (nor does a request that generates nothing)."""
        full_depth = handle.depth is not None and handle.depth.mode == "full"
        if self._shadow is None or full_depth or handle.params.max_tokens == 0:
            return False
        return self._shadow.sample(handle.shadow_rate)

    @staticmethod
    def _after_prefill(decider: DepthDecider, handle: RequestHandle, record: PrefillRecord) -> float:
        """The complexity pre-check, between the prefill and the first decode step."""
        assert handle.depth is not None
        handle.depth, handle.complexity = decider.after_prefill(handle.depth, record.entropies)
        return handle.depth.threshold

    def _cut(self, message: str) -> None:
        self._cut_message = message
        for sequence_id in self._handles:
            self._engine.cancel(sequence_id)  # stopped at the next step boundary; nobody reads them any more
        self._fail_all(message, shutting_down=True)

    def _start_probe(self, future: Future) -> None:
        try:
            sequence_id = self._engine.submit(self._probe_prompt_ids, SamplingParams(max_tokens=1, temperature=0.0))
        except Exception as exc:
            future.set_result(ProbeResult(False, f"the engine refused the probe: {exc}"))
            return
        self._probes[sequence_id] = _Probe(future)

    def _attach_gates(self, gates: GateBank, future: Future) -> None:
        # Here, between two steps, no step can run with half of one gate bank and half of another.
        self._engine.model.attach_gates(gates)
        future.set_result(None)

    def _step(self) -> None:
        try:
            updates = self._engine.step()
        except Exception as exc:
            log.exception("decode step failed; failing %d request(s) and rebuilding the engine", len(self._handles))
            self._fail_all(f"the model failed to run: {type(exc).__name__}: {exc}")
            self._engine = self._engine_factory(self._on_step)
            return
        for update in updates:
            self._dispatch(update)
        self.running = len(self._engine.running_ids() & self._handles.keys())

    def _dispatch(self, update: SequenceUpdate) -> None:
        sequence_id = update.sequence_id
        if sequence_id in self._probes:
            if update.finished:
                self._finish_probe(self._probes.pop(sequence_id), update.error)
            return
        handle = self._handles.get(sequence_id)
        if handle is None:
            return
        handle.generated_ids.extend(update.new_token_ids)
        # A sequence that failed alone (the rest of the batch goes on) fails its request alone.
        handle.deliver(update if update.error is None else EngineFailure(update.error))
        if update.finished:
            del self._handles[sequence_id]
            self._capturing.pop(sequence_id, None)
            if handle.shadowed:
                self._offer_shadow(handle, update)

    def _offer_shadow(self, handle: RequestHandle, update: SequenceUpdate) -> None:
        """A sampled request's final update: its check, or why there is none. A cancelled request is
        checked too: the tokens it generated were served."""
        assert self._shadow is not None  # only then is a request sampled
        if handle.depth is not None and handle.depth.mode == "full":  # the complexity pre-check, after prefill
            self._shadow.skip("full_depth")
        elif update.finish_reason == "error" or not handle.generated_ids or update.gated_record is None:
            self._shadow.skip("no_output")
        else:
            self._shadow.offer(handle.prompt_ids, handle.generated_ids, update.gated_record, handle.on_shadow_result)

    @staticmethod
    def _finish_probe(probe: _Probe, error: str | None) -> None:
        if error is not None:
            probe.future.set_result(ProbeResult(False, error))
        elif probe.saw_layer_activity:
            probe.future.set_result(ProbeResult(True, "a one-token generation ran through the model's layers"))
        else:
            probe.future.set_result(ProbeResult(False, "the probe generated without a layer-activity record"))

    def _fail_all(self, message: str, shutting_down: bool = False) -> None:
        for handle in self._handles.values():
            handle.deliver(EngineFailure(message, shutting_down=shutting_down))
            if handle.shadowed and self._shadow is not None:
                self._shadow.skip("no_output")
        for probe in self._probes.values():
            probe.future.set_result(ProbeResult(False, message))
        self._handles.clear()
        self._capturing.clear()
        self._probes.clear()
        self.running = 0

    def _on_step(self, record: StepRecord) -> None:
        """The engine's step hook: split off probe rows, then hand client rows to telemetry."""
        sequence_ids, entropies, skipped = record.sequence_ids, record.entropies, record.skipped
        executed_skipped, fallback_started = record.executed_skipped, record.fallback_started
        if self._probes:
            is_probe = np.isin(sequence_ids, np.fromiter(self._probes, dtype=np.int64))
            for row in np.flatnonzero(is_probe).tolist():
                # Layer activity = every layer's gate produced a finite entropy for this token (without
                # gates: every layer ran for it).
                activity = np.isfinite(entropies[row]).all() if self._gated else not skipped[row].any()
                self._probes[int(sequence_ids[row])].saw_layer_activity = bool(activity)
            if is_probe.all():
                return
            client = ~is_probe
            sequence_ids, entropies, skipped = sequence_ids[client], entropies[client], skipped[client]
            executed_skipped, fallback_started = executed_skipped[client], fallback_started[client]
        if self._capturing:
            for row, sequence_id in enumerate(sequence_ids.tolist()):
                handle = self._capturing.get(sequence_id)
                if handle is not None:
                    handle.activity.append(~skipped[row])
        if self._telemetry is None:
            return
        try:
            self._telemetry(entropies, skipped, executed_skipped, record.batch_skipped, fallback_started)
        except Exception:  # telemetry must never break decoding; say so once
            if not self._telemetry_failed:
                log.exception("telemetry failed in the step hook (decoding continues)")
                self._telemetry_failed = True
