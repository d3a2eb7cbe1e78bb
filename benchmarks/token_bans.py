"""Token-ban benchmark: what vLLM's `bad_words` and `allowed_token_ids` cost a decode step, in one run.

    .venv/bin/python benchmarks/token_bans.py                  # the demo model if trained, else random
    .venv/bin/python benchmarks/token_bans.py --model DIR      # any checkpoint folder (gates optional)

Drives the real GenerationEngine with `--batch` sequences (`--temperature`, default 0.8; 0 is
greedy) three ways:
"plain" (no bans: the engine's own path), "bad_words" (every row bans the tokenizations of a few
words, as `/v1/completions` turns `bad_words` into token sequences, one- and two-token ones) and
"allowed" (every row draws only from half the vocabulary). Interleaved repetitions (rotating the
order) so that machine noise hits all alike; prints decode tokens/s of each and the ratio to
plain: the median over repetitions of the ratio of adjacent runs, and its spread. The bans' rows
take the engine's per-row sampling path (their logits are adjusted on the device): a sampled row
takes it anyway, a greedy one otherwise shares the batch's one argmax, so greedy rows pay for the
path as well as for the masks. Results: docs/performance.md, "Token bans".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_bench import load_model, random_model
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, demo_model_present
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.inference_shim.runtime.model import Transformer
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.inference_shim.service.prompts import bad_word_ids
from layerwatch.skip_policy import SkipPolicyConfig

BAD_WORDS = (" the", " and", "light", " God said", " unto them")
MODES = ("plain", "bad_words", "allowed")


def params_for(mode: str, tokenizer: Tokenizer, vocab: int, tokens: int, temperature: float) -> SamplingParams:
    base = SamplingParams(max_tokens=tokens, temperature=temperature, seed=1, ignore_eos=True)
    if mode == "bad_words":
        base.bad_words = bad_word_ids(tokenizer, BAD_WORDS)
    elif mode == "allowed":
        base.allowed_token_ids = tuple(range(0, vocab, 2))
    return base


def decode_run(
    model: Transformer, tokenizer: Tokenizer, mode: str, batch: int, tokens: int, prompt: list[int], temperature: float
) -> float:
    """Decode tokens per second of `batch` sequences of `tokens` tokens each."""
    engine = GenerationEngine(
        model,
        tokenizer,
        model_name="bench",
        policy=SkipPolicyConfig(),
        max_batch_size=batch,
        max_seq_len=len(prompt) + tokens + 1,
    )
    for _ in range(batch):
        engine.submit(prompt, params_for(mode, tokenizer, model.config.vocab_size, tokens, temperature))
    engine.step()  # admission (prefill) and the first step are outside the timed part
    started, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    return steps * batch / (time.perf_counter() - started)


def sampling_cost(
    model: Transformer, tokenizer: Tokenizer, mode: str, batch: int, prompt: list[int], temperature: float
) -> float:
    """Median seconds of the engine's token choice (`_sample`) for one step of `batch` rows that have
    generated 16 tokens: what the bans add to a step, apart from the model's own work."""
    engine = GenerationEngine(model, tokenizer, model_name="bench", policy=SkipPolicyConfig(), max_batch_size=batch)
    for _ in range(batch):
        engine.submit(prompt, params_for(mode, tokenizer, model.config.vocab_size, 64, temperature))
    for _ in range(17):
        engine.step()
    rows = [engine._active[slot] for slot in sorted(engine._active)]
    logits = torch.randn(batch, model.config.vocab_size)
    times = []
    for _ in range(200):
        started = time.perf_counter()
        engine._sample(logits, rows)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: the demo model)")
    parser.add_argument("--batch", type=int, default=8, help="concurrent sequences")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per sequence")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model or (DEMO_MODEL_DIR if demo_model_present() else None)
    if folder is not None:
        model, tokenizer = load_model(folder)
        described = f"checkpoint {folder}"
    else:
        model, tokenizer = random_model(12, 512, vocab=2048)
        described = "random model, 12 layers, d=512"
    prompt = tokenizer.encode("And God said, Let there be light: and there was light.")
    decode_run(model, tokenizer, "bad_words", args.batch, 8, prompt, args.temperature)  # warm-up
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repetition in range(args.repetitions):
        order = MODES[repetition % 3 :] + MODES[: repetition % 3]
        for mode in order:
            runs[mode].append(decode_run(model, tokenizer, mode, args.batch, args.tokens, prompt, args.temperature))
    print(
        f"{described}; batch {args.batch}, temperature {args.temperature:g}, {args.tokens} tokens per sequence, "
        f"{args.repetitions} interleaved "
        f"repetitions, torch threads {args.threads}; bad words {BAD_WORDS} -> "
        f"{len(bad_word_ids(tokenizer, BAD_WORDS))} token sequences"
    )
    for mode in MODES:
        print(
            f"{mode:9}: median {statistics.median(runs[mode]):7.1f} tokens/s "
            f"(runs {', '.join(f'{v:.0f}' for v in runs[mode])})"
        )
    costs = {mode: sampling_cost(model, tokenizer, mode, args.batch, prompt, args.temperature) for mode in MODES}
    print(
        "choosing the tokens of one step (median of 200): "
        + ", ".join(f"{mode} {costs[mode] * 1e6:.0f} us" for mode in MODES)
        + f"; {(costs['bad_words'] - costs['plain']) / args.batch * 1e6:.0f} us more per bad_words row, "
        f"{(costs['allowed'] - costs['plain']) / args.batch * 1e6:.0f} us per allowed_token_ids row"
    )
    for mode in MODES[1:]:
        ratios = sorted(banned / plain for banned, plain in zip(runs[mode], runs["plain"]))
        print(
            f"ratio {mode}/plain: median of paired runs {statistics.median(ratios):.3f} "
            f"(spread {ratios[0]:.3f}-{ratios[-1]:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
