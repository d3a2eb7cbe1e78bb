"""`layerwatch eval`: perplexity at full depth vs gated, skip rates, fallbacks and speed on held-out text.

Gated numbers use the real decode semantics step by step (layerwatch/inference_shim/offline/evaluation.py): patience,
protected layers, fallback and the KV policy, exactly as the generation engine applies them.
`--sweep` repeats the gated run for several thresholds and prints the trade-off table; `--compare-rules`
runs each threshold under both skip rules (streak and ewma), so the table compares them. Speed is
measured in pairs, full depth and gated interleaved batch by batch, `--repeats` times
(docs/performance.md says why). Batches run their layers as `serve` does (`--depth-execution`,
`--batch-consensus`: layerwatch/inference_shim/runtime/depth_execution.py); `--batch-sizes` measures each batch
size in turn and prints one row per size: the depth execution's choice, the decided and executed
skips, gated ÷ full and the perplexity cost. `--no-gates` measures a checkpoint without a gate file at
full depth alone: perplexity and speed, before its gates are trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from layerwatch import argtypes
from layerwatch.cli.model_arguments import (
    DEPTH_SETTINGS,
    add_depth_arguments,
    add_model_arguments,
    depth_from_arguments,
    load_checkpoint_from_arguments,
    load_from_arguments,
    report_errors,
)
from layerwatch.inference_shim.service.settings import SkippingSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--data", type=Path, required=True, help="held-out plain UTF-8 text")
    parser.add_argument(
        "--threshold",
        type=argtypes.fraction,
        default=None,
        help="tau (default: the threshold the gates were trained for)",
    )
    parser.add_argument(
        "--sweep",
        type=argtypes.fractions,
        default=None,
        metavar="T1,T2,...",
        help="evaluate these thresholds and print the trade-off table",
    )
    parser.add_argument(
        "--compare-rules",
        action="store_true",
        help="evaluate each threshold under every skip rule (streak, ewma), one row each",
    )
    parser.add_argument(
        "--max-tokens", type=argtypes.positive(int), default=4096, help="decoded (predicted) tokens to evaluate"
    )
    parser.add_argument("--window", type=argtypes.positive(int), default=128, help="tokens per held-out window")
    parser.add_argument(
        "--prefill", type=argtypes.positive(int), default=16, help="window tokens given as the full-depth prompt"
    )
    parser.add_argument(
        "--repeats",
        type=argtypes.positive(int),
        default=3,
        help="timed repetitions of the interleaved full and gated passes (speed spread)",
    )
    add_depth_arguments(parser)
    parser.add_argument(
        "--batch-sizes",
        type=argtypes.positive_ints,
        default=None,
        metavar="B1,B2,...",
        help="evaluate at each batch size in turn (instead of --batch-size) and print one row per size",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each layer's attention and FFN bodies first (the skip decision stays eager)",
    )
    parser.add_argument(
        "--no-gates",
        action="store_true",
        help="a model without a gate file (as `serve --no-gates` serves it): full-depth perplexity and tokens/s only",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# The flags that need gates, by dest and the value that means "not given": refused with --no-gates
# (the depth flags too, as `serve --no-gates` refuses them: without gates layers run whole).
GATED_FLAGS = {
    "gates": None,
    "threshold": None,
    "sweep": None,
    "compare_rules": False,
    "patience": None,
    "skip_rule": None,
    "ewma_alpha": None,
    "batch_sizes": None,
    **{field.name: field.default for field in dataclasses.fields(SkippingSettings) if field.name in DEPTH_SETTINGS},
}


def run(args: argparse.Namespace) -> int:
    if args.no_gates:
        return run_full_depth(args)
    from layerwatch.inference_shim.offline.evaluation import gated_result, heldout_windows, paired_decode
    from layerwatch.inference_shim.offline.training import text_file_stream
    from layerwatch.skip_policy import SKIP_RULES

    def prepare():
        depth = depth_from_arguments(args)
        gated = load_from_arguments(args)
        if args.compile:
            gated.model.compile_layers()
        stream = text_file_stream(gated.loaded.tokenizer, args.data, min_tokens=args.window)
        return gated, heldout_windows(stream, args.window, args.max_tokens, args.prefill), depth

    prepared = report_errors(prepare)
    if prepared is None:
        return 2
    gated, windows, depth = prepared
    # A batch holds at most the windows there are: the size reported is the one that ran.
    batch_sizes = [min(size, len(windows)) for size in args.batch_sizes or [args.batch_size]]
    thresholds = args.sweep or [args.threshold if args.threshold is not None else gated.gates.metadata.threshold]
    rules = SKIP_RULES if args.compare_rules else (gated.skip_rule,)
    policies = [gated.policy(threshold, skip_rule=rule) for threshold in thresholds for rule in rules]

    def measure(batch_size: int) -> tuple[list[dict], dict]:
        runs = paired_decode(
            gated,
            windows,
            policies,
            prefill=args.prefill,
            kv_policy=args.kv_policy,
            batch_size=batch_size,
            repeats=args.repeats,
            depth=depth,
        )
        results = [gated_result(runs, index) for index in range(len(policies))]
        limits = getattr(runs.depth.costs, "limits", {})
        execution = {
            "mode": depth.mode,
            "batch_consensus": depth.vote,
            # The most running rows of a batch for which the row-partial path was the faster (measured).
            "row_partial_limits": {str(size): limit for size, limit in sorted(limits.items())},
        }
        return results, {"full": runs.full[0], "execution": execution}

    header = {
        "model": str(args.model),
        "gates": str(gated.gates_path),
        "gates_sha256": gated.gates.sha256,
        "data": str(args.data),
        "windows": len(windows),
        "window": args.window,
        "prefill": args.prefill,
        "patience": gated.patience,
        "ewma_alpha": gated.ewma_alpha,
        "kv_policy": args.kv_policy,
        "depth_execution": depth.mode,
        "batch_consensus": depth.vote,
        "compiled": args.compile,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "repeats": args.repeats,
    }
    title = f"model {args.model} ({precision(args)})  gates {gated.gates_path} (sha256 {gated.gates.sha256[:12]})"
    description = (
        f"{len(windows)} windows of {args.window} tokens, prefill {args.prefill}, patience {gated.patience}, "
        f"ewma alpha {gated.ewma_alpha:g}, kv policy {args.kv_policy}, depth execution {depth.describe()}"
        + (", compiled layer bodies" if args.compile else "")
    )
    if args.batch_sizes is not None:
        if len(policies) != 1:
            print("error: --batch-sizes measures one threshold and rule: drop --sweep/--compare-rules", file=sys.stderr)
            return 2
        if len(set(batch_sizes)) < len(batch_sizes):
            capped = ",".join(str(size) for size in args.batch_sizes if size >= len(windows))
            print(
                f"error: --batch-sizes {capped}: {len(windows)} windows make one batch of {len(windows)} at each "
                f"of these sizes: keep one of them (or give more --data / --max-tokens)",
                file=sys.stderr,
            )
            return 2
        rows = []
        for batch_size in batch_sizes:
            (result,), extra = measure(batch_size)
            rows.append(
                {"batch_size": batch_size, **result, **extra["execution"], "decoded_tokens": extra["full"].tokens}
            )
        if args.json:
            print(json.dumps({**header, "batch_sizes": rows}, indent=2))
        else:
            print(title)
            print(f"data {args.data}: {description}, threshold {policies[0].threshold:g}")
            print(format_batch_sizes(rows))
        return 0
    (batch_size,) = batch_sizes
    results, extra = measure(batch_size)
    full = extra["full"]
    header |= {"batch_size": batch_size, "decoded_tokens": full.tokens, **extra["execution"]}
    if args.json:
        body = (
            {**header, **results[0]}
            if len(results) == 1
            else {
                **header,
                "perplexity_full": full.perplexity,
                "tokens_per_second_full": results[0]["tokens_per_second_full"],
                "sweep": results,
            }
        )
        print(json.dumps(body, indent=2))
        return 0
    print(title)
    print(f"data {args.data}: {description}, {full.tokens} decoded tokens, batch {batch_size}")
    if len(results) == 1:
        print(format_single(results[0], extra["execution"], batch_size))
    else:
        print(format_sweep(results))
    return 0


def run_full_depth(args: argparse.Namespace) -> int:
    """`eval --no-gates`: the checkpoint alone, at full depth."""
    given = [f"--{dest.replace('_', '-')}" for dest, unset in GATED_FLAGS.items() if getattr(args, dest) != unset]
    if given:
        print(f"error: --no-gates evaluates full depth only: {', '.join(given)} need(s) gates", file=sys.stderr)
        return 2
    from layerwatch.inference_shim.offline.evaluation import full_depth_result, full_depth_runs, heldout_windows
    from layerwatch.inference_shim.offline.training import text_file_stream

    def prepare():
        loaded = load_checkpoint_from_arguments(args)
        if args.compile:
            loaded.model.compile_layers()
        stream = text_file_stream(loaded.tokenizer, args.data, min_tokens=args.window)
        return loaded.model, heldout_windows(stream, args.window, args.max_tokens, args.prefill)

    prepared = report_errors(prepare)
    if prepared is None:
        return 2
    model, windows = prepared
    batch_size = min(args.batch_size, len(windows))
    runs = full_depth_runs(
        model, windows, prefill=args.prefill, kv_policy=args.kv_policy, batch_size=batch_size, repeats=args.repeats
    )
    result = full_depth_result(runs)
    if args.json:
        header = {
            "model": str(args.model),
            "gates": None,
            "gates_sha256": None,
            "data": str(args.data),
            "windows": len(windows),
            "window": args.window,
            "prefill": args.prefill,
            "batch_size": batch_size,
            "kv_policy": args.kv_policy,
            "compiled": args.compile,
            "dtype": args.dtype,
            "quantization": args.quantization,
            "repeats": args.repeats,
            "decoded_tokens": runs[0].tokens,
        }
        print(json.dumps(header | result, indent=2))
        return 0
    print(f"model {args.model} ({precision(args)})  no gates: full depth")
    print(
        f"data {args.data}: {len(windows)} windows of {args.window} tokens, prefill {args.prefill}, "
        f"{runs[0].tokens} decoded tokens, batch {batch_size}" + (", compiled layer bodies" if args.compile else "")
    )
    speed = _spread_text(result["speed"]["tokens_per_second_full"])
    print(f"full-depth perplexity {result['perplexity_full']:.3f}, tokens/s {speed} (median (range) of {args.repeats})")
    return 0


def precision(args: argparse.Namespace) -> str:
    """ "float32", "float32, int4 weights"."""
    return args.dtype + ("" if args.quantization == "none" else f", {args.quantization} weights")


def format_single(r: dict, execution: dict, batch_size: int) -> str:
    layers = " ".join(f"{l}:{rate:.2f}" for l, rate in enumerate(r["per_layer_skip_rate"]))
    return "\n".join(
        [
            f"threshold {r['threshold']:g}, skip rule {r['skip_rule']}",
            f"perplexity full {r['perplexity_full']:.3f}  gated {r['perplexity_gated']:.3f} "
            f"({r['perplexity_increase']:+.2%})",
            f"decode layer evaluations skipped {r['skip_fraction']:.1%} (decided by the skip rule), "
            f"{r['executed_skip_fraction']:.1%} executed, {r['unneeded_run_fraction']:.1%} run though "
            f"skipped  fallbacks {r['fallbacks']}",
            f"depth execution at batch {batch_size}: {execution_text(r, execution, batch_size)}",
            f"per-layer skip rate {layers}",
            f"tokens/s full {r['tokens_per_second_full']:.0f}  gated {r['tokens_per_second_gated']:.0f} "
            f"(medians of {r['speed']['repeats']})",
            f"gated / full tokens/s, paired: {_spread_text(r['speed']['gated_over_full'])} wall, "
            f"{_spread_text(r['speed']['gated_over_full_cpu'])} CPU",
        ]
    )


def format_sweep(results: list[dict]) -> str:
    """A Markdown table (pasted as is into the model card). Skips both as the rules decided them and as
    the batch executed them (a layer run whole, or voted off, for the batch's sake): the perplexity
    is that of what was executed (docs/model.md, "Depth execution")."""
    lines = [
        f"full-depth perplexity {results[0]['perplexity_full']:.3f}, "
        f"{results[0]['tokens_per_second_full']:.0f} tokens/s",
        "",
        "| rule | threshold | skipped: decided | executed | perplexity | increase | fallbacks | tokens/s "
        "| gated / full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['skip_rule']} | {r['threshold']:g} | {r['skip_fraction']:.1%} | {r['executed_skip_fraction']:.1%} | "
            f"{r['perplexity_gated']:.3f} | "
            f"{r['perplexity_increase']:+.2%} | {r['fallbacks']} | {r['tokens_per_second_gated']:.0f} | "
            f"{_spread_text(r['speed']['gated_over_full'])} |"
        )
    return "\n".join(lines)


def execution_text(r: dict, execution: dict, batch_size: int) -> str:
    """ "row-partial up to 1 of 8 rows; layers whole 61%, row-partial 9%, skipped 30%"."""
    limit = execution["row_partial_limits"].get(str(batch_size))
    if execution["mode"] == "rows" or batch_size == 1:
        choice = "every row as it decided"
    elif execution["mode"] == "batch" or not limit:
        choice = "whole layers only" + (" (row-partial never faster, measured)" if limit == 0 else "")
    else:
        choice = f"row-partial up to {limit} of {batch_size} rows (measured)"
    paths = r["layer_paths"]
    return (
        f"{choice}; (step, layer) pairs run whole {paths['whole']:.0%}, row-partial {paths['partial']:.0%}, "
        f"skipped {paths['skipped']:.0%}"
    )


def format_batch_sizes(rows: list[dict]) -> str:
    """A Markdown table, one row per batch size (pasted as is into docs/performance.md)."""
    lines = [
        f"full-depth perplexity {rows[0]['perplexity_full']:.3f}",
        "",
        "| batch | depth execution | skipped: decided | executed | run though skipped | perplexity | increase "
        "| gated / full (CPU) | wall |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {execution_text(r, r, r['batch_size'])} | {r['skip_fraction']:.1%} | "
            f"{r['executed_skip_fraction']:.1%} | {r['unneeded_run_fraction']:.1%} | {r['perplexity_gated']:.3f} | "
            f"{r['perplexity_increase']:+.2%} | {_spread_text(r['speed']['gated_over_full_cpu'])} | "
            f"{_spread_text(r['speed']['gated_over_full'])} |"
        )
    return "\n".join(lines)


def _spread_text(spread: dict) -> str:
    """Median and range of paired ratios: "1.04 (0.98–1.09)"."""
    return f"{spread['median']:.2f} ({spread['min']:.2f}–{spread['max']:.2f})"
