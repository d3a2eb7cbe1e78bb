"""`layerwatch calibrate` writes a profile the alert generator accepts, measured from the decode run."""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from layerwatch.alerts.baseline import (
    MAX_HEALTHY_KL_NATS,
    MAX_HEALTHY_SHAPE_DISTANCE,
    MIN_HEALTHY_AGREEMENT,
    MIN_REQUEST_NORMAL_SHARE,
    GateReadings,
    agreement_floor,
    ascii_histogram,
    baseline_problems,
    build_profile,
    gate_importance_floor,
    gate_importance_profile,
    quality_cost_limit,
    request_tail_profile,
    skip_collapse_fraction,
)
from layerwatch.alerts.profile import GateImportance, RequestTail
from layerwatch.alerts.profile_file import dump_profile, load_profile
from layerwatch.catalog import GATE_LAYER_SAMPLES, REQUEST_FRACTION_BUCKETS
from layerwatch.cli.main import build_parser, main
from layerwatch.inference_shim.offline.calibration import (
    Baseline,
    CalibrationSettings,
    ExecutedQuality,
    calibrate,
    chat_messages,
    encode_prompt,
    generate_baseline,
    line_prompts,
)
from layerwatch.inference_shim.offline.corpus import read_documents
from layerwatch.inference_shim.offline.gated_model import load_gated_model
from layerwatch.inference_shim.runtime.agreement import ShadowResult
from layerwatch.inference_shim.runtime.checkpoint import save_checkpoint
from layerwatch.inference_shim.runtime.depth_execution import DepthExecutionConfig
from layerwatch.inference_shim.runtime.gates import GateMetadata, model_fingerprint, save_gates
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.routing import DEFAULT_MIN_ROUTING_TOKENS
from layerwatch.skip_policy import SkipPolicyConfig
from layerwatch.statistics import DEFAULT_MIN_WINDOW_OBSERVATIONS, histogram20, shape_distance
from tests.model.conftest import build_backend_tokenizer, random_gates, random_model
from tests.model.test_eval_decode import model_dir, text_file  # noqa: F401 (fixtures)

# The shim's gate-importance buffers hold GATE_LAYER_SAMPLES (1024) pairs per layer, 31 per request of
# 32 tokens: they fill after 34 shadow-checked requests, so the baseline needs a few more than that.
TINY_PROMPTS, TINY_TOKENS = 40, 32


@pytest.fixture(scope="module")
def varying_model_dir(tmp_path_factory):
    """The tiny model with freshly initialised gates: their scores vary from token to token (the
    fixture `model_dir`'s gates are constants), so there is a ranking of tokens to calibrate."""
    directory = tmp_path_factory.mktemp("tiny-varying")
    model = random_model()
    save_checkpoint(
        model, Tokenizer(build_backend_tokenizer(), bos_token="<s>", eos_tokens=["</s>"], add_bos_token=True), directory
    )
    metadata = GateMetadata(
        num_layers=4, hidden_size=32, threshold=0.18, patience=3, base_fingerprint=model_fingerprint(model)
    )
    save_gates(directory / "gates.safetensors", random_gates(model.config), metadata)
    return directory


def run_calibrate(model: Path, text: Path, out: Path, *extra: str) -> int:
    """`layerwatch calibrate` on the tiny model with a baseline just long enough for its checks."""
    sizes = ["--prompts", str(TINY_PROMPTS), "--max-new-tokens", str(TINY_TOKENS), "--threads", "1"]
    windows = ["--chunk-tokens", "64", "--min-observations", "50"]
    data = ["--model", str(model), "--data", str(text), "--out", str(out)]
    return main(["calibrate", *data, *sizes, *windows, *extra])


