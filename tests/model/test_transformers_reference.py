"""Our model against a reference nobody here wrote: transformers' own model of each family.

Each case builds a tiny random checkpoint with transformers, saves it the Hugging Face way, loads
it with our loader and compares logits (fp32, within a few times float32's own rounding of the
same computation: `float32_tolerance`): a full forward, and
token-by-token decoding through our KV cache against transformers' own cached decoding. Skipping
is checked against transformers too: a decode step that skips layers matches transformers' forward
with those layers' whole residual update (output norms included) removed for that token.
"""

from __future__ import annotations

import copy
import inspect

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from layerwatch.cli.main import main  # noqa: E402
from layerwatch.inference_shim.runtime.checkpoint import (  # noqa: E402
    checkpoint_fingerprint,
    load_checkpoint,
    save_checkpoint,
)
from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams  # noqa: E402
from layerwatch.inference_shim.runtime.gates import load_gates, model_fingerprint  # noqa: E402
from layerwatch.inference_shim.runtime.model import KVCache, LayerProbe  # noqa: E402
from layerwatch.skip_policy import SkipPolicyConfig  # noqa: E402

from .conftest import VOCAB_SIZE, constant_gates, random_model, tiny_config  # noqa: E402

# Two float32 implementations of one model differ by their rounding, whose size depends on the
# model, the input and the CPU's kernels (one batched decode: 1.5e-4 with ATEN_CPU_CAPABILITY=default,
# under 1e-4 with AVX-512), so no fixed number holds everywhere. Each comparison is held instead to
# FLOAT32_ERRORS times how far float32 rounding moves transformers' own result for the same input
# (its float32 run against a float64 copy's: `float32_tolerance`). Ours carries an error of that size
# and transformers' another, made by the same operations in another order; 16 leaves room for the
# worst of many positions (measured up to 4 across every case and kernel set), and a real mistake
# (a rope, a norm, a window) moves logits by 1e-2 or more.
FLOAT32_ERRORS = 16
SEQUENCE_LENGTH = 40  # crosses the llama3 case's original_max_position_embeddings=16

LLAMA = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "llama-gqa": ("llama", dict(LLAMA), {}),
    "llama-sharded": ("llama", dict(LLAMA), {"max_shard_size": "20KB"}),
    "llama-tied": ("llama", dict(LLAMA, tie_word_embeddings=True), {}),
    "llama3-rope-scaling": ("llama", dict(LLAMA, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0), {}),
    "llama-linear-rope-mha": (
        "llama",
        dict(LLAMA, num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        {},
    ),
    "qwen2-biases": ("qwen2", dict(LLAMA, num_key_value_heads=1), {}),
    "mistral": ("mistral", dict(LLAMA, sliding_window=64), {}),
    "qwen3-qk-norm": ("qwen3", dict(LLAMA, head_dim=16), {}),  # head_dim != hidden / heads
    "gemma": ("gemma", dict(LLAMA, head_dim=8, num_key_value_heads=1), {}),
    "gemma-untied-gelu-legacy": ("gemma", dict(LLAMA, head_dim=8, tie_word_embeddings=False, hidden_act="gelu"), {}),
    # A window of 8 < SEQUENCE_LENGTH slides on layers 0 and 2; tight caps so that both bend values.
    "gemma2": (
        "gemma2",
        dict(
            LLAMA,
            head_dim=8,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
        ),
        {},
    ),
    "gemma2-no-caps-layer-types": (
        "gemma2",
        dict(
            LLAMA,
            head_dim=8,
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        ),
        {},
    ),
    "phi3-fused": ("phi3", dict(LLAMA, pad_token_id=None), {}),
    "olmo2-post-norms": ("olmo2", dict(LLAMA), {}),
}
REFERENCE_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
}


# transformers 5 renamed `past_key_values` to `cache` (argument and output).
CACHE_ARGUMENT = (
    "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"
)


