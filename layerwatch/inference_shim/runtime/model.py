"""A Llama-family transformer in plain PyTorch, with a gate per layer and real per-token layer skipping.

Architecture: token embedding -> L x [RMSNorm -> attention (RoPE, grouped-query) -> residual,
RMSNorm -> SwiGLU -> residual] -> RMSNorm -> LM head (tied or untied). Weight names follow Hugging
Face's, so checkpoints load by name. The other families are Llama plus a few switches in
`ModelConfig` (each off by default, so a Llama computes nothing extra): Qwen2's q/k/v biases,
Qwen3's and OLMo2's q/k norms, Gemma's (1 + w) norms, embedding scale and GELU-tanh MLP, Gemma2's
extra norms on the attention and MLP outputs, soft-capping, query scale and sliding-window layers,
OLMo2's norms on the outputs only. Phi3's fused projections are split when the checkpoint loads.

The gate of layer l reads that layer's input-norm output and scores how much the layer matters for
the token: its "entropy" in [0, 1]. Decoding takes a *run mask* decided before the step starts
(see `skip_policy.py`); a layer then runs only on the rows that need it. A skipped (token, layer)
executes neither attention nor the FFN: the hidden state passes through unchanged. What the cache
holds for it is the KV policy's choice:
  - "project": K/V projected from the layer's normed input (as CALM does), so later tokens still
    attend to that position;
  - "evict":   the position is left out of that layer's attention for later tokens.

This file knows nothing of telemetry: callers read the returned entropies. A full-depth forward
can also fill a `LayerProbe` (per layer: relative residual update, gate score, attention
discreteness) when one is passed; without one it computes nothing extra.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

KV_POLICIES = ("project", "evict")
GATE_HIDDEN = 16  # width of the gate head's hidden layer: Linear(d->16) -> GELU -> Linear(16->1)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU (Llama)
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),  # GeGLU (Gemma)
}
QK_NORMS = (None, "head", "projection")
NORM_LAYOUTS = ("pre", "sandwich", "post")


@dataclass
class ModelConfig:
    vocab_size: int  # tokens in the vocabulary
    hidden_size: int  # d, the residual stream width
    intermediate_size: int  # SwiGLU hidden width
    num_layers: int  # transformer blocks, L
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (< num_heads: grouped-query attention)
    head_dim: int  # width of one head (usually hidden_size // num_heads)
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: dict | None = None  # Hugging Face `rope_scaling` (None, "linear" or "llama3")
    max_position_embeddings: int = 2048  # longest sequence (prompt + generation) the cache holds
    tie_word_embeddings: bool = False  # LM head shares the embedding matrix
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2)
    bos_token_id: int | None = None  # begin-of-sequence token, prepended by the tokenizer side
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)  # generation stops on any of these
    # Family features (FAMILY_FIELDS). Each default is Llama's and costs nothing.
    hidden_act: str = "silu"  # MLP activation (ACTIVATIONS): "silu" (SwiGLU), "gelu_pytorch_tanh" (Gemma)
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (Qwen3), "projection" (OLMo2: all heads)
    norm_layout: str = "pre"  # "pre": norms before attention and MLP; "sandwich" (Gemma2): also on
    #                           their outputs; "post" (OLMo2): on their outputs only
    norm_weight_offset: float = 0.0  # Gemma: norms scale by (1 + weight)
    norm_weight_in_fp32: bool = False  # Gemma, OLMo2: norms multiply by the weight before casting back
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    attention_scale: float | None = None  # q.k scale; None = head_dim**-0.5 (Gemma2: query_pre_attn_scalar**-0.5)
    attn_logit_softcapping: float | None = None  # Gemma2: attention scores s -> c * tanh(s / c)
    final_logit_softcapping: float | None = None  # Gemma2: logits z -> c * tanh(z / c)
    sliding_window: int | None = None  # a sliding layer's query at p attends positions p - window + 1 .. p
    sliding_layers: tuple[int, ...] = ()  # layers with `sliding_window` (Gemma2: every other one)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:  # RoPE rotates each head as two halves
            raise ValueError(f"head_dim={self.head_dim} is odd: rotary embeddings need an even head dimension")
        self.sliding_layers = tuple(self.sliding_layers)  # a config read back from JSON holds a list
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not one of {QK_NORMS}")
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(f"norm_layout={self.norm_layout!r} is not one of {NORM_LAYOUTS}")
        if self.norm_weight_offset and not self.norm_weight_in_fp32:
            raise ValueError("norm_weight_offset is Gemma's norm: it needs norm_weight_in_fp32")
        if self.sliding_layers and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding_layers {self.sliding_layers} need a positive sliding_window")
        if any(not 0 <= layer < self.num_layers for layer in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers} outside 0..{self.num_layers - 1}")

    def to_dict(self) -> dict:
        return asdict(self)

    def family_features(self) -> dict:
        """The family features that differ from Llama's defaults (empty for Llama, Mistral, Qwen2)."""
        defaults = {f.name: f.default for f in fields(self)}
        return {name: getattr(self, name) for name in FAMILY_FIELDS if getattr(self, name) != defaults[name]}


# Fields added for the families beyond Llama/Mistral/Qwen2: gate fingerprints hash them only when
# set (so earlier models keep theirs), and only a model without them saves as a Llama/Qwen2 folder.
FAMILY_FIELDS = (
    "hidden_act",
    "qk_norm",
    "norm_layout",
    "norm_weight_offset",
    "norm_weight_in_fp32",
    "embedding_scale",
    "attention_scale",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window",
    "sliding_layers",
)


class CompileError(RuntimeError):
    """torch.compile cannot build the layer bodies here (Transformer.compile_layers)."""