def test_calibrate_refuses_a_static_baseline_and_writes_it_only_when_told_to(
    model_dir,  # noqa: F811
    text_file,  # noqa: F811
    tmp_path,
    capsys,
):
    # The tiny model's constant gates skip the same layer for every token: what LayerwatchRoutingStatic
    # pages on. Written as the healthy profile, its routing floor (0) could never page. They also cost
    # far past +10 % estimated perplexity one request at a time: refused on that, before the
    # gate-importance passes.
    out = tmp_path / "tiny.yaml"
    assert run_calibrate(model_dir, text_file, out) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: an unhealthy baseline, {out} not written: the gates cost +")
    assert "at batch 1, depth execution auto, consensus 0.5, past the +10% a healthy baseline may cost" in line
    assert line.endswith("(--accept-unhealthy writes it anyway)") and not out.exists()

    code = run_calibrate(model_dir, text_file, out, "--accept-unhealthy")
    assert code == 0, capsys.readouterr().err
    profile = load_profile(out)
    # Named as `serve` names the model: after its folder (the flag's default was the demo model's name).
    assert profile.model_name == model_dir.name and profile.threshold == 0.18 and profile.patience == 3
    # The tiny model's gates: layers 0, 1, 3 score ~0, layer 2 ~1. Only layer 1 is skippable and low,
    # and only after each sequence's first `patience` decode steps: at most (32 - 3) / 32 of a quarter.
    assert 0.0 < profile.skip_ratio_normal <= (32 - 3) / 32 / 4
    assert profile.zero_ratio.low <= 0.75 <= profile.zero_ratio.high
    assert profile.bimodality.min_observations == 50
    assert f"{TINY_PROMPTS} prompts from heldout.txt" in profile.source
    served_as = "kv policy project, batch 8, depth execution auto, consensus 0.5; layer evaluations skipped"
    assert served_as in profile.source
    out = capsys.readouterr().out
    # Quality where the skips are executed, as served (batch 8) and one request at a time.
    assert "executed depth at batch 8, depth execution auto, consensus 0.5: skipped " in out
    assert "executed depth at batch 1, depth execution auto, consensus 0.5: skipped " in out
    assert "bimodal" in out and "agreement of the gated and full-depth top-1" in out
    assert "quality cost KL(gated || full)" in out and f"alert above {profile.shadow_kl_nats_max}" in out
    assert 0.0 <= profile.shadow_agreement_min <= 1.0
    # Layers 0, 1 and 3 score ~0 on every token (static by their scores, protected or not), layer 2
    # ~1: no skipping depends on the token, so the share is 0 and its floor can never page.
    assert profile.routing.static_layers == (0, 1, 3)
    assert (profile.routing.token_dependent_share, profile.routing.share_floor) == (0.0, 0.0)
    assert "routing: static, token-dependent share 0.000" in out
    # Measured, not the schema's defaults (0.5 and 0.01), and within their validity rules (load_profile
    # checked the rest: a bucket edge above skip_ratio_normal, shares below 1).
    tail = profile.request_tail
    assert tail.runaway_skip_fraction in REQUEST_FRACTION_BUCKETS
    assert profile.skip_ratio_normal < tail.runaway_skip_fraction < 0.5
    assert MIN_REQUEST_NORMAL_SHARE <= tail.normal_share < 1.0
    # Constant gates rank no tokens: nothing to calibrate, said so, and the schema's default floor kept.
    assert "gate-importance correlation: no layer's gate scores varied over the baseline" in out
    accepted = "warning: an unhealthy baseline, written as asked (--accept-unhealthy): "
    assert f"{accepted}routing static: token-dependent share 0.000" in out
    assert f"{accepted}no gate's score varied over the baseline" in out
    assert profile.gate_importance == GateImportance()
    assert f"request tail: {TINY_PROMPTS} requests skipped" in out
    assert (
        f"runaway above {tail.runaway_skip_fraction:g} (0.0% of them), page above a share of {tail.normal_share}" in out
    )


