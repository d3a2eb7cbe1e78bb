"""Prompt scoring (echo + logprobs): what it costs, and what it does to the requests beside it.

    .venv/bin/python benchmarks/prompt_scoring.py [--prompt-tokens 512] [--victim-tokens 64] [--repeats 5]

The embedded demo model at its gates' own τ, through the real `GenerationEngine` (batch up to 4),
one torch thread, held-out KJV text as prompts. Printed, medians over `--repeats` interleaved runs:
  cost       ms per prompt token of scoring a prompt (one gated decode step per token after the
             first: what the API does now), of a full-depth forward with every position's logits
             (what prompt log-probabilities cost when they came from the prefill), and ms per
             token of generating as many tokens;
  neighbour  a short generation's (the victim's: 16-token prompt) time to its first token and its
             median inter-token latency: alone, submitted together with a long generation, and
             submitted together with a scored prompt of `--prompt-tokens`.
Results go into docs/performance.md ("Prompt scoring").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.inference_shim.offline.corpus import read_bible, split_chapters, split_heldout, write_corpus
from layerwatch.inference_shim.offline.gated_model import GatedModel, load_gated_model
from layerwatch.inference_shim.offline.training import text_file_stream
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams, token_logprobs

VICTIM_PROMPT = 16


def engine_for(gated: GatedModel) -> GenerationEngine:
    policy = gated.policy()
    return GenerationEngine(gated.model, gated.loaded.tokenizer, model_name="demo", policy=policy, max_batch_size=4)


def run_until_done(engine: GenerationEngine, sequence: int) -> list[float]:
    """Step until `sequence` finishes; -> the time of each of its generated tokens (or of its end)."""
    times, done = [], False
    while not done:
        for update in engine.step():
            if update.sequence_id == sequence:
                now = time.perf_counter()
                times += [now] * max(1, len(update.new_token_ids))
                done = update.finished
    return times


def scoring_ms(gated: GatedModel, prompt: list[int]) -> float:
    engine = engine_for(gated)
    started = time.perf_counter()
    run_until_done(engine, engine.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1)))
    return 1000 * (time.perf_counter() - started) / (len(prompt) - 1)


def forward_ms(gated: GatedModel, prompt: list[int]) -> float:
    tokens = torch.tensor([prompt])
    started = time.perf_counter()
    with torch.inference_mode():
        logits, _ = gated.model(tokens)
        token_logprobs(logits[0, :-1], tokens[0, 1:], [1] * (len(prompt) - 1))
    return 1000 * (time.perf_counter() - started) / (len(prompt) - 1)


def generation_ms(gated: GatedModel, prompt: list[int]) -> float:
    engine = engine_for(gated)
    params = SamplingParams(max_tokens=len(prompt) - 1, ignore_eos=True)
    times = run_until_done(engine, engine.submit(prompt[:VICTIM_PROMPT], params))
    return 1000 * (times[-1] - times[0]) / (len(times) - 1)  # per decode step after the first


def victim(
    gated: GatedModel, victim_prompt: list[int], tokens: int, neighbour: SamplingParams | None, prompt: list[int]
) -> tuple[float, float]:
    """-> (time to first token, median inter-token latency) of the victim, in ms."""
    engine = engine_for(gated)
    if neighbour is not None:
        engine.submit(prompt if neighbour.prompt_logprobs is not None else prompt[:VICTIM_PROMPT], neighbour)
    started = time.perf_counter()
    times = run_until_done(engine, engine.submit(victim_prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)))
    gaps = [b - a for a, b in zip(times, times[1:])]
    return 1000 * (times[0] - started), 1000 * statistics.median(gaps)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--victim-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gated = load_gated_model(DEMO_MODEL_DIR)
    gated.model.attach_gates(gated.gates.gates)
    with tempfile.TemporaryDirectory() as folder:
        _, heldout = write_corpus(split_heldout(split_chapters(read_bible())), Path(folder))
        stream = text_file_stream(gated.loaded.tokenizer, heldout, min_tokens=2 * args.prompt_tokens).tolist()
    prompt, victim_prompt = stream[: args.prompt_tokens], stream[args.prompt_tokens :][:VICTIM_PROMPT]
    neighbours = {
        "alone": None,
        f"beside a {args.prompt_tokens}-token generation": SamplingParams(
            max_tokens=args.prompt_tokens, ignore_eos=True
        ),
        f"beside a scored {args.prompt_tokens}-token prompt": SamplingParams(max_tokens=0, prompt_logprobs=1),
    }
    costs: dict[str, list[float]] = {"scoring": [], "full-depth forward": [], "generating": []}
    latencies: dict[str, list[tuple[float, float]]] = {name: [] for name in neighbours}
    for _ in range(args.repeats):
        costs["scoring"].append(scoring_ms(gated, prompt))
        costs["full-depth forward"].append(forward_ms(gated, prompt))
        costs["generating"].append(generation_ms(gated, prompt))
        for name, neighbour in neighbours.items():
            latencies[name].append(victim(gated, victim_prompt, args.victim_tokens, neighbour, prompt))
    print(f"demo model, τ = {gated.gates.metadata.threshold:g}, {args.repeats} repeats, medians")
    print(f"cost per token of a {args.prompt_tokens}-token prompt:")
    for name, values in costs.items():
        print(f"  {name:20s} {statistics.median(values):8.3f} ms/token")
    print(f"a {args.victim_tokens}-token generation (the victim):")
    for name, pairs in latencies.items():
        ttft = statistics.median(first for first, _ in pairs)
        itl = statistics.median(gap for _, gap in pairs)
        print(f"  {name:40s} first token {ttft:7.2f} ms, inter-token {itl:6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
