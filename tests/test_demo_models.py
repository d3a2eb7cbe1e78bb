"""`layerwatch demo --model`: a demo model by name (layerwatch/demo/models.py) or a checkpoint folder, anything
else refused before anything starts; the real model's import is kept between runs."""

from __future__ import annotations

import pytest

from layerwatch.cli.main import build_parser, main
from layerwatch.demo.loadgen import BOOK, CHAT
from layerwatch.demo.models import DEMO_MODELS, serve_flags


def _model(value: str):
    argv = ["demo", "--model", value]
    return build_parser(argv, environ={}).parse_args(argv).model


def test_a_model_is_a_demo_model_by_name_or_a_checkpoint_folder_run_as_the_demo_model(tmp_path):
    assert _model("smollm2") is DEMO_MODELS["smollm2"] and _model("smollm2").traffic == CHAT
    assert _model("demo") is DEMO_MODELS["demo"]
    folder = _model(str(tmp_path))
    assert folder.folder == tmp_path and folder.traffic == BOOK and folder.timing == DEMO_MODELS["demo"].timing
    assert serve_flags(folder, tmp_path / "cache", print) == ["--model", str(tmp_path)]
    assert serve_flags(DEMO_MODELS["demo"], tmp_path / "cache", print) == []  # the embedded model


def test_a_model_neither_known_nor_a_folder_is_refused_in_one_line_with_the_nearest_name(capsys):
    with pytest.raises(SystemExit) as exit:
        _model("smolm2")
    last = capsys.readouterr().err.splitlines()[-1]
    assert exit.value.code == 2 and last == (
        "layerwatch demo: error: argument --model: 'smolm2' is neither a demo model (demo, smollm2) "
        "nor a checkpoint folder (did you mean smollm2?)"
    )


def test_a_drill_a_model_cannot_run_is_refused_in_one_line_before_anything_starts(tmp_path, capsys):
    workdir = tmp_path / "demo"
    assert main(["demo", "--drill", "surge", "--workdir", str(workdir)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "layerwatch demo: the surge drill does not run on the embedded demo model: "
        + DEMO_MODELS["demo"].drills_not_run["surge"]
    ]
    assert not workdir.exists()
    assert DEMO_MODELS["smollm2"].drill("surge").serve_flags == ("--threshold", "0.18")


def test_a_checkpoint_folder_runs_the_drills_the_embedded_model_refuses(tmp_path):
    """The embedded model's refusals are measured on it: a folder (served by vLLM too, which the refusal
    itself suggests) is not refused for them."""
    assert _model(str(tmp_path)).drill("surge") is not None


def test_an_imported_model_in_the_cache_is_served_without_importing_it_again(tmp_path):
    """import-gguf renames its folder into place once complete, so a folder there is a whole one: it is
    served as it is (importing again would be refused: import-gguf does not write into a full folder)."""
    model = DEMO_MODELS["smollm2"]
    assert model.gguf is not None and model.gates is not None and model.gates.is_file()
    folder = tmp_path / model.gguf.folder
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    said: list[str] = []
    assert serve_flags(model, tmp_path, said.append) == ["--model", str(folder), "--gates", str(model.gates)]
    assert said == []
