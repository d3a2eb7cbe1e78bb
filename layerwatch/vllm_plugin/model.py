"""LayerwatchLlamaForCausalLM: vLLM's Llama with the shim's gates and skip rule, skipping layers per token.

A forward of vLLM is a flat batch of tokens: prefill spans and decode rows mixed. Each sequence's last
token this step is its *step row*: the token whose logits vLLM samples from, as one decode step of the
shim's engine is (the shim's first decode step reads the prompt's last token, as a prefill's step row
here). Per forward:

1. before any layer runs, each step row finds its sequence's policy state (sequences.py) and the rule
   decides, from earlier steps only, which layers it runs (SkipPolicy.run_mask); every other token (a
   prompt's) runs every layer. Under tensor parallelism rank 0 decides and broadcasts the mask, so that
   every rank runs the same rows of each layer (a row subset that differed between ranks would sum
   different rows in the all-reduce);
2. per layer: the input norm for all tokens; q/k/v and attention for all tokens, because vLLM's
   attention op writes the KV cache (so a skipped layer's K/V come from its input, as the shim's
   `project`); o_proj, the residual add and the MLP only for the tokens that run the layer;
3. after the last layer, the shim's GateBank scores every layer's normed input of the step rows at
   once, the policy observes them, the executed skips are counted and one gate frame goes to the exporter.

Under pipeline parallelism each stage does all of this for its own layers (vLLM's `start_layer` to
`end_layer`), as vLLM's Llama does: the first stage embeds, the others continue from the hidden states
and residual the previous stage sent (vLLM's IntermediateTensors), the last one norms. A stage's policy
state is keyed by the KV slots every stage reads alike from the same attention metadata, so each finds
the same sequences; its deciding rank sends the frames of its layers, partial frames the exporter folds
into one model.

The decoder loop is ours and runs eagerly: vLLM's LlamaModel is compiled (`support_torch_compile`) into
one graph per batch size, which cannot take a row subset that depends on data; `ignore_torch_compile`
keeps this model out of it (serve with `--enforce-eager`, docs/vllm.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.compilation.decorators import ignore_torch_compile
from vllm.config import CompilationMode, VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from layerwatch.vllm_plugin.gating import load_gating
from layerwatch.vllm_plugin.sequences import BatchRows
from layerwatch.vllm_plugin.settings import PluginSettings, PluginSettingsError

GATE_TENSOR_PREFIX = "gates."  # a gate file in the model folder is read by vLLM's loader too: not weights


@ignore_torch_compile
class LayerwatchLlamaModel(LlamaModel):
    """vLLM's LlamaModel, its decoder loop replaced by the gated one (module doc), uncompiled."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.block_size = vllm_config.cache_config.block_size
        model_config = vllm_config.model_config
        refuse_unsupported(vllm_config)
        self.gating = load_gating(
            PluginSettings.from_overrides(getattr(model_config.hf_config, "layerwatch", None)),
            model_config.model,
            model_config.hf_config.num_hidden_layers,
            model_config.served_model_name,
            model_config.dtype,
            sequences=vllm_config.scheduler_config.max_num_seqs,
            decides=get_tensor_model_parallel_rank() == 0,  # rank 0 of this stage's tensor-parallel group
            layers=range(self.start_layer, self.end_layer),  # this pipeline stage's
        )
        self.tensor_parallel = vllm_config.parallel_config.tensor_parallel_size > 1

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor | IntermediateTensors:
        residual: torch.Tensor | None = None
        if get_pp_group().is_first_rank:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)  # [N, d]
        else:
            assert intermediate_tensors is not None  # vLLM passes every later stage the previous one's
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        step = self._step(hidden.shape[0])
        layers = self.layers[self.start_layer : self.end_layer]  # this stage's
        plan = _LayerPlan(step, hidden.shape[0], len(layers), hidden.device)
        normed_inputs = []  # each layer's normed input of the step rows [R, d], for the gates
        for l, layer in enumerate(layers):
            if residual is None:
                residual, x = hidden, layer.input_layernorm(hidden)
            else:
                x, residual = layer.input_layernorm(hidden, residual)
            if step is not None and step.slots is not None:
                normed_inputs.append(x[plan.step_tokens])
            hidden, residual = _gated_layer(layer, positions, x, residual, plan.running[l])
        if step is not None:
            self._observe(step, normed_inputs)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _step(self, num_tokens: int) -> _Step | None:
        """The step rows of this forward and the layers each runs, or None for a forward without attention
        metadata (vLLM's warm-up and profiling runs: full depth, nothing observed)."""
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or not metadata:
            return None
        meta = next(iter(metadata.values()))
        requests = len(meta.seq_lens)
        rows = BatchRows.from_metadata(
            meta.query_start_loc[: requests + 1].cpu().numpy(),
            meta.seq_lens.cpu().numpy(),
            meta.slot_mapping[:num_tokens].cpu().numpy(),
            meta.block_table[:requests].cpu().numpy(),
            self.block_size,
        )
        gating = self.gating
        if not gating.decides:  # another rank decides (below)
            return _Step(rows, None, self._shared(np.empty((requests, len(gating.layers)), dtype=bool)))
        slots, fresh = gating.states.step(rows)
        for slot in slots[fresh].tolist():
            gating.policy.reset(slot, gating.threshold)
        # Decided from earlier steps only, before any layer runs.
        return _Step(rows, slots, self._shared(gating.policy.run_mask(slots)))

    def _shared(self, run: np.ndarray) -> np.ndarray:
        """bool [R, L]: rank 0's run mask on every rank of a tensor-parallel group (`run` itself without one)."""
        if not self.tensor_parallel:
            return run
        shared = torch.from_numpy(run.astype(np.uint8))
        return get_tp_group().broadcast(shared, src=0).numpy().astype(bool)

    def _observe(self, step: _Step, normed_inputs: list[torch.Tensor]) -> None:
        """After the step: count the executed skips; on the deciding rank score the step rows' gates (each
        layer's normed input [R, d]), let the policy observe them and send the step's gate frame."""
        gating = self.gating
        gating.executed_skips += (~step.run).sum(axis=0)
        gating.step_rows += len(step.run)
        if step.slots is None:
            return
        scores = gating.gates.scores(torch.stack(normed_inputs)).float().cpu().numpy()  # [R, L]
        fallbacks = int(gating.policy.observe(step.slots, scores, step.run).fallback_started.sum())
        gating.fallbacks += fallbacks
        if gating.sender is not None:
            gating.sender.send(scores, ~step.run, fallbacks)


