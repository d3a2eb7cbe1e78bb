"""The settings shared by the commands that load a gated model (`eval`, `calibrate`), and their errors.

Each is the setting `serve` declares (service/settings.py), read `same_as` it: one flag, type and help.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from layerwatch import argtypes
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.service.settings import ModelSettings, SkippingSettings
from layerwatch.settings import same_as, setting

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class GatedModelSettings:
    """The gated model and how it decodes (None: the gate file's policy), and torch's CPU threads."""

    model: Path = same_as(ModelSettings, "model_dir", DEMO_MODEL_DIR)
    gates_path: Path | None = same_as(ModelSettings, "gates_path")
    patience: int | None = same_as(SkippingSettings, "patience", type=argtypes.positive(int))
    skip_rule: str | None = same_as(SkippingSettings, "skip_rule")
    ewma_alpha: float | None = same_as(SkippingSettings, "ewma_alpha")
    kv_policy: str = same_as(SkippingSettings, "kv_policy")
    batch_size: int = setting(8, type=argtypes.positive(int), help="sequences decoded together")
    device: str = same_as(ModelSettings, "device")
    dtype: str = same_as(ModelSettings, "dtype")
    quantization: str = same_as(ModelSettings, "quantization")
    threads: int = setting(
        0, type=int, help="torch CPU threads (0: torch's default; on a busy shared CPU 1 is often fastest)"
    )


def load_gated(settings: GatedModelSettings):
    """The gated model `settings` name."""
    from layerwatch.inference_shim.offline.gated_model import load_gated_model

    return load_gated_model(
        settings.model,
        settings.gates_path,
        patience=settings.patience,
        skip_rule=settings.skip_rule,
        ewma_alpha=settings.ewma_alpha,
        device=settings.device,
        threads=settings.threads,
        dtype=settings.dtype,
        quantization=settings.quantization,
    )


def load_checkpoint(settings: GatedModelSettings):
    """The checkpoint alone (no gates) `settings` name, at their device, dtype and quantization."""
    from layerwatch.inference_shim.runtime.checkpoint import load_precise

    set_threads(settings.threads)
    return load_precise(settings.model, settings.device, settings.dtype, settings.quantization)


def set_threads(threads: int) -> None:
    """Torch's CPU threads (0: torch's default)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


def report_errors(action: Callable[[], T]) -> T | None:
    """Run `action()`; on bad input print the error and return None (the caller exits with 2)."""
    from layerwatch.inference_shim.offline.corpus import CorpusError
    from layerwatch.inference_shim.runtime.checkpoint import CheckpointError
    from layerwatch.inference_shim.runtime.gates import GateFileError
    from layerwatch.inference_shim.runtime.model import CompileError

    try:
        return action()
    except (CheckpointError, GateFileError, CorpusError, CompileError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
