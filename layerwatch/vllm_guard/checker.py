"""The full-depth check of the sampled answers, in the background: each choice's prompt + answer tokens are sent
to vLLM's `/v1/completions` with `max_tokens` 1 and `prompt_logprobs` 20, so that every answer position is scored
by a prefill, which the plugin runs at full depth; a fresh `cache_salt` keeps vLLM from reusing a KV block the
gated decode wrote (a prefix-cache hit would skip the prefill of those positions), and a low `priority` lets
served requests go first (vLLM takes it under `--scheduling-policy priority`; an engine that refuses it gets the
checks without it, said once in the log). comparison.py turns the two sides into the shim's figures.

At most MAX_WAITING choices wait and CONCURRENT_CHECKS run: a choice that finds the queue full is counted
(`queue_full`), never waited for. A re-score vLLM has not answered within CHECK_TIMEOUT_SECONDS (hung, or starved
at its low priority) fails (`failed`), so that a stalled vLLM cannot hold the workers for good.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import aiohttp

from layerwatch.log_limit import limit_rate
from layerwatch.vllm_guard.comparison import REQUESTED_TOP_LOGPROBS, Position, compare
from layerwatch.vllm_guard.metrics import GuardMetrics
from layerwatch.vllm_guard.openai_bodies import COMPLETIONS_PATH, Choice

log = limit_rate(logging.getLogger(__name__))  # a vLLM refusing the re-scores would log every check

MAX_WAITING = 64  # as the shim's shadow queue
CONCURRENT_CHECKS = 2
CHECK_PRIORITY = 1000  # vLLM serves lower values first; requests default to 0
# A re-score is one prefill of at most max_model_len tokens: seconds on a CPU, unless served requests keep it waiting.
CHECK_TIMEOUT_SECONDS = 120.0


class CheckFailed(Exception):
    pass


def rescore_body(model: str, tokens: list[int]) -> dict[str, Any]:
    """The full-depth re-score of prompt + answer `tokens` (module doc), but for its priority."""
    return {
        "model": model,
        "prompt": tokens,
        "max_tokens": 1,
        "prompt_logprobs": REQUESTED_TOP_LOGPROBS,
        "cache_salt": secrets.token_urlsafe(32),
    }


class Checker:
    def __init__(self, upstream: str, model_name: str, metrics: GuardMetrics) -> None:
        self.upstream = upstream
        self.model_name = model_name
        self.metrics = metrics
        self._queue: asyncio.Queue[tuple[Choice, str]] = asyncio.Queue(MAX_WAITING)
        self._workers: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._priority = True
        self._max_model_len: dict[str, int] = {}

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        self._workers = [asyncio.create_task(self._work()) for _ in range(CONCURRENT_CHECKS)]

    async def stop(self) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)

    def submit(self, choices: list[Choice], model: Any) -> None:
        """Queue each finished choice of a sampled answer (`model`: the name the client asked vLLM for)."""
        for choice in choices:
            if not choice.answer_ids or not choice.prompt_ids:
                self.metrics.not_checked("no_output")
                continue
            try:
                self._queue.put_nowait((choice, model if isinstance(model, str) else self.model_name))
            except asyncio.QueueFull:
                self.metrics.not_checked("queue_full")

    async def join(self) -> None:
        """Until every queued choice has been checked (tests, the benchmark)."""
        await self._queue.join()

    async def _work(self) -> None:
        while True:
            choice, model = await self._queue.get()
            try:
                self.metrics.checked(compare(await self.full_depth_positions(choice, model)))
            except Exception as exc:  # any: a worker that ended would leave the queue full for good
                log.warning("shadow re-check failed: %s", exc or type(exc).__name__)
                self.metrics.not_checked("failed")
            finally:
                self._queue.task_done()

    async def full_depth_positions(self, choice: Choice, model: str) -> list[Position]:
        room = await self._max_len(model) - len(choice.prompt_ids) - 1  # the re-score generates one token
        answer = choice.answer_ids[: max(room, 0)]
        if not answer:
            raise CheckFailed("no room for the answer within the model's length")
        body = rescore_body(model, choice.prompt_ids + answer)
        status, result = await self._post(body)
        if status == 400 and self._priority and "priority" in str(result).lower():
            self._priority = False
            log.warning(
                "vLLM refuses request priorities (serve it with --scheduling-policy priority): "
                "the shadow re-checks run at the served requests' priority"
            )
            status, result = await self._post(body)
        if status != 200:
            raise CheckFailed(f"vLLM answered the re-score {status}: {str(result)[:300]}")
        prompt_logprobs = result["choices"][0]["prompt_logprobs"]
        first = len(choice.prompt_ids)
        positions = []
        for j, gated in enumerate(choice.gated[: len(answer)]):
            ranked = prompt_logprobs[first + j]
            full = {int(token): entry["logprob"] for token, entry in ranked.items()}
            argmax = [int(token) for token, entry in ranked.items() if entry["rank"] == 1]
            if not argmax:
                raise CheckFailed(f"no rank-1 token in the full-depth list at position {first + j}")
            positions.append(Position(gated=gated, full=full, full_argmax=argmax[0]))
        return positions

    async def _post(self, body: dict[str, Any]) -> tuple[int, Any]:
        assert self._session is not None
        if self._priority:
            body = {**body, "priority": CHECK_PRIORITY}
        async with self._session.post(self.upstream + COMPLETIONS_PATH, json=body, timeout=self._timeout()) as response:
            return response.status, await response.json(content_type=None)

    def _timeout(self) -> aiohttp.ClientTimeout:
        """The session's timeouts with a total: a request's own ClientTimeout replaces the session's whole, and
        would drop its connect limit."""
        assert self._session is not None
        own = self._session.timeout
        return aiohttp.ClientTimeout(
            total=CHECK_TIMEOUT_SECONDS, connect=own.connect, sock_read=own.sock_read, sock_connect=own.sock_connect
        )

    async def _max_len(self, model: str) -> int:
        if model not in self._max_model_len:
            assert self._session is not None
            async with self._session.get(self.upstream + "/v1/models", timeout=self._timeout()) as response:
                models = (await response.json(content_type=None))["data"]
            self._max_model_len.update({m["id"]: int(m["max_model_len"]) for m in models})
        return self._max_model_len[model]
