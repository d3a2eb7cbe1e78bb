"""What `layerwatch train-demo` and `layerwatch train-gates` share: their settings objects read from
the flags of the same names, and one training run with `--threads`, its errors and its summary line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any


def from_arguments(settings: type[Any], args: argparse.Namespace) -> Any:
    """The `settings` dataclass with each field that has a flag (`batch_size`: `--batch-size`) set from
    it; the fields without a flag keep their defaults."""
    flags = vars(args)
    return settings(**{field.name: flags[field.name] for field in dataclasses.fields(settings) if field.name in flags})


def run_training(args: argparse.Namespace, train: Callable[[], str], bad_input: tuple[type[Exception], ...]) -> int:
    """Run `train()` on `--threads` torch threads (0: torch's default). Exit 0 after printing the line it
    returns, or 2 after printing the error when it raises one of `bad_input`."""
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        summary = train()
    except bad_input as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary)
    return 0
