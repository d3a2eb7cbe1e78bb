"""`layerwatch eval`: perplexity at full depth vs gated, skip rates, fallbacks and speed on held-out text.

Gated numbers use the real decode semantics step by step (inference_shim/evaluation.py): patience,
protected layers, fallback and the KV policy, exactly as the generation engine applies them.
`--sweep` repeats the gated run for several thresholds and prints the trade-off table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference_shim.checkpoint import LoadedCheckpoint
    from inference_shim.gates import LoadedGates
    from inference_shim.model import Transformer

GATES_FILE = "gates.safetensors"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--data", type=Path, required=True, help="held-out plain UTF-8 text")
    parser.add_argument("--threshold", type=float, default=None,
                        help="tau (default: the threshold the gates were trained for)")
    parser.add_argument("--sweep", type=_thresholds, default=None, metavar="T1,T2,...",
                        help="evaluate these thresholds and print the trade-off table")
    parser.add_argument("--max-tokens", type=int, default=4096, help="decoded (predicted) tokens to evaluate")
    parser.add_argument("--window", type=int, default=128, help="tokens per held-out window")
    parser.add_argument("--prefill", type=int, default=16, help="window tokens given as the full-depth prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared with `layerwatch calibrate`: the gated model and how it decodes."""
    from inference_shim.demo import DEMO_MODEL_DIR

    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR,
                        help="Hugging Face checkpoint folder (default: the embedded demo model)")
    parser.add_argument("--gates", type=Path, default=None,
                        help=f"gate file (default: {GATES_FILE} in the model folder)")
    parser.add_argument("--patience", type=int, default=None, help="default: the gates' own")
    parser.add_argument("--kv-policy", choices=("project", "evict"), default="project")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def _thresholds(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"thresholds must be in [0, 1], got {text!r}")
    return values


@dataclass
class GatedModel:
    loaded: "LoadedCheckpoint"
    gates: "LoadedGates"
    gates_path: Path
    patience: int

    @property
    def model(self) -> "Transformer":
        return self.loaded.model


def load_gated_model(args: argparse.Namespace) -> GatedModel:
    """The checkpoint and its gates, from the shared flags. Raises ValueError subclasses on bad input."""
    import torch

    from inference_shim.checkpoint import load_checkpoint
    from inference_shim.gates import load_gates
    from inference_shim.training import resolve_device

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    loaded = load_checkpoint(args.model, device=resolve_device(args.device))
    gates_path = args.gates if args.gates is not None else args.model / GATES_FILE
    gates = load_gates(gates_path, loaded.model)
    patience = args.patience if args.patience is not None else gates.metadata.patience
    return GatedModel(loaded, gates, gates_path, patience)


def report_errors(action):
    """Run `action()`; on bad input print the error and return None (the caller exits with 2)."""
    from inference_shim.checkpoint import CheckpointError
    from inference_shim.corpus import CorpusError
    from inference_shim.gates import GateFileError

    try:
        return action()
    except (CheckpointError, GateFileError, CorpusError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def decode_windows(gated: GatedModel, windows, threshold: float | None, args: argparse.Namespace):
    """Teacher-forced decode; threshold None = full depth with the gates detached (the ungated model)."""
    from inference_shim.evaluation import teacher_forced_decode
    from inference_shim.skip_policy import SkipPolicyConfig

    policy = None if threshold is None else SkipPolicyConfig(threshold=threshold, patience=gated.patience)
    gated.model.attach_gates(None if policy is None else gated.gates.gates)
    return teacher_forced_decode(gated.model, windows, args.prefill, policy, kv_policy=args.kv_policy,
                                 batch_size=args.batch_size)


def run(args: argparse.Namespace) -> int:
    from inference_shim.evaluation import heldout_windows
    from inference_shim.training import text_file_stream

    def prepare():
        gated = load_gated_model(args)
        stream = text_file_stream(gated.loaded.tokenizer, args.data, min_tokens=args.window)
        return gated, heldout_windows(stream, args.window, args.max_tokens, args.prefill)

    prepared = report_errors(prepare)
    if prepared is None:
        return 2
    gated, windows = prepared
    thresholds = args.sweep or [args.threshold if args.threshold is not None else gated.gates.metadata.threshold]
    full = decode_windows(gated, windows, None, args)
    results = [gated_result(full, decode_windows(gated, windows, t, args), t) for t in thresholds]
    header = {
        "model": str(args.model), "gates": str(gated.gates_path), "gates_sha256": gated.gates.sha256,
        "data": str(args.data), "windows": len(windows), "window": args.window, "prefill": args.prefill,
        "batch_size": args.batch_size, "patience": gated.patience, "kv_policy": args.kv_policy,
        "decoded_tokens": full.tokens,
    }
    if args.json:
        body = {**header, **results[0]} if args.sweep is None else {**header, "perplexity_full": full.perplexity,
                                                                     "tokens_per_second_full": full.tokens_per_second,
                                                                     "sweep": results}
        print(json.dumps(body, indent=2))
        return 0
    print(f"model {args.model}  gates {gated.gates_path} (sha256 {gated.gates.sha256[:12]})")
    print(f"data {args.data}: {len(windows)} windows of {args.window} tokens, prefill {args.prefill}, "
          f"{full.tokens} decoded tokens, batch {args.batch_size}, patience {gated.patience}, "
          f"kv policy {args.kv_policy}")
    if args.sweep is None:
        print(format_single(results[0]))
    else:
        print(format_sweep(results))
    return 0


def gated_result(full, gated, threshold: float) -> dict:
    """The CONTRACT's `eval --json` keys for one threshold."""
    return {
        "threshold": threshold,
        "perplexity_full": full.perplexity,
        "perplexity_gated": gated.perplexity,
        "perplexity_increase": gated.perplexity / full.perplexity - 1.0,
        "skip_fraction": gated.skip_fraction,
        "per_layer_skip_rate": gated.per_layer_skip_rate,
        "fallbacks": gated.fallbacks,
        "tokens_per_second_full": full.tokens_per_second,
        "tokens_per_second_gated": gated.tokens_per_second,
    }


def format_single(r: dict) -> str:
    layers = " ".join(f"{l}:{rate:.2f}" for l, rate in enumerate(r["per_layer_skip_rate"]))
    return "\n".join([
        f"threshold {r['threshold']:g}",
        f"perplexity full {r['perplexity_full']:.3f}  gated {r['perplexity_gated']:.3f} "
        f"({r['perplexity_increase']:+.2%})",
        f"decode layer evaluations skipped {r['skip_fraction']:.1%}  fallbacks {r['fallbacks']}",
        f"per-layer skip rate {layers}",
        f"tokens/s full {r['tokens_per_second_full']:.0f}  gated {r['tokens_per_second_gated']:.0f}",
    ])


def format_sweep(results: list[dict]) -> str:
    """A Markdown table (pasted as is into the model card)."""
    lines = [f"full-depth perplexity {results[0]['perplexity_full']:.3f}, "
             f"{results[0]['tokens_per_second_full']:.0f} tokens/s", "",
             "| threshold | layer evaluations skipped | perplexity | increase | fallbacks | tokens/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['threshold']:g} | {r['skip_fraction']:.1%} | {r['perplexity_gated']:.3f} | "
                     f"{r['perplexity_increase']:+.2%} | {r['fallbacks']} | {r['tokens_per_second_gated']:.0f} |")
    return "\n".join(lines)
