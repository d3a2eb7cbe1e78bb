"""The tokenizer wrapper: BOS handling, chat templates, and streaming detokenisation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from layerwatch.inference_shim.runtime.tokenizer import Tokenizer, TokenizerError

from .conftest import TRAINING_TEXT


def test_bos_comes_from_the_post_processor(tokenizer):
    ids = tokenizer.encode("the earth")
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1 and tokenizer.adds_bos
    assert tokenizer.encode("the earth", add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids) == "the earth"


def test_add_bos_token_false_is_respected_and_the_backend_is_not_changed(backend_tokenizer):
    plain = Tokenizer(backend_tokenizer, bos_token="<s>", add_bos_token=False)
    assert plain.bos_token_id not in plain.encode("the earth") and not plain.adds_bos
    assert backend_tokenizer.post_processor is None  # the shared tokenizer was copied, not edited


def test_a_saved_tokenizer_encodes_as_transformers_does(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tokenizer.save(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    loaded = Tokenizer.from_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    for text in ("the earth", "", "<s>the earth", "naïve café"):
        assert loaded.encode(text) == tokenizer.encode(text) == reference(text).input_ids


def test_plain_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"}]
    assert tokenizer.apply_chat_template(messages) == "system: Be terse.\nuser: Hello\nassistant:"


def test_checkpoint_chat_template_is_used(tmp_path, backend_tokenizer):
    backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
                "chat_template": [{"name": "default", "template": template}],
            }
        )
    )
    loaded = Tokenizer.from_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user]hi</s>"
    assert loaded.eos_token_ids == (1,)


def test_template_errors_are_raised(tokenizer, backend_tokenizer):
    strict = Tokenizer(backend_tokenizer, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(Exception, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_tokenizer_config(tmp_path, backend_tokenizer):
    backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: expected a JSON object"):
        Tokenizer.from_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")


@pytest.mark.parametrize("text", TRAINING_TEXT + ["emoji 🙂 and ✓✓ mixed", "日本語のテキスト"])
def test_incremental_decoder_streams_the_full_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = tokenizer.incremental_decoder()
    deltas = [decoder.push([token]) for token in ids]
    deltas.append(decoder.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # never half a character


def test_incremental_decoder_flushes_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # byte-level: the emoji spans several tokens
    decoder = tokenizer.incremental_decoder()
    assert decoder.push(ids[:1]) == ""  # held back
    assert decoder.flush() == "\ufffd"


def test_demo_tokenizer_agrees_with_transformers():
    # Client token counts (AutoTokenizer) must match the server's, and the demo model keeps the BOS
    # it was trained with (every training document starts with it).
    from transformers import AutoTokenizer

    folder = Path(__file__).resolve().parents[2] / "layerwatch" / "inference_shim" / "demo_model"
    ours = Tokenizer.from_files(folder / "tokenizer.json", folder / "tokenizer_config.json")
    reference = AutoTokenizer.from_pretrained(folder)
    for text in ("In the beginning God created", "", "Ünïcödé ✓"):
        assert ours.encode(text) == reference(text).input_ids
        assert ours.encode(text)[:1] == [ours.bos_token_id]


def test_a_config_asking_for_a_bos_the_post_processor_does_not_add_is_reported(tmp_path, backend_tokenizer, caplog):
    backend_tokenizer.save(str(tmp_path / "tokenizer.json"))  # no post-processor: no BOS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": True}))
    loaded = Tokenizer.from_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    assert loaded.bos_token_id not in loaded.encode("the earth")
    assert "add_bos_token: true" in caplog.text and "tokenizer.json's post-processor adds no BOS" in caplog.text


# Jinja folds a constant expression while it compiles: before, this one allocated its 1.5 GB in the
# loading process (4e9, in a 16 KB GGUF, 12 GB); `eval`, `calibrate` and `serve` load the same way.
MEMORY_BOMB = "{{ 'x' * 1500000000 }}"
# Each render a stack of loops or a string doubled past any memory; both rendered for good before.
LOOPING = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
DOUBLING = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"


@pytest.mark.parametrize(
    "template, problem",
    [(MEMORY_BOMB, "needed more than 1024 MiB"), (LOOPING, "took more than 2 s")],
    ids=["bomb", "loop"],
)
def test_a_template_past_its_bounds_for_one_message_is_refused_at_load(tmp_path, backend_tokenizer, template, problem):
    backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    with pytest.raises(
        TokenizerError, match=rf"tokenizer_config.json: chat template 'default' {problem} to render one"
    ):
        Tokenizer.from_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")


@pytest.mark.parametrize(
    "template, problem",
    # (doubling reaches the memory bound in 0.3 s on an idle machine, the time bound first on a busy one)
    [(LOOPING, "took more than 2 s"), (DOUBLING, "(needed more than 1024 MiB|took more than 2 s)")],
    ids=["loop", "doubling"],
)
def test_a_render_past_its_time_or_memory_is_stopped_and_the_next_one_renders(backend_tokenizer, template, problem):
    from jinja2 import TemplateError

    from layerwatch.inference_shim.runtime.chat_template import RENDER_SECONDS

    hostile = Tokenizer(backend_tokenizer, chat_template=template)
    started = time.monotonic()
    with pytest.raises(TemplateError, match=f"the chat template {problem}"):
        hostile.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < RENDER_SECONDS + 3  # the worker is killed at its deadline
    plain = Tokenizer(backend_tokenizer, chat_template="{{ messages[0].content }}!")
    assert plain.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


@pytest.mark.parametrize(
    "template, problem",
    [
        ("{% for m in messages %}{{ m.content }}", "is not valid Jinja"),
        ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "is nested too deeply"),  # was a RecursionError traceback
    ],
)
def test_a_broken_chat_template_fails_at_load_naming_its_file(tmp_path, backend_tokenizer, template, problem):
    backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").write_text(template)
    with pytest.raises(TokenizerError, match=rf"chat_template.jinja: chat template 'default' {problem}"):
        Tokenizer.from_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
