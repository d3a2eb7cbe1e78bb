"""layerwatch's engine at full depth against Hugging Face transformers' `generate`, on one checkpoint.

    .venv/bin/python benchmarks/transformers_compare.py [--shapes 12x512,16x128,16x1024] [--tokens 128]

For each shape (layers x d) a random Llama checkpoint is written once (`save_checkpoint`, which
transformers loads as LlamaForCausalLM), then both generate greedily from the same prompt at batch 1,
fp32, one torch thread: transformers' `generate` (its KV cache) and our `GenerationEngine` without
gates. The generated token ids are asserted identical, so both did the same work. Timing is the
process CPU clock, the two interleaved `--repeats` times; printed: tokens per CPU second of each and
their ratio (ours ÷ transformers, > 1 = faster), median and range. Results go into
docs/performance.md ("Against transformers").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bench import bench_tokenizer, build_model
from inference_shim.runtime.checkpoint import load_checkpoint, save_checkpoint
from inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.skip_policy import SkipPolicyConfig

VOCAB = 8192
PROMPT = list(range(1, 17))


def ours(loaded, tokens: int) -> tuple[float, list[int]]:
    engine = GenerationEngine(
        loaded.model,
        loaded.tokenizer,
        model_name="bench",
        policy=SkipPolicyConfig(threshold=0.0),  # no gates attached: nothing is scored or skipped
        max_batch_size=1,
        max_seq_len=len(PROMPT) + tokens + 1,
    )
    started = time.process_time()
    # build_model sets no EOS token: every generation runs its full length.
    result = engine.generate(PROMPT, SamplingParams(max_tokens=tokens, temperature=0.0))
    return time.process_time() - started, list(result.token_ids)


def theirs(model, tokens: int) -> tuple[float, list[int]]:
    prompt = torch.tensor([PROMPT])
    started = time.process_time()
    with torch.no_grad():
        output = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return time.process_time() - started, output[0, len(PROMPT) :].tolist()


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="12x512,16x128,16x1024", help="comma-separated LAYERSxD")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; batch 1, greedy, fp32, one thread")
    print("| layers x d | tokens | ours tok/CPU-s | transformers tok/CPU-s | ours / transformers (range) |")
    print("|---|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        layers, hidden = (int(v) for v in shape.split("x"))
        with tempfile.TemporaryDirectory() as folder:
            save_checkpoint(build_model(layers, hidden, VOCAB), bench_tokenizer(VOCAB), folder)
            loaded = load_checkpoint(folder)
            reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ratios, our_rates, their_rates = [], [], []
        for _ in range(args.repeats):
            our_seconds, our_tokens = ours(loaded, args.tokens)
            their_seconds, their_tokens = theirs(reference, args.tokens)
            if our_tokens != their_tokens:
                raise SystemExit(f"{shape}: the generated tokens differ; the comparison would be meaningless")
            our_rates.append(args.tokens / our_seconds)
            their_rates.append(args.tokens / their_seconds)
            ratios.append(their_seconds / our_seconds)
        print(
            f"| {shape} | {args.tokens} | {statistics.median(our_rates):.0f} | {statistics.median(their_rates):.0f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