def test_calibrate_measures_the_gate_floors_and_the_request_tail_from_its_own_baseline(
    varying_model_dir,
    text_file,  # noqa: F811
):
    gated = load_gated_model(varying_model_dir, threads=1)
    documents = read_documents(text_file)
    settings = CalibrationSettings("tiny", prompts=TINY_PROMPTS, max_new_tokens=TINY_TOKENS, chunk_tokens=64)
    result = calibrate(gated, documents, settings, data_name="heldout.txt")
    profile = result.profile
    served, g = result.gate_importance.served, profile.gate_importance

    # Every baseline request (sampled, at the settings' temperature) is shadow-checked on its own record,
    # and the limits come from those checks.
    assert len(result.shadow_checks) == TINY_PROMPTS and result.shadow_total("tokens") == result.decoded_tokens
    # ... and the same prompts decoded one at a time: the limits hold for both.
    as_served, one_at_a_time = result.quality
    assert (as_served.batch_size, one_at_a_time.batch_size) == (8, 1) and as_served.checks == result.shadow_checks
    assert len(one_at_a_time.checks) == TINY_PROMPTS
    # At batch 1 every decided skip runs: nothing decided is left to the batch.
    assert one_at_a_time.executed_skip_share == one_at_a_time.decided_skip_share
    limits = [quality_cost_limit(q.checks, settings.chunk_tokens) for q in result.quality]
    assert profile.shadow_kl_nats_max == max(limits) > 0
    floors = [agreement_floor([(c.tokens, c.agreements) for c in q.checks], 64, 0.03) for q in result.quality]
    assert profile.shadow_agreement_min == min(floors)
    assert profile.shadow_rate_min == settings.shadow_rate_min == 0.01
    # The gauges after every shadow pass once the buffers were full: 31 pairs per request and layer.
    assert served.samples == 4 * GATE_LAYER_SAMPLES and 0 < len(served.headline) <= TINY_PROMPTS - 33
    assert len(served.layers) == len(served.headline) and all(len(row) == 4 for row in served.layers)
    assert g.correlation_min == gate_importance_floor(served.headline, settings.margin)
    # (at least the margin below the lowest reading, up to the profile's rounding to 0.001)
    assert g.correlation_min <= min(served.headline) - settings.margin + 5e-4 and result.gates_vary
    assert g.correlation == round(float(np.median(served.headline)), 3)
    # A floor and a baseline for every layer that counted in every reading, by the same rule.
    layers = np.array(served.layers)
    counted = [layer for layer in range(4) if np.isfinite(layers[:, layer]).all()]
    assert counted and sorted(g.layer_floors) == sorted(g.layer_baselines) == counted
    for layer in counted:
        assert g.layer_floors[layer] == gate_importance_floor(layers[:, layer].tolist(), settings.margin)
        assert g.layer_baselines[layer] == round(float(np.median(layers[:, layer])), 3)
    # Both drills scored the same passes.
    assert set(result.gate_importance.drills) == {"--shuffle-gates", "--scramble-gates"}
    for drill in result.gate_importance.drills.values():
        assert drill.samples == served.samples and len(drill.headline) == len(served.headline)
    # A drill is reported when one of its readings reaches the floor (the alert cannot tell it apart).
    highest = {flag: max(r.headline) for flag, r in result.gate_importance.drills.items()}

    def with_floor(floor: float):
        return dataclasses.replace(
            result, profile=dataclasses.replace(profile, gate_importance=dataclasses.replace(g, correlation_min=floor))
        )

    assert with_floor(max(highest.values()) + 0.001).drills_above_the_floor() == []
    lowest_drill = min(highest, key=highest.__getitem__)
    assert with_floor(highest[lowest_drill]).drills_above_the_floor() == [
        flag for flag in highest if highest[flag] >= highest[lowest_drill]
    ]

    # One request per prompt, its skip fraction from its own decode steps: the same numbers as the
    # recorded steps grouped by sequence.
    assert len(result.request_skip_fractions) == TINY_PROMPTS
    steps = []

    class Recording(Baseline):
        def record(self, step) -> None:
            super().record(step)
            steps.append(step)

    threshold = gated.gates.metadata.threshold
    generate_baseline(
        gated,
        SkipPolicyConfig(threshold=threshold, patience=gated.patience),
        line_prompts(documents, TINY_PROMPTS, random.Random(settings.seed)),
        Recording(),
        model_name="tiny",
        kv_policy=settings.kv_policy,
        batch_size=settings.batch_size,
        depth=settings.depth,
        max_new_tokens=TINY_TOKENS,
        temperature=settings.temperature,
        top_p=settings.top_p,
        seed=settings.seed,
    )
    skipped: dict[int, list[np.ndarray]] = {}
    for step in steps:
        for sequence, row in zip(step.sequence_ids.tolist(), step.skipped):
            skipped.setdefault(sequence, []).append(row)
    by_steps = sorted(float(np.mean(rows)) for rows in skipped.values())
    assert sorted(result.request_skip_fractions) == pytest.approx(by_steps, abs=1e-12)
    assert profile.request_tail == request_tail_profile(result.request_skip_fractions, profile.skip_ratio_normal)
    assert max(result.request_skip_fractions) < profile.request_tail.runaway_skip_fraction


def test_chat_baseline_sends_whole_lines_through_the_chat_template():
    """An instruction-tuned model is served chat traffic (SmolLM2-135M-Instruct's profile):
    `calibrate --chat` sends each line of the text, whole, as one user message rendered by the model's
    chat template with the assistant's turn opened, encoded as /v1/chat/completions encodes it."""
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer = Tokenizer(build_backend_tokenizer(), bos_token="<s>", eos_tokens=["</s>"], chat_template=template)
    lines = ["What is the capital of France?", "Hi", "Write a short poem about the sea."]
    messages = chat_messages(["\n".join(lines)], 20, random.Random(0))
    assert set(messages) == {lines[0], lines[2]}  # whole lines of three words or more
    ids = encode_prompt(tokenizer, lines[0], chat=True)
    assert ids == tokenizer.encode(f"<|user|>{lines[0]}\n<|assistant|>", add_special_tokens=False)
    assert encode_prompt(tokenizer, lines[0], chat=False) == tokenizer.encode(lines[0])
    with pytest.raises(ValueError, match="no line of three words or more"):
        chat_messages(["Hi\nthere you"], 3, random.Random(0))
    parser = build_parser(["calibrate"], environ={})
    assert parser.parse_args(["calibrate", "--data", "x", "--out", "y", "--chat"]).chat
    assert not parser.parse_args(["calibrate", "--data", "x", "--out", "y"]).chat


