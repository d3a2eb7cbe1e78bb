"""The demo backbone's training pieces: corpus split, layer dropout, resumable runs, train-demo."""

from __future__ import annotations

import shutil

import pytest
import torch

from layerwatch.cli.main import main
from layerwatch.inference_shim.offline import corpus, training
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from tests.model.conftest import tiny_config

FAKE_BIBLE = "\n".join(
    f"{book}{chapter}:{verse} Verse {verse} of {book} {chapter}."
    for book in ("Ge", "1Sm")
    for chapter in range(1, 21)
    for verse in range(1, 3)
)


def test_chapters_are_split_and_every_20th_held_out():
    chapters = corpus.split_chapters(FAKE_BIBLE)
    assert len(chapters) == 40
    assert chapters[0] == "Verse 1 of Ge 1.\nVerse 2 of Ge 1."
    assert chapters[20].startswith("Verse 1 of 1Sm 1.")
    split = corpus.split_heldout(chapters)
    assert split.heldout == [chapters[7], chapters[27]]
    assert len(split.train) == 38 and chapters[7] not in split.train


def test_missing_bible_program_fails_clearly(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(corpus.CorpusError, match="bible-kjv"):
        corpus.read_bible()


def test_layer_dropout_rises_with_depth_and_spares_protected_layers():
    p = training.layer_drop_probabilities(6, 0.5, protected=(0, 5))
    assert p == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.0])
    scale = training.layer_dropout(p, torch.Generator().manual_seed(0))
    assert scale(0, torch.zeros(2, 3, 4)) is None
    kept = scale(4, torch.zeros(64, 128, 4))
    assert kept.shape == (64, 128, 1) and set(kept.unique().tolist()) == {0.0, 1.0}
    assert 0.55 < kept.mean().item() < 0.65


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    config = tiny_config(num_layers=3)
    schedule = training.BackboneSchedule(steps=4, batch_size=2, seq_len=8, warmup_steps=2, max_layer_drop=0.5)
    stream = torch.randint(0, config.vocab_size, (500,), generator=torch.Generator().manual_seed(1))
    quiet = dict(log=lambda line: None, checkpoint_every_seconds=1e9)

    straight = training.train_backbone(
        training.new_state(config, schedule), schedule, stream, stream[:100], tmp_path / "a.pt", **quiet
    )
    half = training.BackboneSchedule(**{**schedule.__dict__, "steps": 2})
    first = training.train_backbone(
        training.new_state(config, schedule), half, stream, stream[:100], tmp_path / "b.pt", **quiet
    )
    assert first.step == 2
    resumed, _ = training.load_state(tmp_path / "b.pt")
    resumed = training.train_backbone(resumed, schedule, stream, stream[:100], tmp_path / "b.pt", **quiet)
    assert resumed.step == 4
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.skipif(shutil.which("bible") is None, reason="needs the Debian package bible-kjv")
def test_train_demo_builds_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "model"
    args = [
        "train-demo",
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--layers",
        "2",
        "--hidden-size",
        "16",
        "--intermediate-size",
        "32",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--vocab-size",
        "300",
        "--threads",
        "1",
    ]
    assert main(args) == 0
    loaded = load_checkpoint(out)
    assert loaded.config.num_layers == 2 and loaded.config.vocab_size == 300
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("In the beginning")) == "In the beginning"
    assert (
        (tmp_path / "work" / "heldout.txt").read_text().startswith("And God remembered Noah")
    )  # Genesis 8 is held out
    # Same settings again: the finished state is found and only exported.
    assert main(args) == 0
    assert "resuming at step 2" in capsys.readouterr().out
    # Other settings on the same state: refused rather than silently mixed.
    assert main(args[:-2] + ["--threads", "1", "--learning-rate", "1e-4"]) == 2
