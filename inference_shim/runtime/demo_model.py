"""Where the embedded demo model lives, and what it is called when served."""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
DEMO_MODEL_NAME = "layerwatch-demo"


def demo_model_present() -> bool:
    """Whether the demo checkpoint is there (a fresh clone has it; `layerwatch train-demo` rebuilds it)."""
    return (DEMO_MODEL_DIR / "config.json").is_file()