def non_finite_problem(name: str, tensor: torch.Tensor, converted_to: torch.dtype | None = None) -> str | None:
    """What is wrong with a weight holding NaN or infinite values (every logit or gate score it
    touches turns NaN), else None: the one wording of checkpoint and gate loading. `converted_to`
    says the values were finite before their conversion to that dtype (float32 1e5 is inf in float16).

    A min/max reduction finds them (NaN propagates through it) in a tenth of the time of a finite
    mask, without allocating one; they are counted only once found. Integers and booleans are
    finite; float8, which torch reduces not (nor tests with isfinite), is looked at as float32,
    which holds each of its values."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return None
    if tensor.element_size() == 1:
        tensor = tensor.float()
    low, high = torch.aminmax(tensor)
    if bool(low.isfinite() & high.isfinite()):
        return None
    bad = int((~torch.isfinite(tensor)).sum())
    where = "" if converted_to is None else f" once converted to the model's {converted_to}"
    return f"tensor {name} holds {bad} NaN or infinite value(s){where}"


# --- the weights' layout for decoding ----------------------------------------------------------
#
# A decode step reads every weight once for a few rows, so its matmuls stream memory, and how the
# weights lie in it decides their speed (docs/performance.md, "Against transformers"):
#   - storage in transparent huge pages (`weight_storage`): a step streams hundreds of MB, and 2 MiB
#     pages spare it the TLB misses of 4 KiB ones;
#   - a projection whose output is at least as wide as its input (q/k/v and gate/up fused, o, the
#     LM head) as the transpose of an [in, out] matrix, x @ W with W contiguous, which MKL streams
#     faster for one row than nn.Linear's [out, in] (SmolLM2's tied 49,152 x 576 head: 20.9 -> 8.3
#     ms a token, the embedding then looking its rows up in the same matrix, one strided row per
#     token; q/k/v 960 x 576: 196 -> 132 us); a narrowing one (down) as nn.Linear's rows, which MKL
#     streams faster there (1,536 -> 576: 298 -> 245 us);
#   - projections that read one input in one matrix (q/k/v, gate/up), so that one matmul computes them.
# The parameters stay the [out, in] tensors Hugging Face names (state dicts, checkpoints, training
# and hooks see nothing else; each is a view into its matrix, only its strides or storage differ).
# Fused matmuls run without autograd only; training calls each linear, so every parameter gets its
# gradient. `Transformer.lay_out_weights` builds the layout, and again after loading or moving.

HUGE_PAGE = 2 << 20


def weight_storage(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of `like`'s dtype and device for a decode weight: on a Linux CPU,
    anonymous memory the kernel may back with transparent huge pages (madvise, as torch's own
    THP_MEM_ALLOC_ENABLE does for every allocation); elsewhere, or when small, torch.empty."""
    nbytes = math.prod(shape) * like.element_size()
    if like.device.type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=like.dtype).view(shape)  # the tensor keeps the mapping alive


class DecodeLayout(Protocol):
    """How decoding computes linears that read one input: FusedLinears, or quantization.py's layout."""

    def outputs(self, x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...] | None: ...

    def intact(self) -> bool: ...


def _laid_out(layout: DecodeLayout | None, linears: Sequence[nn.Module]) -> DecodeLayout | None:
    """`layout` while it holds, else the linears laid out afresh: as columns when their outputs
    together are at least as wide as their input, else as rows (see above). Quantized linears keep
    the layout quantization.py gave them."""
    if not all(isinstance(linear, nn.Linear) for linear in linears):
        return layout
    if layout is not None and layout.intact():
        return layout
    plain = cast("Sequence[nn.Linear]", linears)
    return FusedLinears(plain, transposed=sum(linear.out_features for linear in plain) >= plain[0].in_features)


class FusedLinears:
    """Linears that read one input, their weights in one matrix: as rows, [out_1 + ... + out_n, in]
    (nn.Linear's own layout), or `transposed`, as columns of [in, out_1 + ... + out_n]; biases
    likewise. Each linear's parameters become views into it.

    `outputs(x, first)` computes linears first..n in one `F.linear`, without autograd only (the matrix
    is no parameter). It gives None while gradients are recorded, inside a compiled body (inductor
    fuses on its own) and once a parameter no longer is its view (replaced, or given new storage):
    callers then call the linears one by one, which computes the same.
    """

    def __init__(self, linears: Sequence[nn.Linear], transposed: bool) -> None:
        if (
            len({linear.in_features for linear in linears}) != 1
            or len({linear.bias is None for linear in linears}) != 1
        ):
            raise ValueError("fused linears need one input width, and biases on all or none")
        like = linears[0].weight
        self.sizes = [linear.out_features for linear in linears]
        offsets = [sum(self.sizes[:i]) for i in range(len(linears))]
        total, width = sum(self.sizes), like.shape[1]
        rows = weight_storage((width, total) if transposed else (total, width), like).detach()
        matrix = rows.t() if transposed else rows  # [total, in], whatever the storage
        bias = None if linears[0].bias is None else torch.empty(total, dtype=like.dtype, device=like.device)
        self._views: list[tuple[dict, str, nn.Parameter, int]] = []  # (owner's parameters, name, view, address)
        with torch.no_grad():
            for linear, offset, size in zip(linears, offsets, self.sizes):
                parts = [("weight", matrix[offset : offset + size])]
                if bias is not None:
                    parts.append(("bias", bias[offset : offset + size]))
                for name, view in parts:
                    old = linear._parameters[name]
                    assert old is not None
                    view.copy_(old)
                    parameter = nn.Parameter(view, requires_grad=old.requires_grad)
                    setattr(linear, name, parameter)
                    self._views.append((linear._parameters, name, parameter, parameter.data_ptr()))
        self._weights = [matrix[offset:] for offset in offsets]
        self._biases = [None if bias is None else bias[offset:] for offset in offsets]

    def outputs(self, x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...] | None:
        """Linears first..n of x [..., in] (see the class), or None."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or not self.intact():
            return None
        return F.linear(x, self._weights[first], self._biases[first]).split(self.sizes[first:], dim=-1)

    def intact(self) -> bool:
        """Every parameter is still the view it was made."""
        return all(owner[name] is view and view.data_ptr() == address for owner, name, view, address in self._views)


# --- building blocks ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset  # Gemma: the scale is 1 + weight, so weights start at 0
        self.weight_in_fp32 = weight_in_fp32
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - weight_offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 at least, as Llama does, so fp16/bf16 weights do not lose the small
        # variances (a float64 model, which the tests compare with, stays float64).
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) (times the weight) in one kernel instead of six.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not self.weight_in_fp32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        wide = torch.promote_types(x.dtype, torch.float32)
        x32 = F.rms_norm(x.to(wide), self.weight.shape, None, self.eps)
        if self.weight_in_fp32:  # Gemma, OLMo2: scale, then round once
            return (x32 * (self.weight.to(wide) + self.weight_offset)).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class UnitRMSNorm(nn.Module):
    """RMS normalisation without a weight: the gate input of a layer whose attention reads the raw
    residual (OLMo2 normalises only outputs), so every family's gates read a normalised input."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), x.shape[-1:], None, self.eps).to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2], including the `rope_scaling` variants."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = original / low_freq_factor
        high_freq_wavelen = original / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    # x [..., D] -> [second half, first half], one copy
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, D]; cos, sin: [B, 1, T, D] (Transformer.rope), sin's first half negated so
    # that swap_halves(x) * sin is Llama's rotate_half(x) * sin bit for bit, in two kernels, not
    # four (negate, cat, multiply: a decode step runs it twice per layer)
    return x * cos + swap_halves(x) * sin


