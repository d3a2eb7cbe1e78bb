"""layerwatch's engine at full depth against Hugging Face transformers' `generate`, on one checkpoint.

    .venv/bin/python benchmarks/transformers_compare.py [--shapes 12x512,16x128,16x1024] [--tokens 128]
    .venv/bin/python benchmarks/transformers_compare.py --model DIR [--reference HF_DIR]

For each shape (layers x d) a random Llama checkpoint is written once (`save_checkpoint`, which
transformers loads as LlamaForCausalLM); or, with `--model`, a real checkpoint folder (e.g. one
`layerwatch import-gguf` wrote), which transformers loads from `--reference` (default: the same
folder), prompted with PROMPT_TEXT. Then both generate greedily from the same prompt at batch 1,
fp32, one torch thread, through any end-of-sequence token: transformers' `generate` (its KV cache)
and our `GenerationEngine` without gates. The generated token ids are asserted identical, so both
did the same work. Timing is the process CPU clock, the two interleaved `--repeats` times; printed:
tokens per CPU second of each and their ratio (ours ÷ transformers, > 1 = faster), median and range.
Results go into docs/performance.md ("Against transformers").
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
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint, save_checkpoint
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.skip_policy import SkipPolicyConfig

VOCAB = 8192
PROMPT = list(range(1, 17))
PROMPT_TEXT = "The history of the printing press begins"  # a real model's prompt (--model)


def ours(loaded, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    engine = GenerationEngine(
        loaded.model,
        loaded.tokenizer,
        model_name="bench",
        policy=SkipPolicyConfig(threshold=0.0),  # no gates attached: nothing is scored or skipped
        max_batch_size=1,
        max_seq_len=len(prompt) + tokens + 1,
    )
    started = time.process_time()
    result = engine.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return time.process_time() - started, list(result.token_ids)


def theirs(model, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
    prompt = torch.tensor([prompt_ids])
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
    return time.process_time() - started, output[0, len(prompt_ids) :].tolist()


def compare(name: str, loaded, reference, prompt: list[int], tokens: int, repeats: int) -> str:
    """Both interleaved `repeats` times -> the table row."""
    ratios, our_rates, their_rates = [], [], []
    for _ in range(repeats):
        our_seconds, our_tokens = ours(loaded, prompt, tokens)
        their_seconds, their_tokens = theirs(reference, prompt, tokens)
        if our_tokens != their_tokens:
            raise SystemExit(f"{name}: the generated tokens differ; the comparison would be meaningless")
        our_rates.append(tokens / our_seconds)
        their_rates.append(tokens / their_seconds)
        ratios.append(their_seconds / our_seconds)
    return (
        f"| {name} | {tokens} | {statistics.median(our_rates):.1f} | {statistics.median(their_rates):.1f} | "
        f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="12x512,16x128,16x1024", help="comma-separated LAYERSxD")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", type=Path, help="a real checkpoint folder instead of the random shapes")
    parser.add_argument("--reference", type=Path, help="the folder transformers loads (default: --model)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; batch 1, greedy, fp32, one thread")
    print("| layers x d | tokens | ours tok/CPU-s | transformers tok/CPU-s | ours / transformers (range) |")
    print("|---|---:|---:|---:|---:|")
    if args.model is not None:
        loaded = load_checkpoint(args.model)
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            args.reference or args.model, dtype=torch.float32
        ).eval()
        prompt = loaded.tokenizer.encode(PROMPT_TEXT)
        print(compare(args.model.name, loaded, reference, prompt, args.tokens, args.repeats))
        return 0
    for shape in args.shapes.split(","):
        layers, hidden = (int(v) for v in shape.split("x"))
        with tempfile.TemporaryDirectory() as folder:
            save_checkpoint(build_model(layers, hidden, VOCAB), bench_tokenizer(VOCAB), folder)
            loaded = load_checkpoint(folder)
            reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        print(compare(shape, loaded, reference, PROMPT, args.tokens, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
