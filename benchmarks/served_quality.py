"""What the gates cost as served: sampled chat traffic at batch 1 and 8, read from the shim's counters.

    .venv/bin/python benchmarks/served_quality.py --model DIR --thresholds 0.05,0.1,0.18
    .venv/bin/python benchmarks/served_quality.py --model DIR --batch-sizes 1 --requests 24 --depth-execution rows

For each threshold: starts `layerwatch serve --model DIR --shadow-rate 1 --max-batch-size B` with the
model's own gates (or --gates) and the depth execution asked for (serve's default: auto), accepting
the threshold per request (`--request-threshold-range`), and sends `--requests` chat requests: lines
of layerwatch/alerts/profiles/chat-messages.txt (the calibration's), each one user message through the
model's chat template, sampled at temperature 1.0 and 0.7 in turn, `--max-tokens` 48, B at a time
for each batch size B of `--batch-sizes`. Every gated request is shadow-checked against the full
depth once the engine is idle; the counters the quality alerts read (layerwatch_shadow_*) and the
skip counters (decided: layerwatch_layer_skips_total; executed: layerwatch_layer_skips_executed_total)
are read from /metrics as the difference over each phase. Prints one row per (threshold, batch):
skip shares, checked tokens, agreement, KL(gated || full) per token and the estimated perplexity
increase, and the verdict of the profile's limits (`--profile`, default the model's committed one).

Threshold 0 runs at full depth: nothing is skipped, and the shim checks nothing (there is nothing
gated to compare), so its quality figures are absent, not measured.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from layerwatch.alerts.profile_file import PROFILES_DIR, load_profile
from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.inference_shim.service.depth import REQUEST_FIELD
from tests.support import sample_sum, scrape

LAYERWATCH = [sys.executable, "-m", "layerwatch.cli.main"]
CHAT_MESSAGES = PROFILES_DIR / "chat-messages.txt"
TEMPERATURES = (1.0, 0.7)
SHADOW_COUNTERS = ("tokens", "agreements", "kl_nats", "reverse_kl_nats")


def chat(base_url: str, model: str, message: str, temperature: float, seed: int, max_tokens: int, tau: float) -> None:
    request = {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "temperature": temperature,
        "max_tokens": max_tokens,
        "seed": seed,
        REQUEST_FIELD: tau,
    }
    response = httpx.post(f"{base_url}/v1/chat/completions", json=request, timeout=600)
    response.raise_for_status()


def counters(base_url: str) -> dict[str, float]:
    samples = scrape(base_url)
    figures = {name: sample_sum(samples, f"layerwatch_shadow_{name}_total") for name in SHADOW_COUNTERS}
    figures["checked"] = sample_sum(samples, "layerwatch_shadow_requests_total")
    figures["evaluations"] = sample_sum(samples, "layerwatch_layer_evaluations_total")
    figures["skips"] = sample_sum(samples, "layerwatch_layer_skips_total")
    figures["skips_executed"] = sample_sum(samples, "layerwatch_layer_skips_executed_total")
    return figures


def phase(base_url: str, model: str, messages: list[str], batch: int, tau: float, max_tokens: int) -> dict[str, float]:
    """Send the messages `batch` at a time; wait for their shadow checks; the counters' increase."""
    before = counters(base_url)
    with ThreadPoolExecutor(max_workers=batch) as pool:
        temperatures = itertools.cycle(TEMPERATURES)
        jobs = [
            pool.submit(chat, base_url, model, message, next(temperatures), seed, max_tokens, tau)
            for seed, message in enumerate(messages)
        ]
        for job in jobs:
            job.result()
    expected = len(messages) if tau > 0 else 0
    deadline = time.monotonic() + 600
    while counters(base_url)["checked"] - before["checked"] < expected:  # every outcome counts once
        if time.monotonic() > deadline:
            raise SystemExit("the shadow checks did not finish within 600 s")
        time.sleep(0.5)
    after = counters(base_url)
    return {name: after[name] - before[name] for name in after}


def row(tau: float, batch: int, mode: str, figures: dict[str, float], profile) -> str:
    decided = figures["skips"] / max(figures["evaluations"], 1)
    executed = figures["skips_executed"] / max(figures["evaluations"], 1)
    tokens = figures["tokens"]
    if tokens == 0:
        return (
            f"| {tau:g} | {batch} | {mode} | {decided:.1%} | {executed:.1%} | 0 | - | - | - | no check (full depth) |"
        )
    agreement = figures["agreements"] / tokens
    kl = figures["kl_nats"] / tokens
    perplexity = math.expm1(figures["reverse_kl_nats"] / tokens)
    pages = []
    if agreement < profile.shadow_agreement_min:
        pages.append(f"agreement below {profile.shadow_agreement_min}")
    if kl > profile.shadow_kl_nats_max:
        pages.append(f"cost above {profile.shadow_kl_nats_max}")
    verdict = "; ".join(pages) or "within the profile"
    return (
        f"| {tau:g} | {batch} | {mode} | {decided:.1%} | {executed:.1%} | {tokens:.0f} | {agreement:.3f} | "
        f"{kl:.4f} | {perplexity:+.1%} | {verdict} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", type=Path, required=True, help="the checkpoint folder (named as its profile)")
    parser.add_argument("--gates", type=Path, default=None, help="gate file (default: the folder's own)")
    parser.add_argument("--thresholds", default="0.18", help="comma-separated taus, sent per request")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--requests", type=int, default=24, help="chat requests per (threshold, batch)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--depth-execution", default="auto", choices=("auto", "rows", "batch"))
    parser.add_argument("--profile", type=Path, default=None, help="default: profiles/<folder name>.yaml")
    args = parser.parse_args()
    thresholds = [float(t) for t in args.thresholds.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    profile = load_profile(args.profile or PROFILES_DIR / f"{args.model.name}.yaml")
    messages = [line for line in CHAT_MESSAGES.read_text().splitlines() if line.strip()][: args.requests]
    port = free_port()
    argv = [*LAYERWATCH, "serve", "--model", str(args.model), "--port", str(port), "--shadow-rate", "1"]
    argv += ["--max-batch-size", str(max(batches)), "--depth-execution", args.depth_execution]
    argv += ["--request-threshold-range", f"0:{max(thresholds)}", "--exporter-address", f"127.0.0.1:{free_port()}"]
    argv += ["--gates", str(args.gates)] if args.gates else []
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as workdir:
        server = ManagedProcess("serve", argv, Path(workdir) / "serve.log")
        try:
            server.wait_http(f"{base_url}/readyz", timeout=300)
            print(f"{len(messages)} chat requests of {args.max_tokens} tokens per row, temperature 1.0/0.7,")
            print(f"depth execution {args.depth_execution}; limits of {profile.model_name}'s profile:")
            print(
                "| τ | batch | mode | decided skips | executed skips | checked tokens | agreement | "
                "nats/token | est. perplexity | verdict |"
            )
            print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
            for tau, batch in itertools.product(thresholds, batches):
                started = time.monotonic()
                figures = phase(base_url, args.model.name, messages, batch, tau, args.max_tokens)
                print(row(tau, batch, args.depth_execution, figures, profile), f"{time.monotonic() - started:.0f} s")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
