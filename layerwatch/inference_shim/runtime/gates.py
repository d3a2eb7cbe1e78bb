"""Gate heads stored apart from the model, in `gates.safetensors`.

The file holds the GateBank's tensors (fp32) and one metadata entry, `layerwatch_gates`, a JSON
object: layer count, hidden size, the skip policy the gates were trained or calibrated for
(threshold, patience, skip rule and its EWMA weight), and the fingerprint of the base model. Gates
only make sense on the model they were trained on, so loading them onto another model fails. The
sha256 of the file bytes identifies the served gates (`layerwatch_model_info{gates_sha256}`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as serialize_tensors

from layerwatch.inference_shim.runtime.model import (
    FAMILY_FIELDS,
    GateBank,
    ModelConfig,
    Transformer,
    non_finite_problem,
)
from layerwatch.skip_policy import MAX_PATIENCE, SKIP_RULES, SkipPolicyConfig, is_patience, is_threshold

GATES_FILE = "gates.safetensors"  # a checkpoint folder's gate file, when none is named
METADATA_KEY = "layerwatch_gates"  # one key only: the serialised header (and so the sha256) is deterministic
FORMAT_VERSION = 1
FINGERPRINT_SAMPLES = 64  # values sampled from each tensor
# safetensors layout: an 8-byte little-endian header length, the JSON header, then the tensor data.
HEADER_LENGTH_BYTES = 8
# The JSON header of a real gate file takes about 90 bytes per tensor plus the metadata; this is
# room to spare (a gate file's size limit is derived from the model's shape with it).
HEADER_BYTES_BASE = 4096
HEADER_BYTES_PER_TENSOR = 256


def gates_path_for(model_dir: str | Path, gates_path: str | Path | None = None) -> Path:
    """The gate file to load: the one named, else GATES_FILE in the checkpoint folder."""
    return Path(gates_path) if gates_path is not None else Path(model_dir) / GATES_FILE


class GateFileError(ValueError):
    """A gate file is missing, malformed, or belongs to another model; the message names the file."""


@dataclass(frozen=True)
class GateMetadata:
    num_layers: int
    hidden_size: int
    threshold: float
    patience: int
    base_fingerprint: str
    # Optional in a file: gate files written before the EWMA rule came lack them and mean "streak".
    skip_rule: str = SkipPolicyConfig.skip_rule
    ewma_alpha: float = SkipPolicyConfig.ewma_alpha

    def policy(self, **settings: Any) -> SkipPolicyConfig:
        """The skip policy this file records; `settings` (SkipPolicyConfig fields) set the others or
        override what it records."""
        return SkipPolicyConfig.recorded(vars(self), **settings)


@dataclass
class LoadedGates:
    gates: GateBank
    metadata: GateMetadata
    sha256: str  # of the file bytes


# The attribute runtime/quantization.py records a quantized model's float fingerprint in.
QUANTIZED_FROM = "quantized_from_fingerprint"


def model_fingerprint(model: Transformer) -> str:
    """A cheap identity of the base model (`fingerprint`) from the model in memory. A quantized model
    keeps the fingerprint of the weights it was quantized from (QUANTIZED_FROM), so that its gates
    load on it."""
    recorded = getattr(model, QUANTIZED_FROM, None)
    if recorded is not None:
        return recorded
    samples = {}
    for name, tensor in model.state_dict().items():
        if not name.startswith("gates."):
            picks = torch.unravel_index(fingerprint_indices(tensor.numel()).to(tensor.device), tensor.shape)
            samples[name] = (tuple(tensor.shape), tensor.detach()[picks])
    return fingerprint(model.config, samples)


def fingerprint(config: ModelConfig, samples: Mapping[str, tuple[tuple[int, ...], torch.Tensor]]) -> str:
    """The one definition of a base model's fingerprint, from its config and, per weight (the model's
    parameter names, a tied LM head included), its shape and its values in the model's dtype at the
    flat indices `fingerprint_indices` picks: what `model_fingerprint` reads from a model in memory and
    checkpoint.checkpoint_fingerprint from a folder's files.

    The values are rounded to bfloat16, so the same weights loaded in fp32 or bf16 share a fingerprint;
    the config's numbers to float32, so the same model read from its config.json (`rms_norm_eps`
    1e-05) and from a GGUF, which stores float32 (9.999999747e-06), shares one too."""
    digest = hashlib.sha256()
    recorded = config.to_dict()
    for not_shape in ("bos_token_id", "eos_token_ids", "max_position_embeddings"):
        del recorded[not_shape]
    # Family features count only where set, so a Llama keeps the fingerprint its gate files carry.
    recorded = {k: v for k, v in recorded.items() if k not in FAMILY_FIELDS} | config.family_features()
    digest.update(json.dumps(_float32_decimals(recorded), sort_keys=True).encode())
    for name, (shape, values) in sorted(samples.items()):
        sample = values.to(torch.bfloat16).view(torch.int16).cpu().numpy()
        digest.update(f"{name}:{list(shape)}:".encode() + sample.tobytes())
    return digest.hexdigest()


def fingerprint_indices(numel: int) -> torch.Tensor:
    """The flat indices of a tensor of `numel` values that a fingerprint samples: FINGERPRINT_SAMPLES
    evenly spaced, first and last included, in integer arithmetic (float32, torch.linspace's default,
    rounds numel - 1 up to numel past 2^24 elements, one past the end of every real model's embedding)."""
    count = min(numel, FINGERPRINT_SAMPLES)
    return torch.arange(count, dtype=torch.int64) * (numel - 1) // max(count - 1, 1)


def _float32_decimals(value: Any) -> Any:
    """`value` with every float as the shortest decimal that reads back as the same float32 (1e-05
    for both 1e-05 and 9.999999747378752e-06): what the demo model's files already hold."""
    if isinstance(value, float):
        return float(str(np.float32(value)))
    if isinstance(value, dict):
        return {key: _float32_decimals(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_float32_decimals(item) for item in value]
    return value


def save_gates(path: str | Path, gates: GateBank, metadata: GateMetadata) -> str:
    """Write the gate file (atomically) and return its sha256."""
    data = _serialize(gates, metadata)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
    return hashlib.sha256(data).hexdigest()


def load_gates(path: str | Path, model: Transformer) -> LoadedGates:
    """Read a gate file for `model`, on the model's device and dtype. Does not attach them."""
    reference = model.embed_tokens.weight
    return load_gates_for(path, model.config, lambda: model_fingerprint(model), reference.device, reference.dtype)


def load_gates_for(
    path: str | Path, config: ModelConfig, fingerprint: Callable[[], str], device: torch.device, dtype: torch.dtype
) -> LoadedGates:
    """Read a gate file for the model of `config` whose fingerprint `fingerprint()` computes (only once
    the file's own checks passed), placed on `device` in `dtype`.

    The file's size and safetensors header are checked before it is read whole: a gate path that
    points at a huge file, or at something else entirely, costs a few bytes of reading, not its size.
    """
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise GateFileError(f"{path}: not a regular file")
        data = _read_bounded(path, gate_file_max_bytes(config.num_layers, config.hidden_size))
    except FileNotFoundError:
        raise GateFileError(
            f"{path}: gate file not found; train gates for this model with `layerwatch train-gates "
            f"--model DIR --data TEXT --out {path}`; until then `layerwatch serve --no-gates` serves the model at "
            "full depth"
        ) from None
    except OSError as exc:  # a symlink loop, a name too long, a file that cannot be read
        raise GateFileError(f"{path}: cannot read the gate file ({exc.strerror})") from None
    try:
        tensors = load_tensors(data)
    except (SafetensorError, ValueError) as exc:
        raise GateFileError(f"{path}: not a readable safetensors file ({exc})") from exc
    try:
        metadata = _read_metadata(path, data)
    except RecursionError:  # JSON nested deeper than Python's parser (or printer) recurses
        raise GateFileError(f"{path}: bad '{METADATA_KEY}' metadata: nested too deeply") from None
    if (metadata.num_layers, metadata.hidden_size) != (config.num_layers, config.hidden_size):
        raise GateFileError(
            f"{path}: gates for a model with {metadata.num_layers} layers and hidden size "
            f"{metadata.hidden_size}; this model has {config.num_layers} layers and hidden "
            f"size {config.hidden_size}"
        )
    base = fingerprint()
    if metadata.base_fingerprint != base:
        raise GateFileError(
            f"{path}: gates were trained on another base model (fingerprint "
            f"{metadata.base_fingerprint[:12]}, this model is {base[:12]})"
        )
    gates = GateBank(config.num_layers, config.hidden_size)
    try:
        gates.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:  # missing/unexpected names or wrong shapes
        raise GateFileError(f"{path}: tensors do not form a gate bank: {exc}") from exc
    _check_finite(path, tensors)
    placed = gates.to(device=device, dtype=dtype).eval()
    # Finite fp32 weights can still overflow a float16 model's dtype.
    _check_finite(path, placed.state_dict(), converted_to=dtype)
    return LoadedGates(gates=placed, metadata=metadata, sha256=hashlib.sha256(data).hexdigest())


def gate_file_max_bytes(num_layers: int, hidden_size: int) -> int:
    """The largest gate file a model of this shape can have: fp32 tensors and a generous header."""
    with torch.device("meta"):  # shapes only, no memory
        tensors = GateBank(num_layers, hidden_size).state_dict()
    data_bytes = sum(4 * tensor.numel() for tensor in tensors.values())
    return HEADER_LENGTH_BYTES + HEADER_BYTES_BASE + HEADER_BYTES_PER_TENSOR * len(tensors) + data_bytes


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    """The file's bytes, once its size and header length fit a gate file; never more than max_bytes + 1."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > max_bytes:
            raise GateFileError(f"{path}: {size} bytes; a gate file for this model has at most {max_bytes}")
        header_length = int.from_bytes(file.read(HEADER_LENGTH_BYTES), "little")
        if size < HEADER_LENGTH_BYTES or header_length > size - HEADER_LENGTH_BYTES:
            raise GateFileError(
                f"{path}: not a readable safetensors file (a header of {header_length} bytes in a file of {size})"
            )
        file.seek(0)
        data = file.read(max_bytes + 1)  # the file may have grown since the fstat
    if len(data) > max_bytes:
        raise GateFileError(f"{path}: more than {max_bytes} bytes; a gate file for this model has at most that")
    return data


def _check_finite(path: Path, tensors: dict[str, torch.Tensor], converted_to: torch.dtype | None = None) -> None:
    """NaN or infinite gate weights make every score NaN: refused, naming the first such tensor."""
    for name, tensor in tensors.items():
        problem = non_finite_problem(name, tensor, converted_to)
        if problem:
            raise GateFileError(f"{path}: {problem}")


def reset_gates(model: Transformer, seed: int) -> LoadedGates:
    """Freshly initialised gates for `model` (what an overwritten gate file looks like to the stack)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gates = GateBank(model.config.num_layers, model.config.hidden_size)
    defaults = SkipPolicyConfig()
    metadata = GateMetadata(
        num_layers=model.config.num_layers,
        hidden_size=model.config.hidden_size,
        threshold=defaults.threshold,
        patience=defaults.patience,
        base_fingerprint=model_fingerprint(model),
    )
    sha256 = hashlib.sha256(_serialize(gates, metadata)).hexdigest()
    return LoadedGates(gates=_placed(gates, model), metadata=metadata, sha256=sha256)


def gate_derangement(num_layers: int) -> list[int]:
    """source[l]: the layer whose gate layer l gets from `shuffle_gates`, a fixed derangement (no
    gate stays in place): a rotation by half the depth, so each gate lands far from its layer."""
    if num_layers < 2:
        raise ValueError(f"cannot move every gate of a {num_layers}-layer model to another layer")
    return [(layer + num_layers // 2) % num_layers for layer in range(num_layers)]


def shuffle_gates(loaded: LoadedGates) -> LoadedGates:
    """The same gates on the wrong layers (gate l gets layer `gate_derangement(L)[l]`'s weights): a
    drill for gates that no longer track their layers. Metadata (threshold, patience, fingerprint)
    stays; the sha256 is that of the shuffled gates serialised as a gate file, so it changes (from
    the served values: gates placed in bf16 give another hash than in fp32)."""
    source = gate_derangement(len(loaded.gates))
    shuffled = GateBank(loaded.metadata.num_layers, loaded.metadata.hidden_size)
    with torch.no_grad():
        for layer, gate in enumerate(shuffled.gates):
            gate.load_state_dict(loaded.gates[source[layer]].state_dict())
    reference = next(loaded.gates.parameters())
    shuffled = shuffled.to(device=reference.device, dtype=reference.dtype).eval()
    sha256 = hashlib.sha256(_serialize(shuffled, loaded.metadata)).hexdigest()
    return LoadedGates(gates=shuffled, metadata=loaded.metadata, sha256=sha256)


def feature_permutation(hidden_size: int) -> list[int]:
    """source[j]: the input feature that `scramble_gates`'s gates read as feature j, a fixed derangement of
    the hidden state (every feature moves): a rotation by half the width, as `gate_derangement` rotates
    the gates by half the depth."""
    if hidden_size < 2:
        raise ValueError(f"cannot move every feature of a hidden state of size {hidden_size}")
    return gate_derangement(hidden_size)


def scramble_gates(loaded: LoadedGates) -> LoadedGates:
    """Each gate on its own layer, its first projection reading a permuted hidden state (feature j
    read from feature `feature_permutation(d)[j]`), the same biases and second projection: a drill
    for gates that still react to every token, and still score their layers at about the usual
    level, but to the wrong features. Metadata stays; the sha256 is that of the scrambled gates
    serialised as a gate file, so it changes (from the served values, as for `shuffle_gates`)."""
    source = torch.tensor(feature_permutation(loaded.metadata.hidden_size))
    # fc1(x[source]) = W x[source] = W' x with W'[:, source[j]] = W[:, j].
    inverse = torch.argsort(source)
    scrambled = GateBank(loaded.metadata.num_layers, loaded.metadata.hidden_size)
    with torch.no_grad():
        for layer, gate in enumerate(scrambled.gates):
            weights = {name: t.detach().float().cpu() for name, t in loaded.gates[layer].state_dict().items()}
            weights["fc1.weight"] = weights["fc1.weight"][:, inverse]
            gate.load_state_dict(weights)
    reference = next(loaded.gates.parameters())
    scrambled = scrambled.to(device=reference.device, dtype=reference.dtype).eval()
    sha256 = hashlib.sha256(_serialize(scrambled, loaded.metadata)).hexdigest()
    return LoadedGates(gates=scrambled, metadata=loaded.metadata, sha256=sha256)


def _serialize(gates: GateBank, metadata: GateMetadata) -> bytes:
    if len(gates) != metadata.num_layers:
        raise ValueError(f"{len(gates)} gates but metadata says num_layers={metadata.num_layers}")
    tensors = {name: t.detach().float().contiguous().cpu() for name, t in gates.state_dict().items()}
    header = json.dumps({"format_version": FORMAT_VERSION, **asdict(metadata)}, sort_keys=True)
    return serialize_tensors(tensors, metadata={METADATA_KEY: header})


def _read_metadata(path: Path, data: bytes) -> GateMetadata:
    header = json.loads(
        data[HEADER_LENGTH_BYTES : HEADER_LENGTH_BYTES + int.from_bytes(data[:HEADER_LENGTH_BYTES], "little")]
    )
    raw = header.get("__metadata__", {}).get(METADATA_KEY)  # safetensors checked: a dict of strings
    if raw is None:
        raise GateFileError(f"{path}: not a layerwatch gate file (no '{METADATA_KEY}' metadata)")

    def bad(reason: str) -> GateFileError:
        return GateFileError(f"{path}: bad '{METADATA_KEY}' metadata: {reason}")

    try:
        values = json.loads(raw)
    except ValueError as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(values, dict):
        raise bad(f"expected a JSON object, got {type(values).__name__}")
    if values.get("format_version") != FORMAT_VERSION:
        raise bad(f"format_version {values.get('format_version')!r}, expected {FORMAT_VERSION}")
    required = [f.name for f in fields(GateMetadata) if f.default is MISSING]
    missing = [name for name in required if name not in values]
    if missing:
        raise bad(f"missing field(s) {', '.join(missing)}")
    metadata = GateMetadata(**{f.name: values[f.name] for f in fields(GateMetadata) if f.name in values})
    problem = _metadata_problem(metadata)
    if problem:
        raise bad(problem)
    return metadata


def _metadata_problem(metadata: GateMetadata) -> str | None:
    """What is wrong with the fields' values, naming the field; None when nothing is.
    JSON true is a Python int (and 1.0), and Python's json reads NaN: both are refused by name."""

    def counts(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    for name in ("num_layers", "hidden_size", "patience"):
        if not counts(getattr(metadata, name)):
            return f"{name} must be an integer >= 1, got {json.dumps(getattr(metadata, name))}"
    if not is_patience(metadata.patience):
        return f"patience must be <= {MAX_PATIENCE}, got {metadata.patience}"
    threshold = metadata.threshold
    if not is_threshold(threshold):
        return f"threshold must be a number in [0, 1], got {json.dumps(threshold)}"
    if not isinstance(metadata.base_fingerprint, str):
        return f"base_fingerprint must be a string, got {json.dumps(metadata.base_fingerprint)}"
    if metadata.skip_rule not in SKIP_RULES:
        rules = ", ".join(map(json.dumps, SKIP_RULES))
        return f"skip_rule must be one of {rules}, got {json.dumps(metadata.skip_rule)}"
    alpha = metadata.ewma_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        return f"ewma_alpha must be a number in (0, 1], got {json.dumps(alpha)}"
    return None


def _placed(gates: GateBank, model: Transformer) -> GateBank:
    reference = model.embed_tokens.weight
    return gates.to(device=reference.device, dtype=reference.dtype).eval()


def gates_sha256(gates: GateBank, metadata: GateMetadata) -> str:
    """The sha256 a gate file holding `gates` and `metadata` would have (for gates made in memory)."""
    return hashlib.sha256(_serialize(gates, metadata)).hexdigest()
