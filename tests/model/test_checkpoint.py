"""Loading a checkpoint folder: what loads, and how each kind of broken folder fails at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerwatch.inference_shim.runtime.checkpoint import (
    CheckpointError,
    checkpoint_fingerprint,
    config_from_hf,
    load_checkpoint,
    save_checkpoint,
)
from layerwatch.inference_shim.runtime.gates import model_fingerprint

from .conftest import random_model, tiny_config


@pytest.fixture
def folder(tmp_path, tokenizer) -> Path:
    out = tmp_path / "ckpt"
    save_checkpoint(random_model(tiny_config(), seed=3), tokenizer, out)
    return out


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def expect_error(folder: Path, *fragments: str, fingerprint: bool = True) -> str:
    """load_checkpoint's refusal of `folder`, holding each fragment; with `fingerprint`, checkpoint_fingerprint
    (which reads all but the tokenizer and the weights' values) refuses it with the same message."""
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    if fingerprint:
        with pytest.raises(CheckpointError) as fingerprinted:
            checkpoint_fingerprint(folder, torch.float32)
        assert str(fingerprinted.value) == message
    return message


def test_saved_folder_round_trips(folder, tokenizer):
    loaded = load_checkpoint(folder)
    original = random_model(tiny_config(), seed=3)
    tokens = torch.tensor([[0, 5, 9, 100, 200]])
    assert torch.equal(loaded.model(tokens)[0], original(tokens)[0])
    assert loaded.config == original.config
    assert loaded.tokenizer.eos_token_ids == (1,) and loaded.tokenizer.bos_token_id == 0
    assert loaded.tokenizer.encode("the earth") == tokenizer.encode("the earth")


def test_a_tied_head_decodes_from_its_column_layout_and_stays_the_embedding(tmp_path, tokenizer):
    # The LM head is read whole every token (SmolLM2's is a fifth of its weights), and MKL streams one
    # row's x @ W an [in, out] matrix holds 2.5 times as fast as nn.Linear's [out, in] rows
    # (docs/performance.md, "SmolLM2-135M on one thread"): a tied head gets that layout too, and the
    # embedding keeps reading the same parameter, through a move and a conversion.
    original = random_model(tiny_config(tie_word_embeddings=True), seed=3)
    save_checkpoint(original, tokenizer, tmp_path)
    model = load_checkpoint(tmp_path).model
    tokens = torch.tensor([[0, 5, 9, 100, 200]])
    assert torch.equal(model(tokens)[0], original(tokens)[0])
    for step in ("loaded", "converted"):
        assert model.lm_head.weight is model.embed_tokens.weight, step
        assert model.lm_head.weight.t().is_contiguous(), step
        model = model.double()


def test_dtype_comes_from_the_caller_or_from_config(folder):
    assert load_checkpoint(folder, dtype=torch.bfloat16).model.lm_head.weight.dtype == torch.bfloat16
    edit_config(folder, torch_dtype=None, dtype="float16")
    assert load_checkpoint(folder, dtype=None).model.lm_head.weight.dtype == torch.float16
    edit_config(folder, dtype="float8")
    with pytest.raises(CheckpointError, match="dtype 'float8' is not supported"):
        load_checkpoint(folder, dtype=None)


def test_transformers_5_rope_parameters_and_eos_lists_are_read(folder):
    edit_config(
        folder,
        rope_theta=None,
        rope_scaling=None,
        eos_token_id=[1, 2],
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1234.0},
    )
    del_keys(folder / "config.json", "rope_theta", "rope_scaling")
    config = load_checkpoint(folder).config
    assert config.rope_theta == 1234.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.eos_token_ids == (1, 2)


def del_keys(path: Path, *keys: str) -> None:
    config = json.loads(path.read_text())
    for key in keys:
        config.pop(key, None)
    path.write_text(json.dumps(config))