def reference_cache(output):
    return output[CACHE_ARGUMENT] if CACHE_ARGUMENT in output else output["past_key_values"]


def randomize(model: torch.nn.Module, seed: int) -> None:
    # transformers initialises norms to 1 and biases to 0: randomise everything so each weight counts.
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)


def build_reference(family: str, fields: dict):
    fields = copy.deepcopy(fields)  # transformers writes into the rope dict it is given
    config_class, model_class = REFERENCE_CLASSES[family]
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))
    randomize(model, seed=0)
    return model.eval()


@pytest.fixture(params=list(CASES), scope="module")
def pair(request, tmp_path_factory, backend_tokenizer):
    """(transformers model, our loaded checkpoint) for one case."""
    torch.set_num_threads(1)
    family, fields, save_options = CASES[request.param]
    reference = build_reference(family, fields)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder, **save_options)
    backend_tokenizer.save(str(folder / "tokenizer.json"))
    if "max_shard_size" in save_options:
        assert (folder / "model.safetensors.index.json").is_file()
    return reference, load_checkpoint(folder)


def float32_tolerances(reference, compute) -> list[float]:
    """For each tensor `compute(model)` returns: FLOAT32_ERRORS times its largest difference between
    `reference` (float32) and a float64 copy of it."""
    float64 = copy.deepcopy(reference).double()
    with torch.no_grad():
        rounded, exact = compute(reference), compute(float64)
    return [FLOAT32_ERRORS * (a.double() - b.double()).abs().max().item() for a, b in zip(rounded, exact, strict=True)]


def float32_tolerance(reference, compute) -> float:
    return max(float32_tolerances(reference, compute))


def logits_of(*sequences: torch.Tensor):
    """A `compute` for float32_tolerance: the model's logits for each sequence."""
    return lambda model: [model(tokens).logits for tokens in sequences]


def sequence(seed: int, length: int = SEQUENCE_LENGTH) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(seed))


def test_full_forward_matches_transformers(pair):
    reference, ours = pair
    tokens = sequence(1)
    with torch.no_grad():
        expected = reference(tokens).logits
        logits, _ = ours.model(tokens)
    assert (logits - expected).abs().max().item() <= float32_tolerance(reference, logits_of(tokens))


