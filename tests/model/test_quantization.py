"""Weights in low precision (runtime/quantization.py): each bound is derived from the scheme.

A quantized model's logits are those of its dequantized weights computed with bfloat16 inputs to the
projections, and each dequantized weight is within its error bound of the float one. So the tests
check: every weight within half a quantization step (the scheme's bound); every quantized linear
within bfloat16's rounding of x Ŵᵀ (its unit roundoff); the whole model within how far bfloat16
moves the same dequantized model's logits; the gates keep their dtype; the refusals.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint, save_checkpoint
from layerwatch.inference_shim.runtime.gates import model_fingerprint
from layerwatch.inference_shim.runtime.model import GateBank, KVCache, Transformer
from layerwatch.inference_shim.runtime.quantization import (
    HEAD_QUANTIZATION,
    INT4_GROUP,
    PrecisionError,
    QuantizedLinear,
    check_precision,
    check_quantizable,
    quantize_int4,
    quantize_int8,
    quantize_model,
)

from .conftest import random_model, tiny_config

BF16_ROUNDOFF = 2.0**-8  # bfloat16 keeps 8 significant bits: round to nearest is within 2^-8 relative
FP32_ROUNDOFF = 2.0**-24
METHODS = ("int8", "int4")
QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
CPU = torch.device("cpu")


def weights(rows: int = 48, columns: int = 96) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(rows, columns) * 0.05
    w[0] *= 100  # a row (and its groups) of a far larger range
    w[1, :INT4_GROUP] += 3.0  # a group whose minimum is far from 0 for its range: bfloat16 rounds its zero
    w[2] = 0.0  # an all-zero row
    return w


@pytest.mark.parametrize("method", METHODS)
def test_every_dequantized_weight_is_within_half_a_step(method):
    w = weights()
    quantized = QUANTIZERS[method](w)
    error = (quantized.dequantized() - w).abs()
    # The dequantization's own float32 arithmetic: a few roundings of values up to |w| + a step.
    slack = 4 * FP32_ROUNDOFF * (w.abs() + quantized.error_bound())
    assert bool((error <= quantized.error_bound() + slack).all())
    # And the bound is the scheme's: half of the step that spans the row (int8) or group (int4),
    # which a bfloat16 scale moves by at most 2^-8 of itself.
    if method == "int8":
        step = w.abs().amax(dim=1, keepdim=True) / 127
    else:
        groups = w.view(w.shape[0], -1, INT4_GROUP)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(INT4_GROUP, dim=1)
    ideal = (step / 2).expand_as(w) * (1 + 2 * BF16_ROUNDOFF)
    shifted = quantized.minimum_shift is not None and bool((quantized.minimum_shift.abs() > 0).any())
    inside = quantized.error_bound() <= ideal + FP32_ROUNDOFF
    if method == "int8":
        assert bool(inside.all())
    else:  # only a group whose bfloat16 zero moved its minimum more than half a step may exceed it
        assert shifted
        wide = ~inside.view(w.shape[0], -1, INT4_GROUP).all(-1)
        assert bool((quantized.minimum_shift.abs()[wide] > ideal.view(w.shape[0], -1, INT4_GROUP)[..., 0][wide]).all())


@pytest.mark.parametrize("method", METHODS)
def test_a_quantized_linear_is_its_dequantized_weight_in_bfloat16(method):
    w = weights()
    torch.manual_seed(1)
    bias = torch.randn(w.shape[0])
    x = torch.randn(5, 3, w.shape[1])
    linear = QuantizedLinear(w, bias, method)
    dequantized = QUANTIZERS[method](w).dequantized().double()
    rounded = x.to(torch.bfloat16).double()  # what the kernel reads
    exact = rounded @ dequantized.T
    magnitude = rounded.abs() @ dequantized.abs().T
    # The kernel accumulates in float32 (each of K products and sums rounded at most once more) and
    # rounds its output to bfloat16; the bias is added in float32.
    bound = BF16_ROUNDOFF * exact.abs() + (w.shape[1] + 2) * FP32_ROUNDOFF * magnitude + FP32_ROUNDOFF * bias.abs()
    y = linear(x)
    assert y.dtype == torch.float32 and y.shape == (5, 3, w.shape[0])
    assert bool(((y.double() - (exact + bias.double())).abs() <= bound + FP32_ROUNDOFF).all())


def dequantized_copy(model: Transformer, method: str, rounding: bool = False) -> Transformer:
    """`model` with every weight quantize_model quantizes replaced by its dequantized value, in float32;
    `rounding`: with those linears' inputs and outputs rounded to bfloat16, as the kernels round them.
    Without the decode layout, so that decoding calls each linear (and its rounding hooks)."""
    copy = random_model(model.config)
    if model.gates is not None:
        copy.attach_gates(GateBank(model.config.num_layers, model.config.hidden_size))
    copy.load_state_dict(model.state_dict())
    quantized = [
        (name, module)
        for name, module in copy.named_modules()
        if isinstance(module, nn.Linear) and not name.startswith("gates.")
    ]
    with torch.no_grad():
        for name, linear in quantized:
            weight = QUANTIZERS[HEAD_QUANTIZATION[method] if name == "lm_head" else method](linear.weight).dequantized()
            if name == "lm_head" and model.config.tie_word_embeddings:
                linear.weight = nn.Parameter(weight)  # the head's own copy; the embedding keeps its rows
            else:
                linear.weight.copy_(weight)
            if rounding:
                linear.register_forward_pre_hook(lambda _, args: tuple(a.bfloat16().float() for a in args))
                linear.register_forward_hook(lambda _, __, y: y.bfloat16().float())
    return copy.eval()


def logits_of(model: Transformer, tokens: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """Prefill logits of every position, then three decode steps whose run mask `skip`s some layers
    for some rows (the queries-only and the k/v-only projections), all in one tensor."""
    B, T = tokens.shape
    cache = KVCache(model.config, B, T + 4, model.embed_tokens.weight.dtype, CPU)
    outputs = [model(tokens)[0].reshape(B, -1)]
    for row in range(B):
        cache.reset_slot(row)
        model.prefill(tokens[row], cache, row)
    for step in range(3):
        positions = [T + step] * B
        logits, _ = model.decode_step(tokens[:, step], cache, list(range(B)), positions, ~skip.numpy())
        outputs.append(logits)
    return torch.cat(outputs, dim=-1).float()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("method", METHODS)
def test_a_quantized_model_computes_its_dequantized_weights_within_bfloat16(method, tied):
    config = tiny_config(tie_word_embeddings=tied)
    model = random_model(config).eval()
    torch.manual_seed(2)
    model.attach_gates(GateBank(config.num_layers, config.hidden_size).eval())
    reference = dequantized_copy(model, method)
    torch.manual_seed(3)
    tokens = torch.randint(2, config.vocab_size, (3, 7))
    skip = torch.zeros(3, config.num_layers, dtype=torch.bool)
    skip[0, 1] = skip[2, 2] = True  # rows 0 and 2 skip a layer each, row 1 runs everything

    expected = logits_of(reference, tokens, skip)
    rounded = logits_of(dequantized_copy(model, method, rounding=True), tokens, skip)
    # The kernels round what the hooks round; they differ from them only where their float32 sums,
    # added in another order, round to the neighbouring bfloat16 value (a few elements, by one step):
    # less than all the roundings together move the logits.
    bound = (rounded - expected).abs().max()
    quantize_model(model, method)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.method == HEAD_QUANTIZATION[method]
    actual = logits_of(model, tokens, skip)
    assert (actual - rounded).abs().max() <= bound
    # The quantization itself moved the logits by more than that: the comparison can tell.
    original = logits_of(random_model(config).eval(), tokens, skip)
    assert (original - expected).abs().max() > bound
    # What the module doc promises stays in the model's dtype does.
    assert model.embed_tokens.weight.dtype == torch.float32
    assert model.gates is not None and all(p.dtype == torch.float32 for p in model.gates.parameters())


def test_a_quantized_checkpoint_keeps_its_fingerprint_for_its_gates(tmp_path, tokenizer):
    model = random_model(tiny_config())
    save_checkpoint(model, tokenizer, tmp_path)
    assert model_fingerprint(load_checkpoint(tmp_path, quantization="int4").model) == model_fingerprint(model)


def test_int4_refuses_widths_its_kernel_cannot_take(tmp_path, tokenizer):
    save_checkpoint(random_model(tiny_config(intermediate_size=48)), tokenizer, tmp_path)
    with pytest.raises(PrecisionError, match=r"^--quantization int4 needs input widths divisible by 32: intermediate_"):
        load_checkpoint(tmp_path, quantization="int4")
    assert isinstance(load_checkpoint(tmp_path, quantization="int8").model.layers[0].mlp.down_proj, QuantizedLinear)


@pytest.mark.parametrize(
    "config, name",
    [
        (tiny_config(num_heads=3, num_kv_heads=1), "num_heads \\* head_dim is 24"),
        (tiny_config(hidden_size=40), "hidden_size is 40"),
    ],
)
def test_int8_refuses_input_widths_its_kernel_cannot_take(tmp_path, tokenizer, config, name):
    """torch's int8 kernel (_weight_int8pack_mm) reads inputs in units of 16.
    At 24 inputs it returned NaN for one row and killed the process (SIGSEGV) for five: `serve
    --quantization int8` of such a model crashed at its first prompt."""
    save_checkpoint(random_model(config), tokenizer, tmp_path)
    with pytest.raises(PrecisionError, match=rf"^--quantization int8 needs input widths divisible by 16: {name} "):
        load_checkpoint(tmp_path, quantization="int8")


@pytest.mark.parametrize(
    "device, dtype, quantization, message",
    [
        ("cpu", torch.float16, "none", "--dtype float16 is slow on the CPU"),
        ("cuda", torch.bfloat16, "int4", "--quantization int4 runs on torch's CPU kernels only, not on cuda"),
        ("cpu", torch.float32, "int3", "--quantization must be one of none, int8, int4"),
    ],
)
def test_combinations_a_device_cannot_run_are_refused_in_one_line(device, dtype, quantization, message):
    with pytest.raises(PrecisionError) as refused:
        check_precision(torch.device(device), dtype, quantization)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_the_kernel_check_does_not_need_the_device():
    with pytest.raises(PrecisionError, match="not on cuda"):
        check_quantizable(torch.device("cuda"), tiny_config(), "int8")
