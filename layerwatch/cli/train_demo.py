"""`layerwatch train-demo`: build the embedded demo model from scratch (inference_shim/offline/demo_training.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from layerwatch.cli.model_arguments import GatedModelSettings
from layerwatch.cli.training_run import run_training
from layerwatch.inference_shim.offline.demo_training import DEMO_SCHEDULE, DemoShape
from layerwatch.inference_shim.offline.training import BackboneSchedule
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.settings import add_flags, from_flags, same_as, setting

DEFAULT_WORKDIR = Path("runs/demo")
_SHAPE = DemoShape()


@dataclass(frozen=True, kw_only=True)
class TrainDemoSettings:
    """Where the run works and writes, the demo's schedule (DEMO_SCHEDULE's defaults) and shape."""

    workdir: Path = setting(
        DEFAULT_WORKDIR, type=Path, help="corpus, tokenizer and resumable training state (default: runs/demo)"
    )
    out: Path = setting(DEMO_MODEL_DIR, type=Path, help="the exported model folder")
    steps: int = setting(
        DEMO_SCHEDULE.steps, type=int, help="optimiser steps (may change when resuming: the schedule's horizon moves)"
    )
    batch_size: int = setting(DEMO_SCHEDULE.batch_size, type=int, help=None)
    seq_len: int = setting(DEMO_SCHEDULE.seq_len, type=int, help=None)
    learning_rate: float = setting(DEMO_SCHEDULE.learning_rate, type=float, help=None)
    max_layer_drop: float = setting(
        DEMO_SCHEDULE.max_layer_drop,
        type=float,
        help="layer dropout of the deepest unprotected layer; rises linearly with depth",
    )
    layers: int = setting(_SHAPE.layers, type=int, help=None)
    hidden_size: int = setting(_SHAPE.hidden_size, type=int, help=None)
    intermediate_size: int = setting(_SHAPE.intermediate_size, type=int, help=None)
    heads: int = setting(_SHAPE.heads, type=int, help=None)
    kv_heads: int = setting(_SHAPE.kv_heads, type=int, help=None)
    vocab_size: int = setting(_SHAPE.vocab_size, type=int, help=None)
    seed: int = setting(DEMO_SCHEDULE.seed, type=int, help=None)
    threads: int = same_as(GatedModelSettings, "threads")
    checkpoint_every: float = setting(180.0, type=float, help="seconds between state saves")
    export_only: bool = setting(False, help="export the saved training state as it is (e.g. to stop a run early)")

    def shape(self) -> DemoShape:
        return DemoShape(
            layers=self.layers,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            heads=self.heads,
            kv_heads=self.kv_heads,
            vocab_size=self.vocab_size,
        )

    def schedule(self) -> BackboneSchedule:
        """The schedule's flags; its other fields keep BackboneSchedule's defaults."""
        return BackboneSchedule(
            steps=self.steps,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            learning_rate=self.learning_rate,
            max_layer_drop=self.max_layer_drop,
            seed=self.seed,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, TrainDemoSettings)


def run(args: argparse.Namespace) -> int:
    from layerwatch.inference_shim.offline.corpus import CorpusError
    from layerwatch.inference_shim.offline.demo_training import DemoTrainingError, train_demo

    settings = from_flags(TrainDemoSettings, args)

    def train() -> str:
        state = train_demo(
            settings.workdir,
            settings.out,
            settings.shape(),
            settings.schedule(),
            export_only=settings.export_only,
            checkpoint_every_seconds=settings.checkpoint_every,
            log=lambda line: print(line, flush=True),
        )
        out = settings.out
        return f"exported to {out} after {state.step} steps, {state.elapsed_seconds / 60:.1f} min of training"

    return run_training(settings.threads, train, bad_input=(CorpusError, DemoTrainingError))
