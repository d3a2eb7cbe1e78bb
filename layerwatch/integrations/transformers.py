"""A transformers model's layer routing during `generate()`, published as gate frames and trace lines.

    sender = GateFrameSender("127.0.0.1:9410", "my-model", model.config.num_hidden_layers, threshold=0.5)
    with observe(model, read_attributes("router_score", "router_ran"), sender=sender):
        model.generate(**inputs, max_new_tokens=64, do_sample=True, temperature=0.8)

The model keeps its own routing: a FlexiDepth- or MindSkip-style router, layerwatch's gates, an exit
head. A small adapter (`ReadLayer`) says where a decoder layer's score is once the layer has run,
and whether the layer ran: `read_attributes(score, ran)` reads two attributes the layer (or its
wrapper) sets in its forward; any callable `(layer index, layer module, layer output) -> (score,
ran)` does the same in code. A score is one value in [0, 1] per token (`[batch, tokens]`, any shape
that flattens to it per row); `ran` a bool of the same shape, or None when the layer always runs.

What is published is what `layerwatch serve` publishes: one row per generated token of each
sequence. The prefill forward contributes its last position (the prompt's last token, whose
forward produces the first generated token: the serving engine's first decode step), every later
forward its one new position. Rows of sequences that already produced an end-of-sequence token
(transformers keeps feeding them padding until the whole batch is done) are left out, so the rows
of a sequence are exactly its generated tokens. Batches must be left-padded, as transformers
requires for decoder-only generation (the last position is then every row's newest token).

Cost: per layer, a forward hook that keeps the adapter's two tensors (no device work, no check);
per forward, a few operations on the device and one device-to-host transfer of `[batch, 2 * layers + 1]` float32;
nothing waits on the device per layer (docs/performance.md, "Instrumenting transformers"). The sender never blocks
or raises (layerwatch/client.py); a failing trace writer is logged and stops, as in the shim.

Nothing the observer meets breaks the user's `generate()`: a forward in which a decoder layer was not
called (an early exit), or whose adapter raised or returned values of the wrong shape or type, is not
published; it is counted in `dropped[reason]` (`no_reading`, `adapter_error`) and logged as a WARNING,
the first at once, then at most one a minute per reason with the count since the last.

Only `generate()` is observed (a model called directly publishes nothing), one call at a time per
model; greedy and sampled decoding, batch > 1. Not covered: beam search (every beam's row is
published), assisted or speculative decoding (several new positions per forward), stopping rules
other than end-of-sequence tokens (`stop_strings`, custom criteria: the stopped rows keep being
published until the batch ends).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Self, cast

import numpy as np
import torch
from torch import nn

from layerwatch.client import GateFrameSender
from layerwatch.trace import TraceWriter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["GenerateObserver", "ReadLayer", "observe", "read_attributes"]

log = logging.getLogger(__name__)

# Why a forward was not published (GenerateObserver.dropped): a decoder layer that was not called in
# it (an early exit), an adapter that raised or returned values that are not one score per token.
DROP_REASONS = ("no_reading", "adapter_error")
DROP_LOG_INTERVAL_SECONDS = 60.0  # a model that drops every forward logs a line a minute, not one per token

# (score, ran): score float [batch, tokens, ...] in [0, 1]; ran bool of the same shape, None = always ran.
LayerReading = tuple[torch.Tensor, "torch.Tensor | None"]
# (layer index, the decoder layer module, its forward's output) -> the layer's reading for this forward.
ReadLayer = Callable[[int, nn.Module, Any], LayerReading]


def read_attributes(score: str, ran: str | None = None) -> ReadLayer:
    """An adapter reading the layer module's attributes `score` and `ran` (None: the layer always
    runs), which the layer or its wrapper sets in each forward."""

    def read(index: int, layer: nn.Module, output: Any) -> LayerReading:
        value = getattr(layer, score, None)
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"decoder layer {index} ({type(layer).__name__}) has no tensor attribute {score!r} after its "
                f"forward (found {type(value).__name__}): read_attributes reads what the layer's router sets in "
                "each forward; a model without routers needs one on each decoder layer (examples/router_llama.py, "
                "add_routers) or an adapter of its own (docs/instrument.md)"
            )
        if ran is None:
            return value, None
        decision = getattr(layer, ran, None)
        if decision is not None and not isinstance(decision, torch.Tensor):
            raise ValueError(f"decoder layer {index}: attribute {ran!r} is a {type(decision).__name__}, not a tensor")
        return value, decision

    return read


class GenerateObserver:
    """Hooks `model`'s decoder layers and publishes each `generate()` forward's newest row per sequence.

    `read_layer` is the adapter (see the module docstring). `sender` gets every step's rows as gate
    frames; `trace`, as trace lines (for `layerwatch replay` and `layerwatch calibrate-trace`);
    at least one of them. `model_name` names the trace lines (default: the sender's). `layers`:
    the decoder layers to read, in order (default: `model.get_decoder().layers`). `eos_token_id`:
    the end-of-sequence ids that finish a row (default: what each `generate()` call uses, its
    `eos_token_id` or generation config's). Raises ValueError for a model, sender or trace that do
    not fit together.

    `steps` counts the forwards published, `rows` the rows, `dropped[reason]` the forwards not
    published (DROP_REASONS); nothing is raised out of `generate()`. `close()` removes the hooks and
    gives `generate` back; the observer is also a context manager.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        read_layer: ReadLayer,
        *,
        sender: GateFrameSender | None = None,
        trace: TraceWriter | None = None,
        model_name: str | None = None,
        layers: Sequence[nn.Module] | None = None,
        eos_token_id: int | Iterable[int] | None = None,
    ) -> None:
        if sender is None and trace is None:
            raise ValueError("nothing to publish to: give a sender, a trace writer, or both")
        self.model = model
        self.layers = list(_decoder_layers(model) if layers is None else layers)
        if not self.layers:
            raise ValueError("the model has no decoder layers to observe")
        if sender is not None and sender.num_layers != len(self.layers):
            raise ValueError(f"the sender expects {sender.num_layers} layers, the model has {len(self.layers)}")
        name = model_name if model_name is not None else sender.model_name if sender is not None else None
        if not name:
            raise ValueError("a trace without a sender needs model_name")
        self.model_name = name
        self.read_layer = read_layer
        self.sender = sender
        self.trace = trace
        self.steps = 0
        self.rows = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._unlogged = dict.fromkeys(DROP_REASONS, 0)  # drops since the last WARNING of each reason
        self._logged_at = dict.fromkeys(DROP_REASONS, -math.inf)
        self._eos_override = None if eos_token_id is None else _ids(eos_token_id)
        self._step: _Step | None = None  # the forward being observed, while generate() runs
        self._generation: _Generation | None = None
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward),
            *(
                layer.register_forward_hook(functools.partial(self._after_layer, i))
                for i, layer in enumerate(self.layers)
            ),
        ]
        # The generate this one wraps (the class's, or an observer's made before), bound; the instance
        # attribute below shadows it until close(), which puts back what it replaced.
        self._generate: Callable[..., Any] = cast(Any, model).generate
        self._replaced = model.__dict__.get("generate")
        self._closed = False
        cast(Any, model).generate = self._observed_generate

    def close(self) -> None:
        """Remove the hooks and give `model.generate` back. Observers may be closed in any order: one
        closed under another still open passes its calls through until that one is closed too."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._closed = True
        if self.model.__dict__.get("generate") != self._observed_generate:
            return  # an observer made after this one wraps it: that one's close() skips this one
        restored = self._replaced
        while isinstance(below := getattr(restored, "__self__", None), GenerateObserver) and below._closed:
            restored = below._replaced
        if restored is None:
            del self.model.generate
        else:
            cast(Any, self.model).generate = restored

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- generate() and its forwards ---------------------------------------------------------------

    def _observed_generate(self, *args: Any, **kwargs: Any) -> Any:
        # Closed (under an observer still open), or generate() inside generate() (an assistant model): not a step
        if self._closed or self._generation is not None:
            return self._generate(*args, **kwargs)
        self._generation = _Generation(self._end_of_sequence_ids(kwargs))
        try:
            return self._generate(*args, **kwargs)
        finally:
            self._generation = None
            self._step = None

    def _end_of_sequence_ids(self, kwargs: dict[str, Any]) -> list[int]:
        if self._eos_override is not None:
            return self._eos_override
        if kwargs.get("eos_token_id") is not None:
            return _ids(kwargs["eos_token_id"])
        config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        return [] if eos is None else _ids(eos)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        generation = self._generation
        if generation is None:
            return
        step = self._step = _Step(len(self.layers))
        try:
            step.rows = generation.note_inputs(kwargs.get("input_ids", args[0] if args else None), kwargs)
        except Exception as exc:  # the user's generate() goes on whatever the observer meets
            step.fail("adapter_error", f"the forward's inputs: {exc}")

    def _after_layer(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        step = self._step
        if step is None or step.problem is not None:
            return
        try:
            step.scores[index], step.ran[index] = self.read_layer(index, module, output)
        except Exception as exc:  # an adapter is user code: its failure drops the forward, not generate()
            step.fail("adapter_error", f"{type(exc).__name__}: {exc}")

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        step, generation = self._step, self._generation
        if step is None or generation is None:
            return
        self._step = None
        if step.problem is None and None in step.scores:
            missing = [i for i, score in enumerate(step.scores) if score is None]
            step.fail("no_reading", f"decoder layers {missing} were not called in this forward")
        if step.problem is None:
            assert generation.finished is not None  # set by the forward's pre-hook, which had no problem
            try:
                host = self._gather(step, generation.finished)
            except Exception as exc:  # the adapter's values are not one score per token (shape, type, device)
                step.fail("adapter_error", f"{type(exc).__name__}: {exc}")
        if step.problem is not None:
            self._drop(*step.problem)
            return
        layers = len(self.layers)
        keep = host[:, 2 * layers] == 0
        if keep.any():
            self._publish(host[keep, :layers], host[keep, layers : 2 * layers] == 0)

    def _drop(self, reason: str, why: str) -> None:
        self.dropped[reason] += 1
        self._unlogged[reason] += 1
        now = time.monotonic()
        if now - self._logged_at[reason] < DROP_LOG_INTERVAL_SECONDS:
            return
        count, self._unlogged[reason], self._logged_at[reason] = self._unlogged[reason], 0, now
        log.warning(
            "model %r: a generate() forward not published (%s): %s; %d forward(s) dropped for this reason since "
            "the last such line (GenerateObserver.dropped[%r])",
            self.model_name,
            reason,
            why,
            count,
            reason,
        )

    def _gather(self, step: _Step, finished: torch.Tensor) -> np.ndarray:
        """The forward's newest row per sequence on the host: [rows, 2 * layers + 1] (scores, ran, finished)."""
        read = cast(list[torch.Tensor], step.scores)
        scores = _newest(read, range(len(read)), step.rows, "score").float()
        decided = [i for i, r in enumerate(step.ran) if r is not None]
        values = [r for r in step.ran if r is not None]
        if len(decided) == len(step.ran):
            ran = _newest(values, decided, step.rows, "ran").float()
        else:
            ran = torch.ones_like(scores)  # None: the layer ran for every row
            if decided:
                ran[:, decided] = _newest(values, decided, step.rows, "ran").float()
        packed = torch.cat([scores, ran, finished[:, None].float()], dim=1)
        return packed.cpu().numpy()  # the one device-to-host transfer of the step

    def _publish(self, scores: np.ndarray, skipped: np.ndarray) -> None:
        self.steps += 1
        self.rows += len(scores)
        if self.sender is not None:
            self.sender.send(scores, skipped)
        if self.trace is not None:
            try:
                self.trace.write_rows(self.model_name, scores, skipped)
            except OSError as exc:  # raised once: the writer stopped for good and counts what it drops
                log.error(
                    "trace file %s: %s; trace writing stopped, the file ends with the last whole line",
                    self.trace.path,
                    exc,
                )
            except ValueError as exc:  # NaN or out-of-range scores: not representable in the format
                log.warning("trace file %s: step not written: %s", self.trace.path, exc)


