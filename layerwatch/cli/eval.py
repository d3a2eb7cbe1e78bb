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
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from layerwatch import argtypes
from layerwatch.cli.model_arguments import GatedModelSettings, load_checkpoint, load_gated, report_errors
from layerwatch.inference_shim.service.settings import GATED_SETTINGS, ModelSettings, SkippingSettings
from layerwatch.settings import add_flags, changed_from_default, from_flags, same_as, setting


@dataclass(frozen=True, kw_only=True)
class EvalSettings(GatedModelSettings):
    """What `eval` measures, on which text; refuses the flags that need gates with --no-gates."""

    data: Path = setting(type=Path, required=True, help="held-out plain UTF-8 text")
    threshold: float | None = same_as(SkippingSettings, "threshold")
    sweep: list[float] | None = setting(
        None,
        type=argtypes.fractions,
        metavar="T1,T2,...",
        help="evaluate these thresholds and print the trade-off table",
    )
    compare_rules: bool = setting(
        False, help="evaluate each threshold under every skip rule (streak, ewma), one row each"
    )
    max_tokens: int = setting(4096, type=argtypes.positive(int), help="decoded (predicted) tokens to evaluate")
    window: int = setting(128, type=argtypes.positive(int), help="tokens per held-out window")
    prefill: int = setting(16, type=argtypes.positive(int), help="window tokens given as the full-depth prompt")
    repeats: int = setting(
        3,
        type=argtypes.positive(int),
        help="timed repetitions of the interleaved full and gated passes (speed spread)",
    )
    # How a batch runs the layers its rows decided (runtime/depth_execution.py), as `serve` runs them.
    depth_execution: str = same_as(SkippingSettings, "depth_execution")
    batch_consensus: float | None = same_as(SkippingSettings, "batch_consensus")
    batch_sizes: list[int] | None = setting(
        None,
        type=argtypes.positive_ints,
        metavar="B1,B2,...",
        help="evaluate at each batch size in turn (instead of --batch-size) and print one row per size",
    )
    compile: bool = same_as(ModelSettings, "compile")
    no_gates: bool = setting(
        False,
        help="a model without a gate file (as `serve --no-gates` serves it): full-depth perplexity and tokens/s only",
    )
    json: bool = setting(False, help="print one JSON object")

    def __post_init__(self) -> None:
        if self.no_gates and (needing := changed_from_default(self, EVAL_GATED_SETTINGS)):
            raise ValueError(f"--no-gates evaluates full depth only: {', '.join(needing)} need(s) gates")

    def depth(self):
        """The DepthExecutionConfig the depth flags name."""
        from layerwatch.inference_shim.runtime.depth_execution import DepthExecutionConfig

        return DepthExecutionConfig(self.depth_execution, self.batch_consensus)


# The settings that need gates: serve's (GATED_SETTINGS, the depth flags among them: without gates
# layers run whole) and those of eval's own that compare thresholds, rules or batch sizes of gates.
EVAL_GATED_SETTINGS = tuple(
    name
    for name in EvalSettings.__dataclass_fields__
    if name in GATED_SETTINGS or name in ("sweep", "compare_rules", "batch_sizes")
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, EvalSettings)


