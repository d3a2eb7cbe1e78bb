"""`layerwatch calibrate`: measure a healthy baseline run and write the model's profile YAML.

The baseline is held-out text decoded with the real skip semantics (the same teacher-forced
decoding as `layerwatch eval`), at the gates' threshold. See inference_shim/calibration.py for how
the bands are derived; alerts/profile.py defines the file.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from inference_shim.cli_eval import add_model_arguments
    from inference_shim.demo import DEMO_MODEL_NAME

    add_model_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="profile YAML to write")
    parser.add_argument("--model-name", default=DEMO_MODEL_NAME,
                        help="the model_name the service reports and the alerts select on")
    parser.add_argument("--threshold", type=float, default=None,
                        help="tau (default: the threshold the gates were trained for)")
    parser.add_argument("--chunk-tokens", type=int, default=512,
                        help="decoded tokens per chunk when measuring how much window statistics vary")
    parser.add_argument("--margin", type=float, default=0.03, help="added on both sides of each measured band")
    parser.add_argument("--min-observations", type=int, default=1000,
                        help="entropies the exporter window needs before the single-peak alert may fire")


def run(args: argparse.Namespace) -> int:
    from alerts.profile import ProfileError, dump_profile
    from inference_shim.calibration import Baseline, ascii_histogram, build_profile
    from inference_shim.cli_eval import setup_or_exit
    from inference_shim.skip_policy import SkipPolicyConfig

    setup = setup_or_exit(args)
    if setup is None:
        return 2
    threshold = args.threshold if args.threshold is not None else setup.gates.metadata.threshold
    baseline = Baseline()
    totals = setup.decode(threshold, on_step=baseline.record)
    entropies, skipped = baseline.arrays()
    today = datetime.date.today().isoformat()
    source = (f"layerwatch calibrate {today}: {totals.tokens} decoded tokens of {args.data.name}, threshold "
              f"{threshold:g}, gates sha256 {setup.gates.sha256[:12]}, kv policy {args.kv_policy}")
    try:
        profile, stats = build_profile(
            args.model_name, threshold, setup.patience, SkipPolicyConfig().fallback_skip_fraction,
            entropies, skipped, chunk_tokens=args.chunk_tokens, margin=args.margin,
            min_observations=args.min_observations, source=source)
        dump_profile(profile, args.out)
    except (ValueError, ProfileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    b = stats.bimodality
    print(f"baseline: {totals.tokens} decoded tokens, {stats.observations} gate entropies, "
          f"perplexity {totals.perplexity:.3f}, skipped {stats.skip_ratio:.1%}, fallbacks {totals.fallbacks}")
    print(f"active-layer entropy mean {stats.active_mean:.4f} std {stats.active_std:.4f}; "
          f"zero-entropy ratio {stats.zero_ratio:.4f}")
    print(f"bimodality: {'bimodal' if b.bimodal else 'NOT bimodal'} (peaks {b.peaks}, dip {b.dip:.4f}, "
          f"p {b.dip_p_value:.4g}, BC {b.bimodality_coefficient:.3f}, window {b.observations})")
    print("20-bin histogram of decode-time entropies (all layers):")
    print(ascii_histogram(stats.histogram))
    print(f"wrote {args.out}")
    return 0
