"""Gate files: round trip, sha256, and refusal to load gates trained for another model."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.utils.prune
from safetensors.torch import save_file

from layerwatch.inference_shim.runtime.checkpoint import checkpoint_fingerprint, load_checkpoint
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.gates import (
    GateFileError,
    GateMetadata,
    gate_file_max_bytes,
    load_gates,
    model_fingerprint,
    reset_gates,
    save_gates,
)
from layerwatch.inference_shim.runtime.model import GateBank, Transformer

from .conftest import random_gates, random_model, tiny_config


@pytest.fixture
def model():
    return random_model(tiny_config(), seed=3)


def metadata_for(model, **changes) -> GateMetadata:
    values = dict(
        num_layers=model.config.num_layers,
        hidden_size=model.config.hidden_size,
        threshold=0.18,
        patience=3,
        base_fingerprint=model_fingerprint(model),
    )
    values.update(changes)
    return GateMetadata(**values)


def test_round_trip_and_sha256_of_file_bytes(tmp_path, model):
    gates = random_gates(model.config)
    path = tmp_path / "gates.safetensors"
    sha = save_gates(path, gates, metadata_for(model, threshold=0.25, patience=2))
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_gates(path, model)
    assert loaded.sha256 == sha
    assert loaded.metadata == metadata_for(model, threshold=0.25, patience=2)
    x = torch.randn(3, model.config.hidden_size)
    assert all(torch.equal(loaded.gates[l](x), gates[l](x)) for l in range(model.config.num_layers))


def test_the_skip_rule_travels_with_the_file(tmp_path, model):
    path = tmp_path / "gates.safetensors"
    save_gates(path, random_gates(model.config), metadata_for(model, skip_rule="ewma", ewma_alpha=0.3))
    policy = load_gates(path, model).metadata.policy()
    assert (policy.skip_rule, policy.ewma_alpha, policy.threshold, policy.patience) == ("ewma", 0.3, 0.18, 3)
    assert load_gates(path, model).metadata.policy(skip_rule="streak").skip_rule == "streak"  # an override wins


def test_a_file_written_before_the_skip_rules_means_the_streak_rule(tmp_path, model):
    path = tmp_path / "gates.safetensors"
    old_fields = {f.name: v for f, v in zip(dataclasses.fields(GateMetadata), dataclasses.astuple(metadata_for(model)))}
    del old_fields["skip_rule"], old_fields["ewma_alpha"]
    save_file(
        {name: t.contiguous() for name, t in random_gates(model.config).state_dict().items()},
        path,
        metadata={"layerwatch_gates": json.dumps({"format_version": 1, **old_fields})},
    )
    assert load_gates(path, model).metadata.policy().skip_rule == "streak"


def test_gates_for_another_model_are_refused(tmp_path, model):
    path = tmp_path / "gates.safetensors"
    save_gates(path, random_gates(model.config), metadata_for(model))
    same_shape_other_weights = random_model(tiny_config(), seed=4)
    with pytest.raises(GateFileError, match="trained on another base model"):
        load_gates(path, same_shape_other_weights)
    deeper = random_model(tiny_config(num_layers=6), seed=3)
    with pytest.raises(GateFileError, match="4 layers and hidden size 32; this model has 6 layers"):
        load_gates(path, deeper)


def test_fingerprint_ignores_dtype_but_not_weights(model):
    fingerprint = model_fingerprint(model)
    assert model_fingerprint(random_model(tiny_config(), seed=3).to(torch.bfloat16)) == fingerprint
    nudged = random_model(tiny_config(), seed=3)
    with torch.no_grad():
        nudged.layers[2].mlp.down_proj.weight[0, 0] += 1.0  # sampled: index 0 is always picked
    assert model_fingerprint(nudged) != fingerprint


def test_fingerprint_of_a_tensor_past_float32_integers_samples_its_last_value():
    # 2^16 + 1 tokens x 256 = 16,777,472 values: past 2^24, where a float32 index of the last value
    # rounds one past the end (every real model's embedding is this large).
    model = Transformer(tiny_config(vocab_size=2**16 + 1, hidden_size=256))
    assert model.embed_tokens.weight.numel() > 2**24
    fingerprint = model_fingerprint(model)
    with torch.no_grad():
        model.embed_tokens.weight[-1, -1] += 1.0  # the last value is always sampled
    assert model_fingerprint(model) != fingerprint


def test_fingerprint_reads_config_numbers_at_float32(model):
    # A GGUF stores rms_norm_eps as float32 (9.999999747378752e-06), the model's config.json as 1e-05:
    # one model, one fingerprint, so gates trained on either folder load on the other.
    from_gguf = Transformer(dataclasses.replace(model.config, rms_norm_eps=float(np.float32(1e-5))))
    from_json = Transformer(dataclasses.replace(model.config, rms_norm_eps=1e-5))
    for other in (from_gguf, from_json):
        other.load_state_dict(model.state_dict())
    assert model_fingerprint(from_gguf) == model_fingerprint(from_json)
    wider = Transformer(dataclasses.replace(model.config, rms_norm_eps=2e-5))
    wider.load_state_dict(model.state_dict())
    assert model_fingerprint(wider) != model_fingerprint(from_json)


def test_family_features_enter_the_fingerprint_only_when_set(model):
    # The same weights computed another way (here Gemma's embedding scale) are another model; a
    # Llama's fingerprint leaves the family fields out, so the demo model's gate file still loads.
    scaled = Transformer(dataclasses.replace(model.config, embedding_scale=2.0))
    scaled.load_state_dict(model.state_dict())
    assert model_fingerprint(scaled) != model_fingerprint(model)
    demo = load_checkpoint(DEMO_MODEL_DIR)
    recorded = load_gates(DEMO_MODEL_DIR / "gates.safetensors", demo.model).metadata.base_fingerprint
    assert recorded == model_fingerprint(demo.model) == checkpoint_fingerprint(DEMO_MODEL_DIR, torch.float32)


def test_gates_follow_the_model_dtype(tmp_path, model):
    path = tmp_path / "gates.safetensors"
    save_gates(path, random_gates(model.config), metadata_for(model))
    half = random_model(tiny_config(), seed=3).to(torch.bfloat16)
    assert load_gates(path, half).gates[0].fc1.weight.dtype == torch.bfloat16


def test_missing_truncated_and_foreign_files(tmp_path, model):
    with pytest.raises(GateFileError, match="gate file not found") as missing:
        load_gates(tmp_path / "absent.safetensors", model)
    # It says how to get one (train gates) and how to serve the model meanwhile (at full depth).
    assert f"layerwatch train-gates --model DIR --data TEXT --out {tmp_path / 'absent.safetensors'}" in str(
        missing.value
    )
    assert "`layerwatch serve --no-gates` serves the model at full depth" in str(missing.value)
    path = tmp_path / "gates.safetensors"
    save_gates(path, random_gates(model.config), metadata_for(model))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(GateFileError, match="not a readable safetensors file"):
        load_gates(path, model)
    save_file({"w": torch.zeros(2)}, path)
    with pytest.raises(GateFileError, match="not a layerwatch gate file"):
        load_gates(path, model)
    with pytest.raises(GateFileError, match=r"cannot read the gate file \(File name too long\)"):
        load_gates(tmp_path / ("g" * 300), model)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # not "not found": it is there, and unreadable
    with pytest.raises(GateFileError, match=r"cannot read the gate file \(Too many levels of symbolic links\)"):
        load_gates(tmp_path / "loop", model)


def test_bad_metadata_and_wrong_tensors(tmp_path, model):
    path = tmp_path / "gates.safetensors"
    header = json.dumps({"format_version": 1, "num_layers": 4})
    save_file({"w": torch.zeros(2)}, path, metadata={"layerwatch_gates": header})
    with pytest.raises(GateFileError, match="bad 'layerwatch_gates' metadata"):
        load_gates(path, model)
    tensors = {k: v for k, v in random_gates(model.config).state_dict().items() if "gates.3." not in k}
    meta = json.dumps({"format_version": 1, **metadata_for(model).__dict__})
    save_file(tensors, path, metadata={"layerwatch_gates": meta})
    with pytest.raises(GateFileError, match="do not form a gate bank"):
        load_gates(path, model)


def test_reset_gates_is_deterministic_per_seed(tmp_path, model):
    first, again, other = reset_gates(model, 7), reset_gates(model, 7), reset_gates(model, 8)
    assert first.sha256 == again.sha256 != other.sha256
    sha = save_gates(tmp_path / "g.safetensors", first.gates, first.metadata)
    assert sha == first.sha256  # the served hash is the file's hash once written
    assert first.metadata.base_fingerprint == model_fingerprint(model)


def test_batched_scores_equal_each_gate_and_follow_weight_updates(model):
    gates = random_gates(model.config)
    inputs = torch.randn(model.config.num_layers, 5, model.config.hidden_size)

    def each_gate(bank=gates):
        return torch.stack([bank[l](inputs[l]) for l in range(len(bank))], dim=-1).detach()

    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    with torch.no_grad():
        gates[2].fc2.bias.add_(3.0)  # an optimizer step: in place
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    gates.load_state_dict(random_gates(model.config, seed=9).state_dict())
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    gates[0].fc1.weight = torch.nn.Parameter(torch.zeros_like(gates[0].fc1.weight))  # replaced
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    gates.gates[3] = random_gates(model.config, seed=4)[3]  # a whole gate replaced
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    copied = copy.deepcopy(gates)  # a copy's parameters are its own: updating them leaves the original
    with torch.no_grad():
        copied[1].fc2.bias.sub_(2.0)
    assert torch.allclose(copied.scores(inputs), each_gate(copied), atol=1e-6)
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    assert not torch.allclose(copied.scores(inputs), gates.scores(inputs), atol=1e-3)
    gates.to(torch.float64)  # moved: new storage, same Parameter objects
    inputs = inputs.double()
    assert gates.scores(inputs).dtype == torch.float64
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)


def test_batched_scores_follow_the_data_torch_helpers_assign_and_reparametrized_gates(model):
    """`vector_to_parameters` assigns each parameter's `.data` (the
    stacks kept the old values), prune and weight_norm compute a weight no longer a parameter
    (scores raised KeyError), and stacks laid out in inference mode could not be updated after it."""
    gates = random_gates(model.config)
    inputs = torch.randn(model.config.num_layers, 5, model.config.hidden_size)

    def each_gate():
        return torch.stack([gates[l](inputs[l]) for l in range(len(gates))], dim=-1).detach()

    gates.scores(inputs)  # laid out, its registrations seen
    vector = torch.nn.utils.parameters_to_vector(random_gates(model.config, seed=5).parameters())
    torch.nn.utils.vector_to_parameters(vector, gates.parameters())
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    with torch.no_grad():
        gates[1].fc1.weight.mul_(2.0)  # the new parameter is laid out again: in place is seen
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    torch.nn.utils.prune.l1_unstructured(gates[2].fc1, "weight", amount=0.5)
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    torch.nn.utils.prune.remove(gates[2].fc1, "weight")  # a parameter again: stacked again
    with torch.no_grad():
        gates[2].fc1.weight.add_(1.0)
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)
    gates[0].fc2.bias = torch.nn.Parameter(torch.ones(1))
    with torch.inference_mode():  # as the engine decodes: the stacks laid out again there
        gates.scores(inputs)
    with torch.no_grad():
        gates[0].fc2.bias.add_(1.0)  # an inference tensor refused this
    assert torch.allclose(gates.scores(inputs), each_gate(), atol=1e-6)


def write_gate_file(path, model, tensors=None, **metadata_fields) -> None:
    """A gate file as another tool might write it: any tensors, any metadata values (JSON, NaN included)."""
    tensors = tensors if tensors is not None else random_gates(model.config).state_dict()
    meta = {"format_version": 1, **metadata_for(model).__dict__, **metadata_fields}
    save_file(tensors, path, metadata={"layerwatch_gates": json.dumps(meta)})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("stored", [torch.float32, torch.float8_e5m2], ids=["float32", "float8"])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, model, value, stored):
    # torch's min/max and isfinite take no float8: such a file was a NotImplementedError, serve's traceback
    tensors = {name: tensor.to(stored) for name, tensor in random_gates(model.config).state_dict().items()}
    path = tmp_path / "gates.safetensors"
    write_gate_file(path, model, tensors)
    load_gates(path, model)  # finite: served
    tensors["gates.2.fc1.weight"][3, 5] = value
    write_gate_file(path, model, tensors)
    with pytest.raises(GateFileError, match=f"^{path}: tensor gates.2.fc1.weight holds 1 NaN or infinite value"):
        load_gates(path, model)


def test_weights_that_overflow_the_models_dtype_are_refused(tmp_path, model):
    half = random_model(tiny_config(), seed=3).to(torch.float16)
    tensors = random_gates(model.config).state_dict()
    tensors["gates.1.fc2.bias"][0] = 1e6  # finite in fp32, inf in float16
    path = tmp_path / "gates.safetensors"
    write_gate_file(path, model, tensors, base_fingerprint=model_fingerprint(half))
    with pytest.raises(
        GateFileError, match=r"tensor gates.1.fc2.bias holds 1 NaN or infinite value\(s\) once converted"
    ):
        load_gates(path, half)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ("[1, 2]", "expected a JSON object, got list"),
        ('"gates"', "expected a JSON object, got str"),
        ("{not json", "not JSON"),
        ("[" * 5000, "nested too deeply"),
    ],
)
def test_metadata_that_is_not_a_json_object_is_refused(tmp_path, model, metadata, message):
    path = tmp_path / "gates.safetensors"
    save_file(random_gates(model.config).state_dict(), path, metadata={"layerwatch_gates": metadata})
    with pytest.raises(GateFileError, match=f"^{path}: bad 'layerwatch_gates' metadata: {message}"):
        load_gates(path, model)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("threshold", float("nan"), r"threshold must be a number in \[0, 1\], got NaN"),
        ("threshold", True, r"threshold must be a number in \[0, 1\], got true"),
        ("threshold", 1.5, r"threshold must be a number in \[0, 1\], got 1.5"),
        ("threshold", "0.18", r"threshold must be a number in \[0, 1\], got \"0.18\""),
        ("patience", 0, "patience must be an integer >= 1, got 0"),
        ("patience", -2, "patience must be an integer >= 1, got -2"),
        ("patience", True, "patience must be an integer >= 1, got true"),
        ("patience", 2.0, "patience must be an integer >= 1, got 2.0"),
        ("patience", 2**31, "patience must be <= 2147483647, got 2147483648"),  # the rule's int32 step counts
        ("num_layers", True, "num_layers must be an integer >= 1, got true"),
        ("base_fingerprint", 7, "base_fingerprint must be a string, got 7"),
        ("skip_rule", "sliding", 'skip_rule must be one of "streak", "ewma", got "sliding"'),
        ("skip_rule", None, 'skip_rule must be one of "streak", "ewma", got null'),
        ("ewma_alpha", 0, r"ewma_alpha must be a number in \(0, 1\], got 0"),
        ("ewma_alpha", 1.5, r"ewma_alpha must be a number in \(0, 1\], got 1.5"),
        ("ewma_alpha", float("nan"), r"ewma_alpha must be a number in \(0, 1\], got NaN"),
        ("ewma_alpha", True, r"ewma_alpha must be a number in \(0, 1\], got true"),
    ],
)
def test_bad_metadata_values_are_refused_naming_file_and_field(tmp_path, model, field, value, message):
    path = tmp_path / "gates.safetensors"
    write_gate_file(path, model, **{field: value})
    with pytest.raises(GateFileError, match=f"^{path}: bad 'layerwatch_gates' metadata: {message}$"):
        load_gates(path, model)


def test_a_huge_file_is_refused_by_its_size_without_reading_it(tmp_path, model):
    """A sparse 1.5 GB file: refused from its size; tracemalloc sees no allocation of its bytes."""
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as file:
        file.truncate(1_500_000_000)
    limit = gate_file_max_bytes(model.config.num_layers, model.config.hidden_size)
    tracemalloc.start()
    try:
        with pytest.raises(
            GateFileError, match=f"^{path}: 1500000000 bytes; a gate file for this model has at most {limit}"
        ):
            load_gates(path, model)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_file_with_a_foreign_header_is_refused_before_it_is_read(tmp_path, model):
    """Within the size limit, but its first 8 bytes are no safetensors header length for this file."""
    path = tmp_path / "gates.safetensors"
    path.write_bytes(b"PK\x03\x04" + bytes(4000))  # a zip file's magic
    with pytest.raises(GateFileError, match=f"^{path}: not a readable safetensors file \\(a header of 67324752 bytes"):
        load_gates(path, model)


def test_the_size_limit_fits_real_gate_files(tmp_path):
    """The limit is derived from the shape: a real file is within it, with room for a bigger header."""
    for num_layers, hidden_size in [(4, 32), (32, 768)]:
        path = tmp_path / f"{num_layers}.safetensors"
        save_gates(path, GateBank(num_layers, hidden_size), GateMetadata(num_layers, hidden_size, 0.18, 3, "f" * 64))
        size, limit = path.stat().st_size, gate_file_max_bytes(num_layers, hidden_size)
        assert size < limit < size + 4096 + 256 * 4 * num_layers