def run(args: argparse.Namespace) -> int:
    try:
        settings = from_flags(EvalSettings, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_full_depth(settings) if settings.no_gates else run_gated(settings)


def run_gated(settings: EvalSettings) -> int:
    from layerwatch.inference_shim.offline.evaluation import gated_result, heldout_windows, paired_decode
    from layerwatch.inference_shim.offline.training import text_file_stream
    from layerwatch.skip_policy import SKIP_RULES

    def prepare():
        depth = settings.depth()
        gated = load_gated(settings)
        if settings.compile:
            gated.model.compile_layers()
        stream = text_file_stream(gated.loaded.tokenizer, settings.data, min_tokens=settings.window)
        return gated, heldout_windows(stream, settings.window, settings.max_tokens, settings.prefill), depth

    prepared = report_errors(prepare)
    if prepared is None:
        return 2
    gated, windows, depth = prepared
    # A batch holds at most the windows there are: the size reported is the one that ran.
    batch_sizes = [min(size, len(windows)) for size in settings.batch_sizes or [settings.batch_size]]
    thresholds = settings.sweep or [
        settings.threshold if settings.threshold is not None else gated.gates.metadata.threshold
    ]
    rules = SKIP_RULES if settings.compare_rules else (gated.skip_rule,)
    policies = [gated.policy(threshold, skip_rule=rule) for threshold in thresholds for rule in rules]

    def measure(batch_size: int) -> tuple[list[dict], dict]:
        runs = paired_decode(
            gated,
            windows,
            policies,
            prefill=settings.prefill,
            kv_policy=settings.kv_policy,
            batch_size=batch_size,
            repeats=settings.repeats,
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
        "model": str(settings.model),
        "gates": str(gated.gates_path),
        "gates_sha256": gated.gates.sha256,
        "data": str(settings.data),
        "windows": len(windows),
        "window": settings.window,
        "prefill": settings.prefill,
        "patience": gated.patience,
        "ewma_alpha": gated.ewma_alpha,
        "kv_policy": settings.kv_policy,
        "depth_execution": depth.mode,
        "batch_consensus": depth.vote,
        "compiled": settings.compile,
        "dtype": settings.dtype,
        "quantization": settings.quantization,
        "repeats": settings.repeats,
    }
    title = (
        f"model {settings.model} ({precision(settings)})  gates {gated.gates_path} (sha256 {gated.gates.sha256[:12]})"
    )
    description = (
        f"{len(windows)} windows of {settings.window} tokens, prefill {settings.prefill}, patience {gated.patience}, "
        f"ewma alpha {gated.ewma_alpha:g}, kv policy {settings.kv_policy}, depth execution {depth.describe()}"
        + (", compiled layer bodies" if settings.compile else "")
    )
    if settings.batch_sizes is not None:
        if len(policies) != 1:
            print("error: --batch-sizes measures one threshold and rule: drop --sweep/--compare-rules", file=sys.stderr)
            return 2
        if len(set(batch_sizes)) < len(batch_sizes):
            capped = ",".join(str(size) for size in settings.batch_sizes if size >= len(windows))
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
        if settings.json:
            print(json.dumps({**header, "batch_sizes": rows}, indent=2))
        else:
            print(title)
            print(f"data {settings.data}: {description}, threshold {policies[0].threshold:g}")
            print(format_batch_sizes(rows))
        return 0
    (batch_size,) = batch_sizes
    results, extra = measure(batch_size)
    full = extra["full"]
    header |= {"batch_size": batch_size, "decoded_tokens": full.tokens, **extra["execution"]}
    if settings.json:
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
    print(f"data {settings.data}: {description}, {full.tokens} decoded tokens, batch {batch_size}")
    if len(results) == 1:
        print(format_single(results[0], extra["execution"], batch_size))
    else:
        print(format_sweep(results))
    return 0


def run_full_depth(settings: EvalSettings) -> int:
    """`eval --no-gates`: the checkpoint alone, at full depth."""
    from layerwatch.inference_shim.offline.evaluation import full_depth_result, full_depth_runs, heldout_windows
    from layerwatch.inference_shim.offline.training import text_file_stream

    def prepare():
        loaded = load_checkpoint(settings)
        if settings.compile:
            loaded.model.compile_layers()
        stream = text_file_stream(loaded.tokenizer, settings.data, min_tokens=settings.window)
        return loaded.model, heldout_windows(stream, settings.window, settings.max_tokens, settings.prefill)

    prepared = report_errors(prepare)
    if prepared is None:
        return 2
    model, windows = prepared
    batch_size = min(settings.batch_size, len(windows))
    runs = full_depth_runs(
        model,
        windows,
        prefill=settings.prefill,
        kv_policy=settings.kv_policy,
        batch_size=batch_size,
        repeats=settings.repeats,
    )
    result = full_depth_result(runs)
    if settings.json:
        header = {
            "model": str(settings.model),
            "gates": None,
            "gates_sha256": None,
            "data": str(settings.data),
            "windows": len(windows),
            "window": settings.window,
            "prefill": settings.prefill,
            "batch_size": batch_size,
            "kv_policy": settings.kv_policy,
            "compiled": settings.compile,
            "dtype": settings.dtype,
            "quantization": settings.quantization,
            "repeats": settings.repeats,
            "decoded_tokens": runs[0].tokens,
        }
        print(json.dumps(header | result, indent=2))
        return 0
    print(f"model {settings.model} ({precision(settings)})  no gates: full depth")
    print(
        f"data {settings.data}: {len(windows)} windows of {settings.window} tokens, prefill {settings.prefill}, "
        f"{runs[0].tokens} decoded tokens, batch {batch_size}" + (", compiled layer bodies" if settings.compile else "")
    )
    speed = _spread_text(result["speed"]["tokens_per_second_full"])
    repeats = settings.repeats
    print(f"full-depth perplexity {result['perplexity_full']:.3f}, tokens/s {speed} (median (range) of {repeats})")
    return 0


def precision(settings: EvalSettings) -> str:
    """ "float32", "float32, int4 weights"."""
    return settings.dtype + ("" if settings.quantization == "none" else f", {settings.quantization} weights")


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
