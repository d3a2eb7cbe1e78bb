"""The real pretrained model through the commands a user runs: the SmolLM2 folder `import-gguf` wrote
(tests/conftest.py, shared with the parity tests) served by `layerwatch serve` answering a sampled
chat completion over HTTP, and evaluated by `layerwatch eval` on a few hundred tokens of the KJV
(Debian's bible-kjv, as the demo model's corpus)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from layerwatch.cli.main import main
from layerwatch.demo.processes import ManagedProcess, free_port

# A real model predicts English prose: full-depth perplexity on the KJV is ~15 (15.6 measured
# over its held-out chapters); an import that scrambled the weights or the tokenizer lands in
# the hundreds or thousands (uniform over the vocabulary would be 49,152).
PLAUSIBLE_PERPLEXITY = 40.0


def test_serve_answers_a_sampled_chat_completion(real_model, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "layerwatch.cli.main", "serve", "--model", str(real_model.folder)]
    argv += ["--port", str(port), "--max-batch-size", "1", "--depth-execution", "rows"]
    argv += ["--exporter-address", f"127.0.0.1:{free_port()}"]
    process = ManagedProcess("serve", argv, tmp_path / "serve.log", env={"OMP_NUM_THREADS": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        process.wait_http(f"{base_url}/healthz", timeout=120)
        request = {
            "model": real_model.folder.name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0.8,
            "max_tokens": 16,
            "seed": 1,
        }
        response = httpx.post(f"{base_url}/v1/chat/completions", json=request, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        choice = answer["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"].strip()
        assert choice["finish_reason"] in ("stop", "length")
        # The chat template's prompt: its default system message and the question, ~30 tokens.
        assert 25 <= answer["usage"]["prompt_tokens"] <= 40
        assert 1 <= answer["usage"]["completion_tokens"] <= 16
    finally:
        process.stop()
    log = process.log_path.read_text()
    # The tokenizer's byte-level alphabet misses 21 bytes (docs/model.md, "A real model"): serve says so.
    assert "this tokenizer may drop or merge characters" in log


@pytest.mark.skipif(shutil.which("bible") is None, reason="needs the Debian package bible-kjv")
def test_eval_measures_a_plausible_perplexity(real_model, tmp_path, capsys):
    text = tmp_path / "genesis.txt"
    verses = subprocess.run(["bible", "-f", "Ge1:1-Ge1:12"], capture_output=True, text=True, check=True).stdout
    text.write_text("\n".join(line.split(" ", 1)[1] for line in verses.splitlines() if " " in line) + "\n")
    argv = ["eval", "--model", str(real_model.folder), "--data", str(text), "--max-tokens", "48", "--window", "40"]
    argv += ["--prefill", "16", "--repeats", "1", "--batch-size", "2", "--threads", "1", "--depth-execution", "rows"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["decoded_tokens"] >= 48
    assert 1.0 < report["perplexity_full"] < PLAUSIBLE_PERPLEXITY
    assert len(report["per_layer_skip_rate"]) == 30
