"""`layerwatch calibrate-trace TRACE.jsonl`: a model's profile YAML from a trace of its healthy traffic.

For an engine that `layerwatch calibrate` cannot run (any engine but the shim's: transformers through
layerwatch.integrations.transformers, one's own): the trace its healthy traffic wrote is the baseline,
cut into bands by the code `calibrate` uses (layerwatch/alerts/baseline.py). What only the shim measures keeps
the profile's defaults (docs/instrument.md). Torch-free, as `replay` is.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
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
from layerwatch.settings import add_flags, from_flags, setting
from layerwatch.statistics import DEFAULT_MIN_WINDOW_OBSERVATIONS
from layerwatch.trace import TraceError


@dataclass(frozen=True, kw_only=True)
class CalibrateTraceSettings:
    trace: Path = setting(
        type=Path, positional=True, metavar="TRACE.jsonl", help="trace of the model's healthy traffic"
    )
    out: Path = setting(type=Path, required=True, help="profile YAML to write")
    model_name: str | None = setting(None, help="the model to calibrate (default: the trace's only model_name)")
    threshold: float | None = setting(
        None,
        type=argtypes.fraction,
        metavar="TAU",
        help='the skip threshold, for trace lines without a "threshold" key (default: the lines\')',
    )
    patience: int = setting(
        1,
        type=argtypes.positive(int),
        help="steps below the threshold before a layer is skipped (informational; default 1: a per-token router)",
    )
    runaway_skip_ratio: float = setting(
        DEFAULT_RUNAWAY_SKIP_RATIO,
        type=argtypes.fraction,
        help="LayerwatchRunawaySkipping's limit (default %(default)s)",
    )
    chunk_tokens: int = setting(
        DEFAULT_CHUNK_TOKENS,
        type=argtypes.positive(int),
        help="decoded tokens per chunk when measuring how much window statistics vary (default %(default)s)",
    )
    margin: float = setting(
        DEFAULT_MARGIN,
        type=argtypes.fraction,
        help="added on both sides of each measured band (default %(default)s)",
    )
    min_observations: int = setting(
        DEFAULT_MIN_WINDOW_OBSERVATIONS,
        type=argtypes.positive(int),
        help="entropies the exporter window needs before the single-peak alert may fire (default %(default)s)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, CalibrateTraceSettings)


def run(args: argparse.Namespace) -> int:
    settings = from_flags(CalibrateTraceSettings, args)
    try:
        baseline = read_trace_baseline(settings.trace, settings.model_name, settings.threshold)
        if len(baseline.entropies) < settings.chunk_tokens:  # the profile's check, with what to do about it
            print(
                f"layerwatch calibrate-trace: {settings.trace}: {len(baseline.entropies)} decoded tokens of "
                f"{baseline.model_name}, fewer than one chunk of {settings.chunk_tokens} (--chunk-tokens): record more "
                "of its healthy traffic (a few thousand tokens give bands that hold for the live 5-minute "
                "windows), or give a smaller --chunk-tokens (looser bands)",
                file=sys.stderr,
            )
            return 2
        profile, stats = profile_from_trace(
            baseline,
            source=settings.trace.name,
            patience=settings.patience,
            runaway_skip_ratio=settings.runaway_skip_ratio,
            chunk_tokens=settings.chunk_tokens,
            margin=settings.margin,
            min_observations=settings.min_observations,
        )
        dump_profile(profile, settings.out)
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
    print(f"wrote {settings.out}")
    return 0
