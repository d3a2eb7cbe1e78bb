"""The committed demo model: loads, its gates and profile belong to it, and eval uses it by default."""

from __future__ import annotations

import json

from layerwatch.alerts.profile_file import load_profile
from layerwatch.cli.main import main
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from layerwatch.inference_shim.runtime.gates import load_gates

PROFILE = DEMO_MODEL_DIR.parents[1] / "alerts" / "profiles" / "demo.yaml"
MAX_FOLDER_BYTES = 40 * 1024 * 1024


def test_folder_is_small_and_complete():
    names = {p.name for p in DEMO_MODEL_DIR.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "gates.safetensors",
        "README.md",
    } <= names
    assert sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir()) <= MAX_FOLDER_BYTES


def test_gates_and_profile_belong_to_the_model():
    loaded = load_checkpoint(DEMO_MODEL_DIR)
    gates = load_gates(DEMO_MODEL_DIR / "gates.safetensors", loaded.model)  # fingerprint checked
    profile = load_profile(PROFILE)
    assert profile.model_name == DEMO_MODEL_NAME
    assert (profile.threshold, profile.patience) == (gates.metadata.threshold, gates.metadata.patience)
    assert profile.bimodality.peaks == 2 and profile.bimodality.dip_p_value < 0.05
    assert gates.sha256[:12] in profile.source


def test_eval_without_model_uses_the_demo(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 20)
    assert main(["eval", "--data", str(text), "--max-tokens", "32", "--window", "48", "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == str(DEMO_MODEL_DIR)
    assert len(report["per_layer_skip_rate"]) == load_checkpoint(DEMO_MODEL_DIR).config.num_layers


# Matthew 6:5-13 (King James Version): the kind of text the demo model was trained and calibrated on.
VERSES = """And when thou prayest, thou shalt not be as the hypocrites are: for they love to pray standing.
But thou, when thou prayest, enter into thy closet, and when thou hast shut thy door, pray to thy Father.
But when ye pray, use not vain repetitions, as the heathen do: for they think that they shall be heard.
Be not ye therefore like unto them: for your Father knoweth what things ye have need of, before ye ask him.
After this manner therefore pray ye: Our Father which art in heaven, Hallowed be thy name.
Thy kingdom come. Thy will be done in earth, as it is in heaven.
Give us this day our daily bread.
And forgive us our debts, as we forgive our debtors.
And lead us not into temptation, but deliver us from evil: For thine is the kingdom, and the power, and the glory.
"""


def test_calibrate_accepts_the_demo_models_healthy_baseline_named_as_serve_names_it(tmp_path, capsys):
    """The health check refuses what the alerts could not use (tests/model/test_eval_calibrate.py), not a
    healthy model: the demo's gates, at the size of baseline the gate-importance buffers need (36 x 32)."""
    text, out = tmp_path / "verses.txt", tmp_path / "demo.yaml"
    text.write_text(VERSES)
    argv = ["calibrate", "--data", str(text), "--out", str(out), "--threads", "1"]
    code = main([*argv, "--prompts", "36", "--max-new-tokens", "32", "--chunk-tokens", "256"])
    assert code == 0, capsys.readouterr().err
    assert "unhealthy" not in capsys.readouterr().out
    assert load_profile(out).model_name == DEMO_MODEL_NAME
