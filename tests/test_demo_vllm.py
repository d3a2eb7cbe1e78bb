"""`layerwatch demo --engine vllm`: every drill has a form in vLLM's plugin (a gate file written by the
shim's own transforms, or plugin settings), and, opt-in, the static drill pages on a real `vllm serve`.

The run starts vLLM twice (the healthy engine and the drill's) besides the shared engine of tests/vllm, a
few minutes on two cores: it runs only with LAYERWATCH_VLLM_DEMO=1 (and .venv-vllm, Prometheus and
Alertmanager installed), outside the suite's budget."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from layerwatch.alerts.specs import ALERTS
from layerwatch.demo.drills import DRILLS
from layerwatch.demo.models import DEMO_MODELS
from layerwatch.demo.processes import LAYERWATCH_COMMAND, free_port
from layerwatch.demo.receiver import PAGER_PATH, TICKET_PATH
from layerwatch.demo.vllm_serve import GATE_DRILL_FLAGS, VLLM_DRILL_PAGES, plugin_drill
from layerwatch.mixin import config

REPO = Path(__file__).resolve().parents[1]
# The drills that restart the engine: the others (frames lost on their way) need no form in the plugin.
EVERY_RESTART = [
    (model.name, model.drill(name))
    for model in DEMO_MODELS.values()
    for name in DRILLS
    if name not in model.drills_not_run and DRILLS[name].restarts
]


@pytest.mark.parametrize("model, drill", EVERY_RESTART, ids=[f"{m}-{d.name}" for m, d in EVERY_RESTART])
def test_every_drill_has_a_plugin_form(model, drill):
    form = plugin_drill(drill.serve_flags)
    gate_flags = tuple(flag for flag in drill.serve_flags if flag in GATE_DRILL_FLAGS)
    # The faulty gates made at the τ the drill serves (SmolLM2's drills opt its gates in), or a faulty policy.
    threshold = (
        drill.serve_flags[drill.serve_flags.index("--threshold") :][:2] if "--threshold" in drill.serve_flags else ()
    )
    assert form.export_flags == (gate_flags + threshold if gate_flags else ())
    assert form.export_flags or form.settings, form


def test_the_runaway_drill_becomes_the_plugins_threshold_and_protected_layers():
    assert plugin_drill(DEMO_MODELS["smollm2"].drill("runaway").serve_flags).settings == {
        "threshold": 1.0,
        "protected_layers": [],
    }
    assert plugin_drill(("--threshold", "0.95", "--protected-layers=0,29")).settings == {
        "threshold": 0.95,
        "protected_layers": [0, 29],
    }
    assert plugin_drill(("--threshold", "0.3", "--patience", "1")).settings == {"threshold": 0.3, "patience": 1}


def test_a_serve_flag_without_a_plugin_form_is_named():
    with pytest.raises(ValueError, match="--shadow-rate has no form"):
        plugin_drill(("--shadow-rate", "0"))


def test_every_drill_notifies_on_vllm_where_its_alerts_severity_routes():
    assert set(VLLM_DRILL_PAGES) == set(DRILLS)
    specs = {spec.name: spec for spec in ALERTS}
    route = {config.SEVERITY_PAGE: PAGER_PATH, config.SEVERITY_TICKET: TICKET_PATH}
    for name, drill in DRILLS.items():
        assert route[specs[drill.page].severities[-1]] == drill.receiver, name
        assert route[specs[VLLM_DRILL_PAGES[name]].severities[-1]] == drill.receiver, name


def test_the_embedded_model_is_refused_on_vllm(tmp_path):
    demo = subprocess.run(
        [*LAYERWATCH_COMMAND, "demo", "--engine", "vllm", "--model", "demo", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert demo.returncode == 2 and "serves a checkpoint folder, not the embedded demo model" in demo.stderr


@pytest.mark.skipif(
    os.environ.get("LAYERWATCH_VLLM_DEMO") != "1"
    or not (REPO / ".venv-vllm/bin/python").is_file()
    or not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")),
    reason="opt-in (LAYERWATCH_VLLM_DEMO=1): starts vLLM twice; needs .venv-vllm, Prometheus and Alertmanager",
)
def test_the_static_drill_pages_on_vllm(tmp_path):
    page = VLLM_DRILL_PAGES["static"]
    argv = [*LAYERWATCH_COMMAND, "demo", "--engine", "vllm", "--drill", "static", "--baseline", "60"]
    argv += ["--duration", "900", "--interval", "5", "--workdir", str(tmp_path)]
    for flag in ("--port", "--exporter-port", "--prometheus-port", "--alertmanager-port"):
        argv += [flag, str(free_port())]
    demo = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines: list[str] = []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # until the page, or the demo's end at --duration
            lines.append(line)
            if f"PAGED {page}" in line:
                break
        demo.terminate()  # SIGTERM: the demo stops every process it started and says the time to page
        rest, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    text = "".join(lines)
    injected = text.find("fault injected")
    baseline = text[:injected]
    # At the profile's τ 0 nothing is below τ: no skipping to call static or dynamic (layerwatch/routing.py).
    assert "vllm serve" in baseline and "routing: withheld" in baseline, baseline[-3000:]
    # The load goes through vLLM's quality guard, whose checks the screen reads from Prometheus.
    assert "vllm-guard (API)" in baseline and re.search(r"shadow agreement +[01]\.\d{3}", baseline), baseline[-3000:]
    assert not re.search(r"ago +pager", baseline), baseline[-3000:]  # the healthy baseline pages nothing
    assert f"PAGED {page}" in text, text[-3000:]
    assert f"drill static: {page} paged" in rest and "stopped every process it started" in rest, rest
    assert (tmp_path / "drill-gates.safetensors").is_file()  # the plugin served the drill's gate file
