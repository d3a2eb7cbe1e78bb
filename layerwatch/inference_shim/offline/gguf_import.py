"""A GGUF file (llama.cpp's format) as a checkpoint folder `serve`, `eval` and `train-gates` load.

The `gguf` library reads the file and dequantizes its tensors; what llama.cpp's converter changed on
the way in is undone here, as transformers' own GGUF loading undoes it:

- tensor names: llama.cpp's (`blk.0.attn_q.weight`) mapped back to Hugging Face's by gguf's own
  name map; a tied model has no `output.weight`;
- Llama's Q and K rows: the converter interleaves each head's two rotary halves (its RoPE rotates
  adjacent pairs, Hugging Face's the two halves); `_unpermute` puts them back;
- float32 metadata: `rms_norm_eps` is stored as float32 (9.99999975e-06); written as the shortest
  decimal that rounds to the same float32 (1e-05), as the original config had it;
- the tokenizer: only its vocabulary, merges, token types and special ids are stored; the
  pre-tokenizer is named (`tokenizer.ggml.pre`) and rebuilt from PRE_TOKENIZERS; the chat template
  is stored whole.

Anything this code cannot convert faithfully is refused with its name (an architecture, a tensor
type, a tokenizer, a RoPE scaling): a folder that loads but computes another model is worse than none.
So is a file that is not what it says (docs/reliability.md, "GGUF import"): metadata of
the wrong type, counts past the file's end, a vocabulary that names a token twice, a folder that
would not load; each is refused in one line naming the key or the tensor.
The folder is written beside `out` and renamed into place when complete; the folders missing above
`out` are made, and removed again when the import fails.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from layerwatch.inference_shim.runtime.checkpoint import (
    CONFIG_FILE,
    DTYPES,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    CheckpointError,
    config_from_hf,
    expected_shapes,
)
from layerwatch.inference_shim.runtime.model import ModelConfig, non_finite_problem
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer, TokenizerError

# GGUF architecture -> (Hugging Face architecture, model_type): the families whose tensors map one
# to one onto the model's (checkpoint.py's ARCHITECTURES). Mistral files say "llama".
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# The families whose Q and K rows llama.cpp's converter permutes (its RoPE rotates adjacent pairs).
PERMUTED_QK = ("llama",)

# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre`, splitting text as llama.cpp does for each
# name: SmolLM every digit apart, then GPT-2's regex; Llama 3 and Qwen2 by their own regex (digits
# in threes, one by one), the regexes transformers' GGUF loading uses for them too.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(split: str | None = None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    """GPT-2's byte-level pre-tokenizer, splitting by its own regex or by `split`, digits apart first."""
    parts: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        parts += [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    return pre_tokenizers.Sequence(parts)


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _byte_level,
    "smollm": lambda: _byte_level(digits=True),
    "llama-bpe": lambda: _byte_level(_LLAMA3_SPLIT),
    "qwen2": lambda: _byte_level(_QWEN2_SPLIT),
}
# llama.cpp's token types (gguf.TokenType): control tokens are special, user-defined ones are added.
CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4
# Weights are written in shards of at most this many bytes: the import holds one shard in memory.
SHARD_BYTES = 2 << 30
# The most elements a metadata array may hold: several times the largest vocabularies and merge lists
# (Gemma 3's about 262,000 tokens, Llama 3's about 280,000 merges). The gguf library builds a numpy
# array per element (two per string): 2,000,000 one-letter tokens, an 18 MB file, took it 98 s and 2.7 GB.
MAX_ARRAY_LENGTH = 1 << 20
# The largest count metadata may give (a dimension, a head or layer count, the context length): past
# every model's (Llama 3 405B's widest, its feed-forward, is 53,248; the longest contexts a few million
# tokens), and the most positions the model tells apart (runtime/model.py computes RoPE angles from
# float32 positions, exact integers up to 2^24). A context_length of 2^63 was imported as written; a
# width of 2^63 overflowed torch's int64 in the model built to check the shapes, a traceback.
MAX_COUNT = 1 << 24


