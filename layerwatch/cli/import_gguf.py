"""`layerwatch import-gguf FILE.gguf --out DIR`: a GGUF file (llama.cpp's format) as a checkpoint folder.

The folder (safetensors weights, config.json, generation_config.json, tokenizer.json and
tokenizer_config.json with the chat template) is what `serve`, `eval`, `calibrate` and `train-gates`
take with `--model DIR`. The conversion is layerwatch/inference_shim/offline/gguf_import.py's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from layerwatch.settings import add_flags, from_flags, setting

DTYPE_CHOICES = ("float32", "bfloat16", "float16")  # checkpoint.py's DTYPES, without importing torch to list them


@dataclass(frozen=True, kw_only=True)
class ImportSettings:
    gguf: Path = setting(type=Path, positional=True, metavar="FILE.gguf", help="the GGUF file to import")
    out: Path = setting(
        type=Path,
        required=True,
        metavar="DIR",
        help="checkpoint folder to write (must not hold files; missing parent folders are made)",
    )
    dtype: str = setting(
        "float32",
        choices=DTYPE_CHOICES,
        help="dtype of the written weights, dequantized from the file's (default %(default)s)",
    )
    force: bool = setting(False, help="replace an existing --out folder and its files")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ImportSettings)


def run(args: argparse.Namespace) -> int:
    settings = from_flags(ImportSettings, args)
    from layerwatch.inference_shim.offline.gguf_import import GGUFImportError, import_gguf

    try:
        summary = import_gguf(settings.gguf, settings.out, dtype=settings.dtype, force=settings.force)
    except GGUFImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary.line())
    return 0
