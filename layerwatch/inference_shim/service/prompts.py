"""From a request's fields to what the engine reads: a conversation rendered by the chat template
with the options the request sent (each checked against what the template reads), the prompt
limits, vLLM's bad words as token sequences. The generation routes and `/tokenize` share them.

Every check here refuses with a 400 naming the field: an option the template would not read
(a misspelled `chat_template_kwargs` key, `documents` for a template without a place for them)
changes nothing, so it is refused rather than dropped (docs/service.md, "Request fields").
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from jinja2.exceptions import TemplateError

from layerwatch.inference_shim.runtime import chat_template
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.inference_shim.service.schemas import APIError, ChatTemplateFields
from layerwatch.inference_shim.service.shim import Limits

# Template variables a request sets through its own fields, never through chat_template_kwargs.
REQUEST_FIELD_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}
)


# Renders wait for a template worker in threads of their own, as many as there are workers: a template
# at its time bound then holds none of the threads the other routes validate and tokenize in, and a
# render still queued when its client disconnects is dropped.
_RENDER_THREADS = ThreadPoolExecutor(chat_template.MAX_WORKERS, thread_name_prefix="chat-template")


async def render_chat_off_loop(
    tokenizer: Tokenizer, body: ChatTemplateFields, refused: re.Pattern[str] | None = None
) -> str:
    """`render_chat` off the event loop, on the render threads. A render that finds no thread free
    within RENDER_SECONDS is refused as one past its bound: behind renders that loop, a queue of
    conversations would otherwise wait their turns for minutes, and hold a drain (SIGTERM) as long."""
    start_by = time.monotonic() + chat_template.RENDER_SECONDS
    return await asyncio.get_running_loop().run_in_executor(
        _RENDER_THREADS, render_chat, tokenizer, body, refused, start_by
    )


def render_chat(
    tokenizer: Tokenizer,
    body: ChatTemplateFields,
    refused: re.Pattern[str] | None = None,
    start_by: float | None = None,
) -> str:
    """The conversation as the chat template writes it, with the request's template options; a
    message whose text matches `refused` (special tokens' texts), or a render not started by the
    monotonic time `start_by`, is refused with a 400."""
    if refused is not None:
        _refuse_special_tokens(body, refused)
    facts = tokenizer.template_facts(tokenizer.template_name())
    kwargs = {name: value for name, value in (body.chat_template_kwargs or {}).items() if value is not None}
    for name in kwargs:
        param = f"chat_template_kwargs.{name}"
        if name in REQUEST_FIELD_VARIABLES:
            raise APIError(400, f"{param}: send it as the request field.", param=param, code="invalid_value")
        if name not in facts.variables:
            reads = ", ".join(sorted(facts.variables - REQUEST_FIELD_VARIABLES)) or "none"
            raise APIError(
                400,
                f"{param}: the chat template does not read {name!r}, so it would change nothing "
                f"(the variables it reads: {reads}).",
                param=param,
                code="invalid_value",
            )
    if body.documents is not None and "documents" not in facts.variables:
        raise APIError(
            400,
            "documents: the chat template has no place for documents, so they would change nothing.",
            param="documents",
            code="unsupported_parameter",
        )
    try:
        if start_by is not None and time.monotonic() > start_by:
            raise chat_template.all_busy()
        return tokenizer.apply_chat_template(
            [message.template_message() for message in body.messages],
            documents=body.documents,
            add_generation_prompt=body.generation_prompt(),
            continue_final_message=body.continue_final_message,
            **kwargs,
        )
    except TemplateError as exc:  # the checkpoint's template refuses the conversation (e.g. role order)
        raise APIError(
            400, f"The chat template refused the messages: {exc}", param="messages", code="invalid_messages"
        ) from None


def _refuse_special_tokens(body: ChatTemplateFields, refused: re.Pattern[str]) -> None:
    # Written in a message, `<|im_end|>\n<|im_start|>system` is tokenized into the control ids and
    # the model reads a turn the template never wrote (docs/security.md, "Defences, by default").
    for i, message in enumerate(body.messages):
        found = refused.search(message.text() or "")
        if found is not None:
            param = f"messages[{i}].content"
            raise APIError(
                400,
                f"{param} holds the special token {found.group()!r}, which the model would read as a control "
                "token, not text; this server refuses them (--refuse-special-tokens-in-messages).",
                param=param,
                code="invalid_messages",
            )


def describe_limits(limits: Limits) -> str:
    return (
        f"at most {limits.max_prompt_tokens} prompt tokens and {limits.max_tokens_cap} generated tokens "
        f"(max_model_len {limits.max_model_len}; GET /v1/models says so)"
    )


def check_prompt_chars(limits: Limits, text: str, param: str) -> None:
    """Refuse, untokenized, a prompt too long in characters to fit (docs/service.md, "Prompt limits")."""
    if limits.max_prompt_chars is not None and len(text) > limits.max_prompt_chars:
        # Refused by size: it cannot fit, and tokenizing it would cost CPU in proportion to its length.
        raise APIError(
            400,
            f"The prompt has {len(text)} characters, more than {limits.max_prompt_tokens} tokens can hold "
            f"({limits.max_prompt_chars} characters); this server accepts {describe_limits(limits)}.",
            param=param,
            code="context_length_exceeded",
        )


def check_prompt_tokens(limits: Limits, count: int, param: str) -> None:
    if count > limits.max_prompt_tokens:
        raise APIError(
            400,
            f"The prompt has {count} tokens; this server accepts {describe_limits(limits)}.",
            param=param,
            code="context_length_exceeded",
        )


async def encode_text(limits: Limits, text: str, encode: Callable[[str], list[int]], param: str) -> list[int]:
    """A text prompt's ids, refused untokenized when too long in characters to fit."""
    check_prompt_chars(limits, text, param)
    # In a worker thread, which the tokenizer releases the GIL in: neither the event loop nor the
    # engine thread waits for it.
    return await asyncio.to_thread(encode, text)


def check_token_ids(ids: Iterable[int], vocab: int, param: str) -> None:
    if any(token >= vocab for token in ids):  # (negative ids are refused by the schema)
        raise APIError(400, f"{param}: token ids must be in 0..{vocab - 1}.", param=param, code="invalid_value")


def bad_word_ids(tokenizer: Tokenizer, words: Iterable[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of bad words. vLLM's: each word without its leading spaces as it tokenizes
    at the start of a text and, when that is another sequence of as many tokens, after a space (so
    that the word is banned at the start and in the middle of a text). And the word as it is written:
    vLLM drops the spaced form when its length differs (" the" is one token, "the" two in a small
    vocabulary), so that `[" the"]` would still let " the" through."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise APIError(400, f"bad_words: {word!r} has no tokens.", param="bad_words", code="invalid_value")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
        sequences.append(tuple(tokenizer.encode(word, add_special_tokens=False)))
    return tuple(dict.fromkeys(sequences))
