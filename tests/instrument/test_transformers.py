"""layerwatch.integrations.transformers on real transformers models: a tiny Llama behind per-token
routers (examples/router_llama.py), and layerwatch's gate file on a transformers Llama
(examples/gate_file_llama.py), whose published skip decisions must be the serving engine's on the
same random checkpoint, row for row."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from examples.gate_file_llama import left_padded, load_gated_llama  # noqa: E402
from examples.router_llama import THRESHOLD, prompts, routed_llama  # noqa: E402
from layerwatch.client import GateFrameSender  # noqa: E402
from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint  # noqa: E402
from layerwatch.inference_shim.runtime.depth_execution import DepthExecutionConfig  # noqa: E402
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams  # noqa: E402
from layerwatch.inference_shim.runtime.gates import (  # noqa: E402
    GateMetadata,
    gates_path_for,
    load_gates,
    model_fingerprint,
    save_gates,
)
from layerwatch.inference_shim.runtime.model import GateBank  # noqa: E402
from layerwatch.integrations.transformers import observe, read_attributes  # noqa: E402
from layerwatch.trace import TraceWriter, read_trace  # noqa: E402
from layerwatch.wire import decode_frame  # noqa: E402
from tests.model.conftest import VOCAB_SIZE, build_backend_tokenizer  # noqa: E402

READ_ROUTERS = read_attributes("router_score", "router_ran")
READ_GATES = read_attributes("gate_score", "gate_ran")
GATE_THRESHOLD = 0.5  # random gates score around 0.5: about half their scores fall below it
NEW_TOKENS = 14


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def router_model():
    return routed_llama(layers=4, hidden_size=32)


def trace_rows(path: Path) -> tuple[np.ndarray, np.ndarray]:
    records = list(read_trace(path))
    return np.stack([r.scores for r in records]), np.stack([r.skipped for r in records])


def generated(output: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    """Each row's generated tokens up to and including its first end-of-sequence token."""
    rows = []
    for row in output[:, prompt_width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:end])
    return rows


# --- the router example ------------------------------------------------------------------------------


def test_every_generated_token_is_one_row_and_finished_rows_are_left_out(router_model, tmp_path):
    batch = prompts(3, 6, seed=1)
    torch.manual_seed(0)
    trace = TraceWriter(tmp_path / "trace.jsonl", 1 << 20, threshold=THRESHOLD)
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(5)
    sender = GateFrameSender(f"127.0.0.1:{receiver.getsockname()[1]}", "routed", 4, THRESHOLD)
    # One token in about twelve ends a sequence here, so that sampled rows end at different steps.
    eos = [1, *range(100, 140)]
    with observe(router_model, READ_ROUTERS, sender=sender, trace=trace) as watch:
        output = router_model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=40,
            do_sample=True,
            temperature=0.9,
            eos_token_id=eos,
            pad_token_id=1,
        )
    sender.close()
    rows = generated(output, 6, set(eos))
    assert len({len(r) for r in rows}) > 1, "the rows should finish at different steps"
    assert watch.rows == sum(map(len, rows)) == len(list(read_trace(trace.path)))
    assert watch.steps == max(map(len, rows))
    frames = [decode_frame(receiver.recv(65536)) for _ in range(sender.sent)]
    receiver.close()
    assert sender.sent == watch.steps and sum(sender.dropped.values()) == 0
    assert [len(f.entropies) for f in frames] == [sum(len(r) > step for r in rows) for step in range(watch.steps)]
    scores, skipped = trace_rows(trace.path)
    np.testing.assert_array_equal(np.concatenate([f.entropies for f in frames]), scores)
    np.testing.assert_array_equal(skipped, scores < THRESHOLD)  # the router's own rule, per token


def test_the_first_row_is_the_prompts_last_position_and_a_skipped_token_keeps_its_state(router_model, tmp_path):
    prompt = prompts(1, 5, seed=2)
    wrapper = router_model.model.layers[2]
    seen = {}

    def record(module, args, output) -> None:
        seen.setdefault("io", (args[0], output))

    hook = wrapper.register_forward_hook(record)
    with torch.no_grad():
        router_model(prompt)  # a plain forward: not generate(), nothing published
    hook.remove()
    before, after = seen["io"]
    skipped = ~wrapper.router_ran[0]
    assert skipped.any() and (~skipped).any()
    assert torch.equal(after[0, skipped], before[0, skipped])  # a skipped token's hidden state passes through
    assert not torch.equal(after[0, ~skipped], before[0, ~skipped])
    last_scores = torch.stack([layer.router_score[0, -1] for layer in router_model.model.layers]).numpy()

    trace = TraceWriter(tmp_path / "trace.jsonl", 1 << 20)
    with observe(router_model, READ_ROUTERS, trace=trace, model_name="routed") as watch:
        router_model(prompt)
        assert watch.rows == 0
        router_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    scores, _ = trace_rows(trace.path)
    np.testing.assert_allclose(scores[0], last_scores, rtol=0, atol=1e-6)
    assert len(scores) == 3


