"""Which generation requests get in: a bound on those waiting for a batch slot, and the drain.

A request is admitted once its body has been read and leaves when its generation ends (whether or
not its client has read the answer: completions.py, `Generation._follow`): it is either
running (its sequence holds one of the engine's batch slots) or waiting (being tokenized, or queued
for a slot). A client still sending its body holds only its connection, so slow clients cannot
fill the queue (it is checked before the body is read too, so that a full server reads no more
bodies). With `max_batch_size + max_waiting` requests admitted, the next one gets 429 with
Retry-After instead of an ever longer queue. Once draining (SIGTERM), no request is admitted (503)
and the server waits for the admitted ones to finish (docs/service.md, "Back-pressure" and
"Signals and shutdown").

What is counted is the work a request brings: the batch slots its sequences (prompts × choices)
take at once, at most `max_batch_size`. A request enters as one (its body not yet read) and is
weighed once prepared; one that would take the count past `max_batch_size + max_waiting` is refused
(429). Its sequences beyond the batch wait in the engine, which gives each free slot to the request
holding the fewest (runtime/engine.py), so that a request of 128 choices takes turns with the chats
that come after it instead of every slot until its last choice is done.

Admission runs on the event loop only (HTTP handlers and the code that answers them), so the
count needs no lock; `running` comes from the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable

from layerwatch.inference_shim.service.schemas import APIError

RETRY_AFTER_SECONDS = 1  # a slot frees as soon as any running request finishes


class Admission:
    def __init__(self, max_batch_size: int, max_waiting: int, running: Callable[[], int]) -> None:
        if max_waiting < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {max_waiting}")
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self._running = running
        self.admitted = 0
        self.draining = False

    def enter(self) -> None:
        """Admit one request, as one sequence until `weigh` says how many it brings, or raise the
        APIError that refuses it."""
        self.check()
        self.admitted += 1

    def weight(self, sequences: int) -> int:
        """What a request of `sequences` (prompts × choices) counts: the batch slots it takes at once."""
        return min(sequences, self.max_batch_size)

    def weigh(self, sequences: int) -> None:
        """Count an entered request as its `weight`, or raise the 429 that refuses it (it is then
        still counted as one: the caller leaves with 1)."""
        weight = self.weight(sequences)
        if self.admitted - 1 + weight > self.max_batch_size + self.max_waiting:
            raise self._at_capacity(f"this request takes {weight} batch slots")
        self.admitted += weight - 1

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

    def leave(self, sequences: int = 1) -> None:
        self.admitted -= sequences

    def running(self) -> int:
        # The engine thread's count can run ahead of ours by a step (a request it finished whose
        # answer is not sent yet): never more than are admitted.
        return min(self._running(), self.admitted)

    def waiting(self) -> int:
        return self.admitted - self.running()