def test_calibrate_decodes_its_baseline_with_the_depth_execution_it_is_given(
    model_dir,  # noqa: F811
    text_file,  # noqa: F811
    tmp_path,
    capsys,
):
    # As the model will be served: a profile says which execution its baseline ran.
    out = tmp_path / "rows.yaml"
    depth = ["--depth-execution", "rows", "--batch-consensus", "off"]
    assert run_calibrate(model_dir, text_file, out, *depth, "--accept-unhealthy") == 0
    assert "depth execution rows; layer evaluations skipped" in load_profile(out).source
    with pytest.raises(SystemExit):
        run_calibrate(model_dir, text_file, tmp_path / "bad.yaml", "--depth-execution", "layers")
    assert "invalid choice: 'layers'" in capsys.readouterr().err and not (tmp_path / "bad.yaml").exists()


def test_calibrate_refuses_shadow_checks_too_short_for_the_gate_importance_reservoir(
    model_dir,  # noqa: F811
    text_file,  # noqa: F811
    tmp_path,
    capsys,
):
    out = tmp_path / "p.yaml"
    # (accepted as unhealthy: these constant gates' cost would stop the run before the re-checks)
    args = ["--prompts", "6", "--max-new-tokens", "12", "--chunk-tokens", "16", "--threads", "1", "--accept-unhealthy"]
    assert main(["calibrate", "--model", str(model_dir), "--data", str(text_file), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert f"fewer than the {GATE_LAYER_SAMPLES} per layer the gate-importance correlation needs" in err
    assert not out.exists()


def test_gate_importance_floor_is_half_the_lowest_reading_and_separates_the_drills():
    # The demo model's healthy readings at calibration (within layers: 0.089-0.137) and its drills'
    # (shuffled -0.023 to 0.002): half the lowest healthy reading lies above every shuffled one.
    floor = gate_importance_floor([0.137, 0.089, 0.11], margin=0.03)
    assert floor == 0.044 and floor > 0.002
    # Near 0, half is not far enough below: at least the margin.
    assert gate_importance_floor([0.04, 0.2], margin=0.03) == 0.01
    # Gates that do not track their layers (a reading at or below 0): still below every reading.
    assert gate_importance_floor([-0.2, 0.1], margin=0.03) == -0.23
    assert gate_importance_floor([-0.99], margin=0.03) == -1.0  # a correlation: never below -1
    with pytest.raises(ValueError, match="never filled the buffers"):
        gate_importance_floor([], margin=0.03)


def test_gate_importance_profile_floors_only_the_layers_measured_in_every_reading():
    nan = float("nan")
    readings = GateReadings(
        headline=[0.1, 0.12, 0.08],
        layers=[[nan, 0.2, 0.0, 0.1], [nan, 0.25, nan, 0.12], [nan, 0.15, 0.05, 0.14]],
        samples=3000,
    )
    g = gate_importance_profile(readings, margin=0.03)
    assert (g.correlation_min, g.correlation) == (0.04, 0.1)
    # Layer 0's gate never varied, layer 2's not in every reading: neither gets a floor.
    assert g.layer_baselines == {1: 0.2, 3: 0.12} and g.layer_floors == {1: 0.075, 3: 0.05}
    with pytest.raises(ValueError, match="never filled the buffers"):
        gate_importance_profile(GateReadings([], [], 0), margin=0.03)


def test_request_tail_cutoff_is_the_next_bucket_edge_above_the_healthy_maximum_plus_one_std():
    # The demo model's shape: 0.20-0.34, mean 0.27.
    fractions = list(np.random.default_rng(0).uniform(0.20, 0.30, 127)) + [0.34]
    spread = float(np.std(fractions, ddof=1))
    tail = request_tail_profile(fractions, skip_ratio_normal=0.27)
    assert 0.34 + spread > 0.35 and tail.runaway_skip_fraction == 0.4
    # None above it in 128 requests: the 90 % Wilson upper bound z^2 / (n + z^2) = 0.0127, rounded up.
    assert tail.normal_share == 0.013
    # More requests, none above: the bound shrinks below the floor.
    assert request_tail_profile(fractions * 10, skip_ratio_normal=0.27).normal_share == MIN_REQUEST_NORMAL_SHARE
    # A fraction on an edge plus no spread: the cut-off is strictly above it (`runaway` is strict too).
    assert request_tail_profile([0.25] * 50, skip_ratio_normal=0.25).runaway_skip_fraction == 0.3
    # Always above the normal skip ratio, even if every request skipped less (weighted differently).
    assert request_tail_profile([0.1, 0.12], skip_ratio_normal=0.21).runaway_skip_fraction == 0.25
    # Healthy requests beyond the highest edge below 1: that edge, and the share above it, bounded.
    high = request_tail_profile([0.9, 0.96, 0.97, 0.9], skip_ratio_normal=0.9)
    assert high.runaway_skip_fraction == 0.95 and 0.5 < high.normal_share < 1.0
    with pytest.raises(ValueError, match="no request"):
        request_tail_profile([], skip_ratio_normal=0.2)


def test_request_tail_and_gate_floor_reach_the_profile(tmp_path):
    rng = np.random.default_rng(2)
    entropies = np.concatenate([rng.normal(0.1, 0.02, (400, 4)), rng.normal(0.3, 0.02, (400, 4))], axis=1)
    skipped = entropies < 0.18
    kwargs = dict(chunk_tokens=100, margin=0.03, min_observations=100, source="")
    measured, _ = build_profile(
        "m",
        0.18,
        3,
        0.85,
        entropies,
        skipped,
        0.8,
        gate_importance=GateImportance(-0.2, 0.05, {3: 0.1}, {3: -0.1}),
        request_skip_fractions=[0.45, 0.5, 0.55],
        **kwargs,
    )
    assert measured.gate_importance == GateImportance(-0.2, 0.05, {3: 0.1}, {3: -0.1})
    assert measured.request_tail == request_tail_profile([0.45, 0.5, 0.55], measured.skip_ratio_normal)
    dump_profile(measured, tmp_path / "m.yaml")
    assert load_profile(tmp_path / "m.yaml") == measured
    # Not measured: the schema's defaults.
    default, _ = build_profile("m", 0.18, 3, 0.85, entropies, skipped, 0.8, **kwargs)
    assert default.request_tail == RequestTail() and default.gate_importance == GateImportance()


def test_calibrate_flag_defaults_are_the_library_constants():
    parser = build_parser(["calibrate"], environ={})
    calibrate = parser._subparsers._group_actions[0].choices["calibrate"]
    args = calibrate.parse_args(["--data", "d.txt", "--out", "p.yaml"])
    assert args.min_observations == DEFAULT_MIN_WINDOW_OBSERVATIONS == CalibrationSettings("m").min_observations
    assert (args.chunk_tokens, args.margin, args.prompts) == (512, 0.03, 128)


def test_calibrate_refuses_a_text_without_prompts(model_dir, tmp_path, capsys):  # noqa: F811
    text = tmp_path / "words.txt"
    text.write_text("one\ntwo words\n")
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(model_dir),
                "--data",
                str(text),
                "--out",
                str(tmp_path / "p.yaml"),
                "--threads",
                "1",
            ]
        )
        == 2
    )
    assert "no line of three words" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()


