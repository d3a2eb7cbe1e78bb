"""The prompt size bound (Tokenizer.max_chars_per_token) and tokenizing without the GIL.

`layerwatch serve` refuses a prompt longer than max_prompt_tokens x max_chars_per_token characters
without tokenizing it. That must never refuse a prompt that would fit: a prompt of n characters
has at least n / max_chars_per_token tokens, for any text, on every tokenizer the bound is given
for; tokenizers that drop or merge characters get no bound (None).
"""

from __future__ import annotations

import queue
import threading
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models as tokenizer_models

from layerwatch.inference_shim.runtime.tokenizer import MAX_CANONICAL_DECOMPOSITION, Tokenizer

from .conftest import build_backend_tokenizer


def sentencepiece_style() -> BackendTokenizer:
    """Llama-2 style: "▁" for spaces, BPE with byte fallback and fused unknowns."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("▁", "t", "h", "e", "a", "n", "d", "th", "▁th", "▁the", "an", "▁an", "▁and"):
        vocab.setdefault(piece, len(vocab))
    merges = [("t", "h"), ("▁", "th"), ("▁th", "e"), ("a", "n"), ("▁", "an"), ("▁an", "d")]
    backend = BackendTokenizer(
        tokenizer_models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return backend


def qwen_style() -> BackendTokenizer:
    """Qwen2 style: NFC, then byte-level BPE (NFC composes several characters into one)."""
    backend = build_backend_tokenizer()
    backend.normalizer = normalizers.NFC()
    return backend


# Prompts built to have few tokens per character: the vocabulary's own words, long runs, special
# tokens, decomposed accents and Hangul jamo (which NFC composes), and anything else.
PIECES = ["the", " the", " and", "<s>", "</s>", "e\u0301", "\u1100\u1161\u11a8", "\u1f00\u0345\u0300", " ", "\n"]
prompts = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(PIECES), max_size=200).map("".join),
)


@pytest.mark.parametrize("make", [build_backend_tokenizer, sentencepiece_style, qwen_style])
@settings(max_examples=150, deadline=None, derandomize=True)
@given(text=prompts)
def test_no_prompt_has_fewer_tokens_than_the_bound_says(make, text):
    tokenizer = Tokenizer(make(), bos_token="<s>")
    chars_per_token = tokenizer.max_chars_per_token()
    assert chars_per_token is not None
    assert len(tokenizer.backend.encode(text, add_special_tokens=False).ids) * chars_per_token >= len(text)


def test_the_longest_entry_repeated_comes_closest(tokenizer):
    """The bound is what the vocabulary allows, not a guess about typical text."""
    longest = max(tokenizer.backend.get_vocab(), key=len)
    text = tokenizer.decode([tokenizer.backend.token_to_id(longest)]) * 50
    assert len(tokenizer.backend.encode(text, add_special_tokens=False).ids) * tokenizer.max_chars_per_token() >= len(
        text
    )


def test_nfc_composes_at_most_max_canonical_decomposition_characters_into_one():
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000))
    assert longest == MAX_CANONICAL_DECOMPOSITION
    assert Tokenizer(qwen_style()).max_chars_per_token() == MAX_CANONICAL_DECOMPOSITION * max(
        map(len, qwen_style().get_vocab(with_added_tokens=True))
    )


def _with(change) -> Tokenizer:
    backend = build_backend_tokenizer()
    change(backend)
    return Tokenizer(backend)


@pytest.mark.parametrize(
    "change",
    [
        # drops the spaces between words: "a" + a million spaces is 1 token
        lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Whitespace()),
        lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Split(" ", behavior="removed")),
        # shortens the text: two spaces become one
        lambda b: setattr(b, "normalizer", normalizers.Replace("  ", " ")),
        lambda b: setattr(b, "normalizer", normalizers.Strip()),
        # an added token that swallows the whitespace around it
        lambda b: b.add_special_tokens([AddedToken("<mask>", lstrip=True)]),
        # silently truncates: a long prompt would look short
        lambda b: b.enable_truncation(16),
    ],
    ids=["whitespace", "split-removed", "replace-shorter", "strip", "lstrip-token", "truncation"],
)
def test_tokenizers_that_lose_characters_get_no_bound(change):
    assert _with(change).max_chars_per_token() is None


def test_a_bpe_without_the_whole_byte_alphabet_gets_no_bound():
    """Without an unknown token or byte fallback, characters outside the vocabulary are dropped."""
    backend = BackendTokenizer(tokenizer_models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert Tokenizer(backend).max_chars_per_token() is None


def test_encoding_a_long_prompt_lets_other_threads_run(tokenizer):
    """The engine thread and the event loop keep running while a worker thread tokenizes.

    Counted in round trips between two other threads while the encode runs (each needs the GIL a
    few times): holding the GIL, encode let ~150-300 through on a 210 KB prompt, releasing it ~11,000.
    """
    text = "And the earth was without form, and void. " * 5_000
    done = threading.Event()
    pings: queue.SimpleQueue = queue.SimpleQueue()
    pongs: queue.SimpleQueue = queue.SimpleQueue()

    def echo() -> None:
        while (item := pings.get()) is not None:
            pongs.put(item)

    echoing = threading.Thread(target=echo)
    echoing.start()
    encoding = threading.Thread(target=lambda: (tokenizer.encode(text), done.set()))
    encoding.start()
    round_trips = 0
    while not done.is_set():
        pings.put(1)
        pongs.get()
        round_trips += 1
    pings.put(None)
    echoing.join()
    encoding.join()
    assert round_trips > 2_000
