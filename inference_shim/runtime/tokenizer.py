"""The checkpoint's tokenizer: `tokenizer.json` (Hugging Face `tokenizers`) plus `tokenizer_config.json`.

`tokenizer_config.json` is optional; from it we read the BOS/EOS tokens and a Jinja `chat_template`
(rendered with jinja2). A checkpoint without one gets the plain template (docs/model.md):

    system: You are terse.
    user: Hello
    assistant:

Streaming uses `IncrementalDecoder`: it turns one token at a time into text deltas whose
concatenation is the text of all tokens, never emitting half a UTF-8 character.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers

if TYPE_CHECKING:
    from jinja2 import Template


def plain_chat_prompt(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """The template for checkpoints without one: a "role: content" line per message (OpenAI roles),
    then the assistant's turn opened. Plain Python, so the default path needs no Jinja."""
    lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return lines + ("assistant:" if add_generation_prompt else "")


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed; the message names the file."""


class Tokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = True,
    ) -> None:
        self.backend = tokenizer
        self.bos_token = bos_token
        self.bos_token_id = self._id_of(bos_token) if bos_token is not None else None
        self.add_bos_token = add_bos_token  # tokenizer_config.json may say the model wants none
        eos_ids = [self._id_of(t) for t in eos_tokens] + list(extra_eos_token_ids)
        self.eos_tokens = tuple(eos_tokens)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))  # ordered, no duplicates
        self.chat_template = chat_template
        self._template: Template | None = None  # compiled lazily (needs jinja2): most callers never render a chat

    @classmethod
    def from_files(
        cls,
        tokenizer_json: Path,
        tokenizer_config_json: Path | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
    ) -> Tokenizer:
        """Load tokenizer.json (required) and tokenizer_config.json (optional, may be None or absent).

        Without a tokenizer_config.json, `bos_token_id` (the model config's) names the BOS token.
        """
        tokenizer_json = Path(tokenizer_json)
        if not tokenizer_json.is_file():
            raise TokenizerError(f"{tokenizer_json}: file not found (the checkpoint needs a tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # tokenizers raises a bare Exception for any parse error
            raise TokenizerError(f"{tokenizer_json}: not a valid tokenizers file ({exc})") from exc
        if tokenizer_config_json is not None and Path(tokenizer_config_json).is_file():
            settings = _read_json_object(Path(tokenizer_config_json))
        else:
            settings = {"bos_token": backend.id_to_token(bos_token_id) if bos_token_id is not None else None}
        bos = _token_content(settings.get("bos_token"))
        eos = _token_content(settings.get("eos_token"))
        try:
            return cls(
                backend,
                bos_token=bos,
                eos_tokens=(eos,) if eos else (),
                extra_eos_token_ids=extra_eos_token_ids,
                chat_template=_chat_template(settings.get("chat_template")),
                add_bos_token=settings.get("add_bos_token", True) is not False,
            )
        except TokenizerError as exc:
            raise TokenizerError(f"{tokenizer_config_json}: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # Special tokens are added here, not by the tokenizer's post-processor, so that a chat
        # template that already starts with the BOS token does not get a second one.
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render OpenAI-style messages [{"role": ..., "content": ...}] into the prompt text."""
        if self.chat_template is None:
            return plain_chat_prompt(messages, add_generation_prompt)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_tokens[0] if self.eos_tokens else "",
        )

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)

    def save(self, out_dir: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into out_dir."""
        out_dir = Path(out_dir)
        self.backend.save(str(out_dir / "tokenizer.json"))
        settings = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_tokens[0] if self.eos_tokens else None,
            "add_bos_token": self.add_bos_token and self.bos_token is not None,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            settings["chat_template"] = self.chat_template
        (out_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")

    def _id_of(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"special token {token!r} is not in the vocabulary")
        return token_id


class IncrementalDecoder:
    """Text deltas for a growing token list, as streaming needs them.

    Decodes a short window of recent tokens (so that tokenizers which drop or merge leading spaces
    decode in context) and holds text back while it ends in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this are already emitted as text

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; return the new text they complete ('' while a character is incomplete)."""
        self.ids.extend(ids)
        prefix_text = self._tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._tokenizer.decode(self.ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._tokenizer.decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


def _read_json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _token_content(token) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as an AddedToken dict.
    if isinstance(token, dict):
        return token.get("content")
    return token


def _chat_template(value) -> str | None:
    # Either one template, or a list of named ones of which "default" is the chat template.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
    raise TokenizerError("chat_template is neither a string nor a list with a 'default' template")


def _compile_template(source: str) -> Template:
    # Sandboxed, as transformers does: a checkpoint's template is data, not trusted code.
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