def test_cached_decoding_matches_transformers_cached_decoding(pair):
    reference, ours = pair
    tokens = sequence(2)
    prompt = 5
    with torch.no_grad():
        out = reference(tokens[:, :prompt], use_cache=True)
        past, expected = reference_cache(out), [out.logits[0, -1]]
        for t in range(prompt, SEQUENCE_LENGTH):
            out = reference(tokens[:, t : t + 1], use_cache=True, **{CACHE_ARGUMENT: past})
            past = reference_cache(out)
            expected.append(out.logits[0, -1])

    model = ours.model
    cache = KVCache(model.config, slots=2, max_len=64, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        prefill_logits, _ = model.prefill(tokens[0, :prompt], cache, slot=1)
    got = [prefill_logits]
    for t in range(prompt, SEQUENCE_LENGTH):
        logits, _ = model.decode_step(tokens[0, t : t + 1], cache, slots=[1], positions=[t], run_mask=None)
        got.append(logits[0])
    tolerance = float32_tolerance(reference, logits_of(tokens))
    assert (torch.stack(got) - torch.stack(expected)).abs().max().item() <= tolerance


def test_batched_decoding_of_unequal_sequences_matches_transformers(pair):
    # Two sequences at different positions in one decode batch, each in its own cache slot.
    reference, ours = pair
    long, short = sequence(3)[0], sequence(4, 20)[0]
    with torch.no_grad():
        expected_long = reference(long[None]).logits[0]
        expected_short = reference(short[None]).logits[0]
    model = ours.model
    cache = KVCache(model.config, slots=2, max_len=64, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        model.prefill(long[:20], cache, slot=0)
        model.prefill(short[:1], cache, slot=1)
    worst = 0.0
    for step in range(19):
        positions = [20 + step, 1 + step]
        fed = torch.stack([long[positions[0]], short[positions[1]]])
        logits, _ = model.decode_step(fed, cache, slots=[0, 1], positions=positions, run_mask=None)
        worst = max(
            worst,
            (logits[0] - expected_long[positions[0]]).abs().max().item(),
            (logits[1] - expected_short[positions[1]]).abs().max().item(),
        )
    assert worst <= float32_tolerance(reference, logits_of(long[None], short[None]))


@pytest.mark.parametrize("skipped", [(1,), (0, 2)], ids=["middle", "outer"])
def test_skipped_layers_match_transformers_without_their_updates(pair, skipped):
    # Decode positions SKIPPING_AT skip the layers `skipped` (KV policy `project`): transformers'
    # forward, with those layers handing those positions' input through unchanged, is what our
    # decode steps must produce. Its keys and values there come from the layer's input, as
    # `project` computes them, so the later positions check the cache too.
    reference, ours = pair
    tokens = sequence(7, 24)
    prompt = 16
    skipping_at = [17, 19, 20, 23]

    def pass_through(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        hidden[:, skipping_at] = args[0][:, skipping_at]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    layers = reference.model.layers
    hooks = [layers[layer].register_forward_hook(pass_through) for layer in skipped]
    try:
        with torch.no_grad():
            expected = reference(tokens).logits[0, prompt:]
    finally:
        for hook in hooks:
            hook.remove()

    model = ours.model
    cache = KVCache(model.config, slots=1, max_len=32, dtype=torch.float32, device="cpu")
    got = []
    with torch.no_grad():
        model.prefill(tokens[0, :prompt], cache, slot=0)
        for position in range(prompt, tokens.shape[1]):
            run_mask = np.ones((1, model.config.num_layers), dtype=bool)
            if position in skipping_at:
                run_mask[0, list(skipped)] = False
            fed = tokens[0, position : position + 1]
            logits, _ = model.decode_step(fed, cache, slots=[0], positions=[position], run_mask=run_mask)
            got.append(logits[0])
        full_depth = reference(tokens).logits[0, prompt:]
    tolerance = float32_tolerance(reference, logits_of(tokens))  # without the skips: the same rounding
    assert (torch.stack(got) - expected).abs().max().item() <= tolerance
    assert (expected - full_depth).abs().max().item() > 100 * tolerance  # the skips mattered


def test_layer_signals_match_transformers(pair):
    # LayerProbe (the shadow check's layer signals) against transformers' own attention
    # probabilities and each decoder layer's input and output: the family's scale, caps, q/k norms
    # and windows reach the attention KL, its output norms the relative update.
    reference, ours = pair
    tokens = sequence(8)
    probe = LayerProbe(start=3)
    with torch.no_grad():
        ours.model(tokens, probe=probe)
    assert probe.attention_kl is not None and probe.relative_update is not None
    expected_kl, expected_update = expected_layer_signals(reference, tokens)
    kl_tolerance, update_tolerance = float32_tolerances(reference, lambda model: expected_layer_signals(model, tokens))
    assert (probe.attention_kl - expected_kl[:, 3:]).abs().max().item() <= kl_tolerance
    assert (probe.relative_update - expected_update[:, 3:]).abs().max().item() <= update_tolerance


def expected_layer_signals(reference, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each layer's attention KL from uniform and relative update, [B, T, layers], from transformers'
    attention probabilities and its decoder layers' inputs and outputs."""
    ins, outs = [], []

    def record(module, args, output) -> None:
        ins.append(args[0])
        outs.append(output[0] if isinstance(output, tuple) else output)

    hooks = [layer.register_forward_hook(record) for layer in reference.model.layers]
    implementation = reference.config._attn_implementation
    reference.config._attn_implementation = "eager"  # the one that returns attention probabilities
    try:
        with torch.no_grad():
            attentions = reference(tokens, output_attentions=True).attentions
    finally:
        reference.config._attn_implementation = implementation
        for hook in hooks:
            hook.remove()
    config = reference.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    positions = torch.arange(tokens.shape[1], dtype=torch.float64)
    expected_kl, expected_update = [], []
    for probs, layer_in, layer_out, kind in zip(attentions, ins, outs, layer_types, strict=True):
        probs = probs.double()  # [B, H, T, T]; 0 outside the causal window
        plogp = torch.where(probs > 0, probs * probs.clamp_min(1e-300).log(), 0.0).sum(-1)
        attended = positions + 1 if kind == "full_attention" else (positions + 1).clamp_max(config.sliding_window)
        expected_kl.append((plogp + attended.log()).mean(1))
        expected_update.append((layer_out - layer_in).norm(dim=-1) / layer_in.norm(dim=-1))
    return torch.stack(expected_kl, -1), torch.stack(expected_update, -1)


def test_gates_score_and_skip_layers(pair, tokenizer):
    # Gates whose scores stay near 0 skip the unprotected layer after `patience` steps.
    _, ours = pair
    model = ours.model
    model.attach_gates(constant_gates(model.config, entropy_logit=-30.0))
    try:
        engine = GenerationEngine(
            model, tokenizer, model_name="tiny", policy=SkipPolicyConfig(threshold=0.18, patience=3)
        )
        result = engine.generate([0, 17, 54, 120], SamplingParams(max_tokens=8))
    finally:
        model.attach_gates(None)
    assert result.activity[:3].all()  # no history yet: full depth
    assert not result.activity[3:, 1].any() and result.activity[:, [0, 2]].all()


@pytest.mark.parametrize("pair", ["qwen3-qk-norm", "gemma", "gemma2", "phi3-fused", "olmo2-post-norms"], indirect=True)
def test_the_folders_fingerprint_is_the_loaded_models(pair):
    # Each family's names, fused projections (Phi3) and tied heads (Gemma), read from transformers' files.
    _, ours = pair
    assert checkpoint_fingerprint(ours.path, torch.float32) == model_fingerprint(ours.model)


def test_gates_train_on_each_family_and_load_for_it(pair, tmp_path):
    # `layerwatch train-gates` on the transformers-made checkpoint: soft gates weigh each layer's
    # whole update (output norms included), and the file loads for that model only.
    _, ours = pair
    text = tmp_path / "train.txt"
    text.write_text("In the beginning God created the heaven and the earth.\n\n" * 12, encoding="utf-8")
    out = tmp_path / "gates.safetensors"
    arguments = ["--steps", "4", "--batch-size", "2", "--seq-len", "12", "--threads", "1", "--quiet"]
    assert main(["train-gates", "--model", str(ours.path), "--data", str(text), "--out", str(out), *arguments]) == 0
    loaded = load_gates(out, ours.model)
    assert len(loaded.gates) == ours.config.num_layers


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"attention_bias": True}, {"rope_scaling": LLAMA3_ROPE}],
    ids=["llama", "tied", "qwen2-biases", "llama3-rope"],
)
def test_saved_checkpoint_loads_in_transformers_with_same_logits(tmp_path, tokenizer, overrides):
    model = random_model(tiny_config(**overrides), seed=5)
    save_checkpoint(model, tokenizer, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == ("Qwen2ForCausalLM" if overrides.get("attention_bias") else "LlamaForCausalLM")
    tokens = sequence(6)
    with torch.no_grad():
        ours, _ = model(tokens)
        theirs = reloaded(tokens).logits
    assert (ours - theirs).abs().max().item() <= float32_tolerance(reloaded, logits_of(tokens))
    assert torch.equal(load_checkpoint(tmp_path).model(tokens)[0], ours)
