"""One generation request after validation: hand it to the engine thread, follow its updates,
answer in OpenAI's shapes (whole or as server-sent events), and count it exactly once.

The counters a request updates (`layerwatch_requests_total`, `layerwatch_tokens_total`, latency,
its own skip fraction and token-dependent share) are computed from the same updates that make up
the client's `usage`, when the final update
arrives and before the response is sent, so a scrape after the response sees them. A client that
goes away cancels its generation; the request is then counted as `cancelled` with the tokens it
had generated until the engine stopped it (those tokens were decoded and are in the layer
counters too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from starlette.requests import Request

from inference_shim.runtime.engine import SamplingParams, SequenceUpdate
from inference_shim.service.engine_worker import EngineFailure, RequestHandle
from inference_shim.service.metrics import FinishedRequest
from inference_shim.service.schemas import APIError
from layerwatch.request_tail import RequestLayers

if TYPE_CHECKING:
    from inference_shim.service.shim import ShimService

log = logging.getLogger(__name__)

ACTIVITY_HEADER = "x-layerwatch-layer-activity"
ACTIVITY_EVENT = "layerwatch.layer_activity"


@dataclass(frozen=True)
class Prepared:
    """A validated generation request."""

    kind: Literal["completion", "chat"]
    request_id: str
    model_name: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    debug: bool  # return the per-token layer activity


class Generation:
    _draining: set[asyncio.Task] = set()  # background tasks of abandoned streams (kept referenced)

    def __init__(self, service: ShimService, prepared: Prepared, arrived: float) -> None:
        self.service = service
        self.prepared = prepared
        self.arrived = arrived
        self.created = int(time.time())
        self.handle = RequestHandle(
            prepared.prompt_ids, prepared.params, asyncio.get_running_loop(), capture_activity=prepared.debug
        )
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.gaps: list[float] = []
        self.final: SequenceUpdate | None = None
        self.recorded = False
        self.abandoned = False

    def start(self) -> None:
        self.service.worker.submit(self.handle)

    async def next(self) -> SequenceUpdate:
        """The next update; raises APIError when the engine could not serve the request."""
        item = await self.handle.updates.get()
        if isinstance(item, EngineFailure):
            self._record("client_error" if item.client_error else "server_error")
            raise item.api_error()
        now = time.monotonic()
        for _ in item.new_token_ids:
            if self.last_token_at is None:
                self.first_token_at = now
            else:
                self.gaps.append(now - self.last_token_at)
            self.last_token_at = now
        self.completion_tokens += len(item.new_token_ids)
        if item.finished:
            self.final = item
            self._record("cancelled" if item.finish_reason == "cancelled" else "ok")
        return item

    def cancel(self) -> None:
        if self.final is None:
            self.service.worker.cancel(self.handle)

    def abandon(self) -> None:
        """The client is gone: cancel, and count the request once the engine has stopped it.

        A no-op for a request already counted, so it is safe to call however a response ended.
        """
        if self.recorded or self.abandoned:
            return
        self.abandoned = True
        self.cancel()
        task = asyncio.get_running_loop().create_task(self._drain())
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _drain(self) -> None:
        try:
            while not self.recorded:
                await self.next()
        except APIError:
            pass  # already counted as an error

    def _record(self, status: str) -> None:
        if self.recorded:
            return
        self.recorded = True
        self.service.admission.leave()
        # A prompt the engine refused was never prefilled.
        prompt_tokens = 0 if status == "client_error" else len(self.prepared.prompt_ids)
        log.info(
            "%s: %s, %d prompt + %d completion tokens",
            self.prepared.request_id,
            status,
            prompt_tokens,
            self.completion_tokens,
        )
        self.service.request_metrics.finish(
            FinishedRequest(
                status=status,
                prompt_tokens=prompt_tokens,
                completion_tokens=self.completion_tokens,
                time_to_first_token=None if self.first_token_at is None else self.first_token_at - self.arrived,
                inter_token_latencies=self.gaps,
                duration=time.monotonic() - self.arrived,
                layers=self._layers(),
            )
        )

    def _layers(self) -> RequestLayers | None:
        """The request's decode steps per layer, from the engine's final update (None without one)."""
        counts = self.final.layer_counts if self.final is not None else None
        if counts is None:
            return None
        return RequestLayers(counts.tokens, counts.skipped, counts.below_threshold)

    # --- what the client gets ----------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        final = self.final
        prompt = len(self.prepared.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "layers_executed": final.layers_executed if final else 0,
            "layers_skipped": final.layers_skipped if final else 0,
        }

    def activity_json(self) -> str:
        rows = [[int(ran) for ran in token] for token in self.handle.activity]
        return json.dumps(rows, separators=(",", ":"))

    def envelope(self, chunk: bool) -> dict[str, Any]:
        p = self.prepared
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if p.kind == "chat" else "text_completion"
        return {"id": p.request_id, "object": kind, "created": self.created, "model": p.model_name}

    def response(self, text: str) -> dict[str, Any]:
        if self.final is None:
            raise RuntimeError(f"{self.prepared.request_id}: response() before the generation finished")
        reason = self.final.finish_reason
        if self.prepared.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {**self.envelope(chunk=False), "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.prepared.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return {**self.envelope(chunk=True), "choices": [choice]}


async def run_to_end(generation: Generation, request: Request) -> str:
    """Collect a whole generation (non-streaming); a disconnect cancels it. Returns the text."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, generation))
    parts = []
    try:
        while generation.final is None:
            parts.append((await generation.next()).text_delta)
    finally:
        watcher.cancel()
    return "".join(parts)


async def _cancel_on_disconnect(request: Request, generation: Generation) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    generation.cancel()


async def stream_events(generation: Generation) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's streaming format, ending with `data: [DONE]`.

    With `stream_options.include_usage` a last chunk carries `usage`; with the debug header a
    final `layerwatch.layer_activity` event carries the per-token layer activity. If the client
    disconnects, Starlette cancels the stream (possibly before this generator has started), and the
    response's background task abandons the generation.
    """
    p = generation.prepared
    try:
        if p.kind == "chat":
            yield _sse(generation.chunk("", role=True))
        while generation.final is None:
            update = await generation.next()
            if update.text_delta or update.finished:
                yield _sse(generation.chunk(update.text_delta, update.finish_reason))
        if p.include_usage:
            yield _sse({**generation.envelope(chunk=True), "choices": [], "usage": generation.usage()})
        if p.debug:
            yield f'event: {ACTIVITY_EVENT}\ndata: {{"layer_activity": {generation.activity_json()}}}\n\n'
        yield "data: [DONE]\n\n"
    except APIError as err:  # the engine failed the request, or the drain timeout cut it off
        yield _sse(err.body())
        yield "data: [DONE]\n\n"  # the stream still ends the way clients wait for
    finally:
        generation.abandon()  # servers that raise on a disconnected send skip the background task


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
