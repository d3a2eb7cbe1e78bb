"""LayerProbe: the per-layer signals of a full-depth pass, against a forward written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from layerwatch.inference_shim.runtime.agreement import ShadowJob, full_depth_agreement
from layerwatch.inference_shim.runtime.model import LayerProbe, Transformer
from tests.service.conftest import uniform_record

from .conftest import random_gates, random_model, tiny_config


def hand_signals(model: Transformer, tokens: torch.Tensor):
    """The model's full-depth forward written out with explicit attention probabilities (no SDPA,
    no Block/Attention code): per position and layer the relative update ||dh||/||h||, the gate
    score and the mean over heads of KL(attention || uniform) = sum p log p + log(attended)."""
    c = model.config
    T = tokens.shape[0]
    H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    def rope(x, positions):  # x: [heads, T, D]
        freqs = positions[:, None].double() * (1.0 / c.rope_theta ** (torch.arange(0, D, 2).double() / D))
        angles = torch.cat((freqs, freqs), dim=-1).float()
        rotated = torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1)
        return x * angles.cos() + rotated * angles.sin()

    positions = torch.arange(T)
    causal = positions[None, :] <= positions[:, None]  # [query, key]
    h = model.embed_tokens.weight[tokens]
    updates, gates, kls = [], [], []
    for l, block in enumerate(model.layers):
        attn_mod = block.self_attn
        x = rms(h, block.input_layernorm.weight)
        gates.append(model.gates[l](x))
        q = rope((x @ attn_mod.q_proj.weight.T).view(T, H, D).transpose(0, 1), positions)
        k = rope((x @ attn_mod.k_proj.weight.T).view(T, Hkv, D).transpose(0, 1), positions)
        v = (x @ attn_mod.v_proj.weight.T).view(T, Hkv, D).transpose(0, 1)
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(D)
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)  # [H, T, T]
        plogp = torch.where(causal, p * torch.log(p), torch.zeros(()))
        kls.append((plogp.sum(-1) + torch.log(positions.double() + 1).float()).mean(0))
        attn = (p @ v).transpose(0, 1).reshape(T, H * D) @ attn_mod.o_proj.weight.T
        mid = h + attn
        mlp = block.mlp
        y = rms(mid, block.post_attention_layernorm.weight)
        ffn = (F.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        delta = attn + ffn
        updates.append(delta.norm(dim=-1) / h.norm(dim=-1))
        h = h + delta
    return torch.stack(updates, -1), torch.stack(gates, -1), torch.stack(kls, -1)


@pytest.fixture
def model():
    m = random_model(tiny_config(), seed=5)
    m.attach_gates(random_gates(m.config, seed=2))
    return m


def test_probe_matches_the_hand_computation_from_its_start(model):
    tokens = torch.randint(2, model.config.vocab_size, (9,))
    update, gate, kl = hand_signals(model, tokens)
    probe = LayerProbe(start=3)
    with torch.no_grad():
        model(tokens[None], probe=probe)
    L = model.config.num_layers
    assert probe.relative_update.shape == probe.gate_score.shape == probe.attention_kl.shape == (1, 6, L)
    assert probe.relative_update.dtype == torch.float32
    torch.testing.assert_close(probe.relative_update[0], update[3:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(probe.gate_score[0], gate[3:], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(probe.attention_kl[0], kl[3:], rtol=1e-4, atol=1e-5)
    # Between 0 (even) and log(attended) (one position), and not trivially at either end here.
    attended = torch.arange(3, 9, dtype=torch.float32)[:, None] + 1
    assert (probe.attention_kl[0] > 0).all() and (probe.attention_kl[0] < torch.log(attended)).all()


def test_even_attention_has_zero_kl_and_the_first_position_too(model):
    with torch.no_grad():
        for block in model.layers:
            block.self_attn.q_proj.weight.zero_()  # every score 0: attention spread evenly
    probe = LayerProbe()
    with torch.no_grad():
        model(torch.randint(2, model.config.vocab_size, (1, 7)), probe=probe)
    torch.testing.assert_close(probe.attention_kl, torch.zeros_like(probe.attention_kl), atol=1e-6, rtol=0)


def test_probing_changes_no_output_and_works_in_a_batch_without_gates(model):
    tokens = torch.randint(2, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        plain_logits, plain_entropies = model(tokens)
        probe = LayerProbe(start=5)
        logits, entropies = model(tokens, probe=probe)
    assert torch.equal(logits, plain_logits) and torch.equal(entropies, plain_entropies)
    for row in range(2):
        update, _, kl = hand_signals(model, tokens[row])
        torch.testing.assert_close(probe.relative_update[row], update[5:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(probe.attention_kl[row], kl[5:], rtol=1e-4, atol=1e-5)
    model.attach_gates(None)
    probe = LayerProbe(start=5)
    with torch.no_grad():
        model(tokens, probe=probe)
    assert probe.gate_score is None and probe.relative_update.shape == (2, 3, model.config.num_layers)


def test_agreement_returns_the_signals_of_the_decode_positions(model):
    prompt, generated = [0, 5, 9, 13], [21, 34, 55]
    record = uniform_record(len(generated), model.config.vocab_size)  # the tokens are not the model's
    plain = full_depth_agreement(model, ShadowJob(prompt, generated, record))
    probed = full_depth_agreement(model, ShadowJob(prompt, generated, record), layer_signals=True)
    assert plain.layer_signals is None
    assert (probed.tokens, probed.agreements) == (plain.tokens, plain.agreements)
    update, gate, kl = hand_signals(model, torch.tensor(prompt + generated))
    # The decode steps' inputs: the prompt's last token, then every generated token but the last.
    signals = probed.layer_signals
    assert signals.relative_update.shape == (3, model.config.num_layers)
    torch.testing.assert_close(torch.from_numpy(signals.relative_update), update[3:6], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(signals.gate_score), gate[3:6], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(signals.attention_kl), kl[3:6], rtol=1e-4, atol=1e-5)
