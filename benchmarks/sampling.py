"""What one sampled token's draw costs on a real vocabulary: the engine's `sample_token` against the whole
vocabulary sorted and drawn by torch.multinomial (the draw `sample_token` avoids).

    .venv/bin/python benchmarks/sampling.py --model DIR --data TEXT [--positions 256] [--top-p 1,0.95,0.9]

The model's own next-token logits at `--positions` positions of the text (one forward pass), each drawn
once per top_p at temperature 1 on one torch thread, both ways in turn; prints the milliseconds per
draw and the share of positions whose nucleus lay beyond the NUCLEUS_CANDIDATES most likely tokens (those
are sorted whole). Results: docs/performance.md, "Sampling".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.engine import FLOAT32_TINY, NUCLEUS_CANDIDATES, sample_token


def sorted_whole(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """The reference: the nucleus cut from the whole vocabulary sorted, drawn by torch.multinomial."""
    logits = torch.nan_to_num(logits.float())
    probs = torch.softmax((logits - logits.max()) / max(temperature, FLOAT32_TINY), dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        outside[0] = False
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--data", type=Path, required=True, help="plain text whose positions give the logits")
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--top-p", default="1,0.95,0.9", help="comma-separated top_p values")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_checkpoint(args.model)
    ids = loaded.tokenizer.encode(args.data.read_text(encoding="utf-8"))[: args.positions]
    with torch.inference_mode():
        logits = loaded.model(torch.tensor(ids)[None])[0][0]
    print(f"{args.model}: vocabulary {logits.shape[-1]}, {len(ids)} positions, one thread")
    generator = torch.Generator().manual_seed(0)
    for top_p in (float(p) for p in args.top_p.split(",")):
        probs = torch.softmax(logits.float(), dim=-1)
        beyond = (probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1])).values.sum(-1) < top_p).float().mean()
        timings = {}
        for name, draw in (("sorted whole + multinomial", sorted_whole), ("sample_token", sample_token)):
            started = time.perf_counter()
            for row in logits:
                draw(row, 1.0, top_p, generator)
            timings[name] = (time.perf_counter() - started) / len(logits) * 1e3
        cut = f"; nucleus beyond the top {NUCLEUS_CANDIDATES} at {beyond:.1%} of the positions" if top_p < 1 else ""
        costs = ", ".join(f"{name} {ms:.3f} ms" for name, ms in timings.items())
        print(f"top_p {top_p:g}: {costs} per draw{cut}")


if __name__ == "__main__":
    main()