def observe(model: PreTrainedModel, read_layer: ReadLayer, **options: Any) -> GenerateObserver:
    """`GenerateObserver(model, read_layer, **options)`: use it as a context manager around `generate()`."""
    return GenerateObserver(model, read_layer, **options)


class _Generation:
    """One generate() call: its end-of-sequence ids and which rows have produced one."""

    def __init__(self, eos_ids: list[int]) -> None:
        self.eos_ids = eos_ids
        self.finished: torch.Tensor | None = None  # bool [batch] on the device, from the prefill on
        self._eos: torch.Tensor | None = None

    def note_inputs(self, tokens: Any, kwargs: dict[str, Any]) -> int:
        """Mark the rows fed an end-of-sequence token as finished; -> the forward's batch size."""
        fed = tokens if isinstance(tokens, torch.Tensor) else kwargs.get("inputs_embeds")
        if not isinstance(fed, torch.Tensor):
            raise ValueError("generate() called the model with neither input_ids nor inputs_embeds")
        rows = fed.shape[0]
        if self.finished is None:  # the prefill: no row has finished
            self.finished = torch.zeros(rows, dtype=torch.bool, device=fed.device)
        elif isinstance(tokens, torch.Tensor) and self.eos_ids:
            # A row fed an end-of-sequence token produced it at the previous step: it is done.
            self.finished = self.finished | torch.isin(tokens[:, -1], self._eos_tensor(tokens.device))
        return rows

    def _eos_tensor(self, device: torch.device) -> torch.Tensor:
        if self._eos is None or self._eos.device != device:
            self._eos = torch.tensor(self.eos_ids, device=device)
        return self._eos