def test_generation_config_adds_end_of_turn_tokens(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    loaded = load_checkpoint(folder)
    assert loaded.config.eos_token_ids == (1, 7)
    assert set(loaded.tokenizer.eos_token_ids) == {1, 7}


def test_harmless_rotary_buffers_are_ignored(folder):
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    load_checkpoint(folder)


# --- broken folders ------------------------------------------------------------------------------


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not a directory"):
        checkpoint_fingerprint(tmp_path / "nowhere", torch.float32)


def test_missing_config(folder):
    (folder / "config.json").unlink()
    expect_error(folder, "config.json", "file not found")


def test_config_is_not_json(folder):
    (folder / "config.json").write_text("{ this is not json")
    expect_error(folder, "config.json", "not valid JSON")


@pytest.mark.parametrize(
    "name, text, problem",
    [
        # Each stopped serve, eval, calibrate and train-gates with a traceback (or, for the integer,
        # an error that did not name the file).
        ("config.json", "[" * 100_000, "not valid JSON (nested too deeply)"),
        ("config.json", '{"x": ' + "9" * 5000 + "}", "not valid JSON (Exceeds the limit (4300 digits)"),
        ("tokenizer_config.json", '{"a": ' * 50_000 + "1" + "}" * 50_000, "not valid JSON (nested too deeply)"),
    ],
)
def test_json_the_parser_cannot_take_is_a_checkpoint_error_naming_the_file(folder, name, text, problem):
    (folder / name).write_text(text)
    expect_error(folder, name, problem, fingerprint=name != "tokenizer_config.json")


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures=['GPT2LMHeadModel'] is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "bad RoPE settings"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads=3"),
        ({"attention_bias": True}, "attention_bias=true is not supported for Llama"),
        ({"eos_token_id": "</s>"}, "eos_token_id must be an integer or a list"),
        ({"architectures": ["SmolLM3ForCausalLM"]}, "(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2"),
        ({"architectures": ["GraniteForCausalLM"]}, "Gemma2ForCausalLM, Phi3ForCausalLM, Olmo2ForCausalLM)"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
        ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True}, "use_sliding_window=true"),
        ({"architectures": ["GemmaForCausalLM"], "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"architectures": ["Olmo2ForCausalLM"], "attention_bias": True}, "not supported for Olmo2ForCausalLM"),
        (
            {"architectures": ["Gemma2ForCausalLM"], "query_pre_attn_scalar": 8, "attn_logit_softcapping": "50"},
            "attn_logit_softcapping must be a positive number or null, found '50'",
        ),
        (
            {
                "architectures": ["Gemma2ForCausalLM"],
                "query_pre_attn_scalar": 8,
                "sliding_window": 4,
                "layer_types": ["full_attention"],
            },
            "layer_types must list 4 entries",
        ),
    ],
    ids=[
        "architecture",
        "activation",
        "rope-type",
        "rope-fields",
        "layers",
        "gqa",
        "llama-bias",
        "eos",
        "smollm3",
        "granite",
        "partial-rotary",
        "qwen3-sliding",
        "bidirectional",
        "olmo2-bias",
        "softcap",
        "layer-types",
    ],
)
def test_unsupported_config(folder, changes, fragment):
    edit_config(folder, **changes)
    expect_error(folder, "config.json", fragment)


def test_gemma2_without_layer_types_slides_every_other_layer(folder):
    # Checkpoints written before transformers recorded layer_types: layers 0, 2, ... slide.
    edit_config(folder, architectures=["Gemma2ForCausalLM"], query_pre_attn_scalar=8, sliding_window=16)
    raw = json.loads((folder / "config.json").read_text())
    assert "layer_types" not in raw
    config = config_from_hf(raw, folder / "config.json")
    assert (config.sliding_window, config.sliding_layers) == (16, (0, 2))
    assert config.tie_word_embeddings is False  # written by save_checkpoint; Gemma's default is only a default
    del raw["tie_word_embeddings"]
    assert config_from_hf(raw, folder / "config.json").tie_word_embeddings is True


def test_a_model_with_family_features_is_not_saved_as_a_llama(tmp_path, tokenizer):
    gemma_like = random_model(tiny_config(embedding_scale=2.0), seed=3)
    with pytest.raises(ValueError, match=r"family features \['embedding_scale'\]"):
        save_checkpoint(gemma_like, tokenizer, tmp_path)


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    expect_error(folder, "model.safetensors: file not found", "model.safetensors.index.json")


def test_truncated_weights(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    expect_error(folder, "model.safetensors", "cannot read safetensors file")


def test_wrong_shape_names_tensor_and_both_shapes(folder):
    state = load_file(folder / "model.safetensors")
    state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(48, 32)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    expect_error(folder, "model.safetensors", "'model.layers.2.mlp.up_proj.weight'", "[48, 32]", "expected [64, 32]")


def test_missing_tensor(folder):
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    expect_error(folder, "1 tensors missing", "model.layers.1.self_attn.k_proj.weight")


def test_unexpected_tensor_means_a_mismatched_config(folder):
    edit_config(folder, num_hidden_layers=3)  # the file still holds layer 3
    expect_error(folder, "model.safetensors", "unexpected tensor 'model.layers.3.")


def poison(path: Path, name: str, *values: float, stored: torch.dtype = torch.float32) -> None:
    """Write `values` into the first entries of tensor `name` in the safetensors file at `path`,
    the tensor stored as `stored`."""
    state = load_file(path)
    state[name].view(-1)[: len(values)] = torch.tensor(values)
    state[name] = state[name].to(stored)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "value, stored",
    [
        (float("nan"), torch.float32),
        (float("inf"), torch.float32),
        (float("-inf"), torch.float32),
        (float("inf"), torch.float8_e5m2),  # torch's min/max and isfinite take no float8
    ],
    ids=["nan", "inf", "-inf", "float8-inf"],
)
def test_non_finite_weights_are_refused_naming_file_tensor_and_count(folder, value, stored):
    # Such a checkpoint served, every answer a 500 (docs/reliability.md).
    poison(folder / "model.safetensors", "model.layers.2.mlp.down_proj.weight", value, 0.5, value, stored=stored)
    message = expect_error(
        folder,
        "model.safetensors: tensor model.layers.2.mlp.down_proj.weight holds 2 NaN or infinite value(s)",
        fingerprint=False,
    )
    assert "once converted" not in message


