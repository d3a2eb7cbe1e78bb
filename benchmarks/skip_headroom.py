"""How much layer skipping a model can afford, whatever its gates: hindsight policies, executed.

    .venv/bin/python benchmarks/skip_headroom.py --model DIR --data A.txt[,B.txt] [--max-tokens 896]
        [--counts 1,2,3] [--target-speedup 1.2]

Gates can at best find what the model offers. This asks the model itself, on held-out text framed as
`eval` frames it (windows of 128 tokens, the first 16 at full depth, the rest "decoded"; float32):

1. **Cost** of skipping layer l at token t: KL(full ‖ l skipped) of the next-token distribution at t,
   with l skipped over the whole window (one forward per skippable layer, as `train-gates --method
   importance` scores its windows).
2. **Three policies that know those costs in hindsight**, each run for real through the model's own
   forward (`update_scale` 0 on a skipped (token, layer): the hidden state passes through unchanged,
   K/V come from the layer's input as under the `project` KV policy), its perplexity measured:
   `static` skips the cheapest layers for every decoded token; `per token` the cheapest layers of
   each token; `pairs` the cheapest (token, layer) pairs of the whole text. No gate, streak rule or
   patience stands in their way, so a gated model that skips as much does not do better than the
   best of them, except by a better choice of pairs than hindsight costs taken one at a time give.
3. **What a share is worth in speed**: a batch-1 decode step reads every layer's weights and the LM
   head's; skipping a share f of layer evaluations saves at most f · w of them (w: the layers' share of
   the bytes a step reads), an ideal speed-up of 1 / (1 − f · w). Printed: w per precision the shim
   ships, and the share a `--target-speedup` needs with no overhead at all. The policies run at
   `--counts` layers skipped per decoded token (on average, for `pairs`) and at the count that
   share needs in each precision.
Printed: Markdown tables (docs/gate-training.md, "A real model").
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.precision_bench import weight_bytes
from layerwatch.argtypes import positive, positive_ints
from layerwatch.inference_shim.offline.evaluation import heldout_windows
from layerwatch.inference_shim.offline.training import CorpusError, text_file_stream
from layerwatch.inference_shim.runtime.checkpoint import CheckpointError, load_precise
from layerwatch.inference_shim.runtime.model import Transformer
from layerwatch.inference_shim.runtime.quantization import PrecisionError, quantize_model
from layerwatch.skip_policy import SkipPolicyConfig

WINDOW, PREFILL = 128, 16
QUANTIZED = ("int8", "int4")  # what the shim ships beside float32 (docs/performance.md)


@torch.no_grad()
def log_probs(model: Transformer, windows: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """windows [W, T] -> next-token log-probabilities [W, T, V]; keep [L, W, T] (1 runs the layer at
    that token, 0 skips it) or None: full depth."""
    scale = None if keep is None else (lambda layer, _x: keep[layer][..., None])
    return F.log_softmax(model(windows, update_scale=scale)[0], dim=-1)


def perplexity_increase(full: torch.Tensor, skipped: torch.Tensor, windows: torch.Tensor) -> float:
    """Perplexity of the decoded predictions (positions PREFILL-1 .. T-2) with skips over without."""
    targets = windows[:, PREFILL:, None]

    def nll(logp: torch.Tensor) -> float:
        return -logp[:, PREFILL - 1 : -1].gather(-1, targets).mean().item()

    return math.exp(nll(skipped) - nll(full)) - 1


@torch.no_grad()
def skip_costs(model: Transformer, windows: torch.Tensor, full: torch.Tensor, skippable: list[int]) -> torch.Tensor:
    """[L, W, T] KL(full ‖ layer skipped for the whole window) per token, in nats; +inf where no skip
    is allowed (protected layers, the prefill)."""
    layers = model.config.num_layers
    costs = torch.full((layers, *windows.shape), math.inf)
    for layer in skippable:
        keep = torch.ones(layers, *windows.shape)
        keep[layer] = 0
        skipped = log_probs(model, windows, keep)
        costs[layer] = (full.exp() * (full - skipped)).sum(-1)
    costs[:, :, :PREFILL] = math.inf
    return costs


def static_policy(costs: torch.Tensor, count: int) -> torch.Tensor:
    """keep [L, W, T]: the `count` layers cheapest on average skipped at every decoded token."""
    mean = costs[:, :, PREFILL:].mean((1, 2))  # +inf for the protected layers
    keep = torch.ones_like(costs)
    for layer in mean.argsort()[:count].tolist():
        keep[layer, :, PREFILL:] = 0
    return keep


def per_token_policy(costs: torch.Tensor, count: int) -> torch.Tensor:
    """keep [L, W, T]: at every decoded token, its `count` cheapest layers skipped."""
    keep = torch.ones_like(costs)
    decoded = keep[:, :, PREFILL:]
    decoded.scatter_(0, costs[:, :, PREFILL:].argsort(dim=0)[:count], 0.0)
    return keep


def pairs_policy(costs: torch.Tensor, count: int) -> torch.Tensor:
    """keep [L, W, T]: the cheapest decoded (token, layer) pairs of the text skipped, `count` per
    decoded token on average."""
    keep = torch.ones(costs.numel())
    keep[costs.flatten().argsort()[: count * costs.shape[1] * (costs.shape[2] - PREFILL)]] = 0
    return keep.view_as(costs)


def layer_byte_share(model: Transformer) -> float:
    """The layers' share of the weight bytes a batch-1 decode step reads (precision_bench's
    `weight_megabytes_per_token`: all layers, the final norm, the LM head)."""
    return weight_bytes(model.layers) / weight_bytes([*model.layers, model.norm, model.lm_head])


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--data", required=True, help="comma-separated held-out texts")
    parser.add_argument(
        "--max-tokens", type=positive(int), default=896, help="decoded tokens per text (eval's default)"
    )
    parser.add_argument(
        "--counts", type=positive_ints, default="1,2,3", help="comma-separated layers to skip per decoded token"
    )
    parser.add_argument(
        "--target-speedup", type=positive(float, at_most=100), default=1.2, help="the speed-up whose share is printed"
    )
    args = parser.parse_args()
    counts = set(args.counts)
    if not args.target_speedup > 1:
        parser.error("--target-speedup must be above 1")
    torch.set_num_threads(1)
    try:
        loaded = load_precise(args.model, "cpu", "float32", "none")
        streams = {
            Path(text): text_file_stream(loaded.tokenizer, Path(text), min_tokens=WINDOW)
            for text in args.data.split(",")
        }
    except (CheckpointError, CorpusError, OSError) as exc:
        parser.error(str(exc))
    model = loaded.model.eval()
    model.attach_gates(None)
    layers = model.config.num_layers
    protected = SkipPolicyConfig().protected(layers)
    skippable = [layer for layer in range(layers) if layer not in protected]
    if max(counts) > len(skippable):
        parser.error(f"--counts: at most the {len(skippable)} skippable layers")
    byte_shares = {"float32": layer_byte_share(model)}
    for quantization in QUANTIZED:
        try:
            quantized = quantize_model(copy.deepcopy(model), quantization)
            byte_shares[f"float32+{quantization}"] = layer_byte_share(quantized)
        except PrecisionError as exc:  # widths the kernel cannot take
            print(f"float32+{quantization}: not measured ({exc})", file=sys.stderr)

    saved = 1 - 1 / args.target_speedup
    print(f"{args.model.name}: {layers} layers (protected {', '.join(map(str, protected))}); a decode step at batch 1")
    print(
        "| precision | layers' share w of the weight bytes a step reads | share to skip for "
        f"{args.target_speedup:g}× ideal |"
    )
    print("|---|---:|---:|")
    for precision, share in byte_shares.items():
        needed = saved / share
        print(f"| {precision} | {share:.2f} | {needed:.1%} |")
        if needed * layers <= len(skippable):
            counts.add(math.ceil(needed * layers))

    for text, stream in streams.items():
        windows = heldout_windows(stream, WINDOW, args.max_tokens, PREFILL)
        full = log_probs(model, windows)
        costs = skip_costs(model, windows, full, skippable)
        print(f"\n{text.name}: {windows.shape[0]} windows, {windows.shape[0] * (WINDOW - PREFILL)} decoded tokens")
        print("| skipped | static | per token | pairs |")
        print("|---:|---:|---:|---:|")
        for count in sorted(counts):
            row = [
                perplexity_increase(full, log_probs(model, windows, policy), windows)
                for policy in (
                    static_policy(costs, count),
                    per_token_policy(costs, count),
                    pairs_policy(costs, count),
                )
            ]
            print(
                f"| {count / layers:.1%} ({count} of {layers}) | " + " | ".join(f"{value:+.1%}" for value in row) + " |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
