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
        # encode_batch, not encode: only the batch call releases the GIL while the Rust code runs,
        # so a long prompt tokenized in a worker thread does not stall the engine thread and the
        # event loop (encode held it for 2 s on a 1 MiB prompt).
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos and self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def max_chars_per_token(self) -> int | None:
        """The most prompt characters one token can stand for; None when no such bound holds.

        A prompt of n characters then has at least n / this many tokens, so a prompt longer than
        `max_prompt_tokens` times this bound can be refused without tokenizing it (docs/service.md,
        "Prompt limits"). See `_max_chars_per_token` for when the bound holds.
        """
        return _max_chars_per_token(json.loads(self.backend.to_str()), self.backend.get_vocab(with_added_tokens=True))

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


# NFC and NFKC compose at most this many characters into one: the longest canonical decomposition of
# a character (U+1F82 and others; tests/model/test_tokenizer.py checks it against unicodedata).
MAX_CANONICAL_DECOMPOSITION = 4
_DECOMPOSING_NORMALIZERS = {"NFD", "NFKD", "Prepend"}  # never shorten the text
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits"}  # split (or map 1:1), drop nothing
_BYTE_LEVEL_ALPHABET_SIZE = 256


def _max_chars_per_token(config: dict, vocab: Mapping[str, int]) -> int | None:
    """The longest vocabulary entry, times the most the normalizer can shorten the text; None unless
    every character of the prompt ends up inside some token.

    Each BPE token is a contiguous piece of the normalized, pre-tokenized text, as long as its entry:
    in characters for SentencePiece-style vocabularies (a space is one "▁"), in bytes for byte-level
    ones (one entry character per byte, and a character is at least one byte). So a prompt of n
    characters has at least n / (longest entry x shortening) tokens, provided nothing is dropped or
    absorbed on the way: only BPE; normalizers that keep or lengthen the text (NFC/NFKC shorten by at
    most MAX_CANONICAL_DECOMPOSITION); pre-tokenizers that drop nothing; no silent truncation; no added
    token that swallows the whitespace around it; and every character reaching some token (byte
    fallback, a complete byte-level alphabet, or an unknown token per character).
    """
    model = config.get("model") or {}
    if model.get("type") != "BPE" or config.get("truncation") is not None:
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in config.get("added_tokens") or ()):
        return None
    shortening = 1
    for normalizer in _flatten(config.get("normalizer"), "normalizers"):
        kind = normalizer.get("type")
        if kind in _COMPOSING_NORMALIZERS:
            shortening = MAX_CANONICAL_DECOMPOSITION
        elif kind == "Replace":
            pattern = (normalizer.get("pattern") or {}).get("String")
            if pattern is None or len(normalizer.get("content", "")) < len(pattern):
                return None  # a regex, or a replacement shorter than what it replaces
        elif kind not in _DECOMPOSING_NORMALIZERS:
            return None
    pre_tokenizers = _flatten(config.get("pre_tokenizer"), "pretokenizers")
    for pre_tokenizer in pre_tokenizers:
        kind = pre_tokenizer.get("type")
        if kind in ("Split", "Punctuation"):
            if pre_tokenizer.get("behavior") == "Removed":
                return None
        elif kind not in _KEEPING_PRE_TOKENIZERS:
            return None  # e.g. Whitespace: drops the spaces between words
    byte_level = any(p.get("type") == "ByteLevel" for p in pre_tokenizers)
    if not (
        model.get("byte_fallback")
        or (model.get("unk_token") is not None and not model.get("fuse_unk"))
        or (byte_level and _has_byte_level_alphabet(vocab))
    ):
        return None  # a character outside the vocabulary would be dropped (or runs of them fused)
    return max(map(len, vocab)) * shortening


def _flatten(component: dict | None, members: str) -> list[dict]:
    """A normalizer or pre-tokenizer as the list of its parts (a Sequence's members, recursively)."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [part for member in component.get(members) or () for part in _flatten(member, members)]
    return [component]


def _has_byte_level_alphabet(vocab: Mapping[str, int]) -> bool:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    return len(alphabet) == _BYTE_LEVEL_ALPHABET_SIZE and all(symbol in vocab for symbol in alphabet)


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
