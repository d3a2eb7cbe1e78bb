"""The checkpoint's tokenizer: `tokenizer.json` (Hugging Face `tokenizers`), `tokenizer_config.json`
and the chat template, read and applied as transformers reads and applies them (docs/model.md).

Special tokens (BOS) come from `tokenizer.json`'s post-processor, exactly as transformers'
`tokenizer(text)` adds them; a rendered chat is encoded without them, as `apply_chat_template` does,
so BOS appears there only where the template writes it. The chat template is `chat_template.jinja`
(or `tokenizer_config.json`'s `chat_template`), rendered in the Jinja environment transformers uses.
A checkpoint without one gets the plain template:

    system: You are terse.
    user: Hello
    assistant:

OpenAI's `developer` role is its system instruction: a template that never names the role (Qwen2.5
would drop the text and write its default system prompt) gets such messages as `system` ones
(`TemplateFacts`, read off the template's syntax tree).

Streaming uses `IncrementalDecoder`: it turns one token at a time into text deltas whose
concatenation is the text of all tokens, never emitting half a UTF-8 character.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from layerwatch.inference_shim.runtime import chat_template

log = logging.getLogger(__name__)

# The special tokens transformers hands every chat template by name (its SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers 4.50+: takes priority over tokenizer_config.json's
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # more named templates, one NAME.jinja each
# Names a message's reasoning arrives under; transformers fills the ones templates read from any of them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What continue_final_message appends to the final message to find where it ends once rendered
# (transformers' tag: the text after it is the template's closing of the message, cut off).
CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True)
class TemplateFacts:
    """What a chat template reads, from its syntax tree: the variables it takes from the caller (those
    it never assigns itself, but for the environment's globals) and the string constants it holds (the
    roles it compares with, ...).
    A role the template names is one it knows; literal text outside tags and comments is not a constant,
    so a template that merely mentions "developer" in its prose does not count."""

    variables: frozenset[str]
    constants: frozenset[str]


PLAIN_TEMPLATE_FACTS = TemplateFacts(frozenset({"messages", "add_generation_prompt"}), frozenset())


def plain_chat_prompt(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The template for checkpoints without one: a "role: content" line per message (OpenAI roles,
    developer as system), then the assistant's turn opened. Plain Python, so the default path needs
    no Jinja."""
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
        chat_template: str | Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        add_bos_token: bool | None = None,
    ) -> None:
        """Wrap `tokenizer` (a `tokenizers.Tokenizer`).

        `add_bos_token` None keeps the tokenizer's own post-processor (what a tokenizer.json says);
        True or False replaces it with one that prepends BOS or nothing, as transformers does when
        given `add_bos_token` (for tokenizers built here, which have no post-processor yet).
        `chat_template` is one template or named ones ("default", "tool_use", ...).
        `special_tokens` are further named tokens for templates (`pad_token`, ...).
        """
        self.bos_token = bos_token
        self.bos_token_id = self._id_of(tokenizer, bos_token) if bos_token is not None else None
        if add_bos_token is not None:
            tokenizer = _with_bos_post_processor(tokenizer, bos_token if add_bos_token else None)
        self.backend = tokenizer
        eos_ids = [self._id_of(tokenizer, t) for t in eos_tokens] + list(extra_eos_token_ids)
        self.eos_tokens = tuple(eos_tokens)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))  # ordered, no duplicates
        self.special_tokens = {
            **(special_tokens or {}),
            **({"bos_token": bos_token} if bos_token is not None else {}),
            **({"eos_token": self.eos_tokens[0]} if self.eos_tokens else {}),
        }
        templates = {"default": chat_template} if isinstance(chat_template, str) else dict(chat_template or {})
        if templates and "default" not in templates:
            raise TokenizerError(f"chat templates {sorted(templates)} include no 'default' one")
        self.chat_templates: dict[str, str] = templates
        self._facts: dict[str, TemplateFacts] = {}

    @classmethod
    def from_files(
        cls,
        tokenizer_json: Path,
        tokenizer_config_json: Path | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
    ) -> Tokenizer:
        """Load tokenizer.json (required), tokenizer_config.json (optional, may be None or absent) and
        the chat template files next to tokenizer.json (`chat_template.jinja`, `additional_chat_templates/`).

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
        named = {name: _token_content(settings.get(name)) for name in TEMPLATE_SPECIAL_TOKENS}
        eos = named["eos_token"]
        template_files = _read_chat_templates(tokenizer_json.parent)
        try:
            tokenizer = cls(
                backend,
                bos_token=named["bos_token"],
                eos_tokens=(eos,) if eos else (),
                extra_eos_token_ids=extra_eos_token_ids,
                chat_template=template_files or _chat_template(settings.get("chat_template")),
                special_tokens={name: token for name, token in named.items() if token is not None},
            )
        except TokenizerError as exc:
            raise TokenizerError(f"{tokenizer_config_json}: {exc}") from exc
        try:
            for name in tokenizer.chat_templates:  # a broken or hostile template fails at load, not per request
                tokenizer._check_template(name)
        except TokenizerError as exc:
            source = tokenizer_json.parent / CHAT_TEMPLATE_FILE if template_files else tokenizer_config_json
            raise TokenizerError(f"{source}: {exc}") from exc
        if settings.get("add_bos_token") is True and not tokenizer.adds_bos:
            # Folders saved before the BOS moved into tokenizer.json's post-processor look like this.
            log.warning(
                "%s says add_bos_token: true, but %s's post-processor adds no BOS; prompts get none, as "
                'transformers encodes them (re-save the tokenizer: docs/model.md, "Tokenizer")',
                tokenizer_config_json,
                tokenizer_json,
            )
        return tokenizer

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    @property
    def adds_bos(self) -> bool:
        """Whether `encode` prepends the BOS token (the post-processor's choice)."""
        return self.bos_token_id is not None and self.backend.encode("").ids[:1] == [self.bos_token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens (BOS) the tokenizer's post-processor adds
        unless `add_special_tokens` is False: transformers' `tokenizer(text).input_ids`."""
        # encode_batch, not encode: only the batch call releases the GIL while the Rust code runs,
        # so a long prompt tokenized in a worker thread does not stall the engine thread and the
        # event loop (encode held it for 2 s on a 1 MiB prompt).
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def special_token_pattern(self) -> re.Pattern[str] | None:
        """Matches the text of any special (control) token: what, written in a message, the tokenizer
        reads as that token rather than as text. None: the tokenizer has none."""
        texts = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None

    def max_chars_per_token(self) -> int | None:
        """The most prompt characters one token can stand for; None when no such bound holds.

        A prompt of n characters then has at least n / this many tokens, so a prompt longer than
        `max_prompt_tokens` times this bound can be refused without tokenizing it (docs/service.md,
        "Prompt limits"). See `_max_chars_per_token` for when the bound holds.
        """
        return _max_chars_per_token(json.loads(self.backend.to_str()), self.backend.get_vocab(with_added_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render OpenAI-style messages [{"role": ..., "content": ...}] (and tool schemas, documents,
        further template variables; plain JSON values) into the prompt text, as transformers'
        `apply_chat_template(..., tokenize=False)`: the "tool_use" template when tools are given and
        the checkpoint has one. `continue_final_message` leaves the last message open (the text
        ends with its content, as transformers cuts it). Messages of the `developer` role are
        `system` ones for a template that does not name the role. A template's `raise_exception`,
        a conversation continue_final_message cannot continue, and a template past its bounds in time
        or memory (chat_template.py) raise jinja2's TemplateError."""
        name = self.template_name(tools is not None)
        knows_developer = "developer" in self.template_facts(name).constants
        prepared = [_template_message(m, knows_developer) for m in messages]
        if continue_final_message:
            prepared = _tag_final_message(prepared, add_generation_prompt)
        if name is None:
            text = plain_chat_prompt(prepared, add_generation_prompt)
        else:
            variables = {
                "messages": prepared,
                "tools": tools,
                "documents": documents,
                "add_generation_prompt": add_generation_prompt,
                **{**self.special_tokens, **template_kwargs},  # as in transformers, the caller's win
            }
            text = chat_template.render(self.chat_templates[name], variables)
        return _cut_at_tag(text, prepared[-1]["content"]) if continue_final_message else text

    def template_name(self, tools: bool = False) -> str | None:
        """The chat template a conversation is rendered with; None: the plain one."""
        if not self.chat_templates:
            return None
        return "tool_use" if tools and "tool_use" in self.chat_templates else "default"

    def template_facts(self, name: str | None) -> TemplateFacts:
        """What the named chat template reads (None: the plain one); computed once per template."""
        if name is None:
            return PLAIN_TEMPLATE_FACTS
        if name not in self._facts:
            self._facts[name] = _template_facts(self.chat_templates[name])
        return self._facts[name]

    def encode_chat_prompt(self, prompt: str, add_special_tokens: bool | None = None) -> list[int]:
        """The ids of a prompt `apply_chat_template` rendered. By default a checkpoint template's text is
        encoded without special tokens, as transformers' `apply_chat_template(tokenize=True)` does (BOS
        only where the template writes it); the plain template's like a completion prompt."""
        if add_special_tokens is None:
            add_special_tokens = not self.chat_templates
        return self.encode(prompt, add_special_tokens=add_special_tokens)

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)

    def save(self, out_dir: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into out_dir."""
        out_dir = Path(out_dir)
        self.backend.save(str(out_dir / "tokenizer.json"))
        settings: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens,
            # What the post-processor does, for readers that look here (llama.cpp's converter).
            "add_bos_token": self.adds_bos,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_templates:
            named = [{"name": n, "template": t} for n, t in self.chat_templates.items()]
            settings["chat_template"] = self.chat_template if len(named) == 1 else named
        (out_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")

    def _check_template(self, name: str) -> None:
        """Refuse a template that does not compile, or that cannot render a one-message conversation
        within its bounds (a constant `'x' * 4000000000`, a loop whatever the messages); one that
        refuses that conversation (`raise_exception`: "a system message is required") is not at fault."""
        from jinja2 import TemplateError, TemplateSyntaxError

        try:
            chat_template.check_compiles(self.chat_templates[name])
        except TemplateSyntaxError as exc:
            raise TokenizerError(f"chat template {name!r} is not valid Jinja (line {exc.lineno}: {exc})") from exc
        except chat_template.TemplateLimitError as exc:
            raise TokenizerError(f"chat template {name!r} {exc.problem}") from None
        probe = {"messages": [{"role": "user", "content": "Hello"}], "add_generation_prompt": True}
        try:
            chat_template.render(self.chat_templates[name], {**self.special_tokens, **probe})
        except chat_template.TemplateLimitError as exc:
            raise TokenizerError(f"chat template {name!r} {exc.problem} to render one user message") from None
        except TemplateError:
            pass

    @staticmethod
    def _id_of(backend: tokenizers.Tokenizer, token: str) -> int:
        token_id = backend.token_to_id(token)
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
    except RecursionError:  # e.g. 50,000 nested objects: the parser recurses once per level
        raise TokenizerError(f"{path}: not valid JSON (nested too deeply)") from None
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _token_content(token) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as an AddedToken dict.
    if isinstance(token, dict):
        return token.get("content")
    return token


def _chat_template(value) -> str | dict[str, str] | None:
    # Either one template, or a list of named ones ({"name": ..., "template": ...}).
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise TokenizerError("chat_template is neither a string nor a list of {'name': ..., 'template': ...} objects")


def _read_chat_templates(folder: Path) -> dict[str, str] | None:
    """`chat_template.jinja` ("default") and `additional_chat_templates/NAME.jinja`, if any; transformers
    prefers these files to tokenizer_config.json's `chat_template`."""
    files = [folder / CHAT_TEMPLATE_FILE, *sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja"))]
    templates = {}
    for path in files:
        if path.is_file():
            name = "default" if path.name == CHAT_TEMPLATE_FILE else path.name.removesuffix(".jinja")
            try:
                templates[name] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{path}: unreadable chat template ({exc})") from exc
    return templates or None


def _with_bos_post_processor(backend: tokenizers.Tokenizer, bos_token: str | None) -> tokenizers.Tokenizer:
    """A copy of `backend` whose post-processor prepends `bos_token` (nothing when None), written
    as transformers' `update_post_processor` writes it."""
    backend = tokenizers.Tokenizer.from_str(backend.to_str())  # the caller's tokenizer stays as it was
    if bos_token is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    else:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token}:0 $A:0",
            pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
            special_tokens=[(bos_token, Tokenizer._id_of(backend, bos_token))],
        )
    return backend


def _template_message(message: Mapping[str, Any], knows_developer: bool) -> dict[str, Any]:
    # As transformers prepares each message: keys whose value is None are dropped (templates test
    # for a missing key, and would print "None"), and reasoning under any of its names fills the
    # names templates read. And OpenAI's developer message is the system instruction (module doc).
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    if message.get("role") == "developer" and not knows_developer:
        message["role"] = "system"
    return message


def _tag_final_message(messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[dict[str, Any]]:
    """The conversation with CONTINUE_FINAL_MESSAGE_TAG after the final message's text (transformers' way)."""
    from jinja2.exceptions import TemplateError

    if add_generation_prompt:
        raise TemplateError("continue_final_message and add_generation_prompt cannot both be true")
    if not isinstance(messages[-1].get("content"), str):
        raise TemplateError("continue_final_message is set but the final message has no text to continue")
    final = messages[-1]
    return [*messages[:-1], {**final, "content": final["content"] + CONTINUE_FINAL_MESSAGE_TAG}]


def _cut_at_tag(text: str, tagged: str) -> str:
    """The rendered text up to the final message's end (`_tag_final_message`), as transformers cuts it:
    at the tag, or before the spaces a template trimmed off it."""
    from jinja2.exceptions import TemplateError

    final = tagged.removesuffix(CONTINUE_FINAL_MESSAGE_TAG)
    if final.strip() not in text or CONTINUE_FINAL_MESSAGE_TAG.strip() not in text:
        raise TemplateError(
            "continue_final_message is set but the chat template does not write the final message as it is"
        )
    at = text.rindex(CONTINUE_FINAL_MESSAGE_TAG.strip())
    if text[at : at + len(CONTINUE_FINAL_MESSAGE_TAG)] == CONTINUE_FINAL_MESSAGE_TAG:
        return text[:at]
    return text[:at].rstrip()


def _template_facts(source: str) -> TemplateFacts:
    from jinja2 import meta, nodes

    environment = chat_template.environment()
    tree = environment.parse(source)
    constants = {node.value for node in tree.find_all(nodes.Const) if isinstance(node.value, str)}
    # (the environment's globals, raise_exception and the like, are not the caller's to give)
    variables = meta.find_undeclared_variables(tree) - environment.globals.keys()
    return TemplateFacts(frozenset(variables), frozenset(constants))
