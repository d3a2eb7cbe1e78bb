"""The complexity pre-check: does running the most complex prompts at full depth buy back quality?

    .venv/bin/python benchmarks/depth_precheck.py [--window 128] [--prefill 32] [--max-tokens 12000] [--top 0.1]

The embedded demo model at its gates' own tau, on held-out KJV text cut into windows as `layerwatch
eval` cuts them: each window's first `--prefill` tokens are the prompt (prefilled at full depth),
the rest is decoded teacher-forced with the real skip semantics, once at full depth and once gated.
Each window's prompt is scored from its prefill alone, before any decode step, and the top `--top`
share of windows by score is counted at its full-depth loss (what `serve --complexity-cutoff` does
to those requests). Printed for each scorer: full, gated and pre-checked perplexity, the share of
the gated perplexity increase (in log-likelihood) the pre-check removes, and the score cut-off of
that top share; against the same for a random choice of windows (its mean and 5-95 % range over
1,000 draws), which is what a scorer unrelated to the damage removes.

Scorers: `complexity` is the shim's (layerwatch/complexity.py: share of the prompt's prefill gate
scores on skippable layers below tau); the others are the candidates it was chosen over: the
prompt's own full-depth log-perplexity, its mean gate score (low: the gates expect to skip), the
field's text heuristic (entity, nesting and term density: `text_heuristic`) and its length in characters.
Results go into docs/performance.md ("Complexity pre-check").
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layerwatch.complexity import prompt_complexity
from layerwatch.inference_shim.offline.corpus import read_bible, split_chapters, split_heldout, write_corpus
from layerwatch.inference_shim.offline.evaluation import DecodeStep, heldout_windows, teacher_forced_decode
from layerwatch.inference_shim.offline.gated_model import GatedModel, load_gated_model
from layerwatch.inference_shim.offline.training import text_file_stream
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.skip_policy import SkipPolicyConfig

BATCH = 8
RANDOM_DRAWS = 1000


def window_losses(gated: GatedModel, windows: torch.Tensor, prefill: int, policy: SkipPolicyConfig | None):
    """Each window's summed decode loss (nats) [N], at full depth (policy None) or gated."""
    model = gated.model
    model.attach_gates(None if policy is None else gated.gates.gates)
    sums, steps = [], []  # steps: the current batch's per-step losses [B]

    def keep(step: DecodeStep) -> None:
        steps.append(step.losses)

    for start in range(0, len(windows), BATCH):
        teacher_forced_decode(model, windows[start : start + BATCH], prefill, policy, batch_size=BATCH, on_step=keep)
        sums.append(np.sum(steps, axis=0, dtype=np.float64))
        steps.clear()
    model.attach_gates(gated.gates.gates)
    return np.concatenate(sums)


def text_heuristic(text: str) -> float:
    """The field's text scorer: the mean of entity density (capitalised words not opening a sentence),
    nesting (clause punctuation per word) and term density (words of 7 letters or more), each a
    share of the prompt's words (its cut-offs 0.3 / 0.7 split simple, medium and complex)."""
    words = re.findall(r"[A-Za-z']+|[.!?]", text)
    letters = [w for w in words if w[0].isalpha()]
    if not letters:
        return 0.0
    opens_sentence = [i == 0 or words[i - 1] in ".!?" for i in range(len(words))]
    entities = sum(w[0].isupper() and not first for w, first in zip(words, opens_sentence) if w[0].isalpha())
    nesting = min(1.0, len(re.findall(r"[,;:()]", text)) / len(letters))
    terms = sum(len(w) >= 7 for w in letters)
    return (entities / len(letters) + nesting + terms / len(letters)) / 3