def test_bands_cover_every_chunk_with_the_margin():
    rng = np.random.default_rng(0)
    # Layers 0-3 redundant (~0.1), layers 4-7 key (~0.3), 400 decoded tokens.
    entropies = np.concatenate([rng.normal(0.1, 0.02, (400, 4)), rng.normal(0.3, 0.02, (400, 4))], axis=1)
    skipped = entropies < 0.18
    profile, stats = build_profile(
        "m", 0.18, 3, 0.85, entropies, skipped, 0.8, chunk_tokens=100, margin=0.01, min_observations=100, source="test"
    )
    active_means = [entropies[i : i + 100][~skipped[i : i + 100]].mean() for i in range(0, 400, 100)]
    # The profile keeps 4 decimals: within 5e-5 of the value.
    assert profile.entropy_mean.low == pytest.approx(min(active_means) - 0.01, abs=1e-4)
    assert profile.entropy_mean.high == pytest.approx(max(active_means) + 0.01, abs=1e-4)
    assert profile.skip_ratio_normal == pytest.approx(0.5, abs=0.01)
    assert stats.bimodality.bimodal and stats.bimodality.peaks == 2
    assert sum(stats.histogram) == entropies.size
    # Layers 0-3 below tau on every token: all of the skipping is static pruning.
    assert profile.routing.static_layers == (0, 1, 2, 3) and profile.routing.token_dependent_share == 0.0


def test_a_zero_margin_on_one_chunk_still_writes_a_shape_limit_the_profile_accepts(tmp_path):
    """`calibrate --margin 0` (allowed) on a baseline of one chunk measured a
    shape distance of 0, a limit the profile refuses (strictly positive): the whole calibration ran, then
    exit 2 and no profile."""
    rng = np.random.default_rng(0)
    entropies = np.where(rng.random((100, 8)) < 0.4, rng.random((100, 8)) * 0.1, 0.7 + rng.random((100, 8)) * 0.3)
    profile, _ = build_profile(
        "m",
        0.18,
        3,
        0.85,
        entropies,
        entropies < 0.18,
        0.8,
        chunk_tokens=100,
        margin=0.0,
        min_observations=100,
        source="",
    )
    assert profile.bimodality.shape_distance_max == 0.0001  # the profile's unit: a limit of no healthy departure
    dump_profile(profile, tmp_path / "m.yaml")
    assert load_profile(tmp_path / "m.yaml") == profile


