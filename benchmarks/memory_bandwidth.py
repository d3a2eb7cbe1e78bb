"""The physical limit of batch-1 decoding on this machine: weight bytes read per token over memory bandwidth.

    .venv/bin/python benchmarks/memory_bandwidth.py [--model DIR] [--threads 1]

A batch-1 decode step reads every weight it uses once (the LM head whole, the embedding one row),
far more than the caches hold, so no step can be faster than those bytes over the rate one thread
streams memory. The rate is measured here as the simplest read there is: `sum` over a 1 GiB float32
tensor in transparent huge pages (as the model's weights are, model.py's `weight_storage`), best and
median of `--repeats`, per CPU second. With `--model`, the bytes a step of that checkpoint reads at full depth, in
float32 and bfloat16, and the tokens per second they allow. Results: docs/performance.md
("SmolLM2-135M on one thread").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.model import Transformer, weight_storage

GIB = 1 << 30


def read_rates(nbytes: int, repeats: int) -> list[float]:
    """Bytes per CPU second of `sum` over an nbytes float32 tensor, once per repeat: the thread's
    clock, as the decoding benchmarks' tokens per CPU second (on a shared machine the wall clock
    also counts the neighbours)."""
    data = weight_storage((nbytes // 4,), torch.empty(0)).fill_(1.0)
    data.sum()  # the pages are touched and mapped before any timing
    rates = []
    for _ in range(repeats):
        started = time.thread_time()
        data.sum()
        rates.append(nbytes / (time.thread_time() - started))
    return rates


def weight_bytes_per_token(model: Transformer, bytes_per_value: int) -> int:
    """What a full-depth batch-1 step reads: every parameter once, but only one row of an untied embedding."""
    values = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if model.lm_head.weight is not model.embed_tokens.weight:
        values -= model.embed_tokens.weight.numel() - model.config.hidden_size
    return values * bytes_per_value


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint folder: its bytes per token and the limit")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rates = read_rates(GIB, args.repeats)
    best, median = max(rates), statistics.median(rates)
    print(f"read bandwidth, {args.threads} thread(s): best {best / 1e9:.1f} GB/s, median {median / 1e9:.1f} GB/s")
    if args.model is not None:
        model = load_checkpoint(args.model).model
        for name, size in (("float32", 4), ("bfloat16", 2)):
            nbytes = weight_bytes_per_token(model, size)
            print(
                f"{args.model.name}, {name}: {nbytes / 1e6:.0f} MB of weights per token -> at most "
                f"{best / nbytes:.1f} tokens/s (best bandwidth), {median / nbytes:.1f} (median)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
