"""A tiny real checkpoint and a live `layerwatch serve` on loopback for the service tests.

The checkpoint is built once per session: random weights, a byte-level BPE trained on a few KB
of text, saved with checkpoint.save_checkpoint, and gates saved with gates.save_gates. The gates
are shaped so that the middle layers score low (and get skipped after the patience) while the
others score high, so skip counters have something to count.
"""

from __future__ import annotations

import hashlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from demo.processes import ManagedProcess, free_port
from inference_shim.runtime.checkpoint import save_checkpoint
from inference_shim.runtime.gates import GateMetadata, model_fingerprint, save_gates
from inference_shim.runtime.model import GateBank, ModelConfig, Transformer
from layerwatch.wire import GateFrame, decode_frame

MODEL_NAME = "tiny-test"
NUM_LAYERS = 6
FRAME_KEY = b"tiny-test-frame-key-0123456789abcdef"  # the session server tags its gate frames with it
VOCAB_SIZE = 320
BOS, EOS = "<s>", "</s>"
TEXT = """\
In the beginning God created the heaven and the earth. And the earth was without form, and void;
and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.
And God said, Let there be light: and there was light. And God saw the light, that it was good:
and God divided the light from the darkness. And God called the light Day, and the darkness he
called Night. And the evening and the morning were the first day. The quick brown fox jumps over
the lazy dog; pack my box with five dozen liquor jugs. Ünïcödé text: naïve café, 日本語, ✓ done.
"""


@dataclass(frozen=True)
class TinyCheckpoint:
    path: Path
    gates_path: Path
    gates_sha256: str
    num_layers: int


def train_tokenizer(path: Path) -> None:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TEXT.splitlines() * 8, trainer)
    backend.save(str(path))


def tiny_model(seed: int = 0) -> Transformer:
    config = ModelConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_layers=NUM_LAYERS,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_ids=(1,),
    )
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
        # Wide logits, and EOS always scores 0: its probability is ~1e-6 even when sampling, so
        # generations run to max_tokens and token counts are predictable.
        model.lm_head.weight.normal_(0.0, 1.0)
        model.lm_head.weight[1].fill_(0.0)
    return model.eval()


def tiny_gates(model: Transformer, seed: int = 1) -> GateBank:
    """Layers 1-3 score low (1 and 2 always, 3 around the threshold), the rest high."""
    torch.manual_seed(seed)
    config = model.config
    gates = GateBank(config.num_layers, config.hidden_size)
    biases = {1: -5.0, 2: -4.0, 3: -1.5}
    with torch.no_grad():
        for layer, gate in enumerate(gates.gates):
            gate.fc2.bias.fill_(biases.get(layer, 3.0))
    return gates.eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> TinyCheckpoint:
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("tiny-model") / MODEL_NAME
    tokenizer_json = folder.parent / "tokenizer-src.json"
    train_tokenizer(tokenizer_json)
    model = tiny_model()
    save_checkpoint(model, tokenizer_json, folder)
    gates_path = folder / "gates.safetensors"
    metadata = GateMetadata(
        num_layers=NUM_LAYERS,
        hidden_size=model.config.hidden_size,
        threshold=0.18,
        patience=3,
        base_fingerprint=model_fingerprint(model),
    )
    sha = save_gates(gates_path, tiny_gates(model), metadata)
    assert sha == hashlib.sha256(gates_path.read_bytes()).hexdigest()
    return TinyCheckpoint(folder, gates_path, sha, NUM_LAYERS)


# --- a UDP "exporter" that keeps every datagram ----------------------------------------------------


