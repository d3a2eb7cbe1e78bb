"""Weights in low precision, quantized at load time: weight-only int8 and int4 on torch's own CPU kernels.

  - int8: one scale per output channel, symmetric: w = s_n * q, q in -127..127, s_n = max|W_n| / 127.
    Kernel: torch._weight_int8pack_mm.
  - int4: one scale and one minimum per group of INT4_GROUP inputs (GGUF's Q4_1 block): w = s * q + m,
    q in 0..15, s = (max - min) / 15. Kernel: torch._weight_int4pack_mm_for_cpu on the layout
    torch._convert_weight_to_int4pack_for_cpu packs, which computes (q - 8) * s + zero, zero = m + 8 s.

Scales are stored in bfloat16. Rounded by at most 2^-8 of itself, a scale leaves the row's largest
weight at most 127.5 steps from 0 (int8), a group's at most 15.06 steps from its minimum (int4): the
last level is still within half a step, so every weight is (`QuantizedWeight.error_bound`). Both
kernels are fast only on bfloat16 inputs (float32 or float16 inputs took 6 to 35 times as long,
docs/model.md, "Weights in low precision"), so a quantized linear computes in bfloat16 whatever the
model's dtype: its input rounded to bfloat16, its output returned in the model's dtype.

Quantized are every layer's projections and the LM head (int8 under int4 too: HEAD_QUANTIZATION),
what a decode step reads. The embedding table (one row read per token), the norms and the gate heads
keep the model's dtype; a tied LM head gets its own quantized copy of the embedding table. The
projections that decoding computes together stay together (q alone, k and v, gate and up: see
`QuantizedLayout`), each group one kernel call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from layerwatch.inference_shim.runtime.gates import QUANTIZED_FROM, model_fingerprint
from layerwatch.inference_shim.runtime.model import Block, ModelConfig, Transformer

QUANTIZATIONS = ("none", "int8", "int4")
# The LM head's quantization under each: int8 under int4 too, as llama.cpp's Q4_1 files keep their
# output matrix at Q8_0. On SmolLM2-135M an int4 head alone cost +7.2 % perplexity on KJV (an int8
# head +0.0 %) for 13 % more speed (docs/performance.md, "Weights in low precision").
HEAD_QUANTIZATION = {"int8": "int8", "int4": "int8"}
INT4_GROUP = 32  # inputs per int4 scale and minimum: GGUF's Q4_1 block
# The int8 kernel's unit of inputs: at 24, 36, 40 or 56 inputs it returned NaN or inf for one row and
# crashed the process (SIGSEGV) for five (torch 2.13, tests/model/test_quantization.py).
INT8_INPUTS = 16
INT4_ROWS = 16  # the int4 packing's unit of output channels
COMPUTE_DTYPE = torch.bfloat16  # the kernels' fast input dtype


class PrecisionError(ValueError):
    """A dtype and quantization this device or model cannot run; one line saying which and why."""


def check_precision(device: torch.device, dtype: torch.dtype, quantization: str) -> None:
    """What a command checks before loading: refuse a combination that cannot run here, or only at a
    crawl (a float16 checkpoint still loads as float16 for whoever asks load_checkpoint for it)."""
    if device.type == "cpu" and dtype == torch.float16:
        # SmolLM2-135M decoded at a quarter of float32's speed (docs/model.md, "Weights in low precision").
        raise PrecisionError("--dtype float16 is slow on the CPU (torch has no fast float16 path there): use bfloat16")
    _check_kernels(device, quantization)


def _check_kernels(device: torch.device, quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise PrecisionError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization != "none" and device.type != "cpu":
        raise PrecisionError(
            f"--quantization {quantization} runs on torch's CPU kernels only, not on {device.type}: "
            "use --dtype bfloat16 there"
        )


def check_quantizable(device: torch.device, config: ModelConfig, quantization: str) -> None:
    """Refuse a quantization this device has no kernel for, or whose widths its kernels cannot take
    (int8: inputs in units of INT8_INPUTS, any outputs)."""
    _check_kernels(device, quantization)
    if quantization == "none":
        return
    d, inner = config.hidden_size, config.intermediate_size
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inputs = {"hidden_size": d, "intermediate_size": inner, "num_heads * head_dim": q_width}
    if quantization == "int8":
        for name, width in inputs.items():
            if width % INT8_INPUTS:
                raise PrecisionError(
                    f"--quantization int8 needs input widths divisible by {INT8_INPUTS}: {name} is {width} (use none)"
                )
        return
    outputs = {  # the LM head is int8 (HEAD_QUANTIZATION): any vocabulary
        "hidden_size": d,
        "intermediate_size": inner,
        "num_heads * head_dim": q_width,
        "num_kv_heads * head_dim": kv_width,
    }
    for name, width in inputs.items():
        if width % INT4_GROUP:
            instead = "none" if width % INT8_INPUTS else "int8"
            raise PrecisionError(
                f"--quantization int4 needs input widths divisible by {INT4_GROUP}: {name} is {width} (use {instead})"
            )
    for name, width in outputs.items():
        if width % INT4_ROWS:
            raise PrecisionError(
                f"--quantization int4 needs output widths divisible by {INT4_ROWS}: {name} is {width} (use int8)"
            )


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] as levels and their scales (module doc), before the kernel's packing."""

    method: str  # "int8" or "int4"
    levels: torch.Tensor  # int8 [N, K] (-127..127) or int32 [N, K] (0..15)
    scales: torch.Tensor  # bfloat16: [N] (int8) or [N, K / INT4_GROUP] (int4)
    zeros: torch.Tensor | None = None  # int4: bfloat16 [N, K / INT4_GROUP], zero = m' + 8 s
    minimum_shift: torch.Tensor | None = None  # int4: m' - m per group, m' the minimum zero stands for

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by."""
        if self.zeros is None:
            return self.levels.float() * self.scales.float()[:, None]
        n, k = self.levels.shape
        grouped = (self.levels.float() - 8).view(n, -1, INT4_GROUP) * self.scales.float()[..., None]
        return (grouped + self.zeros.float()[..., None]).view(n, k)

    def error_bound(self) -> torch.Tensor:
        """The most each dequantized weight [N, K] may differ from the float32 one: half a step, s/2;
        for int4 the distance |m' - m| if larger (a weight clamped to level 0 or 15 is off by at most
        that: rounding zero to bfloat16 moves the minimum of a group far from 0 for its range)."""
        half = self.scales.float() / 2
        if self.minimum_shift is None:
            return half[:, None].expand(self.levels.shape)
        n, k = self.levels.shape
        bound = torch.maximum(half, self.minimum_shift.abs())
        return bound[..., None].expand(n, k // INT4_GROUP, INT4_GROUP).reshape(n, k)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Per-channel symmetric int8 of a weight [N, K]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(COMPUTE_DTYPE)
    levels = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", levels, scales)


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Group-wise asymmetric int4 of a weight [N, K] (K a multiple of INT4_GROUP)."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny).to(COMPUTE_DTYPE)
    zeros = (low + 8 * scales.float()).to(COMPUTE_DTYPE)
    minimum = zeros.float() - 8 * scales.float()  # the m' the kernel's (q - 8) * s + zero stands for
    levels = torch.round((groups - minimum[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return QuantizedWeight("int4", levels.to(torch.int32).view(n, k), scales, zeros, minimum - low)


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}


class QuantizedLinear(nn.Module):
    """A linear whose weight is quantized (module doc): y = x W^T + b, computed by torch's kernel in bfloat16."""

    packed: torch.Tensor  # buffers, registered in __init__
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, method: str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        quantized = QUANTIZERS[method](weight)
        self.method = method
        if method == "int8":
            self.register_buffer("packed", quantized.levels)
            self.register_buffer("scales", quantized.scales)
        else:
            assert quantized.zeros is not None
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(quantized.levels, 1))
            # The kernel's scales_and_zeros: [K / group, N, 2].
            scales_and_zeros = torch.stack([quantized.scales, quantized.zeros], dim=-1).transpose(0, 1)
            self.register_buffer("scales", scales_and_zeros.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if self.method == "int8":
            y = torch._weight_int8pack_mm(rows, self.packed, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales)
        y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class QuantizedPart(nn.Module):
    """One linear of a group quantized as one matrix (`QuantizedLayout`): the group's output rows
    `start`..`start + size`. Decoding computes the group through the layout; this is the linear by its
    own name for any other caller."""

    def __init__(self, group: QuantizedLinear, start: int, size: int) -> None:
        super().__init__()
        self.group, self.start, self.out_features, self.in_features = group, start, size, group.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group(x)[..., self.start : self.start + self.out_features]


Group = tuple[QuantizedLinear, list[int]]  # one quantized matrix, the output widths of the linears it stacks


class QuantizedLayout:
    """model.py's decode layout (a `DecodeLayout`, like FusedLinears) for quantized linears: the
    groups of linears that read one input, each group one quantized matrix of their stacked rows.
    `outputs(x, first)` computes linears first..n; `first` starts a group (q alone, then k and v)."""

    def __init__(self, groups: Sequence[Group]) -> None:
        self._groups = list(groups)

    def outputs(self, x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...]:
        results: list[torch.Tensor] = []
        index = 0
        for group, sizes in self._groups:
            if index >= first:
                results.extend(group(x).split(sizes, dim=-1))
            elif index + len(sizes) > first:
                raise ValueError(f"linear {first} is inside a quantized group: compute it by its own name")
            index += len(sizes)
        return tuple(results)

    def intact(self) -> bool:
        return True  # the groups hold their own buffers: nothing can be swapped from under them


def _grouped(linears: Sequence[nn.Linear], method: str) -> tuple[Group, list[nn.Module]]:
    """`linears` (one input) as one quantized matrix of their stacked rows, and a module per linear."""
    sizes = [linear.out_features for linear in linears]
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
    group = QuantizedLinear(torch.cat([linear.weight for linear in linears]), bias, method)
    if len(linears) == 1:
        return (group, sizes), [group]
    starts = [sum(sizes[:i]) for i in range(len(linears))]
    return (group, sizes), [QuantizedPart(group, start, size) for start, size in zip(starts, sizes)]


@torch.no_grad()
def quantize_model(model: Transformer, method: str) -> Transformer:
    """Replace `model`'s projections and LM head by quantized ones, in place (`method` "none": as it is)."""
    check_quantizable(model.embed_tokens.weight.device, model.config, method)
    if method == "none":
        return model
    setattr(model, QUANTIZED_FROM, model_fingerprint(model))  # its gates were trained on the float weights
    for block in cast("Sequence[Block]", model.layers):
        attention, mlp = block.self_attn, block.mlp
        q, (q_proj,) = _grouped([attention.q_proj], method)
        kv, (k_proj, v_proj) = _grouped([attention.k_proj, attention.v_proj], method)
        gate_up, (gate_proj, up_proj) = _grouped([mlp.gate_proj, mlp.up_proj], method)
        for owner, name, module in (
            (attention, "q_proj", q_proj),
            (attention, "k_proj", k_proj),
            (attention, "v_proj", v_proj),
            (attention, "o_proj", _grouped([attention.o_proj], method)[1][0]),
            (mlp, "gate_proj", gate_proj),
            (mlp, "up_proj", up_proj),
            (mlp, "down_proj", _grouped([mlp.down_proj], method)[1][0]),
        ):
            owner.register_module(name, module)
        attention.qkv = QuantizedLayout([q, kv])
        mlp.gate_up = QuantizedLayout([gate_up])
        attention.o_layout = mlp.down_layout = None
    model.register_module("lm_head", _grouped([model.lm_head], HEAD_QUANTIZATION[method])[1][0])
    model.lm_head_layout = None
    return model
