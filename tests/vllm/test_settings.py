"""The plugin's start-up checks, in-process (they need no vLLM: layerwatch/vllm_plugin/gating.py): each bad
setting is refused with one line that names it, before vLLM would serve anything; and the sequence keying
(layerwatch/vllm_plugin/sequences.py) on hand-made attention metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from layerwatch.inference_shim.runtime.checkpoint import checkpoint_fingerprint, load_checkpoint
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.gates import GATES_FILE, load_gates
from layerwatch.vllm_plugin.gating import load_gating
from layerwatch.vllm_plugin.sequences import BatchRows, SequenceStates
from layerwatch.vllm_plugin.settings import PluginSettings, PluginSettingsError
from tests.conftest import RealModel


def gating(folder: Path, **raw):
    settings = PluginSettings.from_overrides(raw)
    return load_gating(settings, str(folder), 30, "served", torch.float32, sequences=4, decides=True)


def refusal(folder: Path, **raw) -> str:
    with pytest.raises(PluginSettingsError) as refused:
        gating(folder, **raw)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("layerwatch: ")
    return message


def test_good_settings_give_the_gate_files_policy_with_the_overrides(real_model: RealModel) -> None:
    served = gating(real_model.folder, threshold=0.25, patience=2, protected_layers=[0, 5, 29])
    config = served.policy.config
    assert (config.threshold, config.patience, config.protected_layers) == (0.25, 2, (0, 5, 29))
    assert served.gates.scores(torch.zeros(30, 1, 576)).shape == (1, 30)
    assert served.sender is None and served.threshold == 0.25  # no exporter address: no frames


def test_the_fingerprint_read_from_the_folders_files_is_the_one_the_shipped_gates_record(real_model: RealModel) -> None:
    # The shim recorded it from the whole model in memory (gates.model_fingerprint); the plugin reads a few values
    # of each weight from the files, in the dtypes vLLM may serve in (bf16 rounds alike; fp16 is another model).
    recorded = load_gates(real_model.folder / GATES_FILE, load_checkpoint(real_model.folder).model).metadata
    for dtype in (torch.float32, torch.bfloat16):
        assert checkpoint_fingerprint(real_model.folder, dtype) == recorded.base_fingerprint


def test_an_unknown_key_is_refused_by_name(real_model: RealModel) -> None:
    assert "unknown setting 'treshold'" in refusal(real_model.folder, treshold=0.2)


@pytest.mark.parametrize("tau", [1.5, -0.1, float("nan"), True])
def test_a_threshold_out_of_range_is_refused(real_model: RealModel, tau) -> None:
    assert "threshold must be" in refusal(real_model.folder, threshold=tau)


def test_a_missing_gate_file_is_refused_naming_it(real_model: RealModel, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.safetensors"
    assert f"gates: {missing}: gate file not found" in refusal(real_model.folder, gates=str(missing))


def test_gates_of_another_model_are_refused(real_model: RealModel) -> None:
    message = refusal(real_model.folder, gates=str(DEMO_MODEL_DIR / "gates.safetensors"))
    assert "gates: " in message and "this model has 30 layers" in message


def test_a_model_served_with_another_depth_than_its_folders_is_refused(real_model: RealModel) -> None:
    # vLLM's layer count, after --hf-overrides, against config.json's, which the gates and fingerprint are read for.
    settings = PluginSettings.from_overrides({})
    with pytest.raises(PluginSettingsError, match="30 layers in config.json, vLLM serves 29"):
        load_gating(settings, str(real_model.folder), 29, "served", torch.float32, sequences=4, decides=True)


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"protected_layers": [0, 30]}, "protected layer 30 is outside 0..29"),
        ({"protected_layers": "0,1"}, "protected_layers must be a list"),
        ({"patience": 0}, "patience must be >= 1"),
        ({"patience": 2**31, "skip_rule": "ewma"}, "patience must be >= 1 and <= 2147483647"),  # overflowed a step
        ({"patience": 2.0}, "patience must be an integer, got 2.0"),
        ({"ewma_alpha": "0.5"}, "ewma_alpha must be in (0, 1], got '0.5'"),  # a TypeError's traceback
        ({"ewma_alpha": True}, "ewma_alpha must be in (0, 1], got True"),
        ({"gates": ""}, "gates must be a non-empty string"),
        ({"frame_key_file": "/nonexistent/key"}, "frames: "),  # checked without an exporter address too
        ({"skip_rule": "majority"}, "skip rule must be one of"),
        ({"exporter_address": "127.0.0.1"}, "frames: exporter address"),
        ({"exporter_address": "127.0.0.1:9", "frame_key_file": "/nonexistent/key"}, "frames: "),
    ],
)
def test_other_bad_settings_are_refused_naming_them(real_model: RealModel, raw: dict, named: str) -> None:
    assert named in refusal(real_model.folder, **raw)


def test_a_decode_row_finds_its_previous_token_across_a_block_boundary() -> None:
    block_size = 4
    # Two sequences: one decodes position 4 (its previous token, position 3, ends block 7), one prefills 3 tokens.
    rows = BatchRows.from_metadata(
        query_start_loc=np.array([0, 1, 4]),
        seq_lens=np.array([5, 3]),
        slot_mapping=np.array([9 * 4 + 0, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2]),
        block_table=np.array([[7, 9], [2, 0]]),
        block_size=block_size,
    )
    assert rows.last_tokens.tolist() == [0, 3]
    assert rows.decode.tolist() == [True, False]
    assert rows.previous_slots.tolist() == [7 * 4 + 3, -1]
    assert rows.new_slots.tolist() == [36, 10]
    with pytest.raises(ValueError, match="do not follow blocks of 8 tokens"):  # a block size vLLM does not use
        BatchRows.from_metadata(np.array([0, 1]), np.array([5]), np.array([36]), np.array([[7, 9]]), block_size=8)


def test_a_state_follows_its_sequence_from_slot_to_slot_and_a_prefill_starts_afresh() -> None:
    states = SequenceStates(capacity=2)

    def step(new: int, previous: int, decode: bool) -> tuple[int, bool]:
        rows = BatchRows(np.array([0]), np.array([decode]), np.array([new]), np.array([previous]))
        slots, fresh = states.step(rows)
        return int(slots[0]), bool(fresh[0])

    first, fresh = step(new=10, previous=-1, decode=False)
    assert fresh
    assert step(new=11, previous=10, decode=True) == (first, False)
    assert step(new=12, previous=11, decode=True) == (first, False)
    second, fresh = step(new=20, previous=19, decode=True)  # nothing under 19: a sequence this engine never saw
    assert fresh and second != first
    third, fresh = step(new=30, previous=-1, decode=False)  # the pool is full: the state stepped longest ago goes
    assert fresh and third == first
    assert step(new=13, previous=12, decode=True)[1]  # its sequence comes back: a fresh state, full depth again


def test_a_pipeline_stage_holds_its_own_layers_gates_and_protected_layers() -> None:
    settings = PluginSettings.from_overrides({"exporter_address": "127.0.0.1:9", "protected_layers": [0, 9, 15]})

    def stage(layers: range):
        return load_gating(settings, str(DEMO_MODEL_DIR), 16, "demo", torch.float32, 4, True, layers)

    whole, first, second = stage(range(16)), stage(range(0, 8)), stage(range(8, 16))
    inputs = torch.randn(16, 3, 128, generator=torch.Generator().manual_seed(0))
    scores = whole.gates.scores(inputs)
    # The same gates; a batched op over 8 layers instead of 16 may round differently (float32's tolerance).
    torch.testing.assert_close(first.gates.scores(inputs[:8]), scores[:, :8])
    torch.testing.assert_close(second.gates.scores(inputs[8:]), scores[:, 8:])
    assert first.policy.config.protected_layers == (0,) and second.policy.config.protected_layers == (1, 7)
    assert first.policy.skippable.tolist() == [False] + [True] * 7
    assert second.policy.skippable.tolist() == [True, False] + [True] * 5 + [False]
    assert second.sender is not None and (second.sender.first_layer, second.sender.model_layers) == (8, 16)
    assert second.sender.num_layers == 8 and second.executed_skips.shape == (8,)
