"""docs/instrument.md's examples run as written: a newcomer copies the first one (an example that
names a `model` and `inputs` it never made, or stops with a traceback on a stock model, loses them).
Each Python block is run whole, in a fresh namespace, from an empty folder; its frames go
to a UDP socket of the test's in place of the exporter's default address, which the block names."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from examples.router_llama import tiny_llama
from layerwatch.integrations.transformers import observe, read_attributes
from layerwatch.trace import TraceWriter, read_trace
from layerwatch.wire import DEFAULT_FRAMES_ADDRESS, decode_frame

DOC = Path(__file__).resolve().parents[2] / "docs" / "instrument.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)


def received(sock: socket.socket) -> list[str]:
    names = []
    while True:
        try:
            names.append(decode_frame(sock.recv(65536)).model_name)
        except BlockingIOError:
            return names


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_each_python_example_of_instrument_md_runs_as_written(index, tmp_path, monkeypatch):
    block = python_blocks()[index]
    assert block.count(f'"{DEFAULT_FRAMES_ADDRESS}"') == 1, "the example sends to the exporter's default address"
    torch.set_num_threads(1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as exporter:
        exporter.bind(("127.0.0.1", 0))
        exporter.setblocking(False)
        address = f"127.0.0.1:{exporter.getsockname()[1]}"
        monkeypatch.chdir(tmp_path)
        exec(compile(block.replace(DEFAULT_FRAMES_ADDRESS, address), f"{DOC}[{index}]", "exec"), {})
        names = received(exporter)
    assert names and set(names) == {"my-model"}
    trace = tmp_path / "healthy.jsonl"
    if "TraceWriter" in block:
        assert len(list(read_trace(trace))) >= 2  # a row per sequence and generated token
    assert [p.name for p in tmp_path.iterdir()] == (["healthy.jsonl"] if "TraceWriter" in block else [])


def test_a_stock_model_without_routers_is_told_what_to_add_in_one_line(tmp_path, caplog):
    model = tiny_llama(layers=2, hidden_size=32)
    batch = torch.randint(2, 512, (1, 4))
    trace = TraceWriter(tmp_path / "t.jsonl", 1 << 20)
    observer = observe(model, read_attributes("router_score", "router_ran"), trace=trace, model_name="m")
    with observer:  # generate() is never broken by the observer: it warns and counts
        output = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=2)
    assert output.shape == (1, 6) and observer.rows == 0 and observer.dropped["adapter_error"] == 2
    message = next(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "\n" not in message and (
        "not published (adapter_error): ValueError: decoder layer 0 (LlamaDecoderLayer) has no tensor "
        "attribute 'router_score' after its forward" in message
    )
    assert "examples/router_llama.py, add_routers" in message and "docs/instrument.md" in message
