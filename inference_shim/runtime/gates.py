"""Gate heads stored apart from the model, in `gates.safetensors`.

The file holds the GateBank's tensors (fp32) and one metadata entry, `layerwatch_gates`, a JSON
object: layer count, hidden size, the threshold and patience the gates were trained for, and the
fingerprint of the base model. Gates only make sense on the model they were trained on, so
loading them onto another model fails. The sha256 of the file bytes identifies the served gates
(`layerwatch_model_info{gates_sha256}`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as serialize_tensors

from inference_shim.runtime.model import FAMILY_FIELDS, GateBank, Transformer
from inference_shim.runtime.skip_policy import SkipPolicyConfig

GATES_FILE = "gates.safetensors"  # a checkpoint folder's gate file, when none is named
METADATA_KEY = "layerwatch_gates"  # one key only: the serialised header (and so the sha256) is deterministic
FORMAT_VERSION = 1
FINGERPRINT_SAMPLES = 64  # values sampled from each tensor


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


@dataclass
class LoadedGates:
    gates: GateBank
    metadata: GateMetadata
    sha256: str  # of the file bytes


def model_fingerprint(model: Transformer) -> str:
    """A cheap identity of the base model: its shape-defining config, tensor names and shapes, and
    a strided sample of every tensor's values. Rounded to bfloat16, so the same weights loaded in
    fp32 or bf16 share a fingerprint."""
    digest = hashlib.sha256()
    config = model.config.to_dict()
    for not_shape in ("bos_token_id", "eos_token_ids", "max_position_embeddings"):
        del config[not_shape]
    # Family features count only where set, so a Llama keeps the fingerprint its gate files carry.
    config = {k: v for k, v in config.items() if k not in FAMILY_FIELDS} | model.config.family_features()
    digest.update(json.dumps(config, sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        if name.startswith("gates."):
            continue
        flat = tensor.detach().reshape(-1)
        picks = torch.linspace(0, flat.numel() - 1, min(flat.numel(), FINGERPRINT_SAMPLES)).long()
        sample = flat[picks.to(flat.device)].to(torch.bfloat16).view(torch.int16).cpu().numpy()
        digest.update(f"{name}:{list(tensor.shape)}:".encode() + sample.tobytes())
    return digest.hexdigest()


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
    path = Path(path)
    if not path.is_file():
        raise GateFileError(
            f"{path}: gate file not found; train gates for this model with `layerwatch train-gates "
            f"--model DIR --data TEXT --out {path}`, or serve untrained gates with `--reset-gates`"
        )
    data = path.read_bytes()
    try:
        tensors = load_tensors(data)
    except (SafetensorError, ValueError) as exc:
        raise GateFileError(f"{path}: not a readable safetensors file ({exc})") from exc
    metadata = _read_metadata(path, data)
    config = model.config
    if (metadata.num_layers, metadata.hidden_size) != (config.num_layers, config.hidden_size):
        raise GateFileError(
            f"{path}: gates for a model with {metadata.num_layers} layers and hidden size "
            f"{metadata.hidden_size}; this model has {config.num_layers} layers and hidden "
            f"size {config.hidden_size}"
        )
    fingerprint = model_fingerprint(model)
    if metadata.base_fingerprint != fingerprint:
        raise GateFileError(
            f"{path}: gates were trained on another base model (fingerprint "
            f"{metadata.base_fingerprint[:12]}, this model is {fingerprint[:12]})"
        )
    gates = GateBank(config.num_layers, config.hidden_size)
    try:
        gates.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:  # missing/unexpected names or wrong shapes
        raise GateFileError(f"{path}: tensors do not form a gate bank: {exc}") from exc
    return LoadedGates(gates=_placed(gates, model), metadata=metadata, sha256=hashlib.sha256(data).hexdigest())


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


def _serialize(gates: GateBank, metadata: GateMetadata) -> bytes:
    if len(gates) != metadata.num_layers:
        raise ValueError(f"{len(gates)} gates but metadata says num_layers={metadata.num_layers}")
    tensors = {name: t.detach().float().contiguous().cpu() for name, t in gates.state_dict().items()}
    header = json.dumps({"format_version": FORMAT_VERSION, **asdict(metadata)}, sort_keys=True)
    return serialize_tensors(tensors, metadata={METADATA_KEY: header})


def _read_metadata(path: Path, data: bytes) -> GateMetadata:
    # safetensors layout: 8-byte little-endian header length, then the JSON header.
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    raw = header.get("__metadata__", {}).get(METADATA_KEY)
    if raw is None:
        raise GateFileError(f"{path}: not a layerwatch gate file (no '{METADATA_KEY}' metadata)")
    try:
        values = json.loads(raw)
        if values.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {values.get('format_version')!r}, expected {FORMAT_VERSION}")
        metadata = GateMetadata(**{f.name: values[f.name] for f in fields(GateMetadata)})
        types_ok = (
            isinstance(metadata.num_layers, int)
            and isinstance(metadata.hidden_size, int)
            and isinstance(metadata.threshold, (int, float))
            and isinstance(metadata.patience, int)
            and isinstance(metadata.base_fingerprint, str)
        )
        if not types_ok:
            raise ValueError("a field has the wrong type")
    except (KeyError, TypeError, ValueError) as exc:
        raise GateFileError(f"{path}: bad '{METADATA_KEY}' metadata {raw!r}: {exc!r}") from exc
    return metadata


def _placed(gates: GateBank, model: Transformer) -> GateBank:
    reference = model.embed_tokens.weight
    return gates.to(device=reference.device, dtype=reference.dtype).eval()


def gates_sha256(gates: GateBank, metadata: GateMetadata) -> str:
    """The sha256 a gate file holding `gates` and `metadata` would have (for gates made in memory)."""
    return hashlib.sha256(_serialize(gates, metadata)).hexdigest()
