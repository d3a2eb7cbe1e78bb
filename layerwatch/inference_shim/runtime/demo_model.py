"""Where the embedded demo model lives, and what a model is called when served."""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
DEMO_MODEL_NAME = "layerwatch-demo"


def demo_model_present() -> bool:
    """Whether the demo checkpoint is there (a fresh clone has it; `layerwatch train-demo` rebuilds it)."""
    return (DEMO_MODEL_DIR / "config.json").is_file()


def served_model_name(model_dir: str | Path, model_name: str | None = None) -> str:
    """The model_name `serve` reports and its metrics and alerts carry (and `calibrate` writes into the
    profile by default): `model_name` when given, else DEMO_MODEL_NAME for the embedded demo model,
    else the checkpoint folder's name."""
    if model_name:
        return model_name
    folder = Path(model_dir).resolve()
    return DEMO_MODEL_NAME if folder == DEMO_MODEL_DIR else folder.name
