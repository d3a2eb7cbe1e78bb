"""A checkpoint with its gate file, as `layerwatch eval` and `layerwatch calibrate` load it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from inference_shim.runtime.checkpoint import LoadedCheckpoint, load_checkpoint, resolve_device
from inference_shim.runtime.gates import LoadedGates, gates_path_for, load_gates
from inference_shim.runtime.model import Transformer


@dataclass
class GatedModel:
    loaded: LoadedCheckpoint
    gates: LoadedGates
    gates_path: Path
    patience: int

    @property
    def model(self) -> Transformer:
        return self.loaded.model


def load_gated_model(
    model_dir: Path,
    gates_path: Path | None = None,
    *,
    patience: int | None = None,
    device: str = "cpu",
    threads: int = 0,
) -> GatedModel:
    """The checkpoint and its gates (default: the folder's gates.safetensors); patience defaults to
    the gates' own. Raises ValueError subclasses on bad input."""
    if threads > 0:
        torch.set_num_threads(threads)
    loaded = load_checkpoint(model_dir, device=resolve_device(device))
    gates_path = gates_path_for(model_dir, gates_path)
    gates = load_gates(gates_path, loaded.model)
    return GatedModel(loaded, gates, gates_path, patience if patience is not None else gates.metadata.patience)
