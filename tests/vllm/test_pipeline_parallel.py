"""vLLM's pipeline parallelism with the plugin: two stages, a core each (`--pipeline-parallel-size 2`), on the embedded
demo model with its trained gates, layers 0-7 on the first stage and 8-15 on the second. Each stage decides its own
layers from its own state, keyed by the KV slots both read alike: together their decisions are the shim's for the
same tokens, as size 1's are (tests/vllm/test_plugin.py). Each stage sends partial frames of its layers; an exporter
fed by both counts one model of 16 layers. Then a sampled batch (both prompts at once, n = 2): each stage's frames
carry exactly the skips it executed, and the exporter still counts every layer of every step row once."""

from __future__ import annotations

import json

import numpy as np

from layerwatch.exporter.state import ExporterConfig, ExporterState
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.gates import GATES_FILE, load_gates
from tests.vllm_engine import require_vllm, run_helper

from .shim_reference import Sequence, compare
from .test_tensor_parallel import PROMPTS, THREADS_PER_RANK, TOKENS

SAMPLED_TOKENS = 24


def test_two_stages_decide_as_one_model_and_the_exporter_counts_one() -> None:
    require_vllm()
    policy = load_gates(DEMO_MODEL_DIR / GATES_FILE, load_checkpoint(DEMO_MODEL_DIR).model).metadata.policy()
    result = run_helper(
        "offline_run.py",
        *(str(DEMO_MODEL_DIR), str(TOKENS), json.dumps(PROMPTS), "{}", "1", "2", str(SAMPLED_TOKENS)),
        env=THREADS_PER_RANK,
    )
    first, second = sorted(result["executed"], key=lambda worker: worker["first_layer"])
    assert (first["first_layer"], second["first_layer"]) == (0, len(first["skips"]))
    sampled = result["sampled"]
    assert sampled["tokens"] == len(PROMPTS) * 2 * SAMPLED_TOKENS
    steps = len(PROMPTS) * TOKENS + sampled["tokens"]
    assert first["step_rows"] == second["step_rows"] == steps
    assert sum(first["skips"]) > 0 and sum(second["skips"]) > 0  # both stages really skip
    exporter = ExporterState(ExporterConfig())

    sequences, frame_skips = [], {0: 0, second["first_layer"]: 0}
    for run in result["runs"]:
        stages = {}
        for start in frame_skips:
            frames = sorted((f for f in run["frames"] if f["first_layer"] == start), key=lambda f: f["seq"])
            assert len(frames) == TOKENS and all(len(frame["scores"]) == 1 for frame in frames)
            stages[start] = frames
            frame_skips[start] += np.array([frame["skipped"][0] for frame in frames]).sum(axis=0)
            for frame in frames:
                exporter.ingest_datagram(bytes.fromhex(frame["data"]))
        # A step's row: the first stage's columns, then the second's.
        scores = np.array([[*a["scores"][0], *b["scores"][0]] for a, b in zip(*stages.values())], dtype=np.float32)
        skipped = np.array([[*a["skipped"][0], *b["skipped"][0]] for a, b in zip(*stages.values())], dtype=bool)
        sequences.append(Sequence(run["prompt_ids"], run["output_ids"], scores, skipped))
    for frame in sampled["frames"]:
        frame_skips[frame["first_layer"]] += np.array(frame["skipped"]).sum(axis=0)
        exporter.ingest_datagram(bytes.fromhex(frame["data"]))
    assert frame_skips[0].tolist() == first["skips"]
    assert frame_skips[second["first_layer"]].tolist() == second["skips"]

    comparison = compare(DEMO_MODEL_DIR, policy, sequences)
    print(comparison)
    assert comparison.score_error <= comparison.bound
    assert not comparison.unexplained

    (model,) = exporter.snapshot()  # one model, all its layers, each under its own index
    assert model.layer_counts.tolist() == [steps] * 16
    assert model.layer_skips.tolist() == first["skips"] + second["skips"]
    assert model.frames_received == 2 * len(PROMPTS) * TOKENS + len(sampled["frames"]) and model.frames_lost == 0
    routing = exporter.routing(model.model_name)
    assert routing.tokens == steps and routing.skip_counts.tolist() == model.layer_skips.tolist()
