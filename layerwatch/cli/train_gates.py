"""`layerwatch train-gates`: train the gate heads of a frozen model on a plain-text file.

The objective is in layerwatch/inference_shim/offline/gate_training.py and docs/gate-training.md. The same command
with the same --seed, data and device writes a byte-identical gate file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerwatch import argtypes
from layerwatch.cli.training_run import from_arguments, run_training


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from layerwatch.inference_shim.offline.gate_training import GATE_METHODS, GateSchedule
    from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
    from layerwatch.skip_policy import SKIP_RULES

    d = GateSchedule()
    parser.add_argument(
        "--model",
        type=Path,
        default=DEMO_MODEL_DIR,
        help="Hugging Face checkpoint folder (default: the embedded demo model)",
    )
    parser.add_argument("--data", type=Path, required=True, help="plain UTF-8 text; blank lines separate documents")
    parser.add_argument("--out", type=Path, required=True, help="gate file to write (safetensors)")
    parser.add_argument(
        "--method",
        choices=GATE_METHODS,
        default=d.method,
        help="relaxed: train the relaxed skip decision through the model (the demo's recipe); importance: "
        "score each layer's per-token cost of a skip once with the frozen model, then fit the gates to it "
        "(fast on real models; docs/gate-training.md)",
    )
    parser.add_argument(
        "--steps", type=int, default=d.steps, help="training steps (importance: batches of windows scored)"
    )
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--seq-len", type=int, default=d.seq_len)
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    parser.add_argument(
        "--threshold", type=argtypes.fraction, default=d.threshold, help="tau the gates are trained for"
    )
    parser.add_argument("--patience", type=int, default=d.patience)
    parser.add_argument(
        "--skip-rule",
        choices=SKIP_RULES,
        default=d.skip_rule,
        help="the skip rule the gates are trained for and that their file names: streak (--patience "
        "consecutive low scores) or ewma (the scores' moving average low, after --patience warm-up steps)",
    )
    parser.add_argument(
        "--ewma-alpha",
        type=argtypes.positive_fraction,
        default=d.ewma_alpha,
        metavar="A",
        help="the ewma rule's weight of the newest score, in (0, 1]",
    )
    parser.add_argument(
        "--target-skip",
        type=float,
        default=d.target_skip,
        help="share of (token, skippable layer) pairs the gates should skip",
    )
    parser.add_argument("--sparsity-weight", type=float, default=d.sparsity_weight)
    parser.add_argument(
        "--commit-weight",
        type=float,
        default=d.commit_weight,
        help="weight of the double-well penalty that pulls scores to --low-score/--high-score",
    )
    parser.add_argument(
        "--low-score",
        type=argtypes.open_fraction,
        default=d.low_score,
        help="the double well's lower minimum, in (0, 1) and below --threshold",
    )
    parser.add_argument(
        "--high-score",
        type=argtypes.open_fraction,
        default=d.high_score,
        help="the double well's upper minimum, in (0, 1) and above --threshold",
    )
    parser.add_argument(
        "--fit-epochs", type=int, default=d.fit_epochs, help="importance: passes of the gate fit over the scores"
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from layerwatch.inference_shim.offline.corpus import CorpusError
    from layerwatch.inference_shim.offline.gate_training import GateSchedule, GateStepStats, train_gate_file
    from layerwatch.inference_shim.offline.importance_gates import ImportanceStats
    from layerwatch.inference_shim.runtime.checkpoint import CheckpointError

    def train() -> str:
        schedule = from_arguments(GateSchedule, args)  # before the model loads: a bad number fails at once
        total = schedule.steps + (schedule.fit_epochs if schedule.method == "importance" else 0)
        with tqdm(total=total, desc="train-gates", disable=args.quiet, file=sys.stderr) as bar:

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
                args.model,
                args.data,
                args.out,
                schedule,
                device=args.device,
                on_step=progress,
                on_progress=importance_progress,
            )
        return f"wrote {args.out} (sha256 {sha256})"

    return run_training(args, train, bad_input=(CheckpointError, CorpusError, ValueError))
