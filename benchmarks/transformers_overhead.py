"""What observing a transformers `generate()` costs: tokens/s with and without the integration, paired.

    .venv/bin/python benchmarks/transformers_overhead.py [--shapes 8x64,16x512] [--batches 1,8] [--tokens 64]
        [--repeats 7] [--threads 1]

For each shape (layers x hidden size) a random transformers Llama behind per-token routers
(examples/router_llama.py) generates `--tokens` tokens per row from random prompts, greedily, with
end-of-sequence off so every run does the same work, at each batch size. Each repetition times one
`generate` without the observer and one with it (layerwatch.integrations.transformers, sending gate
frames to a loopback receiver that discards them, as an exporter would read them; no trace), in
alternating order, so the two runs of a pair share the machine's state. Printed per case: tokens per
second of process CPU time of each (median, min-max over the repetitions), the paired ratio observed
÷ bare by CPU time and by the wall clock (median, min-max), and the observer's CPU cost per step in
microseconds (the paired difference) and the CPU time the observer's hooks themselves took per step
(measured inside them: the direct figure, free of the two runs' noise). CPU time is the figure to
read on a shared machine: the wall clock also counts the time other processes held the cores. The
generated tokens of the two runs are asserted identical. Results go into docs/performance.md
("Instrumenting transformers").
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_bench import RECEIVER
from examples.router_llama import THRESHOLD, prompts, routed_llama
from layerwatch.client import GateFrameSender
from layerwatch.integrations.transformers import GenerateObserver, read_attributes

READ_ROUTERS = read_attributes("router_score", "router_ran")


class TimedObserver(GenerateObserver):
    """The observer, adding up the process CPU time its hooks take: the cost measured directly, apart
    from the noise of two whole runs' difference (torch's own dispatch of the hooks, about 1.5 us per
    layer and step here, is not in it)."""

    cpu_seconds = 0.0

    def _timed(self, hook: Callable[..., None], *args: Any) -> None:
        started = time.process_time()
        hook(*args)
        self.cpu_seconds += time.process_time() - started

    def _before_forward(self, *args: Any) -> None:
        self._timed(super()._before_forward, *args)

    def _after_layer(self, *args: Any) -> None:
        self._timed(super()._after_layer, *args)

    def _after_forward(self, *args: Any) -> None:
        self._timed(super()._after_forward, *args)


def timed_generate(model, batch: torch.Tensor, tokens: int) -> tuple[float, float, torch.Tensor]:
    """(process CPU seconds, wall seconds, output) of one greedy generate."""
    cpu, wall = time.process_time(), time.perf_counter()
    output = model.generate(
        batch, attention_mask=torch.ones_like(batch), max_new_tokens=tokens, do_sample=False, pad_token_id=1
    )
    return time.process_time() - cpu, time.perf_counter() - wall, output


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def run_case(model, sender: GateFrameSender, batch_size: int, tokens: int, repeats: int) -> dict[str, list[float]]:
    batch = prompts(batch_size, 16, seed=batch_size)
    timed_generate(model, batch, 4)  # warm-up: first-call allocations, lazy imports
    runs: dict[str, list[tuple[float, float]]] = {"bare": [], "observed": []}
    hooks_us = []
    for repeat in range(repeats):
        outputs = {}
        for kind in ("bare", "observed") if repeat % 2 == 0 else ("observed", "bare"):
            if kind == "bare":
                cpu, wall, outputs[kind] = timed_generate(model, batch, tokens)
            else:
                with TimedObserver(model, READ_ROUTERS, sender=sender) as observer:
                    cpu, wall, outputs[kind] = timed_generate(model, batch, tokens)
                hooks_us.append(observer.cpu_seconds / tokens * 1e6)
            runs[kind].append((cpu, wall))
        assert torch.equal(outputs["bare"], outputs["observed"]), "the observer changed what was generated"
    rows = batch_size * tokens
    pairs = list(zip(runs["bare"], runs["observed"]))
    return {
        "bare": [rows / cpu for cpu, _ in runs["bare"]],
        "observed": [rows / cpu for cpu, _ in runs["observed"]],
        "ratio": [b[0] / o[0] for b, o in pairs],  # observed tokens per CPU-second ÷ bare
        "ratio_wall": [b[1] / o[1] for b, o in pairs],
        "step_us": [(o[0] - b[0]) / tokens * 1e6 for b, o in pairs],
        "hooks_us": hooks_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8x64,16x512", help="layers x hidden size, comma-separated")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    assert receiver.stdout is not None
    address = f"127.0.0.1:{receiver.stdout.readline().strip()}"
    print(
        f"transformers generate, greedy, {args.tokens} tokens per row, {args.repeats} paired repetitions, "
        f"{args.threads} torch thread(s); frames to a discarding receiver at {address}"
    )
    print(
        "| layers x d | batch | bare tokens/CPU-s | observed tokens/CPU-s | observed / bare (CPU) "
        "| observed / bare (wall) | CPU cost per step (us) | hooks' CPU per step (us) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    try:
        for shape in args.shapes.split(","):
            layers, hidden = (int(x) for x in shape.split("x"))
            model = routed_llama(layers=layers, hidden_size=hidden)
            model.generation_config.eos_token_id = None  # every run generates all its tokens
            with GateFrameSender(address, "bench", layers, THRESHOLD) as sender:
                for batch_size in (int(b) for b in args.batches.split(",")):
                    result = run_case(model, sender, batch_size, args.tokens, args.repeats)
                    print(
                        f"| {layers} x {hidden} | {batch_size} | {spread(result['bare'], '.0f')} | "
                        f"{spread(result['observed'], '.0f')} | {spread(result['ratio'], '.3f')} | "
                        f"{spread(result['ratio_wall'], '.3f')} | {spread(result['step_us'], '.0f')} | "
                        f"{spread(result['hooks_us'], '.0f')} |",
                        flush=True,
                    )
                assert sum(sender.dropped.values()) == 0, sender.dropped
    finally:
        receiver.kill()


if __name__ == "__main__":
    main()