def test_routing_baseline_floor_and_static_layers():
    rng = np.random.default_rng(1)
    tokens, chunk = 2000, 500
    # Layers 0-1 always low (static), 2-3 low on a random half of the tokens, 4-5 high; layer 4 is
    # low on every token of the second chunk only (static there: expected, not paged).
    low = np.zeros((tokens, 6), dtype=bool)
    low[:, :2] = True
    low[:, 2:4] = rng.random((tokens, 2)) < 0.5
    low[chunk : 2 * chunk, 4] = True
    entropies = np.where(low, rng.normal(0.1, 0.02, low.shape), rng.normal(0.3, 0.02, low.shape))
    profile, stats = build_profile(
        "m", 0.18, 3, 0.85, entropies, low, 0.8, chunk_tokens=chunk, margin=0.03, min_observations=100, source=""
    )
    routing = profile.routing
    assert routing.static_layers == (0, 1, 4)
    whole = 1 - 2 * tokens / low.sum()  # static mass: layers 0-1 (layer 4 is not static over the whole)
    assert routing.token_dependent_share == pytest.approx(whole, abs=1e-4)  # kept to 4 decimals: within 5e-5
    chunk_shares = [
        1 - low[i : i + chunk][:, [0, 1, 4] if i == chunk else [0, 1]].sum() / low[i : i + chunk].sum()
        for i in range(0, tokens, chunk)
    ]
    assert routing.share_floor == round(0.5 * min(chunk_shares), 3)
    assert routing.min_tokens == DEFAULT_MIN_ROUTING_TOKENS
    assert stats.routing.verdict == "static" and stats.routing.static_layers == (0, 1)  # share 0.38 < 0.5


def test_skip_collapse_fraction_keeps_every_healthy_chunk_above_the_limit():
    assert skip_collapse_fraction(0.3, [0.28, 0.31], margin=0.03) == 0.5  # the default
    assert skip_collapse_fraction(0.3, [0.1, 0.31], margin=0.03) == round(0.07 / 0.3, 3)  # lowered
    assert skip_collapse_fraction(0.3, [0.02], margin=0.03) == 0.01  # never 0 or below
    assert skip_collapse_fraction(0.0, [0.0], margin=0.03) == 0.5  # nothing skipped: no limit to place


def test_too_short_a_baseline_is_refused():
    with pytest.raises(ValueError, match="fewer than one chunk"):
        build_profile(
            "m",
            0.18,
            3,
            0.85,
            np.zeros((5, 4)),
            np.zeros((5, 4), bool),
            0.9,
            chunk_tokens=10,
            margin=0.0,
            min_observations=1,
            source="",
        )


def test_ascii_histogram_scales_bars_to_the_tallest_bin():
    counts = [0] * 20
    counts[2], counts[6] = 10, 5
    lines = ascii_histogram(counts, width=10).splitlines()
    assert len(lines) == 20
    assert lines[2].startswith("[0.10, 0.15) ##########") and lines[2].endswith(" 10")
    assert lines[6].count("#") == 5 and lines[19].startswith("[0.95, 1.00]")


def test_agreement_floor_is_the_worst_chunk_minus_the_margin():
    # (tokens, agreements) per request; chunks close once they hold >= 20 tokens.
    checks = [(10, 10), (10, 9), (12, 6), (10, 10), (5, 5)]  # chunks: 19/20, 16/22; the 5-token tail is dropped
    assert agreement_floor(checks, chunk_tokens=20, margin=0.05) == round(16 / 22 - 0.05, 3)
    with pytest.raises(ValueError, match="fewer than one chunk"):
        agreement_floor([(5, 5)], chunk_tokens=20, margin=0.0)


