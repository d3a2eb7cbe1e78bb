"""One generation request after validation: hand its sequences to the engine thread, follow
their updates, answer in OpenAI's shapes (whole or as server-sent events), and count each once.

A request asks for one or more choices: `n` per prompt, and completions may carry several
prompts. Each choice is one engine sequence (`Choice`), counted in the metrics as one request:
`layerwatch_requests_total`, `layerwatch_tokens_total`, latency, its own skip fraction and
token-dependent share are computed from the same updates that make up the client's `usage`, when
the final update arrives and before the response is sent, so a scrape after the response sees
them. A client that goes away cancels every choice; each is then counted as `cancelled` with the
tokens it had generated until the engine stopped it (those tokens were decoded and are in the
layer counters too). A choice that fails fails the request, and the other choices are cancelled.
The updates are taken as the engine makes them, whether or not the client reads the answer
(`Generation._follow`): a request is counted, and leaves admission, when its generation ends; a
client that stops reading cannot hold its admission slot for good.

With the audit trail on (audit.py), a request also has a span from its arrival until its last
choice is counted, ended with a `RequestRecord` of the same numbers.

Log-probabilities are the served model's (`TokenLogprob`): generated tokens' from the gated decode
step that produced them, prompt tokens' from the gated decode steps that scored the prompt
teacher-forced (the engine's module doc).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from starlette.requests import Request

from layerwatch.inference_shim.runtime.agreement import ShadowResult
from layerwatch.inference_shim.runtime.engine import SamplingParams, SequenceUpdate, TokenLogprob
from layerwatch.inference_shim.service.admission import Admission, Weight
from layerwatch.inference_shim.service.depth import DepthDecider, DepthDecision
from layerwatch.inference_shim.service.engine_worker import EngineFailure, EngineWorker, RequestHandle
from layerwatch.inference_shim.service.metrics import SKIPPING_STATUSES, RequestMetrics
from layerwatch.inference_shim.service.mitigation import NO_MITIGATION, Mitigations, RequestMitigation
from layerwatch.inference_shim.service.records import FinishedRequest, RequestRecord
from layerwatch.inference_shim.service.schemas import APIError
from layerwatch.request_tail import RequestLayers

if TYPE_CHECKING:
    from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
    from layerwatch.inference_shim.service.audit import RequestSpan

log = logging.getLogger(__name__)

ACTIVITY_HEADER = "x-layerwatch-layer-activity"
ACTIVITY_EVENT = "layerwatch.layer_activity"


@dataclass(frozen=True)
class GenerationParts:
    """What a generation uses of the service (shim.py builds it once): the engine thread, the depth
    decider, the request metrics, the admission queue, the mitigations, the tokenizer."""

    worker: EngineWorker
    depth: DepthDecider
    request_metrics: RequestMetrics
    admission: Admission
    mitigations: Mitigations
    tokenizer: Tokenizer
    gates_sha256: Callable[[], str]  # of the gates serving now (a reload swaps them)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # what `echo` returns


@dataclass(frozen=True)
class Prepared:
    """A validated generation request."""

    kind: Literal["completion", "chat"]
    request_id: str
    model_name: str
    prompts: list[Prompt]
    depth: list[DepthDecision]  # per prompt, before its prefill: every choice of a prompt shares it
    n: int  # choices per prompt
    params: SamplingParams  # choice j of a prompt draws with seed + j
    stream: bool
    include_usage: bool
    continuous_usage: bool  # every streamed chunk carries its choice's usage so far (vLLM's continuous_usage_stats)
    debug: bool  # return the per-token layer activity (of the first choice)
    echo: bool = False  # completions: the prompt opens the text (and its logprobs the logprobs)
    logprobs: int | None = None  # alternatives per token (chat: top_logprobs); None: no logprobs
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"

    def scored_tokens(self) -> int:
        """The prompt tokens the engine scores, a decode step each (echo with logprobs): all but each
        prompt's first, for each choice."""
        if self.params.prompt_logprobs is None:
            return 0
        return self.n * sum(len(prompt.ids) - 1 for prompt in self.prompts)

    def choice_params(self, j: int) -> SamplingParams:
        if j == 0 or self.params.seed is None:
            return self.params
        return replace(self.params, seed=(self.params.seed + j) % 2**63)


