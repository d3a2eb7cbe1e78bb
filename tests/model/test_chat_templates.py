"""Chat templates render and encode exactly as transformers' `apply_chat_template(tokenize=True)`.

The templates in chat_templates/ are those published with Qwen2.5-Instruct, Llama-3.2-Instruct,
Mistral-Nemo-Instruct-2407, gemma-2-it and OpenHermes-2.5-Mistral (ChatML on a tokenizer that
prepends BOS to plain text but whose template writes none). Each test makes a tokenizer folder with the model's
special tokens and BOS rule (its tokenizer.json post-processor) and compares, for several
conversations, our rendered text and token ids with transformers' on the same folder, and that a
conversation a template refuses is refused by both with the same message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from layerwatch.inference_shim.runtime.tokenizer import Tokenizer

from .conftest import TRAINING_TEXT

TEMPLATES = Path(__file__).parent / "chat_templates"


@dataclass(frozen=True)
class Family:
    template: str
    special_tokens: tuple[str, ...]
    named: dict[str, str | None]  # tokenizer_config.json's bos_token, eos_token, ...
    bos_prepended: bool  # tokenizer.json's post-processor prepends the BOS token
    template_file: bool = False  # chat_template.jinja instead of tokenizer_config.json's chat_template


FAMILIES = {
    "qwen2.5": Family(
        "qwen2.5.jinja",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        bos_prepended=False,
    ),
    "chatml": Family(
        "chatml.jinja",
        ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"),
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"},
        bos_prepended=True,
    ),
    "llama-3.2": Family(
        "llama-3.2.jinja",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        bos_prepended=True,
        template_file=True,
    ),
    "mistral-nemo": Family(
        "mistral-nemo.jinja",
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]")
        + ("[/TOOL_RESULTS]", "[TOOL_CALLS]"),
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        bos_prepended=True,
    ),
    "gemma-2": Family(
        "gemma-2.jinja",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
        bos_prepended=True,
    ),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city, in Celsius.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

# (messages, tools, add_generation_prompt)
CONVERSATIONS = {
    "user": ([{"role": "user", "content": "Hello"}], None, True),
    "system": ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": " Hi there "}], None, True),
    "multi-turn": (
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And <b>3+3</b>? naïve café ✓"},
        ],
        None,
        False,
    ),
    "tools": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL], True),
    "tool call and result": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call12345", "content": "21"},
        ],
        [WEATHER_TOOL],
        True,
    ),
}


def make_folder(path: Path, family: Family) -> Path:
    """tokenizer.json (byte-level BPE with the family's special tokens and BOS rule) and
    tokenizer_config.json (its named tokens and template) as the Hub ships them."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TRAINING_TEXT * 4, trainer)
    bos = family.named["bos_token"]
    if family.bos_prepended:
        assert bos is not None
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    template = (TEMPLATES / family.template).read_text()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **family.named, "clean_up_tokenization_spaces": False}
    if family.template_file:
        (path / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory) -> tuple[Tokenizer, object]:
    folder = make_folder(tmp_path_factory.mktemp("tokenizers") / request.param, FAMILIES[request.param])
    ours = Tokenizer.from_files(folder / "tokenizer.json", folder / "tokenizer_config.json")
    return ours, AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_chat_renders_and_encodes_as_transformers(pair, conversation):
    ours, reference = pair
    messages, tools, add_generation_prompt = CONVERSATIONS[conversation]
    options = dict(tools=tools, add_generation_prompt=add_generation_prompt)
    try:
        expected_text = reference.apply_chat_template(messages, tokenize=False, **options)
    except TemplateError as refused:  # e.g. gemma has no system or tool roles: ours must refuse alike
        with pytest.raises(TemplateError) as ours_refused:
            ours.apply_chat_template(messages, **options)
        assert str(ours_refused.value) == str(refused)
        return
    expected_ids = reference.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    text = ours.apply_chat_template(messages, **options)
    assert text == expected_text
    assert ours.encode_chat_prompt(text) == expected_ids
    assert expected_ids.count(ours.bos_token_id) == text.count(ours.bos_token or "\0")  # BOS only where written


@pytest.mark.parametrize("text", ["Hello", "", "In the beginning ✓"])
def test_completion_prompts_encode_as_transformers(pair, text):
    ours, reference = pair
    assert ours.encode(text) == reference(text).input_ids


