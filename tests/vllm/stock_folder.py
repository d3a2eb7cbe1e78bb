"""A checkpoint folder for stock vLLM: the model's files without its gate file, which stock vLLM would take
for weights. Used by the parity test and benchmarks/vllm_compare.py (which runs in .venv-vllm: no pytest)."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def stock_folder(model: Path, dest: Path) -> Path:
    """`dest`, made, holding links to `model`'s checkpoint files (no copy of the weights)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        (dest / name).symlink_to(model.resolve() / name)
    return dest
