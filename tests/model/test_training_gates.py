"""`layerwatch train-gates` on a tiny random model: determinism, the relaxed skip rules, the importance
method, bad input."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from layerwatch.cli.main import main
from layerwatch.inference_shim.offline.gate_training import (
    GateSchedule,
    average_skip,
    fit_importance_gates,
    hard_skip_fraction,
    init_gates,
    moving_average,
    patience_skip,
    train_gates,
)
from layerwatch.inference_shim.offline.importance_gates import predicted_logits, score_windows
from layerwatch.inference_shim.offline.training import sample_windows, text_file_stream
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint, save_checkpoint
from layerwatch.inference_shim.runtime.gates import load_gates
from layerwatch.inference_shim.runtime.skip_policy import decide_sequences
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from layerwatch.skip_policy import SkipPolicyConfig
from tests.model.conftest import TRAINING_TEXT, build_backend_tokenizer, random_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    tokenizer = Tokenizer(build_backend_tokenizer(), bos_token="<s>", eos_tokens=["</s>"], add_bos_token=True)
    save_checkpoint(random_model(), tokenizer, directory)
    return directory


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text("\n\n".join(TRAINING_TEXT * 6) + "\n", encoding="utf-8")
    return path


def train(model_dir, text_file, out, *extra: str) -> int:
    return main(
        [
            "train-gates",
            "--model",
            str(model_dir),
            "--data",
            str(text_file),
            "--out",
            str(out),
            "--steps",
            "6",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--threads",
            "1",
            "--quiet",
            *extra,
        ]
    )


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_file_other_seed_other_file(model_dir, text_file, tmp_path):
    first, second, other = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    assert train(model_dir, text_file, first, "--seed", "3") == 0
    assert train(model_dir, text_file, second, "--seed", "3") == 0
    assert train(model_dir, text_file, other, "--seed", "4") == 0
    assert sha256(first) == sha256(second)
    assert sha256(first) != sha256(other)


def test_written_gates_load_onto_the_model_with_their_threshold(model_dir, text_file, tmp_path):
    out = tmp_path / "gates.safetensors"
    assert train(model_dir, text_file, out, "--threshold", "0.2", "--patience", "2") == 0
    loaded = load_gates(out, load_checkpoint(model_dir).model)
    assert (loaded.metadata.threshold, loaded.metadata.patience) == (0.2, 2)
    assert loaded.metadata.num_layers == 4


def test_gates_trained_for_the_ewma_rule_say_so_in_their_file(model_dir, text_file, tmp_path):
    out = tmp_path / "gates.safetensors"
    assert train(model_dir, text_file, out, "--skip-rule", "ewma", "--ewma-alpha", "0.25") == 0
    metadata = load_gates(out, load_checkpoint(model_dir).model).metadata
    assert (metadata.skip_rule, metadata.ewma_alpha) == ("ewma", 0.25)


@pytest.mark.parametrize("skip_rule", ["streak", "ewma"])
def test_the_relaxed_rule_at_hard_decisions_is_the_decode_rule(skip_rule):
    # 64 sequences of one layer over 24 tokens; hard "high" events, as the temperature -> 0.
    scores = torch.rand(64, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.6
    alpha, tau, patience = 0.4, 0.3, 2
    if skip_rule == "ewma":
        skip = average_skip((moving_average(scores, alpha) >= tau).double(), patience)
    else:
        skip = patience_skip((scores >= tau).double(), patience)
    config = SkipPolicyConfig(
        threshold=tau,
        patience=patience,
        protected_layers=(),
        fallback_skip_fraction=1.0,
        skip_rule=skip_rule,
        ewma_alpha=alpha,
    )
    decided = decide_sequences(config, scores.numpy()[:, :, None])[:, :, 0]
    assert np.array_equal(skip.numpy().astype(bool), decided) and 0.1 < decided.mean() < 0.9


@pytest.mark.parametrize("skip_rule", ["streak", "ewma"])
def test_training_moves_the_skip_rate_towards_the_target(model_dir, text_file, skip_rule):
    loaded = load_checkpoint(model_dir)
    stream = text_file_stream(loaded.tokenizer, text_file, min_tokens=18)
    rates = []
    for target in (0.1, 0.7):
        schedule = GateSchedule(
            steps=40,
            batch_size=2,
            seq_len=16,
            learning_rate=0.05,
            target_skip=target,
            protected_layers=(0, 3),
            commit_weight=0.0,
            end_temperature=0.5,
            skip_rule=skip_rule,
        )
        seen = []
        train_gates(
            loaded.model,
            init_gates(4, 32, schedule),
            stream,
            schedule,
            on_step=lambda s, seen=seen: seen.append(s.skip_fraction),
        )
        rates.append(sum(seen[-10:]) / 10)
    assert rates[0] < 0.2 < 0.4 < rates[1]


def test_patience_skip_needs_all_previous_tokens_low():
    # high = 1 means the score was above tau. Token t is skipped iff t-1, t-2, t-3 were all low.
    high = torch.tensor([[1.0, 0, 0, 0, 0, 1, 0, 0, 0, 0]])
    expected = torch.tensor([[0.0, 0, 0, 0, 1, 1, 0, 0, 0, 1]])
    assert torch.equal(patience_skip(high, patience=3), expected)
    # The first `patience` tokens have no history and are never skipped, even when all are low.
    assert torch.equal(patience_skip(torch.zeros(1, 4), patience=3), torch.tensor([[0.0, 0, 0, 1]]))


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such text file"),
        (b"\xff\xfe\x00bad bytes", "not UTF-8"),
        (b"  \n\n \n", "holds no text"),
        (b"Too short.", "tokens, at least"),
    ],
)
def test_bad_text_file_fails_clearly_and_writes_nothing(model_dir, tmp_path, capsys, content, message):
    data = tmp_path / "data.txt"
    if content is not None:
        data.write_bytes(content)
    out = tmp_path / "gates.safetensors"
    assert train(model_dir, data, out) == 2
    error = capsys.readouterr().err
    assert message in error and str(data) in error
    assert not out.exists()


def test_bad_model_folder_fails_clearly(text_file, tmp_path, capsys):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    assert train(folder, text_file, tmp_path / "gates.safetensors") == 2
    assert "config.json" in capsys.readouterr().err


def test_unavailable_device_fails_clearly(model_dir, text_file, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert train(model_dir, text_file, tmp_path / "g.safetensors", "--device", "cuda") == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["--seq-len", "2"], "--seq-len must be longer than --patience (3), got 2"),
        (["--method", "importance", "--seq-len", "3"], "--seq-len must be longer than --patience (3), got 3"),
        (["--target-skip", "1.5"], "--target-skip is a share of (token, layer) pairs in [0, 1], got 1.5"),
    ],
)
def test_a_window_no_longer_than_the_patience_or_a_share_past_one_is_refused(
    model_dir, text_file, tmp_path, capsys, arguments, named
):
    """Before: --seq-len 2 (importance: 3) trained into a tensor-shape RuntimeError traceback; a target
    share of 1.5 trained and wrote a gate file, exit 0."""
    out = tmp_path / "gates.safetensors"
    assert train(model_dir, text_file, out, *arguments) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--target-skip", "--sparsity-weight", "--commit-weight"])
def test_a_weight_that_is_not_a_finite_number_is_refused_and_writes_nothing(
    model_dir, text_file, tmp_path, capsys, flag
):
    # Unguarded, a NaN weight trains for every step and writes a gate file, exit 0.
    out = tmp_path / "gates.safetensors"
    assert train(model_dir, text_file, out, flag, "nan") == 2
    assert f"{flag} must be a finite number, got nan" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--high-score", "1"], "argument --high-score: must be in (0, 1), got 1"),
        (["--high-score", "2"], "argument --high-score: must be in (0, 1), got 2"),
        (["--low-score", "0"], "argument --low-score: must be in (0, 1), got 0"),
        (["--low-score", "nan"], "argument --low-score: must be in (0, 1), got nan"),
    ],
)
def test_a_score_outside_the_open_unit_interval_is_a_usage_error(tmp_path, capsys, flags, message):
    """Before: --high-score 1 was a ZeroDivisionError traceback; --low-score 0 and --high-score 2 a
    "math domain error" naming no flag, after the model had loaded."""
    argv = ["train-gates", "--model", str(tmp_path / "never-loaded"), "--data", str(tmp_path / "x")]
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--out", str(tmp_path / "g.safetensors"), *flags])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_scores_on_the_wrong_side_of_tau_are_refused_before_the_model_loads(tmp_path, capsys):
    """Before: --low-score 0.9 --high-score 0.05 trained and wrote a gate file, exit 0."""
    out = tmp_path / "g.safetensors"
    argv = ["train-gates", "--model", str(tmp_path / "never-loaded"), "--data", str(tmp_path / "x"), "--out", str(out)]
    assert main([*argv, "--low-score", "0.9", "--high-score", "0.05"]) == 2
    err = capsys.readouterr().err
    assert "--low-score (0.9) < --threshold (0.18) < --high-score (0.05) must hold" in err
    assert "never-loaded" not in err and not out.exists()


# --- the importance method ------------------------------------------------------------------------


def test_importance_gates_are_reproducible_and_load_with_their_threshold(model_dir, text_file, tmp_path):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for out in (first, second):
        assert train(model_dir, text_file, out, "--method", "importance", "--fit-epochs", "2", "--seed", "5") == 0
    assert sha256(first) == sha256(second)
    loaded = load_gates(first, load_checkpoint(model_dir).model)
    assert loaded.metadata.threshold == GateSchedule().threshold


def test_a_cost_is_what_skipping_the_layer_for_the_window_does_to_the_next_token():
    model = random_model()
    stream = torch.arange(100) % 50
    sample = score_windows(model, stream, 1, 2, 16, (1, 2), torch.Generator().manual_seed(0))
    tokens = sample_windows(stream, 2, 16, torch.Generator().manual_seed(0))[:, :-1]
    with torch.no_grad():
        full = F.log_softmax(model(tokens)[0], dim=-1)
        for i, layer in enumerate((1, 2)):
            skip = lambda l, x, layer=layer: torch.zeros(x.shape[:-1] + (1,)) if l == layer else None  # noqa: E731
            skipped = F.log_softmax(model(tokens, update_scale=skip)[0], dim=-1)
            kl = (full.exp() * (full - skipped)).sum(-1)
            torch.testing.assert_close(sample.costs[i], kl[:, 1:], rtol=1e-4, atol=1e-6)
    assert sample.inputs.shape == (2, 2, 15, 32) and (sample.costs[0] > 0).all()


@pytest.mark.parametrize("target", [0.1, 0.4])
def test_importance_gates_skip_the_target_share_of_the_scored_windows_at_their_threshold(target):
    model = random_model()
    stream = torch.arange(400) % 50
    schedule = GateSchedule(
        method="importance",
        steps=2,
        batch_size=4,
        seq_len=24,
        fit_epochs=3,
        target_skip=target,
        protected_layers=(0, 3),
    )
    gates = fit_importance_gates(model, init_gates(4, 32, schedule), stream, schedule)
    sample = score_windows(model, stream, 2, 4, 24, (1, 2), torch.Generator().manual_seed(schedule.seed))
    scores = torch.sigmoid(predicted_logits(gates, sample))
    assert hard_skip_fraction(scores, schedule) == pytest.approx(target, abs=0.02)
    # Protected layers read the high score whatever their input.
    x = torch.randn(5, 32)
    assert torch.allclose(gates[0](x), torch.full((5,), schedule.high_score))


def test_importance_gates_rank_layers_by_their_cost():
    # Layer 2's updates are scaled down 100-fold, so skipping it costs almost nothing: at a small
    # target the gates must skip it and leave layer 1 running.
    model = random_model()
    with torch.no_grad():
        model.layers[2].self_attn.o_proj.weight.mul_(0.01)
        model.layers[2].mlp.down_proj.weight.mul_(0.01)
    stream = torch.arange(400) % 50
    schedule = GateSchedule(
        method="importance",
        steps=2,
        batch_size=4,
        seq_len=24,
        fit_epochs=100,
        learning_rate=0.02,
        target_skip=0.3,
        protected_layers=(0, 3),
    )
    gates = fit_importance_gates(model, init_gates(4, 32, schedule), stream, schedule)
    sample = score_windows(model, stream, 2, 4, 24, (1, 2), torch.Generator().manual_seed(schedule.seed))
    scores = torch.sigmoid(predicted_logits(gates, sample))
    per_layer = [hard_skip_fraction(scores[i], schedule) for i in range(2)]
    assert per_layer[1] > 0.5 > 0.1 > per_layer[0]
