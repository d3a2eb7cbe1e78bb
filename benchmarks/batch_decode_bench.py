"""Batched decode benchmark: does skipping pay at batch > 1, with the skip patterns real gates produce?

    .venv/bin/python benchmarks/batch_decode_bench.py [--batches 1,4,8,16] [--steps 48] [--repeats 5]

The skip patterns are real: the embedded demo model decodes its held-out text teacher-forced at its
own τ (inference_shim/offline/evaluation.py, the engine's step semantics), and every step's per-row
run mask is recorded. Those masks are then replayed, row by row and step by step, on random models
of 12 × 512 and 16 × 1024 (layer l of a 12-layer model takes the demo's layer at the same relative
depth), through `Transformer.decode_step` with both KV policies. Rows skip different layers, as they
do in a served batch, so this measures what row-partial skipping costs.

Per model, batch size and KV policy, three configurations run interleaved, `--repeats` times, on one
torch thread, timed by the process CPU clock (the machine may be shared):
  full   the model without gates, every layer for every row;
  τ = 0  gates attached, every layer runs (the gated baseline: what skipping is measured against);
  gated  gates attached, the recorded masks;
  consensus  the recorded masks merged per step by serve's --batch-consensus rule (q = 0.5): only
         whole-batch skips (its quality cost: `layerwatch eval --batch-consensus 0.5`).
Printed: gated ÷ full tokens/s (goal ≥ 1 when ≥ 25 % of row-layer evaluations are skipped), and
realised ÷ ideal, with ideal = 1 / (1 − f·w): f the skipped share of row-layer evaluations (a CPU
computes rows, so every skipped row saves its work) and w the share of a τ = 0 step spent in
attention + FFN, measured per batch size by a per-layer profile. The whole-batch column gives f for
skips every row shares (the only ones that save weight reads on a memory-bound GPU).
Results go into docs/performance.md ("Decode at batch > 1").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bench import build_model, skippable_spans
from inference_shim.offline.corpus import read_bible, split_chapters, split_heldout, write_corpus
from inference_shim.offline.evaluation import DecodeStep, heldout_windows, teacher_forced_decode
from inference_shim.offline.gated_model import load_gated_model
from inference_shim.offline.training import text_file_stream
from inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from inference_shim.runtime.model import KV_POLICIES, GateBank, KVCache, Transformer
from inference_shim.runtime.skip_policy import consensus_mask

PROMPT_TOKENS = 16
CONSENSUS = 0.5
MODELS = ((12, 512), (16, 1024))  # (layers, d)


def demo_run_masks(rows: int, steps: int) -> np.ndarray:
    """bool [steps, rows, 16]: the demo model's run masks on `rows` held-out windows at its own τ."""
    gated = load_gated_model(DEMO_MODEL_DIR)
    with tempfile.TemporaryDirectory() as folder:
        _, heldout = write_corpus(split_heldout(split_chapters(read_bible())), Path(folder))
        stream = text_file_stream(gated.loaded.tokenizer, heldout, min_tokens=rows * (steps + PROMPT_TOKENS + 1))
    windows = heldout_windows(stream, steps + PROMPT_TOKENS + 1, rows * steps, PROMPT_TOKENS)[:rows]
    gated.model.attach_gates(gated.gates.gates)
    masks: list[np.ndarray] = []

    def record(step: DecodeStep) -> None:
        masks.append(~step.skipped)

    policy = gated.policy()
    teacher_forced_decode(gated.model, windows, PROMPT_TOKENS, policy, batch_size=rows, on_step=record)
    return np.stack(masks)[:steps]


def for_depth(masks: np.ndarray, layers: int) -> np.ndarray:
    """The masks of a model with `layers` layers: each takes the demo layer at its relative depth."""
    source = masks.shape[2]
    picks = np.round(np.arange(layers) * (source - 1) / (layers - 1)).astype(int)
    return masks[:, :, picks]


def decode_run(model: Transformer, masks: np.ndarray | None, batch: int, steps: int, kv_policy: str) -> float:
    """CPU seconds of `steps` decode steps of `batch` rows (masks [steps, batch, L] or None), after a
    full-depth prompt per row."""
    config = model.config
    cache = KVCache(config, slots=batch, max_len=PROMPT_TOKENS + steps + 1, dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, config.vocab_size, (batch, PROMPT_TOKENS), generator=generator)
    for slot in range(batch):
        model.prefill(prompts[slot], cache, slot)
    tokens = prompts[:, -1]
    slots = list(range(batch))
    started = time.process_time()
    for step in range(steps):
        positions = [PROMPT_TOKENS + step] * batch
        logits, _ = model.decode_step(
            tokens, cache, slots, positions, None if masks is None else masks[step], kv_policy
        )
        tokens = logits.argmax(dim=-1)
    return time.process_time() - started


def skippable_share(model: Transformer, batch: int, steps: int) -> float:
    """w at this batch size: the share of a τ = 0 decode step spent in what a skip removes
    (decode_bench.skippable_spans); one thread, so the CPU clock measures it."""
    with skippable_spans(model, time.process_time) as (starts, ends):
        total = decode_run(model, None, batch, steps, "project")
    # The prefill also passes the hooks: only the decode steps' last `steps * L` spans count.
    spans = steps * len(model.layers)
    return sum(e - s for s, e in zip(starts[-spans:], ends[-spans:])) / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,16", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions per configuration")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(1)

    recorded = demo_run_masks(max(batches), args.steps)
    print(
        f"demo model's run masks: {recorded.shape[1]} rows x {recorded.shape[0]} steps, "
        f"{1 - recorded.mean():.1%} of row-layer evaluations skipped"
    )
    print(
        "| model | batch | KV | skipped | whole-batch | w | full tok/s | gated tok/s | gated / full | "
        f"realised / ideal | consensus {CONSENSUS:g}: skipped | gated / full |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layers, hidden in MODELS:
        model = build_model(layers, hidden, vocab=8192)
        torch.manual_seed(1)
        gates = GateBank(layers, hidden).eval()
        masks_all = for_depth(recorded, layers)
        for batch in batches:
            masks = masks_all[:, :batch]
            no_fallback = np.zeros(batch, dtype=bool)
            merged = np.stack([consensus_mask(step, CONSENSUS, no_fallback) for step in masks])
            f = 1 - masks.mean()
            f_whole = float((~masks).all(axis=1).mean())
            model.attach_gates(gates)
            w = skippable_share(model, batch, args.steps)
            for kv_policy in KV_POLICIES:
                runs = (
                    ("full", None, None),
                    ("tau0", gates, None),
                    ("gated", gates, masks),
                    ("consensus", gates, merged),
                )
                seconds: dict[str, list[float]] = {name: [] for name, *_ in runs}
                for _ in range(args.repeats):  # interleaved: a slow spell hits every configuration
                    for name, bank, run_masks in runs:
                        model.attach_gates(bank)
                        seconds[name].append(decode_run(model, run_masks, batch, args.steps, kv_policy))
                rate = {name: batch * args.steps / statistics.median(values) for name, values in seconds.items()}
                speedup, ideal = rate["gated"] / rate["tau0"], 1 / (1 - f * w)
                print(
                    f"| {layers} x {hidden} | {batch} | {kv_policy} | {f:.1%} | {f_whole:.1%} | {w:.2f} | "
                    f"{rate['full']:.0f} | {rate['gated']:.0f} | {rate['gated'] / rate['full']:.3f} | "
                    f"{speedup / ideal:.3f} | {1 - merged.mean():.1%} | {rate['consensus'] / rate['full']:.3f} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
