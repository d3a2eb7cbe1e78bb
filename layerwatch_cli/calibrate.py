"""`layerwatch calibrate`: measure a healthy baseline run and write the model's profile YAML.

The baseline is served traffic in miniature: prompts cut from the beginnings of the text's verses
(lines), completed by the real GenerationEngine with the service's sampling settings, so every
skip decision follows the real decode semantics (patience, protected layers, fallback, KV policy).
inference_shim/offline/calibration.py derives the bands; alerts/profile.py defines the file.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
from pathlib import Path

from inference_shim.runtime.demo_model import DEMO_MODEL_NAME
from layerwatch_cli.model_arguments import add_model_arguments, load_from_arguments, report_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--data", type=Path, required=True, help="held-out plain UTF-8 text; prompts are the first words of its lines"
    )
    parser.add_argument("--out", type=Path, required=True, help="profile YAML to write")
    parser.add_argument(
        "--model-name", default=DEMO_MODEL_NAME, help="the model_name the service reports and the alerts select on"
    )
    parser.add_argument(
        "--threshold", type=float, default=None, help="tau (default: the threshold the gates were trained for)"
    )
    parser.add_argument("--prompts", type=int, default=128, help="requests in the baseline")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=512,
        help="decoded tokens per chunk when measuring how much window statistics vary",
    )
    parser.add_argument("--margin", type=float, default=0.03, help="added on both sides of each measured band")
    parser.add_argument(
        "--min-observations",
        type=int,
        default=1000,
        help="entropies the exporter window needs before the single-peak alert may fire",
    )


def run(args: argparse.Namespace) -> int:
    from alerts.profile import ProfileError, dump_profile
    from inference_shim.offline.calibration import (
        Baseline,
        agreement_floor,
        ascii_histogram,
        build_profile,
        generate_baseline,
        line_prompts,
        shadow_checks,
    )
    from inference_shim.offline.corpus import read_documents
    from inference_shim.runtime.skip_policy import SkipPolicyConfig

    def prepare():
        gated = load_from_arguments(args)
        prompts = line_prompts(read_documents(args.data), args.prompts, random.Random(args.seed))
        return gated, prompts

    prepared = report_errors(prepare)
    if prepared is None:
        return 2
    gated, prompts = prepared
    threshold = args.threshold if args.threshold is not None else gated.gates.metadata.threshold
    policy = SkipPolicyConfig(threshold=threshold, patience=gated.patience)
    baseline = Baseline()
    decoding = dict(
        model_name=args.model_name,
        kv_policy=args.kv_policy,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    fallbacks = generate_baseline(
        gated, policy, prompts, baseline, temperature=args.temperature, top_p=args.top_p, seed=args.seed, **decoding
    )
    entropies, skipped = baseline.arrays()
    checks = shadow_checks(gated, policy, prompts, **decoding)
    checked_tokens, agreed = sum(t for t, _ in checks), sum(a for _, a in checks)
    today = datetime.date.today().isoformat()
    source = (
        f"layerwatch calibrate {today}: {len(prompts)} prompts from {args.data.name}, {len(entropies)} "
        f"decoded tokens (temperature {args.temperature:g}, top_p {args.top_p:g}), threshold {threshold:g}, "
        f"gates sha256 {gated.gates.sha256[:12]}, kv policy {args.kv_policy}"
    )
    try:
        profile, stats = build_profile(
            args.model_name,
            threshold,
            gated.patience,
            policy.fallback_skip_fraction,
            entropies,
            skipped,
            agreement_floor(checks, args.chunk_tokens, args.margin),
            chunk_tokens=args.chunk_tokens,
            margin=args.margin,
            min_observations=args.min_observations,
            source=source,
        )
        dump_profile(profile, args.out)
    except (ValueError, ProfileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    b = stats.bimodality
    print(
        f"baseline: {len(prompts)} requests, {len(entropies)} decoded tokens, {stats.observations} gate "
        f"entropies, skipped {stats.skip_ratio:.1%}, fallbacks {fallbacks}"
    )
    print(
        f"active-layer entropy mean {stats.active_mean:.4f} std {stats.active_std:.4f}; "
        f"zero-entropy ratio {stats.zero_ratio:.4f}"
    )
    print(
        f"bimodality: {'bimodal' if b.bimodal else 'NOT bimodal'} (peaks {b.peaks}, dip {b.dip:.4f}, "
        f"p {b.dip_p_value:.4g}, BC {b.bimodality_coefficient:.3f}, window {b.observations})"
    )
    print(
        f"shadow agreement (greedy, full-depth top-1): {agreed}/{checked_tokens} = "
        f"{agreed / max(checked_tokens, 1):.3f}; alert floor {profile.shadow_agreement_min}"
    )
    print("20-bin histogram of decode-time entropies (all layers):")
    print(ascii_histogram(stats.histogram))
    print(f"wrote {args.out}")
    return 0
