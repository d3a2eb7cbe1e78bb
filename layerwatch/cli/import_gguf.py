"""`layerwatch import-gguf FILE.gguf --out DIR`: a GGUF file (llama.cpp's format) as a checkpoint folder.

The folder (safetensors weights, config.json, generation_config.json, tokenizer.json and
tokenizer_config.json with the chat template) is what `serve`, `eval`, `calibrate` and `train-gates`
take with `--model DIR`. The conversion is layerwatch/inference_shim/offline/gguf_import.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPE_CHOICES = ("float32", "bfloat16", "float16")  # checkpoint.py's DTYPES, without importing torch to list them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", type=Path, metavar="FILE.gguf", help="the GGUF file to import")
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="checkpoint folder to write (must not hold files; missing parent folders are made)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="float32",
        help="dtype of the written weights, dequantized from the file's (default %(default)s)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --out folder and its files")


def run(args: argparse.Namespace) -> int:
    from layerwatch.inference_shim.offline.gguf_import import GGUFImportError, import_gguf

    try:
        summary = import_gguf(args.gguf, args.out, dtype=args.dtype, force=args.force)
    except GGUFImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary.line())
    return 0
