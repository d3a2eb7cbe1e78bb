"""`import-gguf` on each family it converts, against transformers' own GGUF loading of the same file.

Each case writes a tiny random transformers model as llama.cpp's converter would (gguf's tensor names,
Llama's Q and K rows permuted, some tensors quantized to Q8_0, the byte-level tokenizer as metadata
naming its pre-tokenizer), imports it, and compares our model's logits and our tokenizer's ids with
what transformers reads from the file. Also: --force replaces a folder with a complete import, and a
tensor type the gguf library cannot dequantize is refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from layerwatch.cli.main import main
from layerwatch.inference_shim.offline.gguf_import import GGUFImportError, import_gguf
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint

from .conftest import TRAINING_TEXT, build_backend_tokenizer
from .test_transformers_reference import LLAMA, build_reference, float32_tolerance, logits_of, sequence

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# name -> (GGUF architecture, transformers family, config fields, tokenizer.ggml.pre)
CASES = {
    "llama": ("llama", "llama", dict(LLAMA), "llama-bpe"),
    "llama-tied": ("llama", "llama", dict(LLAMA, tie_word_embeddings=True), "gpt-2"),
    "qwen2": ("qwen2", "qwen2", dict(LLAMA, num_key_value_heads=1), "qwen2"),
    # head_dim 128 ≠ hidden / heads, from attention.key_length (transformers' GGUF loading ignores the
    # key and takes Qwen3's default, 128, so that is the one both can read).
    "qwen3": ("qwen3", "qwen3", dict(LLAMA, head_dim=128), "qwen2"),
}
# Text where the pre-tokenizers differ: digit runs (GPT-2 keeps them whole, Llama 3 cuts them in
# threes, Qwen2 one by one), spaces before digits, contractions in capitals, newlines.
TEXT = "In 2024 THEY'D paid  1,234 coins;\n\n  the earth was   without form 2024 ÜNÏCÖDÉ 日本"


@pytest.fixture(scope="module")
def backend_tokenizer():
    """Byte-level BPE (tests/model/conftest.py's) trained with digit runs too, so that its merges
    join digits: how each pre-tokenizer cuts them then shows in the ids."""
    return build_backend_tokenizer([*TRAINING_TEXT, "In 2024, 1234 and 2024: 20 24 202 4"])


CONTROL, NORMAL = 3, 1  # llama.cpp's token types


def write_gguf(
    path, reference, backend_tokenizer, architecture: str, pre: str, quantize=gguf.GGMLQuantizationType.Q8_0
):
    """`reference` (a transformers model) as llama.cpp's converter writes it."""
    config = reference.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    serialized = json.loads(backend_tokenizer.to_str())
    vocab = backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    special = {token["content"] for token in serialized["added_tokens"] if token["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in serialized["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if token in special else NORMAL for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}")
    names = gguf.get_tensor_name_map(
        next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture), config.num_hidden_layers
    )
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        values = tensor.numpy()
        if architecture == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            rows = values.shape[0]  # llama.cpp's permute: each head's two rotary halves interleaved
            values = values.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(values.shape)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if values.ndim == 2 and quantize is not None:
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, quantize), raw_dtype=quantize)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(params=list(CASES), scope="module")
def imported(request, tmp_path_factory, backend_tokenizer):
    """(transformers' model and tokenizer from the GGUF, our import of it) for one case."""
    torch.set_num_threads(1)
    architecture, family, fields, pre = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    path = folder / "model.gguf"
    write_gguf(path, build_reference(family, fields), backend_tokenizer, architecture, pre)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    import_gguf(path, folder / "imported")
    return reference.eval(), tokenizer, load_checkpoint(folder / "imported")


def test_logits_match_transformers_loading_the_same_file(imported):
    reference, _, ours = imported
    tokens = sequence(1)
    with torch.no_grad():
        expected = reference(tokens).logits
        logits, _ = ours.model(tokens)
    assert (logits - expected).abs().max().item() <= float32_tolerance(reference, logits_of(tokens))


def test_token_ids_match_transformers(imported):
    """For the pre-tokenizers transformers reads from the file (not "smollm": test_gguf_import.py)."""
    _, tokenizer, ours = imported
    ids = ours.tokenizer.encode(TEXT)
    assert ids == tokenizer(TEXT).input_ids
    assert ours.tokenizer.decode(ids) == TEXT
    assert ours.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>user: hi</s>"


def test_force_replaces_a_folder_with_a_complete_import(tmp_path, backend_tokenizer, capsys):
    path = tmp_path / "model.gguf"
    write_gguf(path, build_reference("llama", LLAMA), backend_tokenizer, "llama", "gpt-2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert main(["import-gguf", str(path), "--out", str(out), "--force", "--dtype", "bfloat16"]) == 0
    assert "imported model.gguf (llama, 3 layers" in capsys.readouterr().out
    assert not (out / "notes.txt").exists()
    assert load_checkpoint(out, dtype=None).model.embed_tokens.weight.dtype == torch.bfloat16
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial folder left


def test_a_tensor_type_the_gguf_library_cannot_dequantize_is_refused_by_name(tmp_path, backend_tokenizer):
    path = tmp_path / "model.gguf"
    write_gguf(path, build_reference("llama", LLAMA), backend_tokenizer, "llama", "gpt-2", quantize=None)
    # Rewrite one F32 tensor's type code in place as Q8_1 (llama.cpp's activation type), which the gguf
    # library does not dequantize:
    # the type is a uint32 right after the tensor's name, dimension count and dimensions.
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    type_field = tensor.field.parts[-2]  # parts: name length, name, n_dims, dims, type, offset
    data = bytearray(path.read_bytes())
    offset = tensor.field.offset + sum(part.nbytes for part in tensor.field.parts[:-2])
    assert int(np.frombuffer(data, np.uint32, 1, offset)[0]) == int(type_field[0]) == gguf.GGMLQuantizationType.F32
    data[offset : offset + 4] = np.uint32(gguf.GGMLQuantizationType.Q8_1).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFImportError, match=r"tensor blk\.0\.ffn_up\.weight is of type Q8_1"):
        import_gguf(path, tmp_path / "out")


def test_an_out_that_cannot_be_written_is_refused_in_one_line(tmp_path, backend_tokenizer, capsys):
    path = tmp_path / "model.gguf"
    write_gguf(path, build_reference("llama", LLAMA), backend_tokenizer, "llama", "gpt-2")
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "model"
    assert main(["import-gguf", str(path), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: --out {out}: cannot write the folder (") and error.count("\n") == 1


def test_large_models_are_written_in_shards_that_load(tmp_path, backend_tokenizer, monkeypatch):
    from layerwatch.inference_shim.offline import gguf_import

    path = tmp_path / "model.gguf"
    write_gguf(path, build_reference("qwen2", dict(LLAMA, num_key_value_heads=1)), backend_tokenizer, "qwen2", "qwen2")
    import_gguf(path, tmp_path / "whole")
    monkeypatch.setattr(gguf_import, "SHARD_BYTES", 20_000)  # a 32 x 300 float32 embedding is 38,400 bytes
    import_gguf(path, tmp_path / "sharded")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    whole, sharded = load_checkpoint(tmp_path / "whole").model, load_checkpoint(tmp_path / "sharded").model
    for (name, expected), (_, got) in zip(whole.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(expected, got), name