def admission_weight(admission: Admission, prepared: Prepared) -> Weight:
    """What a prepared request counts in admission: its sequences and the prompt tokens it scores."""
    return admission.weight(len(prepared.prompts) * prepared.n, prepared.scored_tokens())


class Choice:
    """One sequence of a request: its engine handle, what it has produced, its metrics."""

    def __init__(
        self,
        parts: GenerationParts,
        prepared: Prepared,
        index: int,
        prompt: Prompt,
        arrived: float,
        on_recorded: Callable[[], None],
        depth: DepthDecision,
        mitigation: RequestMitigation = NO_MITIGATION,
        audit: RequestSpan | None = None,
    ) -> None:
        self.parts = parts
        self.prepared = prepared
        self.index = index
        self.prompt = prompt
        self.arrived = arrived
        self._on_recorded = on_recorded
        self._audit = audit
        self.handle = RequestHandle(
            prompt.ids,
            prepared.choice_params(index % prepared.n),
            asyncio.get_running_loop(),
            capture_activity=prepared.debug and index == 0,
            depth=depth,
            shadow_rate=mitigation.shadow_rate,
            request_id=prepared.request_id,
            on_shadow_result=None if audit is None else self._shadow_checked,
        )
        self.text = prompt.text if prepared.echo else ""
        self.completion_tokens = 0
        # The tokens that have log-probabilities (echo: the prompt's first) and theirs (None: none).
        self.logprob_ids: list[int] = []
        self.text_offsets = [0]  # characters before each logprob entry, filled as streams ask (_text_offset)
        self.logprobs: list[TokenLogprob | None] = []
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.gaps: list[float] = []
        self.final: SequenceUpdate | None = None
        self.status: str | None = None  # once counted
        self.recorded = False

    def start(self) -> None:
        self.parts.worker.submit(self.handle)

    async def next(self) -> SequenceUpdate:
        """The next update; raises APIError when the engine could not serve the choice."""
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
        self.text += item.text_delta
        if item.prompt_logprobs is not None and self.prepared.echo:
            self.logprob_ids += self.prompt.ids
            self.logprobs += item.prompt_logprobs
        if item.logprobs is not None:
            self.logprob_ids += item.new_token_ids
            self.logprobs += item.logprobs
        if item.finished:
            self.final = item
            self._record("cancelled" if item.finish_reason == "cancelled" else "ok")
        return item

    def cancel(self) -> None:
        """Stop the engine's sequence (the client is gone, or another choice failed); it is counted
        once the engine has stopped it. A no-op for a choice already counted."""
        if not self.recorded:
            self.parts.worker.cancel(self.handle)

    def _record(self, status: str) -> None:
        if self.recorded:
            return
        self.recorded = True
        self.status = status
        self._on_recorded()
        # A prompt the engine refused was never prefilled.
        prompt_tokens = 0 if status == "client_error" else len(self.prompt.ids)
        depth = self.handle.depth
        assert depth is not None
        log.info(
            "%s[%d]: %s, %d prompt + %d completion tokens, depth %s (threshold %g, %s)",
            self.prepared.request_id,
            self.index,
            status,
            prompt_tokens,
            self.completion_tokens,
            depth.mode,
            depth.threshold,
            depth.reason,
        )
        if status in SKIPPING_STATUSES:
            self.parts.depth.record(depth, self.handle.complexity)
        self.parts.request_metrics.finish(
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

    def _shadow_checked(self, result: ShadowResult, seconds: float) -> None:
        """Called in the engine thread when the choice's shadow re-check ran (audit spans on)."""
        assert self._audit is not None
        self._audit.shadow_checked(self.index, result, seconds)

    def _layers(self) -> RequestLayers | None:
        """The choice's decode steps per layer, from the engine's final update (None without one)."""
        counts = self.final.layer_counts if self.final is not None else None
        if counts is None:
            return None
        return RequestLayers(counts.tokens, counts.skipped, counts.below_threshold)


@dataclass(frozen=True)
class Arrival:
    """An update of one choice, with how far the choice's text and log-probabilities reached once it
    was in (the choice may have moved on by the time the client is ready for it)."""

    choice: Choice
    update: SequenceUpdate
    text_end: int
    logprobs_end: int
    completion_tokens: int


class Generation:
    """A request's choices, and the response they make up."""

    _following: set[asyncio.Task] = set()  # every generation's _follow task (kept referenced)

    def __init__(
        self, parts: GenerationParts, prepared: Prepared, arrived: float, audit: RequestSpan | None = None
    ) -> None:
        self.parts = parts
        self.prepared = prepared
        self.created = int(time.time())
        mitigation = parts.mitigations.for_new_request()  # once per request, whatever its choices
        # A mitigation forcing full depth outranks every other reason (depth.py).
        depth = prepared.depth if mitigation.threshold is None else [parts.depth.override()] * len(prepared.depth)
        self._audit = audit
        self.choices = [
            Choice(
                parts,
                prepared,
                i * prepared.n + j,
                prompt,
                arrived,
                self._choice_recorded,
                depth[i],
                mitigation,
                audit,
            )
            for i, prompt in enumerate(prepared.prompts)
            for j in range(prepared.n)
        ]
        self._unrecorded = len(self.choices)
        self._token_texts: dict[int, str] = {}
        # What _follow took, until the client is ready for it: Arrivals, a choice's APIError, and
        # None once every choice is counted.
        self._arrivals: asyncio.Queue[Arrival | APIError | None] = asyncio.Queue()

    def _choice_recorded(self) -> None:
        # The request was admitted as its choices: it leaves once, when its last choice is counted.
        self._unrecorded -= 1
        if self._unrecorded == 0:
            self.parts.admission.leave(admission_weight(self.parts.admission, self.prepared))
            if self._audit is not None:
                self._audit.end(self.record())

    def record(self) -> RequestRecord:
        """The request once every choice is counted."""
        statuses = {c.status for c in self.choices}
        # Each choice's final decision (the pre-check may have revised it after the prefill).
        decisions = [c.handle.depth for c in self.choices if c.handle.depth is not None]
        p = self.prepared
        return RequestRecord(
            kind=p.kind,
            request_id=p.request_id,
            model_name=p.model_name,
            gates_sha256=self.parts.gates_sha256(),
            params=p.params,
            n=p.n,
            stream=p.stream,
            threshold=decisions[0].threshold,
            depth_mode=decisions[0].mode if len({d.mode for d in decisions}) == 1 else "mixed",
            depth_reason=decisions[0].reason if len({d.reason for d in decisions}) == 1 else "mixed",
            status=next((s for s in ("server_error", "client_error", "cancelled") if s in statuses), "ok"),
            finish_reasons=[(c.final.finish_reason if c.final else None) or "error" for c in self.choices],
            usage=self.usage(),
            layers=[c.final.layer_counts for c in self.choices if c.final and c.final.layer_counts],
        )

    def start(self) -> None:
        for choice in self.choices:
            choice.start()
        task = asyncio.get_running_loop().create_task(self._follow())
        self._following.add(task)
        task.add_done_callback(self._following.discard)

    def finished(self) -> bool:
        return all(choice.final is not None for choice in self.choices)

    async def _follow(self) -> None:
        """Take every choice's updates as they arrive (in order within a choice) until each choice
        is counted, however fast the client reads them. A choice that fails cancels the others."""
        waiting = {asyncio.ensure_future(c.next()): c for c in self.choices}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    choice = waiting.pop(task)
                    try:
                        update = task.result()
                    except APIError as err:  # the choice is counted as an error
                        self.cancel()
                        self._arrivals.put_nowait(err)
                        continue
                    if not choice.recorded:
                        waiting[asyncio.ensure_future(choice.next())] = choice
                    self._arrivals.put_nowait(
                        Arrival(choice, update, len(choice.text), len(choice.logprobs), choice.completion_tokens)
                    )
        finally:
            for task in waiting:
                task.cancel()  # safe: an update is taken off its queue only by a finished get()
            self._arrivals.put_nowait(None)

    async def updates(self) -> AsyncIterator[Arrival]:
        """Every choice's updates, as the client is ready for them, until each choice is counted.
        The APIError of a choice that failed is raised (the other choices are cancelled)."""
        while (arrival := await self._arrivals.get()) is not None:
            if isinstance(arrival, APIError):
                raise arrival
            yield arrival

    def cancel(self) -> None:
        for choice in self.choices:
            choice.cancel()

    # --- what the client gets ----------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        """OpenAI's usage (each prompt counted once, however many choices it has) and the layers
        the choices' decode steps executed and skipped."""
        finals = [c.final for c in self.choices if c.final is not None]
        prompt = sum(len(p.ids) for p in self.prepared.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "layers_executed": sum(f.layers_executed for f in finals),
            "layers_skipped": sum(f.layers_skipped for f in finals),
        }

    def activity_json(self) -> str:
        rows = [[int(ran) for ran in token] for token in self.choices[0].handle.activity]
        return json.dumps(rows, separators=(",", ":"))

    def envelope(self, chunk: bool) -> dict[str, Any]:
        p = self.prepared
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if p.kind == "chat" else "text_completion"
        return {"id": p.request_id, "object": kind, "created": self.created, "model": p.model_name}

    def encoded_response(self) -> bytes:
        """The whole answer as JSON, as Starlette's JSONResponse writes it, built and encoded one choice
        at a time, for a worker thread. A 24 MB answer (n 128, top_logprobs 20) built whole and encoded in
        one call stalled the event loop for seconds: json's C encoder holds the GIL for a whole call,
        and a million objects alive at once set off the garbage collector's full passes, which hold it
        too. A choice's objects are gone before the next is built."""
        if not self.finished():
            raise RuntimeError(f"{self.prepared.request_id}: the answer asked for before the generation finished")
        # The placeholder cannot occur earlier in the text: a quote inside a JSON string is escaped.
        envelope = {**self.envelope(chunk=False), "choices": None, "usage": self.usage()}
        head, tail = _json_text(envelope).split('"choices":null', 1)
        encoded = b",".join(_json_text(self._choice(c)).encode() for c in self.choices)
        return b"".join([head.encode(), b'"choices":[', encoded, b"]", tail.encode()])

    def _choice(self, c: Choice) -> dict[str, Any]:
        assert c.final is not None
        logprobs = self._logprobs(c, 0, len(c.logprobs))
        if self.prepared.kind == "chat":
            message = {"role": "assistant", "content": c.text}
            return {"index": c.index, "message": message, "finish_reason": c.final.finish_reason, "logprobs": logprobs}
        return {"index": c.index, "text": c.text, "finish_reason": c.final.finish_reason, "logprobs": logprobs}

    def chunk(
        self,
        choice: Choice,
        text: str | None,
        logprobs: tuple[int, int],
        finish_reason: str | None = None,
        role: bool = False,
        completion_tokens: int = 0,
    ) -> dict[str, Any]:
        """One choice's streamed chunk: its new text and the log-probabilities of entries [start, end),
        with `completion_tokens` generated so far."""
        entries = self._logprobs(choice, *logprobs)
        if self.prepared.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            body = {"index": choice.index, "delta": delta, "finish_reason": finish_reason, "logprobs": entries}
        else:
            body = {"index": choice.index, "text": text or "", "finish_reason": finish_reason, "logprobs": entries}
        chunk = {**self.envelope(chunk=True), "choices": [body]}
        if self.prepared.continuous_usage:
            prompt = len(choice.prompt.ids)
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens,
            }
        return chunk

    def _logprobs(self, choice: Choice, start: int, end: int) -> dict[str, Any] | None:
        """Entries [start, end) of a choice's log-probabilities in the endpoint's shape; None when
        not asked for."""
        k = self.prepared.logprobs
        if k is None:
            return None
        ids, entries = choice.logprob_ids[start:end], choice.logprobs[start:end]
        if self.prepared.kind == "chat":
            return {"content": [self._chat_logprob(e, k) for e in entries if e is not None]}
        return completion_logprobs(ids, entries, self._token_text, self._text_offset(choice, start), self._token_label)

    def _token_label(self, token_id: int) -> str:
        """How the log-probabilities name a token: its text, or with return_tokens_as_token_ids its id
        (which tells apart tokens of one text, such as the bytes of one character)."""
        return f"token_id:{token_id}" if self.prepared.tokens_as_ids else self._token_text(token_id)

    def _chat_logprob(self, entry: TokenLogprob, k: int) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": self._token_label(token_id), "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {**item(entry.token_id, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in entry.top[:k]]}

    def _text_offset(self, choice: Choice, start: int) -> int:
        """Characters of the choice's token texts before entry `start`: extends the choice's running
        prefix sums (a stream asks for ever later starts; summing from 0 each time is quadratic)."""
        offsets = choice.text_offsets
        while len(offsets) <= start:
            offsets.append(offsets[-1] + len(self._token_text(choice.logprob_ids[len(offsets) - 1])))
        return offsets[start]

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.parts.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def completion_logprobs(
    ids: list[int],
    entries: list[TokenLogprob | None],
    token_text: Callable[[int], str],
    offset: int,
    label: Callable[[int], str] | None = None,
) -> dict[str, list]:
    """The completions API's logprobs object. As OpenAI's (and vLLM's), each top_logprobs dict also
    holds the chosen token, so it may have one entry more than asked for. `label` names the tokens
    (default: their text); the text offsets are always the tokens' texts'."""
    label = label or token_text
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, entry in zip(ids, entries):
        tokens.append(label(token_id))
        text_offset.append(offset)
        offset += len(token_text(token_id))
        token_logprobs.append(None if entry is None else entry.logprob)
        if entry is None:
            top_logprobs.append(None)
        else:
            top: dict[str, float] = {}
            for token, logprob in (*entry.top, (token_id, entry.logprob)):
                top.setdefault(label(token), logprob)  # tokens of one text: the most likely's
            top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


