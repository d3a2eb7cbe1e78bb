"""layerwatch's engine at full depth against llama.cpp on the same GGUF file (opt-in, not in the suite).

    .venv/bin/pip install llama-cpp-python          # builds llama.cpp from source (cmake, a C++ compiler)
    .venv/bin/python benchmarks/llamacpp_compare.py --gguf FILE.gguf --model DIR [--dtype D] [--quantization Q]

`--model` is the folder `layerwatch import-gguf FILE.gguf --out DIR` wrote from the same file (its
weights dequantized to floats); llama.cpp runs the file itself, in its own quantization. Both decode
PROMPT_TEXT greedily for `--tokens` new tokens through any end-of-sequence token, at batch 1 on
`--threads` threads, the two interleaved `--repeats` times; each generation's time includes its
prompt. Timing is the process CPU clock (both run in this process; it counts llama.cpp's threads
too); printed: tokens per CPU second of each and their ratio (llama.cpp ÷ layerwatch, how many
times faster llama.cpp is), median and range, and how many leading tokens the two generations share
(different number formats drift apart after a while; the work done is the same token count).

llama.cpp reads the prompt with `n_batch = n_ubatch = 1`, one token at a time: on an AMX CPU
(Sapphire Rapids) llama-cpp-python 0.3.36 crashed on its first completion with an 18-token prompt
at its default batch, and ran with these. Results go into docs/performance.md ("SmolLM2-135M on one
thread").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.transformers_compare import PROMPT_TEXT, ours
from layerwatch.inference_shim.runtime.checkpoint import DTYPES, load_precise
from layerwatch.inference_shim.runtime.quantization import QUANTIZATIONS


def theirs(llama, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    generated: list[int] = []
    started = time.process_time()
    # generate() yields greedy tokens (top_k 1) without stopping at end-of-sequence.
    for token in llama.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        generated.append(token)
        if len(generated) == tokens:
            break
    return time.process_time() - started, generated


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the GGUF file llama.cpp runs")
    parser.add_argument("--model", type=Path, required=True, help="the folder `layerwatch import-gguf` made of it")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="layerwatch's weights")
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="as serve takes it")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print(
            "llama-cpp-python is not installed, so there is nothing to compare with: "
            "`.venv/bin/pip install llama-cpp-python` (it builds llama.cpp from source, a few minutes) and rerun",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(args.threads)
    llama = llama_cpp.Llama(
        model_path=str(args.gguf),
        n_ctx=512,
        n_batch=1,
        n_ubatch=1,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    loaded = load_precise(args.model, "cpu", args.dtype, args.quantization)
    prompt = loaded.tokenizer.encode(PROMPT_TEXT)
    if len(prompt) + args.tokens > llama.n_ctx():
        raise SystemExit(f"--tokens {args.tokens} and the prompt do not fit llama.cpp's context of {llama.n_ctx()}")
    print(
        f"llama-cpp-python {llama_cpp.__version__}, torch {torch.__version__}; batch 1, greedy, "
        f"{args.threads} thread(s), {len(prompt)}-token prompt"
    )
    ratios, our_rates, their_rates, shared = [], [], [], []
    for _ in range(args.repeats):
        our_seconds, our_tokens = ours(loaded, prompt, args.tokens)
        their_seconds, their_tokens = theirs(llama, prompt, args.tokens)
        our_rates.append(args.tokens / our_seconds)
        their_rates.append(args.tokens / their_seconds)
        ratios.append(our_seconds / their_seconds)
        shared.append(shared_prefix(our_tokens, their_tokens))
    print(
        "| layerwatch | tokens | layerwatch tok/CPU-s | llama.cpp tok/CPU-s | llama.cpp ÷ layerwatch (range) "
        "| same first tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| {args.model.name}, {args.dtype}+{args.quantization} | {args.tokens} | {statistics.median(our_rates):.1f} | "
        f"{statistics.median(their_rates):.1f} | {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}–{max(ratios):.2f}) | {min(shared)} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
