"""Teacher-forced decoding with the real skip semantics, and `layerwatch eval` on a tiny model."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from layerwatch.cli.main import main
from layerwatch.inference_shim.offline.evaluation import heldout_windows, paired_decode, teacher_forced_decode
from layerwatch.inference_shim.offline.gated_model import load_gated_model
from layerwatch.inference_shim.runtime.checkpoint import save_checkpoint
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
from layerwatch.inference_shim.runtime.gates import GATES_FILE, GateMetadata, model_fingerprint, save_gates
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.skip_policy import SkipPolicyConfig
from tests.model.conftest import (
    TRAINING_TEXT,
    build_backend_tokenizer,
    constant_gates,
    random_gates,
    random_model,
    tiny_config,
)

WINDOW, PREFILL = 24, 6
DECODE_STEPS = WINDOW - PREFILL  # per window


def windows(count: int = 3, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, 300, (count, WINDOW), generator=generator)


def test_threshold_zero_is_bit_identical_to_full_depth():
    model = random_model()
    full = teacher_forced_decode(model, windows(), PREFILL, None, batch_size=2)
    model.attach_gates(random_gates(model.config))
    gated = teacher_forced_decode(model, windows(), PREFILL, SkipPolicyConfig(threshold=0.0), batch_size=2)
    assert gated.nll_sum == full.nll_sum
    assert gated.skip_fraction == 0.0 and gated.tokens == full.tokens == 3 * DECODE_STEPS


def test_low_gates_skip_unprotected_layers_after_patience_steps():
    model = random_model()
    model.attach_gates(constant_gates(model.config, entropy_logit=-30.0))
    totals = teacher_forced_decode(model, windows(), PREFILL, SkipPolicyConfig(patience=3), batch_size=3)
    skipped_steps = DECODE_STEPS - 3  # the first `patience` decode steps have no history
    expected = [0.0, skipped_steps / DECODE_STEPS, skipped_steps / DECODE_STEPS, 0.0]  # 0 and 3 protected
    assert totals.per_layer_skip_rate == pytest.approx(expected)
    assert totals.fallbacks == 0  # 2 of 4 layers skipped is below the 85 % trigger
    full = teacher_forced_decode(model, windows(), PREFILL, None, batch_size=3)
    assert totals.nll_sum != full.nll_sum  # skipping really changed the computation


def test_skipping_everything_triggers_fallback_episodes():
    model = random_model()
    model.attach_gates(constant_gates(model.config, entropy_logit=-30.0))
    policy = SkipPolicyConfig(protected_layers=(), fallback_trigger_steps=2, fallback_steps=4)
    skipped_per_step = []
    totals = teacher_forced_decode(
        model,
        windows(count=1),
        PREFILL,
        policy,
        batch_size=1,
        on_step=lambda step: skipped_per_step.append(int(step.skipped.sum())),
    )
    # 3 full steps (patience), 2 all-skipped steps trigger, then 4 fallback steps at full depth, repeat.
    assert skipped_per_step[:12] == [0, 0, 0, 4, 4, 0, 0, 0, 0, 4, 4, 0]
    assert totals.fallbacks == 3


@pytest.mark.parametrize("kv_policy", ["project", "evict"])
def test_teacher_forcing_the_engine_output_replays_its_steps(backend_tokenizer, kv_policy):
    # Fed the engine's own greedy tokens, eval must take the engine's every step: same masks,
    # same entropies, and logits that give the same per-token loss.
    model = random_model(tiny_config(num_layers=6, eos_token_ids=()))
    model.attach_gates(random_gates(model.config))
    policy = SkipPolicyConfig(threshold=0.5, patience=2)  # random gates score around 0.5: patterns switch
    records, logits = [], []
    decode_step = model.decode_step

    def spy(*args):
        out = decode_step(*args)
        logits.append(out[0])
        return out

    model.decode_step = spy
    engine = GenerationEngine(
        model,
        Tokenizer(backend_tokenizer),
        model_name="tiny",
        policy=policy,
        kv_policy=kv_policy,
        step_hook=records.append,
    )
    prompt = [0, 17, 54, 120, 9]
    result = engine.generate(prompt, SamplingParams(max_tokens=40))
    del model.decode_step
    expected_nll = F.cross_entropy(torch.cat(logits), torch.tensor(result.token_ids), reduction="sum").item()

    steps = []
    totals = teacher_forced_decode(
        model,
        torch.tensor([prompt + result.token_ids]),
        len(prompt),
        policy,
        kv_policy=kv_policy,
        batch_size=1,
        on_step=steps.append,
    )
    skipped = np.concatenate([s.skipped for s in steps])
    assert skipped.any() and not skipped.all()
    assert np.array_equal(skipped, np.concatenate([r.skipped for r in records]))
    assert np.array_equal(np.concatenate([s.entropies for s in steps]), np.concatenate([r.entropies for r in records]))
    assert totals.nll_sum == pytest.approx(expected_nll, rel=1e-6)


def test_a_policy_without_gates_is_refused():
    with pytest.raises(ValueError, match="needs gates"):
        teacher_forced_decode(random_model(), windows(), PREFILL, SkipPolicyConfig())


def test_heldout_windows_cover_the_requested_tokens():
    stream = torch.arange(1000)
    w = heldout_windows(stream, window_len=100, max_decode_tokens=250, prefill_len=20)
    assert w.shape == (4, 100)  # ceil(250 / 80)
    assert torch.equal(w[1], torch.arange(100, 200))
    with pytest.raises(ValueError, match="fewer than one window"):
        heldout_windows(torch.arange(50), window_len=100, max_decode_tokens=10, prefill_len=20)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    model = random_model()
    save_checkpoint(
        model, Tokenizer(build_backend_tokenizer(), bos_token="<s>", eos_tokens=["</s>"], add_bos_token=True), directory
    )
    gates = constant_gates(model.config, entropy_logit=-30.0)
    with torch.no_grad():
        gates[2].fc2.bias.fill_(30.0)  # layer 2 always matters
    metadata = GateMetadata(
        num_layers=4, hidden_size=32, threshold=0.18, patience=3, base_fingerprint=model_fingerprint(model)
    )
    save_gates(directory / "gates.safetensors", gates, metadata)
    return directory


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "heldout.txt"
    path.write_text("\n\n".join(TRAINING_TEXT * 6) + "\n", encoding="utf-8")
    return path


def run_eval(model_dir, text_file, *extra: str) -> int:
    return main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--data",
            str(text_file),
            "--window",
            str(WINDOW),
            "--prefill",
            str(PREFILL),
            "--max-tokens",
            "60",
            "--threads",
            "1",
            *extra,
        ]
    )


def test_eval_json_reports_the_contract_keys(model_dir, text_file, capsys):
    assert run_eval(model_dir, text_file, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    for key in (
        "perplexity_full",
        "perplexity_gated",
        "skip_fraction",
        "per_layer_skip_rate",
        "fallbacks",
        "tokens_per_second_full",
        "tokens_per_second_gated",
        "threshold",
    ):
        assert key in report
    assert report["threshold"] == 0.18  # the gates' own
    rates = report["per_layer_skip_rate"]
    assert rates[0] == rates[2] == rates[3] == 0.0 and rates[1] == pytest.approx((DECODE_STEPS - 3) / DECODE_STEPS)
    assert report["skip_fraction"] == pytest.approx(np.mean(rates))
    assert report["perplexity_gated"] != report["perplexity_full"]


def test_interleaved_repeated_passes_compute_what_separate_passes_do(model_dir):
    # Rotating full and gated batch by batch (gates attached and detached in between) must change
    # nothing but the timing: every repetition equals a pass run on its own.
    gated = load_gated_model(model_dir)
    runs = paired_decode(
        gated,
        windows(count=5),
        [gated.policy(0.18), gated.policy(0.5)],
        prefill=PREFILL,
        kv_policy="project",
        batch_size=2,
        repeats=3,
    )
    gated.model.attach_gates(None)
    alone_full = teacher_forced_decode(gated.model, windows(count=5), PREFILL, None, batch_size=2)
    gated.model.attach_gates(gated.gates.gates)
    for threshold, repeats in zip([0.18, 0.5], runs.gated):
        policy = gated.policy(threshold)
        alone = teacher_forced_decode(gated.model, windows(count=5), PREFILL, policy, batch_size=2)
        assert len(repeats) == 3
        for totals in repeats:
            assert totals.nll_sum == alone.nll_sum and np.array_equal(totals.skips_per_layer, alone.skips_per_layer)
            assert totals.decode_seconds > 0 and totals.decode_cpu_seconds > 0
    assert alone.skips_per_layer.sum() > 0  # the gates really skip: the comparison is not trivial
    assert [totals.nll_sum for totals in runs.full] == [alone_full.nll_sum] * 3


def test_eval_json_reports_paired_speed_over_repeats(model_dir, text_file, capsys):
    assert run_eval(model_dir, text_file, "--json", "--repeats", "2") == 0
    report = json.loads(capsys.readouterr().out)
    speed = report["speed"]
    assert report["repeats"] == speed["repeats"] == 2
    full, gated = speed["tokens_per_second_full"]["runs"], speed["tokens_per_second_gated"]["runs"]
    assert speed["gated_over_full"]["runs"] == pytest.approx([g / f for f, g in zip(full, gated)])
    assert report["tokens_per_second_gated"] == pytest.approx(np.median(gated))
    assert len(speed["cpu_seconds_full"]) == 2 and all(seconds > 0 for seconds in speed["cpu_seconds_gated"])


def test_eval_refuses_zero_repeats(model_dir, text_file, capsys):
    with pytest.raises(SystemExit):
        run_eval(model_dir, text_file, "--repeats", "0")
    assert "--repeats" in capsys.readouterr().err


def test_eval_sweep_prints_one_row_per_threshold(model_dir, text_file, capsys):
    assert run_eval(model_dir, text_file, "--sweep", "0,0.5") == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| streak |")]
    assert len(rows) == 2 and "| streak | 0 | 0.0% |" in rows[0] and "+0.00%" in rows[0]


def test_eval_sweep_table_reports_executed_skips_beside_decided_ones(model_dir, text_file, tmp_path, capsys):
    """A layer run whole for the batch runs for rows whose rule skipped it: the sweep table said only
    how much the rule decided, beside a perplexity that comes from what was executed."""
    model = random_model()  # model_dir's model
    metadata = GateMetadata(
        num_layers=4, hidden_size=32, threshold=0.18, patience=3, base_fingerprint=model_fingerprint(model)
    )
    gates = tmp_path / "random.safetensors"
    save_gates(gates, random_gates(model.config), metadata)  # scores near 0.5 that differ by row
    sweep = ["--gates", str(gates), "--sweep", "0.5,0.6", "--batch-size", "4", "--repeats", "1"]
    sweep += ["--depth-execution", "batch", "--batch-consensus", "off"]  # a layer runs if any row wants it
    assert run_eval(model_dir, text_file, *sweep, "--json") == 0
    measured = [(r["skip_fraction"], r["executed_skip_fraction"]) for r in json.loads(capsys.readouterr().out)["sweep"]]
    assert any(executed < decided for decided, executed in measured)
    assert run_eval(model_dir, text_file, *sweep) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| streak |")]
    assert [(row[3].strip(), row[4].strip()) for row in rows] == [(f"{d:.1%}", f"{e:.1%}") for d, e in measured]


def test_eval_compare_rules_runs_each_threshold_under_both_rules(model_dir, text_file, capsys):
    assert run_eval(model_dir, text_file, "--sweep", "0,0.5", "--compare-rules", "--ewma-alpha", "0.3", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    rows = [(r["skip_rule"], r["threshold"], r["ewma_alpha"]) for r in report["sweep"]]
    assert rows == [("streak", 0, None), ("ewma", 0, 0.3), ("streak", 0.5, None), ("ewma", 0.5, 0.3)]
    at_zero, at_half = report["sweep"][:2], report["sweep"][2:]
    assert all(r["skip_fraction"] == 0 and r["perplexity_increase"] == 0 for r in at_zero)
    # Constant gates: the average is the constant, so both rules skip the same layers after warm-up.
    assert at_half[0]["per_layer_skip_rate"] == at_half[1]["per_layer_skip_rate"]
    assert at_half[0]["per_layer_skip_rate"][1] == pytest.approx((DECODE_STEPS - 3) / DECODE_STEPS)


def test_eval_refuses_an_ewma_alpha_outside_0_1(model_dir, text_file, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_eval(model_dir, text_file, "--skip-rule", "ewma", "--ewma-alpha", "0")
    assert exit_info.value.code == 2 and "argument --ewma-alpha: must be in (0, 1], got 0" in capsys.readouterr().err


def test_eval_refuses_gates_of_another_model(model_dir, text_file, tmp_path, capsys):
    other = random_model(tiny_config(), seed=5)
    metadata = GateMetadata(
        num_layers=4, hidden_size=32, threshold=0.18, patience=3, base_fingerprint=model_fingerprint(other)
    )
    save_gates(tmp_path / "other.safetensors", random_gates(other.config), metadata)
    assert run_eval(model_dir, text_file, "--gates", str(tmp_path / "other.safetensors")) == 2
    assert "another base model" in capsys.readouterr().err


def test_eval_measures_the_batch_consensus_mode(model_dir, text_file, capsys):
    assert run_eval(model_dir, text_file, "--json", "--batch-consensus", "0.5", "--repeats", "1") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["batch_consensus"] == 0.5 and 0 < report["skip_fraction"] < 1
    with pytest.raises(SystemExit):
        run_eval(model_dir, text_file, "--batch-consensus", "0")
    assert "must be in (0, 1]" in capsys.readouterr().err


def test_eval_batch_sizes_prints_the_depth_execution_of_each(model_dir, text_file, capsys):
    assert run_eval(model_dir, text_file, "--json", "--batch-sizes", "1,2", "--repeats", "1") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["depth_execution"] == "auto" and report["batch_consensus"] == 0.5
    rows = report["batch_sizes"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 <= r["unneeded_run_fraction"] <= r["skip_fraction"] and 0 <= r["executed_skip_fraction"] <= 1
        assert sum(r["layer_paths"].values()) == pytest.approx(1.0)
        assert "perplexity_increase" in r and len(r["speed"]["gated_over_full_cpu"]["runs"]) == 1
    assert set(rows[1]["row_partial_limits"]) == {"2"}  # measured before the timed passes
    assert rows[0]["executed_skip_fraction"] == rows[0]["skip_fraction"]  # one row: as it decided

    assert run_eval(model_dir, text_file, "--batch-sizes", "2", "--repeats", "1", "--depth-execution", "rows") == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(table) == 1 and "every row as it decided" in table[0]
    assert run_eval(model_dir, text_file, "--batch-sizes", "2", "--sweep", "0,0.5") == 2
    assert "--batch-sizes measures one threshold" in capsys.readouterr().err


def test_eval_reports_the_batch_size_that_ran_and_refuses_empty_or_repeated_sizes(model_dir, text_file, capsys):
    """Unguarded, `--batch-sizes 99999999999,1,,1` is accepted and its JSON says
    `batch_size: 99999999999` for a batch of the 4 windows there were."""
    for sizes, message in (
        ("1,,2", "an empty entry in '1,,2'"),
        ("1,2,", "an empty entry"),
        ("2,1,2", "an entry given twice in"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            run_eval(model_dir, text_file, "--batch-sizes", sizes)
        assert exit_info.value.code == 2 and f"argument --batch-sizes: {message}" in capsys.readouterr().err
    assert run_eval(model_dir, text_file, "--batch-sizes", "4,99999999999") == 2
    assert "--batch-sizes 4,99999999999: 4 windows make one batch of 4 at each" in capsys.readouterr().err
    assert run_eval(model_dir, text_file, "--json", "--batch-sizes", "1,99999999999", "--repeats", "1") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["windows"] == 4 and [r["batch_size"] for r in report["batch_sizes"]] == [1, 4]
    assert set(report["batch_sizes"][1]["row_partial_limits"]) == {"4"}
    assert run_eval(model_dir, text_file, "--json", "--repeats", "1") == 0  # --batch-size 8, the default
    assert json.loads(capsys.readouterr().out)["batch_size"] == 4


def test_eval_no_gates_measures_the_full_depth_of_a_model_without_a_gate_file(model_dir, text_file, tmp_path, capsys):
    ungated = tmp_path / "ungated"
    shutil.copytree(model_dir, ungated, ignore=shutil.ignore_patterns(GATES_FILE))
    assert run_eval(ungated, text_file, "--json") == 2
    assert "`layerwatch serve --no-gates`" in capsys.readouterr().err
    assert run_eval(ungated, text_file, "--no-gates", "--json", "--repeats", "1") == 0
    alone = json.loads(capsys.readouterr().out)
    assert run_eval(model_dir, text_file, "--json", "--repeats", "1") == 0
    paired = json.loads(capsys.readouterr().out)
    # The same checkpoint at full depth: the same windows and the same perplexity, to the bit.
    assert alone["perplexity_full"] == paired["perplexity_full"] and alone["decoded_tokens"] == paired["decoded_tokens"]
    assert (alone["gates"], alone["gates_sha256"], alone["speed"]["repeats"]) == (None, None, 1)
    assert run_eval(ungated, text_file, "--no-gates", "--threshold", "0.2", "--compare-rules") == 2
    err = capsys.readouterr().err
    assert "error: --no-gates evaluates full depth only: --threshold, --compare-rules need(s) gates" in err
    # serve --no-gates refuses the depth flags too: they were taken and did nothing.
    assert run_eval(ungated, text_file, "--no-gates", "--depth-execution", "rows", "--batch-consensus", "off") == 2
    err = capsys.readouterr().err
    assert "error: --no-gates evaluates full depth only: --depth-execution, --batch-consensus need(s) gates" in err


def test_eval_quantizes_the_model_its_gates_were_trained_on_and_refuses_what_cannot_run(model_dir, text_file, capsys):
    assert run_eval(model_dir, text_file, "--json", "--repeats", "1") == 0
    float32 = json.loads(capsys.readouterr().out)
    assert run_eval(model_dir, text_file, "--json", "--repeats", "1", "--quantization", "int8") == 0
    int8 = json.loads(capsys.readouterr().out)
    # The gate file loads on the quantized model (the float weights' fingerprint), the report says
    # what ran, and the perplexity moved (int8 weights and bfloat16 projections) but not far: a
    # random model's logits moved by 2^-8 of their size change its perplexity by about as much.
    assert (int8["quantization"], int8["dtype"], float32["quantization"]) == ("int8", "float32", "none")
    assert int8["perplexity_full"] != float32["perplexity_full"]
    assert abs(math.log(int8["perplexity_full"] / float32["perplexity_full"])) < 0.05
    assert run_eval(model_dir, text_file, "--dtype", "float16") == 2
    assert capsys.readouterr().err.startswith("error: --dtype float16 is slow on the CPU")
