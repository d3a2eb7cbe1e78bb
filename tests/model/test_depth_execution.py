"""The depth execution (layerwatch/inference_shim/runtime/depth_execution.py): how a batch runs the layers its
rows decided. Plans are tested with given costs (FixedDepthCosts), so they are deterministic; the
measured costs only for what a measurement must do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerwatch.inference_shim.offline.evaluation import teacher_forced_decode
from layerwatch.inference_shim.runtime.depth_execution import (
    DepthExecution,
    DepthExecutionConfig,
    FixedDepthCosts,
    MeasuredDepthCosts,
)
from layerwatch.inference_shim.runtime.engine import SamplingParams
from layerwatch.inference_shim.runtime.model import KVCache

from .test_skipping import MIXED, PROMPTS, Recorder, engine_for, gated_model

# Layer columns of an 8-row batch: wanted by 8, 0, 1, 2, 3, 4 and 6 rows.
WANTING = [8, 0, 1, 2, 3, 4, 6]
DECIDED = np.array([[row < wanting for wanting in WANTING] for row in range(8)])
NOBODY = np.zeros(8, dtype=bool)


def plan(mode: str, vote: float | None, limit: int, full_depth: np.ndarray = NOBODY) -> np.ndarray:
    depth = DepthExecution(DepthExecutionConfig(mode, vote), FixedDepthCosts({8: limit}))
    return depth.plan(DECIDED, full_depth)


def runs(executed: np.ndarray) -> list[int]:
    return executed.sum(axis=0).tolist()


def test_auto_runs_a_layer_row_by_row_only_up_to_the_limit_and_whole_beyond():
    executed = plan("auto", None, limit=2)
    # 1 and 2 rows: row-partial, exactly the deciding rows; 3 and more: every row.
    assert runs(executed) == [8, 0, 1, 2, 8, 8, 8]
    assert np.array_equal(executed[:, :4], DECIDED[:, :4])
    assert (executed >= DECIDED).all()  # no row lost a layer it wanted: its output can only gain


def test_auto_with_a_consensus_votes_where_a_layer_would_run_whole():
    # Beyond the limit (2), a layer runs for all when at least half the rows want it, else for none.
    assert runs(plan("auto", 0.5, limit=2)) == [8, 0, 1, 2, 0, 8, 8]
    assert runs(plan("auto", 0.75, limit=2)) == [8, 0, 1, 2, 0, 0, 8]


def test_rows_mode_runs_every_row_as_it_decided_and_batch_mode_whole_layers_only():
    assert np.array_equal(plan("rows", 0.5, limit=0), DECIDED)  # no layer runs whole: no vote either
    assert runs(plan("batch", None, limit=7)) == [8, 0, 8, 8, 8, 8, 8]  # batch ignores the costs
    assert runs(plan("batch", 0.5, limit=7)) == [8, 0, 0, 0, 0, 8, 8]  # what --batch-consensus 0.5 did


@pytest.mark.parametrize(("mode", "vote", "limit"), [("auto", 0.5, 2), ("auto", 0.9, 0), ("batch", 0.5, 0)])
def test_full_depth_rows_run_every_layer_whatever_the_vote(mode, vote, limit):
    full_depth = np.zeros(8, dtype=bool)
    full_depth[7] = True  # e.g. tau 0: its rule keeps every layer
    decided = DECIDED.copy()
    decided[7] = True
    depth = DepthExecution(DepthExecutionConfig(mode, vote), FixedDepthCosts({8: limit}))
    executed = depth.plan(decided, full_depth)
    assert executed[7].all()
    # A layer the vote turns off runs for the full-depth row alone where the row-partial path pays
    # (one row within the limit), else for every row.
    wanting = decided.sum(axis=0)
    voted_off = (wanting > limit) & (wanting / 8 < vote)
    assert voted_off.any()
    expected = 1 if limit >= 1 else 8
    assert all(executed[:, layer].sum() == expected for layer in np.flatnonzero(voted_off))


def test_rows_made_to_run_a_layer_they_skipped_get_what_full_depth_computes():
    """A row whose rule skipped layers but which ran every layer for its batch's sake (the whole
    path) produces full depth's logits, bit for bit; rows that ran row-partial what they decided."""
    model = gated_model()
    L = model.config.num_layers
    decided = np.ones((4, L), dtype=bool)
    decided[0, [1, 3]] = False  # row 0 skips layers 1 and 3 ...
    decided[1:3, 2] = False  # ... rows 1 and 2 layer 2; row 3 runs everything
    depth = DepthExecution(DepthExecutionConfig("auto", None), FixedDepthCosts({4: 1}))
    executed = depth.plan(decided, np.zeros(4, dtype=bool))
    # Layers 1 and 3: wanted by 3 rows (> limit 1), run whole; layer 2: wanted by 2, run whole too.
    assert executed.all()

    def step(run_mask):
        cache = KVCache(model.config, slots=4, max_len=16, dtype=torch.float32, device="cpu")
        for slot in range(4):
            model.prefill(torch.tensor(PROMPTS[slot % 3][:4]), cache, slot)
        logits, _ = model.decode_step(torch.tensor([5, 6, 7, 8]), cache, [0, 1, 2, 3], [4] * 4, run_mask)
        return logits

    assert torch.equal(step(executed), step(None))
    assert not torch.equal(step(decided)[0], step(None)[0])  # as decided, row 0 differs: it skips
    partial = DepthExecution(DepthExecutionConfig("auto", None), FixedDepthCosts({4: 3})).plan(
        decided, np.zeros(4, dtype=bool)
    )
    assert np.array_equal(partial, decided)  # within the limit: exactly as decided


