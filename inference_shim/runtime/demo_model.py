"""Where the embedded demo model lives (kept apart from __init__ so that importing it is free)."""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
DEMO_MODEL_NAME = "layerwatch-demo"
