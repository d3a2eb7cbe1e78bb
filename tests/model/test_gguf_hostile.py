"""`import-gguf` given files that are not what they say, and destinations that fight back
(docs/reliability.md, "GGUF import"): each refused in one line naming what is wrong,
nothing written, nothing of the user's lost; and what it writes is readable by whoever serves it.

The files are tiny (a one-layer Llama of width 8 over a byte-level vocabulary, written with the gguf
library as llama.cpp's converter writes one), so every case costs milliseconds; the signal test
imports the real model, the one import here long enough to be interrupted.
"""

from __future__ import annotations

import os
import resource
import signal
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as Kind
from tokenizers import pre_tokenizers

from layerwatch.cli.main import main
from layerwatch.inference_shim.offline import gguf_import
from layerwatch.inference_shim.offline.gguf_import import GGUFImportError, import_gguf
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from tests.conftest import real_model_gguf

TOKENS = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "ab", "<s>", "</s>"]
CONTROL, NORMAL = 3, 1  # llama.cpp's token types
HIDDEN, FFN = 8, 16


def metadata(tokens: list[str] = TOKENS) -> dict[str, tuple]:
    """A one-layer Llama's metadata: key -> (value, GGUF type[, element type])."""
    return {
        "llama.block_count": (1, Kind.UINT32),
        "llama.context_length": (64, Kind.UINT32),
        "llama.embedding_length": (HIDDEN, Kind.UINT32),
        "llama.feed_forward_length": (FFN, Kind.UINT32),
        "llama.attention.head_count": (2, Kind.UINT32),
        "llama.attention.head_count_kv": (2, Kind.UINT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, Kind.FLOAT32),
        "llama.rope.freq_base": (10000.0, Kind.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", Kind.STRING),
        "tokenizer.ggml.pre": ("gpt-2", Kind.STRING),
        "tokenizer.ggml.tokens": (tokens, Kind.ARRAY, Kind.STRING),
        "tokenizer.ggml.token_type": (
            [CONTROL if t in ("<s>", "</s>") else NORMAL for t in tokens],
            Kind.ARRAY,
            Kind.INT32,
        ),
        "tokenizer.ggml.merges": (["a b"], Kind.ARRAY, Kind.STRING),
        "tokenizer.ggml.bos_token_id": (len(tokens) - 2, Kind.UINT32),
        "tokenizer.ggml.eos_token_id": (len(tokens) - 1, Kind.UINT32),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}", Kind.STRING),
    }