@pytest.mark.parametrize("dtype, value", [(torch.float16, 1e5), (torch.bfloat16, 3.4e38)], ids=["float16", "bfloat16"])
def test_weights_that_overflow_the_model_dtype_are_refused(folder, dtype, value):
    poison(folder / "model.safetensors", "model.norm.weight", value)
    load_checkpoint(folder)  # finite in float32
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder, dtype=dtype)
    message = str(caught.value)
    expected = "tensor model.norm.weight holds 1 NaN or infinite value(s) once converted to the model's"
    assert message.endswith(f"model.safetensors: {expected} {dtype}"), message


def sharded(folder: Path) -> Path:
    """Split model.safetensors into two shards with an index."""
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, folder / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()
    return folder


def test_sharded_folder_loads(folder):
    expected = load_checkpoint(folder).model.state_dict()
    got = load_checkpoint(sharded(folder)).model.state_dict()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_non_finite_weights_in_a_shard_name_the_shard(folder):
    name, shard = "model.layers.3.self_attn.q_proj.weight", "model-00002-of-00002.safetensors"
    weight_map = json.loads((sharded(folder) / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map[name] == shard  # the second shard: not only the first file is checked
    poison(folder / shard, name, float("nan"))
    expect_error(folder, f"{shard}: tensor {name} holds 1 NaN", fingerprint=False)


def test_missing_shard(folder):
    (sharded(folder) / "model-00002-of-00002.safetensors").unlink()
    expect_error(folder, "model-00002-of-00002.safetensors", "missing")


def test_index_lists_tensor_the_shard_lacks(folder):
    index_path = sharded(folder) / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    expect_error(folder, "model-00001-of-00002.safetensors", "model.layers.0.mlp.extra.weight")


def test_index_without_weight_map(folder):
    (sharded(folder) / "model.safetensors.index.json").write_text("{}")
    expect_error(folder, "model.safetensors.index.json", "weight_map")


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_folders_fingerprint_is_the_loaded_models(folder, stored, dtype):
    # Weights stored in one dtype and served in another (fp32 -> fp16 -> bf16 rounds twice), a tied head and
    # sharded files: the few values read from the files give the fingerprint of the model in memory.
    state = {name: t.to(stored) for name, t in load_file(folder / "model.safetensors").items()}
    edit_config(folder, tie_word_embeddings=True)
    del state["lm_head.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    expected = model_fingerprint(load_checkpoint(folder, dtype=dtype).model)
    assert checkpoint_fingerprint(folder, dtype) == expected
    assert checkpoint_fingerprint(sharded(folder), dtype) == expected


def test_the_fingerprint_refuses_weights_it_cannot_read_as_floats(folder):
    state = load_file(folder / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int8)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.safetensors: weights stored as I8; the gates' fingerprint reads"):
        checkpoint_fingerprint(folder, torch.float32)


def test_missing_tokenizer(folder):
    (folder / "tokenizer.json").unlink()
    expect_error(folder, "tokenizer.json", "file not found", fingerprint=False)


def test_broken_tokenizer(folder):
    (folder / "tokenizer.json").write_text('{"model": 17}')
    expect_error(folder, "tokenizer.json", "not a valid tokenizers file", fingerprint=False)


def test_tokenizer_config_names_unknown_token(folder):
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["eos_token"] = "<|im_end|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    expect_error(folder, "tokenizer_config.json", "'<|im_end|>' is not in the vocabulary", fingerprint=False)


def test_tokenizer_larger_than_embedding(folder):
    edit_config(folder, vocab_size=100)
    state = load_file(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][:100].contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    expect_error(folder, "tokenizer.json", "vocab_size=100", fingerprint=False)
