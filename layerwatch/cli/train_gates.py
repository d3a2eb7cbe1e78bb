"""`layerwatch train-gates`: train the gate heads of a frozen model on a plain-text file.

The objective is in layerwatch/inference_shim/offline/gate_training.py and docs/gate-training.md. The same command
with the same --seed, data and device writes a byte-identical gate file.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from layerwatch.cli.model_arguments import GatedModelSettings
from layerwatch.cli.training_run import run_training
from layerwatch.inference_shim.offline.corpus import CorpusError
from layerwatch.inference_shim.offline.gate_training import GateSchedule, GateStepStats, train_gate_file
from layerwatch.inference_shim.offline.importance_gates import ImportanceStats
from layerwatch.inference_shim.runtime.checkpoint import CheckpointError
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.service.settings import ModelSettings
from layerwatch.settings import add_flags, from_flags, same_as, setting


@dataclass(frozen=True, kw_only=True)
class TrainGatesSettings(GateSchedule):
    """Which model's gates to train on which text, where to write them and on which device; the training
    knobs are GateSchedule's, whose checks refuse a bad number before the model loads."""

    model: Path = same_as(ModelSettings, "model_dir", DEMO_MODEL_DIR)
    data: Path = setting(type=Path, required=True, help="plain UTF-8 text; blank lines separate documents")
    out: Path = setting(type=Path, required=True, help="gate file to write (safetensors)")
    device: str = same_as(ModelSettings, "device")
    threads: int = same_as(GatedModelSettings, "threads")
    quiet: bool = setting(False, help="no progress bar")

    def schedule(self) -> GateSchedule:
        return GateSchedule(**{field.name: getattr(self, field.name) for field in dataclasses.fields(GateSchedule)})


# The run's own flags first (the model, the text, the file), then the schedule's.
_RUN_SETTINGS = tuple(
    name for name in TrainGatesSettings.__dataclass_fields__ if name not in GateSchedule.__dataclass_fields__
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, TrainGatesSettings, _RUN_SETTINGS)
    add_flags(parser.add_argument_group("training (docs/gate-training.md)"), GateSchedule)


def run(args: argparse.Namespace) -> int:
    try:
        settings = from_flags(TrainGatesSettings, args)  # before the model loads: a bad number fails at once
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_training(settings.threads, lambda: train(settings), bad_input=(CheckpointError, CorpusError, ValueError))


def train(settings: TrainGatesSettings) -> str:
    """Train and write the gate file; the line that says where it went."""
    schedule = settings.schedule()
    total = schedule.steps + (schedule.fit_epochs if schedule.method == "importance" else 0)
    with tqdm(total=total, desc="train-gates", disable=settings.quiet, file=sys.stderr) as bar:

        def progress(stats: GateStepStats) -> None:
            bar.update(1)
            bar.set_postfix(
                loss=f"{stats.loss:.3f}",
                lm=f"{stats.lm_loss:.3f}",
                skip=f"{stats.skip_fraction:.2f}",
                temp=f"{stats.temperature:.2f}",
            )

        def importance_progress(stats: ImportanceStats) -> None:
            bar.update(1)
            bar.set_postfix(stage=stats.stage, loss=f"{stats.loss:.4f}")

        sha256 = train_gate_file(
            settings.model,
            settings.data,
            settings.out,
            schedule,
            device=settings.device,
            on_step=progress,
            on_progress=importance_progress,
        )
    return f"wrote {settings.out} (sha256 {sha256})"