class FrameCapture:
    """Binds a loopback UDP port and collects datagrams in a thread (so the socket buffer never fills).

    With a frame `key`, `frames()` decodes as an exporter holding that key does: every datagram must
    carry a valid tag.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)  # the kernel may cap it
        self.socket.bind(("127.0.0.1", 0))
        self.socket.settimeout(0.1)
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        self.datagrams: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                self.datagrams.append(self.socket.recv(65536))
            except TimeoutError:
                continue
            except OSError:
                return

    def frames(self) -> list[GateFrame]:
        return sorted((decode_frame(d, self.key) for d in list(self.datagrams)), key=lambda f: f.sequence)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close()


# --- the live server -----------------------------------------------------------------------------


@dataclass
class LiveServer:
    base_url: str
    process: ManagedProcess
    capture: FrameCapture
    trace_path: Path
    checkpoint: TinyCheckpoint
    max_tokens_cap: int
    max_prompt_tokens: int
    max_body_bytes: int

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(self.base_url)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request is in flight: requests_total stops moving and the engine has drained."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            snapshot = self.metrics()
            current = (
                sample_sum(snapshot, "layerwatch_requests_total"),
                sample_sum(snapshot, "layerwatch_layers_executed_count"),
            )
            if current == last:
                return
            last = current
            time.sleep(0.3)
        raise TimeoutError("the server did not go idle")


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on /metrics as {(name, sorted labels): value}."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample_sum(snapshot: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in snapshot.items() if n == name and all((k, labels[k]) in ls for k in labels))


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory) -> Iterator[LiveServer]:
    work = tmp_path_factory.mktemp("serve")
    key_file = work / "frame.key"  # given through the environment: frames must come tagged with it
    key_file.write_text(FRAME_KEY.decode() + "\n")
    key_file.chmod(0o600)
    capture = FrameCapture(FRAME_KEY)
    port = free_port()
    trace_path = work / "trace.jsonl"
    caps = dict(max_tokens_cap=48, max_prompt_tokens=96, max_body_bytes=8192)
    argv = [
        sys.executable,
        "-m",
        "layerwatch_cli.main",
        "serve",
        "--model",
        str(tiny_checkpoint.path),
        "--model-name",
        MODEL_NAME,
        "--port",
        str(port),
        "--exporter-address",
        capture.address,
        "--trace-file",
        str(trace_path),
        "--allow-debug",
        "--shadow-rate",
        "1",
        "--max-batch-size",
        "4",
        # Every row as its rule decided, so that a request gets what it gets alone whatever shares its
        # batch (tests compare the two); the default depth execution: tests/model/test_depth_execution.py.
        "--depth-execution",
        "rows",
        "--max-tokens-cap",
        str(caps["max_tokens_cap"]),
        "--max-prompt-tokens",
        str(caps["max_prompt_tokens"]),
        "--shim-id",
        "test-shim",
        "--log-level",
        "info",
    ]
    env = {
        "LAYERWATCH_MAX_BODY_BYTES": str(caps["max_body_bytes"]),
        "LAYERWATCH_FRAME_KEY_FILE": str(key_file),
        "OMP_NUM_THREADS": "1",
    }
    process = ManagedProcess("serve", argv, work / "serve.log", env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        process.wait_http(f"{base_url}/healthz", timeout=120)
        yield LiveServer(base_url, process, capture, trace_path, tiny_checkpoint, **caps)
    finally:
        process.stop()
        capture.close()


# --- an in-process server, for cases that need to reach into the service ---------------------------


class InProcessServer:
    """uvicorn in a thread on a free loopback port, serving create_app(service)."""

    def __init__(self, service) -> None:
        from inference_shim.service.app import create_app

        self.service = service
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.05)
        return self

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(self.base_url)

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(15)


@pytest.fixture
def in_process(tiny_checkpoint):
    """Factory: in_process(**settings) -> a started InProcessServer (stopped after the test)."""
    from inference_shim.service.shim import ServeSettings, ShimService

    started: list[InProcessServer] = []

    def start(**overrides) -> InProcessServer:
        settings = ServeSettings(
            model_dir=tiny_checkpoint.path,
            model_name=MODEL_NAME,
            exporter_address="",
            max_tokens_cap=32,
            max_prompt_tokens=64,
            **overrides,
        )
        server = InProcessServer(ShimService.load(settings)).__enter__()
        started.append(server)
        return server

    torch.set_num_threads(1)
    yield start
    for server in started:
        server.__exit__(None, None, None)
