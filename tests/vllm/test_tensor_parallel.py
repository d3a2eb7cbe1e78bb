"""vLLM's tensor parallelism with the plugin: two ranks, a core each (`--tensor-parallel-size 2`), on the embedded
demo model (its 4 attention heads split over two ranks; SmolLM2's 9 do not, and vLLM refuses it) with its trained
gates. Rank 0 decides and broadcasts the run mask, so both ranks run the same rows of every layer: their executed
skips are equal, which a rank deciding on its own (or running an unset mask) would break. The decisions are the
shim's for the same tokens, as size 1's are (tests/vllm/test_plugin.py, on the shared engine), and rank 0's frames
carry exactly them."""

from __future__ import annotations

import json

import numpy as np

from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.gates import GATES_FILE, load_gates
from tests.vllm_engine import require_vllm, run_helper

from .shim_reference import Sequence, compare

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TOKENS = 40
# One core per rank: vLLM cannot place two CPU workers on this machine's one NUMA node by itself.
THREADS_PER_RANK = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_two_ranks_run_rank_zeros_mask_and_decide_as_the_shim() -> None:
    require_vllm()
    policy = load_gates(DEMO_MODEL_DIR / GATES_FILE, load_checkpoint(DEMO_MODEL_DIR).model).metadata.policy()
    result = run_helper(
        "offline_run.py", str(DEMO_MODEL_DIR), str(TOKENS), json.dumps(PROMPTS), "{}", "2", env=THREADS_PER_RANK
    )
    rank0, rank1 = result["executed"]
    assert rank0["step_rows"] == rank1["step_rows"] == len(PROMPTS) * TOKENS
    assert rank0["skips"] == rank1["skips"] and sum(rank0["skips"]) > 0  # one mask, really skipping
    assert rank1["frames"] is None  # one rank sends

    sequences = []
    for run in result["runs"]:
        frames = run["frames"]
        assert all(len(frame["scores"]) == 1 for frame in frames)
        scores = np.array([frame["scores"][0] for frame in frames], dtype=np.float32)
        skipped = np.array([frame["skipped"][0] for frame in frames], dtype=bool)
        sequences.append(Sequence(run["prompt_ids"], run["output_ids"], scores, skipped))
    assert sum(s.skipped.sum(axis=0) for s in sequences).tolist() == rank0["skips"]
    comparison = compare(DEMO_MODEL_DIR, policy, sequences)
    print(comparison)
    assert comparison.score_error <= comparison.bound
    assert not comparison.unexplained
