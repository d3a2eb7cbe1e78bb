"""`layerwatch calibrate-trace TRACE.jsonl`: a model's profile YAML from a trace of its healthy traffic.

For an engine that `layerwatch calibrate` cannot run (any engine but the shim's: transformers through
layerwatch.integrations.transformers, one's own): the trace its healthy traffic wrote is the baseline,
cut into bands by the code `calibrate` uses (layerwatch/alerts/baseline.py). What only the shim measures keeps
the profile's defaults (docs/instrument.md). Torch-free, as `replay` is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerwatch import argtypes
from layerwatch.alerts.baseline import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_MARGIN,
    ascii_histogram,
    baseline_summary,
    profile_from_trace,
    read_trace_baseline,
)
from layerwatch.alerts.profile import DEFAULT_RUNAWAY_SKIP_RATIO
from layerwatch.alerts.profile_file import ProfileError, dump_profile
from layerwatch.statistics import DEFAULT_MIN_WINDOW_OBSERVATIONS
from layerwatch.trace import TraceError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE.jsonl", type=Path, help="trace of the model's healthy traffic")
    parser.add_argument("--out", type=Path, required=True, help="profile YAML to write")
    parser.add_argument(
        "--model-name", default=None, help="the model to calibrate (default: the trace's only model_name)"
    )
    parser.add_argument(
        "--threshold",
        type=argtypes.fraction,
        default=None,
        metavar="TAU",
        help='the skip threshold, for trace lines without a "threshold" key (default: the lines\')',
    )
    parser.add_argument(
        "--patience",
        type=argtypes.positive(int),
        default=1,
        help="steps below the threshold before a layer is skipped (informational; default 1: a per-token router)",
    )
    parser.add_argument(
        "--runaway-skip-ratio",
        type=argtypes.fraction,
        default=DEFAULT_RUNAWAY_SKIP_RATIO,
        help="LayerwatchRunawaySkipping's limit (default %(default)s)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=argtypes.positive(int),
        default=DEFAULT_CHUNK_TOKENS,
        help="decoded tokens per chunk when measuring how much window statistics vary (default %(default)s)",
    )
    parser.add_argument(
        "--margin",
        type=argtypes.fraction,
        default=DEFAULT_MARGIN,
        help="added on both sides of each measured band (default %(default)s)",
    )
    parser.add_argument(
        "--min-observations",
        type=argtypes.positive(int),
        default=DEFAULT_MIN_WINDOW_OBSERVATIONS,
        help="entropies the exporter window needs before the single-peak alert may fire (default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        baseline = read_trace_baseline(args.trace, args.model_name, args.threshold)
        if len(baseline.entropies) < args.chunk_tokens:  # the profile's check, with what to do about it
            print(
                f"layerwatch calibrate-trace: {args.trace}: {len(baseline.entropies)} decoded tokens of "
                f"{baseline.model_name}, fewer than one chunk of {args.chunk_tokens} (--chunk-tokens): record more "
                "of its healthy traffic (a few thousand tokens give bands that hold for the live 5-minute "
                "windows), or give a smaller --chunk-tokens (looser bands)",
                file=sys.stderr,
            )
            return 2
        profile, stats = profile_from_trace(
            baseline,
            source=args.trace.name,
            patience=args.patience,
            runaway_skip_ratio=args.runaway_skip_ratio,
            chunk_tokens=args.chunk_tokens,
            margin=args.margin,
            min_observations=args.min_observations,
        )
        dump_profile(profile, args.out)
    except (TraceError, OSError, ValueError, ProfileError) as exc:
        print(f"layerwatch calibrate-trace: {exc}", file=sys.stderr)
        return 2
    rows, layers = baseline.entropies.shape
    print(
        f"baseline: {rows} decoded tokens of {baseline.model_name} ({layers} layers, threshold "
        f"{baseline.threshold:g}), {stats.observations} gate entropies, skipped {stats.skip_ratio:.1%}"
    )
    print("\n".join(baseline_summary(stats, profile)))
    print(
        "not measured (a trace has no shadow checks and no request boundaries): shadow_agreement_min "
        f"{profile.shadow_agreement_min}, shadow_kl_nats_max {profile.shadow_kl_nats_max}, "
        f"gate_importance.correlation_min {profile.gate_importance.correlation_min}, request_tail "
        f"{profile.request_tail.runaway_skip_fraction:g} / {profile.request_tail.normal_share} (defaults)"
    )
    print("20-bin histogram of decode-time entropies (all layers):")
    print(ascii_histogram(stats.histogram))
    print(f"wrote {args.out}")
    return 0
