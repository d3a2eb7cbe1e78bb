"""Flags and error reporting shared by the commands that load a gated model (`eval`, `calibrate`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from layerwatch import argtypes
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.gates import GATES_FILE
from layerwatch.inference_shim.runtime.model import KV_POLICIES
from layerwatch.inference_shim.service.settings import PRECISION_SETTINGS, ModelSettings, SkippingSettings
from layerwatch.settings import add_flags
from layerwatch.skip_policy import SKIP_RULES

T = TypeVar("T")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared with `layerwatch calibrate`: the gated model and how it decodes."""
    parser.add_argument(
        "--model",
        type=Path,
        default=DEMO_MODEL_DIR,
        help="Hugging Face checkpoint folder (default: the embedded demo model)",
    )
    parser.add_argument(
        "--gates", type=Path, default=None, help=f"gate file (default: {GATES_FILE} in the model folder)"
    )
    parser.add_argument("--patience", type=argtypes.positive(int), default=None, help="default: the gates' own")
    parser.add_argument(
        "--skip-rule",
        choices=SKIP_RULES,
        default=None,
        help="streak (patience consecutive scores below tau) or ewma (their moving average below tau); "
        "default: the gates' own",
    )
    parser.add_argument(
        "--ewma-alpha",
        type=argtypes.positive_fraction,
        default=None,
        metavar="A",
        help="the ewma rule's weight of the newest score, in (0, 1]; default: the gates' own",
    )
    parser.add_argument("--kv-policy", choices=KV_POLICIES, default=KV_POLICIES[0])
    parser.add_argument("--batch-size", type=argtypes.positive(int), default=8, help="sequences decoded together")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    add_flags(parser, ModelSettings, PRECISION_SETTINGS)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


# How a batch runs the layers its rows decided (depth_execution.py): serve's two flags, for `eval`.
DEPTH_SETTINGS = ("depth_execution", "batch_consensus")


def add_depth_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SkippingSettings, DEPTH_SETTINGS)


def depth_from_arguments(args: argparse.Namespace):
    """The DepthExecutionConfig the depth flags name."""
    from layerwatch.inference_shim.runtime.depth_execution import DepthExecutionConfig

    return DepthExecutionConfig(args.depth_execution, args.batch_consensus)


def load_from_arguments(args: argparse.Namespace):
    """The gated model the shared flags name (see add_model_arguments)."""
    from layerwatch.inference_shim.offline.gated_model import load_gated_model

    return load_gated_model(
        args.model,
        args.gates,
        patience=args.patience,
        skip_rule=args.skip_rule,
        ewma_alpha=args.ewma_alpha,
        device=args.device,
        threads=args.threads,
        dtype=args.dtype,
        quantization=args.quantization,
    )


def load_checkpoint_from_arguments(args: argparse.Namespace):
    """The checkpoint alone (no gates) the shared flags name, at their device, dtype and quantization."""
    import torch

    from layerwatch.inference_shim.runtime.checkpoint import load_precise

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return load_precise(args.model, args.device, args.dtype, args.quantization)


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