def test_a_callable_adapter_and_close_leave_the_model_as_it_was(router_model, tmp_path):
    def read(index, layer, output):  # a callable adapter; layer 0 reported as always running
        return layer.router_score, None if index == 0 else layer.router_score >= THRESHOLD

    trace = TraceWriter(tmp_path / "trace.jsonl", 1 << 20)
    watch = observe(router_model, read, trace=trace, model_name="routed")
    assert "generate" in router_model.__dict__
    batch = prompts(2, 4, seed=3)
    router_model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=4, do_sample=False)
    watch.close()
    scores, skipped = trace_rows(trace.path)
    assert not skipped[:, 0].any() and (scores[:, 0] < THRESHOLD).any()
    np.testing.assert_array_equal(skipped[:, 1:], scores[:, 1:] < THRESHOLD)
    assert watch.rows == 8 and "generate" not in router_model.__dict__
    assert not router_model._forward_hooks and not router_model._forward_pre_hooks
    assert not any(layer._forward_hooks for layer in router_model.model.layers)
    router_model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=2, do_sample=False)
    assert watch.rows == 8


@pytest.mark.parametrize("closed_first", ["inner", "outer"])
def test_nested_observers_closed_in_either_order_each_publish_until_closed(router_model, tmp_path, closed_first):
    # Naively, closing the inner one deletes model.generate, the outer one's
    # wrapper with it, and the outer one publishes nothing; closing the outer one first breaks generate.
    batch = prompts(2, 4, seed=5)

    def generate() -> None:
        router_model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=2, do_sample=False)

    outer, inner = (
        observe(router_model, READ_ROUTERS, trace=TraceWriter(tmp_path / f"{name}.jsonl", 1 << 20), model_name=name)
        for name in ("outer", "inner")
    )
    generate()
    assert (outer.rows, inner.rows) == (4, 4)
    first, second = (inner, outer) if closed_first == "inner" else (outer, inner)
    first.close()
    generate()
    assert (first.rows, second.rows) == (4, 8)
    second.close()
    generate()
    assert (first.rows, second.rows) == (4, 8)
    assert "generate" not in router_model.__dict__ and not router_model._forward_hooks


def test_a_misfitting_sender_or_adapter_is_refused_clearly(router_model, tmp_path):
    with pytest.raises(ValueError, match="the sender expects 6 layers, the model has 4"):
        observe(router_model, READ_ROUTERS, sender=GateFrameSender("127.0.0.1:9", "m", 6, 0.5))
    with pytest.raises(ValueError, match="nothing to publish to"):
        observe(router_model, READ_ROUTERS)
    with pytest.raises(ValueError, match="needs model_name"):
        observe(router_model, READ_ROUTERS, trace=TraceWriter(tmp_path / "t.jsonl", 1 << 20))


def test_an_adapter_that_fails_drops_the_forward_never_generate(router_model, tmp_path, caplog):
    """The adapter's errors must not be raised out of the user's generate()."""
    batch = prompts(2, 4, seed=4)
    plain = router_model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=2, do_sample=False)

    def complex_scores(index, layer, output):  # the imaginary part must not be lost
        return layer.router_score.to(torch.complex64), None

    for adapter, message in (
        (read_attributes("no_such_score"), "decoder layer 0 .* has no tensor attribute 'no_such_score'"),
        (lambda i, layer, output: (layer.router_score[0], None), r"the adapter's score has shape \(4,\)"),
        (complex_scores, "adapter.s score is torch.complex64; expected real"),
    ):
        caplog.clear()
        trace = TraceWriter(tmp_path / "t.jsonl", 1 << 20)
        with observe(router_model, adapter, trace=trace, model_name="m") as watch:
            output = router_model.generate(
                batch, attention_mask=torch.ones_like(batch), max_new_tokens=2, do_sample=False
            )
        assert torch.equal(output, plain)
        assert watch.rows == 0 and watch.dropped == {"no_reading": 0, "adapter_error": 2}
        assert any(re.search(message, r.getMessage()) for r in caplog.records if r.levelname == "WARNING"), message


class EarlyExit(nn.Module):
    """An early exit in front of a decoder layer: on the forwards listed in `exits` the layer is not
    called at all and the hidden state passes through (the exit head took the token out)."""

    def __init__(self, layer: nn.Module, exits: set[int]) -> None:
        super().__init__()
        self.layer, self.exits, self.forwards = layer, exits, 0

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        self.forwards += 1
        if self.forwards - 1 in self.exits:
            return hidden_states
        return self.layer(hidden_states, *args, **kwargs)


