"""Which generation requests get in: a bound on those waiting for a batch slot, and the drain.

A request is admitted once its body has been read and leaves when its generation ends (whether or
not its client has read the answer: completions.py, `Generation._follow`): it is either
running (its sequence holds one of the engine's batch slots) or waiting (being tokenized, or queued
for a slot). A client still sending its body holds only its connection, so slow clients cannot
fill the queue (it is checked before the body is read too, so that a full server reads no more
bodies). With `max_batch_size + max_waiting` slots admitted, the next request gets 429 with
Retry-After instead of an ever longer queue. Once draining (SIGTERM), no request is admitted (503)
and the server waits for the admitted ones to finish (docs/service.md, "Back-pressure" and
"Signals and shutdown").

What is counted is the work a request brings: the batch slots its sequences (prompts × choices)
take at once, at most `max_batch_size`, and the prompt tokens it scores (echo with logprobs: a
decode step each, where a prefill takes one forward pass for all). A request enters as one slot (its
body not yet read) and is weighed once prepared; one that would take the slots past
`max_batch_size + max_waiting` is refused (429). Its sequences beyond the batch wait in the engine,
which gives each free slot to the request holding the fewest (runtime/engine.py), so that a request
of 128 choices takes turns with the chats that come after it instead of every slot until its last
choice is done.

Scoring has a budget of its own, `max_scored_tokens`: what the engine's scoring slots (half the
batch) score in one pass of the longest prompts. A scoring request counts its tokens against it, at
most the whole budget, so that one larger than the budget is admitted when no other scores and the
next scoring request waits its turn (429); requests that score nothing never count against it. So
scoring requests can neither fill the queue the chats need nor, with the engine's rule, hold more
than half the batch.

Admission runs on the event loop only (HTTP handlers and the code that answers them), so the
count needs no lock; `running` comes from the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from layerwatch.inference_shim.service.schemas import APIError

RETRY_AFTER_SECONDS = 1  # a slot frees as soon as any running request finishes


@dataclass(frozen=True)
class Weight:
    """What an admitted request counts."""

    slots: int  # batch slots its sequences take at once: prompts × choices, at most max_batch_size
    scored_tokens: int = 0  # prompt tokens it scores, at most max_scored_tokens


ONE_SLOT = Weight(1)  # a request admitted but not yet prepared


class Admission:
    def __init__(
        self, max_batch_size: int, max_waiting: int, running: Callable[[], int], max_scored_tokens: int
    ) -> None:
        if max_waiting < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {max_waiting}")
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.max_scored_tokens = max_scored_tokens
        self._running = running
        self.admitted = 0  # batch slots
        self.scored_tokens = 0
        self.draining = False

    def enter(self) -> None:
        """Admit one request, as one slot until `weigh` says what it brings, or raise the APIError
        that refuses it."""
        self.check()
        self.admitted += 1

    def weight(self, sequences: int, scored_tokens: int = 0) -> Weight:
        """What a request of `sequences` (prompts × choices) scoring `scored_tokens` prompt tokens counts."""
        return Weight(min(sequences, self.max_batch_size), min(scored_tokens, self.max_scored_tokens))

    def weigh(self, weight: Weight) -> None:
        """Count an entered request as its `weight`, or raise the 429 that refuses it (it is then
        still counted as one slot: the caller leaves with ONE_SLOT)."""
        if self.admitted - 1 + weight.slots > self.max_batch_size + self.max_waiting:
            raise self._at_capacity(f"this request takes {weight.slots} batch slots")
        if weight.scored_tokens and self.scored_tokens + weight.scored_tokens > self.max_scored_tokens:
            raise self._at_capacity(
                f"{self.scored_tokens} prompt tokens are being scored, at most {self.max_scored_tokens} at once, and "
                f"this request counts {weight.scored_tokens}"
            )
        self.admitted += weight.slots - 1
        self.scored_tokens += weight.scored_tokens

    def check(self) -> None:
        """Raise the APIError that would refuse a request now."""
        if self.draining:
            raise APIError(
                503,
                "The server is shutting down and admits no new requests; retry on another replica.",
                type="server_error",
                code="server_shutting_down",
            )
        if self.admitted >= self.max_batch_size + self.max_waiting:
            raise self._at_capacity()

    def _at_capacity(self, more: str = "") -> APIError:
        return APIError(
            429,
            f"The server is at capacity: {self.running()} sequences running and {self.waiting()} waiting "
            f"(at most {self.max_waiting} may wait for a batch slot){'; ' + more if more else ''}; retry after "
            f"{RETRY_AFTER_SECONDS} s.",
            type="server_error",
            code="server_overloaded",
            headers={"retry-after": str(RETRY_AFTER_SECONDS)},
        )

    def leave(self, weight: Weight) -> None:
        self.admitted -= weight.slots
        self.scored_tokens -= weight.scored_tokens

    def running(self) -> int:
        # The engine thread's count can run ahead of ours by a step (a request it finished whose
        # answer is not sent yet): never more than are admitted.
        return min(self._running(), self.admitted)

    def waiting(self) -> int:
        return self.admitted - self.running()
