"""`layerwatch generate [--check]`: write every generated file of the repository from code.

What is generated, and the query check that runs first, is layerwatch/deploy/artifacts.py. `--check` writes
nothing and exits 1 naming each committed file that differs from what the code generates (or that
lies in a generated folder but is no longer generated).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from layerwatch.alerts.profile_file import ProfileError
from layerwatch.deploy.artifacts import PROFILES_DIR, FlagsReferenceError, generated_files, stale_files
from layerwatch.promql import UnknownMetricError
from layerwatch.settings import add_flags, from_flags, setting


@dataclass(frozen=True, kw_only=True)
class GenerateSettings:
    check: bool = setting(False, help="write nothing; exit 1 if any committed generated file is stale")
    root: Path = setting(
        Path("."),
        type=Path,
        help="the repository checkout to read profiles from and write into (default: the current folder)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, GenerateSettings)


def run(args: argparse.Namespace) -> int:
    settings = from_flags(GenerateSettings, args)
    root = settings.root.resolve()
    if not (root / PROFILES_DIR).is_dir():
        # An installed package has no checkout to write into: generation is a repository tool.
        print(
            f"layerwatch generate: {root} is not a layerwatch checkout (no {PROFILES_DIR}/); "
            f"run it from the repository root or pass --root",
            file=sys.stderr,
        )
        return 2
    try:
        files = generated_files(root)
    except ModuleNotFoundError as exc:
        print(f"layerwatch generate: {exc}: install the `generate` extra (pip install '.[generate]')", file=sys.stderr)
        return 2
    except (ProfileError, UnknownMetricError, FlagsReferenceError) as exc:
        print(f"layerwatch generate: {exc}", file=sys.stderr)
        return 2
    if settings.check:
        stale = stale_files(root, files)
        for path in stale:
            print(f"stale: {path}", file=sys.stderr)
        if stale:
            print("run `layerwatch generate` and commit the result", file=sys.stderr)
            return 1
        print(f"{len(files)} generated files are up to date")
        return 0
    for path, text in files.items():
        target = root / path
        if target.is_file() and target.read_text() == text:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {path}")
    return 0
