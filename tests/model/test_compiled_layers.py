"""`--compile`: the layer bodies are compiled, the skip decision is not.

A compiled graph that held the whole step would run every layer for every row; compiling only the
bodies keeps the decision in Python. These tests count the rows that enter each compiled body and
compare the decoded tokens with eager decoding. They compile with the `aot_eager` backend: it
captures the same graphs as the default `inductor` (Dynamo, then AOTAutograd) without generating and
building C++ kernels, which takes minutes on a small CPU; `layerwatch serve --compile` uses inductor
(benchmarks/batch_decode_bench.py --compile measures it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from layerwatch.inference_shim.runtime.engine import SamplingParams
from layerwatch.inference_shim.runtime.model import CompileError

from .test_skipping import PROMPTS, Recorder, engine_for, gated_model

BODIES = ("decode_qkv", "decode_queries", "decode_kv", "decode_updates")


def counting(rows: list[int], layer: int, body):
    """`body`, counting the rows (the leading dimension of its first argument) that enter it."""

    def counted(x, *args):
        rows[layer] += x.shape[0]
        return body(x, *args)

    return counted


def decode_batch(model, tokenizer) -> Recorder:
    recorder = Recorder()
    engine = engine_for(model, tokenizer, max_batch_size=3, step_hook=recorder.on_step)
    for prompt in PROMPTS:
        engine.submit(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    while engine.has_work():
        recorder.drain(engine)
    return recorder


def test_compiled_bodies_never_see_a_skipped_row_and_decode_the_eager_tokens(tokenizer):
    eager, compiled = gated_model(), gated_model()
    compiled.compile_layers(backend="aot_eager")
    graphs_built = counters["stats"]["unique_graphs"]
    L = compiled.config.num_layers
    rows: dict[str, list[int]] = {name: [0] * L for name in BODIES}
    for l, block in enumerate(compiled.layers):
        owner = {name: block.self_attn for name in BODIES[:3]} | {"decode_updates": block}
        for name in BODIES:
            body = getattr(owner[name], name)
            assert hasattr(body, "_torchdynamo_orig_callable"), f"layer {l} {name} is not compiled"
            setattr(owner[name], name, counting(rows[name], l, body))
    compiled.reset_counters()

    expected, got = decode_batch(eager, tokenizer), decode_batch(compiled, tokenizer)

    assert got.tokens == expected.tokens
    assert counters["stats"]["unique_graphs"] == graphs_built  # compile_layers built them all, none at serving time
    activity = np.concatenate([np.array(a) for a in got.activity.values()])
    assert np.array_equal(activity, np.concatenate([np.array(a) for a in expected.activity.values()]))
    ran = activity.sum(axis=0)
    assert ran.sum() < activity.size  # rows skipped layers, and rows in one step differed:
    assert any((r.skipped != r.skipped[0]).any() for r in got.records)
    # Only running rows enter the queries (with their K/V where every row runs the layer, alone
    # where some skip it) and the residual updates (attention output + FFN); the `project` policy
    # gives every row of the step its K/V, run or skipped.
    queries = np.add(rows["decode_qkv"], rows["decode_queries"])
    assert queries.tolist() == ran.tolist()
    assert rows["decode_updates"] == ran.tolist()
    assert np.add(rows["decode_qkv"], rows["decode_kv"]).tolist() == [len(activity)] * L
    assert 0 < sum(rows["decode_queries"]) < sum(queries)  # both paths were taken
    prefill_rows = sum(len(p) - 1 for p in PROMPTS)
    assert compiled.layer_rows_executed == (ran + prefill_rows).tolist()


def test_a_backend_that_cannot_compile_here_is_a_clear_error():
    model = gated_model()

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no C++ compiler found")

    expected = "(?s)'broken_backend'.*cannot compile the layers.*no C\\+\\+ compiler found"
    with pytest.raises(CompileError, match=expected):
        model.compile_layers(backend=broken_backend)
    torch._dynamo.reset()  # the broken backend's cache entries go with it
