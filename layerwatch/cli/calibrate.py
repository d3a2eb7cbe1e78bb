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
from dataclasses import dataclass
from pathlib import Path

from layerwatch import argtypes
from layerwatch.alerts.profile_file import ProfileError, dump_profile
from layerwatch.catalog import GATE_LAYER_SAMPLES, MIN_GATE_SCORE_STD
from layerwatch.cli.model_arguments import GatedModelSettings, load_gated, report_errors
from layerwatch.inference_shim.offline.calibration import (
    Calibration,
    CalibrationSettings,
    UnhealthyBaseline,
    calibrate,
)
from layerwatch.inference_shim.offline.corpus import read_documents
from layerwatch.inference_shim.runtime.demo_model import served_model_name
from layerwatch.inference_shim.runtime.depth_execution import DepthExecutionConfig
from layerwatch.inference_shim.service.settings import ModelSettings, SkippingSettings
from layerwatch.settings import add_flags, flag_of, from_flags, same_as, setting


@dataclass(frozen=True, kw_only=True)
class CalibrateSettings(GatedModelSettings):
    """Which gated model's baseline to measure on which text, and where its profile goes; the baseline's
    knobs are CalibrationSettings', whose checks refuse a bad number before the model loads."""

    # How a batch runs the layers its rows decided (runtime/depth_execution.py), as `serve` runs them.
    depth_execution: str = same_as(SkippingSettings, "depth_execution")
    batch_consensus: float | None = same_as(SkippingSettings, "batch_consensus")
    data: Path = setting(type=Path, required=True, help="held-out plain UTF-8 text; prompts are cut from its lines")
    out: Path = setting(type=argtypes.output_file, required=True, help="profile YAML to write (its folder must exist)")
    model_name: str | None = same_as(ModelSettings, "model_name")  # the one the alerts select on
    threshold: float | None = same_as(SkippingSettings, "threshold")
    chat: bool = same_as(CalibrationSettings, "chat")
    prompts: int = same_as(CalibrationSettings, "prompts")
    max_new_tokens: int = same_as(CalibrationSettings, "max_new_tokens")
    temperature: float = same_as(CalibrationSettings, "temperature")
    top_p: float = same_as(CalibrationSettings, "top_p")
    seed: int = same_as(CalibrationSettings, "seed")
    chunk_tokens: int = same_as(CalibrationSettings, "chunk_tokens")
    margin: float = same_as(CalibrationSettings, "margin")
    shadow_rate_min: float = same_as(CalibrationSettings, "shadow_rate_min")
    accept_unhealthy: bool = same_as(CalibrationSettings, "accept_unhealthy")
    min_observations: int = same_as(CalibrationSettings, "min_observations")

    def __post_init__(self) -> None:
        self.calibration()  # CalibrationSettings' checks, with their messages

    def calibration(self) -> CalibrationSettings:
        """The baseline's settings: the model named as `serve` names it, decoded as these flags say."""
        return CalibrationSettings(
            model_name=served_model_name(self.model, self.model_name),
            threshold=self.threshold,
            kv_policy=self.kv_policy,
            batch_size=self.batch_size,
            depth=DepthExecutionConfig(self.depth_execution, self.batch_consensus),
            **{name: getattr(self, name) for name in BASELINE_SETTINGS},
        )


# CalibrationSettings' own flags, the knobs of the baseline.
BASELINE_SETTINGS = tuple(f.name for f in dataclasses.fields(CalibrationSettings) if flag_of(f) is not None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, CalibrateSettings)


def run(args: argparse.Namespace) -> int:
    try:  # before the model loads: a bad number fails at once
        settings = from_flags(CalibrateSettings, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def prepare():
        return load_gated(settings), read_documents(settings.data)

    prepared = report_errors(prepare)
    if prepared is None:
        return 2
    gated, documents = prepared
    try:
        result = calibrate(gated, documents, settings.calibration(), data_name=settings.data.name)
    except UnhealthyBaseline as exc:
        return _refuse(settings.out, [str(exc)])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report(result, settings.margin)
    problems = result.problems()
    if problems and not settings.accept_unhealthy:
        return _refuse(settings.out, problems)
    try:
        dump_profile(result.profile, settings.out)
    except (OSError, ValueError, ProfileError) as exc:  # (OSError: the folder went away during the run)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"warning: an unhealthy baseline, written as asked (--accept-unhealthy): {problem}")
    print(f"wrote {settings.out}")
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
