"""vLLM's tensor parallelism with the plugin: two ranks, a core each (`--tensor-parallel-size 2`), on a small
random Llama whose 4 heads two ranks can split (SmolLM2's 9 cannot: vLLM refuses it). Rank 0 decides and
broadcasts the run mask, so both ranks run the same rows of every layer: their executed skips are equal, and a
rank that decided on its own (or ran garbage) would show here. The decisions are the shim's for the same tokens,
as size 1's are (tests/vllm/test_plugin.py, on the shared engine), and rank 0's frames carry exactly them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from layerwatch.skip_policy import SkipPolicyConfig
from tests.conftest import RealModel
from tests.vllm_engine import require_vllm, run_helper

from .shim_reference import Sequence, compare
from .tiny_model import median_threshold, save_tiny_model

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TOKENS = 24
# One core per rank: vLLM cannot place two CPU workers on this machine's one NUMA node by itself.
THREADS_PER_RANK = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_two_ranks_run_rank_zeros_mask_and_decide_as_the_shim(real_model: RealModel, tmp_path: Path) -> None:
    require_vllm()
    folder = save_tiny_model(real_model, tmp_path / "tiny")
    tau = median_threshold(folder)
    settings = json.dumps({"threshold": tau})
    result = run_helper(
        "offline_run.py", str(folder), str(TOKENS), json.dumps(PROMPTS), settings, "2", env=THREADS_PER_RANK
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
    comparison = compare(folder, SkipPolicyConfig(threshold=tau), sequences)
    print(comparison)
    assert comparison.score_error <= comparison.bound
    assert not comparison.unexplained
