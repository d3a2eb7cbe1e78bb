"""The records of a finished request, from the same numbers as the `usage` its client saw: one
`FinishedRequest` per choice (what the request metrics count, metrics.py) and the request's
`RequestRecord` once every choice is counted (what its audit span says, audit.py). completions.py
writes both; neither reader needs the request's code.

Two records because they count different things: the metrics count each choice as one request
(`layerwatch_requests_total`, latency and the request skip fraction are per engine sequence: the
module doc of completions.py), the moment that choice ends, and a request refused before it had any
choice as one too (app.py: a status only); the audit span is one per HTTP request, its choices'
finish reasons and layer counts together, and exists only once the last choice is counted. One
record for both would make the metrics wait for the slowest choice, or the span carry per-choice
rows it does not export.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from layerwatch.inference_shim.runtime.engine import LayerCounts, SamplingParams
from layerwatch.request_tail import RequestLayers


@dataclass(frozen=True)
class FinishedRequest:
    """What a request ended with; the same numbers the client saw in `usage`."""

    status: str  # one of REQUEST_STATUSES
    prompt_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token: float | None = None  # seconds; None when no token was generated
    inter_token_latencies: Sequence[float] = ()
    duration: float | None = None  # seconds; None for requests rejected before generation
    layers: RequestLayers | None = None  # its decode steps per layer; None when the engine did not finish it


@dataclass(frozen=True)
class RequestRecord:
    """What a request's audit span says (audit.py): the whole request, once every choice is counted."""

    kind: Literal["completion", "chat"]
    request_id: str
    model_name: str
    gates_sha256: str  # of the gates serving when it finished
    params: SamplingParams
    n: int  # choices per prompt
    stream: bool
    threshold: float  # the tau its sequences ran at (its first prompt's, when its prompts differ)
    depth_mode: str  # full | strict | gated, or "mixed" when its prompts ran at different depths
    depth_reason: str  # why (depth.REASONS), or "mixed"
    status: str  # the request's, as layerwatch_requests_total names it: its worst choice's
    finish_reasons: list[str]  # one per choice
    usage: Mapping[str, int]
    layers: list[LayerCounts]  # of the choices the engine finished
