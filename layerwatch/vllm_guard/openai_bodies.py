"""The OpenAI bodies vLLM answers, as the guard reads and changes them: what a sampled request asks for on top of
the client's (the answer's raw top-20 log-probabilities by token id, and the token ids), and how an answer is
read and then restored to what the client asked for. Written against vLLM 0.32's chat and text completions,
streamed or not (vllm/entrypoints/openai/{chat_completion,completion}/serving.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from layerwatch.vllm_guard.comparison import REQUESTED_TOP_LOGPROBS

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATION_PATHS = (CHAT_PATH, COMPLETIONS_PATH)
TOKEN_ID_PREFIX = "token_id:"  # vLLM's token strings under return_tokens_as_token_ids


def checkable(path: str, body: Any) -> bool:
    """Whether a request can be shadow-checked with the client seeing exactly what vLLM would answer it: a
    generation request that asks for no log-probabilities itself. vLLM's token strings in log-probabilities depend
    on the tokens before them (its detokenizer's byte-fallback correction), which a proxy without the tokenizer
    cannot rebuild from the token ids the check needs, so a request that asks for them passes unchecked."""
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return False
    if body.get("use_beam_search") or body.get("prompt_logprobs") is not None:
        return False
    if body.get("echo"):  # vLLM would also score the echoed prompt, its log-probabilities before the answer's
        return False
    if path == CHAT_PATH:  # top_logprobs alone is vLLM's error to give, not one the guard's logprobs may hide
        return not body.get("logprobs") and body.get("top_logprobs") is None
    return body.get("logprobs") is None


def sampled_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The client's body asking also for the raw top-20 log-probabilities by token id and the token ids."""
    logprobs: dict[str, Any] = (
        {"logprobs": True, "top_logprobs": REQUESTED_TOP_LOGPROBS}
        if path == CHAT_PATH
        else {"logprobs": REQUESTED_TOP_LOGPROBS}
    )
    return {**body, **logprobs, "return_token_ids": True, "return_tokens_as_token_ids": True}


def token_id(token: str) -> int:
    return int(token.removeprefix(TOKEN_ID_PREFIX))


@dataclass
class Choice:
    """One choice of an answer, gathered from its whole body or its stream's chunks."""

    prompt_ids: list[int] = field(default_factory=list)
    answer_ids: list[int] = field(default_factory=list)
    gated: list[dict[int, float]] = field(default_factory=list)  # per generated position: token id -> logprob


@dataclass
class Answer:
    """What an answer's bodies said, choice by choice (n > 1, or several prompts of a text completion)."""

    chat: bool
    client_wants_token_ids: bool
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_ids: list[int] | None = None  # chat: the whole answer's prompt (one per request)
    unreadable: str = ""  # why the check cannot use this answer (not vLLM's shape), if so

    def read_and_restore(self, body: dict[str, Any]) -> dict[str, Any]:
        """Take what the check needs from one body (a whole answer or a stream chunk) and return it as vLLM would
        have sent it for the client's own request: no log-probabilities, and token ids only if it asked. A body
        not of vLLM's shape is restored as far as it can be, and the answer marked unreadable."""
        if self.chat and isinstance(body.get("prompt_token_ids"), list):
            self.prompt_ids = body["prompt_token_ids"]
        choices = body.get("choices")
        for raw in choices if isinstance(choices, list) else ():
            if not isinstance(raw, dict):
                self.unreadable = "a choice is not a JSON object"
                continue
            try:
                choice = self.choices.setdefault(raw.get("index", 0), Choice())
                if isinstance(raw.get("prompt_token_ids"), list):
                    choice.prompt_ids = raw["prompt_token_ids"]
                choice.answer_ids += raw.get("token_ids") or []
                choice.gated += self._positions(raw.get("logprobs"))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self.unreadable = f"its token ids or log-probabilities: {exc!r}"
            raw["logprobs"] = None
            if not self.client_wants_token_ids:
                for key in ("token_ids", "prompt_token_ids"):
                    if key in raw:
                        raw[key] = None
        if not self.client_wants_token_ids and "prompt_token_ids" in body:
            body["prompt_token_ids"] = None
        return body

    def _positions(self, logprobs: Any) -> list[dict[int, float]]:
        if not logprobs:
            return []
        if self.chat:
            return [
                {
                    token_id(entry["token"]): entry["logprob"],
                    **{token_id(t["token"]): t["logprob"] for t in entry.get("top_logprobs") or ()},
                }
                for entry in logprobs.get("content") or ()
            ]
        return [{token_id(t): lp for t, lp in (top or {}).items()} for top in logprobs.get("top_logprobs") or ()]

    def finished_choices(self) -> list[Choice]:
        """The choices with their prompt, each generated token paired with its gated log-probabilities."""
        done = []
        for choice in self.choices.values():
            prompt = choice.prompt_ids or self.prompt_ids or []
            positions = min(len(choice.answer_ids), len(choice.gated))
            done.append(Choice(list(prompt), choice.answer_ids[:positions], choice.gated[:positions]))
        return done


def dumps(body: Any) -> bytes:
    """JSON as vLLM's pydantic writes it: compact, UTF-8."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
