"""The real pretrained model through the commands a user runs: the SmolLM2 folder `import-gguf` wrote
(tests/conftest.py, shared with the parity tests) served by `layerwatch serve` answering sampled chat
completions over HTTP, and evaluated by `layerwatch eval` on a few hundred tokens of the KJV
(Debian's bible-kjv, as the demo model's corpus).

The served model is also judged as its alerts judge it (issue 39): the shim's own counters, read from
/metrics, against the limits of its committed profile (layerwatch/alerts/profiles/smollm2-135m-instruct.yaml).
Served as shipped, one request at a time, it pages nothing; its gates opted in at tau 0.18 cost what
the quality pages fire on, one request at a time and at batch 8 with every decided skip executed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from layerwatch.alerts.profile_file import PROFILES_DIR, load_profile
from layerwatch.cli.main import main
from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.inference_shim.service.depth import REQUEST_FIELD
from tests.support import sample_sum, scrape, wait_for

# A real model predicts English prose: full-depth perplexity on the KJV is ~15 (15.6 measured
# over its held-out chapters); an import that scrambled the weights or the tokenizer lands in
# the hundreds or thousands (uniform over the vocabulary would be 49,152).
PLAUSIBLE_PERPLEXITY = 40.0


# The gates' own tau when a request opts in (what the shipped file recorded before it recorded 0).
OPT_IN_THRESHOLD = 0.18
PROFILE = PROFILES_DIR / "smollm2-135m-instruct.yaml"
CHAT_MESSAGES = PROFILES_DIR / "chat-messages.txt"


@dataclass(frozen=True)
class Served:
    base_url: str
    model: str
    process: ManagedProcess


@pytest.fixture(scope="module")
def served(real_model, tmp_path_factory) -> Iterator[Served]:
    """`serve` as shipped (the gate file's tau), every gated request shadow-checked, batches of up to 8
    with every decided skip executed (`rows`), and a per-request tau accepted so that one process
    serves the opted-in gates too."""
    port = free_port()
    argv = [sys.executable, "-m", "layerwatch.cli.main", "serve", "--model", str(real_model.folder)]
    argv += ["--port", str(port), "--max-batch-size", "8", "--depth-execution", "rows", "--shadow-rate", "1"]
    argv += ["--request-threshold-range", f"0:{OPT_IN_THRESHOLD}", "--exporter-address", f"127.0.0.1:{free_port()}"]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    process = ManagedProcess("serve", argv, log, env={"OMP_NUM_THREADS": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        process.wait_http(f"{base_url}/readyz", timeout=180)
        yield Served(base_url, real_model.folder.name, process)
    finally:
        process.stop()


def test_serve_answers_a_sampled_chat_completion(served):
    request = {
        "model": served.model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0.8,
        "max_tokens": 16,
        "seed": 1,
    }
    response = httpx.post(f"{served.base_url}/v1/chat/completions", json=request, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].strip()
    assert choice["finish_reason"] in ("stop", "length")
    # The chat template's prompt: its default system message and the question, ~30 tokens.
    assert 25 <= answer["usage"]["prompt_tokens"] <= 40
    assert 1 <= answer["usage"]["completion_tokens"] <= 16
    # The tokenizer's byte-level alphabet misses 21 bytes (docs/model.md, "A real model"): serve says so.
    assert "this tokenizer may drop or merge characters" in served.process.log_path.read_text()


def _chat(served: Served, message: str, seed: int, threshold: float | None) -> None:
    """One sampled chat request like the calibration's (temperature 1.0 and 0.7 in turn)."""
    request = {
        "model": served.model,
        "messages": [{"role": "user", "content": message}],
        "temperature": (1.0, 0.7)[seed % 2],
        "max_tokens": 24,
        "seed": seed,
    }
    if threshold is not None:
        request[REQUEST_FIELD] = threshold
    response = httpx.post(f"{served.base_url}/v1/chat/completions", json=request, timeout=300)
    assert response.status_code == 200, response.text


COUNTERS = {
    "tokens": "layerwatch_shadow_tokens_total",
    "agreements": "layerwatch_shadow_agreements_total",
    "kl_nats": "layerwatch_shadow_kl_nats_total",
    "sampled": "layerwatch_shadow_requests_total",
    "skips": "layerwatch_layer_skips_total",
    "executed_skips": "layerwatch_layer_skips_executed_total",
    "evaluations": "layerwatch_layer_evaluations_total",
}


def _phase(served: Served, threshold: float | None, concurrency: int, requests: int) -> dict[str, float]:
    """Send `requests` chat requests `concurrency` at a time; once every gated one is shadow-checked,
    the increase of the counters the quality and skip alerts read."""
    before = {name: sample_sum(scrape(served.base_url), metric) for name, metric in COUNTERS.items()}
    messages = [line for line in CHAT_MESSAGES.read_text().splitlines() if line.strip()][:requests]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for done in [pool.submit(_chat, served, m, seed, threshold) for seed, m in enumerate(messages)]:
            done.result()
    gated = threshold is not None and threshold > 0
    if gated:  # the shim checks each request once the engine idles
        wait_for(
            lambda: sample_sum(scrape(served.base_url), COUNTERS["sampled"]) - before["sampled"] >= requests,
            timeout=300,
            what=f"the shadow checks of {requests} requests",
        )
    after = {name: sample_sum(scrape(served.base_url), metric) for name, metric in COUNTERS.items()}
    return {name: after[name] - before[name] for name in COUNTERS}


def _pages(figures: dict[str, float]) -> list[str]:
    """The quality pages whose condition the phase's figures meet, by the profile's limits (absent
    figures, no checked token, meet none)."""
    profile = load_profile(PROFILE)
    tokens = figures["tokens"]
    if tokens == 0:
        return []
    pages = []
    if figures["agreements"] / tokens < profile.shadow_agreement_min:
        pages.append("LayerwatchShadowAgreementLow")
    if figures["kl_nats"] / tokens > profile.shadow_kl_nats_max:
        pages.append("LayerwatchShadowQualityCost")
    return pages


def test_served_as_shipped_one_request_at_a_time_pages_nothing(served):
    figures = _phase(served, None, concurrency=1, requests=4)
    # Every decided skip runs one request at a time: the shipped default skips none, so nothing is
    # lost to skipping and nothing is gated to check.
    assert figures["evaluations"] > 0 and figures["skips"] == figures["executed_skips"] == 0
    assert _pages(figures) == []


@pytest.mark.parametrize("concurrency", [1, 8])
def test_gates_opted_in_page_the_quality_alerts_one_at_a_time_and_at_batch_8(served, concurrency):
    # (their cost, about 0.3 nats per token one at a time, is thousands of times the limit: a few
    # requests tell; at batch 8, a batch's worth)
    figures = _phase(served, OPT_IN_THRESHOLD, concurrency=concurrency, requests=max(concurrency, 4))
    # `rows`: every row runs exactly what it decided, at batch 8 as at batch 1.
    assert figures["executed_skips"] == figures["skips"] > 0
    assert figures["tokens"] > 0
    assert _pages(figures) == ["LayerwatchShadowAgreementLow", "LayerwatchShadowQualityCost"], figures


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


def test_calibrate_refuses_the_baseline_the_previous_profile_was_made_from(real_model, tmp_path, capsys):
    """The SmolLM2 profile was once calibrated with its gates at tau 0.18, in batches of 8 under depth
    execution `auto`, where the batch runs the scattered skips whole (1.7 % of layer evaluations decided,
    0.0 % executed): it measured a model that does not skip. One request at a time every decided skip
    runs, and costs far past +10 % estimated perplexity: calibrate refuses that baseline in one line
    saying so, before its gate-importance passes."""
    out = tmp_path / "smollm2.yaml"
    traffic = ["--data", str(CHAT_MESSAGES), "--chat", "--temperature", "1.0", "--top-p", "1.0"]
    sizes = ["--prompts", "8", "--max-new-tokens", "24", "--chunk-tokens", "64", "--threads", "1"]
    argv = ["calibrate", "--model", str(real_model.folder), "--threshold", str(OPT_IN_THRESHOLD), "--out", str(out)]
    assert main([*argv, *traffic, *sizes]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: an unhealthy baseline, {out} not written: the gates cost +"), line
    assert "at batch 1, depth execution auto, consensus 0.5, past the +10% a healthy baseline may cost" in line
    assert not out.exists()
