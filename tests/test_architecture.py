"""Imports go one way between the project's packages, and the light parts never import torch.

docs/architecture.md draws the same map. Every import statement of every module counts, also the
ones inside functions (commands import their libraries lazily, which must not hide a wrong edge).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# package -> the project packages it may import. Everything installs under the one top-level name
# `layerwatch`: a package is the core (the modules directly in layerwatch/), one of its subpackages, or one
# of inference_shim's layers (inference_shim itself holds nothing but them).
CORE = "layerwatch"
ALLOWED: dict[str, set[str]] = {
    CORE: set(),
    # The one exception to a torch-free core: instrumentation for other engines' frameworks, which
    # imports torch and transformers and of the project only the core; the core never imports it.
    "layerwatch.integrations": {CORE},
    "layerwatch.mixin": {CORE},
    "layerwatch.exporter": {CORE},
    "layerwatch.alerts": {CORE, "layerwatch.mixin"},
    "layerwatch.dashboards": {CORE, "layerwatch.mixin", "layerwatch.alerts"},
    "layerwatch.deploy": {CORE, "layerwatch.mixin", "layerwatch.alerts", "layerwatch.dashboards"},
    # The model code imports, of the project, only the skip policy's settings (ONLY_MODULES).
    "layerwatch.inference_shim.runtime": {CORE},
    "layerwatch.inference_shim.service": {CORE, "layerwatch.inference_shim.runtime"},
    "layerwatch.inference_shim.offline": {CORE, "layerwatch.alerts", "layerwatch.inference_shim.runtime"},
    "layerwatch.demo": {CORE, "layerwatch.mixin", "layerwatch.alerts", "layerwatch.deploy"},
    # The vLLM plugin serves the runtime's gates and skip rule inside vLLM and sends the core's frames.
    "layerwatch.vllm_plugin": {CORE, "layerwatch.inference_shim.runtime"},
    # The quality guard in front of vLLM's API: the core's catalog, metrics and divergence, no model.
    "layerwatch.vllm_guard": {CORE},
}
# Where a package may import only some modules of another. Calibrate builds a profile with the torch-free
# profile math (layerwatch.alerts.baseline) and returns it (layerwatch.alerts.profile), and needs no rule or spec.
ONLY_MODULES: dict[tuple[str, str], set[str]] = {
    ("layerwatch.inference_shim.offline", "layerwatch.alerts"): {
        "layerwatch.alerts.baseline",
        "layerwatch.alerts.profile",
    },
    # The model code knows nothing of HTTP, metrics or frames: of the core, only the skip policy's
    # settings (τ's default, range and comparison), which the shim, traces and frames share with it,
    # and the shadow check's divergence, which the vLLM guard shares with it.
    ("layerwatch.inference_shim.runtime", CORE): {"layerwatch.skip_policy", "layerwatch.shadow_divergence"},
}
# The commands sit on top: they may import every library package, and nothing imports them.
COMMANDS = "layerwatch.cli"
# What the exporter's container and the generators install: no torch, no model.
TORCH_FREE = (
    CORE,
    "layerwatch.mixin",
    "layerwatch.exporter",
    "layerwatch.alerts",
    "layerwatch.dashboards",
    "layerwatch.deploy",
    "layerwatch.demo",
    "layerwatch.vllm_guard",
)
SHIM = "layerwatch.inference_shim"


def package_of(module: str) -> str | None:
    """The package a module (or a name imported from it) belongs to; None outside the project."""
    parts = module.split(".")
    if parts[0] != CORE:
        return None
    if len(parts) == 1 or not (REPO / CORE / parts[1]).is_dir():
        return CORE  # the package itself, a core module, or a name imported from the core
    if parts[1] == "inference_shim" and len(parts) > 2:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def source_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((REPO / CORE).rglob("*.py")):
        relative = path.relative_to(REPO).with_suffix("")
        modules[".".join(relative.parts).removesuffix(".__init__")] = path
    return modules


def imported_modules(path: Path, module: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")
                names.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> the modules where that import happens."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in source_modules().items():
        source = package_of(module)
        for name in imported_modules(path, module):
            target = package_of(name)
            if source and target and target != source:
                edges.setdefault((source, target), []).append(module)
    return edges


def test_the_allowed_map_has_no_cycle() -> None:
    try:
        list(TopologicalSorter(ALLOWED).static_order())
    except CycleError as exc:
        pytest.fail(f"ALLOWED has a cycle: {exc.args[1]}")


def test_imports_go_one_way_between_packages() -> None:
    wrong = []
    for (source, target), where in sorted(package_edges().items()):
        if source == COMMANDS:
            continue
        if target == COMMANDS or target not in ALLOWED.get(source, set()):
            wrong.append(f"{source} -> {target} (in {', '.join(sorted(set(where)))})")
    assert not wrong, "imports against the package direction:\n  " + "\n  ".join(wrong)


def test_narrow_edges_import_only_their_modules() -> None:
    wrong = []
    for module, path in source_modules().items():
        for name in imported_modules(path, module):
            allowed = ONLY_MODULES.get((package_of(module) or "", package_of(name) or ""))
            if allowed is not None and not any(name == m or name.startswith(f"{m}.") for m in allowed):
                wrong.append(f"{module} imports {name} (allowed of it: {sorted(allowed)})")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle_between_modules() -> None:
    """Within a package too, imports go one way: every import counts, also those for type checking
    only and those inside functions (a circle read at type-checking time is a circle all the same)."""
    modules = source_modules()
    graph = {
        module: {name for name in imported_modules(path, module) if name in modules and name != module}
        for module, path in modules.items()
    }
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def test_every_module_belongs_to_a_known_package() -> None:
    stray = [m for m in source_modules() if package_of(m) not in ALLOWED and package_of(m) != COMMANDS and m != SHIM]
    assert not stray, f"modules outside the package map (add them to a layer): {stray}"


def test_the_light_packages_never_import_torch() -> None:
    heavy = ("torch", "safetensors", "transformers", SHIM)
    found = []
    for module, path in source_modules().items():
        if package_of(module) in TORCH_FREE:
            found += [
                f"{module} imports {name}"
                for name in imported_modules(path, module)
                if any(name == h or name.startswith(f"{h}.") for h in heavy)
            ]
    assert not found, "\n".join(found)


def test_the_exporter_command_runs_without_torch() -> None:
    """Importing the exporter's command and its whole server leaves torch unloaded (the sidecar
    image has no torch at all), and so do the vLLM guard's command, the sender an engine imports, and
    the integrations' package (only its framework modules import a framework)."""
    code = (
        "import sys; import layerwatch.cli.exporter, layerwatch.cli.replay, layerwatch.cli.top; "
        "import layerwatch.cli.vllm_guard; "
        "import layerwatch.exporter.server; "
        "import layerwatch.client, layerwatch.integrations; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr or "torch was imported"


def test_the_wheel_installs_one_top_level_name(tmp_path: Path) -> None:
    """Installed into an environment it does not own (vLLM's, with the plugin), the package must not put
    generic names (`demo`, `exporter`, ...) at the top of site-packages: only `layerwatch` and its metadata."""
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("layerwatch-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {CORE}, sorted(top)
    # The data the parts read at run time travels inside the one package.
    for data in ("layerwatch/alerts/profiles/demo.yaml", "layerwatch/inference_shim/demo_model/config.json"):
        assert data in names, data


# Where a score may be compared with τ, or a count of steps with patience: the one skip rule and what is
# checked against it. A second implementation of the rule compares there too, and fails the test below.
RULE_SITES = {
    "layerwatch/skip_policy.py": "below_threshold: the one comparison of a score with τ",
    "layerwatch/inference_shim/runtime/skip_policy.py": "the rule: SkipPolicy, decide_sequences",
    "layerwatch/inference_shim/offline/gate_training.py": "the rule's differentiable relaxation, for training "
    "(equal to the rule at hard decisions: test_the_relaxed_rule_at_hard_decisions_is_the_decode_rule)",
    "tests/model/test_training_gates.py": "that relaxation's hard decisions, compared with the rule",
    "tests/model/test_skipping.py": "the rule's own tests: an oracle written from its definition",
    "examples/router_llama.py": "another model's router, which layerwatch instruments (not layerwatch's rule)",
}
RULE_NAMES = {"threshold", "tau", "skip_threshold", "patience"}


def _is_setting(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in RULE_NAMES or name.endswith("_threshold")


def rule_comparisons(tree: ast.AST) -> list[int]:
    """Lines where a value that is neither a constant nor another setting of the rule is ordered
    against τ or patience (`score < threshold`, `streak >= patience`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(o, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for o in node.ops):
            operands = [node.left, *node.comparators]
            settings = [o for o in operands if _is_setting(o)]
            others = [o for o in operands if not _is_setting(o) and not isinstance(o, ast.Constant)]
            if settings and others:
                lines.append(node.lineno)
    return lines


def test_the_skip_rule_is_written_once() -> None:
    """The runtime, training, calibration, the tests' traces and the vLLM plugin all call the one rule
    (SkipPolicy, decide_sequences, below_threshold): a copy of it elsewhere fails here."""
    found = []
    for folder in (CORE, "tests", "benchmarks", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative not in RULE_SITES:
                found += [f"{relative}:{line}" for line in rule_comparisons(ast.parse(path.read_text()))]
    assert not found, "the skip rule (or its comparison with τ) written again; call SkipPolicy:\n" + "\n".join(found)


def test_the_rule_check_finds_a_copy() -> None:
    copy = "def skips(scores, streak, patience, threshold):\n    return (streak >= patience) & (scores < threshold)\n"
    assert rule_comparisons(ast.parse(copy)) == [2, 2]


def gelu_calls(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))
        in ("gelu", "GELU")
    ]


def test_the_gate_is_defined_once() -> None:
    """Linear(d->16) -> GELU -> Linear(16->1) -> Sigmoid lives in the runtime's model (Gate, and GateBank's
    batched scores of the same parameters); the training, the plugin and the tests call it."""
    home = "layerwatch/inference_shim/runtime/model.py"
    found = []
    for folder in (CORE, "tests", "benchmarks", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.relative_to(REPO).as_posix() != home:
                found += [f"{path.relative_to(REPO)}:{line}" for line in gelu_calls(ast.parse(path.read_text()))]
    assert not found, f"a gate (GELU) defined outside {home}:\n" + "\n".join(found)
    assert gelu_calls(ast.parse((REPO / home).read_text()))  # the check looks where the gate is