class GGUFImportError(ValueError):
    """The file cannot be imported; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ImportSummary:
    source: Path
    out: Path
    architecture: str
    num_layers: int
    parameters: int
    tensor_types: dict[str, int]  # GGUF tensor type -> tensors of it
    dtype: str
    seconds: float

    def line(self) -> str:
        types = ", ".join(f"{name} {count}" for name, count in sorted(self.tensor_types.items()))
        return (
            f"imported {self.source.name} ({self.architecture}, {self.num_layers} layers, "
            f"{self.parameters / 1e6:.1f} M parameters; tensors {types}) as {self.dtype} into {self.out} "
            f"in {self.seconds:.1f} s"
        )


def import_gguf(source: str | Path, out: str | Path, dtype: str = "float32", force: bool = False) -> ImportSummary:
    """Write the checkpoint folder `out` from the GGUF file `source` (see the module doc).

    `out` must not exist or be an empty directory unless `force`; it is replaced only once the new
    folder is complete, so a failed import leaves it as it was."""
    started = time.perf_counter()
    # Resolved: `--out .` has no name to put the partial folder beside, and a link's target is replaced.
    source, out = Path(source), Path(out).resolve()
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    _check_destination(out, force, source)
    gguf_file = _GGUFFile(source)
    config, hf_config = gguf_file.model_config(DTYPES[dtype])
    tokenizer = gguf_file.tokenizer()
    if tokenizer.vocab_size > config.vocab_size:
        raise gguf_file.error(f"{tokenizer.vocab_size} tokens, but the embedding has {config.vocab_size} rows")

    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    # The folders missing above `out` are made (as `git clone` makes them), and removed if this run fails.
    missing = list(itertools.takewhile(lambda folder: not folder.exists(), out.parents))[::-1]
    made: list[Path] = []
    try:
        for folder in missing:
            folder.mkdir()
            made.append(folder)
        partial.mkdir()
        (partial / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        parameters = gguf_file.write_weights(config, DTYPES[dtype], partial)
        (partial / GENERATION_CONFIG_FILE).write_text(json.dumps(gguf_file.generation_config(), indent=2) + "\n")
        _save_tokenizer(tokenizer, partial)
        _read_back_tokenizer(partial, gguf_file)
        _move_into_place(partial, out)
    except (OSError, SafetensorError) as exc:  # no room, no permission, a file where a folder should be
        _remove_written(partial, made)
        raise GGUFImportError(f"--out {out}: cannot write the folder ({exc})") from None
    except BaseException:
        _remove_written(partial, made)
        raise
    return ImportSummary(
        source=source,
        out=out,
        architecture=gguf_file.architecture,
        num_layers=config.num_layers,
        parameters=parameters,
        tensor_types=dict(Counter(t.tensor_type.name for t in gguf_file.reader.tensors)),
        dtype=dtype,
        seconds=time.perf_counter() - started,
    )


def _remove_written(partial: Path, made: list[Path]) -> None:
    """What a failed run wrote: its partial folder, and the folders it made above `out` (outermost
    first in `made`) unless something else was put in one since."""
    shutil.rmtree(partial, ignore_errors=True)
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:  # not empty: the folder is no longer this run's alone
            return


def _check_destination(out: Path, force: bool, source: Path) -> None:
    if out.parent == out:
        raise GGUFImportError(f"--out {out}: the root directory cannot be the checkpoint folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise GGUFImportError(f"--out {out}: exists and is not a directory")
    if any(out.iterdir()) and not force:
        raise GGUFImportError(f"--out {out}: directory is not empty (--force replaces it)")
    if source.resolve().is_relative_to(out):
        raise GGUFImportError(f"--out {out}: holds {source}, the file imported (--force would delete it)")


def _read_back_tokenizer(folder: Path, gguf_file: _GGUFFile) -> None:
    """Read the written tokenizer as `serve` reads it (its chat templates compiled): a template that is
    not text or not Jinja is refused here, not by the first command that loads the folder."""
    try:
        Tokenizer.from_files(folder / TOKENIZER_FILE, folder / TOKENIZER_CONFIG_FILE)
    except TokenizerError as exc:
        message = str(exc).removeprefix(f"{folder / TOKENIZER_CONFIG_FILE}: ")
        raise gguf_file.error(f"tokenizer: {message}") from None


def _save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    try:
        tokenizer.save(folder)
    except OSError:
        raise
    except Exception as exc:  # tokenizers raises a bare Exception when it cannot write (no room)
        raise OSError(str(exc)) from None


def _move_into_place(partial: Path, out: Path) -> None:
    """`partial` becomes `out`; an existing `out` (checked by _check_destination) goes only after."""
    if not out.exists():
        partial.rename(out)
        return
    if not any(out.iterdir()):
        # An empty folder is filled, not replaced, so that a shell standing in it (`--out .`) sees
        # the files; config.json, which makes it a checkpoint folder, comes last.
        for path in sorted(partial.iterdir(), key=lambda path: path.name == CONFIG_FILE):
            path.rename(out / path.name)
        partial.rmdir()
        return
    previous = out.with_name(f".{out.name}.previous-{os.getpid()}")
    out.rename(previous)
    partial.rename(out)
    shutil.rmtree(previous)


class _GGUFFile:
    """One GGUF file's metadata and tensors, read through the `gguf` library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise self.error("file not found")
        try:
            with np.errstate(over="raise"):  # an offset or a shape of the file's that overflows uint64
                self.reader = _CheckedReader(path)
        except (ValueError, OSError, IndexError, TypeError, KeyError, FloatingPointError) as exc:  # malformed
            raise self.error(
                f"not a readable GGUF file, truncated or malformed ({type(exc).__name__}: {exc})"
            ) from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        if self.get("split.count", 1, INTEGER) > 1:
            raise self.error(
                f"one part of a split GGUF (split.count={self.get('split.count')}): merge the parts first "
                "(llama.cpp's llama-gguf-split --merge)"
            )
        self.architecture = self.get("general.architecture", kind=TEXT)
        if self.architecture not in GGUF_ARCHITECTURES:
            raise self.error(
                f"architecture {self.architecture!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
            )

    def error(self, message: str) -> GGUFImportError:
        return GGUFImportError(f"{self.path}: {message}")

    _REQUIRED = object()

    def get(self, key: str, default: Any = _REQUIRED, kind: MetadataKind | None = None) -> Any:
        """The value of metadata `key`, refused unless of `kind` (when given)."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is self._REQUIRED:
                raise self.error(f"metadata {key!r} is missing")
            return default
        try:
            value = field.contents()
        except UnicodeDecodeError:
            raise self.error(f"metadata {key!r} is not UTF-8 text") from None
        if kind is not None and not kind.holds(value):
            shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)
            raise self.error(f"metadata {key!r} must be {kind.name}, found {shown}")
        return value

    def _count(self, key: str, default: Any = _REQUIRED) -> int:
        value = self.get(key, default, INTEGER)
        if value <= 0:
            raise self.error(f"metadata {key!r} must be a positive integer, found {value}")
        if value > MAX_COUNT:
            raise self.error(f"metadata {key!r} must be at most {MAX_COUNT:,}, found {value:,}")
        return value

    def _float(self, key: str, default: float) -> float:
        value = self.get(key, default, NUMBER)
        if not (math.isfinite(value) and value > 0):
            raise self.error(f"metadata {key!r} must be a positive finite number, found {value}")
        # The shortest decimal that is the same float32: 1e-05, not 9.999999747378752e-06.
        return float(str(np.float32(value)))

    # --- config -------------------------------------------------------------------------------------

    def model_config(self, dtype: torch.dtype) -> tuple[ModelConfig, dict]:
        """The model's ModelConfig and the config.json that describes it."""
        arch = self.architecture
        hf_architecture, model_type = GGUF_ARCHITECTURES[arch]
        if any(isinstance(self.get(f"{arch}.attention.{key}", 0), list) for key in ("head_count", "head_count_kv")):
            raise self.error("per-layer head counts are not supported (one head count for every layer)")
        heads = self._count(f"{arch}.attention.head_count")
        kv_heads = self._count(f"{arch}.attention.head_count_kv", heads)
        hidden = self._count(f"{arch}.embedding_length")
        head_dim = self._count(f"{arch}.attention.key_length", hidden // heads)
        value_dim = self._count(f"{arch}.attention.value_length", head_dim)
        if value_dim != head_dim:  # the v tensors were read as key_length wide: a file of another kind
            raise self.error(f"value heads of {value_dim} dimensions and key heads of {head_dim} are not supported")
        rotary = self._count(f"{arch}.rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise self.error(f"RoPE on {rotary} of {head_dim} head dimensions is not supported (the whole head only)")
        if "rope_freqs.weight" in self.tensors:
            raise self.error("per-frequency RoPE factors (tensor rope_freqs.weight, Llama 3.1 style) are not supported")
        embedding = self.tensors.get("token_embd.weight")
        if embedding is None:
            raise self.error("no token_embd.weight tensor")
        eos_ids = self.eos_token_ids()
        raw = {
            "architectures": [hf_architecture],
            "model_type": model_type,
            "vocab_size": int(embedding.shape[-1]),  # GGUF lists dimensions innermost first
            "hidden_size": hidden,
            "intermediate_size": self._count(f"{arch}.feed_forward_length"),
            "num_hidden_layers": self._count(f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self._float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._float(f"{arch}.rope.freq_base", 10000.0),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": self._count(f"{arch}.context_length"),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": arch == "qwen2",
            "mlp_bias": False,
            "bos_token_id": self._token_id("bos_token_id"),
            "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "use_cache": True,
        }
        if arch == "qwen2":
            del raw["attention_bias"]  # Qwen2 always has q/k/v biases; its config has no such field
        try:
            return config_from_hf(raw, self.path), raw
        except CheckpointError as exc:
            raise GGUFImportError(str(exc)) from None

    def _rope_scaling(self) -> dict | None:
        kind = self.get(f"{self.architecture}.rope.scaling.type", "none", TEXT)
        if kind == "none":
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": self._float(f"{self.architecture}.rope.scaling.factor", 1.0)}
        raise self.error(f"RoPE scaling {kind!r} is not supported (supported: none, linear)")

    def eos_token_ids(self) -> list[int]:
        """End of sequence, then end of turn and end of message where the file names them (an
        instruct model ends its answers with those)."""
        ids = (self._token_id(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id"))
        return list(dict.fromkeys(i for i in ids if i is not None))

    def _token_id(self, key: str) -> int | None:
        """`tokenizer.ggml.KEY`, a token of the vocabulary (None: not given)."""
        token_id = self.get(f"tokenizer.ggml.{key}", None, INTEGER)
        if token_id is not None and not 0 <= token_id < len(self.tokens):
            raise self.error(f"tokenizer.ggml.{key}={token_id} is outside the vocabulary of {len(self.tokens)}")
        return token_id

    @functools.cached_property
    def tokens(self) -> list[str]:
        """The vocabulary, each token once (a token listed twice would leave one of its ids unreachable)."""
        tokens = self.get("tokenizer.ggml.tokens", kind=TEXTS)
        first_ids: dict[str, int] = {}
        for index, token in enumerate(tokens):
            first = first_ids.setdefault(token, index)
            if first != index:
                raise self.error(f"token {token!r} is in the vocabulary twice (ids {first} and {index})")
        return tokens

    def generation_config(self) -> dict:
        eos_ids = self.eos_token_ids()
        settings = {
            "bos_token_id": self._token_id("bos_token_id"),
            "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
            "pad_token_id": self._token_id("padding_token_id"),
        }
        return {name: value for name, value in settings.items() if value is not None and value != []}

    # --- weights ------------------------------------------------------------------------------------

    def write_weights(self, config: ModelConfig, dtype: torch.dtype, folder: Path) -> int:
        """Dequantize every tensor the model needs into `folder` (shards of SHARD_BYTES at most);
        the number of parameters."""
        # Checked before the model's tensors are listed and gguf maps names for that many blocks: a
        # block_count of 10^7 ran for minutes, 14 GB and growing.
        blocks = {name.split(".")[1] for name in self.tensors if name.startswith("blk.")}
        if len(blocks) != config.num_layers or blocks != {str(block) for block in range(config.num_layers)}:
            raise self.error(f"block_count={config.num_layers}, but the tensors are of {len(blocks)} blocks")
        arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == self.architecture)
        name_map = gguf.get_tensor_name_map(arch_id, config.num_layers)
        expected = expected_shapes(config)
        gguf_names = {}
        for hf_name in expected:
            base, suffix = hf_name.rsplit(".", 1)
            gguf_base = name_map.get_name(base)
            if gguf_base is None:
                raise self.error(f"no GGUF name for the model's tensor {hf_name!r}")
            gguf_names[f"{gguf_base}.{suffix}"] = hf_name
        unexpected = sorted(set(self.tensors) - set(gguf_names))
        if unexpected:
            raise self.error(
                f"tensors {unexpected[:3]} are not part of a {self.architecture} model as config describes"
            )
        missing = sorted(set(gguf_names) - set(self.tensors))
        if missing:
            raise self.error(f"{len(missing)} tensors missing, e.g. {missing[:3]}")

        shards: list[dict[str, torch.Tensor]] = [{}]
        shard_bytes = 0
        parameters = 0
        for gguf_name, hf_name in gguf_names.items():
            weight = self._tensor(gguf_name, config, dtype)
            if tuple(weight.shape) != expected[hf_name]:
                raise self.error(
                    f"tensor {gguf_name} has shape {list(weight.shape)}, expected {list(expected[hf_name])}"
                )
            size = weight.numel() * weight.element_size()
            if shards[-1] and shard_bytes + size > SHARD_BYTES:
                self._write_shard(folder, len(shards), shards[-1])
                shards.append({})
                shard_bytes = 0
            shards[-1][hf_name] = weight
            shard_bytes += size
            parameters += weight.numel()
        if len(shards) == 1:
            _save_weights(shards[0], folder / WEIGHTS_FILE)
            return parameters
        self._write_shard(folder, len(shards), shards[-1])
        weight_map = {}
        for number in range(1, len(shards) + 1):
            final = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            (folder / f"shard-{number}.safetensors").rename(folder / final)
            weight_map.update(dict.fromkeys(shards[number - 1], final))
        (folder / WEIGHTS_INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}, indent=2) + "\n")
        return parameters

    @staticmethod
    def _write_shard(folder: Path, number: int, tensors: dict[str, torch.Tensor]) -> None:
        _save_weights(tensors, folder / f"shard-{number}.safetensors")
        for name in tensors:  # the index needs only the names; the memory goes back
            tensors[name] = torch.empty(0)

    def _tensor(self, name: str, config: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
        tensor = self.tensors[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise self.error(
                f"tensor {name} is of type {tensor.tensor_type.name}, which the gguf library cannot dequantize"
            ) from None
        # An F32 tensor comes as a read-only view of the file (copied here); a dequantized one is new.
        weight = torch.from_numpy(np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
        if self.architecture in PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight")):
            weight = _unpermute(weight, config.num_heads if "attn_q" in name else config.num_kv_heads)
        weight = weight.to(dtype)
        problem = non_finite_problem(name, weight, converted_to=dtype)
        if problem is not None:
            raise self.error(problem)
        return weight

    # --- tokenizer ----------------------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the file describes: byte-level BPE (`tokenizer.ggml.model` gpt2)."""
        kind = self.get("tokenizer.ggml.model", kind=TEXT)
        if kind != "gpt2":
            raise self.error(f"tokenizer {kind!r} is not supported (supported: gpt2, byte-level BPE)")
        pre = self.get("tokenizer.ggml.pre", None)
        if pre not in PRE_TOKENIZERS:
            raise self.error(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
        if self.get("tokenizer.ggml.add_eos_token", False, BOOLEAN):
            raise self.error("tokenizer.ggml.add_eos_token=true is not supported")
        tokens = self.tokens
        types = self.get("tokenizer.ggml.token_type", [], INTEGERS)
        merges = [tuple(merge.split(" ", 1)) for merge in self.get("tokenizer.ggml.merges", kind=TEXTS)]
        if unpaired := next((" ".join(merge) for merge in merges if len(merge) != 2), None):
            raise self.error(f"merge {unpaired!r} is not two tokens separated by a space")
        try:
            bpe = models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges, fuse_unk=False)
        except Exception as exc:  # tokenizers raises a bare Exception (a merge of tokens outside the vocabulary)
            raise self.error(f"tokenizer: {exc}") from None
        backend = BackendTokenizer(bpe)
        backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()
        control = [t for t, kind in zip(tokens, types, strict=False) if kind == CONTROL_TOKEN]
        user_defined = [t for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED_TOKEN]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])

        def token(key: str) -> str | None:
            token_id = self._token_id(key)
            return None if token_id is None else tokens[token_id]

        bos, unk, pad = token("bos_token_id"), token("unknown_token_id"), token("padding_token_id")
        try:
            return Tokenizer(
                backend,
                bos_token=bos,
                eos_tokens=[tokens[i] for i in self.eos_token_ids()],
                chat_template=self._chat_templates(),
                special_tokens={name: t for name, t in (("unk_token", unk), ("pad_token", pad)) if t is not None},
                add_bos_token=self.get("tokenizer.ggml.add_bos_token", False, BOOLEAN) and bos is not None,
            )
        except TokenizerError as exc:
            raise self.error(f"tokenizer: {exc}") from None

    def _chat_templates(self) -> dict[str, str] | None:
        # llama.cpp writes the default template as tokenizer.chat_template, named ones as tokenizer.chat_template.NAME.
        prefix = "tokenizer.chat_template"
        templates = {
            "default" if key == prefix else key.removeprefix(prefix + "."): self.get(key, kind=TEXT)
            for key in self.reader.fields
            if key == prefix or key.startswith(prefix + ".")
        }
        return templates or None


def _save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors writes through a temporary file of mode 0600: given the mode the umask gives the
    folder's other files (config.json, written first), so that a server running as another user (the
    shim's container, uid 10001, reading a mounted folder) can read the weights as it reads the config."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    shutil.copymode(path.parent / CONFIG_FILE, path)


@dataclass(frozen=True)
class MetadataKind:
    name: str
    holds: Callable[[Any], bool]


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


INTEGER = MetadataKind("an integer", _is_integer)
NUMBER = MetadataKind("a number", lambda v: _is_integer(v) or isinstance(v, float))
BOOLEAN = MetadataKind("true or false", lambda v: isinstance(v, bool))
TEXT = MetadataKind("text", lambda v: isinstance(v, str))
TEXTS = MetadataKind("a list of text", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
INTEGERS = MetadataKind("a list of integers", lambda v: isinstance(v, list) and all(map(_is_integer, v)))


class _CheckedReader(gguf.GGUFReader):
    """gguf's reader held to the file's bounds. Its reads past the end come back short, and an array
    whose elements lie there was read for ever (a 100-byte file declaring 2^40 one-byte elements grew
    without end): a short read is refused, and so is an array longer than MAX_ARRAY_LENGTH."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        values = super()._get(offset, dtype, count, override_order)
        if len(values) < int(count):
            raise ValueError(f"{int(count)} values at byte {offset} run past the end of the file")
        return values

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
        if raw_type == gguf.GGUFValueType.ARRAY:
            length = int(self._get(orig_offs + 4, np.uint64)[0])  # after the element type, a uint32
            if length > MAX_ARRAY_LENGTH:
                raise ValueError(f"an array of {length:,} elements at byte {orig_offs} (at most {MAX_ARRAY_LENGTH:,})")
        return super()._get_field_parts(orig_offs, raw_type)


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: within each head it interleaved the two rotary halves
    (rows 0, d/2, 1, d/2+1, ...); transformers' GGUF loading undoes it the same way."""
    rows, columns = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)
