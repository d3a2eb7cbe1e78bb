"""`layerwatch train-demo`: build the embedded demo model from scratch (inference_shim/offline/demo_training.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerwatch.cli.training_run import from_arguments, run_training

DEFAULT_WORKDIR = Path("runs/demo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from layerwatch.inference_shim.offline.demo_training import DEMO_SCHEDULE, DemoShape
    from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR

    shape, schedule = DemoShape(), DEMO_SCHEDULE
    parser.add_argument(
        "--workdir",
        type=Path,
        default=DEFAULT_WORKDIR,
        help="corpus, tokenizer and resumable training state (default: runs/demo)",
    )
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR, help="the exported model folder")
    parser.add_argument(
        "--steps",
        type=int,
        default=schedule.steps,
        help="optimiser steps (may change when resuming: the schedule's horizon moves)",
    )
    parser.add_argument("--batch-size", type=int, default=schedule.batch_size)
    parser.add_argument("--seq-len", type=int, default=schedule.seq_len)
    parser.add_argument("--learning-rate", type=float, default=schedule.learning_rate)
    parser.add_argument(
        "--max-layer-drop",
        type=float,
        default=schedule.max_layer_drop,
        help="layer dropout of the deepest unprotected layer; rises linearly with depth",
    )
    parser.add_argument("--layers", type=int, default=shape.layers)
    parser.add_argument("--hidden-size", type=int, default=shape.hidden_size)
    parser.add_argument("--intermediate-size", type=int, default=shape.intermediate_size)
    parser.add_argument("--heads", type=int, default=shape.heads)
    parser.add_argument("--kv-heads", type=int, default=shape.kv_heads)
    parser.add_argument("--vocab-size", type=int, default=shape.vocab_size)
    parser.add_argument("--seed", type=int, default=schedule.seed)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch's default; on a busy shared CPU 1 is often fastest)",
    )
    parser.add_argument("--checkpoint-every", type=float, default=180.0, help="seconds between state saves")
    parser.add_argument(
        "--export-only", action="store_true", help="export the saved training state as it is (e.g. to stop a run early)"
    )


def run(args: argparse.Namespace) -> int:
    from layerwatch.inference_shim.offline.corpus import CorpusError
    from layerwatch.inference_shim.offline.demo_training import DemoShape, DemoTrainingError, train_demo
    from layerwatch.inference_shim.offline.training import BackboneSchedule

    def train() -> str:
        state = train_demo(
            args.workdir,
            args.out,
            from_arguments(DemoShape, args),
            from_arguments(BackboneSchedule, args),
            export_only=args.export_only,
            checkpoint_every_seconds=args.checkpoint_every,
            log=lambda line: print(line, flush=True),
        )
        return f"exported to {args.out} after {state.step} steps, {state.elapsed_seconds / 60:.1f} min of training"

    return run_training(args, train, bad_input=(CorpusError, DemoTrainingError))
