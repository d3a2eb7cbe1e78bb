"""How a decode step runs the layers its rows want: the depth execution, never slower than full depth.

The skip policy (skip_policy.py) decides, per row, which layers the next step runs: the *decided*
run mask, each row by its own gates, threshold, patience and fallback. At batch > 1 a layer that
some rows want and others do not can run three ways:
  - row-partial: the rows that want it are gathered, run and scattered back (model.py); every row
    runs exactly what it decided, at the cost of the layer at r of B rows plus the gathers;
  - whole: every row runs it, those whose rule said skip included: their quality can only gain,
    and the layer costs what it costs at full depth;
  - voted off (batch consensus, share q): when fewer than q·B rows want it, no row runs it but the
    rows at full depth (τ = 0, or in a fallback episode), which always run every layer.
On a CPU a layer's cost grows far slower than its rows (docs/performance.md, "Decode at batch > 1";
at d = 128 one that 6 of 8 rows run costs about what 8 do), so the row-partial path pays only where
few rows run a layer, if at all. Per step and layer, `DepthExecution.plan` therefore takes the row-partial path
where this device runs it faster than the whole layer (`DepthCosts`: the most running rows for
which it does, measured on the model), and otherwise runs the layer whole or, with a vote, for
every row when at least q·B want it and for none else. No layer then costs more than at full depth.

Modes (`DepthExecutionConfig.mode`):
  - "auto" (default): as above;
  - "rows": the row-partial path for every layer (each row exactly as it decided, whatever its
    neighbours: the mode that keeps a row's result independent of its batch);
  - "batch": whole layers only (with the vote, what `--batch-consensus` did before there were modes).
The decided mask stays each row's own in every mode: the fallback breaker and the step records'
`skipped` (frames, traces, the routing statistics) read it; what really ran is the *executed* mask
(`executed_skipped`, usage), which the shim counts apart (docs/model.md, "Depth execution").
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from layerwatch.inference_shim.runtime.model import KV_POLICIES, KVCache, Transformer

DEPTH_MODES = ("auto", "rows", "batch")
DEFAULT_VOTE = 0.5  # the share at which `eval` measured consensus faster and better than per row (performance.md)
# The paths a (step, layer) takes, as `layer_paths` counts them.
PATHS = ("whole", "partial", "skipped")


@dataclass(frozen=True)
class DepthExecutionConfig:
    mode: str = "auto"  # DEPTH_MODES
    vote: float | None = DEFAULT_VOTE  # q in (0, 1]: batch consensus where a layer runs whole; None: none
    # (mode "rows" runs no layer whole, so it never votes)

    def __post_init__(self) -> None:
        if self.mode not in DEPTH_MODES:
            raise ValueError(f"depth execution must be one of {', '.join(DEPTH_MODES)}, got {self.mode!r}")
        if self.vote is not None and not 0.0 < self.vote <= 1.0:  # NaN fails too
            raise ValueError(f"batch consensus must be in (0, 1], got {self.vote}")

    def describe(self) -> str:
        """For reports: "auto, consensus 0.5" or "rows" (which runs no layer whole: no vote)."""
        return self.mode + ("" if self.vote is None or self.mode == "rows" else f", consensus {self.vote:g}")


class DepthCosts(Protocol):
    def row_partial_limit(self, batch: int) -> int:
        """The most running rows (of `batch`) for which a layer's row-partial path is faster than
        running it for the whole batch (0: never; batch - 1: always)."""
        ...


@dataclass
class FixedDepthCosts:
    """Limits given rather than measured (tests, or a device measured before): batch -> limit;
    a batch size not listed takes `default`, at most batch - 1."""

    limits: dict[int, int] = field(default_factory=dict)
    default: int = 0

    def row_partial_limit(self, batch: int) -> int:
        return min(self.limits.get(batch, self.default), batch - 1)


class MeasuredDepthCosts:
    """The row-partial limits of this model on its device, measured once per batch size and kept.

    A measurement times the decode work of a few layers (`Transformer.decode_layers`, the code a
    step runs) on a scratch cache: the whole batch, and the row-partial path at r of the rows,
    interleaved, the fastest of `repeats` runs each; a binary search finds the largest r whose
    row-partial path is faster by at least MARGIN (ceil(log2 B) values of r, assuming it gets slower
    with r). Where the two are about even the layer runs whole: the timings of a shared machine
    would otherwise pick either at random, and whole is what a batch consensus can vote off. The
    layers are spread over the model so that each run reads weights the previous one evicted, as in
    a step. What it cost is in `seconds`; `limits` holds what it found.
    """

    CONTEXT = 16  # cached positions the scratch rows attend to
    MARGIN = 0.95  # the row-partial path must take at most this share of the whole layer's time

    def __init__(self, model: Transformer, kv_policy: str, layers: int = 2, repeats: int = 3) -> None:
        if kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")
        self.model = model
        self.kv_policy = kv_policy
        count = min(layers, model.config.num_layers)
        self.layers = np.linspace(0, model.config.num_layers - 1, count).round().astype(int).tolist()
        self.repeats = repeats
        self.limits: dict[int, int] = {}
        self.seconds = 0.0

    def row_partial_limit(self, batch: int) -> int:
        if batch not in self.limits:
            started = time.perf_counter()
            self.limits[batch] = self._measure(batch) if batch > 1 else 0
            self.seconds += time.perf_counter() - started
        return self.limits[batch]

    def prepare(self, batches: Iterable[int]) -> None:
        """Measure these batch sizes now (before timing anything, or before serving)."""
        for batch in batches:
            self.row_partial_limit(batch)

    def _measure(self, batch: int) -> int:
        model, config = self.model, self.model.config
        weight = model.embed_tokens.weight
        cache = KVCache(config, batch, self.CONTEXT + 1, weight.dtype, weight.device)
        cache.valid[:, :, : self.CONTEXT] = True  # attend to zeros: only the time counts
        rows = model.step_rows(cache, list(range(batch)), [self.CONTEXT] * batch)
        h = torch.randn(batch, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(weight)

        def seconds(running: np.ndarray | None) -> float:
            _synchronize(weight.device)
            started = time.perf_counter()
            model.decode_layers(h.clone(), rows, cache, self.layers, self.CONTEXT + 1, running, self.kv_policy)
            _synchronize(weight.device)
            return time.perf_counter() - started

        def faster(running_rows: int) -> bool:
            # The running rows spread over the batch, as a step's are.
            running = np.zeros(batch, dtype=bool)
            running[np.linspace(0, batch - 1, running_rows).round().astype(int)] = True
            seconds(None), seconds(running)  # warm-up: first calls at these shapes allocate
            whole, partial = [], []
            for _ in range(self.repeats):
                whole.append(seconds(None))
                partial.append(seconds(running))
            return min(partial) < self.MARGIN * min(whole)

        low, high = 0, batch - 1  # the row-partial path at 0 rows runs nothing: always faster
        while low < high:
            middle = (low + high + 1) // 2
            if faster(middle):
                low = middle
            else:
                high = middle - 1
        return low

    def table(self) -> str:
        """The limits found, for a log line: "B=2: 0, B=4: 1, B=8: 2 (0.21 s)"."""
        limits = ", ".join(f"B={batch}: {limit}" for batch, limit in sorted(self.limits.items()))
        return f"{limits} ({self.seconds:.2f} s)"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_paths(executed: np.ndarray) -> dict[str, int]:
    """A step's layers by how they ran (PATHS), from its executed mask bool [B, L]: for every row,
    for some, for none."""
    runs = executed.sum(axis=0)
    whole, skipped = int((runs == executed.shape[0]).sum()), int((runs == 0).sum())
    return {"whole": whole, "partial": executed.shape[1] - whole - skipped, "skipped": skipped}


class DepthExecution:
    """Turns each step's decided run mask into the executed one (the module docstring)."""

    def __init__(self, config: DepthExecutionConfig, costs: DepthCosts) -> None:
        self.config = config
        self.costs = costs

    def plan(self, decided: np.ndarray, full_depth: np.ndarray) -> np.ndarray:
        """The executed mask bool [B, L] (True = the layer runs for the row) for decided: bool [B, L]
        (the skip policy's run mask); full_depth: bool [B], rows that run every layer whatever the
        batch does (τ = 0, fallback: SkipPolicy.full_depth_rows)."""
        batch = decided.shape[0]
        if self.config.mode == "rows" or batch == 1:  # one row: whole is row-partial
            return decided
        limit = 0 if self.config.mode == "batch" else self.costs.row_partial_limit(batch)
        wanting = decided.sum(axis=0)  # [L]
        whole = wanting > limit  # the row-partial path would not be faster: run it whole (or vote)
        if not whole.any():
            return decided
        executed = decided.copy()
        vote = self.config.vote
        voted_off = whole & (wanting / batch < vote) if vote is not None else np.zeros_like(whole)
        executed[:, whole & ~voted_off] = True
        if voted_off.any():
            # Only the full-depth rows run a voted-off layer: row-partial where that is faster.
            keep = full_depth if int(full_depth.sum()) <= limit else np.ones(batch, dtype=bool)
            executed[:, voted_off] = keep[:, None]
        return executed


def default_depth_execution(model: Transformer, kv_policy: str, config: DepthExecutionConfig) -> DepthExecution:
    """The execution with this model's measured costs (none are measured unless "auto" needs them)."""
    return DepthExecution(config, MeasuredDepthCosts(model, kv_policy))
