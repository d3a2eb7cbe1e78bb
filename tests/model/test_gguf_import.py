"""`layerwatch import-gguf` on a real model against a reference nobody here wrote: transformers' own
loading of the same GGUF file (`from_pretrained(..., gguf_file=...)`), SmolLM2-135M-Instruct (Q4_1).

The import is shared with the service tests (tests/conftest.py, `real_model`); transformers' model
is loaded once for this module. And the refusals: not a GGUF, a truncated one, an architecture or
a tokenizer the importer does not convert, an --out that holds files.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from layerwatch.cli.main import main
from layerwatch.inference_shim.offline.gguf_import import GGUFImportError, import_gguf
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.model import KVCache

transformers = pytest.importorskip("transformers")

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY_CHAT = [{"role": "user", "content": "Describe Paris in two sentences."}]
GREEDY_STEPS = 24
# fp32's unit roundoff: the relative error of one rounding.
FP32_ROUNDOFF = 2.0**-24


@pytest.fixture(scope="module")
def reference(real_model):
    gguf = real_model.gguf
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def ours(real_model):
    return load_checkpoint(real_model.folder)


def logit_tolerance(logits: torch.Tensor, num_layers: int) -> float:
    """How far two fp32 evaluations of the same weights may land apart: the model adds 2 rounded
    updates per layer to its residual stream (attention, MLP), then normalizes once and multiplies
    by the LM head; each of those 2L + 2 steps may round differently in the two programs (another
    summation order, another kernel), by at most one roundoff of the value's size, and the logit
    carries them at most on its own scale. Twice that: either side may be the one off. For SmolLM2
    (30 layers, logits up to ~27) about 2e-4; what the issue asks for (1e-4) is checked on top."""
    return 2 * (2 * num_layers + 2) * FP32_ROUNDOFF * logits.abs().max().item()


def test_weights_are_transformers_own_bit_for_bit(reference, ours, real_model):
    """The import's part of parity is exact: the same dequantization, Q/K order and names."""
    from safetensors.torch import load_file

    expected = reference[0].state_dict()
    written = load_file(real_model.folder / "model.safetensors")
    assert written.keys() <= expected.keys() and len(written) == 272
    different = [name for name, tensor in written.items() if not torch.equal(tensor, expected[name])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def test_logits_match_transformers(reference, ours):
    model, tokenizer = reference
    ids = tokenizer(PROMPT).input_ids
    assert ours.tokenizer.encode(PROMPT) == ids
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = model(tokens).logits
        logits, _ = ours.model(tokens)
    difference = (logits - expected).abs().max().item()
    assert difference <= min(1e-4, logit_tolerance(expected, ours.config.num_layers))


def test_chat_prompt_has_transformers_token_ids(reference, ours):
    _, tokenizer = reference
    expected = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    text = ours.tokenizer.apply_chat_template(CHAT)
    assert text == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert ours.tokenizer.encode_chat_prompt(text) == expected["input_ids"]
    assert ours.tokenizer.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_greedy_tokens_match_transformers(reference, ours):
    """Through our KV cache, token by token as serve decodes, to the end of the answer."""
    model, _ = reference
    prompt = ours.tokenizer.encode_chat_prompt(ours.tokenizer.apply_chat_template(GREEDY_CHAT))
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_STEPS, do_sample=False)
    expected = expected[0, len(prompt) :].tolist()
    cache = KVCache(ours.config, slots=1, max_len=len(prompt) + GREEDY_STEPS, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        logits, _ = ours.model.prefill(torch.tensor(prompt), cache, slot=0)
        got = [int(logits.argmax())]
        while got[-1] not in ours.tokenizer.eos_token_ids and len(got) < GREEDY_STEPS:
            position = len(prompt) + len(got) - 1
            logits, _ = ours.model.decode_step(
                torch.tensor(got[-1:]), cache, slots=[0], positions=[position], run_mask=None
            )
            got.append(int(logits[0].argmax()))
    assert got == expected
    assert len(got) >= 16 and "Paris" in ours.tokenizer.decode(got)


def test_digits_are_split_as_the_models_own_tokenizer_splits_them(ours):
    """`tokenizer.ggml.pre` says "smollm": every digit is its own piece before GPT-2's regex, as in
    llama.cpp (the vocabulary holds no token of two digits). transformers' GGUF loading ignores that
    name, and so spaces before a digit come out one token each there ("a", "Ġ", "Ġ", "1")."""
    ids = ours.tokenizer.encode("a  1 22")
    assert [ours.tokenizer.backend.id_to_token(i) for i in ids] == ["a", "ĠĠ", "1", "Ġ", "2", "2"]


# --- refusals -----------------------------------------------------------------------------------


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path, capsys):
    bogus = tmp_path / "model.gguf"
    bogus.write_text("not a gguf file\n")
    assert main(["import-gguf", str(bogus), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert (
        error.startswith(f"error: {bogus}: not a readable GGUF file, truncated or malformed") and error.count("\n") == 1
    )
    assert not (tmp_path / "out").exists()


def test_a_truncated_file_is_refused_and_leaves_nothing(real_model, tmp_path, capsys):
    truncated = tmp_path / "truncated.gguf"
    with real_model.gguf.open("rb") as source:
        truncated.write_bytes(source.read(65_536))  # cut inside the vocabulary
    assert main(["import-gguf", str(truncated), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {truncated}: ") and error.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["truncated.gguf"]


def write_gguf(path, architecture: str, tokenizer_model: str = "gpt2") -> None:
    """A small GGUF with the metadata the importer reads first (no tensors needed to be refused)."""
    import gguf

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("architecture", "tokenizer_model", "named"),
    [
        ("gemma2", "gpt2", "architecture 'gemma2' is not supported (supported: llama, qwen2, qwen3)"),
        ("llama", "llama", "tokenizer 'llama' is not supported (supported: gpt2, byte-level BPE)"),
    ],
)
def test_what_is_not_converted_is_refused_by_name(tmp_path, architecture, tokenizer_model, named):
    path = tmp_path / "model.gguf"
    write_gguf(path, architecture, tokenizer_model)
    with pytest.raises(GGUFImportError) as refused:
        import_gguf(path, tmp_path / "out")
    assert str(refused.value) == f"{path}: {named}"
    assert not (tmp_path / "out").exists()


def test_an_out_folder_with_files_is_kept(real_model, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert main(["import-gguf", str(real_model.gguf), "--out", str(out)]) == 2
    assert "directory is not empty (--force replaces it)" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    # --force replaces it only with a complete folder: a refused import leaves it as it was.
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + bytes(100))
    assert main(["import-gguf", str(bogus), "--out", str(out), "--force"]) == 2
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    shutil.rmtree(out)
