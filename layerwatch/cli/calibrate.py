"""`layerwatch calibrate`: measure a healthy baseline run and write the model's profile YAML.

The baseline is served traffic in miniature: prompts cut from the beginnings of the text's verses
(lines), completed by the real GenerationEngine with the service's sampling settings, so every
skip decision follows the real decode semantics (patience, protected layers, fallback, KV policy).
The run is `layerwatch.inference_shim.offline.calibration.calibrate`; this command parses its flags, prints what
was measured and writes the profile (layerwatch/alerts/profile.py defines the file), unless the baseline shows
what its alerts page on (`Calibration.problems`): then it exits 2 naming each problem, and writes the
profile only with --accept-unhealthy (docs/alerting.md, "What calibrate measures").
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from layerwatch import argtypes
from layerwatch.catalog import GATE_LAYER_SAMPLES, MIN_GATE_SCORE_STD
from layerwatch.cli.model_arguments import (
    add_depth_arguments,
    add_model_arguments,
    depth_from_arguments,
    load_from_arguments,
    report_errors,
)
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_NAME, served_model_name

if TYPE_CHECKING:
    from layerwatch.inference_shim.offline.calibration import Calibration


def _defaults() -> dict[str, object]:
    # CalibrationSettings is the one source of the defaults; imported late (it imports torch).
    from layerwatch.inference_shim.offline.calibration import CalibrationSettings

    return {f.name: f.default for f in dataclasses.fields(CalibrationSettings) if f.default is not dataclasses.MISSING}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = _defaults()
    add_model_arguments(parser)
    add_depth_arguments(parser)
    parser.add_argument(
        "--data", type=Path, required=True, help="held-out plain UTF-8 text; prompts are the first words of its lines"
    )
    parser.add_argument(
        "--out", type=argtypes.output_file, required=True, help="profile YAML to write (its folder must exist)"
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="the model_name the service reports and the alerts select on (default: the name `serve` gives the "
        f"model: the checkpoint folder's name, {DEMO_MODEL_NAME} for the embedded demo model)",
    )
    parser.add_argument(
        "--threshold",
        type=argtypes.fraction,
        default=defaults["threshold"],
        help="tau (default: the threshold the gates were trained for)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="chat traffic: each prompt is a whole line of --data sent as one user message, rendered by the model's "
        "chat template as /v1/chat/completions renders it (default: completions of a line's first 2-6 words)",
    )
    parser.add_argument("--prompts", type=int, default=defaults["prompts"], help="requests in the baseline")
    parser.add_argument(
        "--max-new-tokens", type=int, default=defaults["max_new_tokens"], help="tokens generated per request"
    )
    parser.add_argument("--temperature", type=float, default=defaults["temperature"])
    parser.add_argument("--top-p", type=float, default=defaults["top_p"])
    parser.add_argument("--seed", type=int, default=defaults["seed"])
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=defaults["chunk_tokens"],
        help="decoded tokens per chunk when measuring how much window statistics vary",
    )
    parser.add_argument(
        "--margin", type=float, default=defaults["margin"], help="added on both sides of each measured band"
    )
    parser.add_argument(
        "--shadow-rate-min",
        type=argtypes.fraction,
        default=defaults["shadow_rate_min"],
        help="the shadow rate the model's shims are expected to run at (written to the profile; 0: none expected)",
    )
    parser.add_argument(
        "--accept-unhealthy",
        action="store_true",
        help="write the profile even when the baseline shows what its alerts page on (static routing, low shadow "
        "agreement, a high quality cost, gates that cost more than +5%% estimated perplexity where their skips are "
        'executed, at the served batch or at batch 1, gates that rank no tokens; docs/alerting.md, "What calibrate '
        'measures"); without it such a baseline is refused with exit 2',
    )
    parser.add_argument(
        "--min-observations",
        type=int,
        default=defaults["min_observations"],
        help="entropies the exporter window needs before the single-peak alert may fire",
    )


def run(args: argparse.Namespace) -> int:
    from layerwatch.alerts.profile_file import ProfileError, dump_profile
    from layerwatch.inference_shim.offline.calibration import CalibrationSettings, UnhealthyBaseline, calibrate
    from layerwatch.inference_shim.offline.corpus import read_documents

    try:  # before the model loads: a bad number fails at once
        settings = CalibrationSettings(
            model_name=served_model_name(args.model, args.model_name),
            threshold=args.threshold,
            prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            chat=args.chat,
            chunk_tokens=args.chunk_tokens,
            margin=args.margin,
            min_observations=args.min_observations,
            shadow_rate_min=args.shadow_rate_min,
            kv_policy=args.kv_policy,
            batch_size=args.batch_size,
            depth=depth_from_arguments(args),
            accept_unhealthy=args.accept_unhealthy,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def prepare():
        return load_from_arguments(args), read_documents(args.data)

    prepared = report_errors(prepare)
    if prepared is None:
        return 2
    gated, documents = prepared
    try:
        result = calibrate(gated, documents, settings, data_name=args.data.name)
    except UnhealthyBaseline as exc:
        return _refuse(args.out, [str(exc)])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report(result, args.margin)
    problems = result.problems()
    if problems and not args.accept_unhealthy:
        return _refuse(args.out, problems)
    try:
        dump_profile(result.profile, args.out)
    except (OSError, ValueError, ProfileError) as exc:  # (OSError: the folder went away during the run)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"warning: an unhealthy baseline, written as asked (--accept-unhealthy): {problem}")
    print(f"wrote {args.out}")
    return 0


def _refuse(out: Path, problems: list[str]) -> int:
    print(
        f"error: an unhealthy baseline, {out} not written: {'; '.join(problems)} (--accept-unhealthy writes it anyway)",
        file=sys.stderr,
    )
    return 2


def report(result: Calibration, margin: float) -> None:
    """What the baseline measured and the profile's limits cut from it, for the terminal."""
    from layerwatch.alerts.baseline import ascii_histogram, baseline_summary

    profile, stats = result.profile, result.stats
    print(
        f"baseline: {result.requests} requests, {result.decoded_tokens} decoded tokens, {stats.observations} gate "
        f"entropies, skipped {stats.skip_ratio:.1%}, fallbacks {result.fallbacks}"
    )
    print("\n".join(baseline_summary(stats, profile)))
    tokens, agreements = result.shadow_total("tokens"), result.shadow_total("agreements")
    checked = max(tokens, 1)
    print(
        f"shadow check ({len(result.shadow_checks)} requests, {tokens:.0f} tokens, the baseline's own sampling): "
        f"agreement of the gated and full-depth top-1 {agreements:.0f}/{tokens:.0f} = {agreements / checked:.3f}, "
        f"alert floor {profile.shadow_agreement_min}; quality cost KL(gated || full) "
        f"{result.shadow_total('kl_nats') / checked:.4f} nats per token, alert above {profile.shadow_kl_nats_max}; "
        f"estimated perplexity increase {math.expm1(result.shadow_total('reverse_kl_nats') / checked):+.2%}; "
        f"shadow rate expected at least {profile.shadow_rate_min:g}"
    )
    for quality in result.quality:
        print(f"executed depth {quality.summary()}")
    served, gp = result.gate_importance.served, profile.gate_importance
    drills = "; ".join(f"{flag} reads {_span(r.headline)}" for flag, r in result.gate_importance.drills.items())
    if result.gates_vary:
        print(
            "gate-importance correlation (the shim's gauge over the probed shadow passes: per layer, Spearman of "
            f"the last {GATE_LAYER_SAMPLES} (gate score, next update) pairs, the mean over the layers whose gates "
            f"vary; {len(served.headline)} readings): {_span(served.headline)}; page below {gp.correlation_min} "
            f"(half the lowest, at least {margin:g} below it); {drills}"
        )
        print(
            f"  per layer ({len(gp.layer_floors)} counted in every reading), median (floor): "
            + " ".join(f"{layer}:{gp.layer_baselines[layer]:.3f} ({floor})" for layer, floor in gp.layer_floors.items())
        )
    else:
        print(
            "gate-importance correlation: no layer's gate scores varied over the baseline (standard deviation "
            f"below {MIN_GATE_SCORE_STD}): there is no ranking of tokens to calibrate, the shim's gate-importance "
            f"correlation stays absent and LayerwatchGateMiscalibrated silent; the profile keeps its default "
            f"floor {gp.correlation_min}"
        )
    fractions, tail = result.request_skip_fractions, profile.request_tail
    above = sum(f > tail.runaway_skip_fraction for f in fractions) / len(fractions)
    print(
        f"request tail: {len(fractions)} requests skipped {_span(fractions)} of their decode layer evaluations "
        f"(std {statistics.stdev(fractions) if len(fractions) > 1 else 0.0:.4f}); runaway above "
        f"{tail.runaway_skip_fraction:g} ({above:.1%} of them), page above a share of {tail.normal_share}"
    )
    print("20-bin histogram of decode-time entropies (all layers):")
    print(ascii_histogram(stats.histogram))


def _span(values: list[float]) -> str:
    return f"{min(values):.3f} to {max(values):.3f}" if values else "n/a"