def prompt_scores(gated: GatedModel, windows: torch.Tensor, prefill: int, threshold: float) -> dict[str, np.ndarray]:
    """What each scorer says about each window's prompt, from what the engine's prefill computes
    (the prompt but its last token, at full depth)."""
    model, tokenizer = gated.model, gated.loaded.tokenizer
    skippable = SkipPolicyConfig(threshold=threshold).skippable(model.config.num_layers)
    names = ("complexity", "prompt log-perplexity", "low mean gate score", "text heuristic", "length")
    scores: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for window in windows:
            context = window[: prefill - 1]
            logits, entropies = model(context[None])
            gate_scores = entropies[0].float().numpy()
            scores["complexity"].append(prompt_complexity(gate_scores, threshold, skippable))
            scores["prompt log-perplexity"].append(F.cross_entropy(logits[0, :-1], context[1:]).item())
            scores["low mean gate score"].append(-float(gate_scores[:, skippable].mean()))
            text = tokenizer.decode(window[:prefill].tolist())
            scores["text heuristic"].append(text_heuristic(text))
            scores["length"].append(len(text))
    return {name: np.array(values) for name, values in scores.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=32, help="prompt tokens per window")
    parser.add_argument("--max-tokens", type=int, default=12000, help="decoded tokens in all")
    parser.add_argument("--top", type=float, default=0.1, help="share of prompts run at full depth")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gated = load_gated_model(DEMO_MODEL_DIR)
    threshold = gated.gates.metadata.threshold
    with tempfile.TemporaryDirectory() as folder:
        _, heldout = write_corpus(split_heldout(split_chapters(read_bible())), Path(folder))
        stream = text_file_stream(gated.loaded.tokenizer, heldout, min_tokens=args.window)
    windows = heldout_windows(stream, args.window, args.max_tokens, args.prefill)
    policy = SkipPolicyConfig(threshold=threshold, patience=gated.patience)
    full = window_losses(gated, windows, args.prefill, None)
    gated_loss = window_losses(gated, windows, args.prefill, policy)
    scores = prompt_scores(gated, windows, args.prefill, threshold)

    tokens = len(windows) * (args.window - args.prefill)
    increase = gated_loss.sum() - full.sum()
    top = max(1, round(args.top * len(windows)))

    def perplexity(losses: np.ndarray) -> float:
        return math.exp(losses.sum() / tokens)

    def recovered(chosen: np.ndarray) -> tuple[float, float]:
        """(pre-checked perplexity, share of the increase removed) with `chosen` windows at full depth."""
        checked = gated_loss.copy()
        checked[chosen] = full[chosen]
        return perplexity(checked), float((gated_loss.sum() - checked.sum()) / increase)

    print(
        f"demo model, tau {threshold:g}, patience {gated.patience}: {len(windows)} held-out windows of "
        f"{args.window} tokens, prompts of {args.prefill}, {tokens} decoded tokens; top {top} prompts "
        f"({args.top:.0%}) at full depth"
    )
    print(
        f"perplexity full {perplexity(full):.3f}  gated {perplexity(gated_loss):.3f} "
        f"({perplexity(gated_loss) / perplexity(full) - 1:+.2%})"
    )
    print("| scorer | pre-checked perplexity | increase removed | cut-off (score of the top share) |")
    print("|---|---:|---:|---:|")
    for name, score in scores.items():
        chosen = np.argsort(-score, kind="stable")[:top]
        checked, share = recovered(chosen)
        print(f"| {name} | {checked:.3f} | {share:.1%} | {score[chosen].min():.3f} |")
    rng = np.random.default_rng(0)
    shares = [recovered(rng.choice(len(windows), top, replace=False))[1] for _ in range(RANDOM_DRAWS)]
    low, high = np.percentile(shares, [5, 95])
    print(f"| random {args.top:.0%} (mean, 5-95 %) | | {np.mean(shares):.1%} ({low:.1%} to {high:.1%}) | |")
    oracle = np.argsort(-(gated_loss - full), kind="stable")[:top]
    print(f"| the windows that lost most (hindsight) | {recovered(oracle)[0]:.3f} | {recovered(oracle)[1]:.1%} | |")


if __name__ == "__main__":
    main()