def refuse_unsupported(vllm_config: VllmConfig) -> None:
    """What vLLM can be asked for that the gated decoder loop cannot serve stops start-up with one line."""
    if (
        vllm_config.parallel_config.pipeline_parallel_size > 1
        and current_platform.is_cpu()
        and vllm_config.compilation_config.mode == CompilationMode.NONE
    ):
        # vLLM 0.32's CPU runner allocates a later stage's input buffers only in its compile warm-up.
        raise PluginSettingsError(
            "layerwatch: pipeline parallelism on CPU needs vLLM's compile warm-up: serve without --enforce-eager"
        )
    if vllm_config.speculative_config is not None:
        raise PluginSettingsError("layerwatch: speculative decoding is not supported by the plugin")
    if vllm_config.lora_config is not None:
        # vLLM's LoRA layers take each token's adapter by its place in the whole batch: a layer's row subset made
        # them fail (einsum sizes) as soon as the rows of one step skipped differently.
        raise PluginSettingsError("layerwatch: LoRA adapters are not supported by the plugin")


@dataclass(frozen=True)
class _Step:
    """One forward's step rows: where they are, their policy slots, the layers each runs."""

    rows: BatchRows
    slots: np.ndarray | None  # int [R]: each step row's policy slot; None on a rank that does not decide
    run: np.ndarray  # bool [R, L]: True = the stage's layer runs for that row


class _LayerPlan:
    """Which tokens of the flat batch run each layer, from the step rows' run mask: the tokens that run,
    as an index shared by every layer with the same running rows, or None when all of them run."""

    def __init__(self, step: _Step | None, num_tokens: int, num_layers: int, device: torch.device) -> None:
        self.running: list[torch.Tensor | None] = [None] * num_layers
        if step is None:
            return
        last_tokens = step.rows.last_tokens
        self.step_tokens = torch.as_tensor(last_tokens, device=device)  # [R]: the step rows in the flat batch
        shared: dict[bytes, torch.Tensor] = {}
        for l in np.flatnonzero(~step.run.all(axis=0)):
            column = step.run[:, l]  # bool [R]
            key = column.tobytes()
            if key not in shared:
                runs = np.ones(num_tokens, dtype=bool)
                runs[last_tokens[~column]] = False
                shared[key] = torch.as_tensor(np.flatnonzero(runs), device=device)
            self.running[l] = shared[key]


def _gated_layer(
    layer: Any, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, running: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer in vLLM's (hidden, residual) form, x = its input norm's output [N, d]: for the
    tokens `running` (None: all), attention's output projection, the residual add and the MLP; for the
    others hidden 0 and the residual unchanged, so that the next layer's fused add passes them through.
    Attention runs for every token: vLLM's attention op writes the KV cache."""
    if running is None:
        hidden = layer.self_attn(positions=positions, hidden_states=x)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        return layer.mlp(hidden), residual
    attention = layer.self_attn
    qkv, _ = attention.qkv_proj(x)
    q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
    q, k = attention.rotary_emb(positions, q, k)
    attended = attention.attn(q, k, v)  # [N, heads * head_dim], the KV cache written for every token
    hidden = torch.zeros_like(x)
    if running.numel():
        out, _ = attention.o_proj(attended[running])
        out, running_residual = layer.post_attention_layernorm(out, residual[running])
        hidden.index_copy_(0, running, layer.mlp(out))
        residual = residual.index_copy(0, running, running_residual)
    return hidden, residual


class LayerwatchLlamaForCausalLM(LlamaForCausalLM):
    """The architecture `--hf-overrides '{"architectures": ["LayerwatchLlamaForCausalLM"], ...}'` selects."""

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type: Any = None) -> LlamaModel:
        return LayerwatchLlamaModel(vllm_config=vllm_config, prefix=prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The gate file beside the weights holds the gates, which load_gating read and checked.
        return super().load_weights((name, w) for name, w in weights if not name.startswith(GATE_TENSOR_PREFIX))