async def run_to_end(generation: Generation, request: Request) -> None:
    """Collect a whole generation (non-streaming); a disconnect cancels it, a failed choice the rest."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, generation))
    try:
        async for _ in generation.updates():
            pass
    finally:
        watcher.cancel()
        generation.cancel()  # a no-op for the choices counted


async def _cancel_on_disconnect(request: Request, generation: Generation) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    generation.cancel()


async def stream_events(generation: Generation) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's streaming format, ending with `data: [DONE]`.

    Each chunk carries one choice's new text (with echo, the prompt first) and, when asked for,
    the log-probabilities of its new tokens, so a chunk may come with an empty text. With
    `stream_options.include_usage` a last chunk carries `usage` (and with `continuous_usage_stats`
    every chunk its choice's usage so far, as vLLM's do); with the debug header a final
    `layerwatch.layer_activity` event carries the per-token layer activity. If the client
    disconnects, Starlette cancels the stream (possibly before this generator has started), and the
    response's background task cancels the generation.
    """
    p = generation.prepared
    sent_text = {c.index: 0 for c in generation.choices}  # characters of each choice's text sent
    sent_logprobs = dict.fromkeys(sent_text, 0)  # its log-probability entries sent
    try:
        if p.kind == "chat":
            for choice in generation.choices:
                yield _sse(generation.chunk(choice, "", (0, 0), role=True))
        async for arrival in generation.updates():
            choice, update = arrival.choice, arrival.update
            text = choice.text[sent_text[choice.index] : arrival.text_end]
            entries = (sent_logprobs[choice.index], arrival.logprobs_end)
            if text or update.finished or entries[1] > entries[0]:
                sent_text[choice.index], sent_logprobs[choice.index] = arrival.text_end, entries[1]
                yield _sse(
                    generation.chunk(choice, text, entries, update.finish_reason, False, arrival.completion_tokens)
                )
        if p.include_usage:
            yield _sse({**generation.envelope(chunk=True), "choices": [], "usage": generation.usage()})
        if p.debug:
            yield f'event: {ACTIVITY_EVENT}\ndata: {{"layer_activity": {generation.activity_json()}}}\n\n'
        yield "data: [DONE]\n\n"
    except APIError as err:  # the engine failed the request, or the drain timeout cut it off
        yield _sse(err.body())
        yield "data: [DONE]\n\n"  # the stream still ends the way clients wait for
    finally:
        generation.cancel()  # servers that raise on a disconnected send skip the background task


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _json_text(value: Any) -> str:
    # Starlette's JSONResponse settings: UTF-8 as it is, no NaN, no spaces.
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