class KVCache(nn.Module):
    """Keys and values for `slots` sequences, each slot holding one sequence at its own length.

    `valid[l, s, t]` says whether position t of slot s takes part in layer l's attention: the
    `evict` policy clears it for skipped (token, layer) pairs; unwritten positions are never valid.
    """

    k: torch.Tensor  # buffers, registered in __init__
    v: torch.Tensor
    valid: torch.Tensor
    heads: torch.Tensor  # 0 .. Hkv - 1 (`places`)

    def __init__(
        self, config: ModelConfig, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        shape = self._shape(config, slots, max_len)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer(
            "valid", torch.zeros(shape[:2] + (max_len,), dtype=torch.bool, device=device), persistent=False
        )
        self.register_buffer("heads", torch.arange(config.num_kv_heads, device=device), persistent=False)
        self.max_len = max_len

    @staticmethod
    def _shape(config: ModelConfig, slots: int, max_len: int) -> tuple[int, int, int, int, int]:
        return (config.num_layers, slots, config.num_kv_heads, max_len, config.head_dim)

    @classmethod
    def bytes_needed(cls, config: ModelConfig, slots: int, max_len: int, dtype: torch.dtype) -> int:
        """What the cache allocates: K and V, and the validity mask."""
        layers, slots, heads, length, width = cls._shape(config, slots, max_len)
        return 2 * layers * slots * heads * length * width * dtype.itemsize + layers * slots * length

    def reset_slot(self, slot: int) -> None:
        self.valid[:, slot].fill_(False)

    def fill_prefix(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # Prefill: positions 0..T-1 of one slot. k, v: [Hkv, T, D]
        T = k.shape[1]
        self.k[layer, slot, :, :T] = k
        self.v[layer, slot, :, :T] = v
        self.valid[layer, slot, :T] = True

    def places(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B] slots and positions -> [B, Hkv]: each row's (slot, head, position) as a row of one
        layer's keys (or values) viewed as [slots * Hkv * max_len, D], the rows `write` copies."""
        return (slots[:, None] * self.k.shape[2] + self.heads) * self.max_len + positions[:, None]

    def write(self, layer: int, places: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # places: [B, Hkv] (`places`); k, v: [B, Hkv, D]. One row copy per (row, head): cheaper
        # than indexing slots and positions, and a step marks its positions valid once (`mark_written`).
        index, width = places.reshape(-1), self.k.shape[-1]
        self.k[layer].view(-1, width).index_copy_(0, index, k.reshape(-1, width))
        self.v[layer].view(-1, width).index_copy_(0, index, v.reshape(-1, width))

    def mark_written(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """A decode step's positions in every layer: each layer writes them (`evict` clears them again)."""
        self.valid[:, slots, positions] = True

    def evict(self, layer: int, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.valid[layer, slots, positions] = False

    def read(self, layer: int, slots: torch.Tensor | slice, length: int):
        # -> k, v: [B, Hkv, length, D]; mask: [B, 1, 1, length]
        k = self.k[layer, slots, :, :length]
        v = self.v[layer, slots, :, :length]
        mask = self.valid[layer, slots, :length][:, None, None, :]
        return k, v, mask


@dataclass(frozen=True)
class StepRows:
    """Where each row of a decode step is: its RoPE and its place in the cache (`Transformer.step_rows`)."""

    cos: torch.Tensor  # [B, 1, 1, head_dim]
    sin: torch.Tensor
    slots: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    places: torch.Tensor  # [B, Hkv]: KVCache.places
    read: torch.Tensor | slice  # the slots attention reads: a slice when contiguous (read in place)

    def take(self, rows: torch.Tensor) -> StepRows:
        """The rows `rows` (indices) of the step."""
        slots = self.slots[rows]
        return StepRows(self.cos[rows], self.sin[rows], slots, self.positions[rows], self.places[rows], slots)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm is not None:
            # Qwen3 normalises each head, OLMo2 the whole projection (all heads at once).
            q_width, k_width = (
                (self.head_dim, self.head_dim)
                if config.qk_norm == "head"
                else (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim)
            )
            norm = partial(RMSNorm, eps=config.rms_norm_eps, weight_in_fp32=config.norm_weight_in_fp32)
            self.q_norm, self.k_norm = norm(q_width), norm(k_width)
        self.scale = config.attention_scale  # None: SDPA's default, head_dim**-0.5
        self.softcap = config.attn_logit_softcapping
        self.window = config.sliding_window if layer in config.sliding_layers else None
        # The decode layout of the projections (Transformer.lay_out_weights): q, k, v in one matrix.
        self.qkv: DecodeLayout | None = None
        self.o_layout: DecodeLayout | None = None
        # The projections decoding calls, replaced by compiled ones by Transformer.compile_layers.
        self.decode_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self.project_qkv
        self.decode_queries: Callable[..., torch.Tensor] = self.queries
        self.decode_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self.project_kv

    def _heads(self, projected: torch.Tensor, norm: RMSNorm | None, heads: int) -> torch.Tensor:
        # projected: [B, T, heads * D], or [B, heads * D] for one token per row -> [B, heads, T, D],
        # q/k-normed where the family does it
        if norm is not None:
            projected = norm(projected.unflatten(-1, (-1, norm.weight.shape[0]))).flatten(-2)
        return projected.view(projected.shape[0], -1, heads, self.head_dim).transpose(1, 2)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [B, T, d] -> q: [B, H, T, D] (rotated); x: [B, d] (decode, one token per row) -> [B, H, 1, D]
        return apply_rope(self._heads(self.q_proj(x), self.q_norm, self.num_heads), cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, d] -> k, v: [B, Hkv, T, D] (k rotated); x: [B, d] -> [B, Hkv, 1, D]
        fused = self.qkv.outputs(x, first=1) if self.qkv is not None else None
        k, v = (self.k_proj(x), self.v_proj(x)) if fused is None else fused
        return self._keys_values(k, v, cos, sin)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # queries and project_kv in one: x: [B, T, d] -> q [B, H, T, D], k, v [B, Hkv, T, D]
        fused = self.qkv.outputs(x) if self.qkv is not None else None
        if fused is None:
            return self.queries(x, cos, sin), *self.project_kv(x, cos, sin)
        q, k, v = fused
        return apply_rope(self._heads(q, self.q_norm, self.num_heads), cos, sin), *self._keys_values(k, v, cos, sin)

    def _keys_values(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # projected k, v: [B, T, Hkv * D] or [B, Hkv * D] -> k (normed where the family does, rotated),
        # v: [B, Hkv, T, D]
        k = apply_rope(self._heads(k, self.k_norm, self.num_kv_heads), cos, sin)
        return k, v.view(v.shape[0], -1, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def visible(self, query_positions: torch.Tensor, length: int) -> torch.Tensor:
        """Which of keys 0..length-1 each query position attends: causal, within the window on a
        sliding layer. [Q] -> bool [Q, length]"""
        keys = torch.arange(length, device=query_positions.device)[None, :]
        seen = keys <= query_positions[:, None]
        if self.window is not None:
            seen = seen & (keys > query_positions[:, None] - self.window)
        return seen

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Attention logits before the mask: q [B, H, Q, D], k [B, Hkv, T, D] -> [B, H, Q, T]
        (scaled, and soft-capped for Gemma2)."""
        keys = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        scores = (q @ keys.transpose(-1, -2)) * (self.head_dim**-0.5 if self.scale is None else self.scale)
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # q [B, H, Q, D]; k, v [B, Hkv, T, D]; mask: bool, broadcast to [B, H, Q, T] (None: causal) -> [B, H, Q, D]
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=self._gqa
            )
        # SDPA cannot soft-cap: the scores by hand, the softmax in fp32 as transformers does.
        if mask is None:
            mask = self.visible(torch.arange(q.shape[2], device=q.device), k.shape[2])
        probs = torch.softmax(self.scores(q, k).masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
        return probs.to(q.dtype) @ v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # Causal attention over the whole sequence. x: [B, T, d] -> out [B, T, d], k, v [B, Hkv, T, D]
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        mask = None if self.window is None else self.visible(torch.arange(T, device=x.device), T)
        out = self._attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), k, v

    def attention_kl(
        self, x: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int
    ) -> torch.Tensor:
        """KL(attention || uniform) of each query position from `start` on, averaged over heads.

        x: the layer's attention input [B, T, d]; k: its rotated keys [B, Hkv, T, D] (from `forward_full`).
        Query p attends n_p positions (0..p, or its window), so KL = log(n_p) - H(attention): 0 for
        attention spread evenly, log(n_p) for attention on one position. -> [B, T - start], fp32.
        """
        T = x.shape[1]
        q = self.queries(x[:, start:], cos[:, :, start:], sin[:, :, start:]).float()
        positions = torch.arange(start, T, device=x.device)
        attended = self.visible(positions, T)  # [Q, T]
        log_p = torch.log_softmax(self.scores(q, k.float()).masked_fill(~attended, float("-inf")), dim=-1)
        neg_entropy = torch.where(attended, log_p.exp() * log_p, 0.0).sum(-1)  # [B, H, Q]
        return (neg_entropy + torch.log(attended.sum(-1).float())).mean(dim=1)

    def forward_decode(
        self, x: torch.Tensor, rows: StepRows, cache: KVCache, layer: int, length: int, write_kv: bool = True
    ) -> torch.Tensor:
        # One new token per row. x: [B, d] -> [B, d]. write_kv=False: the rows' K/V are already in
        # the cache (the `project` policy wrote the whole batch's at once, see Block.write_kv).
        B = x.shape[0]
        if write_kv:
            q, k, v = self.decode_qkv(x, rows.cos, rows.sin)
            cache.write(layer, rows.places, k[:, :, 0], v[:, :, 0])
        else:
            q = self.decode_queries(x, rows.cos, rows.sin)
        # A slice of contiguous slots reads the cache in place; index tensors would copy it.
        keys, values, mask = cache.read(layer, rows.read, length)
        if self.window is not None:
            mask = mask & self.visible(rows.positions, length)[:, None, None, :]
        out = self._attend(q, keys, values, mask)
        return self.o_proj(out.reshape(B, -1))

    @property
    def _gqa(self) -> bool:
        return self.num_kv_heads != self.num_heads


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with SiLU (Llama), GeGLU with tanh GELU (Gemma)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]
        # The decode layout of the projections (Transformer.lay_out_weights): gate and up in one matrix.
        self.gate_up: DecodeLayout | None = None
        self.down_layout: DecodeLayout | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up.outputs(x) if self.gate_up is not None else None
        gate, up = (self.gate_proj(x), self.up_proj(x)) if fused is None else fused
        return self.down_proj(self.act(gate) * up)


class Block(nn.Module):
    """One transformer layer. Callers apply `input_layernorm` themselves: the layer's gate reads
    that normed input too, so it is computed once and passed in as `x`.

    Where the norms sit is the family's `norm_layout` (module names are Hugging Face's):
      - "pre" (Llama): h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))
      - "sandwich" (Gemma2): h += post_attention_layernorm(attn(input_layernorm(h)));
        h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
      - "post" (OLMo2): h += post_attention_layernorm(attn(h)); h += post_feedforward_layernorm(mlp(h)),
        and `input_layernorm` is a weightless norm that only the gate reads.
    A skipped layer skips both whole updates, output norms included.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        norm = partial(
            RMSNorm,
            config.hidden_size,
            config.rms_norm_eps,
            weight_offset=config.norm_weight_offset,
            weight_in_fp32=config.norm_weight_in_fp32,
        )
        self.layout = config.norm_layout
        self.input_layernorm = UnitRMSNorm(config.rms_norm_eps) if self.layout == "post" else norm()
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = norm()
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if self.layout != "pre":
            self.post_feedforward_layernorm = norm()
        self.mlp = GatedMLP(config)
        # The residual updates decoding calls, replaced by a compiled one by Transformer.compile_layers.
        self.decode_updates: Callable[..., torch.Tensor] = self._residual_updates

    def attention_input(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # What attention reads: the normed input x, or the residual h itself (OLMo2).
        return h if self.layout == "post" else x

    def forward(
        self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None = None
    ):
        # Every position, causal. h: residual [B, T, d]; x = input_layernorm(h)
        # -> h [B, T, d], k, v [B, Hkv, T, D] (for a cache to keep)
        attn, k, v = self.self_attn.forward_full(self.attention_input(h, x), cos, sin)
        return self._residual_updates(h, attn, scale), k, v

    def decode(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        rows: StepRows,
        cache: KVCache,
        layer: int,
        length: int,
        write_kv: bool = True,
    ) -> torch.Tensor:
        # One new token per row, its K/V written to the cache unless already there. h, x: [B, d] -> h [B, d]
        attn = self.self_attn.forward_decode(self.attention_input(h, x), rows, cache, layer, length, write_kv)
        return self.decode_updates(h, attn)

    def write_kv(self, h: torch.Tensor, x: torch.Tensor, rows: StepRows, cache: KVCache, layer: int) -> None:
        # Project and cache every row's K/V from its normed input: under `project` that is what a
        # row that skips the layer keeps, and what a running row's attention writes anyway, so a
        # layer that only some rows run reads the K/V weights once for the whole batch. h, x: [B, d]
        k, v = self.self_attn.decode_kv(self.attention_input(h, x), rows.cos, rows.sin)
        cache.write(layer, rows.places, k[:, :, 0], v[:, :, 0])

    def _residual_updates(self, h: torch.Tensor, attn: torch.Tensor, scale: torch.Tensor | None = None):
        # h + attention, then + MLP, normed where the layout says; training's `scale` weighs both
        # updates (see UpdateScale).
        if self.layout != "pre":
            attn = self.post_attention_layernorm(attn)
        h = h + (attn if scale is None else scale * attn)
        if self.layout == "pre":
            mlp = self.mlp(self.post_attention_layernorm(h))
        elif self.layout == "sandwich":
            mlp = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        else:  # "post"
            mlp = self.post_feedforward_layernorm(self.mlp(h))
        return h + (mlp if scale is None else scale * mlp)


class Gate(nn.Module):
    """Linear(d->16) -> GELU -> Linear(16->1) -> Sigmoid, on the layer's input-norm output."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, GATE_HIDDEN)
        self.fc2 = nn.Linear(GATE_HIDDEN, 1)

    def logit(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., d] -> [...]; training uses the logit (e.g. for Gumbel-sigmoid), serving the sigmoid.
        return self.fc2(F.gelu(self.fc1(x))).squeeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(x))


# Parameters and modules registered by attribute anywhere in this process, counted by nn.Module's
# global registration hooks: a GateBank looks for a replaced parameter only after this changed.
_registrations = [0]


def _count_registration(*_: object) -> None:
    _registrations[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


class _StackedParameter(nn.Parameter):
    """A gate parameter that is a view into its bank's stack. Assigning its `.data` (as
    `torch.nn.utils.vector_to_parameters` does) gives it other storage without registering anything,
    so the assignment is counted as a registration: the bank then finds it apart from its stack."""

    @property
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _TENSOR_DATA.__set__(self, value)
        _registrations[0] += 1


_TENSOR_DATA: Any = vars(torch._C.TensorBase)["data"]  # the C property a Tensor's `.data` is


class GateBank(nn.Module):
    """One gate per layer. Kept apart from the transformer's weights: stored in gates.safetensors.

    Every gate's parameters are views into four tensors stacked by layer, which `scores` reads as
    they are (`_lay_out`): an update in place (an optimizer step, `load_state_dict`) is in the stacks
    already, and only a parameter replaced (a new Parameter assigned) or moved (`.to()` gives it new
    storage, `_apply`) or copied (`__setstate__`) has them laid out again. A replacement is looked
    for (a walk over the parameters' identities and storage) only after some module registered a
    parameter or a module by attribute or a gate parameter's `.data` was assigned (`_registrations`),
    which a decode step does not. Reading every parameter's `_version` and storage each step, as the
    check did before, cost SmolLM2's int4 decode step 0.2 ms of its 20 (docs/performance.md, "Weights
    in low precision"). Gates reparametrized (`torch.nn.utils.parametrize`, `prune`, `weight_norm`:
    their weight is computed, no longer a parameter) are scored by calling each gate. Not seen: a
    parameter written into `_parameters` directly; assign a new Parameter instead.
    """

    def __init__(self, num_layers: int, hidden_size: int) -> None:
        super().__init__()
        self.gates = nn.ModuleList(Gate(hidden_size) for _ in range(num_layers))
        self._stacks: tuple[torch.Tensor, ...] = ()  # w1 [L, 16, d], b1 [L, 1, 16], w2 [L, 1, 16], b2 [L, 1, 1]
        # The parameters, in order, each with its data pointer (into the stacks) when laid out.
        self._laid_out: list[tuple[torch.Tensor, int]] = []
        self._registrations_seen = -1  # `_registrations` when the parameters were last checked
        self._lay_out()

    def __getitem__(self, layer: int) -> Gate:
        return cast(Gate, self.gates[layer])  # nn.ModuleList is not generic

    def __len__(self) -> int:
        return len(self.gates)

    @torch.no_grad()
    def scores(self, inputs: torch.Tensor) -> torch.Tensor:
        """Every layer's entropy in a few batched ops: inputs [L, N, d], layer l's normed input -> [N, L].

        The same function as calling each gate, for inference: a decode step's gates feed only
        later steps, so the step evaluates them together after its last layer instead of as 4 small
        ops per layer.
        """
        if self._registrations_seen != _registrations[0]:
            current = self._parameters_in_order()
            if len(current) != len(self._laid_out) or any(
                p is not q or p.data_ptr() != at for p, (q, at) in zip(current, self._laid_out)
            ):
                self._lay_out()  # a parameter was replaced, or its data
            self._registrations_seen = _registrations[0]
        if not self._stacks:  # reparametrized gates: their weights are computed by their own forward
            return torch.stack([gate(inputs[layer]) for layer, gate in enumerate(self.gates)], dim=-1)
        w1, b1, w2, b2 = self._stacks
        hidden = F.gelu(torch.baddbmm(b1, inputs, w1.transpose(1, 2)))  # [L, N, 16]
        return torch.sigmoid(torch.baddbmm(b2, hidden, w2.transpose(1, 2))[..., 0]).T

    def _apply(self, fn, recurse=True):
        # Moving or converting the gates gives every parameter its own new storage.
        super()._apply(fn, recurse)
        self._lay_out()
        return self

    def __setstate__(self, state: dict) -> None:
        # A copy (copy.deepcopy, pickle): deepcopy clones each parameter apart from the stacks.
        super().__setstate__(state)
        self._lay_out()

    def _parameters_in_order(self) -> list[torch.Tensor]:
        # The module dicts walked directly: `self.parameters()` costs four times as much, every step.
        return [
            p
            for gate in self.gates._modules.values()
            if gate is not None
            for linear in gate._modules.values()
            if linear is not None
            for p in linear._parameters.values()
            if p is not None
        ]

    def _lay_out(self) -> None:
        """Stack every gate's parameters by layer and make each parameter a view into its stack (a
        contiguous one, as safetensors saves them); reparametrized gates get none (`scores` calls
        each gate). Then note each parameter and where its data is."""
        gates = list(cast("Iterable[Gate]", self.gates))  # nn.ModuleList is not generic
        linears = [linear for gate in gates for linear in (gate.fc1, gate.fc2)]
        self._stacks = ()
        if gates and not any(
            parametrize.is_parametrized(linear)
            or None in (linear._parameters.get("weight"), linear._parameters.get("bias"))
            for linear in linears
        ):
            self._stacks = self._stacked(gates)
        self._laid_out = [(p, p.data_ptr()) for p in self._parameters_in_order()]

    @staticmethod
    def _stacked(gates: list[Gate]) -> tuple[torch.Tensor, ...]:
        """The four stacks, every gate parameter made a view into them."""
        like = gates[0].fc1.weight
        L, d = len(gates), like.shape[1]
        # Laid out by a decode step (the engine's inference mode) too: tensors made there could never
        # again be updated in place or trained outside it.
        with torch.inference_mode(False), torch.no_grad():
            w1, b1, w2, b2 = (
                torch.empty(shape, dtype=like.dtype, device=like.device)
                for shape in ((L, GATE_HIDDEN, d), (L, 1, GATE_HIDDEN), (L, 1, GATE_HIDDEN), (L, 1, 1))
            )
            for l, gate in enumerate(gates):
                for linear, weight, bias in ((gate.fc1, w1[l], b1[l, 0]), (gate.fc2, w2[l], b2[l, 0])):
                    for name, view in (("weight", weight), ("bias", bias)):
                        old = linear._parameters[name]
                        assert old is not None  # gate linears have biases
                        view.copy_(old)
                        setattr(linear, name, _StackedParameter(view, requires_grad=old.requires_grad))
        return w1, b1, w2, b2


# --- per-layer signals of a full-depth pass ----------------------------------------------------


@dataclass
class LayerProbe:
    """Asks a full-depth forward (`Transformer.forward(..., probe=)`) for per-layer signals of the
    positions `start` onwards; the forward fills the fields, each fp32 [B, T - start, L] on the
    model's device (layer l in column l):

      - `relative_update`: ||dh|| / ||h||, dh = layer l's attention + MLP contribution to the
        residual stream, h = its input residual;
      - `gate_score`: layer l's gate on the same token (its normed input), None without gates;
      - `attention_kl`: KL divergence of each head's attention distribution from uniform over the
        attended positions (0..p), averaged over the heads: how discrete the layer's attention is.

    Without a probe the forward computes none of it.
    """

    start: int = 0
    relative_update: torch.Tensor | None = None
    gate_score: torch.Tensor | None = None
    attention_kl: torch.Tensor | None = None


# --- the transformer ---------------------------------------------------------------------------

# A hook for training: (layer, normed input [B, T, d]) -> scale [B, T, 1] applied to the layer's
# residual updates (x + s*attn, then + s*mlp), or None for s = 1. Layer dropout and soft gates use it.
UpdateScale = Callable[[int, torch.Tensor], "torch.Tensor | None"]


class Transformer(nn.Module):
    inv_freq: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, layer) for layer in range(config.num_layers))
        self.norm = RMSNorm(
            config.hidden_size,
            config.rms_norm_eps,
            weight_offset=config.norm_weight_offset,
            weight_in_fp32=config.norm_weight_in_fp32,
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.gates: GateBank | None = None
        self.lm_head_layout: DecodeLayout | None = None
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        # Executed (row, layer) computations since the last reset: proof that skipped means skipped.
        self.layer_rows_executed = [0] * config.num_layers
        self.decode_layout = False  # lay_out_weights ran: keep the layout through moves (`_apply`)

    def lay_out_weights(self) -> None:
        """Give the projections the decode layout ("the weights' layout for decoding" above) where
        they lack it. What decodes calls it (the engine, load_checkpoint), after any initialisation:
        a random fill in place draws in memory order, which the layout changes. It runs again after
        a move gave the parameters new storage (`_apply`: `.to()`, `.half()` and the like)."""
        self.decode_layout = True
        for block in cast("Iterable[Block]", self.layers):  # nn.ModuleList is not generic
            attention, mlp = block.self_attn, block.mlp
            attention.qkv = _laid_out(attention.qkv, [attention.q_proj, attention.k_proj, attention.v_proj])
            attention.o_layout = _laid_out(attention.o_layout, [attention.o_proj])
            mlp.gate_up = _laid_out(mlp.gate_up, [mlp.gate_proj, mlp.up_proj])
            mlp.down_layout = _laid_out(mlp.down_layout, [mlp.down_proj])
        tied = getattr(self.lm_head, "weight", None) is self.embed_tokens.weight  # a quantized head has none
        self.lm_head_layout = _laid_out(self.lm_head_layout, [self.lm_head])
        if tied:  # one parameter still: the embedding reads its rows from the head's [in, out] matrix
            self.embed_tokens.weight = self.lm_head.weight

    def _apply(self, fn, recurse=True):
        # Moving or converting the model gives every parameter its own new storage.
        super()._apply(fn, recurse)
        if self.decode_layout:
            self.lay_out_weights()
        return self

    def attach_gates(self, gates: GateBank | None) -> None:
        if gates is not None and len(gates) != self.config.num_layers:
            raise ValueError(f"{len(gates)} gates for a model of {self.config.num_layers} layers")
        self.gates = gates

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens [...] -> [..., d]; Gemma scales by sqrt(d), rounded to the model dtype as transformers does.
        h = self.embed_tokens(tokens)
        scale = self.config.embedding_scale
        return h if scale is None else h * h.new_tensor(scale)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        # Final hidden states [..., d] -> logits [..., V]; Gemma2 soft-caps them.
        logits = self.lm_head(self.norm(h))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions: [B, T] -> cos, sin: [B, 1, T, head_dim], sin's first half negated (apply_rope)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        half, sin = freqs.shape[-1], emb.sin()
        return emb.cos().to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)

    # Full sequence, full depth: training, scoring, prefill. ------------------------------------

    def forward(self, tokens: torch.Tensor, update_scale: UpdateScale | None = None, probe: LayerProbe | None = None):
        """tokens: [B, T] -> (logits [B, T, V], entropies [B, T, L] or None when no gates are attached).

        `probe`: filled with per-layer signals of the positions from `probe.start` on (see LayerProbe).
        """
        h, entropies = self._full_depth(tokens, update_scale, probe=probe)
        return self.logits(h), entropies

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: KVCache, slot: int):
        """One sequence's tokens [T] at full depth, their keys and values written to positions
        0..T-1 of cache slot `slot` (reset it first when a new sequence takes it).

        -> (logits [V] of the last position, entropies [T, L] or None without gates)
        """
        h, entropies = self._full_depth(tokens[None], cache=cache, slot=slot)
        logits = self.logits(h[0, -1])
        return logits, (entropies[0] if entropies is not None else None)

    def _full_depth(
        self,
        tokens: torch.Tensor,
        update_scale: UpdateScale | None = None,
        cache: KVCache | None = None,
        slot: int | None = None,
        probe: LayerProbe | None = None,
    ):
        # tokens: [B, T] -> final hidden states [B, T, d] (before the norm), entropies [B, T, L] or None
        B, T = tokens.shape
        h = self.embed(tokens)
        positions = torch.arange(T, device=tokens.device).expand(B, T)
        cos, sin = self.rope(positions, h.dtype)
        entropies = []
        updates, kls = [], []  # only with a probe
        for l, block in enumerate(cast("Iterable[Block]", self.layers)):  # nn.ModuleList is not generic
            x = block.input_layernorm(h)
            if self.gates is not None:
                entropies.append(self.gates[l](x))
            scale = update_scale(l, x) if update_scale is not None else None
            h_in = h
            h, k, v = block(h, x, cos, sin, scale)
            if probe is not None:
                start = probe.start
                h_in32 = h_in[:, start:].float()
                updates.append((h[:, start:].float() - h_in32).norm(dim=-1) / h_in32.norm(dim=-1).clamp_min(1e-30))
                kls.append(block.self_attn.attention_kl(block.attention_input(h_in, x), k, cos, sin, start))
            if cache is not None:
                if slot is None:
                    raise ValueError("filling a KV cache needs the slot to fill")
                cache.fill_prefix(l, slot, k[0], v[0])
            self.layer_rows_executed[l] += B * T
        stacked = torch.stack(entropies, dim=-1) if entropies else None
        if probe is not None:
            probe.relative_update = torch.stack(updates, dim=-1)
            probe.attention_kl = torch.stack(kls, dim=-1)
            probe.gate_score = stacked[:, probe.start :].float() if stacked is not None else None
        return h, stacked

    # One decode step, layers skipped per row. ---------------------------------------------------

    @torch.no_grad()
    def decode_step(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        slots: Sequence[int],
        positions: Sequence[int],
        run_mask: np.ndarray | None,
        kv_policy: str = "project",
    ):
        """One new token per row, each row a sequence in its own cache slot.

        tokens: [B] on the model's device; slots, positions: host ints, [B]; run_mask: host bool
        [B, L] decided before the step (None = run everything). The mask is on the host so that no
        layer waits on the device to learn whether it runs.
        -> logits [B, V], entropies [B, L] (None without gates)
        """
        if kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")
        B = tokens.shape[0]
        length = int(max(positions)) + 1  # keys beyond the longest row are never valid
        h = self.embed(tokens)  # [B, d]
        rows = self.step_rows(cache, slots, positions)
        normed_inputs = []  # the gates' inputs, scored together after the last layer
        plan = _RowPlan(run_mask, B, self.config.num_layers, rows)
        for l, block in enumerate(cast("Iterable[Block]", self.layers)):  # nn.ModuleList is not generic
            x = block.input_layernorm(h)  # [B, d]
            if self.gates is not None:
                normed_inputs.append(x)
            running = plan.rows(l)
            h = self._decode_layer(l, block, h, x, running, rows, cache, length, kv_policy)
            self.layer_rows_executed[l] += B if running is None else running.count
        logits = self.logits(h)
        entropies = (
            self.gates.scores(torch.stack(normed_inputs)).float() if normed_inputs and self.gates is not None else None
        )
        return logits, entropies

    def step_rows(self, cache: KVCache, slots: Sequence[int], positions: Sequence[int]) -> StepRows:
        """A decode step's rows at `positions` of cache `slots` (host ints, [B]), their positions
        marked written in every layer (the step writes them; `evict` clears a skipped one)."""
        device = self.embed_tokens.weight.device
        slot_t = torch.as_tensor(slots, device=device)
        pos_t = torch.as_tensor(positions, device=device)
        cos, sin = self.rope(pos_t[:, None], self.embed_tokens.weight.dtype)  # [B, 1, 1, D]
        first = slots[0]
        contiguous = list(slots) == list(range(first, first + len(slots)))
        cache.mark_written(slot_t, pos_t)
        return StepRows(
            cos,
            sin,
            slot_t,
            pos_t,
            cache.places(slot_t, pos_t),
            slice(first, first + len(slots)) if contiguous else slot_t,
        )

    @torch.no_grad()
    def decode_layers(
        self,
        h: torch.Tensor,
        rows: StepRows,
        cache: KVCache,
        layers: Sequence[int],
        length: int,
        running: np.ndarray | None,
        kv_policy: str = "project",
    ) -> torch.Tensor:
        """The work of a decode step at `layers` only, as `decode_step` does it: each layer's input
        norm, then the layer for the rows `running` (host bool [B]; None = every row) -> h [B, d].
        What depth_execution.py's cost measurement times; it runs for no sequence, so
        `layer_rows_executed` does not count it (decode_step counts)."""
        mask = None if running is None else np.repeat(running[:, None], len(self.layers), axis=1)
        plan = _RowPlan(mask, h.shape[0], len(self.layers), rows)
        for l in layers:
            block = cast(Block, self.layers[l])
            h = self._decode_layer(l, block, h, block.input_layernorm(h), plan.rows(l), rows, cache, length, kv_policy)
        return h

    def _decode_layer(
        self,
        layer: int,
        block: Block,
        h: torch.Tensor,
        x: torch.Tensor,
        running: _Rows | None,
        rows: StepRows,
        cache: KVCache,
        length: int,
        kv_policy: str,
    ) -> torch.Tensor:
        """One layer of a decode step: h, x = input_layernorm(h) [B, d] -> h after the layer, for
        the `running` rows (None: every row)."""
        if running is None:
            return block.decode(h, x, rows, cache, layer, length)
        project = kv_policy == "project"
        if project:  # one K/V projection for the whole batch, skipped rows included
            block.write_kv(h, x, rows, cache, layer)
        else:
            cache.evict(layer, *running.skipping())
        if running.count:
            run = running.run
            hr = block.decode(h[run], x[run], running.running_rows(), cache, layer, length, write_kv=not project)
            h.index_copy_(0, run, hr)  # in place: h is this step's own tensor, apart from the gates' inputs
        return h

    def reset_counters(self) -> None:
        self.layer_rows_executed = [0] * self.config.num_layers

    def compile_layers(self, backend: str | Callable = "inductor") -> None:
        """torch.compile the bodies of every layer that decoding runs: the attention's projections
        (with RoPE) and the residual updates (attention output, norms, FFN). Never the step: which
        rows run a layer stays the Python decision in `decode_step`, so a compiled graph cannot run a
        skipped layer (compiling the whole step would trace every layer into one graph). Shapes are
        dynamic, so one graph serves any number of running rows (and one more is built for a single
        row, which torch.compile specialises). The graphs are built here, not by the first request;
        raises CompileError when the backend cannot work on this machine.
        """
        # The graphs guard on the weights they read: built on the decode layout, or the engine's
        # own lay_out_weights would make every body compile again at the first request.
        self.lay_out_weights()
        blocks = list(cast("Iterable[Block]", self.layers))  # nn.ModuleList is not generic
        for block in blocks:
            attention = block.self_attn
            attention.decode_qkv = torch.compile(attention.project_qkv, backend=backend, dynamic=True)
            attention.decode_queries = torch.compile(attention.queries, backend=backend, dynamic=True)
            attention.decode_kv = torch.compile(attention.project_kv, backend=backend, dynamic=True)
            block.decode_updates = torch.compile(block._residual_updates, backend=backend, dynamic=True)
        weight = self.embed_tokens.weight
        try:
            with torch.inference_mode():  # as the engine decodes: Dynamo guards on the grad mode
                for rows in (1, 2):
                    h = torch.zeros(rows, self.config.hidden_size, dtype=weight.dtype, device=weight.device)
                    cos, sin = self.rope(torch.zeros(rows, 1, dtype=torch.long, device=weight.device), h.dtype)
                    for block in blocks:
                        block.self_attn.decode_qkv(h, cos, sin)
                        block.self_attn.decode_queries(h, cos, sin)
                        block.self_attn.decode_kv(h, cos, sin)
                        block.decode_updates(h, torch.zeros_like(h))  # not h itself: Dynamo guards on aliasing
        except Exception as exc:  # whatever the backend raised (no C++ compiler, unsupported device, ...)
            reason = str(exc).split("\n\n")[0]  # the cause, without torch's advice on debug logging
            raise CompileError(
                f"torch.compile (backend {getattr(backend, '__name__', backend)!r}) cannot compile the layers "
                f"on this machine: {type(exc).__name__}: {reason}"
            ) from exc


class _RowPlan:
    """Which rows run each layer, from the host-side run mask, built once per step before any layer
    runs. Layers whose running rows are the same share one `_Rows`, so those rows' RoPE, slots and
    positions are gathered once per step for all of them."""

    def __init__(self, run_mask: np.ndarray | None, batch: int, num_layers: int, rows: StepRows) -> None:
        self._rows: list[_Rows | None] = [None] * num_layers
        if run_mask is None:
            return
        if run_mask.shape != (batch, num_layers):
            raise ValueError(f"run_mask shape {run_mask.shape} != (batch={batch}, layers={num_layers})")
        shared: dict[bytes, _Rows] = {}
        for l in np.flatnonzero(~run_mask.all(axis=0)):
            column = run_mask[:, l]
            key = column.tobytes()
            if key not in shared:
                shared[key] = _Rows(column, rows)
            self._rows[l] = shared[key]

    def rows(self, layer: int) -> _Rows | None:
        """None: every row runs the layer."""
        return self._rows[layer]


class _Rows:
    """The rows of a batch that run a layer (`run`, `count` of them) and those that skip it; what
    each gathers is computed on first use and kept for the step's other layers with these rows."""

    def __init__(self, column: np.ndarray, rows: StepRows) -> None:
        device = rows.slots.device
        self.run = torch.as_tensor(np.flatnonzero(column), device=device)
        self.count = int(self.run.numel())
        self._skip = torch.as_tensor(np.flatnonzero(~column), device=device)
        self._step = rows
        self._running: StepRows | None = None
        self._skipping: tuple[torch.Tensor, torch.Tensor] | None = None

    def running_rows(self) -> StepRows:
        """The running rows' RoPE and cache places."""
        if self._running is None:
            self._running = self._step.take(self.run)
        return self._running

    def skipping(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The skipping rows' slots and positions (what `evict` clears)."""
        if self._skipping is None:
            self._skipping = (self._step.slots[self._skip], self._step.positions[self._skip])
        return self._skipping
