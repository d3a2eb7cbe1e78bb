"""`layerwatch generate [--check]` and the metric-name check that guards every generated query."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from layerwatch import catalog
from layerwatch.alerts.specs import PER_MODEL_ALERTS
from layerwatch.cli.main import COMMANDS, build_parser, env_var_for
from layerwatch.demo.processes import LAYERWATCH_COMMAND
from layerwatch.deploy import artifacts
from layerwatch.promql import UnknownMetricError, check_queries, known_series, metric_names

from .conftest import REPO, run_tool


def layerwatch(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAYERWATCH_COMMAND, "generate", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """A repository root holding only the profiles: what generation reads."""
    shutil.copytree(REPO / "layerwatch" / "alerts" / "profiles", tmp_path / "layerwatch" / "alerts" / "profiles")
    return tmp_path


def test_committed_files_are_up_to_date() -> None:
    result = layerwatch("--check")
    assert result.returncode == 0, result.stderr


def test_generate_writes_everything_then_check_passes(tree: Path) -> None:
    assert layerwatch("--root", tree, "--check").returncode == 1  # nothing written yet
    result = layerwatch("--root", tree)
    assert result.returncode == 0, result.stderr
    for path in artifacts.generated_files(tree):
        assert (tree / path).is_file(), path
    assert layerwatch("--root", tree, "--check").returncode == 0
    assert layerwatch("--root", tree).stdout == ""  # nothing changed: nothing rewritten


def test_check_names_each_stale_and_leftover_file(tree: Path) -> None:
    layerwatch("--root", tree)
    (tree / artifacts.DASHBOARD_PATH).write_text("{}\n")
    (tree / "layerwatch" / "alerts" / "generated" / "old.rules.yaml").write_text("groups: []\n")
    result = layerwatch("--root", tree, "--check")
    assert result.returncode == 1
    assert f"stale: {artifacts.DASHBOARD_PATH}" in result.stderr
    assert "layerwatch/alerts/generated/old.rules.yaml (not generated any more" in result.stderr
    assert artifacts.RULES_PATH not in result.stderr


def test_a_profile_change_makes_the_rules_stale(tree: Path) -> None:
    layerwatch("--root", tree)
    profile = tree / "layerwatch" / "alerts" / "profiles" / "reference.yaml"
    profile.write_text(profile.read_text().replace("runaway_skip_ratio: 0.85", "runaway_skip_ratio: 0.9"))
    result = layerwatch("--root", tree, "--check")
    assert result.returncode == 1 and f"stale: {artifacts.RULES_PATH}" in result.stderr


def test_broken_profile_fails_with_a_clear_message(tree: Path) -> None:
    profile = tree / "layerwatch" / "alerts" / "profiles" / "reference.yaml"
    profile.write_text(profile.read_text().replace("threshold: 0.18", "threshold: 18"))
    result = layerwatch("--root", tree)
    assert result.returncode == 2
    assert "reference.yaml: threshold: 18.0 is outside [0, 1]" in result.stderr
    assert not (tree / artifacts.RULES_PATH).exists()


LONGEST_DURATION = "2562047h47m16s854ms"  # 2^63 - 1 ns, Prometheus' longest (layerwatch/alerts/durations.py)


def edit_profile(tree: Path, **changes: object) -> Path:
    path = tree / "layerwatch" / "alerts" / "profiles" / "reference.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **changes}))
    return path


def test_rules_at_prometheus_limits_pass_promtool(tree: Path, promtool: str) -> None:
    edit_profile(
        tree,
        model_name="m" * 255,  # the longest a gate frame carries
        drift={"limit": 0.18, "window": LONGEST_DURATION},
        **{"for": {spec.name: LONGEST_DURATION for spec in PER_MODEL_ALERTS}},
    )
    assert layerwatch("--root", tree).returncode == 0
    result = run_tool(promtool, "check", "rules", tree / artifacts.RULES_PATH)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "changes, problem",
    [
        # Unchecked, generation exits 0 and writes rules promtool refuses.
        ({"model_name": "layerwatch-demo\n"}, "model_name: 'layerwatch-demo\\n' must match"),
        (
            {"drift": {"limit": 0.18, "window": "1000000000000000d"}},
            "drift: window: '1000000000000000d' is out of range",
        ),
        ({"for": {"LayerwatchEntropyDrift": "1000000000000000d"}}, "is out of range: Prometheus durations are at most"),
        ({"drift": {"limit": 0.18, "window": "106752d"}}, "drift: window: '106752d' is out of range"),  # one day over
        ({"model_name": "m" * 256}, "must match"),  # longer than a gate frame carries: no series would match
        # PromQL cannot read it
        ({"bimodality": {"min_observations": 10**400}}, "bimodality: min_observations: an integer of 401 digits"),
    ],
)
def test_generate_refuses_what_prometheus_would(tree: Path, changes: dict, problem: str) -> None:
    path = edit_profile(tree, **changes)
    result = layerwatch("--root", tree)
    assert result.returncode == 2, result.stdout
    assert f"layerwatch generate: {path}: " in result.stderr and problem in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tree / artifacts.RULES_PATH).exists()


@pytest.mark.parametrize(
    "rewrite, problem",
    [
        # Unchecked, the first two crash generation with a traceback; the third is last-wins.
        (lambda _: "model_name: café\n".encode("latin-1"), "not UTF-8 text (byte 15)"),
        (lambda _: b"model_name: " + b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (lambda original: original + b"\nthreshold: 0.5\n", "found key 'threshold' twice"),
    ],
    ids=["latin-1", "5000-deep", "duplicate-key"],
)
def test_an_unreadable_profile_fails_generation_naming_the_file(tree: Path, rewrite, problem: str) -> None:
    path = tree / "layerwatch" / "alerts" / "profiles" / "reference.yaml"
    path.write_bytes(rewrite(path.read_bytes()))
    result = layerwatch("--root", tree)
    assert result.returncode == 2, result.stdout
    assert f"layerwatch generate: {path}: cannot read profile: " in result.stderr and problem in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_never_imports_torch() -> None:
    code = (
        "import sys; from layerwatch.cli.main import main; rc = main(['generate', '--check']); "
        "assert 'torch' not in sys.modules and 'inference_shim' not in sys.modules; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr


# --- the metric-name check -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr, names",
    [
        ('sum by (job) (up{job="x"}) > 0', {"up"}),
        (
            'histogram_quantile(0.95, sum by (le) (rate(a_bucket{model_name=~"$model"}[$__rate_interval])))',
            {"a_bucket"},
        ),
        ('avg by (layer) (label_replace(x:y:z{a="b"}, "layer", "0$1", "layer", "([0-9])"))', {"x:y:z"}),
        ("a / on (job, instance) group_right b * 1e3", {"a", "b"}),
        ("sum(rate(x[5m])) by (le) and bool y unless z offset 1h", {"x", "y", "z"}),
        ("stddev_over_time(m[10m:1m]) > 0.18 or vector(1)", {"m"}),
        ("count(x) without (a, b)", {"x"}),
    ],
)
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_check_catches_a_bogus_metric() -> None:
    known = known_series(set())
    check_queries([("fine", "rate(layerwatch_fallbacks_total[5m])")], known)
    with pytest.raises(UnknownMetricError, match="panel X: layerwatch_fallback_total"):
        check_queries([("panel X", "rate(layerwatch_fallback_total[5m])")], known)


def test_generation_fails_when_a_panel_reads_an_undefined_metric(monkeypatch, tree: Path) -> None:
    """Drop a metric from the catalog: the dashboard panels that read it must stop generation."""
    real = catalog.all_series_names
    monkeypatch.setattr(catalog, "all_series_names", lambda: real() - {"layerwatch_time_to_first_token_seconds_bucket"})
    with pytest.raises(UnknownMetricError) as err:
        artifacts.generated_files(tree)
    assert "dashboard panel 'Time to first token'" in str(err.value)
    assert "layerwatch_time_to_first_token_seconds_bucket" in str(err.value)


def test_generation_fails_when_a_rule_reads_an_undefined_metric(monkeypatch, tree: Path) -> None:
    real = catalog.all_series_names
    monkeypatch.setattr(catalog, "all_series_names", lambda: real() - {"layerwatch_entropy_dip"})
    with pytest.raises(UnknownMetricError, match=r"rule LayerwatchEntropyShapeChanged \(annotation\)"):
        artifacts.generated_files(tree)


# --- docs/flags.md -------------------------------------------------------------------------------


def _command_section(page: str, command: str) -> str:
    start = page.index(f"## `layerwatch {command}`\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end >= 0 else len(page)]


def _variable_by_the_pages_rule(row: str) -> str | None:
    """The header's rule: a flag's first long name, upper case, `-` as `_`, after `LAYERWATCH_`."""
    names = row.split("`")[1].split(" ")[0].split(",")
    longs = [n for n in names if n.startswith("--")]
    return "LAYERWATCH_" + longs[0][2:].upper().replace("-", "_") if longs else None


def test_no_flag_row_repeats_its_default_in_its_meaning() -> None:
    """The default column states a default; the meaning does not say it again as "(default X)"."""
    page = (REPO / artifacts.FLAGS_DOC_PATH).read_text()
    for row in (line for line in page.splitlines() if line.startswith("| `")):
        _, default, meaning = (cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:4])
        if default.startswith("`"):
            value = re.escape(default.strip("`"))
            assert not re.search(rf"[(;] ?default:? {value}\)", meaning), row


def test_the_flags_page_states_the_environment_rule_once() -> None:
    page = (REPO / artifacts.FLAGS_DOC_PATH).read_text()
    assert "`--some-flag`" in page and "`LAYERWATCH_SOME_FLAG`" in page.split("\n## ")[0]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_flags_page_lists_every_flag_of_every_command(command: str) -> None:
    """Each flag of the parser `layerwatch <command>` really parses with (environment applied to none)
    has a row of the command's section, and the page's rule gives the environment variable it reads."""
    page = (REPO / artifacts.FLAGS_DOC_PATH).read_text()
    rows = [line for line in _command_section(page, command).splitlines() if line.startswith("| `")]
    parser = build_parser([command], environ={})
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    actions = [a for a in subparsers.choices[command]._actions if a.dest not in ("help", "_module")]
    assert actions, command
    for action in actions:
        name = action.option_strings[0] if action.option_strings else action.metavar or action.dest
        row = [r for r in rows if r.startswith(f"| `{name} ") or r.startswith(f"| `{name}`")]
        assert row, f"{command} {name} missing from {artifacts.FLAGS_DOC_PATH}"
        assert _variable_by_the_pages_rule(row[0]) == env_var_for(action), row[0]
        if (same := re.search(r"\| as `([a-z-]+)` \|$", row[0])) is not None:  # explained on that command's row
            assert row[0].split(" | ")[0] in _command_section(page, same[1]), row[0]
    assert len(rows) == len(actions), f"{command}: the page lists flags the command does not have"
