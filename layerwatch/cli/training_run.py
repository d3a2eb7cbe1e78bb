"""What `layerwatch train-demo` and `layerwatch train-gates` share: one training run on `--threads`
torch threads, its errors and its summary line."""

from __future__ import annotations

import sys
from collections.abc import Callable

from layerwatch.cli.model_arguments import set_threads


def run_training(threads: int, train: Callable[[], str], bad_input: tuple[type[Exception], ...]) -> int:
    """Run `train()` on `threads` torch CPU threads (0: torch's default). Exit 0 after printing the line
    it returns, or 2 after printing the error when it raises one of `bad_input`."""
    set_threads(threads)
    try:
        summary = train()
    except bad_input as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary)
    return 0
