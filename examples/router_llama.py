"""A transformers Llama with a per-token router in front of every decoder layer, feeding an exporter.

    .venv/bin/python -m examples.router_llama [--exporter 127.0.0.1:9410] [--trace FILE] [--prompts 8]

The routing is FlexiDepth's and MindSkip's idea, cut down: a router reads the layer's normed input,
scores the token with a sigmoid, and a token scoring below the threshold skips the layer (its hidden
state passes through unchanged; the layer still writes its keys and values, as FlexiDepth keeps
computing them). The router sets `router_score` and `router_ran` on its wrapper in every forward,
which is all `layerwatch.integrations.transformers` needs to read (`read_attributes`).

The model here is tiny and random (no download), so the scores mean nothing; the point is the
plumbing: the exporter's histogram, verdicts and the generated alert rules see this model as they see
a served one (tests/instrument/test_instrumented_stack.py runs that end to end).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import transformers
from torch import nn

from layerwatch.client import GateFrameSender
from layerwatch.integrations.transformers import observe, read_attributes
from layerwatch.trace import TraceWriter
from layerwatch.wire import DEFAULT_FRAMES_ADDRESS

MODEL_NAME = "routed-llama-tiny"
THRESHOLD = 0.5  # a router score below this skips the layer for the token
VOCAB_SIZE = 512


class RoutedDecoderLayer(nn.Module):
    """A decoder layer behind a router: score = sigmoid(w . input_layernorm(h) + b) per token; a token
    whose score is below `threshold` keeps its hidden state, the layer's update is dropped for it."""

    def __init__(self, layer: Any, hidden_size: int, threshold: float) -> None:
        super().__init__()
        self.layer = layer
        self.router = nn.Linear(hidden_size, 1)
        self.threshold = threshold
        self.router_score: torch.Tensor | None = None  # float [batch, tokens], this forward's
        self.router_ran: torch.Tensor | None = None  # bool [batch, tokens]

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        normed = self.layer.input_layernorm(hidden_states)
        score = torch.sigmoid(self.router(normed)).squeeze(-1)
        ran = score >= self.threshold
        output = self.layer(hidden_states, *args, **kwargs)
        updated = output[0] if isinstance(output, tuple) else output  # transformers 4 returned a tuple
        routed = torch.where(ran[..., None], updated, hidden_states)
        self.router_score, self.router_ran = score, ran
        return (routed, *output[1:]) if isinstance(output, tuple) else routed


def add_routers(
    model: transformers.PreTrainedModel, threshold: float = THRESHOLD, seed: int = 0
) -> list[RoutedDecoderLayer]:
    """Wrap every decoder layer of `model` in a RoutedDecoderLayer with a random router.

    The routers' weights are scaled so that a router's logit varies by a few units from token to token
    and their biases are spread over the layers: early layers mostly run, late ones mostly skip, and
    each decides per token (an untrained stand-in for trained routers).
    """
    layers = model.get_decoder().layers
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    routed = []
    for index, layer in enumerate(layers):
        wrapper = RoutedDecoderLayer(layer, hidden, threshold)
        with torch.no_grad():
            wrapper.router.weight.copy_(torch.randn(1, hidden, generator=generator) * 3.0 / hidden**0.5)
            wrapper.router.bias.fill_(2.0 - 4.0 * index / max(1, len(layers) - 1))
        layers[index] = wrapper
        routed.append(wrapper)
    return routed


def tiny_llama(layers: int = 8, hidden_size: int = 64, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A random transformers Llama small enough to generate on a CPU in milliseconds per token."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return transformers.LlamaForCausalLM(config).eval()


def routed_llama(layers: int = 8, hidden_size: int = 64, seed: int = 0) -> transformers.LlamaForCausalLM:
    model = tiny_llama(layers, hidden_size, seed)
    add_routers(model, seed=seed)
    return model


def prompts(count: int, length: int, seed: int) -> torch.Tensor:
    """`count` random prompts of `length` token ids (2.. the vocabulary: no BOS or EOS among them)."""
    return torch.randint(2, VOCAB_SIZE, (count, length), generator=torch.Generator().manual_seed(seed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--exporter", default=DEFAULT_FRAMES_ADDRESS, help="the exporter's --listen address")
    parser.add_argument("--trace", help="also write a trace file (for layerwatch replay and calibrate-trace)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)

    model = routed_llama()
    sender = GateFrameSender(args.exporter, MODEL_NAME, model.config.num_hidden_layers, THRESHOLD)
    trace = TraceWriter(args.trace, 100 << 20, threshold=THRESHOLD) if args.trace else None
    with sender, observe(model, read_attributes("router_score", "router_ran"), sender=sender, trace=trace) as watch:
        for start in range(0, args.prompts, args.batch_size):
            batch = prompts(min(args.batch_size, args.prompts - start), 8, seed=start)
            model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=args.max_new_tokens,
                do_sample=True,
                temperature=args.temperature,
            )
    print(
        f"{watch.rows} tokens in {watch.steps} steps: {sender.sent} frames sent to {args.exporter}, "
        f"dropped {sender.dropped}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