@pytest.mark.parametrize(
    "flags, message",
    [
        # --margin nan would write every band as [0, 1], alerts that never fire, and exit 0.
        (["--margin", "nan"], "--margin must be a number in [0, 1), got nan"),
        (["--temperature", "inf"], "--temperature must be in [0, 2.0], got inf"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--min-observations", "100000"], "--min-observations must be 1..72000"),
    ],
)
def test_calibrate_refuses_numbers_that_would_write_a_useless_profile(tmp_path, capsys, flags, message):
    out = tmp_path / "p.yaml"
    argv = ["calibrate", "--model", str(tmp_path / "never-loaded"), "--data", str(tmp_path / "x"), "--out", str(out)]
    assert main([*argv, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        # Before: calibrated for 2 min 7 s, then a FileNotFoundError traceback, exit 1.
        (["--out", "/nonexistent-folder/p.yaml"], "cannot write /nonexistent-folder/p.yaml: the folder"),
        # Before: wrote a profile that load_profile refuses (outside [0, 1]), exit 0.
        (["--shadow-rate-min", "5"], "argument --shadow-rate-min: must be in [0, 1], got 5"),
        (["--shadow-rate-min", "nan"], "argument --shadow-rate-min: must be in [0, 1], got nan"),
    ],
)
def test_calibrate_refuses_an_output_it_cannot_write_or_read_back_before_the_run(tmp_path, capsys, flags, message):
    argv = ["calibrate", "--model", str(tmp_path / "never-loaded"), "--data", str(tmp_path / "x")]
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--out", str(tmp_path / "p.yaml"), *flags])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_calibrate_chat_with_a_template_that_refuses_one_user_message_is_one_line(
    model_dir,  # noqa: F811
    text_file,  # noqa: F811
    tmp_path,
    capsys,
):
    """Before: a jinja2 TemplateError traceback after the model had loaded (serve answers it with a 400)."""
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message is required') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    out = tmp_path / "p.yaml"
    assert main(["calibrate", "--model", str(folder), "--data", str(text_file), "--out", str(out), "--chat"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: the model's chat template refused a conversation of one user message, which is what --chat sends: "
        "a system message is required\n"
    )
    assert not out.exists()


@pytest.mark.parametrize("command", ["calibrate", "train-gates"])
def test_calibrate_and_train_gates_take_tau_as_eval_and_serve_do(tmp_path, capsys, command):
    """--threshold is a fraction in [0, 1] for every command: a usage error, before anything loads."""
    argv = [command, "--model", str(tmp_path / "never-loaded"), "--data", str(tmp_path / "x"), "--out", "o"]
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--threshold", "nan"])
    assert exit.value.code == 2 and "argument --threshold: must be in [0, 1], got nan" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        # Unguarded, the first three are tracebacks (ValueError,
        # ZeroDivisionError, "range() arg 3 must not be zero"), the last evaluates and exits 0.
        (["--threshold", "nan"], "argument --threshold: must be in [0, 1], got nan"),
        (["--max-tokens", "0"], "argument --max-tokens: must be positive, got 0"),
        (["--batch-size", "0"], "argument --batch-size: must be positive, got 0"),
        (["--prefill", "-1"], "argument --prefill: must be positive, got -1"),
    ],
)
def test_eval_refuses_numbers_it_cannot_use(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit:
        main(["eval", "--data", str(tmp_path / "x"), *flags])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_quality_cost_limit_is_a_factor_over_the_worst_chunk():
    # Nats of KL(gated || full) per request; chunks close once they hold >= 20 tokens.
    checks = [ShadowResult(10, 9, kl_nats=0.4), ShadowResult(10, 9, kl_nats=0.6), ShadowResult(22, 20, kl_nats=2.2)]
    # chunks: 1.0 / 20 = 0.05 and 2.2 / 22 = 0.1 nats per token; the limit is 1.5 x 0.1, rounded up.
    assert quality_cost_limit(checks, chunk_tokens=20) == 0.15
    with pytest.raises(ValueError, match="fewer than one chunk"):
        quality_cost_limit(checks[:1], chunk_tokens=20)
    # A full-depth baseline costs nothing: the limit is the least cost it can state, so any cost pages.
    assert quality_cost_limit([ShadowResult(30, 30)], chunk_tokens=20) == 0.0001


@pytest.mark.parametrize(
    ("reverse_kl_nats", "problem"),
    [
        (100 * math.log(1.10) - 1e-6, None),  # +10.0 %: the bound itself is healthy
        (
            100 * 0.18,  # +19.7 %, what the shipped SmolLM2 gates cost one request at a time
            "the gates cost +19.7% estimated perplexity (agreement 0.780, 0.230 nats per token; 6.0% of layer "
            "evaluations executed skipped) at batch 1, depth execution auto, consensus 0.5, past the +10% a healthy "
            "baseline may cost: the quality alerts would call that loss healthy",
        ),
    ],
)
def test_executed_quality_past_ten_percent_perplexity_is_a_problem_naming_batch_and_mode(reverse_kl_nats, problem):
    checks = [ShadowResult(50, 39, kl_nats=11.5, reverse_kl_nats=reverse_kl_nats / 2)] * 2
    quality = ExecutedQuality(1, DepthExecutionConfig(), checks, decided_skip_share=0.06, executed_skip_share=0.06)
    assert quality.problem() == problem
    assert quality.summary().startswith("at batch 1, depth execution auto, consensus 0.5: skipped 6.0% decided, 6.0% ")


def test_a_healthy_shape_of_one_hump_is_recorded_not_refused():
    """SmolLM2's healthy gate scores need not make two humps, so refusing such a baseline ('not
    bimodal') would leave the model without a profile. Its shape is recorded instead: the histogram,
    and the largest distance a healthy chunk lay from it plus the margin, for windows of one chunk's
    entropies."""
    rng = np.random.default_rng(5)
    low = np.zeros((800, 8), dtype=bool)
    low[:, :4] = rng.random((800, 4)) < 0.3
    entropies = np.clip(rng.lognormal(np.log(0.3), 0.4, low.shape), 0, 1)
    entropies[low] = rng.uniform(0.05, 0.18, int(low.sum()))
    kwargs = dict(chunk_tokens=200, margin=0.03, min_observations=100, source="")
    profile, stats = build_profile("m", 0.18, 3, 0.85, entropies, low, 0.8, **kwargs)
    assert stats.bimodality.bimodal is False and not profile.bimodality.healthy_bimodal
    assert baseline_problems(stats, 0.18) == []
    shape = profile.bimodality
    assert len(shape.histogram) == 20 and sum(shape.histogram) == pytest.approx(1.0, abs=1e-3)
    assert shape.histogram == pytest.approx(histogram20(entropies) / entropies.size, abs=5e-5)
    chunks = [shape_distance(histogram20(entropies[i : i + 200]), histogram20(entropies)) for i in range(0, 800, 200)]
    assert shape.shape_distance_max == pytest.approx(max(chunks) + 0.03, abs=1e-4)
    assert shape.shape_min_observations == 200 * 8


def test_baseline_problems_name_each_figure_an_alert_could_not_use():
    rng = np.random.default_rng(3)
    # Two humps, and layers 0-3 below tau on a random half of the tokens: healthy.
    low = np.zeros((800, 8), dtype=bool)
    low[:, :4] = rng.random((800, 4)) < 0.5
    entropies = np.where(low, rng.normal(0.1, 0.02, low.shape), rng.normal(0.3, 0.02, low.shape))
    kwargs = dict(chunk_tokens=200, margin=0.03, min_observations=100, source="")
    _, healthy = build_profile("m", 0.18, 3, 0.85, entropies, low, 0.8, **kwargs)
    limits = {"agreement": MIN_HEALTHY_AGREEMENT, "kl_nats_per_token": MAX_HEALTHY_KL_NATS}
    assert baseline_problems(healthy, 0.18, **limits) == []
    # Below the limits: the shadow check's own alerts would take the damage for healthy.
    (agreement,) = baseline_problems(healthy, 0.18, agreement=0.459)
    assert agreement.startswith(f"shadow agreement 0.459, below {MIN_HEALTHY_AGREEMENT}")
    (cost,) = baseline_problems(healthy, 0.18, kl_nats_per_token=0.598)
    assert cost.startswith(f"quality cost 0.598 nats per token, above {MAX_HEALTHY_KL_NATS}")
    # The same layers low on every token: the routing alert.
    static = np.zeros_like(low)
    static[:, :4] = True
    one_hump = rng.normal(0.2, 0.03, low.shape)
    _, broken = build_profile("m", 0.18, 3, 0.85, np.where(static, 0.1, one_hump), static, 0.8, **kwargs)
    (routing,) = baseline_problems(broken, 0.18)
    assert routing.startswith("routing static: token-dependent share 0.") and "below 0.5" in routing
    # A shape that moves between chunks (one hump at 0.3, then at 0.6): the shape alert could not tell a
    # departure from it.
    moving = np.where(low, entropies, np.repeat([0.3, 0.3, 0.6, 0.6], 200)[:, None] + rng.normal(0, 0.02, low.shape))
    _, restless = build_profile("m", 0.18, 3, 0.85, moving, low, 0.8, **kwargs)
    (shape,) = baseline_problems(restless, 0.18)
    assert shape.startswith("the entropy shape varies between the baseline's chunks up to a distance 0.")
    assert f"above {MAX_HEALTHY_SHAPE_DISTANCE}" in shape
    # Nothing below a tau meant to skip: no skipping to compare with.
    _, idle = build_profile("m", 0.18, 3, 0.85, entropies + 0.2, np.zeros_like(low), 0.8, **kwargs)
    assert baseline_problems(idle, 0.18) == [
        "no gate score below the threshold 0.18: nothing is skipped, so the routing and skip-rate alerts have no "
        "healthy skipping to compare with"
    ]
    # At tau 0 the model is served at full depth by choice: nothing is meant to skip.
    _, full_depth = build_profile("m", 0.0, 3, 0.85, entropies, np.zeros_like(low), 1.0, **kwargs)
    assert baseline_problems(full_depth, 0.0, agreement=1.0, kl_nats_per_token=0.0) == []
