"""A checkpoint with its gate file, as `layerwatch eval` and `layerwatch calibrate` load it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerwatch.inference_shim.runtime.checkpoint import LoadedCheckpoint, load_precise
from layerwatch.inference_shim.runtime.gates import LoadedGates, gates_path_for, load_gates
from layerwatch.inference_shim.runtime.model import Transformer
from layerwatch.skip_policy import SkipPolicyConfig


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
        chosen = {"threshold": threshold, "patience": self.patience, "skip_rule": self.skip_rule}
        return self.gates.metadata.policy(**(chosen | {"ewma_alpha": self.ewma_alpha} | settings))


def load_gated_model(
    model_dir: Path,
    gates_path: Path | None = None,
    *,
    patience: int | None = None,
    skip_rule: str | None = None,
    ewma_alpha: float | None = None,
    device: str = "cpu",
    threads: int = 0,
    dtype: str = "float32",
    quantization: str = "none",
) -> GatedModel:
    """The checkpoint (at `dtype`, a DTYPES name, and `quantization`) and its gates (default: the
    folder's gates.safetensors); patience, skip rule and EWMA weight default to the gate file's.
    Raises ValueError subclasses on bad input."""
    if threads > 0:
        torch.set_num_threads(threads)
    loaded = load_precise(model_dir, device, dtype, quantization)
    gates_path = gates_path_for(model_dir, gates_path)
    gates = load_gates(gates_path, loaded.model)
    # The gate file's policy under the settings chosen here (refusing a bad one before any decoding).
    policy = gates.metadata.policy(patience=patience, skip_rule=skip_rule, ewma_alpha=ewma_alpha)
    return GatedModel(loaded, gates, gates_path, policy.patience, policy.skip_rule, policy.ewma_alpha)