def test_chatml_gets_no_bos_and_llama_gets_todays_date_and_its_tools(tmp_path):
    # The regressions the issue reported: BOS prepended to a ChatML prompt whose template writes
    # none, `strftime_now` undefined (the template's fallback date), `tools` not passed.
    chatml_folder = make_folder(tmp_path / "chatml", FAMILIES["chatml"])
    chatml = Tokenizer.from_files(chatml_folder / "tokenizer.json", chatml_folder / "tokenizer_config.json")
    prompt_ids = chatml.encode_chat_prompt(chatml.apply_chat_template([{"role": "user", "content": "Hello"}]))
    assert chatml.encode("Hello")[0] == chatml.bos_token_id and chatml.bos_token_id not in prompt_ids
    llama_folder = make_folder(tmp_path / "llama", FAMILIES["llama-3.2"])
    llama = Tokenizer.from_files(llama_folder / "tokenizer.json", llama_folder / "tokenizer_config.json")
    dated = llama.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL])
    assert "Today Date: 26 Jul 2024" not in dated and '"name": "get_weather"' in dated
    given = llama.apply_chat_template([{"role": "user", "content": "Hi"}], date_string="1 Jan 2025")
    assert "Today Date: 1 Jan 2025" in given


def test_the_tool_use_template_is_chosen_when_tools_are_given(tmp_path, backend_tokenizer):
    backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    templates = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "{{ tools | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    ours = Tokenizer.from_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    reference = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    for tools, expected in ((None, "plain"), ([WEATHER_TOOL], "1")):
        assert ours.apply_chat_template(messages, tools=tools) == expected
        assert reference.apply_chat_template(messages, tools=tools, tokenize=False) == expected


# --- OpenAI's developer role, continue_final_message, what a template reads ------------------------

DEVELOPER = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]


def test_a_developer_message_is_the_system_instruction_for_templates_without_the_role(pair):
    """OpenAI's developer message is its system instruction: none of these templates names the role,
    so it renders as their system message does (Qwen2.5 wrote its default system prompt and dropped
    the text; gemma, which has no system role, refuses both alike)."""
    ours, reference = pair
    as_system = [{**DEVELOPER[0], "role": "system"}, DEVELOPER[1]]
    try:
        expected = reference.apply_chat_template(as_system, tokenize=False, add_generation_prompt=True)
    except TemplateError as refused:
        with pytest.raises(TemplateError) as ours_refused:
            ours.apply_chat_template(DEVELOPER)
        assert str(ours_refused.value) == str(refused)
        return
    assert "Answer in French." in expected
    assert ours.apply_chat_template(DEVELOPER) == expected


def test_a_template_that_names_the_developer_role_gets_it(backend_tokenizer):
    knows = "{% for m in messages %}{% if m.role == 'developer' %}[dev]{% else %}[{{ m.role }}]{% endif %}"
    knows += "{{ m.content }}{% endfor %}"
    prose = "{# a developer note #}Made by developers. {% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert Tokenizer(backend_tokenizer, chat_template=knows).apply_chat_template(DEVELOPER) == (
        "[dev]Answer in French.[user]Hello"
    )
    # Mentioning the word in text or comments is not knowing the role.
    assert Tokenizer(backend_tokenizer, chat_template=prose).apply_chat_template(DEVELOPER) == (
        "Made by developers. [system]Answer in French.[user]Hello"
    )
    assert Tokenizer(backend_tokenizer).apply_chat_template(DEVELOPER) == (
        "system: Answer in French.\nuser: Hello\nassistant:"
    )


@pytest.mark.parametrize("final", ["Once upon a", "Trailing space "])
def test_continue_final_message_leaves_the_last_message_open_as_transformers_does(pair, final):
    ours, reference = pair
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": final}]
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    text = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == expected and text.rstrip().endswith(final.rstrip())
    with pytest.raises(TemplateError, match="cannot both be true"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_template_facts_are_the_variables_a_template_reads(pair):
    ours, _ = pair
    facts = ours.template_facts(ours.template_name())
    assert "messages" in facts.variables
    assert "raise_exception" not in facts.variables and "namespace" not in facts.variables  # the environment's
    assert "developer" not in facts.constants


def test_llama_reads_its_date_and_tool_options(tmp_path):
    folder = make_folder(tmp_path / "llama", FAMILIES["llama-3.2"])
    llama = Tokenizer.from_files(folder / "tokenizer.json", folder / "tokenizer_config.json")
    assert {"date_string", "tools_in_user_message", "tools"} <= llama.template_facts("default").variables
