"""Load and save a local Hugging Face checkpoint folder.

A folder holds `config.json`, the weights as `model.safetensors` or as shards listed in
`model.safetensors.index.json`, `tokenizer.json` and optionally `tokenizer_config.json` and
`generation_config.json`. The families in ARCHITECTURES load: Llama, Mistral and Qwen2 are one
architecture up to q/k/v biases; the others switch on ModelConfig's family features. Anything
broken, mismatched or of another family fails at load time with a `CheckpointError` naming the
file and what is wrong: a server must not start on half a model.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from layerwatch.inference_shim.runtime.gates import fingerprint, fingerprint_indices
from layerwatch.inference_shim.runtime.model import (
    ACTIVATIONS,
    ModelConfig,
    Transformer,
    non_finite_problem,
    rope_inverse_frequencies,
)
from layerwatch.inference_shim.runtime.quantization import check_precision, check_quantizable, quantize_model
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer, TokenizerError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
)
GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM")
# Families whose attention_bias adds an o_proj bias too, which the model does not have.
NO_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM", *GEMMA)
# Families whose every layer is a sliding-window layer: served up to the window, where it is plain
# causal attention (Gemma2 alternates, and really slides).
SLIDING_EVERY_LAYER = ("MistralForCausalLM", "Phi3ForCausalLM")
# Phi3 stores q/k/v and gate/up each stacked by rows in one matrix; the model keeps them apart.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Tensors some exporters write that carry nothing we need (RoPE frequencies are recomputed).
HARMLESS_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# safetensors' names of the float dtypes a weights file may store, and its length field's size.
STORED_FLOAT_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_LENGTH_BYTES = 8


class CheckpointError(ValueError):
    """The checkpoint folder is broken or does not match this code; the message names the file."""


@dataclass
class LoadedCheckpoint:
    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer


def resolve_device(name: str) -> torch.device:
    """A torch device from its name; ValueError for a malformed name, a kind of device the model does
    not run on (meta, mps, xpu: a traceback from the first tensor made there) or a GPU this machine lacks."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r}: {exc}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: the model runs on cpu or cuda (cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def device_memory_bytes(device: torch.device) -> int:
    """All the memory of `device`: a GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
    quantization: str = "none",
) -> LoadedCheckpoint:
    """Load a checkpoint folder. `dtype=None` keeps the dtype config.json declares; `quantization`
    (QUANTIZATIONS) quantizes the projections and the LM head once loaded (runtime/quantization.py);
    one the device or the model's widths cannot take is refused (PrecisionError) before any weight is
    read."""
    folder = Path(path)
    hf_config, config = _read_config(folder)
    if dtype is None:
        dtype = _declared_dtype(hf_config, folder / CONFIG_FILE)
    check_quantizable(torch.device(device), config, quantization)
    fused = _architecture(hf_config) in FUSED_ARCHITECTURES
    state = _load_weights(folder, config, torch.device(device), dtype, fused)
    model = quantize_model(_build_model(config, state, torch.device(device)), quantization)
    try:
        tokenizer = Tokenizer.from_files(
            folder / TOKENIZER_FILE,
            folder / TOKENIZER_CONFIG_FILE,
            extra_eos_token_ids=config.eos_token_ids,
            bos_token_id=config.bos_token_id,
        )
    except TokenizerError as exc:
        raise CheckpointError(str(exc)) from exc
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{folder / TOKENIZER_FILE}: {tokenizer.vocab_size} tokens, but the model's "
            f"embedding has only vocab_size={config.vocab_size} rows ({CONFIG_FILE})"
        )
    return LoadedCheckpoint(path=folder, config=config, model=model.eval(), tokenizer=tokenizer)


def read_config(path: str | Path) -> ModelConfig:
    """The config of the checkpoint folder `path`, as load_checkpoint reads it, without its weights."""
    return _read_config(Path(path))[1]


def checkpoint_fingerprint(path: str | Path, dtype: torch.dtype) -> str:
    """gates.model_fingerprint of the model load_checkpoint(path, dtype=dtype) would load, read from the
    folder's files: its config and the few values of each weight the fingerprint samples, never a whole
    weight. A folder load_checkpoint refuses for its config or its weights' names, shapes or files is
    refused the same way; NaN or infinite weights, which it finds by reading them all, are not looked for."""
    folder = Path(path)
    hf_config, config = _read_config(folder)
    stored, parts = _stored_shapes(config, fused=_architecture(hf_config) in FUSED_ARCHITECTURES)
    samples: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}

    layout = functools.cache(_data_layout)

    def sample(path: Path, name: str, _: Any) -> None:
        shape = stored[name]
        first = 0  # a fused tensor's parts are blocks of its rows; any other tensor is one block
        for part, rows in parts.get(name, [(name, shape[0])]):
            part_shape = (rows, *shape[1:])
            numel = math.prod(part_shape)
            values = _values_at(path, layout(path)[name], first + fingerprint_indices(numel))
            samples[_our_name(part)] = (part_shape, values.to(dtype))
            first += numel

    _read_stored(folder, config, stored, sample)
    if config.tie_word_embeddings:
        samples["lm_head.weight"] = samples["embed_tokens.weight"]
    return fingerprint(config, samples)


def _read_config(folder: Path) -> tuple[dict, ModelConfig]:
    """(config.json as read, the model's config from it)."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory (expected a Hugging Face checkpoint folder)")
    hf_config = _read_json(folder / CONFIG_FILE)
    return hf_config, config_from_hf(hf_config, folder / CONFIG_FILE, _generation_eos_ids(folder))


def load_precise(path: str | Path, device: str, dtype: str, quantization: str) -> LoadedCheckpoint:
    """A checkpoint at the device, dtype (a DTYPES name) and quantization a command's flags name,
    a combination the device cannot run refused first (quantization.check_precision)."""
    resolved = resolve_device(device)
    check_precision(resolved, DTYPES[dtype], quantization)
    return load_checkpoint(path, device=resolved, dtype=DTYPES[dtype], quantization=quantization)


# --- config.json ---------------------------------------------------------------------------------


def _architecture(raw: dict) -> str | None:
    return next((a for a in raw.get("architectures") or [] if a in ARCHITECTURES), None)


def config_from_hf(raw: dict, source: Path, extra_eos_ids: tuple[int, ...] = ()) -> ModelConfig:
    """Map a Hugging Face config.json onto ModelConfig; refuse what this model cannot compute."""

    def fail(message: str) -> CheckpointError:
        return CheckpointError(f"{source}: {message}")

    architecture = _architecture(raw)
    if architecture is None:
        raise fail(
            f"architectures={raw.get('architectures')!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if raw.get("mlp_bias"):
        raise fail("mlp_bias=true is not supported")
    if architecture in NO_ATTENTION_BIAS and raw.get("attention_bias"):
        raise fail(f"attention_bias=true is not supported for {architecture} (it adds an o_proj bias)")
    if raw.get("use_sliding_window"):
        raise fail("use_sliding_window=true is not supported")
    if raw.get("use_bidirectional_attention"):
        raise fail("use_bidirectional_attention=true is not supported (a causal language model is)")

    def integer(name: str, default: int | None = None) -> int:
        value = raw.get(name, default)
        if value is None and default is not None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise fail(f"{name} must be a positive integer, found {value!r}")
        return value

    def number(name: str) -> float | None:
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
            raise fail(f"{name} must be a positive number or null, found {value!r}")
        return None if value is None else float(value)

    hidden, heads = integer("hidden_size"), integer("num_attention_heads")
    num_layers = integer("num_hidden_layers")
    max_positions = integer("max_position_embeddings", 2048)
    if architecture in SLIDING_EVERY_LAYER and raw.get("sliding_window"):
        # Within the window, sliding-window attention is plain causal attention.
        max_positions = min(max_positions, integer("sliding_window"))
    rope_theta, rope_scaling = _rope(raw, fail)
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos_ids, list) or not all(isinstance(i, int) for i in eos_ids):
        raise fail(f"eos_token_id must be an integer or a list of integers, found {eos!r}")
    bos = raw.get("bos_token_id")
    if bos is not None and not isinstance(bos, int):
        raise fail(f"bos_token_id must be an integer or null, found {bos!r}")

    # The family features (ModelConfig, FAMILY_FIELDS); Llama, Mistral and Phi3 need none.
    features: dict = {}
    if architecture == "Qwen3ForCausalLM":
        features.update(qk_norm="head")
    if architecture == "Olmo2ForCausalLM":
        features.update(qk_norm="projection", norm_layout="post", norm_weight_in_fp32=True)
    if architecture in GEMMA:
        features.update(norm_weight_offset=1.0, norm_weight_in_fp32=True, embedding_scale=hidden**0.5)
        # Gemma2 names it `hidden_activation`; Gemma's legacy "gelu" means the tanh approximation
        # (transformers maps it the same way).
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        activation = "gelu_pytorch_tanh" if activation == "gelu" else activation
    else:
        activation = raw.get("hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise fail(f"hidden_act={activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    features.update(hidden_act=activation)
    if architecture == "Gemma2ForCausalLM":
        features.update(
            norm_layout="sandwich",
            attention_scale=integer("query_pre_attn_scalar") ** -0.5,
            attn_logit_softcapping=number("attn_logit_softcapping"),
            final_logit_softcapping=number("final_logit_softcapping"),
        )
        if raw.get("sliding_window") is not None:
            features.update(
                sliding_window=integer("sliding_window"), sliding_layers=_sliding_layers(raw, num_layers, fail)
            )
    try:
        return ModelConfig(
            vocab_size=integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=integer("num_key_value_heads", heads),
            head_dim=integer("head_dim", hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            # Gemma ties the LM head unless told otherwise (transformers' default for the family).
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", architecture in GEMMA)),
            attention_bias=architecture == "Qwen2ForCausalLM",
            bos_token_id=bos,
            eos_token_ids=tuple(dict.fromkeys(eos_ids + list(extra_eos_ids))),
            **features,
        )
    except ValueError as exc:  # e.g. heads not a multiple of kv heads
        raise fail(str(exc)) from exc


def _sliding_layers(raw: dict, num_layers: int, fail) -> tuple[int, ...]:
    # Gemma2: `layer_types` names each layer's attention; without it (checkpoints from before
    # transformers wrote it), layers 0, 2, 4, ... slide and the others attend to everything.
    types = raw.get("layer_types")
    if types is None:
        return tuple(range(0, num_layers, 2))
    kinds = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
        raise fail(f"layer_types must list {num_layers} entries of {kinds}, found {types!r}")
    return tuple(layer for layer, kind in enumerate(types) if kind == "sliding_attention")


def _rope(raw: dict, fail) -> tuple[float, dict | None]:
    # transformers < 5 writes `rope_theta` and `rope_scaling`; 5.x writes one `rope_parameters`
    # dict holding rope_theta, rope_type and the scaling fields.
    params = dict(raw.get("rope_parameters") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    # Phi3 may rotate only part of each head; transformers 5 moves the factor into rope_parameters.
    partial_rotary = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial_rotary != 1.0:
        raise fail(f"partial_rotary_factor={partial_rotary!r} is not supported (RoPE on the whole head only)")
    scaling = raw.get("rope_scaling") or params or None
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise fail(f"rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if kind == "default":
            scaling = None
    try:
        theta = float(theta)
        probe = ModelConfig(
            vocab_size=1,
            hidden_size=2,
            intermediate_size=1,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=2,
            rope_theta=theta,
            rope_scaling=scaling,
        )
        rope_inverse_frequencies(probe)  # a missing scaling field fails here, not at the first request
    except (KeyError, TypeError, ValueError) as exc:
        raise fail(f"bad RoPE settings rope_theta={theta!r} rope_scaling={scaling!r}: {exc!r}") from exc
    return theta, scaling


def _declared_dtype(raw: dict, source: Path) -> torch.dtype:
    name = raw.get("dtype", raw.get("torch_dtype", "float32")) or "float32"
    if name not in DTYPES:
        raise CheckpointError(f"{source}: dtype {name!r} is not supported (supported: {', '.join(DTYPES)})")
    return DTYPES[name]


def _generation_eos_ids(folder: Path) -> tuple[int, ...]:
    # Instruct checkpoints often list their end-of-turn tokens only in generation_config.json.
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        return ()
    eos = _read_json(path).get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise CheckpointError(f"{path}: eos_token_id must be an integer or a list of integers, found {eos!r}")
    return tuple(ids)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        value = json.loads(path.read_text())
    except RecursionError:  # e.g. 100,000 "[": the parser recurses once per level
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


# --- weights -------------------------------------------------------------------------------------


def hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face one ("layers.0.mlp..." -> "model.layers.0.mlp...")."""
    return name if name.startswith("lm_head.") else "model." + name


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for every weight the checkpoint must hold."""
    with torch.device("meta"):
        model = Transformer(config)
    shapes = {hf_name(n): tuple(t.shape) for n, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]  # the embedding matrix serves as the LM head
    return shapes


def _shard_files(folder: Path) -> dict[str, list[str]]:
    """File name -> tensor names it should hold, from the index or the single weights file."""
    index_path = folder / WEIGHTS_INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' object mapping tensor names to shard files")
        shards: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            shards.setdefault(file, []).append(name)
        for file in shards:
            if not (folder / file).is_file():
                raise CheckpointError(f"{folder / file}: shard listed in {WEIGHTS_INDEX_FILE} is missing")
        return shards
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise CheckpointError(
            f"{single}: file not found, and no {WEIGHTS_INDEX_FILE} either "
            f"(only safetensors weights are supported; the folder holds {found})"
        )
    return {WEIGHTS_FILE: []}  # [] = whatever the file holds


def _our_name(name: str) -> str:
    """The Hugging Face parameter name -> ours (hf_name's inverse)."""
    return name.removeprefix("model.")


def _fused_names(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Fused tensor name (Phi3) -> the names of the tensors it stacks by rows, in order."""
    return {
        f"model.layers.{layer}.{fused}.weight": tuple(f"model.layers.{layer}.{part}.weight" for part in parts)
        for layer in range(config.num_layers)
        for fused, parts in FUSED_PROJECTIONS.items()
    }


def _stored_shapes(
    config: ModelConfig, fused: bool
) -> tuple[dict[str, tuple[int, ...]], dict[str, list[tuple[str, int]]]]:
    """Hugging Face name -> shape of each tensor the folder must hold, a fused one (Phi3) as stored; and
    fused name -> (name, rows) of each tensor it stacks by rows, in order."""
    expected = expected_shapes(config)
    parts: dict[str, list[tuple[str, int]]] = {}
    for name, names in (_fused_names(config) if fused else {}).items():
        shapes = [expected.pop(part) for part in names]
        parts[name] = [(part, rows) for part, (rows, _) in zip(names, shapes, strict=True)]
        expected[name] = (sum(rows for _, rows in parts[name]), shapes[0][1])
    return expected, parts


def _read_stored(
    folder: Path, config: ModelConfig, expected: dict[str, tuple[int, ...]], read: Callable[[Path, str, Any], None]
) -> None:
    """read(file, name, safetensors reader) for each tensor of `expected` in the folder's weights files,
    once its name and shape are checked; every one must be there, and no other but a harmless one."""
    found: set[str] = set()
    for file, listed in _shard_files(folder).items():
        path = folder / file
        try:
            with safe_open(str(path), framework="pt") as reader:
                names = list(reader.keys())
                missing_listed = sorted(set(listed) - set(names))
                if missing_listed:
                    raise CheckpointError(
                        f"{path}: {WEIGHTS_INDEX_FILE} lists {missing_listed[:3]} in this "
                        f"shard, but the file does not hold them"
                    )
                for name in names:
                    if name not in expected:
                        if HARMLESS_TENSOR.fullmatch(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
                            continue
                        raise CheckpointError(
                            f"{path}: unexpected tensor {name!r} (not part of this "
                            f"{config.num_layers}-layer model as {CONFIG_FILE} describes it)"
                        )
                    shape = tuple(reader.get_slice(name).get_shape())
                    if shape != expected[name]:
                        raise CheckpointError(
                            f"{path}: tensor {name!r} has shape {list(shape)}, "
                            f"expected {list(expected[name])} from {CONFIG_FILE}"
                        )
                    read(path, name, reader)
                    found.add(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc
    missing = [name for name in expected if name not in found]
    if missing:
        raise CheckpointError(f"{folder}: {len(missing)} tensors missing from the weights files, e.g. {missing[:3]}")


def _load_weights(
    folder: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype, fused: bool = False
) -> dict[str, torch.Tensor]:
    expected, parts = _stored_shapes(config, fused)
    state: dict[str, torch.Tensor] = {}

    def keep(path: Path, name: str, reader: Any) -> None:
        state[name] = _finite_weight(path, name, reader.get_tensor(name), device, dtype)

    _read_stored(folder, config, expected, keep)
    for name, stacked in parts.items():
        names, rows = zip(*stacked, strict=True)
        state.update(zip(names, state.pop(name).split(list(rows)), strict=True))
    return state


def _data_layout(path: Path) -> dict[str, tuple[str, int]]:
    """Tensor name -> (its safetensors dtype, the offset of its first byte) in the weights file `path`,
    whose header safetensors has read and checked."""
    with open(path, "rb") as file:
        header_length = int.from_bytes(file.read(SAFETENSORS_LENGTH_BYTES), "little")
        header = json.loads(file.read(header_length))
    data_start = SAFETENSORS_LENGTH_BYTES + header_length
    return {
        name: (entry["dtype"], data_start + entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _values_at(path: Path, where: tuple[str, int], flat: torch.Tensor) -> torch.Tensor:
    """The values at the flat indices `flat` of the tensor stored at `where` (_data_layout) in the weights
    file `path`, each read alone: a few bytes each, not the pages around them, as a memory map would."""
    stored_dtype, start = where
    dtype = STORED_FLOAT_DTYPES.get(stored_dtype)
    if dtype is None:
        raise CheckpointError(f"{path}: weights stored as {stored_dtype}; the gates' fingerprint reads float weights")
    size = dtype.itemsize
    with open(path, "rb", buffering=0) as file:
        data = b"".join(os.pread(file.fileno(), size, start + size * index) for index in flat.tolist())
    if len(data) != size * len(flat):
        raise CheckpointError(f"{path}: cannot read safetensors file (it ends before its tensors' data)")
    return torch.frombuffer(bytearray(data), dtype=dtype)


def _finite_weight(
    path: Path, name: str, stored: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """`stored` on the model's device and dtype, refused if it holds NaN or infinite values: they
    would make every answer's logits NaN. Conversion keeps NaN and inf and can only add inf, so one
    pass over the converted tensor finds both; the stored one is looked at again only to say which
    it was."""
    converted = stored.to(device=device, dtype=dtype)
    problem = non_finite_problem(name, converted, converted_to=dtype)
    if problem is None:
        return converted
    raise CheckpointError(f"{path}: {non_finite_problem(name, stored) or problem}")


def _build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    # Built on the meta device and then given the loaded tensors: no time or memory spent on a
    # random initialisation that would be overwritten.
    with torch.device("meta"):
        model = Transformer(config)
    ours = {name[len("model.") :] if name.startswith("model.") else name: t for name, t in state.items()}
    if config.tie_word_embeddings:
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
    model.load_state_dict(ours, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.lay_out_weights()  # the assigned tensors replaced the layout built on the meta device
    model.inv_freq = rope_inverse_frequencies(config).to(device)  # a non-persistent buffer, still on meta
    return model


# --- saving --------------------------------------------------------------------------------------


def save_checkpoint(model: Transformer, tokenizer: Tokenizer | str | Path, out_dir: str | Path) -> None:
    """Write `model` (without gates) as a Hugging Face folder that transformers can load too.

    `tokenizer` is our Tokenizer, or the path of a tokenizer.json (see `tokenizer_for_model`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = tokenizer_for_model(Path(tokenizer), config)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(model), indent=2) + "\n")
    state = {
        hf_name(n): t.detach().contiguous().cpu() for n, t in model.state_dict().items() if not n.startswith("gates.")
    }
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer.save(out)


def tokenizer_for_model(tokenizer_json: Path, config: ModelConfig) -> Tokenizer:
    """A bare tokenizer.json (as training writes it) made the model's tokenizer: BOS and EOS are the
    config's token ids, and it prepends BOS when the config has one, because our training frames
    every document with BOS; saved, transformers' AutoTokenizer then encodes as we do."""
    backend = Tokenizer.from_files(tokenizer_json).backend
    id_to_token = backend.id_to_token

    def token(token_id: int, name: str) -> str:
        text = id_to_token(token_id)
        if text is None:
            raise TokenizerError(f"{tokenizer_json}: {name} {token_id} is not in the vocabulary")
        return text

    bos = token(config.bos_token_id, "bos_token_id") if config.bos_token_id is not None else None
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_tokens=[token(i, "eos_token_id") for i in config.eos_token_ids],
        add_bos_token=bos is not None,
    )


def hf_config(model: Transformer) -> dict:
    """The config.json transformers needs to rebuild `model` (Qwen2 when q/k/v carry biases)."""
    c = model.config
    if c.family_features():
        raise ValueError(
            f"saving writes a Llama or Qwen2 folder; this model has family features {sorted(c.family_features())}"
        )
    architecture, model_type = ("Qwen2ForCausalLM", "qwen2") if c.attention_bias else ("LlamaForCausalLM", "llama")
    dtype = next(model.parameters()).dtype
    eos = list(c.eos_token_ids)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": model_type != "llama",
        "mlp_bias": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