def write_tiny_gguf(
    path: Path, changes: dict | None = None, tokens: list[str] = TOKENS, shapes: dict | None = None
) -> Path:
    """A tied one-layer Llama (random weights) with `changes` to its metadata (None: the key left out)
    and `shapes` to its tensors' shapes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (metadata(tokens) | (changes or {})).items():
        if value is not None:
            writer.add_key_value(key, value[0], value[1], sub_type=value[2] if len(value) > 2 else None)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (len(tokens), HIDDEN),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_v.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
        "output_norm.weight": (HIDDEN,),
    } | (shapes or {})
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def raw_gguf(path: Path, fields: bytes, count: int, tensor_infos: bytes = b"", tensors: int = 0) -> Path:
    """A GGUF v3 written byte by byte: `count` metadata fields (general.architecture first), then
    `tensors` tensor infos; what the gguf library would not write."""

    def text(value: bytes) -> bytes:
        return struct.pack("<Q", len(value)) + value

    architecture = text(b"general.architecture") + struct.pack("<I", Kind.STRING) + text(b"llama")
    body = b"GGUF" + struct.pack("<IQQ", 3, tensors, count + 1) + architecture + fields + tensor_infos
    path.write_bytes(body + bytes(-len(body) % 32 + 64))
    return path


def refusal(path: Path, out: Path) -> str:
    with pytest.raises(GGUFImportError) as refused:
        import_gguf(path, out)
    assert not out.exists()
    return str(refused.value).removeprefix(f"{path}: ")


def test_a_tiny_file_imports_and_its_weights_are_as_readable_as_its_config(tmp_path):
    """safetensors wrote the weights 0600: a shim running as another user (the container's uid 10001,
    the folder mounted) read config.json and failed on model.safetensors."""
    umask = os.umask(0o022)
    try:
        import_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "out")
    finally:
        os.umask(umask)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes
    loaded = load_checkpoint(tmp_path / "out")
    assert loaded.config.num_layers == 1 and loaded.tokenizer.encode("ab") == [TOKENS.index("ab")]


NOT_JINJA = "{% for %}"


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"llama.attention.head_count": (0, Kind.UINT32)}, "'llama.attention.head_count' must be a positive integer"),
        ({"llama.embedding_length": ("8", Kind.STRING)}, "'llama.embedding_length' must be an integer, found '8'"),
        ({"split.count": ("2", Kind.STRING)}, "'split.count' must be an integer, found '2'"),
        (
            {"llama.attention.layer_norm_rms_epsilon": (float("nan"), Kind.FLOAT32)},
            "'llama.attention.layer_norm_rms_epsilon' must be a positive finite number, found nan",
        ),
        ({"llama.rope.freq_base": (-1.0, Kind.FLOAT32)}, "'llama.rope.freq_base' must be a positive finite number"),
        ({"llama.block_count": (2_000, Kind.UINT32)}, "block_count=2000, but the tensors are of 1 blocks"),
        (
            {"llama.context_length": (2**63, Kind.UINT64)},
            "'llama.context_length' must be at most 16,777,216, found 9,223,372,036,854,775,808",
        ),
        ({"llama.embedding_length": (2**63, Kind.UINT64)}, "'llama.embedding_length' must be at most 16,777,216"),
        ({"tokenizer.ggml.eos_token_id": (-1, Kind.INT32)}, "tokenizer.ggml.eos_token_id=-1 is outside the vocabulary"),
        ({"tokenizer.ggml.add_bos_token": ("yes", Kind.STRING)}, "'tokenizer.ggml.add_bos_token' must be true or"),
        ({"tokenizer.ggml.tokens": (list(range(259)), Kind.ARRAY, Kind.INT32)}, "must be a list of text"),
        ({"tokenizer.ggml.merges": (["ab"], Kind.ARRAY, Kind.STRING)}, "merge 'ab' is not two tokens separated"),
        ({"tokenizer.ggml.merges": (["a zz"], Kind.ARRAY, Kind.STRING)}, "tokenizer: Error while initializing BPE"),
        ({"tokenizer.chat_template": (5, Kind.UINT32)}, "'tokenizer.chat_template' must be text, found 5"),
        ({"tokenizer.chat_template": (NOT_JINJA, Kind.STRING)}, "tokenizer: chat template 'default' is not valid"),
        # Jinja folds the constant while it compiles: 1.5 GB in the importing process (4e9: 12 GB, killed).
        (
            {"tokenizer.chat_template": ("{{ 'x' * 1500000000 }}", Kind.STRING)},
            "chat template 'default' needed more than 1024 MiB to render one user message",
        ),
    ],
    ids=lambda case: next(iter(case)) if isinstance(case, dict) else None,
)
def test_metadata_that_is_not_what_it_says_is_refused_naming_it(tmp_path, changes, named):
    """Before: tracebacks (ZeroDivisionError, TypeError, tokenizers' bare Exception; torch's int64
    overflow for a width of 2^63), hangs (a block count of 10^7 built gguf's name map for that many),
    or a folder that computed NaN (eps NaN), took the last token for EOS (id -1), did not load (a
    template that is not text or not Jinja) or claimed a context of 2^63 tokens; a template whose
    constants are gigabytes was compiled in the importing process."""
    assert named in refusal(write_tiny_gguf(tmp_path / "model.gguf", changes), tmp_path / "out")


# Two heads of 3 dimensions (key_length 3): q, k and v 6 rows, the output 6 columns.
ODD_HEADS = {f"blk.0.attn_{name}.weight": (6, HIDDEN) for name in "qkv"} | {"blk.0.attn_output.weight": (HIDDEN, 6)}


@pytest.mark.parametrize(
    ("changes", "shapes", "named"),
    [
        (
            {"llama.attention.key_length": (3, Kind.UINT32), "llama.rope.dimension_count": (3, Kind.UINT32)},
            ODD_HEADS,
            "head_dim=3 is odd: rotary embeddings need an even head dimension",
        ),
        ({"llama.attention.value_length": (2, Kind.UINT32)}, {}, "value heads of 2 dimensions and key heads of 4"),
    ],
    ids=["odd head dimension", "value_length other than key_length"],
)
def test_heads_the_model_cannot_compute_are_refused_though_the_shapes_agree(tmp_path, changes, shapes, named):
    """Unguarded, heads of 3 dimensions are a RuntimeError traceback (the Q/K
    unpermutation reshapes by pairs); value heads narrower than the key heads are imported as key-wide,
    the metadata contradicting the folder."""
    assert named in refusal(write_tiny_gguf(tmp_path / "model.gguf", changes, shapes=shapes), tmp_path / "out")


def test_a_token_listed_twice_is_refused(tmp_path):
    """Before: imported with one of the two ids unreachable (the vocabulary a token shorter)."""
    tokens = [*TOKENS[:-3], "ab", "ab", "</s>"]
    path = write_tiny_gguf(tmp_path / "model.gguf", {"tokenizer.ggml.bos_token_id": None}, tokens=tokens)
    assert refusal(path, tmp_path / "out") == "token 'ab' is in the vocabulary twice (ids 256 and 257)"


def test_text_that_is_not_utf8_is_refused_naming_its_key(tmp_path):
    path = write_tiny_gguf(tmp_path / "model.gguf", {"tokenizer.chat_template": ("@@@@", Kind.STRING)})
    path.write_bytes(path.read_bytes().replace(b"@@@@", b"\xff\xfe\xff\xfe"))
    assert refusal(path, tmp_path / "out") == "metadata 'tokenizer.chat_template' is not UTF-8 text"


def test_an_array_that_runs_past_the_end_of_the_file_is_refused(tmp_path):
    """gguf's reader reads an array element by element and a read past the end comes back empty:
    2^40 declared bytes were read for ever (memory growing); here 10^5, read to the end before."""
    field = struct.pack("<Q", 3) + b"x.y" + struct.pack("<IIQ", Kind.ARRAY, Kind.UINT8, 100_000)
    path = raw_gguf(tmp_path / "model.gguf", field, 1)
    assert "run past the end of the file" in refusal(path, tmp_path / "out")


def test_an_array_longer_than_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """At the real limit (2^20) the case is a megabyte; the limit is lowered to keep it small."""
    monkeypatch.setattr(gguf_import, "MAX_ARRAY_LENGTH", 1_000)
    path = write_tiny_gguf(tmp_path / "model.gguf", {"x.y": ([0] * 1_001, Kind.ARRAY, Kind.UINT8)})
    assert "an array of 1,001 elements" in refusal(path, tmp_path / "out")


def test_a_tensor_offset_that_overflows_is_refused_without_a_warning(tmp_path):
    """The reader added start and offset as uint64, which wrapped with a RuntimeWarning on stderr."""
    name = b"token_embd.weight"
    info = struct.pack("<Q", len(name)) + name + struct.pack("<IQQIQ", 2, 8, 2, 0, 2**64 - 32)
    path = raw_gguf(tmp_path / "model.gguf", b"", 0, info, tensors=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert "overflow" in refusal(path, tmp_path / "out")
    assert not caught, [str(warning.message) for warning in caught]


# --- destinations ---------------------------------------------------------------------------------


def test_out_dot_fills_the_empty_folder_the_shell_stands_in(tmp_path, monkeypatch):
    """Before: `ValueError: PosixPath('.') has an empty name`, a traceback."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    import_gguf(write_tiny_gguf(tmp_path / "model.gguf"), ".")
    assert sorted(path.name for path in here.iterdir())[:2] == ["config.json", "generation_config.json"]
    assert sorted(path.name for path in Path.cwd().iterdir()) == sorted(path.name for path in here.iterdir())


def test_force_never_deletes_the_file_it_imports(tmp_path):
    """Before: `import-gguf models/x.gguf --out models --force` replaced models/, the GGUF with it."""
    folder = tmp_path / "models"
    folder.mkdir()
    path = write_tiny_gguf(folder / "model.gguf")
    with pytest.raises(GGUFImportError, match=r"holds .*model\.gguf, the file imported \(--force would delete it\)"):
        import_gguf(path, folder, force=True)
    assert [p.name for p in folder.iterdir()] == ["model.gguf"]


def test_force_through_a_link_replaces_its_target_and_keeps_the_link(tmp_path):
    """Before: the link was renamed aside, rmtree refused it, and a finished import was reported as
    `cannot write the folder (Cannot call rmtree on a symbolic link)`, the link left beside it."""
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    (target / "old.txt").write_text("old\n")
    link.symlink_to(target)
    import_gguf(write_tiny_gguf(tmp_path / "model.gguf"), link, force=True)
    assert link.is_symlink() and (link / "config.json").is_file() and not (target / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "model.gguf", "target"]


def test_a_failed_import_removes_the_folders_it_made_above_out(tmp_path):
    """Before: `--out models/new/tiny` made models/ and models/new/ and left them when the import failed."""
    out = tmp_path / "models" / "new" / "tiny"
    path = write_tiny_gguf(tmp_path / "model.gguf", {"tokenizer.chat_template": (NOT_JINJA, Kind.STRING)})
    assert "chat template 'default' is not valid" in refusal(path, out)
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
    import_gguf(write_tiny_gguf(tmp_path / "good.gguf"), out)  # made as `git clone` makes them
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("what", ["weights", "tokenizer"])
def test_a_full_disk_is_refused_in_one_line_and_leaves_nothing(tmp_path, capsys, what):
    """A file-size limit stands in for a full disk (EFBIG as ENOSPC: the write fails part way).
    Before: safetensors' SafetensorError and tokenizers' bare Exception, tracebacks."""
    # For the tokenizer case, a vocabulary whose tokenizer.json outgrows the bfloat16 weights.
    tokens = [*TOKENS, *(f"a-long-token-name-{n:05d}" for n in range(2_000))] if what == "tokenizer" else TOKENS
    path = write_tiny_gguf(tmp_path / "model.gguf", tokens=tokens)
    limit = {"weights": 4_096, "tokenizer": 48_000}[what]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        status = main(["import-gguf", str(path), "--out", str(tmp_path / "out"), "--dtype", "bfloat16"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    error = capsys.readouterr().err
    assert status == 2 and error.startswith(f"error: --out {tmp_path / 'out'}: cannot write the folder (")
    assert error.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_sigterm_mid_import_leaves_no_partial_folder(tmp_path):
    """Before: the process died at once and its partial folder (up to the model's size) stayed."""
    out = tmp_path / "models" / "smollm2"
    command = [sys.executable, "-m", "layerwatch.cli.main", "import-gguf", str(real_model_gguf()), "--out", str(out)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(out.parent.glob(".smollm2.partial-*")):  # the weights are being written
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        process.kill()
    assert "SIGTERM received: stopping" in process.stderr.read()
    assert list(tmp_path.iterdir()) == []  # models/, which the import made, removed with its partial folder
