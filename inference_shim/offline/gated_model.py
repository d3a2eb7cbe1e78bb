"""A checkpoint with its gate file, as `layerwatch eval` and `layerwatch calibrate` load it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference_shim.runtime.checkpoint import LoadedCheckpoint, load_checkpoint, resolve_device
from inference_shim.runtime.gates import LoadedGates, gates_path_for, load_gates
from inference_shim.runtime.model import Transformer
from inference_shim.runtime.skip_policy import SkipPolicyConfig


@dataclass
class GatedModel:
    loaded: LoadedCheckpoint
    gates: LoadedGates
    gates_path: Path
    patience: int
    skip_rule: str
    ewma_alpha: float

    @property
    def model(self) -> Transformer:
        return self.loaded.model

    def policy(self, threshold: float | None = None, **settings: Any) -> SkipPolicyConfig:
        """The skip policy these gates decode under: at `threshold` (default: the gate file's), with
        this patience and rule unless `settings` (SkipPolicyConfig fields) say otherwise."""
        chosen = {"patience": self.patience, "skip_rule": self.skip_rule, "ewma_alpha": self.ewma_alpha}
        if threshold is not None:
            chosen["threshold"] = threshold
        return self.gates.metadata.policy(**(chosen | settings))


def load_gated_model(
    model_dir: Path,
    gates_path: Path | None = None,
    *,
    patience: int | None = None,
    skip_rule: str | None = None,
    ewma_alpha: float | None = None,
    device: str = "cpu",
    threads: int = 0,
) -> GatedModel:
    """The checkpoint and its gates (default: the folder's gates.safetensors); patience, skip rule and
    EWMA weight default to the gate file's. Raises ValueError subclasses on bad input."""
    if threads > 0:
        torch.set_num_threads(threads)
    loaded = load_checkpoint(model_dir, device=resolve_device(device))
    gates_path = gates_path_for(model_dir, gates_path)
    gates = load_gates(gates_path, loaded.model)
    metadata = gates.metadata
    gated = GatedModel(
        loaded,
        gates,
        gates_path,
        patience=metadata.patience if patience is None else patience,
        skip_rule=metadata.skip_rule if skip_rule is None else skip_rule,
        ewma_alpha=metadata.ewma_alpha if ewma_alpha is None else ewma_alpha,
    )
    gated.policy()  # refuse a bad patience, rule or alpha here, before any decoding
    return gated