class _Step:
    """One forward's readings, layer by layer, still on the device, or why it cannot be published."""

    def __init__(self, layers: int) -> None:
        self.rows = 0
        self.scores: list[torch.Tensor | None] = [None] * layers
        self.ran: list[torch.Tensor | None] = [None] * layers
        self.problem: tuple[str, str] | None = None  # (reason, why): the first thing that went wrong

    def fail(self, reason: str, why: str) -> None:
        if self.problem is None:
            self.problem = (reason, why)


def _newest(values: list[torch.Tensor], layers: Sequence[int], rows: int, what: str) -> torch.Tensor:
    """Each row's value at the forward's last position, layer by layer: [rows, len(values)]. Tensors of
    one shape (the usual case: one router class) take three operations whatever the number of layers.
    `layers` and `what` name the adapter's values in the error a wrong shape raises."""
    for layer, value in zip(layers, values):
        if value.dim() == 0 or value.shape[0] != rows:
            raise ValueError(
                f"decoder layer {layer}: the adapter's {what} has shape {tuple(value.shape)}; expected one value "
                f"per token, [{rows}, tokens]"
            )
        if value.is_complex():  # .float() would keep the real part only, with a warning
            raise TypeError(f"decoder layer {layer}: the adapter's {what} is {value.dtype}; expected real values")
    if len({v.shape for v in values}) == 1:
        return torch.stack(values, dim=1).reshape(rows, len(values), -1)[:, :, -1]
    return torch.stack([v.reshape(rows, -1)[:, -1] for v in values], dim=1)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: pass layers=")
    return layers


def _ids(value: int | Iterable[int]) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
