"""Imports go one way between the project's packages, and the light parts never import torch.

docs/architecture.md draws the same map. Every import statement of every module counts, also the
ones inside functions (commands import their libraries lazily, which must not hide a wrong edge).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# package -> the project packages it may import. A package is a top-level folder, one of
# inference_shim's layers (inference_shim itself holds nothing but them), or layerwatch.integrations.
ALLOWED: dict[str, set[str]] = {
    "layerwatch": set(),
    # The one exception to a torch-free core: instrumentation for other engines' frameworks, which
    # imports torch and transformers and of the project only the core; the core never imports it.
    "layerwatch.integrations": {"layerwatch"},
    "mixin": {"layerwatch"},
    "exporter": {"layerwatch"},
    "alerts": {"layerwatch", "mixin"},
    "dashboards": {"layerwatch", "mixin", "alerts"},
    "deploy": {"layerwatch", "mixin", "alerts", "dashboards"},
    # The model code imports, of the project, only the skip policy's settings (ONLY_MODULES).
    "inference_shim.runtime": {"layerwatch"},
    "inference_shim.service": {"layerwatch", "inference_shim.runtime"},
    "inference_shim.offline": {"layerwatch", "alerts", "inference_shim.runtime"},
    "demo": {"layerwatch", "mixin", "alerts", "deploy"},
}
# Where a package may import only some modules of another. Calibrate builds a profile with the
# torch-free profile math (alerts.baseline) and returns it (alerts.profile), and needs no rule or spec.
ONLY_MODULES: dict[tuple[str, str], set[str]] = {
    ("inference_shim.offline", "alerts"): {"alerts.baseline", "alerts.profile"},
    # The model code knows nothing of HTTP, metrics or frames: of the core, only the skip policy's
    # settings (τ's default, range and comparison), which the shim, traces and frames share with it.
    ("inference_shim.runtime", "layerwatch"): {"layerwatch.skip_policy"},
}
# The commands sit on top: they may import every library package, and nothing imports them.
COMMANDS = "layerwatch_cli"
# What the exporter's container and the generators install: no torch, no model.
TORCH_FREE = ("layerwatch", "mixin", "exporter", "alerts", "dashboards", "deploy", "demo")


def package_of(module: str) -> str | None:
    if module.startswith("inference_shim.") or module.split(".")[:2] == ["layerwatch", "integrations"]:
        return ".".join(module.split(".")[:2])
    top = module.split(".")[0]
    return top if top in ALLOWED or top == COMMANDS or top == "inference_shim" else None


def source_modules() -> dict[str, Path]:
    modules = {}
    for package in [*{p.split(".")[0] for p in ALLOWED}, COMMANDS]:
        for path in sorted((REPO / package).rglob("*.py")):
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
    stray = [
        m
        for m in source_modules()
        if package_of(m) is None or package_of(m) == "inference_shim" and m != "inference_shim"
    ]
    assert not stray, f"modules outside the package map (add them to a layer): {stray}"


def test_the_light_packages_never_import_torch() -> None:
    heavy = ("torch", "safetensors", "transformers", "inference_shim")
    found = []
    for module, path in source_modules().items():
        if package_of(module) in TORCH_FREE:
            found += [
                f"{module} imports {name}" for name in imported_modules(path, module) if name.split(".")[0] in heavy
            ]
    assert not found, "\n".join(found)


def test_the_exporter_command_runs_without_torch() -> None:
    """Importing the exporter's command and its whole server leaves torch unloaded (the sidecar
    image has no torch at all), and so does the sender an engine imports, and the integrations'
    package (only its framework modules import a framework)."""
    code = (
        "import sys; import layerwatch_cli.exporter, layerwatch_cli.replay, layerwatch_cli.top, exporter.server; "
        "import layerwatch.client, layerwatch.integrations; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr or "torch was imported"