def test_a_layer_not_called_in_a_forward_drops_that_forward_never_generate(tmp_path, caplog):
    """generate() must not raise "decoder layers [3] gave no reading in this forward"."""
    model = routed_llama(layers=4, hidden_size=32)
    routers = list(model.model.layers)
    model.model.layers[3] = EarlyExit(routers[3], exits={1, 3, 4})  # forward 0 is the prefill
    batch = prompts(2, 4, seed=5)
    trace = TraceWriter(tmp_path / "t.jsonl", 1 << 20)
    with observe(model, READ_ROUTERS, trace=trace, model_name="m", layers=routers) as watch:
        output = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=6, do_sample=False)
    assert output.shape == (2, 10)
    assert watch.dropped == {"no_reading": 3, "adapter_error": 0}
    assert watch.steps == 3 and watch.rows == 6 == len(list(read_trace(trace.path)))
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]  # then one a minute
    assert "not published (no_reading): decoder layers [3] were not called in this forward" in warning

    # A layer whose router set no score in one forward drops that forward only.
    def score_missing_in_the_second_forward(index, layer, output):
        if index == 1 and watch.steps == 1 and not watch.dropped["adapter_error"]:
            layer.router_score = None
        return READ_ROUTERS(index, layer, output)

    model.model.layers[3] = routers[3]
    with observe(model, score_missing_in_the_second_forward, trace=trace, model_name="m") as watch:
        model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=6, do_sample=False)
    assert watch.dropped == {"no_reading": 0, "adapter_error": 1} and watch.steps == 5


# --- layerwatch's gate file on a transformers Llama, against the engine ----------------------------


@pytest.fixture(scope="module")
def gated_checkpoint(tmp_path_factory) -> Path:
    """A random transformers Llama saved with a tokenizer and a gate file our loader accepts for it."""
    folder = tmp_path_factory.mktemp("gated-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # transformers' init is nearly flat; random weights make every token count
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    build_backend_tokenizer().save(str(folder / "tokenizer.json"))
    ours = load_checkpoint(folder).model
    torch.manual_seed(1)
    gates = GateBank(config.num_hidden_layers, config.hidden_size)
    metadata = GateMetadata(config.num_hidden_layers, config.hidden_size, GATE_THRESHOLD, 2, model_fingerprint(ours))
    save_gates(gates_path_for(folder), gates, metadata)
    return folder


def engine_generation(folder: Path, prompt_ids: list[list[int]], **policy) -> tuple[list[list[int]], list]:
    checkpoint = load_checkpoint(folder)
    loaded = load_gates(gates_path_for(folder), checkpoint.model)
    checkpoint.model.attach_gates(loaded.gates)
    records: list = []
    engine = GenerationEngine(
        checkpoint.model,
        checkpoint.tokenizer,
        model_name="tiny",
        policy=loaded.metadata.policy(**policy),
        max_batch_size=len(prompt_ids),
        step_hook=records.append,
        # Each row exactly as it decided, as the example runs them (the default depth execution may
        # run a layer for a row that skipped it, or vote one off: docs/model.md, "Depth execution").
        depth=DepthExecutionConfig("rows", None),
    )
    ids = [engine.submit(p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)) for p in prompt_ids]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for update in engine.step():
            tokens[update.sequence_id] += update.new_token_ids
    return [tokens[i] for i in ids], records


def set_end_of_sequence(folder: Path, eos: list[int]) -> None:
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        data = json.loads(path.read_text())
        data["eos_token_id"] = eos
        path.write_text(json.dumps(data))


@pytest.mark.parametrize("skip_rule", ["streak", "ewma"])
def test_the_gate_file_on_transformers_skips_exactly_as_the_engine(gated_checkpoint, tmp_path, skip_rule):
    # Prompts of unequal length (the shorter one left-padded), and an end-of-sequence token that one
    # of the sequences produces early: the engine then decodes the other one alone.
    prompt_ids = [[0, 17, 54, 120, 33, 9, 250, 71], [0, 88, 12, 140, 201]]
    unstopped, _ = engine_generation(gated_checkpoint, prompt_ids, skip_rule=skip_rule)
    first = unstopped[0]
    stop = next(i for i in range(3, NEW_TOKENS) if first[i] not in first[:i])
    eos = [1, first[stop]]
    set_end_of_sequence(gated_checkpoint, eos)
    try:
        expected_tokens, records = engine_generation(gated_checkpoint, prompt_ids, skip_rule=skip_rule)
        gated = load_gated_llama(gated_checkpoint, skip_rule=skip_rule)
    finally:
        set_end_of_sequence(gated_checkpoint, [1])
    assert len(expected_tokens[0]) == stop + 1 and len(expected_tokens[1]) > len(expected_tokens[0])

    trace = TraceWriter(tmp_path / "trace.jsonl", 1 << 20, threshold=GATE_THRESHOLD)
    ids, mask = left_padded(prompt_ids, pad_id=1)
    with observe(gated.model, READ_GATES, trace=trace, model_name="tiny"):
        output = gated.model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=1
        )
    assert generated(output, ids.shape[1], set(eos)) == expected_tokens
    scores, skipped = trace_rows(trace.path)
    expected_skipped = np.concatenate([r.skipped for r in records])
    np.testing.assert_array_equal(skipped, expected_skipped)
    np.testing.assert_allclose(scores, np.concatenate([r.entropies for r in records]), rtol=0, atol=1e-5)
    assert expected_skipped[:, 1:-1].mean() > 0.1 and not expected_skipped[:, [0, -1]].any()  # protected layers