def test_the_engine_counts_decided_and_executed_skips_apart(tokenizer):
    """Step records and usage: `skipped` is what each rule decided, `executed_skipped` what ran;
    the difference is the layers run for rows that skipped them and those a consensus voted off."""
    depth = DepthExecution(DepthExecutionConfig("auto", 0.5), FixedDepthCosts(default=0))
    recorder = Recorder()
    engine = engine_for(gated_model(), tokenizer, policy=MIXED, max_batch_size=3, depth=depth)
    engine.step_hook = recorder.on_step
    for prompt in PROMPTS:
        engine.submit(prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True))
    while engine.has_work():
        recorder.drain(engine)
    decided = np.concatenate([r.skipped for r in recorder.records])
    executed = np.concatenate([r.executed_skipped for r in recorder.records])
    unneeded, voted = (decided & ~executed).sum(), (~decided & executed).sum()
    assert unneeded > 0 and voted > 0  # both happened: the counts below are not trivially equal
    assert executed.sum() == decided.sum() - unneeded + voted
    for r in recorder.records:  # limit 0: each layer of a step ran for all its rows or for none
        ran = (~r.executed_skipped).sum(axis=0)
        assert all(n in (0, len(r.sequence_ids)) for n in ran.tolist())
        assert np.array_equal(r.batch_skipped, r.executed_skipped.all(axis=0))
    layers_skipped = sum(u.layers_skipped for u in recorder.final.values())
    assert layers_skipped == executed.sum()  # usage: what ran
    assert sum(int(u.layer_counts.skipped.sum()) for u in recorder.final.values()) == decided.sum()  # the rules'


def test_eval_totals_count_decided_executed_and_unneeded_apart():
    model = gated_model()
    windows = torch.randint(2, 300, (4, 20), generator=torch.Generator().manual_seed(0))
    depth = DepthExecution(DepthExecutionConfig("auto", None), FixedDepthCosts(default=1))
    totals = teacher_forced_decode(model, windows, 4, MIXED, batch_size=4, depth=depth)
    alone = teacher_forced_decode(model, windows, 4, MIXED, batch_size=4)  # rows as they decided
    assert totals.unneeded_runs_per_layer.sum() > 0
    assert np.array_equal(
        totals.executed_skips_per_layer, totals.skips_per_layer - totals.unneeded_runs_per_layer
    )  # no vote: only layers run for rows that skipped them
    assert alone.executed_skip_fraction == alone.skip_fraction and alone.unneeded_run_fraction == 0
    assert sum(totals.paths.values()) == (20 - 4) * model.config.num_layers  # every (step, layer) once
    assert totals.paths["partial"] > 0 and totals.paths["whole"] > 0


def test_a_measurement_finds_a_limit_once_per_batch_size_without_counting_or_reading_the_device():
    model = gated_model()
    costs = MeasuredDepthCosts(model, "project", repeats=1)

    class Untouched(list):
        # serve measures in the engine thread while the listener is up: a reader of the counts
        # must never see them move, not even for the measurement's duration.
        def __setitem__(self, index, value):
            raise AssertionError(f"the measurement counted rows of layer {index}")

    counted = model.layer_rows_executed = Untouched(model.layer_rows_executed)
    costs.prepare([1, 4, 4])
    assert set(costs.limits) == {1, 4} and costs.limits[1] == 0 and 0 <= costs.limits[4] <= 3
    assert costs.seconds > 0 and "B=4: " in costs.table()
    assert model.layer_rows_executed is counted  # the measurement ran for no sequence
    limits = dict(costs.limits)
    assert costs.row_partial_limit(4) == limits[4] and costs.limits == limits  # kept, not measured again
